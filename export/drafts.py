"""Self-speculative drafts: a cheaper model made from the target's own checkpoint and exported
beside it, so speculative decoding needs no second checkpoint and shares the tokenizer.

    <target>/manifest.json     extra["drafts"] = ["drafts/int4", ...]; the first is the one
                               `load_model(target, draft=True)` pairs with the target
    <target>/drafts/int4/      a complete model directory: manifest.json (draft_of ".."),
                               model.onnx, model.onnx.data, tokenizer.json (the target's, copied)

Two ways to make a draft cheaper, combinable (`DraftOptions.name`: "int4", "layers8",
"layers8-int4"):

- quant "int4": every linear weight (q, k, v, o, gate, up, down) as `MatMulNBits`, 4 bits in
  blocks of 32 (the "block-min" scheme of quantize.py), and the LM head at 8 bits (symmetric),
  its bytes shared by a tied embedding's `GatherBlockQuantized`; the kernels round activations
  to int8 (accuracy_level 4). From the default Q4_1 GGUF the 4-bit blocks are the file's own
  and the 8-bit table is its Q8_0 embedding, so the draft multiplies by the target's very
  weights and differs from it only by the int8 activations (see QUANTS for the measurements).
- layers N: the first N decoder layers, then the target's final norm and LM head (an early
  exit; the model was not trained for it, so agreement falls quickly as N shrinks).

Validation before a draft is written (`build_draft`):

- its step and verify entry points agree within the target's bound (fp32: 1e-4, or 4e-6 of
  the logit scale); for int4, a looser one (see `QUANT_TOLERANCES`);
- its logits match a PyTorch reference: the checkpoint run through its first N layers (the
  target's bound: the layer-skip graph is exact), with the draft's dequantized weights
  swapped in for int4 (that reference has float activations, so the bound is a share of the
  logit scale, not float32 rounding);
- its top-1 agreement with the target, teacher-forced on the validation prompt, is recorded in
  its manifest (extra["agreement"]["top1"]). A quantized draft must also agree with its
  unquantized equivalent (the same depth in float) on at least `MIN_AGREEMENT` of the
  positions, or the export fails: a broken graph agrees on ~1/vocab of them. Agreement with
  the target has no floor: a shallow layer-skip draft may honestly agree little, and its graph
  is checked exactly anyway.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np

from ortspec.runtime.ort import manifest as mf
from ortspec.runtime.check.tolerances import TOLERANCES, Bound, Tolerances
from ortspec.runtime.errors import ExportError, ManifestError
from ortspec.runtime.validation import check_int

from .attention import attention_op
from .errors import ExportOptionError
from .graph_spec import QUANTS, DecoderSpec, GraphOptions, WeightQuant
from .graphs import build_decoder
from .quantize import quantize_blockwise, quantize_q4gemm
from .validate import check_logits, run_graph, validation_prompt

DRAFTS_DIR = "drafts"
DRAFT_OF = ".."  # a draft's manifest names its target relative to itself
DRAFT_REVISION = 3  # bumped whenever a draft's graph changes; ensure_default_draft re-exports
MIN_AGREEMENT = 0.3  # of a quantized draft with its target, on the validation prompt
LINEAR = ("q", "k", "v", "o", "gate", "up", "down")

# A quantized graph's bounds, as shares of the logit scale (max |logit| of the reference).
# The reference already multiplies by the dequantized weights, so what is left is the kernels'
# rounding of each 32-block of activations to int8 (accuracy_level 4), which the float
# reference does not do, and which onnxruntime does differently at one token (step) than at
# several (verify). Measured, max |difference| / scale, step vs verify and vs the reference:
# SmolLM2-135M 3.6% and 5.0%; the tiny test Llama 0.0% and 2.2%, Qwen2 0.0% and 1.6%. With
# float activations (accuracy_level 0) the same graphs match the reference to 6e-6 of the
# scale, so the packing itself is exact. Bounds: about 3x the largest measured; a wrong
# packing or zero point moves logits by the whole scale.
QUANT_TOLERANCES = Tolerances(step_vs_verify=Bound(1e-4, 0.1), vs_pytorch=Bound(1e-3, 0.15))


class DraftOptionError(ExportOptionError):
    """A draft option is out of range (raised before anything is read or written)."""


@dataclasses.dataclass(frozen=True)
class DraftOptions:
    quant: str | None = None  # a key of QUANTS
    layers: int | None = None  # keep the first N decoder layers

    @property
    def name(self) -> str:
        """The draft's directory name under drafts/: "int4", "layers8", "layers8-int4"."""
        parts = ([f"layers{self.layers}"] if self.layers is not None else []) + \
            ([self.quant] if self.quant is not None else [])
        return "-".join(parts)

    @property
    def weight_quant(self) -> WeightQuant | None:
        return None if self.quant is None else QUANTS[self.quant]

    def record(self, of_layers: int) -> dict:
        """The manifest's extra["draft"]."""
        q = self.weight_quant
        return {"name": self.name, "revision": DRAFT_REVISION,
                "layers": self.layers if self.layers is not None else of_layers,
                "of_layers": of_layers, "quant": self.quant,
                "weight_quant": None if q is None else dataclasses.asdict(q)}


