"""One exception hierarchy: every error ortspec raises on purpose is an `OrtspecError`.

Each also subclasses the built-in a Python user would catch (ValueError, TypeError,
FileNotFoundError), so `except ValueError` keeps working. Messages name the offending value and
what is allowed.
"""

from __future__ import annotations


class OrtspecError(Exception):
    """Base of every error ortspec raises deliberately."""


class InvalidOptionError(OrtspecError, ValueError):
    """An option is out of range: temperature, top_k, top_p, max_new_tokens, draft length...

    `option` names the option when the error is about one (the name a caller passed it by, such
    as "top_p"), for a caller that points at it in words of its own (the server); None
    otherwise."""

    def __init__(self, message: str, *, option: str | None = None) -> None:
        super().__init__(message)
        self.option = option


class InvalidPromptError(OrtspecError, ValueError):
    """The prompt is empty, has token ids outside the vocabulary, or does not fit the capacity.

    An error about one token carries `token_index` and `token`, one about the length `length`
    and `capacity` (None otherwise), for a caller that answers in words of its own (the server)."""

    def __init__(self, message: str, *, token_index: int | None = None, token: object = None,
                 length: int | None = None, capacity: int | None = None) -> None:
        super().__init__(message)
        self.token_index, self.token = token_index, token
        self.length, self.capacity = length, capacity


class InvalidDistributionError(OrtspecError, ValueError):
    """A DraftDist (or probability vector) is not a distribution over the vocabulary."""


class DecoderContractError(OrtspecError, TypeError):
    """An object passed as a decoder lacks one of the seven members of the `Decoder` contract
    (vocab_size, capacity, length, reset, forward_token, forward_batch, truncate)."""


class DrafterError(OrtspecError, ValueError):
    """A drafter returned a block the decode loop cannot verify (ids out of range, too long)."""


class NonFiniteLogitsError(OrtspecError, ValueError):
    """The model returned NaN or infinite logits."""


class CapacityError(OrtspecError, ValueError):
    """A decoder was asked to hold more tokens than its KV capacity."""


class ManifestError(OrtspecError, ValueError):
    """A model directory is malformed, corrupted, or reaches outside itself."""


class ProviderError(OrtspecError, ValueError):
    """An execution provider was asked for that the installed onnxruntime does not offer."""


class ExportError(OrtspecError, RuntimeError):
    """An export was refused (unsupported architecture, bad option) or failed validation."""


class ModelBusyError(OrtspecError, RuntimeError):
    """Every decode slot of a loaded model is taken, and the request was not to wait (or its
    wait timed out)."""


class ConcurrentUseError(OrtspecError, RuntimeError):
    """One request's state (a decoder, a drafter, a draft-length policy) was used by a second
    request while the first still held it."""
