"""`Engine`: requests admitted through a bounded queue, decoded in worker threads.

The event loop never decodes. A request takes a place in `Admission` (running up to
`max_running`, then waiting up to `max_waiting`, else `QueueFull`), then one worker thread runs
its whole decode (`Model.start`, its tokens turned into text by a `Detokenizer`, with stop
strings matched on the text) and hands each piece
of text back to the loop (pieces that arrive while the loop is busy go out as one; a request
not streamed gets its whole text at the end, waking the loop once). When the client goes away
the consumer sets the request's cancel event; the worker stops after the step in progress and
closes the stream, which gives the model's decode slot back, and only then is the place in
`Admission` released.

A decode cut short (a stop string, a client gone) still reports what it did: the token stream's
`.tokens` and `.counters` hold what was emitted and counted up to the close.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import os
import threading
import time
from typing import AsyncIterator, Callable

from ..decoding.counters import DecodeCounters
from ..model import DEFAULT_MAX_CONCURRENT, Model
from ..ort import manifest as mf
from ..decoding.text import Detokenizer
from .metrics import ServerMetrics
from .protocol import GenerationRequest, finish_reason
from .stops import StopMatcher, tokens_through

# requests a batching model decodes at once by default: its calls carry them together, and on
# the default model's window export a token cost 3.35 ms of batched calls at 8 rows against
# 6.03 ms at 4 (the model's cost surface, a 2-core AVX-512 VNNI CPU); 8 KV slots of the
# default model take about 0.9 GiB
BATCHED_MAX_CONCURRENT = 8


def default_max_concurrent(path: str | os.PathLike) -> int:
    """--max-concurrent when it is not given: BATCHED_MAX_CONCURRENT (at most the graph's
    max_batch) for a model whose graph batches requests, else DEFAULT_MAX_CONCURRENT. A
    manifest that cannot be read gives the latter (loading the model then says why)."""
    try:
        max_batch = mf.read_manifest(path, verify_checksums=False).max_batch
    except mf.ManifestError:
        return DEFAULT_MAX_CONCURRENT
    return min(BATCHED_MAX_CONCURRENT, max_batch) if max_batch > 1 else DEFAULT_MAX_CONCURRENT


class QueueFull(Exception):
    """Every decode place is taken and the waiting queue is full."""


class Ticket:
    """One request's place in `Admission`: granted at once or queued. `release` is idempotent.

    Once a worker decodes the request (`in_work`), the engine releases the place when the worker
    has finished; before that, `abandon` (a request that never started) releases it."""

    def __init__(self, admission: "Admission", granted: asyncio.Future) -> None:
        self._admission, self._granted = admission, granted
        self._released = False
        self.in_work = False

    def abandon(self) -> None:
        if not self.in_work:
            self.release()

    async def wait(self) -> None:
        try:
            await self._granted
        except asyncio.CancelledError:
            self.release()
            raise

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        if self._granted.done() and not self._granted.cancelled():
            self._admission._leave()
        else:
            self._admission._abandon(self._granted)


class Admission:
    """Running and waiting places, first come first served; used from the event loop only."""

    def __init__(self, *, max_running: int, max_waiting: int) -> None:
        self.max_running, self.max_waiting = max_running, max_waiting
        self.running = 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def ticket(self) -> Ticket:
        granted = asyncio.get_running_loop().create_future()
        if self.running < self.max_running and not self._waiters:
            self.running += 1
            granted.set_result(None)
        elif len(self._waiters) < self.max_waiting:
            self._waiters.append(granted)
        else:
            raise QueueFull(f"{self.running} requests are running and {self.waiting} waiting "
                            f"(--max-concurrent {self.max_running}, --max-queue {self.max_waiting})")
        return Ticket(self, granted)

    def _leave(self) -> None:
        self.running -= 1
        while self._waiters:
            nxt = self._waiters.popleft()
            if not nxt.done():
                self.running += 1
                nxt.set_result(None)
                break

    def _abandon(self, granted: asyncio.Future) -> None:
        if granted in self._waiters:
            self._waiters.remove(granted)
        granted.cancel()


@dataclasses.dataclass(frozen=True)
class Piece:
    text: str


@dataclasses.dataclass(frozen=True)
class Outcome:
    finish_reason: str  # "stop", "length", or "cancelled" (the client went away)
    # tokens of the answer; after a stop string, those up to the one that completed it (what
    # any drafter, or none, gives for the same text), not those the last step made past it
    completion_tokens: int
    counters: DecodeCounters  # what the decode did, up to where it ended or was closed
    text: str | None = None  # a request not streamed: its whole text (no pieces were sent)


_END = object()  # the worker's last message to the loop
_FIRST = object()  # a request not streamed: the first text exists (time to first token)


class Engine:
    def __init__(self, model: Model, *, drafter: str, max_concurrent: int, max_queue: int) -> None:
        self.model, self.drafter = model, drafter
        self.admission = Admission(max_running=max_concurrent, max_waiting=max_queue)
        runner = model.runner  # its BatchRunner when it batches
        self.metrics = ServerMetrics(running=lambda: self.admission.running,
                                     waiting=lambda: self.admission.waiting,
                                     batch=runner.stats if runner is not None else None,
                                     prefixes=model.prefix_counts)
        self.executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_concurrent, thread_name_prefix="ortspec-decode")

    def admit(self) -> Ticket:
        """A place for one request, or QueueFull; decided at once, before any response starts."""
        return self.admission.ticket()

    async def run(self, request: GenerationRequest, ticket: Ticket, arrived: float
                  ) -> AsyncIterator[Piece | Outcome]:
        """Text pieces as they are decoded, then the `Outcome`; for a request not streamed,
        only the `Outcome`, with the text (the loop is then woken once, not once a piece).
        Closing this generator early (the client disconnected) cancels the decode and frees
        its slot."""
        loop = asyncio.get_running_loop()
        inbox: collections.deque = collections.deque()  # the worker's messages, in order
        arrived_mail = asyncio.Event()
        cancel = threading.Event()

        def deliver(item: object) -> None:  # on the loop
            inbox.append(item)
            arrived_mail.set()

        def post(item: object) -> None:  # from the worker thread
            try:
                loop.call_soon_threadsafe(deliver, item)
            except RuntimeError:  # the loop has closed: nobody is listening any more
                cancel.set()

        await ticket.wait()
        try:
            work = loop.run_in_executor(self.executor, self._work, request, post, cancel)
        except BaseException:
            ticket.release()
            raise
        ticket.in_work = True
        work.add_done_callback(lambda f: self._done(f, ticket, request, arrived))
        first = True
        try:
            while True:
                while not inbox:
                    arrived_mail.clear()
                    await arrived_mail.wait()
                # what arrived since the last look: the pieces in one chunk (when the loop fell
                # behind the decode), then the end
                items = list(inbox)
                inbox.clear()
                if first and any(i is _FIRST or isinstance(i, Piece) for i in items):
                    self.metrics.ttft.observe(time.perf_counter() - arrived)
                    first = False
                text = "".join(i.text for i in items if isinstance(i, Piece))
                if text:
                    yield Piece(text)
                if _END in items:
                    break
            yield await work  # the worker's exception, if it failed
        finally:
            cancel.set()

    def _done(self, work: asyncio.Future, ticket: Ticket, request: GenerationRequest,
              arrived: float) -> None:
        ticket.release()
        if work.cancelled() or work.exception() is not None:
            return
        outcome: Outcome = work.result()
        cancelled = outcome.finish_reason == "cancelled"
        self.metrics.finished(reason="abort" if cancelled else outcome.finish_reason,
                              prompt_tokens=len(request.prompt_ids),
                              completion_tokens=outcome.completion_tokens,
                              counters=outcome.counters,
                              seconds=None if cancelled else time.perf_counter() - arrived)

    def _work(self, request: GenerationRequest, post: Callable[[object], None],
              cancel: threading.Event) -> Outcome:
        try:
            return self._decode(request, post, cancel)
        finally:
            post(_END)

    def _decode(self, request: GenerationRequest, post: Callable[[object], None],
                cancel: threading.Event) -> Outcome:
        # checked by the protocol (check_request) already; the request's set-up is done here
        stream = self.model.start(request.prompt_ids, drafter=self.drafter,
                                  options=request.options)
        detok = Detokenizer(self.model.decode)
        matcher = StopMatcher(request.stop)
        texts: list[str] = []  # a request not streamed: its text, sent once at the end

        def emit(text: str) -> None:
            if request.stream:
                post(Piece(text))
            else:
                if not texts:
                    post(_FIRST)
                texts.append(text)

        cancelled = False
        try:
            for ids in stream:  # the tokens of one target call
                if cancel.is_set():
                    cancelled = True
                    break
                if (piece := detok.add(ids)) and (out := matcher.feed(piece)):
                    emit(out)
                if matcher.stopped:
                    break
            else:  # the decode ended: the text its last token completed, if any
                assert stream.result is not None
                if (tail := detok.finish(stream.result.text)) and (out := matcher.feed(tail)):
                    emit(out)
        finally:
            stream.close()  # a stream cut short gives its slot back here
        if cancelled:
            return Outcome("cancelled", len(stream.tokens), stream.counters)
        if matcher.stopped:
            n = tokens_through(self.model.decode, stream.tokens, matcher.through)
            return Outcome("stop", n, stream.counters, "".join(texts))
        if tail := matcher.flush():
            emit(tail)
        result = stream.result
        assert result is not None
        return Outcome(finish_reason(result.finish_reason), result.num_tokens, result.counters,
                       "".join(texts))

    def close(self) -> None:
        self.executor.shutdown(wait=True)
