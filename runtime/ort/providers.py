"""Execution providers: onnxruntime's own `providers=` convention, with defaults that fit a model.

`providers` is what `onnxruntime.InferenceSession` takes: names, or (name, options) pairs, in
priority order. Short aliases are accepted too ("cpu", "cuda", "tensorrt"/"trt"). Without an
explicit choice the order is TensorRT, CUDA, CPU, keeping those the installed onnxruntime offers
and the model's graph is built for: an entry point's `provider` field in the manifest is "any"
or a comma-separated list of provider names (the fp32 GroupQueryAttention graph says
"CPUExecutionProvider" because ORT's CUDA GQA kernel is fp16/bf16 only, and TensorRT does not
import GQA at all).

TensorRT gets an engine cache next to the model, fp16 when the export is fp16, and one shape
profile per entry point (step: S = 1; verify: S = 1..max_verify_len), KV buffers at capacity.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import onnxruntime as ort

from . import manifest as mf
from .graph_io import ATTENTION_MASK, INPUT_IDS, LOGIT_ROWS, past_key_name, past_value_name
from ..errors import ProviderError

TENSORRT = "TensorrtExecutionProvider"
CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
DEFAULT_ORDER = (TENSORRT, CUDA, CPU)
ALIASES = {"cpu": CPU, "cuda": CUDA, "tensorrt": TENSORRT, "trt": TENSORRT}
TRT_CACHE_DIR = "trt_cache"  # inside the model directory

ProviderSpec = str | tuple[str, dict[str, Any]]


def available_providers() -> list[str]:
    return list(ort.get_available_providers())


@dataclasses.dataclass(frozen=True)
class ProviderChoice:
    """Execution providers chosen once (a load of a target and its draft, a command line): the
    caller's names, checked against this onnxruntime, with the caller's options; or, when the
    caller named none (`explicit` False), the default order among those available. Each model
    directory then gets its own defaults from it (`for_model`): the providers its graph is
    built for, TensorRT's profiles and engine cache."""

    chosen: tuple[tuple[str, dict[str, Any]], ...]
    explicit: bool

    def for_model(self, manifest: mf.Manifest | None = None,
                  model_dir: str | Path | None = None) -> list[tuple[str, dict[str, Any]]]:
        """(name, options) pairs for `InferenceSession(providers=...)`, best first."""
        chosen = list(self.chosen)
        if not self.explicit:
            wanted = _graph_providers(manifest)
            chosen = [(name, options) for name, options in chosen if name in wanted] or [(CPU, {})]
        return [(name, _with_defaults(name, options, manifest, model_dir)) for name, options in chosen]


def choose_providers(providers: "Sequence[ProviderSpec] | str | ProviderChoice | None" = None
                     ) -> ProviderChoice:
    """The caller's `providers` checked once against this onnxruntime (a `ProviderChoice` passes
    through). Raises ProviderError when an explicitly requested provider is not offered,
    naming the ones that are."""
    if isinstance(providers, ProviderChoice):
        return providers
    available = available_providers()
    if providers is None:
        return ProviderChoice(tuple((name, {}) for name in DEFAULT_ORDER if name in available),
                              explicit=False)
    chosen = [_parse_one(p, available) for p in _as_list(providers)]
    if not chosen:
        raise ProviderError(f"providers=[] names no execution provider; available: "
                            f"{', '.join(available)}")
    return ProviderChoice(tuple(chosen), explicit=True)


def resolve_providers(
    providers: "Sequence[ProviderSpec] | str | ProviderChoice | None" = None,
    *,
    manifest: mf.Manifest | None = None,
    model_dir: str | Path | None = None,
) -> list[tuple[str, dict[str, Any]]]:
    """(name, options) pairs for `InferenceSession(providers=...)`, best first:
    `choose_providers(providers).for_model(manifest, model_dir)`.

    Raises ProviderError when an explicitly requested provider is not offered by this
    onnxruntime, naming the ones that are.
    """
    return choose_providers(providers).for_model(manifest, model_dir)


def kv_device(providers: Sequence[tuple[str, dict[str, Any]]]) -> tuple[str, int]:
    """Where the KV buffers live: ('cuda', device_id) for TensorRT/CUDA first, else ('cpu', 0)."""
    name, options = providers[0]
    if name in (TENSORRT, CUDA):
        return "cuda", int(options.get("device_id", 0))
    return "cpu", 0


