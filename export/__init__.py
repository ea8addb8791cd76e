"""ortspec.export: a checkpoint (Hugging Face directory, GGUF file, or the default model) ->
an ONNX model directory the runtime loads with nothing else.

Why the graph is built directly from the weights with the `onnx` helper API, not traced with
torch.onnx:

- It takes seconds and no example inputs: tracing runs the PyTorch model and records every
  op, including its KV-cache bookkeeping, which the fixed-capacity in-place KV design replaces.
- It emits ONNX Runtime's fused ops directly (SimplifiedLayerNormalization,
  SkipSimplifiedLayerNormalization, GroupQueryAttention with rotary embedding and a shared
  past/present KV buffer), the graph onnxruntime-genai's builder produces and the fastest
  measured on the CPU; a traced graph would need a fusion pass that may or may not match.
- The graph itself needs no torch: `graphs.build_decoder` takes NumPy arrays. torch and
  transformers only load the checkpoint (GGUF dequantisation included) and serve as the
  reference the export is validated against.
- The tied LM head reuses the embedding table (Gemm with transB), so the weights are stored
  once, in one external data file.
- A second flavour for TensorRT (`attention="standard"`: ONNX opset-24 Attention,
  TensorScatter, RotaryEmbedding, RMSNormalization) is a different attention block in the
  same builder, not a different exporter.

- Self-speculative drafts of the same checkpoint (drafts.py: 4-bit `MatMulNBits` weights, or
  the first N layers) are the same builder with a `WeightQuant` or a shorter `DecoderSpec`,
  exported beside the target in `<target>/drafts/<name>/`.

Public API: `export_model`, `add_draft`, `default_model_dir`, `ensure_default_model`,
`default_draft_dir`, `ensure_default_draft`; the CLI is `cli.main`.
"""

from typing import TYPE_CHECKING as _TYPE_CHECKING, Any as _Any

if _TYPE_CHECKING:
    from .api import ExportOptionError, add_draft, export_model
    from .defaults import default_draft_dir, default_model_dir, ensure_default_draft, \
        ensure_default_model
    from .drafts import DraftOptionError

__all__ = ["DraftOptionError", "ExportOptionError", "add_draft", "default_draft_dir",
           "default_model_dir", "ensure_default_draft", "ensure_default_model", "export_model"]


def __getattr__(name: str) -> _Any:
    """The public API, imported on first use: the package itself imports nothing, so
    `ortspec export --help` (cli.py) runs where the export extra (onnx, torch, ...) is not
    installed."""
    if name in ("ExportOptionError", "add_draft", "export_model"):
        from . import api
        return getattr(api, name)
    if name in ("default_draft_dir", "default_model_dir", "ensure_default_draft",
                "ensure_default_model"):
        from . import defaults
        return getattr(defaults, name)
    if name == "DraftOptionError":
        from . import drafts
        return drafts.DraftOptionError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
