"""EAGLE-3 draft heads: read a head checkpoint directory, in either of the two formats people
publish, into one normalised form (`Eagle3Head`), and check it against its target before any
work.

An EAGLE-3 head is one Llama decoder layer whose q/k/v read 2 * hidden inputs (the normed token
embedding beside the normed hidden state), an `fc` that projects the target's three
concatenated hidden states [3 * target_hidden] to [hidden], a final norm and an LM head over a
reduced *draft* vocabulary, mapped back to target token ids by `d2t`. The forward pass is in
eagle3_reference.py.

The two formats (key names and conventions read from the primary sources):

- speculators (vllm-project/speculators, `src/speculators/models/eagle3.py` and
  `convert/eagle/eagle3_converter.py`): config.json has `speculators_model_type: "eagle3"`, the
  layer's Llama config under `transformer_layer_config` (its `vocab_size` is the target's
  vocabulary), and at the top `draft_vocab_size`, `norm_before_residual`, `target_hidden_size`
  and `eagle_aux_hidden_state_layer_ids`. Weights: `fc.weight`, `layers.0.{self_attn.{q,k,v,o}
  _proj, mlp.{gate,up,down}_proj, input_layernorm, hidden_norm, post_attention_layernorm}
  .weight`, `norm.weight`, `lm_head.weight`, the buffers `d2t` (int64 [draft_vocab]) and `t2d`
  (bool [vocab]), optionally `embed_tokens.weight`.
- EAGLE / SpecForge (SafeAILab/EAGLE, sgl-project/SpecForge): config.json is a Llama config with
  `architectures: ["LlamaForCausalLMEagle3"]`, `draft_vocab_size`, and optionally
  `eagle_config.eagle_aux_hidden_state_layer_ids`. The same weights with `midlayer.` where
  speculators writes `layers.0.` (vLLM's llama_eagle3.py `load_weights` and the speculators
  converter's `parameter_mappings` both rename exactly that prefix).

Conventions (vLLM `vllm/model_executor/models/llama_eagle3.py`, `Eagle3LlamaForCausalLM.
compute_logits`; llama.cpp's `convert_hf_to_gguf.py` EAGLE-3 path keeps `d2t` and drops `t2d`
the same way):

- `d2t` holds offsets: target_id = draft_id + d2t[draft_id]. `t2d[target_id]` is True exactly for
  the target ids some draft id maps to; it is only checked here, never needed.
- Layer ids name the residual stream *entering* that target layer, the convention of
  hidden_states.py; vLLM reads a config's `eagle_aux_hidden_state_layer_ids` (top level first,
  then under `eagle_config`) without changing them, and defaults to (2, L // 2, L - 3).
- The head has its own `embed_tokens` only in some checkpoints; without one it embeds with the
  target's table (vLLM shares the target's embedding then).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from ortspec.runtime.errors import ExportError

from .hidden_states import eagle3_layers

SPECULATORS, EAGLE = "speculators", "eagle"
EAGLE_ARCHITECTURE = "LlamaForCausalLMEagle3"
LAYER_PREFIX = {SPECULATORS: "layers.0.", EAGLE: "midlayer."}

# Eagle3Head field -> checkpoint key under the layer prefix (q/k/v/o, gate/up/down: [out, in])
LAYER_KEYS = {
    "input_norm": "input_layernorm.weight",  # on the token embedding
    "hidden_norm": "hidden_norm.weight",  # on the hidden state
    "post_attn_norm": "post_attention_layernorm.weight",
    **{w: f"self_attn.{w}_proj.weight" for w in ("q", "k", "v", "o")},
    **{w: f"mlp.{w}_proj.weight" for w in ("gate", "up", "down")},
}
TOP_KEYS = {"fc": "fc.weight", "norm": "norm.weight", "lm_head": "lm_head.weight"}
OPTIONAL_KEYS = {"fc_bias": "fc.bias", "embed": "embed_tokens.weight", "d2t": "d2t", "t2d": "t2d"}


@dataclasses.dataclass(frozen=True)
class Eagle3Target:
    """What a head must fit: the target's hidden size, vocabulary and number of layers."""

    hidden_size: int
    vocab_size: int
    num_layers: int

    @classmethod
    def from_spec(cls, spec) -> Eagle3Target:
        """From the target's DecoderSpec (graph_spec.py)."""
        return cls(spec.hidden_size, spec.vocab_size, spec.num_layers)


