"""`OrtDraftHead`: a trained draft head (EAGLE-3) run by ONNX Runtime, behind `DraftHead`.

A head directory (head_config.py) holds two graphs: `fc`, the projection of the target's hidden
states, and `head`, one decoder layer with a KV cache of its own, the final norm and the LM head
over the draft vocabulary. Like `OrtDecoder`, the head's KV is one fixed-capacity OrtValue for
keys and one for values ([1, kv_heads, capacity, head_dim]), each bound through IOBinding as
both `past_key_values.0.*` and `present.0.*`, so GroupQueryAttention writes the new entries in
place; the cache length lives in Python, the attention mask is `length + n` ones, and `reset`
and `truncate` are integer assignments.

`forward(tokens, hidden, from_target=True)` runs fc on the target's states into the head's
input buffer and the head on it; `from_target=False` copies the given hidden states (the head's
own `hidden_out`, perhaps the very view the last call returned) there and runs the head alone. The outputs land in preallocated buffers whose views are
returned: valid until the next call.

The head's graph is built for the CPU (float32 GroupQueryAttention, which onnxruntime's CUDA
kernel does not run), so it opens on the CPU provider, with the caller's options for it when
the caller named it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from ..decoding.protocols import DecoderBase
from ..errors import ConcurrentUseError, InvalidOptionError
from ..validation import check_int, check_logits, check_token_block, check_truncate_length
from .graph_io import (ATTENTION_MASK, INPUT_IDS, LOGITS, past_key_name, past_value_name,
                       present_key_name, present_value_name)
from .head_config import AUX, HIDDEN, HIDDEN_OUT, HeadConfig, read_head_config, read_target_ids
from .providers import CPU, choose_providers
from .sessions import open_session, session_options


class HeadSessions:
    """The read-only half of a draft head: its checked head.json, target ids and the two
    sessions, shared by every `OrtDraftHead.on(sessions)` (onnxruntime runs one session from
    several threads, each with its own IOBinding)."""

    def __init__(self, head_dir: str | os.PathLike, *, providers: Any = None,
                 threads: int | None = None):
        self.head_dir = Path(head_dir)
        if threads is not None:
            check_int("threads", threads, minimum=0, what=" (0 = onnxruntime's default)")
        self.config: HeadConfig = read_head_config(self.head_dir)
        self.target_ids: np.ndarray = read_target_ids(self.head_dir, self.config)  # [Vd]
        self.providers = _cpu_providers(providers)
        # no spinning: the head's sessions share the cores with the target's
        self.fc, self.head = (
            open_session(str(self.head_dir / self.config.graphs[role]),
                     session_options(threads=threads, allow_spinning=False), self.providers)
            for role in ("fc", "head"))


class OrtDraftHead:
    """One draft head's state (KV buffers, bindings, length) over its two sessions.

    draft_vocab_size, target_ids ([Vd] int64), capacity: as `DraftHead` declares.
    hidden_size: H, the width of `hidden_out` and of a `from_target=False` input;
    aux_width: K * target_hidden, the width of a `from_target=True` input; layer_ids: the
    target layers those K states come from. `ort_seconds` / `ort_calls` count the time inside
    onnxruntime and the session runs.

    `OrtDraftHead(head_dir, ...)` opens sessions of its own; `OrtDraftHead.on(head.sessions)`
    makes another head (its own KV, length 0) over sessions already open: one per request."""

    def __init__(self, head_dir: str | os.PathLike, *, providers: Any = None,
                 threads: int | None = None):
        self._init(HeadSessions(head_dir, providers=providers, threads=threads))

    @classmethod
    def on(cls, sessions: HeadSessions) -> "OrtDraftHead":
        """A head with KV buffers of its own over `sessions` (shared, read-only)."""
        self = cls.__new__(cls)
        self._init(sessions)
        return self

    def _init(self, sessions: HeadSessions) -> None:
        self.sessions = sessions
        self.head_dir = sessions.head_dir
        c = self.config = sessions.config
        self.target_ids: np.ndarray = sessions.target_ids  # [Vd] int64
        self.draft_vocab_size: int = c.draft_vocab_size
        self.vocab_size: int = c.vocab_size
        self.capacity: int = c.capacity
        self.hidden_size: int = c.hidden_size
        self.aux_width: int = c.aux_width
        self.layer_ids: tuple[int, ...] = c.layer_ids
        self.providers = sessions.providers
        self._fc, self._head = sessions.fc, sessions.head
        self._length = 0
        self._busy = threading.Lock()
        self.ort_seconds = 0.0
        self.ort_calls = 0

        kv_shape = [1, c.num_kv_heads, c.capacity, c.head_dim]
        self._kv = []
        for _ in range(2):
            buf = ort.OrtValue.ortvalue_from_shape_and_type(kv_shape, np.float32, "cpu", 0)
            buf.update_inplace(np.zeros(kv_shape, np.float32))
            self._kv.append(buf)
        self._mask = np.ones(c.capacity, np.int64)  # [capacity], sliced to [1, length + n]
        self._rows = 0  # rows the staging buffers hold
        self._grow(min(16, c.capacity))
        self._head_io = self._head.io_binding()
        for (past, present), buf in zip(((past_key_name(0), present_key_name(0)),
                                         (past_value_name(0), present_value_name(0))), self._kv):
            self._head_io.bind_ortvalue_input(past, buf)
            self._head_io.bind_ortvalue_output(present, buf)  # in place
        self._fc_io = self._fc.io_binding()

    # -- the DraftHead protocol -----------------------------------------------------------------

    @property
    def length(self) -> int:
        return self._length

    def reset(self) -> None:
        with self._owned():
            self._length = 0

    def truncate(self, length: int) -> None:
        """Keep the first `length` entries (0 <= length <= self.length). O(1)."""
        with self._owned():
            self._length = check_truncate_length(length, self._length)

    def forward(self, tokens: Sequence[int], hidden: np.ndarray, *,
                from_target: bool) -> tuple[np.ndarray, np.ndarray]:
        """Append n entries (tokens [n] target ids, hidden [n, aux_width] with `from_target`,
        else [n, hidden_size]); returns (logits [n, draft_vocab_size], hidden_out
        [n, hidden_size]) float32, views valid until the next call."""
        if not isinstance(from_target, bool):
            raise InvalidOptionError(f"from_target must be True or False, got {from_target!r}")
        with self._owned():
            ids = check_token_block(tokens, vocab_size=self.vocab_size, length=self._length,
                                    capacity=self.capacity)  # [n] int64
            n = ids.size
            width = self.aux_width if from_target else self.hidden_size
            states = np.asarray(hidden)
            if states.shape != (n, width):
                what = "the target's hidden states (K * target_hidden)" if from_target else \
                    "the head's own hidden output"
                raise InvalidOptionError(f"hidden must be [{n}, {width}], {what} for each of "
                                         f"the {n} tokens; got shape {list(states.shape)}")
            if n > self._rows:
                self._grow(n)
            t0 = time.perf_counter()
            hidden_in = self._hidden_in[:n * self.hidden_size].reshape(n, self.hidden_size)
            if from_target:  # fc writes the head's input
                self._fc_io.bind_cpu_input(AUX, np.ascontiguousarray(states, np.float32))
                self._fc_io.bind_ortvalue_output(HIDDEN, self._view(self._hidden_in, n))
                self._fc.run_with_iobinding(self._fc_io)
                self.ort_calls += 1
            else:  # copied: the caller's rows may be a view of the last call's hidden_out,
                hidden_in[...] = states  # which this call's output overwrites
            self._ids[:n] = ids
            end = self._length + n
            io = self._head_io
            io.bind_cpu_input(INPUT_IDS, self._ids[:n].reshape(1, n))
            io.bind_cpu_input(ATTENTION_MASK, self._mask[:end].reshape(1, end))
            io.bind_cpu_input(HIDDEN, hidden_in)
            io.bind_ortvalue_output(LOGITS, self._view(self._logits, n))
            io.bind_ortvalue_output(HIDDEN_OUT, self._view(self._hidden_out, n))
            self._head.run_with_iobinding(io)
            self.ort_seconds += time.perf_counter() - t0
            self.ort_calls += 1
            logits = self._logits[:n * self.draft_vocab_size].reshape(n, self.draft_vocab_size)
            check_logits(logits, first_position=self._length, source="the draft head")
            self._length = end
            return logits, self._hidden_out[:n * self.hidden_size].reshape(n, self.hidden_size)

    # -- internals ------------------------------------------------------------------------------

    def _grow(self, rows: int) -> None:
        """Staging and output buffers for calls of up to `rows` entries (views rebuilt)."""
        rows = max(rows, 2 * self._rows)
        self._rows = min(rows, self.capacity)
        self._ids = np.zeros(self._rows, np.int64)
        self._logits = np.empty(self._rows * self.draft_vocab_size, np.float32)
        self._hidden_out = np.empty(self._rows * self.hidden_size, np.float32)
        self._hidden_in = np.empty(self._rows * self.hidden_size, np.float32)  # the head's input
        self._values: dict[tuple[int, int], ort.OrtValue] = {}

    def _view(self, buffer: np.ndarray, n: int) -> ort.OrtValue:
        """An OrtValue over the first n rows of `buffer` (shares its memory), made once."""
        key = (id(buffer), n)
        value = self._values.get(key)
        if value is None:
            width = buffer.size // self._rows
            value = ort.OrtValue.ortvalue_from_numpy(buffer[:n * width].reshape(n, width))
            self._values[key] = value
        return value

    def _owned(self) -> "_Owned":
        return _Owned(self._busy, self)

    def __repr__(self) -> str:
        return (f"OrtDraftHead({str(self.head_dir)!r}, length={self._length}, "
                f"capacity={self.capacity})")


def open_draft_head(head_dir: str | os.PathLike, *, providers: Any = None,
                    threads: int | None = None) -> OrtDraftHead:
    """The draft head in `head_dir` (a target's `drafts/eagle3`, its manifest's draft_head),
    checked (head.json, checksums, the graphs' references and I/O) and opened. ManifestError
    for a directory that is not a well-formed head."""
    return OrtDraftHead(head_dir, providers=providers, threads=threads)


class HeadSteps(DecoderBase):
    """A head's own-state steps as a `Decoder`, to time a drafted token against a target step
    (`calibration.step_cost_ratio`): `forward_token` feeds a token with the head's previous
    hidden output, what every drafted token after the first costs; `forward_batch` feeds a
    block with zero states (a prefill of the head's cache)."""

    def __init__(self, head: OrtDraftHead) -> None:
        self.head = head
        self.vocab_size = head.vocab_size
        self.capacity = head.capacity
        self._hidden = np.zeros((1, head.hidden_size), np.float32)  # [1, H]

    @property
    def length(self) -> int:
        return self.head.length

    def reset(self) -> None:
        self.head.reset()

    def truncate(self, length: int) -> None:
        self.head.truncate(length)

    def forward_token(self, token: int) -> np.ndarray:  # [vocab_d]
        logits, hidden = self.head.forward([token], self._hidden, from_target=False)
        self._hidden = hidden.copy()
        return logits[0]

    def forward_batch(self, tokens: Sequence[int]) -> np.ndarray:  # [n, vocab_d]
        zeros = np.zeros((len(tokens), self.head.hidden_size), np.float32)
        return self.head.forward(tokens, zeros, from_target=False)[0]


def _cpu_providers(providers: Any) -> list[tuple[str, dict[str, Any]]]:
    """The CPU provider, with the caller's options for it when the caller named it."""
    chosen = choose_providers(providers)
    options = next((dict(o) for name, o in chosen.chosen if name == CPU), {})
    return [(CPU, options)]


class _Owned:
    """Holds the head's lock for one call; a second caller meanwhile is an error."""

    __slots__ = ("_lock", "_head")

    def __init__(self, lock: threading.Lock, head: OrtDraftHead) -> None:
        self._lock, self._head = lock, head

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            raise ConcurrentUseError(f"{self._head!r} is in use by another thread; each "
                                     f"request needs a draft head of its own")

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
