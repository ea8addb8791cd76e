"""Load a checkpoint with transformers (GGUF files are dequantised on load) and present it as the
graph builder wants it: a `DecoderSpec`, float32 weights under canonical names, RoPE tables.

The PyTorch model stays loaded because validation compares the exported graph against it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any

import numpy as np
import torch

from ortspec.runtime.errors import ExportError

from .graph_spec import DecoderSpec
from .sources import MODEL_TYPES, SUPPORTED, Source

# rope types whose cos/sin depend only on the position (not on the current sequence length)
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

_LAYER_NAMES = {  # canonical suffix -> Hugging Face parameter under model.layers.{i}.
    "attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
    **{w: f"self_attn.{w}_proj.weight" for w in ("q", "k", "v", "o")},
    **{f"{w}_bias": f"self_attn.{w}_proj.bias" for w in ("q", "k", "v", "o")},
    **{w: f"mlp.{w}_proj.weight" for w in ("gate", "up", "down")},
    **{f"{w}_bias": f"mlp.{w}_proj.bias" for w in ("gate", "up", "down")},
    "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
}
# Phi-3 stores q, k, v as one qkv_proj and gate, up as one gate_up_proj: canonical suffix ->
# (the fused parameter, which of its row blocks), the blocks' sizes from the DecoderSpec
_FUSED = {"q": ("self_attn.qkv_proj.weight", 0), "k": ("self_attn.qkv_proj.weight", 1),
          "v": ("self_attn.qkv_proj.weight", 2),
          "gate": ("mlp.gate_up_proj.weight", 0), "up": ("mlp.gate_up_proj.weight", 1)}
# Gemma names its four norms by place: the one before the MLP is pre_feedforward_layernorm,
# and post_attention_layernorm normalises the attention's output
_GEMMA_NORMS = {"mlp_norm": "pre_feedforward_layernorm.weight",
                "post_attn_norm": "post_attention_layernorm.weight",
                "post_mlp_norm": "post_feedforward_layernorm.weight"}
GEMMA = ("gemma2", "gemma3")


@dataclasses.dataclass
class Checkpoint:
    source: Source
    model: Any  # transformers PreTrainedModel, eval mode, float32
    tokenizer: Any  # transformers fast tokenizer
    spec: DecoderSpec

    def weight(self, name: str) -> np.ndarray | None:
        """Canonical weight name -> float32 array sharing the model's memory, or None."""
        key, rows = self._where(name)
        tensor = self._params.get(key)
        if tensor is None:
            return None
        array = tensor.detach().float().numpy()[rows]
        if self.spec.family in GEMMA and name.rsplit(".", 1)[-1].endswith("norm"):
            return array + np.float32(1.0)  # Gemma's RMSNorm multiplies by (1 + weight)
        return array

    def _where(self, name: str) -> tuple[str, slice]:
        """Canonical weight name -> (the Hugging Face parameter, the rows of it that are this
        weight: all of them except in a fused parameter)."""
        if name == "embed":
            return "model.embed_tokens.weight", slice(None)
        if name == "norm":
            return "model.norm.weight", slice(None)
        if name == "lm_head":
            return "lm_head.weight", slice(None)
        _, i, suffix = name.split(".", 2)
        if self.spec.family == "phi3" and suffix in _FUSED:
            fused, block = _FUSED[suffix]
            spec = self.spec
            q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
            sizes = (q, kv, kv) if suffix in ("q", "k", "v") else (spec.intermediate_size,) * 2
            start = sum(sizes[:block])
            return f"model.layers.{i}.{fused}", slice(start, start + sizes[block])
        if self.spec.family in GEMMA and suffix in _GEMMA_NORMS:
            return f"model.layers.{i}.{_GEMMA_NORMS[suffix]}", slice(None)
        return f"model.layers.{i}.{_LAYER_NAMES[suffix]}", slice(None)

    def rope_tables(self, capacity: int, *, layer_type: str | None = None) -> \
            tuple[np.ndarray, np.ndarray]:
        """cos, sin: [capacity, rotary_dim // 2] float32, computed by the model's own RoPE
        module (for `layer_type`'s parameters where the model has one set per layer type)."""
        rotary = self.model.model.rotary_emb
        positions = torch.arange(capacity, dtype=torch.int64)[None]  # [1, capacity]
        args = () if layer_type is None else (layer_type,)
        if layer_type is None and self.spec.family == "gemma3":  # one module per layer type
            args = ("full_attention",)
        with torch.no_grad():
            cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions, *args)
        half = cos.shape[-1] // 2  # rotary_dim / 2 (head_dim / 2 unless the rotary is partial)
        # the module returns cat(freqs, freqs) (rotate-half layout); GQA wants one half
        return cos[0, :, :half].numpy().copy(), sin[0, :, :half].numpy().copy()

    def local_rope_tables(self, capacity: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The sliding layers' own cos, sin (Gemma 3's local base), or None."""
        if not self.spec.local_rope:
            return None
        return self.rope_tables(capacity, layer_type="sliding_attention")

    def torch_logits(self, ids: np.ndarray, *, num_layers: int | None = None,
                     replace: dict[str, np.ndarray] | None = None) -> np.ndarray:
        """Reference logits for ids [n], one forward pass: [n, vocab] float32.

        num_layers: run only the first N decoder layers (then the final norm and the LM head),
        the reference of a layer-skip draft. replace: canonical weight name -> float32 array
        used instead of the checkpoint's for this call (a quantized draft's dequantized
        weights; "lm_head" unties a tied head). The model is restored afterwards either way.
        """
        with torch.no_grad(), self._truncated(num_layers), self.replaced(replace or {}):
            out = self.model(torch.as_tensor(ids, dtype=torch.int64)[None], use_cache=False)
        return out.logits[0].float().numpy()

    @contextlib.contextmanager
    def _truncated(self, num_layers: int | None):
        config = self.model.config
        full = config.num_hidden_layers
        if num_layers is None or num_layers == full:
            yield
            return
        if not 1 <= num_layers <= full:
            raise ValueError(f"num_layers must be in 1..{full}, got {num_layers}")
        config.num_hidden_layers = num_layers  # the model runs self.layers[:num_hidden_layers]
        try:
            yield
        finally:
            config.num_hidden_layers = full

    @contextlib.contextmanager
    def replaced(self, weights: dict[str, np.ndarray]):
        """The model computing with `weights` (canonical name -> float32 array) instead of
        the checkpoint's while the block runs (see torch_logits' replace)."""
        saved: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        head = self.model.lm_head
        tied_head = head.weight  # restored as the very Parameter, so a tied head is tied again
        try:
            for name, array in weights.items():
                tensor = torch.from_numpy(np.ascontiguousarray(array, np.float32))
                if name == "lm_head":
                    head.weight = torch.nn.Parameter(tensor, requires_grad=False)
                    continue
                key, rows = self._where(name)
                param = self._params[key]
                current = param.data[rows]
                if tuple(current.shape) != tuple(tensor.shape):
                    raise ValueError(f"{name}: replacement of shape {tuple(tensor.shape)} for a "
                                     f"weight of shape {tuple(current.shape)}")
                saved.append((param, param.data))
                if rows == slice(None):
                    param.data = tensor
                else:  # a block of a fused parameter: a copy with those rows replaced
                    whole = param.data.clone()
                    whole[rows] = tensor
                    param.data = whole
            yield
        finally:
            for param, data in reversed(saved):
                param.data = data
            head.weight = tied_head

    def __post_init__(self):
        self._params = dict(self.model.named_parameters())


def load_checkpoint(source: Source, *, capacity: int, progress: bool = True) -> Checkpoint:
    """The PyTorch model (float32) and tokenizer of a materialised source."""
    import transformers  # heavy; imported only when an export really runs

    kwargs: dict[str, Any] = {}
    if source.gguf_file is not None:
        kwargs["gguf_file"] = source.gguf_file
    directory = str(source.directory)
    try:
        with _quiet(not progress):
            config = transformers.AutoConfig.from_pretrained(directory, **kwargs)
            if source.gguf_file is not None:
                check_gguf_config(source.path, config, capacity=capacity)
            check_config(config, capacity=capacity)
            tokenizer = transformers.AutoTokenizer.from_pretrained(directory, **kwargs)
            model = transformers.AutoModelForCausalLM.from_pretrained(
                directory, dtype=torch.float32, **kwargs)
    except ExportError:
        raise
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise ExportError(f"transformers could not load {source.path}: {e}") from e
    model.eval()
    if not getattr(tokenizer, "is_fast", False) or not hasattr(tokenizer, "backend_tokenizer"):
        raise ExportError(f"{source.path}: needs a fast (tokenizers-library) tokenizer; got "
                          f"{type(tokenizer).__name__}")
    return Checkpoint(source, model, tokenizer, decoder_spec(model, capacity=capacity))


@contextlib.contextmanager
def _quiet(quiet: bool):
    """Silence transformers' progress bars, restoring them afterwards. Its GGUF loader uses
    plain tqdm (not transformers' switch), so that one is wrapped with disable=True."""
    if not quiet:
        yield
        return
    import transformers
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    enabled = transformers.utils.logging.is_progress_bar_enabled()
    original = gguf_utils.tqdm
    transformers.utils.logging.disable_progress_bar()
    gguf_utils.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = original
        if enabled:
            transformers.utils.logging.enable_progress_bar()


def _rope_parameters(config: Any) -> dict:
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return rope if isinstance(rope, dict) else {}


def check_config(config: Any, *, capacity: int) -> None:
    """Refuse configurations the graph does not implement, naming the config key and value."""
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_TYPES:
        raise ExportError(f"model_type {model_type!r} is not supported; supported: {SUPPORTED}")
    if MODEL_TYPES[model_type] in GEMMA:
        _check_gemma(config, capacity=capacity)
        return
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ExportError(f"hidden_act {act!r} is not supported (the MLP is SiLU-gated)")
    rope = _rope_parameters(config)
    if set(rope) & {"sliding_attention", "full_attention"}:
        raise ExportError(f"rope_parameters per layer type ({', '.join(sorted(rope))}) are not "
                          f"supported for model_type {model_type!r}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if model_type == "phi3" and rope_type in ("longrope", "su"):
        # transformers picks the short factors while the sequence fits the original context
        # and the long ones (for every position, cached keys aside) beyond it: one table
        # serves a cache only while the short ones always apply
        original = rope.get("original_max_position_embeddings") or \
            getattr(config, "original_max_position_embeddings", None)
        if not isinstance(original, int) or capacity > original:
            raise ExportError(f"rope_type {rope_type!r} with original_max_position_embeddings "
                              f"{original} is supported for a capacity up to that only (the "
                              f"long factors change every position's rotary); got capacity "
                              f"{capacity}")
    elif rope_type not in STATIC_ROPE_TYPES:
        raise ExportError(f"rope_type {rope_type!r} is not supported; supported: "
                          f"{', '.join(STATIC_ROPE_TYPES)}"
                          + (", longrope (Phi-3)" if model_type == "phi3" else ""))
    heads = getattr(config, "num_attention_heads", 1)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if head_dim % 16:
        raise ExportError(f"head_dim {head_dim} is not a multiple of 16, which onnxruntime's "
                          f"GroupQueryAttention requires")
    partial = float(rope.get("partial_rotary_factor", 1.0) or 1.0)
    if int(head_dim * partial) % 16:
        raise ExportError(f"partial_rotary_factor {partial} rotates {head_dim * partial:g} of "
                          f"{head_dim} dimensions; the graph needs a multiple of 16")
    if model_type in ("qwen2", "qwen3", "smollm3") and getattr(config, "use_sliding_window",
                                                               False):
        raise ExportError("use_sliding_window True is not supported for model_type "
                          f"{model_type!r} (its sliding layers are not implemented)")


# GGUF tensors that carry a RoPE scaling (llama.cpp's way of writing it): name -> rope_type
_GGUF_ROPE_TENSORS = {"rope_freqs.weight": "llama3", "rope_factors_long.weight": "longrope",
                      "rope_factors_short.weight": "longrope"}


def check_gguf_config(path: Any, config: Any, *, capacity: int) -> None:
    """Refuse a GGUF file stating what transformers' GGUF loader left out of `config`, the
    config it made of the file. That loader reads only the keys its GGUF_CONFIG_MAPPING names
    (transformers 5.x: no RoPE scaling and no rope_freqs / rope_factors tensors for any of these
    architectures, no head_dim for 'qwen3', no partial rotary or sliding window for 'phi3', no
    sliding window for 'llama', no soft-capping or query_pre_attn_scalar for Gemma); the rest
    keeps the config class's defaults, a model that is not the file's. Header reads only."""
    from .sources import read_gguf_header

    metadata, tensors = read_gguf_header(path)
    arch = metadata.get("general.architecture")
    name = path.name

    def key(k: str) -> Any:
        return metadata.get(f"{arch}.{k}")

    def refuse(stated: str, loaded: str) -> None:
        raise ExportError(f"{name}: the file states {stated}, which transformers' GGUF loader "
                          f"does not read (it loads {loaded}); export the Hugging Face model "
                          f"directory instead")

    if arch == "llama" and metadata.get("general.name") == "mistral":
        raise ExportError(f"{name}: general.name 'mistral' makes transformers' GGUF loader load "
                          f"it as model_type 'mistral', for which gguf-py has no tensor names; "
                          f"rename the model in the file or export its Hugging Face directory")
    rope = _rope_parameters(config)
    full = rope.get("full_attention", rope)
    rope_type = full.get("rope_type", full.get("type", "default"))
    scaling = key("rope.scaling.type")
    if scaling not in (None, "none", rope_type):
        refuse(f"{arch}.rope.scaling.type {scaling!r}", f"rope_type {rope_type!r}")
    for tensor in tensors:
        if tensor in _GGUF_ROPE_TENSORS and rope_type != _GGUF_ROPE_TENSORS[tensor]:
            refuse(f"the tensor {tensor} (rope_type {_GGUF_ROPE_TENSORS[tensor]!r})",
                   f"rope_type {rope_type!r}")
    for k, loaded in (("rope.freq_base", full.get("rope_theta")),
                      ("rope.freq_base_swa", rope.get("sliding_attention", {}).get("rope_theta"))):
        stated = key(k)
        if stated is not None and loaded is not None and \
                abs(stated - loaded) > 1e-6 * abs(loaded):
            refuse(f"{arch}.{k} {stated:g}", f"rope_theta {loaded:g}")
    head_dim = getattr(config, "head_dim", None) or \
        config.hidden_size // config.num_attention_heads
    key_length = key("attention.key_length")
    if key_length is not None and key_length != head_dim:
        refuse(f"{arch}.attention.key_length {key_length}", f"head_dim {head_dim}")
    partial = float(full.get("partial_rotary_factor", 1.0) or 1.0)
    rotary = key("rope.dimension_count")
    if rotary is not None and rotary != int(head_dim * partial):
        refuse(f"{arch}.rope.dimension_count {rotary}",
               f"{int(head_dim * partial)} rotary dimensions of head_dim {head_dim}")
    window = key("attention.sliding_window")
    loaded_window = getattr(config, "sliding_window", None) \
        if getattr(config, "use_sliding_window", True) else None
    if isinstance(window, int) and 0 < window < capacity and window != loaded_window:
        refuse(f"{arch}.attention.sliding_window {window} (under the capacity {capacity})",
               f"sliding_window {loaded_window}")
    for k in ("attn_logit_softcapping", "final_logit_softcapping"):
        stated, loaded = key(k), float(getattr(config, k, None) or 0.0)
        if stated is not None and abs(stated - loaded) > 1e-6 * max(abs(loaded), 1.0):
            refuse(f"{arch}.{k} {stated:g}", f"{k} {loaded:g}")
    scalar = getattr(config, "query_pre_attn_scalar", None)
    if arch in GEMMA and scalar is not None and scalar != head_dim:
        raise ExportError(f"{name}: a GGUF file has no query_pre_attn_scalar: llama.cpp scales "
                          f"the attention by {arch}.attention.key_length {head_dim} (the 27B "
                          f"models by hidden_size / heads), transformers' GGUF loader by its "
                          f"default query_pre_attn_scalar {scalar}; export the Hugging Face "
                          f"model directory instead")


def _check_gemma(config: Any, *, capacity: int) -> None:
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ExportError(f"hidden_activation {act!r} is not supported (the Gemma MLP is "
                          f"GeGLU with the tanh approximation)")
    if getattr(config, "use_bidirectional_attention", False):
        raise ExportError("use_bidirectional_attention True is not supported (the graph is "
                          "causal)")
    rope = _rope_parameters(config)
    per_type = rope if set(rope) & {"sliding_attention", "full_attention"} else {"": rope}
    for layer_type, params in per_type.items():
        rope_type = params.get("rope_type", "default")
        if rope_type not in STATIC_ROPE_TYPES:
            where = f"rope_parameters[{layer_type!r}]" if layer_type else "rope_parameters"
            raise ExportError(f"{where} rope_type {rope_type!r} is not supported; supported: "
                              f"{', '.join(STATIC_ROPE_TYPES)}")
    types = set(getattr(config, "layer_types", None) or ())
    if not types <= {"sliding_attention", "full_attention"}:
        raise ExportError(f"layer_types {sorted(types)} are not supported; supported: "
                          f"sliding_attention, full_attention")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if head_dim % 16:
        raise ExportError(f"head_dim {head_dim} is not a multiple of 16, which onnxruntime's "
                          f"GroupQueryAttention requires")


def decoder_spec(model: Any, *, capacity: int | None = None) -> DecoderSpec:
    """The graph's numbers from the loaded model. capacity: the KV capacity the graph is
    built for; a sliding window at least that long never narrows anything and is left out."""
    config = model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    embed = model.model.embed_tokens.weight
    lm_head = model.lm_head.weight
    tied = lm_head is embed or lm_head.data_ptr() == embed.data_ptr()
    family = MODEL_TYPES[config.model_type]
    layers = model.model.layers
    attn0 = layers[0].self_attn
    q = attn0.qkv_proj.weight if family == "phi3" else attn0.q_proj.weight
    q_rows = heads * head_dim + (2 * kv_heads * head_dim if family == "phi3" else 0)
    if tuple(q.shape) != (q_rows, config.hidden_size):
        raise ExportError(f"{'qkv_proj' if family == 'phi3' else 'q_proj'} has shape "
                          f"{tuple(q.shape)}; expected ({q_rows}, {config.hidden_size}) from "
                          f"the config")
    window = getattr(config, "sliding_window", None) if family in ("llama", "phi3", *GEMMA) \
        else None
    windows: tuple[int, ...] = ()
    if family in GEMMA and isinstance(window, int) and window > 0:
        # the layers layer_types names sliding_attention, kept even where the window spans
        # the capacity: Gemma 3's have their own rotary tables
        windows = tuple(window if t == "sliding_attention" else 0
                        for t in config.layer_types[:config.num_hidden_layers])
    elif isinstance(window, int) and window > 0 and (capacity is None or window < capacity):
        windows = (window,) * config.num_hidden_layers
    gemma = family in GEMMA
    scale = float(head_dim) ** -0.5
    if gemma:
        scale = float(config.query_pre_attn_scalar) ** -0.5
    local_rope = family == "gemma3" and "sliding_attention" in _rope_parameters(config)
    rope_layers: tuple[bool, ...] = ()
    if family == "smollm3":
        rope_layers = tuple(bool(x) for x in config.no_rope_layers[:config.num_hidden_layers])
    partial = float(_rope_parameters(config).get("partial_rotary_factor", 1.0) or 1.0)
    rotary_dim = int(head_dim * partial)
    return DecoderSpec(
        family=family,
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        vocab_size=int(embed.shape[0]),
        rms_norm_eps=float(config.rms_norm_eps),
        tied_embeddings=bool(tied),
        attention_scale=scale,
        qk_norm=family in ("qwen3", "gemma3"),
        windows=windows,
        rope_layers=rope_layers if not all(rope_layers) else (),
        rotary_dim=rotary_dim if rotary_dim != head_dim else 0,
        embed_scale=float(model.model.embed_tokens.embed_scale) if gemma else 1.0,
        mlp_act="gelu_tanh" if gemma else "silu",
        sandwich_norms=gemma,
        attn_softcap=float(getattr(config, "attn_logit_softcapping", None) or 0.0),
        final_softcap=float(getattr(config, "final_logit_softcapping", None) or 0.0),
        local_rope=local_rope and any(windows),
    )