def default_kv_mode(providers: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """"shared" (past and present bound to one buffer, updated in place) unless TensorRT runs
    the graph: its engines make no promise about an input aliasing an output ("ping-pong")."""
    return "ping-pong" if providers[0][0] == TENSORRT else "shared"


def _as_list(providers: Sequence[ProviderSpec] | str) -> list[ProviderSpec]:
    if isinstance(providers, str):
        return [providers]
    if isinstance(providers, tuple) and len(providers) == 2 and isinstance(providers[1], dict):
        return [providers]  # a single (name, options) pair
    try:
        return list(providers)
    except TypeError:
        raise ProviderError(f"providers must be a list of names or (name, options) pairs, got "
                            f"{type(providers).__name__}") from None


def _parse_one(p: ProviderSpec, available: list[str]) -> tuple[str, dict[str, Any]]:
    if isinstance(p, str):
        name, options = p, {}
    elif isinstance(p, (tuple, list)) and len(p) == 2 and isinstance(p[0], str) \
            and isinstance(p[1], dict):
        name, options = p[0], dict(p[1])
    else:
        raise ProviderError(f"provider entry {p!r} is neither a name nor a (name, options) pair")
    name = ALIASES.get(name.lower(), name)
    if name not in available:
        raise ProviderError(f"execution provider {name!r} is not available in this onnxruntime "
                            f"({ort.__version__}); available: {', '.join(available)}")
    return name, options


def _graph_providers(manifest: mf.Manifest | None) -> set[str]:
    """Providers every entry point's graph is built for ("any" means all of them)."""
    wanted = set(DEFAULT_ORDER)
    if manifest is None:
        return wanted
    for entry in manifest.entry_points.values():
        if entry.provider != "any":
            wanted &= {ALIASES.get(n.strip().lower(), n.strip()) for n in entry.provider.split(",")}
    return wanted


def _with_defaults(name: str, options: dict[str, Any], manifest: mf.Manifest | None,
                   model_dir: str | Path | None) -> dict[str, Any]:
    if name != TENSORRT or manifest is None:
        return dict(options)
    defaults: dict[str, Any] = {
        "trt_engine_cache_enable": True,
        "trt_timing_cache_enable": True,
        "trt_fp16_enable": manifest.dtype == "fp16",
        **tensorrt_profiles(manifest),
    }
    if model_dir is not None:
        cache = str(Path(model_dir) / TRT_CACHE_DIR)
        defaults["trt_engine_cache_path"] = cache
        defaults["trt_timing_cache_path"] = cache
    return {**defaults, **options}  # what the caller passed wins


def tensorrt_profiles(manifest: mf.Manifest) -> dict[str, str]:
    """trt_profile_{min,opt,max}_shapes: profile 1 is the step (S = 1), profile 2 the verify
    call (S = 1..max_verify_len); the mask covers 1..capacity, logit_rows 1..S, the KV buffers
    are at capacity."""
    a = manifest.architecture
    kv = f"1x{a.num_kv_heads}x{manifest.capacity}x{a.head_dim}"
    kv_names = [n for i in range(a.num_layers)
                for n in (past_key_name(i), past_value_name(i))]

    def shapes(s: int, total: int) -> list[str]:  # logit_rows: the call's N <= S rows
        return [f"{INPUT_IDS}:1x{s}", f"{ATTENTION_MASK}:1x{total}",
                f"{LOGIT_ROWS}:{s}", *(f"{n}:{kv}" for n in kv_names)]

    step = manifest.entry_points["step"]
    verify = manifest.entry_points["verify"]
    cap = manifest.capacity
    mins = shapes(step.min_len, 1) + shapes(verify.min_len, 1)
    opts = shapes(1, cap // 2) + shapes(verify.max_len, cap // 2)
    maxs = shapes(step.max_len, cap) + shapes(verify.max_len, cap)
    return {"trt_profile_min_shapes": ",".join(mins), "trt_profile_opt_shapes": ",".join(opts),
            "trt_profile_max_shapes": ",".join(maxs)}
