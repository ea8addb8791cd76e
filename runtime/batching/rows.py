"""The rows' side of batched decoding: the `Decoder` a request decodes on, and what it hands
the runner.

A `BatchRow` owns no KV buffers: each call it makes (`forward_token`, `forward_batch`,
`prefill`) becomes a `BatchJob` for its `BatchRunner` (`runner.py`), which runs it in a
shared call and hands back the logits or the error. `BatchStats` counts what the runner did,
for /metrics and benchmarks.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from ..decoding.protocols import last_hidden_copy
from ..validation import check_token_block, check_truncate_length
from .backend import BatchBackend


class Signal:
    """A one-shot flag: `set` once by the runner's thread, `wait`ed for by the thread that
    submitted the job. A lock held from creation and released by `set`: threading.Event's set
    and wait run a Condition in Python, on a path every row of every call takes."""

    __slots__ = ("_lock", "_set")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._set = False

    def set(self) -> None:
        if not self._set:
            self._set = True
            self._lock.release()

    def is_set(self) -> bool:
        return self._set

    def wait(self) -> None:
        with self._lock:
            pass


@dataclasses.dataclass(eq=False)
class BatchJob:
    row: "BatchRow"
    tokens: np.ndarray  # [n] int64
    prefill: bool  # read in prefill calls (chunked); else one row of a batched decode call
    keep_all: bool = True  # return every position's logits (else the last one's)
    offset: int = 0  # prefill: tokens fed so far
    start: int | None = None  # prefill: the row's length before it (restored on failure)
    parts: list = dataclasses.field(default_factory=list)
    hidden_parts: list = dataclasses.field(default_factory=list)  # as parts, of the states
    result: np.ndarray | None = None
    hidden: np.ndarray | None = None  # [rows of result, K * hidden] where the backend has them
    error: BaseException | None = None
    done: Signal = dataclasses.field(default_factory=Signal)


@dataclasses.dataclass
class BatchStats:
    """What the runner did: calls by rows and by S, and the seconds its calls took (for /metrics
    and benchmarks)."""

    calls: int = 0
    prefill_calls: int = 0
    decode_seconds: float = 0.0  # in the backend's decode calls
    prefill_seconds: float = 0.0  # ... and its prefill calls (prompt chunks read)
    padded_rows: int = 0  # rows carried along without a job
    prefix_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0  # ... and found there (copied, not computed)
    rows: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    widths: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def record(self, *, rows: int, width: int, padded: int) -> None:
        with self._lock:
            self.calls += 1
            self.rows[rows] += 1
            self.widths[width] += 1
            self.padded_rows += padded

    def record_seconds(self, *, prefill: bool, seconds: float) -> None:
        """A backend call took `seconds`: a prefill call (counted here) or a decode call
        (counted by `record`)."""
        with self._lock:
            if prefill:
                self.prefill_calls += 1
                self.prefill_seconds += seconds
            else:
                self.decode_seconds += seconds

    def seconds_snapshot(self) -> tuple[int, float, int, float]:
        """(decode calls, their seconds, prefill calls, their seconds)."""
        with self._lock:
            return self.calls, self.decode_seconds, self.prefill_calls, self.prefill_seconds

    def record_prefix(self, *, queried: int, hit: int) -> None:
        with self._lock:
            self.prefix_queried_tokens += queried
            self.prefix_hit_tokens += hit

    def prefix_snapshot(self) -> tuple[int, int]:
        """(prompt tokens looked up in the prefix cache, those found there)."""
        with self._lock:
            return self.prefix_queried_tokens, self.prefix_hit_tokens

    def snapshot(self) -> tuple[dict[int, int], dict[int, int], int]:
        """(calls by rows, calls by S, padded rows), consistent with each other."""
        with self._lock:
            return dict(self.rows), dict(self.widths), self.padded_rows



class RowHost(Protocol):
    """What a row needs of the runner that batches its calls (`runner.BatchRunner` is one)."""

    backend: BatchBackend
    max_verify_len: int

    def submit(self, job: BatchJob) -> np.ndarray:
        """Queue the job, wait for its call, return its logits [rows asked for, vocab]."""
        ...

    def release(self, row: BatchRow) -> None:
        """The row's request is over: its pool row goes back before the next call."""
        ...


class BatchRow:
    """A `Decoder` whose calls the runner batches with the other rows' (one request at a time,
    like any decoder). `release` gives its pool row back when the request ends."""

    def __init__(self, runner: RowHost) -> None:
        self.runner = runner
        backend = runner.backend
        self.vocab_size: int = backend.vocab_size
        self.max_verify_len: int = runner.max_verify_len
        # a row carried along in someone else's call appends up to max_verify_len tokens
        self.capacity: int = backend.capacity - runner.max_verify_len
        self.ort_seconds = 0.0  # time of the calls this row took part in
        self.length = 0  # set by this row's thread (truncate, reset) and by the runner
        self.index: int | None = None  # its row of the pool (the runner's to change)
        # a `HiddenStateSource` where the backend returns hidden states (a draft head's target)
        self.hidden_state_layers: tuple[int, ...] | None = backend.hidden_state_layers
        self._last_hidden: np.ndarray | None = None  # [rows, K * hidden] of the last call

    def reset(self) -> None:
        self.length = 0
        self._last_hidden = None

    def truncate(self, length: int) -> None:
        self.length = check_truncate_length(length, self.length)

    def forward_token(self, token: int) -> np.ndarray:  # [vocab]
        return self._submit(BatchJob(self, self._check([token]), prefill=False))[0]

    def forward_batch(self, tokens: Sequence[int]) -> np.ndarray:  # [n, vocab]
        ids = self._check(tokens)
        return self._submit(BatchJob(self, ids, prefill=ids.size > self.max_verify_len))

    def prefill(self, tokens: Sequence[int]) -> np.ndarray:  # [vocab]
        return self._submit(BatchJob(self, self._check(tokens), prefill=True, keep_all=False))

    def last_hidden_states(self) -> np.ndarray:  # [rows, K * hidden]
        """The hidden states of the rows whose logits the last forward_token / forward_batch /
        prefill returned (`HiddenStateSource`), as `OrtDecoder.last_hidden_states` gives them."""
        return last_hidden_copy(
            self._last_hidden, unavailable=None if self.hidden_state_layers is not None else
            "this batched model returns no hidden states (export it with `--draft-head` or "
            "`--hidden-states`)")

    def _submit(self, job: BatchJob) -> np.ndarray:
        self._last_hidden = None
        result = self.runner.submit(job)
        self._last_hidden = job.hidden
        return result

    def release(self) -> None:
        """The request is over: the pool row goes back (the cache is dropped)."""
        self.length = 0
        self.runner.release(self)

    def _check(self, tokens: Sequence[int]) -> np.ndarray:
        return check_token_block(tokens, vocab_size=self.vocab_size, length=self.length,
                                 capacity=self.capacity)

    def __repr__(self) -> str:
        return f"BatchRow(index={self.index}, length={self.length}, capacity={self.capacity})"