@dataclasses.dataclass(frozen=True, eq=False)
class Eagle3Head:
    """One EAGLE-3 head, whatever format it was published in. Weights are float32 NumPy arrays,
    linear weights [out, in]; H is hidden_size, Ht target_hidden_size, D head_dim."""

    source_format: str  # SPECULATORS or EAGLE
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # the config's rope_scaling (e.g. llama3), or None
    max_position_embeddings: int
    target_hidden_size: int  # Ht: the width of each hidden state the head reads
    vocab_size: int  # the target vocabulary the head was trained with
    draft_vocab_size: int
    layer_ids: tuple[int, ...] | None  # the target layers it reads; None: (2, L // 2, L - 3)
    norm_before_residual: bool  # hidden_norm before the residual is taken (vLLM's option)
    d2t: np.ndarray | None  # [draft_vocab] int64 offsets, None when the vocabularies agree
    embed: np.ndarray | None  # [vocab, H], None: the head embeds with the target's table
    fc: np.ndarray  # [H, 3 * Ht]
    fc_bias: np.ndarray | None  # [H]: only some speculators checkpoints have one
    input_norm: np.ndarray  # [H]
    hidden_norm: np.ndarray  # [H]
    post_attn_norm: np.ndarray  # [H]
    q: np.ndarray  # [heads * D, 2H]
    k: np.ndarray  # [kv_heads * D, 2H]
    v: np.ndarray  # [kv_heads * D, 2H]
    o: np.ndarray  # [H, heads * D]
    gate: np.ndarray  # [intermediate, H]
    up: np.ndarray  # [intermediate, H]
    down: np.ndarray  # [H, intermediate]
    norm: np.ndarray  # [H]
    lm_head: np.ndarray  # [draft_vocab, H]

    @property
    def has_own_embedding(self) -> bool:
        return self.embed is not None

    def target_ids(self) -> np.ndarray:
        """The target token id of each draft id: [draft_vocab] int64."""
        ids = np.arange(self.draft_vocab_size, dtype=np.int64)
        return ids if self.d2t is None else ids + self.d2t

    def layers_for(self, num_layers: int) -> tuple[int, ...]:
        """The target layer ids the head reads on a target of `num_layers` layers."""
        return self.layer_ids if self.layer_ids is not None else eagle3_layers(num_layers)


def read_eagle3_head(directory: str | Path, *, target: Eagle3Target | None = None) -> Eagle3Head:
    """Read the head in `directory` (config.json + *.safetensors). Everything is checked from
    the config and the tensors' headers before a weight is read: the format, the numbers, every
    tensor's presence and shape, and with `target` its fit (hidden size, layer ids, embedding
    rows); then the d2t map (in the head's and the target's vocabulary, one to one, as t2d
    says). Raises ExportError naming the config key or tensor at fault."""
    directory = Path(directory)
    config = _read_config(directory)
    fmt = detect_format(config)
    numbers = _numbers(config, fmt)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ExportError(f"{directory}: no *.safetensors weights (an EAGLE-3 head is read from "
                          f"safetensors only)")
    shapes, where = _tensor_shapes(files)
    keys = _keys(fmt)
    _check_shapes(numbers, keys, shapes)
    if target is not None:
        _check_fit(numbers, target, has_embed=keys["embed"] in shapes)
    tensors = _load(where, {k for k in keys.values() if k in shapes})
    d2t = _checked_d2t(numbers, tensors, keys, target)
    weights = {field: tensors[key].astype(np.float32) for field, key in keys.items()
               if field not in ("d2t", "t2d") and key in tensors}
    return Eagle3Head(source_format=fmt, d2t=d2t, **numbers,
                      **{f: weights.get(f) for f in ("embed", "fc_bias")},
                      **{f: weights[f] for f in (*LAYER_KEYS, *TOP_KEYS)})


def check_fits(head: Eagle3Head, target: Eagle3Target) -> None:
    """Refuse a head that does not fit `target` (ExportError naming the key)."""
    numbers = {f.name: getattr(head, f.name) for f in dataclasses.fields(head)
               if f.name in _NUMBER_FIELDS}
    _check_fit(numbers, target, has_embed=head.has_own_embedding)
    if head.d2t is not None:
        _check_target_ids(head.target_ids(), target.vocab_size, "target vocabulary")


def detect_format(config: dict) -> str:
    """SPECULATORS or EAGLE from config.json's contents."""
    kind = config.get("speculators_model_type")
    if kind is not None:
        if kind != "eagle3":
            raise ExportError(f"config.json: speculators_model_type is {kind!r}; only 'eagle3' "
                              f"heads are read")
        if not isinstance(config.get("transformer_layer_config"), dict):
            raise ExportError("config.json: a speculators eagle3 config needs "
                              "transformer_layer_config (the decoder layer's Llama config)")
        return SPECULATORS
    if EAGLE_ARCHITECTURE in (config.get("architectures") or []):
        return EAGLE
    raise ExportError(f"config.json: not an EAGLE-3 head: neither speculators_model_type "
                      f"'eagle3' nor architectures [{EAGLE_ARCHITECTURE!r}] "
                      f"(architectures: {config.get('architectures')!r})")


