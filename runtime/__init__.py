"""ortspec.runtime: lossless speculative decoding over ONNX Runtime (NumPy + onnxruntime only)."""

from importlib.metadata import PackageNotFoundError, version as _version

from .decoding.counters import DecodeCounters
from .decoding.loop import decode_steps, plain_decode, speculative_decode, speculative_decode_with
from .decoding.options import SpeculativeDecodeResult, SpeculativeOptions
from .drafters.draft_model import DraftModelDrafter
from .drafters.prompt_lookup import PromptLookupSpeculator
from .errors import (
    CapacityError,
    ConcurrentUseError,
    DecoderContractError,
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
from .model import Model, TokenStream
from .ort.decoder import OrtDecoder
from .paths import default_model_path, models_dir
from .decoding.protocols import Decoder, DecoderBase, DraftLengthPolicy, Drafter, DrafterBase, as_decoder
from .ort.providers import choose_providers, resolve_providers
from .check.reference import ReferenceConfig, ReferenceDecoder
from .request import DrafterSpec, check_request
from .ort.sessions import OrtSessions
from .decoding.sampling import DraftBlock, DraftDist, accept_or_resample, sample_from, verify_block, warp
from .decoding.text import Detokenizer, TextStream, detokenize

try:
    __version__ = _version("ortspec")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "CapacityError", "ConcurrentUseError", "DecodeCounters", "Decoder", "DecoderBase",
    "DecoderContractError", "Detokenizer", "DraftBlock", "DraftDist", "DraftLengthPolicy", "DraftModelDrafter", "Drafter", "DrafterSpec",
    "DrafterBase", "DrafterError", "ExportError", "InvalidDistributionError",
    "InvalidOptionError", "InvalidPromptError", "ManifestError", "Model", "ModelBusyError",
    "NonFiniteLogitsError", "OrtDecoder", "OrtSessions", "OrtspecError",
    "PromptLookupSpeculator", "ProviderError", "ReferenceConfig", "ReferenceDecoder",
    "SpeculativeDecodeResult", "SpeculativeOptions", "TextStream", "TokenStream", "__version__",
    "accept_or_resample", "as_decoder", "check_request", "choose_providers", "decode_steps",
    "default_model_path", "detokenize", "models_dir",
    "load_model", "plain_decode", "resolve_providers", "sample_from", "speculative_decode",
    "speculative_decode_with", "verify_block", "warp",
]
