"""OrtDecoder: an exported model directory behind the `Decoder` protocol.

The KV cache is one fixed-capacity OrtValue per layer for keys and one for values
([1, kv_heads, capacity, head_dim], allocated once on the provider's device). Each is bound
through IOBinding as both `past_key_values.{i}.*` input and `present.{i}.*` output, so
GroupQueryAttention writes the new positions in place and no KV byte crosses the host. The
valid length lives in Python only: the attention mask is `length + S` ones, its row sum tells
the graph where to write and how far to attend, so `truncate` (a rollback after a rejected
draft) is an integer assignment, and the logits after it are those of a fresh decode.

Only the logits come back to NumPy, into one preallocated buffer; the OrtValue bound as the
`logits` output is a view of it, one per block length, rebound when the length changes.

Under TensorRT, whose engines make no promise about an input aliasing an output, the KV lives
in two sets of buffers instead ("ping-pong"): a call reads one set as past and writes the other
as present (the graph copies the past rows over, O(capacity) on the device), then they swap.
Both sets are pre-bound in two IOBindings, so a swap rebinds nothing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from onnxruntime.capi import onnxruntime_pybind11_state as _ort_errors

from . import manifest as mf
from .errors import CapacityError, InvalidOptionError, InvalidPromptError, ManifestError, \
    NonFiniteLogitsError
from .providers import default_kv_mode, kv_device, resolve_providers

PREFILL_CHUNK = 128
_GRAPH_ERRORS = (_ort_errors.InvalidGraph, _ort_errors.InvalidProtobuf, _ort_errors.NoSuchFile,
                 _ort_errors.NotImplemented, _ort_errors.InvalidArgument)
_KV_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
KV_MODES = ("shared", "ping-pong")  # one buffer set updated in place, or two that alternate


class OrtDecoder:
    """A target (or draft) model with a KV cache, run by ONNX Runtime.

    forward_token uses the `step` entry point, forward_batch the `verify` one (in chunks of
    at most `verify.max_len` tokens when given more, e.g. for a prompt). `ort_seconds` and
    `ort_calls` count the time spent inside `run_with_iobinding` and the calls made.
    """

    def __init__(self, model_dir: str | os.PathLike, *, manifest: mf.Manifest | None = None,
                 providers: Any = None, threads: int | None = None,
                 session_options: ort.SessionOptions | None = None, kv_mode: str | None = None):
        self.model_dir = Path(model_dir)
        self.manifest = manifest if manifest is not None else mf.read_manifest(self.model_dir)
        m = self.manifest
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                    or threads < 0):
            raise InvalidOptionError(f"threads must be an integer >= 0 (0 = onnxruntime's "
                                     f"default), got {threads!r}")
        self.vocab_size: int = m.architecture.vocab_size
        self.capacity: int = m.capacity
        self.max_verify_len: int = m.entry_points["verify"].max_len
        if kv_mode is not None and kv_mode not in KV_MODES:
            raise InvalidOptionError(f"kv_mode must be one of {', '.join(KV_MODES)}, got "
                                     f"{kv_mode!r}")
        self.provider_config = resolve_providers(providers, manifest=m, model_dir=self.model_dir)
        self.kv_mode: str = kv_mode or default_kv_mode(self.provider_config)
        self._sessions = self._open_sessions(threads, session_options)
        # intra-op threads the sessions run with (0: onnxruntime's default); part of the key
        # under which the cost curve is cached, since the relative cost of a block depends on it
        self.intra_op_threads = next(iter(self._sessions.values())).get_session_options().intra_op_num_threads
        self.providers: list[str] = self._sessions["step"].get_providers()
        self._length = 0
        self.ort_seconds = 0.0  # wall time inside run_with_iobinding
        self.ort_calls = 0

        first = self._sessions["step"]
        in_types = {i.name: i.type for i in first.get_inputs()}
        self._kv_dtype = _KV_DTYPES.get(in_types.get(mf.past_key_name(0), ""))
        if self._kv_dtype is None:
            raise ManifestError(f"{self.model_dir}: graph input {mf.past_key_name(0)!r} is missing "
                                f"or not float32/float16")
        a = m.architecture
        kv_shape = [1, a.num_kv_heads, m.capacity, a.head_dim]
        device, device_id = kv_device(self.provider_config)
        zeros = np.zeros(kv_shape, self._kv_dtype)  # never-read garbage would be harmless too
        self._kv_names = [(past, present) for i in range(a.num_layers)
                          for past, present in ((mf.past_key_name(i), mf.present_key_name(i)),
                                                (mf.past_value_name(i), mf.present_value_name(i)))]
        self._kv_sets: list[list[ort.OrtValue]] = []  # [set][layer * 2 + (0 key | 1 value)]
        for _ in range(2 if self.kv_mode == "ping-pong" else 1):
            bufs = []
            for _ in self._kv_names:
                buf = ort.OrtValue.ortvalue_from_shape_and_type(kv_shape, self._kv_dtype, device,
                                                                 device_id)
                buf.update_inplace(zeros)
                bufs.append(buf)
            self._kv_sets.append(bufs)
        del zeros
        self._current = 0  # the KV set that holds the cache (ping-pong flips it after each run)

        # a prompt is fed in chunks: longer ones than a verify block where the graph's sequence
        # dimension is dynamic (not under TensorRT, whose profiles stop at max_verify_len);
        # 128 tokens amortise the per-call cost for a 25 MB logits buffer
        self.prefill_chunk: int = self.max_verify_len
        if "TensorrtExecutionProvider" not in self.providers:
            self.prefill_chunk = max(self.max_verify_len, min(PREFILL_CHUNK, m.capacity))
        longest = max(self.prefill_chunk, *(e.max_len for e in m.entry_points.values()))
        self._ids = np.zeros(longest, np.int64)  # [longest] staging for input_ids
        self._mask = np.ones(m.capacity, np.int64)  # [capacity], sliced to [1, length + S]
        self._positions = np.arange(m.capacity, dtype=np.int64)  # for graphs with position_ids
        self._logits = np.empty(longest * self.vocab_size, np.float32)  # [longest * vocab]
        self._logit_values: dict[int, ort.OrtValue] = {}  # S -> view of _logits as [1, S, vocab]
        # id(session) -> one IOBinding per current KV set (past = that set, present = the next)
        self._bindings: dict[int, list[_Binding]] = {}
        n_sets = len(self._kv_sets)
        for session in self._sessions.values():
            if id(session) not in self._bindings:
                self._bindings[id(session)] = [
                    _Binding(session, self._kv_names, self._kv_sets[k],
                             self._kv_sets[(k + 1) % n_sets], self.model_dir)
                    for k in range(n_sets)]

    # -- the Decoder protocol -------------------------------------------------------------------

    @property
    def length(self) -> int:
        return self._length

    def reset(self) -> None:
        self._length = 0

    def forward_token(self, token: int) -> np.ndarray:
        """Append one token; its next-token logits, [vocab] float32."""
        return self._run("step", self._check_tokens([token]))[0]

    def forward_batch(self, tokens: Sequence[int]) -> np.ndarray:
        """Append `tokens`; next-token logits after each, [n, vocab] float32."""
        ids = self._check_tokens(tokens)
        chunk = self.prefill_chunk
        if len(ids) <= chunk:
            return self._run("verify", ids)
        out = np.empty((len(ids), self.vocab_size), np.float32)  # [n, vocab]
        start = self._length
        try:
            for lo in range(0, len(ids), chunk):
                out[lo:lo + chunk] = self._run("verify", ids[lo:lo + chunk])
        except BaseException:
            self._length = start  # all or nothing
            raise
        return out

    def prefill(self, tokens: Sequence[int]) -> np.ndarray:
        """forward_batch keeping only the last row: [vocab] float32, without an [n, vocab] array."""
        ids = self._check_tokens(tokens)
        start = self._length
        try:
            for lo in range(0, len(ids), self.prefill_chunk):
                last = self._run("verify", ids[lo:lo + self.prefill_chunk], copy=False)[-1].copy()
        except BaseException:
            self._length = start
            raise
        return last

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens of the cache (0 <= length <= self.length). O(1)."""
        if isinstance(length, bool) or not isinstance(length, (int, np.integer)):
            raise InvalidOptionError(f"truncate length must be an integer, got {length!r}")
        if not 0 <= length <= self._length:
            raise InvalidOptionError(f"cannot truncate to {length}: the cache holds "
                                     f"{self._length} tokens (allowed 0..{self._length})")
        self._length = int(length)

    # -- internals ------------------------------------------------------------------------------

    def _check_tokens(self, tokens: Sequence[int]) -> np.ndarray:
        ids = np.asarray(tokens)
        if ids.ndim != 1 or ids.size == 0:
            raise InvalidPromptError(f"expected a non-empty 1-D sequence of token ids, got shape "
                                     f"{ids.shape}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise InvalidPromptError(f"token ids must be integers, got dtype {ids.dtype}")
        bad = (ids < 0) | (ids >= self.vocab_size)
        if bad.any():
            raise InvalidPromptError(f"token id {int(ids[bad][0])} is outside the vocabulary "
                                     f"0..{self.vocab_size - 1}")
        if self._length + ids.size > self.capacity:
            raise CapacityError(f"{ids.size} more tokens would make {self._length + ids.size}, "
                                f"over the KV capacity of {self.capacity} (export with a larger "
                                f"--capacity, or truncate/reset first)")
        return ids.astype(np.int64, copy=False)

    def _run(self, entry: str, ids: np.ndarray, *, copy: bool = True) -> np.ndarray:
        n = ids.size
        total = self._length + n
        session = self._sessions[entry]
        binding = self._bindings[id(session)][self._current]
        self._ids[:n] = ids
        binding.bind_step(
            self._ids[:n].reshape(1, n),  # [1, S]
            self._mask[:total].reshape(1, total),  # [1, past + S]
            self._positions[self._length:total].reshape(1, n),  # [1, S]
            self._logits_value(n),
        )
        t0 = time.perf_counter()
        session.run_with_iobinding(binding.io)
        self.ort_seconds += time.perf_counter() - t0
        self.ort_calls += 1
        logits = self._logits[: n * self.vocab_size].reshape(n, self.vocab_size)  # [S, vocab]
        if not np.isfinite(logits).all():
            raise NonFiniteLogitsError(f"the {entry} graph returned NaN or infinite logits at "
                                       f"positions {self._length}..{total - 1}")
        self._length = total
        self._current = (self._current + 1) % len(self._kv_sets)  # ping-pong: present is current
        return logits.copy() if copy else logits

    def _logits_value(self, n: int) -> ort.OrtValue:
        value = self._logit_values.get(n)
        if value is None:
            view = self._logits[: n * self.vocab_size].reshape(1, n, self.vocab_size)
            value = ort.OrtValue.ortvalue_from_numpy(view)  # shares memory with self._logits
            self._logit_values[n] = value
        return value

    def _open_sessions(self, threads: int | None,
                       session_options: ort.SessionOptions | None) -> dict[str, Any]:
        """One session per distinct graph file; both entry points share it when they can.

        Two graphs get `allow_spinning=0`, so their intra-op pools do not spin against each
        other. This never calls `set_global_thread_pool_sizes`: once global pools exist,
        onnxruntime 1.32 refuses every later session in the process that does not set
        `use_per_session_threads=False` (measured), a side effect a library must not have.
        When the application has created them, the sessions here join them.
        """
        graphs = {name: e.graph for name, e in self.manifest.entry_points.items()}
        for name, graph in graphs.items():
            mf.safe_member(self.model_dir, graph, what=f"entry point {name}")
        several = len(set(graphs.values())) > 1
        sessions: dict[str, ort.InferenceSession] = {}
        by_graph: dict[str, ort.InferenceSession] = {}
        for name, graph in graphs.items():
            if graph not in by_graph:
                if session_options is not None:
                    so = session_options
                else:
                    so = ort.SessionOptions()
                    # onnxruntime keeps a memory plan per input shape (~4.5 KiB each); with a new
                    # mask length every step that is growth bounded only by the capacity. Off:
                    # no measurable cost (21.9 vs 21.7 ms a step, 40.9 vs 39.4 ms a verify of 8)
                    so.enable_mem_pattern = False
                if threads is not None:
                    so.intra_op_num_threads = threads
                if several:
                    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
                by_graph[graph] = _session(str(self.model_dir / graph), so, self.provider_config)
            sessions[name] = by_graph[graph]
        return sessions

    def __repr__(self) -> str:
        return (f"OrtDecoder({str(self.model_dir)!r}, length={self._length}, "
                f"capacity={self.capacity}, providers={self.providers})")


_global_pools_seen = False  # set once a session creation showed the process has global pools


def _session(path: str, so: ort.SessionOptions, providers: list) -> ort.InferenceSession:
    """An InferenceSession; a graph onnxruntime refuses is a ManifestError naming the file."""
    try:
        return _new_session(path, so, providers)
    except _GRAPH_ERRORS as e:
        raise ManifestError(f"onnxruntime cannot load {Path(path).name!r}: "
                            f"{str(e).strip().splitlines()[0]}") from e


def _new_session(path: str, so: ort.SessionOptions, providers: list) -> ort.InferenceSession:
    global _global_pools_seen
    if not _global_pools_seen:
        try:
            return ort.InferenceSession(path, so, providers=providers)
        except Exception as e:  # noqa: BLE001 - only the global-thread-pool case is retried
            if "use_per_session_threads must be false" not in str(e):
                raise
            _global_pools_seen = True  # (onnxruntime printed its "EP Error" once)
    so.use_per_session_threads = False  # the application created global thread pools
    return ort.InferenceSession(path, so, providers=providers)


class _Binding:
    """One session's IOBinding: KV buffers bound once as past and present, the rest per call."""

    def __init__(self, session: ort.InferenceSession, names: list[tuple[str, str]],
                 past: list[ort.OrtValue], present: list[ort.OrtValue], model_dir: Path):
        self.io = session.io_binding()
        inputs = {i.name for i in session.get_inputs()}
        outputs = {o.name for o in session.get_outputs()}
        needed_in = {mf.INPUT_IDS, mf.ATTENTION_MASK, *(p for p, _ in names)}
        needed_out = {mf.LOGITS, *(q for _, q in names)}
        missing = sorted((needed_in - inputs) | (needed_out - outputs))
        extra = sorted(inputs - needed_in - {mf.POSITION_IDS})
        if missing or extra:
            raise ManifestError(f"{model_dir}: graph I/O does not match the manifest "
                                f"(missing {missing}, unexpected inputs {extra})")
        self.has_positions = mf.POSITION_IDS in inputs
        for (past_name, present_name), src, dst in zip(names, past, present, strict=True):
            self.io.bind_ortvalue_input(past_name, src)
            self.io.bind_ortvalue_output(present_name, dst)  # shared mode: src is dst, in place
        self._bound_logits: ort.OrtValue | None = None

    def bind_step(self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray,
                  logits: ort.OrtValue) -> None:
        self.io.bind_cpu_input(mf.INPUT_IDS, ids)
        self.io.bind_cpu_input(mf.ATTENTION_MASK, mask)
        if self.has_positions:
            self.io.bind_cpu_input(mf.POSITION_IDS, positions)
        if logits is not self._bound_logits:
            self.io.bind_ortvalue_output(mf.LOGITS, logits)
            self._bound_logits = logits
