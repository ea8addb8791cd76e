"""OrtDecoder: one request's decode state over a model's shared sessions, behind `Decoder`.

The sessions (the weights) are an `OrtSessions`, shared read-only by every decoder made from
it; a decoder owns its KV buffers, IOBindings, staging arrays and cache length, so decoders on
one model run concurrently without touching each other's state. One decoder serves one caller
at a time: a call that finds it busy in another thread raises `ConcurrentUseError` instead of
corrupting it.

The KV cache is one fixed-capacity OrtValue per layer for keys and one for values
([1, kv_heads, capacity, head_dim], allocated once on the provider's device). Each is bound
through IOBinding as both `past_key_values.{i}.*` input and `present.{i}.*` output, so
GroupQueryAttention writes the new positions in place and no KV byte crosses the host. The
valid length lives in Python only: the attention mask is `length + S` ones, its row sum tells
the graph where to write and how far to attend, so `truncate` (a rollback after a rejected
draft) is an integer assignment, and the logits after it are those of a fresh decode.

Only the logits come back to NumPy, into one preallocated buffer; the OrtValue bound as the
`logits` output is a view of it, one per row count, rebound when the count changes. A model
whose manifest lists `hidden_state_layers` also returns, for the same rows, the residual
streams of those layers (the `hidden_states` output, for EAGLE-3 heads), into a second buffer
bound the same way; `last_hidden_states()` reads them. For other models nothing of it is
allocated or bound. A graph
with the `logit_rows` input (ortspec's exports) computes only the rows a call reads: every
position of a verify block, the last one of a prompt chunk, none of the padding; one without
it (an earlier export, onnxruntime-genai's) computes them all.

Under TensorRT, whose engines make no promise about an input aliasing an output, the KV lives
in two sets of buffers instead ("ping-pong"): a call reads one set as past and writes the other
as present (the graph copies the past rows over, O(capacity) on the device), then they swap.
Both sets are pre-bound in two IOBindings, so a swap rebinds nothing.

A draft of the same architecture (the int4 self-speculative draft) may run on its target's KV
buffers instead of its own (`OrtDecoder.sharing_kv`): it attends over the keys and values the
target computed for the history, so it needs no prefill and no catch-up on the tokens the
target accepted, and writes its own keys and values only past the target's length, positions
the target's next call overwrites before it reads them. `follow_owner` takes the target's
length as the draft's. The two decoders share one busy lock.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np
import onnxruntime as ort

from . import manifest as mf
from ..errors import ConcurrentUseError, InvalidOptionError, ManifestError
from .graph_io import (ATTENTION_MASK, HIDDEN_STATES, INPUT_IDS, LOGIT_ROWS, LOGITS,
                       POSITION_IDS, TOKEN_ROWS, call_width, logit_rows_for)
from .sessions import OrtSessions
from ..decoding.protocols import last_hidden_copy
from ..validation import check_logits, check_token_block, check_truncate_length


class PrefixStore(Protocol):
    """Keys and values of earlier prompts that a decoder's prefill copies instead of computing
    (`ortspec.runtime.batching.prefix_cache.SharedPrefixCache`)."""

    def reuse(self, tokens: np.ndarray, load: Callable[[Any, int], None]) -> int: ...

    def keep(self, tokens: np.ndarray, save: Callable[[int], Any], nbytes: int) -> None: ...


class OrtDecoder:
    """A target (or draft) model with a KV cache, run by ONNX Runtime.

    forward_token uses the `step` entry point, forward_batch the `verify` one (in chunks of
    at most `prefill_chunk` tokens when given more), prefill too (in chunks of `prompt_chunk`,
    which a graph computing the last row's logits alone allows longer). `ort_seconds` and
    `ort_calls` count the time spent inside `run_with_iobinding` and the calls made.

    `OrtDecoder(model_dir, ...)` opens sessions of its own; `OrtDecoder.on(sessions)` makes
    another decoder over sessions already open.
    """

    def __init__(self, model_dir: str | os.PathLike, *, manifest: mf.Manifest | None = None,
                 providers: Any = None, threads: int | None = None,
                 session_options: ort.SessionOptions | None = None, kv_mode: str | None = None):
        self._init(OrtSessions(model_dir, manifest=manifest, providers=providers, threads=threads,
                               session_options=session_options, kv_mode=kv_mode))

    @classmethod
    def on(cls, sessions: OrtSessions, *, prefixes: PrefixStore | None = None) -> "OrtDecoder":
        """A decoder with KV buffers of its own over `sessions` (shared, read-only).

        `prefixes`: a prefill into an empty cache starts from the longest prefix of the prompt
        found there and keeps the prompt's keys and values there once read. Taken only where
        the sessions compute a position alike in any call (`OrtSessions.rows_exact`, so the
        copied positions are those a fresh prefill computes, bit for bit) and the KV buffers
        are in host memory; otherwise ignored."""
        self = cls.__new__(cls)
        self._init(sessions)
        if prefixes is not None and sessions.rows_exact and self._kv_arrays is not None:
            self.prefixes = prefixes
        return self

    @classmethod
    def sharing_kv(cls, sessions: OrtSessions, owner: "OrtDecoder") -> "OrtDecoder":
        """A decoder over `sessions` that reads and writes `owner`'s KV buffers (see the module
        docstring): `sessions` must have the owner's KV shape, dtype and device, in "shared"
        mode (`kv_compatible`). Its length starts at 0; `follow_owner` sets it."""
        problem = kv_compatible(sessions, owner.sessions)
        if problem:
            raise ManifestError(f"{sessions.model_dir} cannot run on the KV buffers of "
                                f"{owner.model_dir}: {problem}")
        self = cls.__new__(cls)
        self._init(sessions, kv_owner=owner)
        return self

    def _init(self, sessions: OrtSessions, kv_owner: "OrtDecoder | None" = None) -> None:
        s = self.sessions = sessions
        self.model_dir: Path = s.model_dir
        self.manifest: mf.Manifest = s.manifest
        self.vocab_size: int = s.vocab_size
        self.capacity: int = s.capacity
        self.max_verify_len: int = s.max_verify_len
        self.prefill_chunk: int = s.prefill_chunk
        self.prompt_chunk: int = s.prompt_chunk  # prefill's calls (the last row's logits only)
        self.providers: list[str] = s.providers
        self.kv_mode: str = s.kv_mode
        self._length = 0
        self.ort_seconds = 0.0  # wall time inside run_with_iobinding
        self.ort_calls = 0
        self.kv_owner = kv_owner  # the decoder whose KV buffers these are (None: its own)
        # held while a call runs: one caller at a time, on the owner's buffers too
        self._busy = threading.Lock() if kv_owner is None else kv_owner._busy

        device, device_id = s.kv_device
        zeros = np.zeros(s.kv_shape, s.kv_dtype)  # never-read garbage would be harmless too
        self._kv_sets: list[list[ort.OrtValue]] = [] if kv_owner is None else kv_owner._kv_sets
        for _ in range(0 if kv_owner is not None else 2 if self.kv_mode == "ping-pong" else 1):
            bufs = []
            for _ in s.kv_names:
                buf = ort.OrtValue.ortvalue_from_shape_and_type(s.kv_shape, s.kv_dtype, device,
                                                                 device_id)
                buf.update_inplace(zeros)
                bufs.append(buf)
            self._kv_sets.append(bufs)
        del zeros
        # the buffers as NumPy arrays over the same memory, [1, kv_heads, rows, head_dim] per
        # set, for copying prefixes in and out: host buffers only (None on a device)
        self._kv_arrays: list[list[np.ndarray]] | None = None
        if device == "cpu":
            self._kv_arrays = [[_host_array(buf, s.kv_shape, s.kv_dtype) for buf in bufs]
                               for bufs in self._kv_sets]
        self.prefixes: PrefixStore | None = None  # see `on`
        self.token_bytes = len(s.kv_names) * int(np.prod(s.kv_shape[:2])) * s.kv_shape[3] * \
            np.dtype(s.kv_dtype).itemsize  # KV bytes of one position
        self._current = 0  # the KV set that holds the cache (ping-pong flips it after each run)

        longest = s.longest_call  # rows of logits a call may return
        staged = max(longest, s.prompt_chunk)
        self._ids = np.zeros(staged, np.int64)  # [staged] staging for input_ids
        self.min_call_rows: int = s.min_call_rows
        rows = s.kv_shape[2]  # the buffers' capacity (one more than self.capacity when padding)
        self._mask = np.ones(rows, np.int64)  # [rows], sliced to [1, length + S]
        self._positions = np.arange(rows, dtype=np.int64)  # for graphs with position_ids
        self._all_rows = np.arange(staged, dtype=np.int64)  # flat positions, for logit_rows
        self._logits = np.empty(longest * self.vocab_size, np.float32)  # [longest * vocab]
        # (N, taken) -> view of _logits as [N, vocab] (taken: logit_rows) or [1, N, vocab]
        self._logit_values: dict[tuple[int, bool], ort.OrtValue] = {}
        # the hidden_states output: the manifest's layer ids, K * hidden columns
        self.hidden_state_layers: tuple[int, ...] | None = self.manifest.hidden_state_layers
        self._hidden_width = self.manifest.hidden_state_width  # 0: the graph has no such output
        # [longest * width] and its views [N, width] by N; None without the output
        self._hidden = np.empty(longest * self._hidden_width, np.float32) \
            if self._hidden_width else None
        self._hidden_values: dict[int, ort.OrtValue] = {}
        self._last_hidden: np.ndarray | None = None  # [rows, width]: the last call's returned rows
        # id(session) -> one IOBinding per current KV set (past = that set, present = the next)
        self._bindings: dict[int, list[_Binding]] = {}
        n_sets = len(self._kv_sets)
        for session in s.by_entry.values():
            if id(session) not in self._bindings:
                self._bindings[id(session)] = [
                    _Binding(session, s.kv_names, self._kv_sets[k],
                             self._kv_sets[(k + 1) % n_sets], self.model_dir,
                             hidden_states=self._hidden is not None)
                    for k in range(n_sets)]

    # -- the Decoder protocol -------------------------------------------------------------------

    @property
    def length(self) -> int:
        return self._length

    def reset(self) -> None:
        with self._owned():
            self._length = 0
            self._last_hidden = None

    def forward_token(self, token: int) -> np.ndarray:
        """Append one token; its next-token logits, [vocab] float32."""
        with self._owned():
            return self._run("step", self._check_tokens([token]))[0]

    def forward_batch(self, tokens: Sequence[int]) -> np.ndarray:
        """Append `tokens`; next-token logits after each, [n, vocab] float32."""
        with self._owned():
            ids = self._check_tokens(tokens)
            if len(ids) <= self.prefill_chunk:
                return self._run("verify", ids)
            out = np.empty((len(ids), self.vocab_size), np.float32)  # [n, vocab]
            hidden = None if self._hidden is None else \
                np.empty((len(ids), self._hidden_width), np.float32)  # [n, width]
            for lo, logits in self._chunks(ids):
                out[lo:lo + len(logits)] = logits
                if hidden is not None:
                    hidden[lo:lo + len(logits)] = self._last_hidden
            if hidden is not None:
                self._last_hidden = hidden
            return out

    def last_hidden_states(self) -> np.ndarray:
        """The hidden states of the rows the last forward_token / forward_batch / prefill
        returned logits for: [rows, K * hidden] float32 (a copy), row r the residual streams
        entering the decoder layers `hidden_state_layers` lists (K of them, concatenated in that
        order) at the position whose logits are row r: [1, .] after forward_token and prefill,
        [n, .] after forward_batch of n tokens. InvalidOptionError for a model exported
        without `--hidden-states`, or before any call (and after reset)."""
        with self._owned():
            return last_hidden_copy(self._last_hidden, unavailable=None if self._hidden is not None
                                    else f"{self.model_dir} was exported without hidden states "
                                         f"(its manifest lists no hidden_state_layers)")

    def prefill(self, tokens: Sequence[int]) -> np.ndarray:
        """forward_batch keeping only the last row: [vocab] float32, without an [n, vocab] array.
        Into an empty cache with `prefixes` (see `on`), the longest cached prefix of `tokens` is
        copied in rather than computed, and `tokens` are kept there once read."""
        with self._owned():
            ids = self._check_tokens(tokens)
            store = self.prefixes if self._length == 0 else None
            try:
                start = store.reuse(ids, self._load_prefix) if store is not None else 0
                last = None
                for _, logits in self._chunks(ids[start:], last_only=True):
                    last = logits[-1]
            except BaseException:
                if store is not None:
                    self._length = 0  # all or nothing, the copied prefix included
                raise
            if store is not None:
                store.keep(ids, self._save_prefix, ids.size * self.token_bytes)
            return last.copy()

    def _save_prefix(self, n: int) -> list[np.ndarray]:  # [1, kv_heads, n, head_dim] each
        """Copies of the cache's first n positions, read-only."""
        assert self._kv_arrays is not None and n <= self._length
        saved = []
        for buf in self._kv_arrays[self._current]:
            part = buf[:, :, :n].copy()
            part.flags.writeable = False
            saved.append(part)
        return saved

    def _load_prefix(self, saved: list[np.ndarray], n: int) -> None:
        """The cache's first n positions from `_save_prefix`'s copies; the length becomes n."""
        assert self._kv_arrays is not None
        for buf, part in zip(self._kv_arrays[self._current], saved, strict=True):
            buf[:, :, :n] = part[:, :, :n]
        self._length = n

    def follow_owner(self) -> int:
        """A decoder `sharing_kv`: take the owner's length as its own (the owner's cache is now
        this one's); returns it."""
        if self.kv_owner is None:
            raise InvalidOptionError(f"{self!r} has KV buffers of its own: nothing to follow")
        with self._owned():
            self._length = self.kv_owner.length
            return self._length

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens of the cache (0 <= length <= self.length). O(1)."""
        with self._owned():
            self._length = check_truncate_length(length, self._length)

    # -- internals ------------------------------------------------------------------------------

    def _owned(self) -> "_Owned":
        return _Owned(self._busy, self)

    def _chunks(self, ids: np.ndarray, *, last_only: bool = False):
        """Feed `ids` in calls of at most `prefill_chunk` tokens (`prompt_chunk` when only the
        last row's logits are wanted), yielding (offset, logits view: each chunk's rows, or its
        last row only); all or nothing: a failure rolls the cache back to where it started."""
        start = self._length
        chunk = self.prompt_chunk if last_only else self.prefill_chunk
        try:
            for lo in range(0, len(ids), chunk):
                yield lo, self._run("verify", ids[lo:lo + chunk], copy=False, last_only=last_only)
        except BaseException:
            self._length = start
            raise

    def _check_tokens(self, tokens: Sequence[int]) -> np.ndarray:
        return check_token_block(tokens, vocab_size=self.vocab_size, length=self._length,
                                 capacity=self.capacity)

    def _run(self, entry: str, ids: np.ndarray, *, copy: bool = True,
             last_only: bool = False) -> np.ndarray:
        """Append `ids`; the logits after each ([n, vocab]), or after the last ([1, vocab])."""
        owner = self.kv_owner
        if owner is not None and self._length < owner.length:
            raise InvalidOptionError(
                f"this decoder runs on the KV buffers of {owner!r}: writing at position "
                f"{self._length} would overwrite that decoder's cache (it holds {owner.length} "
                f"tokens); call follow_owner() first, or reset the owner")
        n = ids.size
        total = self._length + n
        rows = call_width(1, n, self.min_call_rows)  # S: n, or n padded with its last token
        session = self.sessions.by_entry[entry]
        binding = self._bindings[id(session)][self._current]
        self._ids[:n] = ids
        self._ids[n:rows] = ids[-1]
        end = self._length + rows
        wanted = self._all_rows[n - 1:n] if last_only else self._all_rows[:n]
        take = logit_rows_for(wanted, min_rows=self.min_call_rows) \
            if binding.has_logit_rows else None  # [N >= wanted]
        binding.bind_step(
            self._ids[:rows].reshape(1, rows),  # [1, S]
            self._mask[:end].reshape(1, end),  # [1, past + S]
            self._positions[self._length:end].reshape(1, rows),  # [1, S]
            self._all_rows[:rows],  # every position computed: a row's padding copy included
            take,
            self._logits_value(rows if take is None else take.size, taken=take is not None),
            None if self._hidden is None else self._hidden_value(take.size),
        )
        t0 = time.perf_counter()
        session.run_with_iobinding(binding.io)
        self.ort_seconds += time.perf_counter() - t0
        self.ort_calls += 1
        if take is None:  # the graph computed all S rows: the wanted ones are a slice
            logits = self._logits[: rows * self.vocab_size].reshape(rows, self.vocab_size)
            logits = logits[wanted[0]:wanted[-1] + 1]
        else:  # [N, vocab], the wanted rows first
            logits = self._logits[: wanted.size * self.vocab_size].reshape(wanted.size,
                                                                            self.vocab_size)
        check_logits(logits, first_position=self._length + int(wanted[0]),  # the positions read
                     source=f"the {entry} graph")  # (a prompt chunk: its last)
        if self._hidden is not None:  # [wanted, width], a view until the next call
            self._last_hidden = self._hidden[: wanted.size * self._hidden_width].reshape(
                wanted.size, self._hidden_width)
        self._length = total
        self._current = (self._current + 1) % len(self._kv_sets)  # ping-pong: present is current
        return logits.copy() if copy else logits

    def _logits_value(self, n: int, *, taken: bool) -> ort.OrtValue:
        """The logits output of n rows: [n, vocab] (a graph with logit_rows) or [1, n, vocab]."""
        value = self._logit_values.get((n, taken))
        if value is None:
            view = self._logits[: n * self.vocab_size].reshape(
                (n, self.vocab_size) if taken else (1, n, self.vocab_size))
            value = ort.OrtValue.ortvalue_from_numpy(view)  # shares memory with self._logits
            self._logit_values[n, taken] = value
        return value

    def _hidden_value(self, n: int) -> ort.OrtValue:
        """The hidden_states output of n rows: a view [n, width] of self._hidden."""
        value = self._hidden_values.get(n)
        if value is None:
            view = self._hidden[: n * self._hidden_width].reshape(n, self._hidden_width)
            value = ort.OrtValue.ortvalue_from_numpy(view)  # shares memory with self._hidden
            self._hidden_values[n] = value
        return value

    def __repr__(self) -> str:
        return (f"OrtDecoder({str(self.model_dir)!r}, length={self._length}, "
                f"capacity={self.capacity}, providers={self.providers})")


def _host_array(value: ort.OrtValue, shape: Sequence[int], dtype: Any) -> np.ndarray:
    """A NumPy array over the memory of `value`, an OrtValue in host memory (kept alive by its
    owner for as long as the array is used)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = (ctypes.c_uint8 * nbytes).from_address(value.data_ptr())
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def kv_compatible(sessions: OrtSessions, owner: OrtSessions) -> str | None:
    """Why a decoder over `sessions` cannot run on the KV buffers of one over `owner` (None when
    it can): the buffers must have one shape, dtype and device, be shared in place (not
    ping-pong), and be as many (a key and a value per layer)."""
    if sessions.kv_mode != "shared" or owner.kv_mode != "shared":
        return f"KV modes {sessions.kv_mode!r} and {owner.kv_mode!r} (both must be 'shared')"
    for what, a, b in (("KV shape", sessions.kv_shape, owner.kv_shape),
                       ("KV dtype", sessions.kv_dtype, owner.kv_dtype),
                       ("KV device", sessions.kv_device, owner.kv_device),
                       ("KV tensors", len(sessions.kv_names), len(owner.kv_names))):
        if a != b:
            return f"{what} {a} against {b}"
    return None