def draft_options(quant: str | None, layers: int | None, *, attention: str = "gqa") -> \
        DraftOptions | None:
    """Check the draft options that need no checkpoint; None when no draft is asked for."""
    if quant is not None and quant not in QUANTS:
        raise DraftOptionError(f"draft_quant must be one of {', '.join(QUANTS)} or None, got "
                               f"{quant!r}")
    if layers is not None:
        layers = check_int("draft_layers", layers, minimum=1, error=DraftOptionError,
                           what=" (and at most the model's layer count)")
    if quant is not None and attention == "standard":
        raise DraftOptionError(f"a {quant} draft uses onnxruntime's MatMulNBits (a "
                               f"com.microsoft op), which needs attention='gqa' or 'window'; a "
                               f"layer-skip draft (draft_layers) works with {attention!r}")
    if quant is None and layers is None:
        return None
    return DraftOptions(quant=quant, layers=layers)


def check_draft_layers(options: DraftOptions, num_layers: int) -> None:
    """Once the model's layer count is known: 1 <= layers <= num_layers, and a full-depth
    draft only when quantized (otherwise it would be the target itself)."""
    if options.layers is None:
        return
    if not 1 <= options.layers <= num_layers:
        raise DraftOptionError(f"draft_layers must be in 1..{num_layers} (the model has "
                               f"{num_layers} layers), got {options.layers}")
    if options.layers == num_layers and options.quant is None:
        raise DraftOptionError(f"draft_layers={num_layers} keeps every layer: without "
                               f"draft_quant that draft is the target itself; use "
                               f"1..{num_layers - 1}")


def build_draft(directory: Path, checkpoint, target: mf.Manifest, options: DraftOptions, *,
                target_dir: Path, attention: str, opset: int,
                on_layer=None) -> mf.Manifest:
    """Write a validated draft model directory into `directory` (which exists and is empty)
    from the target's checkpoint; `target_dir` holds the target's tokenizer file. Raises
    ExportError when validation fails (the caller removes the directory)."""
    started = time.perf_counter()
    spec: DecoderSpec = checkpoint.spec
    check_draft_layers(options, spec.num_layers)
    if spec.architecture() != target.architecture:
        raise ExportError(f"the checkpoint's architecture {spec.architecture()} is not the "
                          f"target's {target.architecture}")
    draft_spec = spec if options.layers is None else \
        dataclasses.replace(spec, num_layers=options.layers)
    graph = target.entry_points["step"].graph
    data = graph + ".data"
    gopts = GraphOptions(capacity=target.capacity, dtype=target.dtype, opset=opset,
                         attention=attention, quant=options.weight_quant)
    cos, sin = checkpoint.rope_tables(target.capacity)
    files = build_decoder(draft_spec, gopts, checkpoint.weight, cos, sin,
                          graph_path=directory / graph, data_path=directory / data,
                          on_layer=on_layer,
                          local_rope=checkpoint.local_rope_tables(target.capacity))
    shutil.copyfile(mf.safe_member(target_dir, target.tokenizer, what="manifest.tokenizer"),
                    directory / target.tokenizer)
    manifest = dataclasses.replace(
        target, architecture=draft_spec.architecture(), files={}, draft_of=DRAFT_OF,
        # a draft's rows need not equal its steps for the output to follow the target (q is
        # what it computed); the batched flavour's are padded as its target's are, so that a
        # row drafts the same whatever shares its call, and a seeded request repeats its solo
        # run (export/api.py's min_call_rows)
        min_call_rows=2 if attention == "window" else 1, min_attention_rows=1, row_probe=None,
        extra={"exporter_revision": target.extra.get("exporter_revision"),
               "draft": options.record(spec.num_layers),
               "attention": attention_op(attention, files.op_types), "opset": opset,
               "tied_embeddings": spec.tied_embeddings, "weight_bytes": files.weight_bytes,
               "quantized_weights": len(files.quantized),
               "float_linear_weights": list(files.float_linear)})

    ids = validation_prompt(checkpoint, capacity=target.capacity,
                            max_verify_len=target.max_verify_len)
    verify, step = run_graph(directory, manifest, ids)
    reference = checkpoint.torch_logits(ids, num_layers=options.layers,
                                        replace=dequantized_weights(checkpoint, draft_spec, gopts))
    tol = TOLERANCES[target.dtype] if options.quant is None else QUANT_TOLERANCES
    report = check_logits(verify, step, reference, tol, f"{options.name} draft, {target.dtype}")
    agreement = {"prompt_tokens": int(ids.size),
                 "measured_on": "validation prompt, teacher-forced",
                 "top1": round(top1_agreement(verify, checkpoint.torch_logits(ids)), 4)}
    if options.quant is not None:
        # the floor judges the quantization alone: against the same depth in float
        unquantized = top1_agreement(verify, checkpoint.torch_logits(ids,
                                                                     num_layers=options.layers))
        agreement["top1_vs_unquantized"] = round(unquantized, 4)
        if unquantized < MIN_AGREEMENT:
            raise ExportError(f"validation failed: the {options.name} draft's top token agrees "
                              f"with its unquantized equivalent's on {unquantized:.0%} of the "
                              f"validation prompt, under the floor of {MIN_AGREEMENT:.0%}: a "
                              f"broken graph?")

    checksums = {name: mf.sha256_file(directory / name) for name in (graph, data,
                                                                      target.tokenizer)}
    extra = {**manifest.extra, "validation": report.as_dict(),
             "agreement": agreement,
             "export_seconds": round(time.perf_counter() - started, 2)}
    manifest = dataclasses.replace(manifest, files=checksums, extra=extra)
    manifest.write(directory)
    mf.read_manifest(directory)  # the directory as the runtime will see it
    return manifest


