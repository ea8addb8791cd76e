"""What runs one batched call: B rows of one KV pool, each with its own valid length.

A `BatchBackend` holds the KV state of `max_rows` requests and runs calls over a contiguous
range of them: row r appends `ids[r]` (S tokens, the same S for every row of the call) after
the first `lengths[r]` tokens of its cache, writing their keys and values at
lengths[r] .. lengths[r] + S - 1, and returns the logits after the positions `take` names
(flat indices r * S + s; all of them by default). What lies past a row's
valid length is never read, so a row padded with copies of a token, or carried along with
tokens it does not want (`BatchRunner`'s idle rows), leaves its cache as it was.

- `OrtBatchBackend`: one ONNX Runtime session of a graph whose batch axis is dynamic (a
  manifest with `max_batch` > 1, the "window" attention flavour) over KV buffers
  [max_rows, kv_heads, capacity, head_dim] in host memory, bound by address for the rows a call
  covers. Every call runs at least `min_rows` tokens in all (the manifest's `min_call_rows`;
  `call_width` says how wide a call's blocks are padded): the graph's rows are then bitwise
  independent of S, of the batch size and of the other rows (tests/batching/test_batching.py measures
  it), so a request's logits never depend on what it was batched with.
- `ReferenceBatchBackend`: one `ReferenceDecoder` a row, for tests of the scheduling.
"""

from __future__ import annotations

import time
from typing import Protocol

import numpy as np
import onnxruntime as ort

from ..errors import InvalidOptionError, ManifestError, ProviderError
from ..ort.graph_io import (ATTENTION_MASK, HIDDEN_STATES, INPUT_IDS, LOGIT_ROWS, LOGITS,
                            TOKEN_ROWS, logit_rows_for, token_rows_for)
from ..check.reference import ReferenceConfig, ReferenceDecoder
from ..ort.sessions import OrtSessions
from ..validation import check_int


class BatchBackend(Protocol):
    vocab_size: int
    capacity: int  # KV slots per row
    max_rows: int  # rows of the pool
    max_call: int  # most tokens a row may append in one call
    min_rows: int  # every call runs at least this many tokens in all (see call_width)
    packs_tokens: bool  # a call computes its rows' real tokens only, not their padding
    # each row's cache is read in place, and a row without tokens in a call costs it nothing:
    # a freed row may stay empty among occupied ones (else `move` keeps them contiguous)
    rows_in_place: bool
    ort_seconds: float  # time inside the model runtime
    # the decoder layers whose entering residual streams a call also returns (see
    # `HiddenStateSource`); None: the graph returns none
    hidden_state_layers: tuple[int, ...] | None

    def run(self, lo: int, hi: int, ids: np.ndarray, lengths: np.ndarray, *,
            take: np.ndarray | None = None, real: np.ndarray | None = None) -> np.ndarray:
        """ids [hi - lo, S] int64, lengths [hi - lo], take [N] int64 (flat positions r * S + s,
        None: all (hi - lo) * S): the logits [N, vocab] after those positions, in take's order
        (a view, valid until the next call). real [M] int64, ascending: the positions holding
        a row's own tokens (None: all), take among them; the others are padding, whose keys
        and values land past their row's valid length, and a backend may skip computing them."""
        ...

    def last_hidden(self) -> np.ndarray:
        """The hidden states of the rows the last `run` returned logits for: [N, K * hidden]
        float32 in take's order (a view, valid until the next call). Only where
        `hidden_state_layers` is not None."""
        ...

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy row src's first `length` cache positions to row dst."""
        ...

    token_bytes: int  # what `save` takes a cache position

    def save(self, row: int, length: int) -> object:
        """A copy of row's first `length` cache positions (for `load`, in any row)."""
        ...

    def load(self, row: int, saved: object, length: int) -> None:
        """Write the first `length` positions of a `save` copy into row's cache."""
        ...