class _Owned:
    """Holds a decoder's lock for one call; a second caller meanwhile is an error, not a wait:
    two requests sharing one decoder would interleave their caches."""

    __slots__ = ("_lock", "_decoder")

    def __init__(self, lock: threading.Lock, decoder: OrtDecoder) -> None:
        self._lock, self._decoder = lock, decoder

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            raise ConcurrentUseError(
                f"{self._decoder!r} is in use by another thread; each request needs a decoder of "
                f"its own (Model.generate/stream take one from the model's pool)")

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


class _Binding:
    """One session's IOBinding: KV buffers bound once as past and present, the rest per call."""

    def __init__(self, session: ort.InferenceSession, names: list[tuple[str, str]],
                 past: list[ort.OrtValue], present: list[ort.OrtValue], model_dir: Path, *,
                 hidden_states: bool = False):
        self.io = session.io_binding()
        inputs = {i.name for i in session.get_inputs()}
        outputs = {o.name for o in session.get_outputs()}
        needed_in = {INPUT_IDS, ATTENTION_MASK, *(p for p, _ in names)}
        needed_out = {LOGITS, *(q for _, q in names)}
        if hidden_states:  # the manifest lists hidden_state_layers: rows as logit_rows names
            needed_in.add(LOGIT_ROWS)
            needed_out.add(HIDDEN_STATES)
        missing = sorted((needed_in - inputs) | (needed_out - outputs))
        extra = sorted(inputs - needed_in - {POSITION_IDS, LOGIT_ROWS, TOKEN_ROWS})
        if missing or extra:
            raise ManifestError(f"{model_dir}: graph I/O does not match the manifest "
                                f"(missing {missing}, unexpected inputs {extra})")
        self.has_positions = POSITION_IDS in inputs
        self.has_logit_rows = LOGIT_ROWS in inputs
        self.has_token_rows = TOKEN_ROWS in inputs
        for (past_name, present_name), src, dst in zip(names, past, present, strict=True):
            self.io.bind_ortvalue_input(past_name, src)
            self.io.bind_ortvalue_output(present_name, dst)  # shared mode: src is dst, in place
        self._bound_logits: ort.OrtValue | None = None
        self._bound_hidden: ort.OrtValue | None = None

    def bind_step(self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray,
                  tokens: np.ndarray, take: np.ndarray | None, logits: ort.OrtValue,
                  hidden: ort.OrtValue | None = None) -> None:
        """ids [1, S]; tokens [S]: 0..S-1, the positions a packing graph computes (a lone
        token's padding copy included: the MatMuls see two rows)."""
        self.io.bind_cpu_input(INPUT_IDS, ids)
        self.io.bind_cpu_input(ATTENTION_MASK, mask)
        if self.has_positions:
            self.io.bind_cpu_input(POSITION_IDS, positions)
        if self.has_token_rows:
            self.io.bind_cpu_input(TOKEN_ROWS, tokens)
        if take is not None:
            self.io.bind_cpu_input(LOGIT_ROWS, take)
        if logits is not self._bound_logits:
            self.io.bind_ortvalue_output(LOGITS, logits)
            self._bound_logits = logits
        if hidden is not None and hidden is not self._bound_hidden:  # [N, width], like logits
            self.io.bind_ortvalue_output(HIDDEN_STATES, hidden)
            self._bound_hidden = hidden