def dequantized_weights(checkpoint, spec: DecoderSpec, options: GraphOptions, *,
                        kernel_weights: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """Canonical name -> the weight a quantized graph computes with (what builder.py's
    `matmul_nbits` quantized, dequantized again); empty for a float graph. kernel_weights
    (GraphFiles.kernel_weights): the names stored for ortspec.Q4Gemm, whose d and m are
    float16."""
    q = options.quant
    if q is None:
        return {}
    out: dict[str, np.ndarray] = {}
    for i in range(spec.num_layers):
        for suffix in LINEAR:
            name = f"layers.{i}.{suffix}"
            w = checkpoint.weight(name)
            if name in kernel_weights:  # rows quantize independently: fusion is moot
                out[name] = quantize_q4gemm(w).dequantize()
            elif w.shape[1] % q.block_size == 0:
                out[name] = quantize_blockwise(w, bits=q.bits, block_size=q.block_size,
                                               scheme=q.scheme).dequantize()
    if q.lm_head_bits is not None and spec.hidden_size % q.block_size == 0:
        head = checkpoint.weight("embed" if spec.tied_embeddings else "lm_head")
        out["lm_head"] = quantize_q4gemm(head).dequantize() if "lm_head" in kernel_weights \
            else quantize_blockwise(head, bits=q.lm_head_bits, block_size=q.block_size,
                                    scheme=q.lm_head_scheme).dequantize()
        if q.embed_shares_head and spec.tied_embeddings:
            out["embed"] = out["lm_head"]  # the Gather reads the head's table
    return out


def top1_agreement(draft_logits: np.ndarray, target_logits: np.ndarray) -> float:
    """Share of positions where both argmaxes (lowest id on ties) agree; [n, vocab] each."""
    return float(np.mean(np.argmax(draft_logits, -1) == np.argmax(target_logits, -1)))


def list_drafts(manifest_data: dict) -> list[str]:
    drafts = (manifest_data.get("extra") or {}).get("drafts") or []
    return [d for d in drafts if isinstance(d, str)]


def with_draft_listed(manifest_data: dict, relative: str, *, first: bool = False) -> dict:
    """The manifest JSON with `relative` in extra["drafts"]: appended (or kept where it was),
    or moved to the front with `first`."""
    data = json.loads(json.dumps(manifest_data))  # a deep copy
    extra = data.setdefault("extra", {})
    drafts = list_drafts(data)
    if first and relative in drafts:
        drafts.remove(relative)
    if relative not in drafts:
        drafts.insert(0 if first else len(drafts), relative)
    extra["drafts"] = drafts
    return data


def register_draft(target_dir: Path, relative: str, *, first: bool = False) -> None:
    """List `relative` in target_dir's manifest (at the front with `first`: the draft
    `load_model(target, draft=True)` takes), atomically: a temp file renamed over it. Only
    extra["drafts"] changes; the manifest is not in `files`, so every checksum stays valid."""
    path = target_dir / mf.MANIFEST_FILE
    data = json.loads(path.read_text(encoding="utf-8"))
    drafts = list_drafts(data)
    if relative in drafts and (not first or drafts[0] == relative):
        return
    rewrite_manifest(target_dir, with_draft_listed(data, relative, first=first))


def rewrite_manifest(target_dir: Path, data: dict) -> None:
    """Replace target_dir's manifest with `data` (checked to be a valid manifest first)
    atomically: a temp file renamed over it, keeping the file's mode."""
    path = target_dir / mf.MANIFEST_FILE
    mf.parse_manifest(data)  # still a valid manifest
    tmp = path.with_name(f".{mf.MANIFEST_FILE}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        os.chmod(tmp, path.stat().st_mode & 0o777)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_target_manifest(target_dir: Path, *, adding: str) -> mf.Manifest:
    """The manifest of the export target_dir that a draft or head is `adding` to: ExportError
    when it cannot be read or is itself a draft."""
    try:
        manifest = mf.read_manifest(target_dir)
    except ManifestError as e:
        raise ExportError(f"cannot add {adding} to {target_dir}: {e}") from None
    if manifest.draft_of is not None:
        raise ExportError(f"{target_dir} is itself a draft (draft_of {manifest.draft_of!r}); "
                          f"give its target directory")
    return manifest
