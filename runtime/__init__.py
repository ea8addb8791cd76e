"""ortspec.runtime: lossless speculative decoding over ONNX Runtime (NumPy + onnxruntime only)."""

from .counters import DecodeCounters
from .decode import (
    SpeculativeDecodeResult,
    SpeculativeOptions,
    plain_decode,
    speculative_decode,
    speculative_decode_with,
)
from .drafters.draft_model import DraftModelDrafter
from .drafters.prompt_lookup import PromptLookupSpeculator
from .errors import (
    CapacityError,
    DrafterError,
    ExportError,
    InvalidDistributionError,
    InvalidOptionError,
    InvalidPromptError,
    ManifestError,
    NonFiniteLogitsError,
    OrtspecError,
    ProviderError,
)
from .model import Model, load_model
from .ort_decoder import OrtDecoder
from .protocols import Decoder, Drafter
from .providers import resolve_providers
from .reference_decoder import ReferenceConfig, ReferenceDecoder
from .sampling import DraftBlock, DraftDist, accept_or_resample, sample_from, verify_block, warp

__all__ = [
    "CapacityError", "DecodeCounters", "Model", "OrtDecoder", "load_model", "resolve_providers", "Decoder", "DraftBlock", "DraftDist", "DraftModelDrafter", "Drafter",
    "DrafterError", "ExportError", "InvalidDistributionError", "InvalidOptionError",
    "InvalidPromptError", "ManifestError", "NonFiniteLogitsError", "OrtspecError",
    "PromptLookupSpeculator", "ProviderError", "ReferenceConfig", "ReferenceDecoder",
    "SpeculativeDecodeResult", "SpeculativeOptions", "accept_or_resample", "plain_decode",
    "sample_from", "speculative_decode", "speculative_decode_with", "verify_block", "warp",
]
