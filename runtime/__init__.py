"""ortspec.runtime: lossless speculative decoding over ONNX Runtime (NumPy + onnxruntime only)."""

from importlib.metadata import PackageNotFoundError, version as _version

from .decoding.counters import DecodeCounters
from .decoding.loop import plain_decode, speculative_decode, speculative_decode_with
from .decoding.options import SpeculativeDecodeResult, SpeculativeOptions
from .drafters.draft_model import DraftModelDrafter
from .drafters.prompt_lookup import PromptLookupSpeculator
from .errors import (
    CapacityError,
    ConcurrentUseError,
    DrafterError,
    ExportError,
    InvalidDistributionError,
    InvalidOptionError,
    InvalidPromptError,
    ManifestError,
    ModelBusyError,
    NonFiniteLogitsError,
    OrtspecError,
    ProviderError,
)
from .load import load_model
from .model import DrafterSpec, Model
from .ort.decoder import OrtDecoder
from .paths import default_model_path, models_dir
from .decoding.protocols import Decoder, DecoderBase, DraftLengthPolicy, Drafter, DrafterBase
from .ort.providers import resolve_providers
from .check.reference import ReferenceConfig, ReferenceDecoder
from .ort.sessions import OrtSessions
from .decoding.sampling import DraftBlock, DraftDist, accept_or_resample, sample_from, verify_block, warp

try:
    __version__ = _version("ortspec")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "CapacityError", "ConcurrentUseError", "DecodeCounters", "Decoder", "DecoderBase",
    "DraftBlock", "DraftDist", "DraftLengthPolicy", "DraftModelDrafter", "Drafter", "DrafterSpec",
    "DrafterBase", "DrafterError", "ExportError", "InvalidDistributionError",
    "InvalidOptionError", "InvalidPromptError", "ManifestError", "Model", "ModelBusyError",
    "NonFiniteLogitsError", "OrtDecoder", "OrtSessions", "OrtspecError",
    "PromptLookupSpeculator", "ProviderError", "ReferenceConfig", "ReferenceDecoder",
    "SpeculativeDecodeResult", "SpeculativeOptions", "__version__", "accept_or_resample",
    "default_model_path", "models_dir",
    "load_model", "plain_decode", "resolve_providers", "sample_from", "speculative_decode",
    "speculative_decode_with", "verify_block", "warp",
]
