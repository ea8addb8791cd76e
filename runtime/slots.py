"""`SlotPool`: the bounded pool of per-request decode state a loaded model hands out.

A slot is one request's KV state: a target `OrtDecoder` with its own KV buffers over the
model's shared sessions, and a draft one when the model has a draft (on the target's buffers
when the two share a layout, `Model.draft_shares_kv`; else on its own). Slots are made on first
need, up to `max_slots`, and reused afterwards, so a model that serves one request at a time
holds one. A request that finds every slot taken waits for one (`when_busy="wait"`, optionally
for at most `timeout` seconds) or is refused at once (`when_busy="error"`) with ModelBusyError.
A thread that already holds every slot and asks for another would wait forever (interleaved
streams in one thread): that is refused at once too.

Memory per slot (fp32 SmolLM2-135M at capacity 2048): 30 layers x 2 x [1, 3, 2048, 64] float32
KV = 90 MiB, plus a logits buffer of 128 x 49152 float32 = 24 MiB for chunked prefills.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from typing import Callable, Iterator, Literal

from .batching.rows import BatchRow
from .errors import InvalidOptionError, ModelBusyError
from .ort.decoder import OrtDecoder
from .validation import check_int

WhenBusy = Literal["wait", "error"]
WHEN_BUSY = ("wait", "error")


@dataclasses.dataclass
class DecodeSlot:
    decoder: OrtDecoder | BatchRow  # a row of the model's batch when it batches
    draft: OrtDecoder | BatchRow | None = None  # a row of the draft's batch when it batches

    def end_request(self) -> None:
        """The request on this slot is over: a batch row gives its row of the KV pool back."""
        for decoder in (self.decoder, self.draft):
            if isinstance(decoder, BatchRow):
                decoder.release()


class SlotPool:
    def __init__(self, make: Callable[[], DecodeSlot], *, max_slots: int, when_busy: WhenBusy = "wait",
                 timeout: float | None = None) -> None:
        check_int("max_concurrent", max_slots, minimum=1)
        if when_busy not in WHEN_BUSY:
            raise InvalidOptionError(f"when_busy must be one of {', '.join(WHEN_BUSY)}, got {when_busy!r}")
        if timeout is not None and not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
                                        and timeout >= 0):
            raise InvalidOptionError(f"busy_timeout must be None or a number of seconds >= 0, got {timeout!r}")
        self._make = make
        self.max_slots = int(max_slots)
        self.when_busy: WhenBusy = when_busy
        self.timeout = timeout
        self._free: list[DecodeSlot] = []
        self._made = 0
        self._held_by: dict[int, int] = {}  # id(slot) -> the thread that took it
        self._cond = threading.Condition()

    @property
    def in_use(self) -> int:
        with self._cond:
            return self._made - len(self._free)

    @property
    def made(self) -> int:
        return self._made

    @contextlib.contextmanager
    def slot(self) -> Iterator[DecodeSlot]:
        """A slot for the duration of the `with` block."""
        slot = self.acquire()
        try:
            yield slot
        finally:
            self.release(slot)

    def acquire(self) -> DecodeSlot:
        """A slot, held until `release(slot)` (what a request's stream does when it ends or is
        closed); waits or raises ModelBusyError as `when_busy` says."""
        me = threading.get_ident()
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        with self._cond:
            while not self._free and self._made >= self.max_slots:
                if self.when_busy == "error":
                    raise ModelBusyError(self._busy_message("when_busy='error'"))
                if sum(t == me for t in self._held_by.values()) >= self._made:
                    raise ModelBusyError(self._busy_message(
                        "all of them held by this thread, which would wait for itself"))
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise ModelBusyError(self._busy_message(f"waited {self.timeout} s"))
                self._cond.wait(remaining)
            if self._free:
                slot = self._free.pop()
                self._held_by[id(slot)] = me
                return slot
            self._made += 1  # reserved; made outside the lock (allocates the KV buffers)
        try:
            slot = self._make()
        except BaseException:
            with self._cond:
                self._made -= 1
                self._cond.notify()
            raise
        with self._cond:
            self._held_by[id(slot)] = me
        return slot

    def release(self, slot: DecodeSlot) -> None:
        """Give back a slot `acquire` returned."""
        slot.end_request()
        with self._cond:
            self._held_by.pop(id(slot), None)
            self._free.append(slot)
            self._cond.notify()

    def _busy_message(self, why: str) -> str:
        return (f"all {self.max_slots} decode slots of this model are in use ({why}); allow more "
                f"with load_model(..., max_concurrent=N) or finish a running request first")