# ---- the numbers ----

_NUMBER_FIELDS = ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                  "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings",
                  "target_hidden_size", "vocab_size", "draft_vocab_size", "layer_ids",
                  "norm_before_residual")


def _read_config(directory: Path) -> dict:
    path = directory / "config.json"
    if not path.is_file():
        raise ExportError(f"{directory}: no config.json (an EAGLE-3 head directory holds "
                          f"config.json and safetensors weights)")
    config = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(config, dict):
        raise ExportError(f"{path}: expected a JSON object")
    return config


def _numbers(config: dict, fmt: str) -> dict[str, Any]:
    """The Eagle3Head numbers from a config of format `fmt`."""
    layer = config["transformer_layer_config"] if fmt == SPECULATORS else config

    def need(key: str) -> int:
        value = layer.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ExportError(f"config.json: {key} must be a positive integer, got {value!r}")
        return value

    hidden, heads, vocab = need("hidden_size"), need("num_attention_heads"), need("vocab_size")
    for key in ("attention_bias", "mlp_bias"):
        if layer.get(key):
            raise ExportError(f"config.json: {key} is true; EAGLE-3 heads with biased "
                              f"projections are not supported")
    if layer.get("hidden_act", "silu") != "silu":
        raise ExportError(f"config.json: hidden_act {layer.get('hidden_act')!r}; the head's "
                          f"MLP is read as Llama's SiLU-gated MLP")
    kv_heads = layer.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise ExportError(f"config.json: num_attention_heads {heads} is not a multiple of "
                          f"num_key_value_heads {kv_heads}")
    rope_params = layer.get("rope_parameters") or {}  # transformers 5 writes the theta here
    rope_scaling = layer.get("rope_scaling")
    if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
        rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
    draft_vocab = config.get("draft_vocab_size") or vocab  # vLLM: absent means the full one
    if not isinstance(draft_vocab, int) or not 1 <= draft_vocab <= vocab:
        raise ExportError(f"config.json: draft_vocab_size must lie in 1..vocab_size ({vocab}), "
                          f"got {draft_vocab!r}")
    return dict(
        hidden_size=hidden, num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=layer.get("head_dim") or hidden // heads,
        intermediate_size=need("intermediate_size"),
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),  # transformers' LlamaConfig default
        rope_theta=float(layer.get("rope_theta", rope_params.get("rope_theta", 10000.0))),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(layer.get("max_position_embeddings", 2048)),
        target_hidden_size=config.get("target_hidden_size") or hidden,
        vocab_size=vocab, draft_vocab_size=draft_vocab,
        layer_ids=_layer_ids(config),
        norm_before_residual=bool(config.get("norm_before_residual", False)),
    )


def _layer_ids(config: dict) -> tuple[int, ...] | None:
    """eagle_aux_hidden_state_layer_ids at the top, else under eagle_config (vLLM's order)."""
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        return None
    if not isinstance(ids, list) or len(ids) != 3 or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ExportError(f"config.json: eagle_aux_hidden_state_layer_ids must be three layer "
                          f"ids (the fc reads three hidden states), got {ids!r}")
    return tuple(ids)


def _check_fit(numbers: dict[str, Any], target: Eagle3Target, *, has_embed: bool) -> None:
    """The config-level fit of a head to its target (the d2t check needs the tensor)."""
    if numbers["target_hidden_size"] != target.hidden_size:
        key = "target_hidden_size" if numbers["target_hidden_size"] != numbers["hidden_size"] \
            else "hidden_size"
        raise ExportError(f"config.json: {key} is {numbers['target_hidden_size']} but the "
                          f"target's hidden size is {target.hidden_size}: the head's fc reads "
                          f"three target hidden states of that width")
    if not has_embed and numbers["hidden_size"] != target.hidden_size:
        raise ExportError(f"config.json: hidden_size is {numbers['hidden_size']} and the head "
                          f"has no embed_tokens.weight: it would embed with the target's table, "
                          f"of width {target.hidden_size}")
    if has_embed and numbers["vocab_size"] < target.vocab_size:
        raise ExportError(f"EAGLE-3 head: embed_tokens.weight has {numbers['vocab_size']} rows, "
                          f"fewer than the target's vocabulary ({target.vocab_size})")
    ids = numbers["layer_ids"]
    name = "eagle_aux_hidden_state_layer_ids"
    if ids is None:
        ids, name = eagle3_layers(target.num_layers), "the default layer ids (2, L // 2, L - 3)"
    if len(set(ids)) != len(ids) or not all(1 <= i <= target.num_layers - 1 for i in ids):
        raise ExportError(f"config.json: {name} {list(ids)}: each id must lie in "
                          f"1..{target.num_layers - 1} (the state entering that layer of the "
                          f"target's {target.num_layers}), no id twice")


