"""ortspec.runtime: lossless speculative decoding over ONNX Runtime (NumPy + onnxruntime only)."""

from .errors import *  # noqa: F401,F403