class OrtBatchBackend:
    """`BatchBackend` over an `OrtSessions` whose verify graph takes B rows (CPU only: the KV
    pool lives in host memory and each call binds the rows it covers by address)."""

    def __init__(self, sessions: OrtSessions, *, max_rows: int) -> None:
        m = sessions.manifest
        check_int("max_rows", max_rows, minimum=1)
        if m.max_batch < 2:
            raise ProviderError(f"{sessions.model_dir}: the graph takes one row a call "
                                f"(manifest max_batch = {m.max_batch}); export with "
                                f"`ortspec export --attention window` for batched decoding")
        if sessions.providers[0] != "CPUExecutionProvider":
            raise ProviderError(f"batched decoding keeps its KV pool in host memory and runs on "
                                f"the CPU provider only; this model runs on {sessions.providers[0]}")
        self.sessions = sessions
        self.vocab_size = sessions.vocab_size
        self.capacity = m.capacity
        self.max_rows = min(int(max_rows), m.max_batch)
        self.max_call = max(sessions.prefill_chunk, sessions.max_verify_len)
        self.min_rows = sessions.min_call_rows
        self.ort_seconds = 0.0
        a = m.architecture
        self._session = sessions.by_entry["verify"]
        if LOGIT_ROWS not in {i.name for i in self._session.get_inputs()}:
            raise ManifestError(f"{sessions.model_dir}: the graph has no `{LOGIT_ROWS}` input "
                                f"(exported by an earlier ortspec); export it again for "
                                f"batched decoding")
        self.packs_tokens = TOKEN_ROWS in {i.name for i in self._session.get_inputs()}
        # ortspec.CacheAttention reads each packed token's own row up to its position; the
        # MatMul attention slices the first W slots of every row the call covers
        self.rows_in_place = self.packs_tokens and m.attends_in_place
        self._names = sessions.kv_names
        # [max_rows, kv_heads, capacity, head_dim] per layer and key/value, every page written
        # now: left to the first write, a fresh row faults in its pages in the middle of a call
        # that every row waits for (the default model in fp32: ~90 MiB a row, about 300 ms here)
        self._kv = [np.full((self.max_rows, a.num_kv_heads, m.capacity, a.head_dim), 0,
                            sessions.kv_dtype) for _ in self._names]
        longest = self.max_rows * max(sessions.max_verify_len, self.min_rows)
        self._logits = np.empty(max(longest, self.max_call) * self.vocab_size, np.float32)
        self._mask = np.zeros(self.max_rows * (m.capacity + 1), np.int64)
        self._bindings: dict[tuple[int, int], ort.IOBinding] = {}
        self._element = np.float32 if sessions.kv_dtype == np.float32 else np.float16
        self.token_bytes = sum(b[0, :, 0].nbytes for b in self._kv)  # one row's cache position
        # the hidden_states output (a model exported for a draft head), rows as the logits'
        self.hidden_state_layers: tuple[int, ...] | None = m.hidden_state_layers
        self._hidden_width = m.hidden_state_width if m.hidden_state_layers else 0
        self._hidden = np.empty(self._logits.size // self.vocab_size * self._hidden_width,
                                np.float32)
        self._hidden_rows = 0  # the rows the last call returned

    def _binding(self, lo: int, hi: int) -> ort.IOBinding:
        io = self._bindings.get((lo, hi))
        if io is None:
            io = self._session.io_binding()
            for (past, present), buf in zip(self._names, self._kv, strict=True):
                rows = buf[lo:hi]  # contiguous: the batch axis is the outermost
                shape = list(rows.shape)
                io.bind_input(past, "cpu", 0, self._element, shape, rows.ctypes.data)
                io.bind_output(present, "cpu", 0, self._element, shape, rows.ctypes.data)
            self._bindings[(lo, hi)] = io
        return io

    def run(self, lo: int, hi: int, ids: np.ndarray, lengths: np.ndarray, *,
            take: np.ndarray | None = None, real: np.ndarray | None = None) -> np.ndarray:
        n, s = ids.shape
        width = int(lengths.max()) + s
        mask = self._mask[: n * width].reshape(n, width)  # [B, W]: row r has lengths[r] + S ones
        mask[:] = np.arange(width)[None, :] < (lengths[:, None] + s)
        wanted = np.arange(n * s, dtype=np.int64) if take is None else np.asarray(take, np.int64)
        io = self._binding(lo, hi)
        io.bind_cpu_input(INPUT_IDS, np.ascontiguousarray(ids, np.int64))
        io.bind_cpu_input(ATTENTION_MASK, mask)
        rows = logit_rows_for(wanted, min_rows=self.min_rows)  # the graph computes these only
        io.bind_cpu_input(LOGIT_ROWS, rows)
        if self.packs_tokens:  # the MatMuls run on the real tokens only
            computed = np.arange(n * s, dtype=np.int64) if real is None else \
                np.asarray(real, np.int64)
            if real is not None and real is not take and not np.isin(wanted, computed).all():
                raise ValueError("every position whose logits are taken must be among the "
                                 "real ones (a position left out is computed from zeros)")
            io.bind_cpu_input(TOKEN_ROWS, token_rows_for(computed, grid=n * s,
                                                            min_rows=self.min_rows))
        logits = self._logits[: rows.size * self.vocab_size].reshape(rows.size, self.vocab_size)
        io.bind_output(LOGITS, "cpu", 0, np.float32, [rows.size, self.vocab_size],
                       logits.ctypes.data)
        if self._hidden_width:
            io.bind_output(HIDDEN_STATES, "cpu", 0, np.float32, [rows.size, self._hidden_width],
                           self._hidden.ctypes.data)
        t0 = time.perf_counter()
        self._session.run_with_iobinding(io)
        self.ort_seconds += time.perf_counter() - t0
        self._hidden_rows = wanted.size
        return logits[:wanted.size]  # [N, vocab]

    def last_hidden(self) -> np.ndarray:  # [N, K * hidden]
        if not self._hidden_width:
            raise InvalidOptionError(f"{self.sessions.model_dir} was exported without hidden "
                                     f"states (its manifest lists no hidden_state_layers)")
        return self._hidden[: self._hidden_rows * self._hidden_width].reshape(
            self._hidden_rows, self._hidden_width)

    def move(self, src: int, dst: int, length: int) -> None:
        for buf in self._kv:
            buf[dst, :, :length] = buf[src, :, :length]

    def save(self, row: int, length: int) -> list[np.ndarray]:  # [kv_heads, length, head_dim] each
        return [buf[row, :, :length].copy() for buf in self._kv]

    def load(self, row: int, saved: object, length: int) -> None:
        for buf, part in zip(self._kv, saved, strict=True):  # type: ignore[call-overload]
            buf[row, :, :length] = part[:, :length]