# ---- the tensors ----

def _keys(fmt: str) -> dict[str, str]:
    """Eagle3Head field -> the checkpoint key in format `fmt`."""
    prefix = LAYER_PREFIX[fmt]
    return {**{f: prefix + k for f, k in LAYER_KEYS.items()}, **TOP_KEYS, **OPTIONAL_KEYS}


def _expected_shapes(n: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    h, d, inter = n["hidden_size"], n["head_dim"], n["intermediate_size"]
    q, kv = n["num_heads"] * d, n["num_kv_heads"] * d
    return {"input_norm": (h,), "hidden_norm": (h,), "post_attn_norm": (h,), "norm": (h,),
            "q": (q, 2 * h), "k": (kv, 2 * h), "v": (kv, 2 * h), "o": (h, q),
            "gate": (inter, h), "up": (inter, h), "down": (h, inter),
            "fc": (h, 3 * n["target_hidden_size"]), "fc_bias": (h,),
            "lm_head": (n["draft_vocab_size"], h), "embed": (n["vocab_size"], h),
            "d2t": (n["draft_vocab_size"],), "t2d": (n["vocab_size"],)}


def _check_shapes(numbers: dict, keys: dict[str, str], shapes: dict[str, tuple]) -> None:
    expected = _expected_shapes(numbers)
    required = [*LAYER_KEYS, *TOP_KEYS]
    if numbers["draft_vocab_size"] != numbers["vocab_size"]:
        required.append("d2t")  # a reduced vocabulary needs its map back to target ids
    missing = [keys[f] for f in required if keys[f] not in shapes]
    if missing:
        raise ExportError(f"EAGLE-3 head: missing tensor(s) {missing}")
    for field, key in keys.items():
        if key in shapes and tuple(shapes[key]) != expected[field]:
            raise ExportError(f"EAGLE-3 head: tensor {key} has shape {list(shapes[key])}, the "
                              f"config implies {list(expected[field])}")


def _tensor_shapes(files: list[Path]) -> tuple[dict[str, tuple], dict[str, Path]]:
    """Every tensor's shape and file, from the safetensors headers (no weight is read)."""
    from safetensors import safe_open

    shapes, where = {}, {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                shapes[key] = tuple(f.get_slice(key).get_shape())
                where[key] = path
    return shapes, where


def _load(where: dict[str, Path], keys: set[str]) -> dict[str, np.ndarray]:
    """The named tensors as NumPy arrays (bf16 and fp16 widened to float32)."""
    import torch
    from safetensors import safe_open

    out = {}
    for path in sorted({where[k] for k in keys}):
        with safe_open(path, framework="pt") as f:
            for key in keys:
                if where[key] == path:
                    t = f.get_tensor(key)
                    out[key] = (t.float() if t.is_floating_point() else t.to(torch.int64)
                                if t.dtype != torch.bool else t).numpy()
    return out


def _checked_d2t(numbers: dict, tensors: dict[str, np.ndarray], keys: dict[str, str],
                 target: Eagle3Target | None) -> np.ndarray | None:
    """d2t as int64 offsets, checked: every mapped id in the head's vocabulary (and the
    target's), no two draft ids on one target id, and t2d, where present, marking exactly the
    mapped ids."""
    d2t = tensors.get(keys["d2t"])
    if d2t is None:
        return None
    d2t = d2t.astype(np.int64)
    ids = np.arange(numbers["draft_vocab_size"], dtype=np.int64) + d2t
    _check_target_ids(ids, numbers["vocab_size"], "head's vocab_size")
    if target is not None:
        _check_target_ids(ids, target.vocab_size, "target vocabulary")
    t2d = tensors.get(keys["t2d"])
    if t2d is not None:
        marked = np.flatnonzero(t2d.astype(bool))
        if not np.array_equal(marked, np.sort(ids)):
            raise ExportError(f"EAGLE-3 head: t2d marks {marked.size} target ids, not the "
                              f"{ids.size} that d2t maps to")
    return d2t


def _check_target_ids(ids: np.ndarray, vocab: int, what: str) -> None:
    if ids.min() < 0 or ids.max() >= vocab:
        raise ExportError(f"EAGLE-3 head: d2t maps a draft id to target id {int(ids.max())} "
                          f"(min {int(ids.min())}), outside the {what} of {vocab}")
    if np.unique(ids).size != ids.size:
        raise ExportError("EAGLE-3 head: d2t maps two draft ids to one target id")
