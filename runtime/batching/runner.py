"""Continuous batching beneath the `Decoder` protocol: many requests, one model call a step.

Each request decodes in its own thread exactly as it would alone (`decode_steps`
with its own drafter, policy, sampler and seed) on a `BatchRow` (`rows.py`), a
`Decoder` that owns no KV buffers. A row's calls are jobs for one `BatchRunner` thread, which
combines the jobs of all rows into one call of the backend (`backend.py`): B rows, each appending its own block
(a plain step's token, or a pending token and k drafts) after its own valid length, every
block padded to the call's S with copies of its last token. Prefill is chunked and alternates
with the batched calls, so the running rows keep decoding while a prompt is read (the jobs that
came in during a chunk all run in the call after it): a prefill call reads up to
`prefill_chunk` prompt tokens in all, from every row with a prompt waiting, oldest first (one
call of several prompts shares the cost of reading the weights that each chunk pays).

- **Rows join and leave between calls.** A row takes the lowest free row of the KV pool at its
  first job and gives it back when its request ends (`release`); the runner then moves the
  highest occupied row into the hole, so the occupied rows are always 0..n-1 and a call covers
  them without gaps.
- **The barrier.** The runner calls as soon as every decoding row has a job waiting, or when
  the first job has waited half a recent call's duration (at least `gather_seconds`): a row
  that joins a call adds a fraction of its cost, one that misses it costs a call of its own,
  and without the wait rows fall out of step for good (each call's rows come back while the
  other rows' call runs). A row without a job (still drafting, or prefilling) rides along
  with padding tokens written past its valid length, where nothing reads them; its cache is
  unchanged.
- **Lossless per row.** A row's logits are bitwise those of its solo decode (the backend's
  calls are row-invariant), so each request's output is what it would be alone, at every
  temperature; the per-row sampling is the request's own.
- **Failures stay in their row.** Non-finite logits fail only the row they appear in; an
  error of the whole call fails the jobs in it, and the runner goes on.
- **Prompts that start the same** (`prefix_cache_bytes`, `prompts.PromptPrefixes`): a prompt
  read into an empty row is kept in a `PrefixCache`, and a later prompt copies the keys and
  values of the tokens it shares with one instead of computing them (exact, as the calls are
  row-invariant). A prompt that shares a long prefix with an older one still being read waits
  for it.

The rows' capacity is the pool's less `max_verify_len`: a row carried along appends at most
that many padding tokens.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from .backend import BatchBackend
from .rows import BatchJob, BatchRow, BatchStats
from ..errors import ModelBusyError, OrtspecError
from ..ort.graph_io import call_width
from .prefix_cache import PrefixCache
from .prompts import PromptPrefixes
from ..validation import check_int, non_finite_logits

GATHER_SECONDS = 0.003  # the least a call waits for the decoding rows that have no job yet
WAIT_FRACTION = 0.5  # ... and the most, as a fraction of a recent batched call's duration
CALL_ALPHA = 0.2  # weight of the newest call in that recent duration
BATCH_PREFILL_TOKENS = 128  # prompt tokens one prefill call reads, of all rows (the others decode)
IDLE_SECONDS = 1.0  # an idle runner thread checks this often whether its model is still used

log = logging.getLogger("ortspec.batching")


class BatchRunner:
    """Runs every row's calls on one thread, as batched calls of `backend`."""

    def __init__(self, backend: BatchBackend, *, max_verify_len: int,
                 gather_seconds: float = GATHER_SECONDS, prefill_chunk: int = BATCH_PREFILL_TOKENS,
                 prefix_cache_bytes: int = 0) -> None:
        check_int("max_verify_len", max_verify_len, minimum=1)
        self.backend = backend
        self.max_verify_len = min(int(max_verify_len), backend.max_call)
        self.gather_seconds = float(gather_seconds)
        check_int("prefill_chunk", prefill_chunk, minimum=1)
        self.prefill_chunk = int(prefill_chunk)  # prompt tokens a prefill call reads in all
        self.stats = BatchStats()
        # prompts' keys and values kept for later prompts that start the same (0: none)
        self.prefixes = PromptPrefixes(PrefixCache(prefix_cache_bytes), backend, self.stats) \
            if prefix_cache_bytes else None
        self._cond = threading.Condition()
        self._slots: list[BatchRow | None] = [None] * backend.max_rows  # pool row -> its row
        self._jobs: dict[BatchRow, BatchJob] = {}  # decode jobs waiting for the next call
        self._prefills: collections.deque[BatchJob] = collections.deque()
        self._releases: list[BatchRow] = []
        self._tasks: collections.deque[
            tuple[Callable[[BatchBackend, np.ndarray], Any], BatchJob]] = collections.deque()
        self._decoding: set[BatchRow] = set()  # rows expected at the next call
        self._first_wait: float | None = None  # when the oldest waiting decode job arrived
        self._call_seconds = 0.0  # running average of the batched calls' durations
        self._free_since = time.monotonic()  # when the runner's last call ended
        self._context = 0  # active_context, as of the last call
        self._thread: threading.Thread | None = None
        self._closed = False
        # told of every decode call, on the runner's thread, by keyword: rows (with a job),
        # span (rows the call covers), tokens (in all), widest (block), context (the rows'
        # mean length before it) and seconds (the draft-length policy's BatchCorrection)
        self.call_listener: Callable[..., None] | None = None

    @property
    def active_rows(self) -> int:
        """Rows decoding now (at least 1): what a row's draft-length policy prices a call at.
        Read without the lock (a set's size is read whole), as every row does every step."""
        return max(1, len(self._decoding))

    @property
    def active_context(self) -> int:
        """The mean valid length of the rows that held a row of the pool after the last call
        (0 with none): the context a row's draft-length policy prices a call at (a row that has
        just read its prompt counts before its first decode job). Set by the runner's thread
        after each call, read without the lock."""
        return self._context

    def _note_context(self) -> None:
        """On the runner's thread, after a call: `active_context` now."""
        rows = [r for r in self._slots if r is not None]
        self._context = sum(r.length for r in rows) // len(rows) if rows else 0

    def row(self) -> "BatchRow":
        return BatchRow(self)

    def exclusive(self, fn: "Callable[[BatchBackend, np.ndarray], Any]") -> Any:
        """fn(backend, floors) on the runner's thread between calls, no row's call running
        meanwhile (measuring the cost surface); its result, or its exception. floors
        [max_rows] are the rows' valid lengths: fn may write past them, never below."""
        job = BatchJob(None, np.zeros(0, np.int64), prefill=False)  # type: ignore[arg-type]
        with self._cond:
            self._start()
            self._tasks.append((fn, job))
            self._cond.notify_all()
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.result

    def _start(self) -> None:
        if self._closed:
            raise OrtspecError("the batch runner has been closed")
        if self._thread is None:
            # the thread holds the runner weakly between iterations, so a model nobody
            # references any more is collected and its thread ends
            self._thread = threading.Thread(target=_serve, args=(weakref.ref(self),),
                                            name="ortspec-batch", daemon=True)
            self._thread.start()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()

    # -- called by rows (their request threads) --------------------------------------------------

    def submit(self, job: BatchJob) -> np.ndarray:
        """Queue a row's job and wait for it: its logits, or its error raised."""
        with self._cond:
            self._start()
            if job.prefill:
                self._decoding.discard(job.row)
                self._prefills.append(job)
                wake = True
            else:
                self._decoding.add(job.row)
                self._jobs[job.row] = job
                # the runner wakes for the first job (its wait starts) and for the one that
                # completes the batch; those in between would only wake it to wait again
                wake = self._first_wait is None or len(self._jobs) >= len(self._decoding)
                if self._first_wait is None:
                    self._first_wait = time.monotonic()
            if wake:
                self._cond.notify_all()
        job.done.wait()
        if job.error is not None:
            raise job.error
        assert job.result is not None
        return job.result

    def release(self, row: BatchRow) -> None:
        """A row's request is over: its pool row is given back before the next call."""
        with self._cond:
            self._decoding.discard(row)
            if row.index is not None:
                self._releases.append(row)
                self._cond.notify_all()

    # -- the runner thread -----------------------------------------------------------------------

    def _step(self) -> bool:
        """One iteration of the runner thread: a task, or a prefill chunk and/or a batched
        call, or nothing after IDLE_SECONDS; False once the runner is closed."""
        with self._cond:
            task = self._tasks.popleft() if self._tasks else None
        if task is not None:
            fn, job = task
            floors = np.array([0 if r is None else r.length for r in self._slots], np.int64)
            try:
                job.result = fn(self.backend, floors)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                job.error = e
            job.done.set()
            return True
        with self._cond:
            prefills, jobs = self._next_work()
            if prefills is None and jobs is None:
                return False
            for job in list(prefills or ()) + list(jobs or ()):
                self._place(job)
        if prefills:
            self._prefill_call(prefills)
            # the rows whose jobs came in during the chunk join the call that follows it, so
            # a prompt being read does not split the decoding rows into two calls
            with self._cond:
                jobs = self._take_jobs()
                for job in jobs:
                    self._place(job)
        if jobs:
            self._decode_call(jobs)
        with self._cond:
            self._free_since = time.monotonic()
            self._note_context()
            if prefills:
                self._prefills = collections.deque(j for j in self._prefills
                                                   if not j.done.is_set())
        return True

    def _next_work(self) -> tuple[list[BatchJob] | None, list[BatchJob] | None]:
        """Under the lock: wait for prompts to read (the prefill jobs waiting, oldest first) or
        a full (or timed-out) batch of decode jobs; (None, None) when closed, (None, []) for a
        task or after IDLE_SECONDS with nothing to do."""
        idle_since = time.monotonic()
        while True:
            self._apply_releases()
            if self._closed:
                return None, None
            if self._tasks:
                return None, []
            prefills = list(self._prefills) or None
            if self._jobs:
                waiting = [r for r in self._decoding if r not in self._jobs]
                patience = max(self.gather_seconds, WAIT_FRACTION * self._call_seconds)
                # the wait counts from when a job arrived or the last call ended, the later:
                # jobs that came in during a call have not waited for the rows in it
                start = max(self._first_wait or 0.0, self._free_since)
                late = time.monotonic() - start >= patience
                if prefills:  # their chunks first; the decode jobs after them
                    return prefills, None
                if not waiting or late:
                    return None, self._take_jobs()
                self._cond.wait(max(0.0, patience - (time.monotonic() - start)))
                continue
            if prefills:
                return prefills, None
            if time.monotonic() - idle_since >= IDLE_SECONDS:
                return None, []
            self._cond.wait(IDLE_SECONDS)

    def _take_jobs(self) -> list[BatchJob]:
        """Under the lock: the decode jobs waiting now, for the next call."""
        jobs = list(self._jobs.values())
        self._jobs.clear()
        self._first_wait = None
        return jobs

    def _apply_releases(self) -> None:
        for row in self._releases:
            i = row.index
            if i is None or self._slots[i] is not row:
                continue
            row.index = None
            last = max(j for j, r in enumerate(self._slots) if r is not None)
            self._slots[i] = None
            # where an empty row costs a call nothing it stays empty until a request takes it;
            # else the occupied rows are kept contiguous: the last one fills the hole
            if last != i and not self.backend.rows_in_place:
                moved = self._slots[last]
                assert moved is not None
                self.backend.move(last, i, moved.length)
                self._slots[i], self._slots[last] = moved, None
                moved.index = i
        self._releases.clear()

    def _place(self, job: BatchJob) -> None:
        row = job.row
        if row.index is None:
            try:
                row.index = self._slots.index(None)
            except ValueError:
                job.error = ModelBusyError(f"all {self.backend.max_rows} rows of the batch are in use")
                job.done.set()
                return
            self._slots[row.index] = row

    def _prefill_call(self, waiting: list[BatchJob]) -> None:
        """One call reading the next chunks of the waiting prompts (see `_prefill_plan`)."""
        plan = self._prefill_plan([j for j in waiting if not j.done.is_set()])
        if not plan:
            return
        lo, hi, s = self._prefill_span(plan)
        ids = np.zeros((hi - lo, s), np.int64)  # rows riding along append zeros, never read
        lengths = np.array([0 if r is None else r.length for r in self._slots[lo:hi]], np.int64)
        real, take = [], []  # flat positions: each job's chunk; its last (or every) position
        for job, n in plan:
            r = job.row.index - lo  # type: ignore[operator]
            _pad_into(ids[r], job.tokens[job.offset: job.offset + n])
            real.append(r * s + np.arange(n))
            take.append(real[-1] if job.keep_all else real[-1][-1:])
        try:
            t0 = time.perf_counter()
            logits = self.backend.run(lo, hi, ids, lengths, take=np.concatenate(take),
                                      real=np.concatenate(real))
            self.stats.record_seconds(prefill=True, seconds=time.perf_counter() - t0)
        except BaseException as e:  # noqa: BLE001 - handed to the rows' threads
            for job, _ in plan:
                self._fail_prefill(job, e)
            return
        hidden = self._hidden()
        first = 0
        for (job, n), rows in zip(plan, take, strict=True):
            got = logits[first: first + rows.size]  # [1 or n, vocab]
            got_hidden = None if hidden is None else hidden[first: first + rows.size]
            first += rows.size
            row = job.row
            error = non_finite_logits(  # the rows read (a prompt chunk: its last)
                got, first_position=row.length + (0 if job.keep_all else n - 1))
            if error is not None:
                self._fail_prefill(job, error)
                continue
            row.length += n
            job.offset += n
            if not job.keep_all:  # only the last chunk's row is the result
                job.parts, job.hidden_parts = [], []
            job.parts.append(got.copy())
            if got_hidden is not None:
                job.hidden_parts.append(got_hidden.copy())
            if job.offset >= job.tokens.size:
                if self.prefixes is not None:
                    self.prefixes.keep(job)
                job.result = np.concatenate(job.parts) if job.keep_all else job.parts[-1][0]
                if job.hidden_parts:
                    job.hidden = np.concatenate(job.hidden_parts)
                job.done.set()

    def _prefill_plan(self, jobs: list[BatchJob]) -> list[tuple[BatchJob, int]]:
        """(job, tokens it reads) for the next prefill call, in row order: the jobs oldest
        first, each its remaining tokens (at most the backend's `max_call`), while the call's
        `prefill_chunk` lasts. A job that
        wants every position's logits (a long block, not a prompt) runs alone. A job joins
        only if every row the call then covers has room for S positions past its valid length
        (the oldest job alone always has: its row's capacity holds its prompt)."""
        plan: list[tuple[BatchJob, int]] = []
        budget = self.prefill_chunk
        for k, job in enumerate(jobs):
            if budget <= 0 or (plan and job.keep_all):
                break
            if job.start is None and self.prefixes is not None \
                    and self.prefixes.waits(job, jobs[:k]):
                continue
            self._begin_prefill(job)
            n = min(job.tokens.size - job.offset, budget, self.backend.max_call)
            trial = sorted(plan + [(job, n)], key=lambda p: p[0].row.index)  # type: ignore
            lo, hi, s = self._prefill_span(trial)
            if any(r is not None and r.length + s > self.backend.capacity
                   for r in self._slots[lo:hi]):
                assert plan, "a prompt's first chunk always fits its row"
                continue
            plan, budget = trial, budget - n
            if job.keep_all:
                break
        return plan

    def _prefill_span(self, plan: list[tuple[BatchJob, int]]) -> tuple[int, int, int]:
        """(lo, hi, S) of the call for a plan in row order: the rows from its first job's to
        its last's, and its longest chunk (a single token padded to min_rows)."""
        lo, hi = plan[0][0].row.index, plan[-1][0].row.index + 1  # type: ignore[operator]
        return lo, hi, call_width(1, max(n for _, n in plan), self.backend.min_rows)

    def _begin_prefill(self, job: BatchJob) -> None:
        """A prefill's first call: the row's length is noted, and a prompt on an empty row
        starts from the longest cached prefix it has."""
        if job.start is None:
            job.start = job.row.length
            if self.prefixes is not None:
                self.prefixes.reuse(job)

    def _fail_prefill(self, job: BatchJob, error: BaseException) -> None:
        assert job.start is not None
        job.row.length = job.start
        job.error = error
        job.done.set()

    def _decode_call(self, jobs: list[BatchJob]) -> None:
        jobs = [j for j in jobs if not j.done.is_set()]
        if not jobs:
            return
        by_index = {j.row.index: j for j in jobs}
        hi = max(by_index) + 1  # type: ignore[type-var]
        s = call_width(hi, max(j.tokens.size for j in jobs), self.backend.min_rows)
        ids = np.zeros((hi, s), np.int64)
        lengths = np.zeros(hi, np.int64)
        # the positions whose logits come back: each job's own tokens, not its padding, and
        # nothing of the rows riding along; job i's rows start at offsets[i] of the result
        order = sorted(by_index)
        take = np.concatenate([i * s + np.arange(by_index[i].tokens.size) for i in order])
        offsets = dict(zip(order, np.cumsum([0] + [by_index[i].tokens.size for i in order])))
        for i in range(hi):
            row = self._slots[i]
            lengths[i] = row.length if row is not None else 0
            job = by_index.get(i)
            if job is not None:  # (a row without a job rides along on zeros, written past
                _pad_into(ids[i], job.tokens)  # its valid length and never read)
        self.stats.record(rows=len(jobs), width=s, padded=hi - len(jobs))
        try:
            t0 = time.perf_counter()
            # the jobs' own tokens are the positions computed: padding and rows riding along
            # need no MatMul rows (take is ascending: rows in order, each its tokens in order)
            logits = self.backend.run(0, hi, ids, lengths, take=take, real=take)
            seconds = time.perf_counter() - t0
            self._call_seconds += CALL_ALPHA * (seconds - self._call_seconds)
            self.stats.record_seconds(prefill=False, seconds=seconds)
        except BaseException as e:  # noqa: BLE001 - every job of the call gets the error
            for job in jobs:
                job.error = e
                job.done.set()
            return
        # one copy and one finiteness check for the whole call, each job's rows a view of it;
        # the rows woken only once every job has its result, so that their threads do not take
        # the interpreter from the runner while it hands results out; whatever fails here
        # fails the jobs left without a result, and every job is woken
        try:
            hidden = self._hidden()
            results = logits.copy()  # [N, vocab]
            finite = bool(np.isfinite(results).all())
            for i, job in by_index.items():
                n = job.tokens.size
                rows = results[offsets[i]:offsets[i] + n]
                row = job.row
                row.ort_seconds += seconds
                error = None if finite else non_finite_logits(rows, first_position=row.length)
                if error is not None:
                    job.error = error
                else:
                    job.result = rows
                    if hidden is not None:
                        job.hidden = hidden[offsets[i]:offsets[i] + n].copy()
                    row.length += n
        except Exception as e:  # noqa: BLE001 - handed to the jobs without a result
            log.exception("handing out the results of a batched call failed")
            for job in jobs:
                if job.result is None and job.error is None:
                    job.error = e
        finally:
            for job in jobs:
                job.done.set()
        if self.call_listener is not None:  # (after the rows have their results)
            try:
                self.call_listener(rows=len(jobs), span=hi, tokens=int(take.size),
                                   widest=max(j.tokens.size for j in jobs),
                                   context=int(lengths[order].sum()) // len(order),
                                   seconds=seconds)
            except Exception:  # noqa: BLE001 - a listener's fault must not stop the runner
                log.exception("the batch runner's call listener failed")

    def _hidden(self) -> np.ndarray | None:
        """The last call's hidden states [N, K * hidden], rows as its logits'; None where the
        backend returns none."""
        return None if self.backend.hidden_state_layers is None else self.backend.last_hidden()


def _pad_into(out: np.ndarray, tokens: np.ndarray) -> None:
    """out [S] = tokens [n <= S], then copies of the last token (what the padded rows compute
    is past the row's valid length and dropped)."""
    out[:tokens.size] = tokens
    out[tokens.size:] = tokens[-1]


def _serve(ref: "weakref.ref[BatchRunner]") -> None:
    """The runner thread: iterations of `BatchRunner._step`, the runner held only during one."""
    while True:
        runner = ref()
        if runner is None or not runner._step():
            return
        del runner
