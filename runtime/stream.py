"""`TokenStream`: one request of a loaded model, as the tokens its decode emits.

`Model.start` checks the request, does its set-up and returns the stream; the stream takes a
decode slot from the model's pool at its first `next()`, makes the request's drafter on that
slot, and runs the decode loop (`decoding.loop.decode_steps`). What it calls on the model is
declared by `StreamHost`.
"""

from __future__ import annotations

from typing import Iterator, Protocol, Sequence

from .decoding.counters import DecodeCounters
from .decoding.loop import Steps, decode_steps
from .decoding.options import SpeculativeDecodeResult, SpeculativeOptions
from .decoding.protocols import DraftLengthPolicy, Drafter
from .request import DrafterSpec
from .slots import DecodeSlot, SlotPool


class StreamHost(Protocol):
    """What a `TokenStream` calls on the model that made it (`Model`)."""

    slots: SlotPool

    def slot_drafter(self, slot: DecodeSlot, drafter: Drafter | DrafterSpec | None
                     ) -> Drafter | None:
        """The request's drafter on `slot`: made there for a `DrafterSpec`, else `drafter`."""
        ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...


class TokenStream:
    """One request of a `Model` (made by `Model.start`), as the tokens its decode emits: a list
    per target call (one token for a plain step, accepted drafts and the token after them for a
    verify). `.tokens` and `.counters` hold what was emitted and counted so far; `.result` is
    the `SpeculativeDecodeResult` (with `.text`) once the decode has ended, None before.

    The stream owns the request's state: at the first `next()` it takes a decode slot from the
    model's pool, makes the drafter on it (for a name or a `DrafterSpec`), and iterates the
    decode loop (`decoding.loop.decode_steps`) with the request's policy; the slot goes back
    when the decode ends, fails, or the stream is closed (`close()`, or garbage collection of a
    stream dropped half way). Nothing else happens inside `next()`: the request was checked, and
    any set-up done, by `Model.start`."""

    def __init__(self, host: StreamHost, prompt: list[int], drafter: Drafter | DrafterSpec | None,
                 options: SpeculativeOptions, policy: DraftLengthPolicy | None) -> None:
        self.host = host
        self.prompt = prompt
        self.options = options
        self.tokens: list[int] = []  # emitted so far
        self.counters = DecodeCounters()  # filled in as the decode goes
        self.result: SpeculativeDecodeResult | None = None
        self._drafter, self._policy = drafter, policy
        self._slot: DecodeSlot | None = None
        self._steps: Steps | None = None
        self._done = False

    def __iter__(self) -> Iterator[list[int]]:
        return self

    def __next__(self) -> list[int]:
        if self._done:
            raise StopIteration
        if self._steps is None:
            self._begin()
        assert self._steps is not None
        try:
            new = next(self._steps)
        except StopIteration as stop:
            self.result = stop.value
            self.result.text = self.host.decode(self.result.tokens)
            self.close()
            raise StopIteration from None
        except BaseException:
            self.close()
            raise
        self.tokens.extend(new)
        return new

    def _begin(self) -> None:
        """Take a slot, make the drafter on it, open the decode loop."""
        slot = self._slot = self.host.slots.acquire()
        try:
            drafter = self.host.slot_drafter(slot, self._drafter)
            self._steps = decode_steps(slot.decoder, self.prompt, drafter, self.options,
                                       draft_length=self._policy, counters=self.counters)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """End the request: the decode loop is closed and the slot given back (idempotent)."""
        self._done = True
        steps, self._steps = self._steps, None
        slot, self._slot = self._slot, None
        try:
            if steps is not None:
                steps.close()  # the loop's claims on the decoder, drafter and policy end
        finally:
            if slot is not None:
                self.host.slots.release(slot)

    def __del__(self) -> None:
        if self._slot is not None:
            self.close()
