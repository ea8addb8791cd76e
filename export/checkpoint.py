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
}


@dataclasses.dataclass
class Checkpoint:
    source: Source
    model: Any  # transformers PreTrainedModel, eval mode, float32
    tokenizer: Any  # transformers fast tokenizer
    spec: DecoderSpec

    def weight(self, name: str) -> np.ndarray | None:
        """Canonical weight name -> float32 array sharing the model's memory, or None."""
        tensor = self._params.get(self._key(name))
        return None if tensor is None else tensor.detach().float().numpy()

    @staticmethod
    def _key(name: str) -> str:
        """Canonical weight name -> the Hugging Face parameter name."""
        if name == "embed":
            return "model.embed_tokens.weight"
        if name == "norm":
            return "model.norm.weight"
        if name == "lm_head":
            return "lm_head.weight"
        _, i, suffix = name.split(".", 2)
        return f"model.layers.{i}.{_LAYER_NAMES[suffix]}"

    def rope_tables(self, capacity: int) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin: [capacity, head_dim // 2] float32, computed by the model's own RoPE module."""
        rotary = self.model.model.rotary_emb
        positions = torch.arange(capacity, dtype=torch.int64)[None]  # [1, capacity]
        with torch.no_grad():
            cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
        half = self.spec.head_dim // 2
        # the module returns cat(freqs, freqs) (rotate-half layout); GQA wants one half
        return cos[0, :, :half].numpy().copy(), sin[0, :, :half].numpy().copy()

    def torch_logits(self, ids: np.ndarray, *, num_layers: int | None = None,
                     replace: dict[str, np.ndarray] | None = None) -> np.ndarray:
        """Reference logits for ids [n], one forward pass: [n, vocab] float32.

        num_layers: run only the first N decoder layers (then the final norm and the LM head),
        the reference of a layer-skip draft. replace: canonical weight name -> float32 array
        used instead of the checkpoint's for this call (a quantized draft's dequantized
        weights; "lm_head" unties a tied head). The model is restored afterwards either way.
        """
        with torch.no_grad(), self._truncated(num_layers), self._replaced(replace or {}):
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
    def _replaced(self, weights: dict[str, np.ndarray]):
        saved: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        head = self.model.lm_head
        tied_head = head.weight  # restored as the very Parameter, so a tied head is tied again
        try:
            for name, array in weights.items():
                tensor = torch.from_numpy(np.ascontiguousarray(array, np.float32))
                if name == "lm_head":
                    head.weight = torch.nn.Parameter(tensor, requires_grad=False)
                    continue
                param = self._params[self._key(name)]
                if tuple(param.shape) != tuple(tensor.shape):
                    raise ValueError(f"{name}: replacement of shape {tuple(tensor.shape)} for a "
                                     f"weight of shape {tuple(param.shape)}")
                saved.append((param, param.data))
                param.data = tensor
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
    return Checkpoint(source, model, tokenizer, decoder_spec(model))


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


def check_config(config: Any, *, capacity: int) -> None:
    """Refuse configurations the graph does not implement, naming the feature."""
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_TYPES:
        raise ExportError(f"model_type {model_type!r} is not supported; supported: {SUPPORTED}")
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ExportError(f"hidden_act {act!r} is not supported (the MLP is SiLU-gated)")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in STATIC_ROPE_TYPES:
        raise ExportError(f"rope_type {rope_type!r} is not supported; supported: "
                          f"{', '.join(STATIC_ROPE_TYPES)}")
    heads = getattr(config, "num_attention_heads", 1)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if head_dim % 16:
        raise ExportError(f"head_dim {head_dim} is not a multiple of 16, which onnxruntime's "
                          f"GroupQueryAttention requires")
    if getattr(config, "use_sliding_window", False):
        raise ExportError("sliding-window attention (use_sliding_window=true) is not supported")
    window = getattr(config, "sliding_window", None)
    if model_type == "mistral" and window is not None and window < capacity:
        raise ExportError(f"sliding_window {window} is shorter than the capacity {capacity}; "
                          f"sliding-window attention is not supported (export with "
                          f"capacity <= {window})")


def decoder_spec(model: Any) -> DecoderSpec:
    config = model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    embed = model.model.embed_tokens.weight
    lm_head = model.lm_head.weight
    tied = lm_head is embed or lm_head.data_ptr() == embed.data_ptr()
    q = model.model.layers[0].self_attn.q_proj.weight
    if tuple(q.shape) != (heads * head_dim, config.hidden_size):
        raise ExportError(f"q_proj has shape {tuple(q.shape)}; expected "
                          f"({heads * head_dim}, {config.hidden_size}) from the config")
    return DecoderSpec(
        family=MODEL_TYPES[config.model_type],
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        vocab_size=int(embed.shape[0]),
        rms_norm_eps=float(config.rms_norm_eps),
        tied_embeddings=bool(tied),
        attention_scale=float(head_dim) ** -0.5,
    )
