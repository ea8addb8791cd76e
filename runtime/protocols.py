"""The two interfaces everything else is written against: `Decoder` and `Drafter`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from .sampling import DraftBlock


@runtime_checkable
class Decoder(Protocol):
    """A target (or draft) model with a KV cache of fixed capacity.

    The cache holds the tokens fed so far (`length` of them). `forward_batch` appends a block
    in one call and returns the logits after each of its tokens; `truncate` rolls the cache back
    to a shorter length in O(1). A decoder may also expose `max_verify_len` (the longest block
    one call verifies efficiently); the decode loop reads it with `getattr`, if present.
    """

    vocab_size: int
    capacity: int  # most tokens the KV buffers hold

    @property
    def length(self) -> int: ...  # tokens currently in the cache

    def reset(self) -> None: ...

    def forward_token(self, token: int) -> np.ndarray: ...  # [vocab] logits

    def forward_batch(self, tokens: Sequence[int]) -> np.ndarray: ...  # [n, vocab] logits

    def truncate(self, length: int) -> None: ...


@runtime_checkable
class Drafter(Protocol):
    """Proposes up to `max_tokens` tokens to follow `history` (prompt + tokens emitted so far).

    Returns `DraftBlock.empty()` when it has nothing worth verifying. Each drafted token comes
    with the distribution it was drawn from (`DraftDist`), which the verifier needs to stay
    lossless; a model-free drafter proposes point masses. A drafter must not modify `history`.

    Optionally a drafter defines `begin(options)`: the decode loop calls it when a request
    starts, with the request's `SpeculativeOptions` (to reset state, follow its temperature,
    seed its own random stream).
    """

    def propose(self, history: Sequence[int], max_tokens: int) -> "DraftBlock": ...
