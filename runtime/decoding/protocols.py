"""The interfaces the decode loop is written against: `Decoder`, `Drafter`, `DraftLengthPolicy`;
`HiddenStateSource`, the optional capability a trained draft head needs of its target; and
`DraftHead`, the head itself.

The loop calls exactly what these declare, nothing it has to discover. Optional behaviour has a
documented no-op default in a small base class (`DecoderBase`, `DrafterBase`), so a new drafter
needs only `propose`, and a decoder only the seven members of `Decoder`: every entry point that
takes a decoder passes it through `as_decoder`, which supplies `DecoderBase`'s defaults for
what it lacks.

    class RepeatLast(DrafterBase):
        def propose(self, history, max_tokens):
            return DraftBlock.points([history[-1]] * min(2, max_tokens), source="repeat")
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Protocol, Sequence, runtime_checkable

import numpy as np

from ..errors import DecoderContractError, DrafterError, InvalidOptionError

if TYPE_CHECKING:
    from .options import SpeculativeOptions
    from .sampling import DraftBlock

FALLBACK_PREFILL_CHUNK = 64  # tokens per call when a decoder states no max_verify_len


@runtime_checkable
class Decoder(Protocol):
    """A target (or draft) model with a KV cache of fixed capacity: these seven members.

    The cache holds the tokens fed so far (`length` of them). `forward_batch` appends a block
    in one call and returns the logits after each of its tokens; `truncate` rolls the cache back
    to a shorter length in O(1).

    Optional members, with `DecoderBase`'s defaults where a decoder lacks them (`as_decoder`):
    `max_verify_len`, the longest block one call verifies efficiently (None: no limit);
    `prefill(tokens)`, which feeds a prompt without returning every row's logits ([vocab], the
    last row's); `ort_seconds`, the time spent inside the model runtime (0 for a NumPy model).
    """

    vocab_size: int
    capacity: int  # most tokens the KV buffers hold

    @property
    def length(self) -> int: ...  # tokens currently in the cache

    def reset(self) -> None: ...

    def forward_token(self, token: int) -> np.ndarray: ...  # [vocab] logits

    def forward_batch(self, tokens: Sequence[int]) -> np.ndarray: ...  # [n, vocab] logits

    def truncate(self, length: int) -> None: ...


DECODER_MEMBERS = ("vocab_size", "capacity", "length", "reset", "forward_token", "forward_batch",
                   "truncate")
OPTIONAL_DECODER_MEMBERS = ("max_verify_len", "prefill", "ort_seconds")


class DecoderBase:
    """Defaults for a `Decoder`: no block limit, no runtime time, and a `prefill` that feeds
    the tokens through `forward_batch` in chunks, so a long prompt never materialises
    [n, vocab] logits. A subclass provides the rest of the protocol."""

    max_verify_len: int | None = None
    ort_seconds: float = 0.0

    def prefill(self, tokens: Sequence[int]) -> np.ndarray:  # [vocab]
        chunk = self.max_verify_len or FALLBACK_PREFILL_CHUNK
        return prefill_in_chunks(self, tokens, chunk)  # type: ignore[arg-type]


def _has(obj: object, name: str) -> bool:
    """`obj` has the attribute `name`, found without running it (a property is not called)."""
    return inspect.getattr_static(obj, name, _MISSING) is not _MISSING


_MISSING = object()


def as_decoder(decoder: object, *, role: str = "decoder") -> "Decoder":
    """`decoder` as the decode loop calls it: itself when it has every optional member too,
    else a `DecoderDefaults` over it. An object lacking one of the seven members of `Decoder`
    is refused with DecoderContractError naming what it lacks, before anything is called on it.
    `role` names it in the message ("draft decoder")."""
    missing = [name for name in DECODER_MEMBERS if not _has(decoder, name)]
    if missing:
        raise DecoderContractError(
            f"the {role} ({type(decoder).__name__}) lacks {', '.join(missing)}: a Decoder needs "
            f"{', '.join(DECODER_MEMBERS)} (optional: {', '.join(OPTIONAL_DECODER_MEMBERS)})")
    if all(_has(decoder, name) for name in OPTIONAL_DECODER_MEMBERS):
        return decoder  # type: ignore[return-value]
    return DecoderDefaults(decoder)  # type: ignore[arg-type]


class DecoderDefaults(DecoderBase):
    """A decoder with only the seven members of `Decoder`, and `DecoderBase`'s defaults for any
    optional one it lacks. Every member is read through to the wrapped decoder when called, so
    `length` (and the rest) stay live."""

    def __init__(self, decoder: "Decoder") -> None:
        self.decoder = decoder

    @property
    def vocab_size(self) -> int:  # type: ignore[override]
        return self.decoder.vocab_size

    @property
    def capacity(self) -> int:  # type: ignore[override]
        return self.decoder.capacity

    @property
    def length(self) -> int:
        return self.decoder.length

    @property
    def max_verify_len(self) -> int | None:  # type: ignore[override]
        return getattr(self.decoder, "max_verify_len", None)

    @property
    def ort_seconds(self) -> float:  # type: ignore[override]
        return getattr(self.decoder, "ort_seconds", 0.0)

    def reset(self) -> None:
        self.decoder.reset()

    def forward_token(self, token: int) -> np.ndarray:  # [vocab]
        return self.decoder.forward_token(token)

    def forward_batch(self, tokens: Sequence[int]) -> np.ndarray:  # [n, vocab]
        return self.decoder.forward_batch(tokens)

    def truncate(self, length: int) -> None:
        self.decoder.truncate(length)

    def prefill(self, tokens: Sequence[int]) -> np.ndarray:  # [vocab]
        if _has(self.decoder, "prefill"):
            return self.decoder.prefill(tokens)  # type: ignore[attr-defined]
        return super().prefill(tokens)

    def __repr__(self) -> str:
        return f"DecoderDefaults({self.decoder!r})"


def prefill_in_chunks(decoder: Decoder, tokens: Sequence[int], chunk: int) -> np.ndarray:
    """Feed `tokens` (non-empty) through `forward_batch`, `chunk` at a time; the last row's
    logits, [vocab]. The one chunked prefill every decoder and measurement uses."""
    tokens = list(tokens)
    last = None
    for lo in range(0, len(tokens), chunk):
        last = decoder.forward_batch(tokens[lo:lo + chunk])[-1]
    assert last is not None, "prefill of an empty sequence"
    return last


class HiddenStateSource(Protocol):
    """A decoder that also hands out the target's hidden states: what a trained EAGLE-3 head
    reads. Not part of `Decoder` (the loop never needs it); a drafter that needs it takes a
    `HiddenStateSource` and says so in its signature. `OrtDecoder` is one, for a model whose
    manifest lists `hidden_state_layers` (`ortspec export --hidden-states`); for other models
    its `hidden_state_layers` is None and `last_hidden_states` raises.

    hidden_state_layers: the ids k of the decoder layers whose entering residual stream is
    returned (the output of layer k - 1, before the final norm; vLLM's EAGLE-3
    aux_hidden_state_layers), in column order. last_hidden_states(): for the rows whose logits
    the last forward_token / forward_batch / prefill returned, [rows, K * hidden] float32.
    """

    hidden_state_layers: tuple[int, ...] | None

    def last_hidden_states(self) -> np.ndarray: ...  # [rows, len(hidden_state_layers) * hidden]


def last_hidden_copy(last: np.ndarray | None, *, unavailable: str | None) -> np.ndarray:
    """What a `HiddenStateSource`'s `last_hidden_states` returns: a copy of `last`, the last
    call's rows [rows, K * hidden]. InvalidOptionError saying `unavailable` (why this model
    returns none) when that is given, or that no call has returned any yet when `last` is None."""
    if unavailable is not None:
        raise InvalidOptionError(unavailable)
    if last is None:
        raise InvalidOptionError("no hidden states yet: call forward_token, forward_batch or "
                                 "prefill first")
    return last.copy()


class DraftHead(Protocol):
    """A trained draft head (EAGLE-3; an MTP layer or a DFlash block fits the same shape) with a
    KV cache of its own, fixed capacity, rolled back by `truncate` like a `Decoder`'s.

    Entry j of the head's cache holds one pair: the token at some history position t and a
    hidden state describing the prefix before it, either the target's hidden states after it
    processed history[t - 1] (`from_target`: [K * target_hidden], the rows a
    `HiddenStateSource` returns, projected by the head's own `fc`) or the head's own hidden
    output at entry j - 1 ([hidden], what `forward` returned). Entries are consecutive history
    positions; the head's rotary position is the entry index (relative positions are what
    attention sees). The output at entry j: draft-vocabulary logits for history[t + 1], and the
    head's hidden output (before its final norm), which the next entry reads when the head
    drafts on from its own state.

    draft_vocab_size: the rows of the head's LM head. target_ids: [draft_vocab_size] int64, the
    target token id of each draft id (EAGLE-3's d2t applied), strictly inside the target's
    vocabulary and distinct; a head over the whole vocabulary has target_ids == arange(vocab).
    """

    draft_vocab_size: int
    target_ids: np.ndarray  # [draft_vocab_size] int64
    capacity: int  # most entries the KV buffers hold

    @property
    def length(self) -> int: ...  # entries currently in the cache

    def reset(self) -> None: ...

    def truncate(self, length: int) -> None: ...

    def forward(self, tokens: Sequence[int], hidden: np.ndarray, *,
                from_target: bool) -> tuple[np.ndarray, np.ndarray]: ...
    # tokens: [n] target ids; hidden: [n, K * target_hidden] (from_target) or [n, hidden];
    # appends n entries in one call; returns (logits [n, draft_vocab_size] float32,
    # hidden_out [n, hidden] float32), both valid until the next call


class DraftLengthPolicy(Protocol):
    """How many drafted tokens a verify call takes, learned from what earlier calls showed.

    Per request the decode loop calls `begin(options)` once, then per step `should_propose()`
    (False: a plain step, the drafter not asked), `choose(block)` after drafting,
    `observe_cost(n_tokens, seconds)` with the wall time of the target call, and
    `observe(...)` with its outcome. A drafter that pays per drafted token asks `limit`
    before drafting; a composite drafter asks `rate` which of its drafters to run (the tokens
    per second the best block of a key is expected to emit, `paid` when drafting costs a step
    per token). One policy object serves one request at a time; `Model` gives each request
    its own, sharing only the guarded cross-request estimates.
    """

    def begin(self, options: "SpeculativeOptions") -> None: ...

    def should_propose(self) -> bool: ...

    def limit(self, k_max: int, *, key: tuple[str, int], prior: float | None) -> int: ...

    def rate(self, k_max: int, *, key: tuple[str, int], prior: float | None, paid: bool) -> float: ...

    def choose(self, block: "DraftBlock") -> int: ...

    def observe(self, proposed: "DraftBlock", n_verified: int, n_accepted: int, first_token: int,
                *, first_accept_prob: float | None = None) -> None: ...

    def observe_cost(self, n_tokens: int, seconds: float) -> None: ...


@runtime_checkable
class Drafter(Protocol):
    """Proposes up to `max_tokens` tokens to follow `history` (prompt + tokens emitted so far).

    Returns `DraftBlock.empty()` when it has nothing worth verifying. Each drafted token comes
    with the distribution it was drawn from (`DraftDist`), which the verifier needs to stay
    lossless; a model-free drafter proposes point masses. A drafter must not modify `history`.

    `begin(options, draft_length)` is called when a request starts, with the request's
    `SpeculativeOptions` (to reset state, follow its temperature, seed its own random stream)
    and the request's draft-length policy (None when there is none), which a drafter that pays
    per drafted token asks through `limit`. `DrafterBase.begin` does nothing.

    `observe_target(start, logits)` is called after every target call (a verify or a plain
    step), before the next `propose`, with the target's logits for the positions that call
    emitted: `logits` is [n, vocab] (n >= 1), row i the target's logits for history position
    `start + i`, computed from `history[:start + i]`; `start + n == len(history)`. The token now
    at that position has the distribution warp(logits[i]) under the request's temperature,
    top_k and top_p (those `begin` was given): a drafter may keep what it needs of it as the q
    of later drafts. Rows for drafts after a rejection are not passed (they were computed from
    tokens that were discarded), nor the prompt's. The array is only valid during the call:
    copy what is kept. `DrafterBase.observe_target` ignores it.
    """

    def begin(self, options: "SpeculativeOptions", draft_length: DraftLengthPolicy | None) -> None: ...

    def propose(self, history: Sequence[int], max_tokens: int) -> "DraftBlock": ...

    def observe_target(self, start: int, logits: np.ndarray) -> None: ...  # logits: [n, vocab]


def check_drafter(drafter: object) -> None:
    """DrafterError unless `drafter` has the three methods of `Drafter`."""
    if not isinstance(drafter, Drafter):
        raise DrafterError(
            f"a drafter needs begin(options, draft_length), propose(history, max_tokens) and "
            f"observe_target(start, logits) methods (subclass ortspec.runtime.DrafterBase for a "
            f"begin and an observe_target that do nothing); got "
            f"{type(drafter).__name__}")


class DrafterBase:
    """A drafter keeping no per-request state and using no target rows: `begin` and
    `observe_target` are no-ops."""

    def begin(self, options: "SpeculativeOptions", draft_length: DraftLengthPolicy | None) -> None:
        """Nothing to reset."""

    def observe_target(self, start: int, logits: np.ndarray) -> None:  # logits: [n, vocab]
        """Nothing to keep."""