class ReferenceBatchBackend:
    """`BatchBackend` over one `ReferenceDecoder` a row (float64 NumPy, exact to ~1e-13): what
    the scheduling is tested against."""

    def __init__(self, config: ReferenceConfig = ReferenceConfig(), *, max_rows: int,
                 max_call: int = 8, min_rows: int = 1, rows_in_place: bool = False) -> None:
        self.rows = [ReferenceDecoder(config) for _ in range(max_rows)]
        self.vocab_size = config.vocab_size
        self.capacity = config.capacity
        self.max_rows = max_rows
        self.max_call = max_call
        self.min_rows = min_rows
        self.packs_tokens = False  # computes every position, padding included
        self.rows_in_place = rows_in_place  # (either way: the scheduling under test)
        self.ort_seconds = 0.0
        self.hidden_state_layers: tuple[int, ...] | None = None
        self.calls: list[tuple[int, int]] = []  # (rows, S) of each call, for tests
        self.real: list[np.ndarray | None] = []  # each call's `real` positions, for tests

    def run(self, lo: int, hi: int, ids: np.ndarray, lengths: np.ndarray, *,
            take: np.ndarray | None = None, real: np.ndarray | None = None) -> np.ndarray:
        """Computes every position (`real` is recorded, not used)."""
        out = np.empty((hi - lo, ids.shape[1], self.vocab_size))
        for r, (row_ids, length) in enumerate(zip(ids, lengths, strict=True)):
            dec = self.rows[lo + r]
            dec.truncate(int(length))
            out[r] = dec.forward_batch([int(t) for t in row_ids])
        self.calls.append((hi - lo, ids.shape[1]))
        self.real.append(None if real is None else np.array(real, np.int64))
        out = out.reshape(-1, self.vocab_size)
        return out if take is None else out[np.asarray(take, np.int64)]

    def last_hidden(self) -> np.ndarray:
        raise InvalidOptionError("the reference backend returns no hidden states")

    def move(self, src: int, dst: int, length: int) -> None:
        self.rows[src].truncate(length)
        self.rows[dst], self.rows[src] = self.rows[src], self.rows[dst]

    @property
    def token_bytes(self) -> int:
        return self.rows[0].kv_token_bytes

    def save(self, row: int, length: int) -> object:
        return self.rows[row].kv_prefix(length)

    def load(self, row: int, saved: object, length: int) -> None:
        self.rows[row].load_kv_prefix(saved, length)  # type: ignore[arg-type]
