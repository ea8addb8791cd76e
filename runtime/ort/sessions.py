"""`OrtSessions`: a model directory's ONNX Runtime sessions, opened once and shared read-only.

The sessions hold the weights (pre-packed by onnxruntime at load); everything a request changes
(KV buffers, bindings, the cache length) lives in an `OrtDecoder` made from them. onnxruntime's `InferenceSession.run_with_iobinding` may be called from several
threads at once, each with its own IOBinding, so one `OrtSessions` serves any number of
decoders (`OrtDecoder.on(sessions)`), concurrently.

`session_options` is the one builder of `onnxruntime.SessionOptions` the runtime uses.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from onnxruntime.capi import onnxruntime_pybind11_state as _ort_errors

from . import kernels, manifest as mf
from .graph_io import LOGIT_ROWS, past_key_name, past_value_name, present_key_name, present_value_name
from ..errors import InvalidOptionError, ManifestError
from .providers import TENSORRT, choose_providers, default_kv_mode, kv_device
from .row_invariance import lone_rows_exact
from ..validation import check_int

DYNAMIC_PREFILL_CALL_TOKENS = 128  # tokens per prefill call where the graph's sequence axis is dynamic
# tokens per call of a prompt whose logits are read at its last position only (`prefill`), where
# the graph runs its LM head on the rows `logit_rows` names: the SmolLM2-135M fp32 target reads
# a 1,536-token prompt in 0.90x the time in chunks of 512 as of 128 (0.87x in one call)
PROMPT_CHUNK = 512
# ... and at most this much attention scratch: GroupQueryAttention's scores of a chunk take
# heads x chunk x capacity float32s
PROMPT_SCRATCH_BYTES = 64 << 20
KV_MODES = ("shared", "ping-pong")  # one buffer set updated in place, or two that alternate
_GRAPH_ERRORS = (_ort_errors.InvalidGraph, _ort_errors.InvalidProtobuf, _ort_errors.NoSuchFile,
                 _ort_errors.NotImplemented, _ort_errors.InvalidArgument)
_KV_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


def session_options(*, threads: int | None = None, allow_spinning: bool = True) -> ort.SessionOptions:
    """The runtime's session options.

    - `enable_mem_pattern` off: onnxruntime keeps a memory plan per input shape (~4.5 KiB
      each); with a new mask length every step that is growth bounded only by the capacity.
      No measurable cost (21.9 vs 21.7 ms a step, 40.9 vs 39.4 ms a verify of 8).
    - `allow_spinning` False where several sessions share the process (a draft beside the
      target, two graph files): idle intra-op threads that spin fight for the cores (measured:
      the int4 draft pair ran at 0.87x plain decoding spinning, 1.15x not).
    - `threads`: intra-op threads (None or 0: onnxruntime's default).
    """
    so = ort.SessionOptions()
    so.enable_mem_pattern = False
    if not allow_spinning:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if threads is not None:
        so.intra_op_num_threads = threads
    return so


class OrtSessions:
    """The read-only half of a loaded model: manifest, providers, one session per graph file.

    Attributes are fixed after construction; `OrtDecoder.on(sessions)` makes the per-request
    half.
    """

    def __init__(self, model_dir: str | os.PathLike, *, manifest: mf.Manifest | None = None,
                 providers: Any = None, threads: int | None = None,
                 session_options: ort.SessionOptions | None = None, kv_mode: str | None = None,
                 allow_spinning: bool = True):
        self.model_dir = Path(model_dir)
        self.manifest = manifest if manifest is not None else mf.read_manifest(self.model_dir)
        m = self.manifest
        if threads is not None:
            check_int("threads", threads, minimum=0, what=" (0 = onnxruntime's default)")
        if kv_mode is not None and kv_mode not in KV_MODES:
            raise InvalidOptionError(f"kv_mode must be one of {', '.join(KV_MODES)}, got {kv_mode!r}")
        self.vocab_size: int = m.architecture.vocab_size
        # every call runs at least this many rows (Manifest.min_call_rows); a padding row
        # (the runtime's, or the graph's own in its attention: min_attention_rows) takes a KV
        # slot during the call, so one token fewer fits
        self.min_call_rows: int = m.min_call_rows
        self.capacity: int = m.capacity - m.reserved_slots
        self.max_verify_len: int = m.entry_points["verify"].max_len
        # a ProviderChoice (load_model's, made once for a target and its draft) or a spec
        self.provider_config = choose_providers(providers).for_model(m, self.model_dir)
        if m.min_call_rows < m.min_attention_rows and not self._lone_rows_exact(threads):
            self.min_call_rows = m.min_attention_rows  # this machine's kernels: pad calls
        self.kv_mode: str = kv_mode or default_kv_mode(self.provider_config)
        # a position's keys, values and logits are the same bits whatever call computed it
        # (`Manifest.rows_exact`): what copying an earlier prompt's prefix relies on
        self.rows_exact: bool = m.rows_exact
        self.by_entry = self._open(threads, session_options, allow_spinning)
        first = self.by_entry["step"]
        # intra-op threads the sessions run with (0: onnxruntime's default); part of the key
        # under which the cost curve is cached, since the relative cost of a block depends on it
        self.intra_op_threads: int = first.get_session_options().intra_op_num_threads
        self.providers: list[str] = first.get_providers()
        in_types = {i.name: i.type for i in first.get_inputs()}
        kv_dtype = _KV_DTYPES.get(in_types.get(past_key_name(0), ""))
        if kv_dtype is None:
            raise ManifestError(f"{self.model_dir}: graph input {past_key_name(0)!r} is missing "
                                f"or not float32/float16")
        self.kv_dtype: type = kv_dtype
        a = m.architecture
        self.kv_shape = [1, a.num_kv_heads, m.capacity, a.head_dim]
        self.kv_device: tuple[str, int] = kv_device(self.provider_config)
        self.kv_names = [(past, present) for i in range(a.num_layers)
                         for past, present in ((past_key_name(i), present_key_name(i)),
                                               (past_value_name(i), present_value_name(i)))]
        # a prompt is fed in chunks: longer ones than a verify block where the graph's sequence
        # dimension is dynamic (not under TensorRT, whose profiles stop at max_verify_len);
        # 128 tokens amortise the per-call cost for a 25 MB logits buffer
        self.prefill_chunk: int = self.max_verify_len
        if TENSORRT not in self.providers:
            self.prefill_chunk = max(self.max_verify_len, min(DYNAMIC_PREFILL_CALL_TOKENS, m.capacity))
        self.longest_call: int = max(self.prefill_chunk, *(e.max_len for e in m.entry_points.values()))
        self.prompt_chunk: int = self.prefill_chunk
        verify_inputs = {i.name for i in self.by_entry["verify"].get_inputs()}
        if TENSORRT not in self.providers and LOGIT_ROWS in verify_inputs:
            scratch = PROMPT_SCRATCH_BYTES // (4 * a.num_heads * m.capacity)
            self.prompt_chunk = max(self.prefill_chunk, min(PROMPT_CHUNK, m.capacity, scratch))
        # what the cost-curve cache is keyed by: this graph's checksum
        verify_graph = m.entry_points["verify"].graph
        self.graph_digest: str = m.files.get(verify_graph, "")

    @property
    def kv_bytes_per_decoder(self) -> int:
        """Device memory one decoder's KV buffers take (both sets in ping-pong mode)."""
        per_set = len(self.kv_names) * int(np.prod(self.kv_shape)) * np.dtype(self.kv_dtype).itemsize
        return per_set * (2 if self.kv_mode == "ping-pong" else 1)

    @property
    def logits_bytes_per_decoder(self) -> int:
        """Host memory of one decoder's logits buffer (the longest call's rows)."""
        return self.longest_call * self.vocab_size * 4

    def _open(self, threads: int | None, options: ort.SessionOptions | None,
              allow_spinning: bool) -> dict[str, ort.InferenceSession]:
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
        spinning = allow_spinning and len(set(graphs.values())) == 1
        by_entry: dict[str, ort.InferenceSession] = {}
        by_graph: dict[str, ort.InferenceSession] = {}
        for name, graph in graphs.items():
            if graph not in by_graph:
                so = options
                if so is None:
                    so = session_options(threads=threads, allow_spinning=spinning)
                else:  # the caller's options, with the two settings this loader owns
                    if threads is not None:
                        so.intra_op_num_threads = threads
                    if not spinning:
                        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
                by_graph[graph] = open_session(str(self.model_dir / graph), so, self.provider_config)
            by_entry[name] = by_graph[graph]
        return by_entry

    def _lone_rows_exact(self, threads: int | None) -> bool:
        """Whether the export's row probe finds its kernels computing a lone row as among
        several here (False without a probe: then every call runs two rows)."""
        probe = self.manifest.row_probe
        if probe is None:
            return False
        path = mf.safe_member(self.model_dir, probe, what="manifest.row_probe")
        names = tuple(name for name, _ in self.provider_config)
        return _probe_verdict(str(path), threads, names)

    def __repr__(self) -> str:
        return f"OrtSessions({str(self.model_dir)!r}, providers={self.providers})"


@functools.lru_cache(maxsize=32)
def _probe_verdict(path: str, threads: int | None, providers: tuple[str, ...]) -> bool:
    """row_invariance.lone_rows_exact on the probe at `path`, once a process per settings."""
    probe = open_session(path, session_options(threads=threads, allow_spinning=False),
                     list(providers))
    return lone_rows_exact(probe)


_global_pools_seen = False  # set once a session creation showed the process has global pools


def open_session(path: str, so: ort.SessionOptions, providers: list) -> ort.InferenceSession:
    """An InferenceSession; a graph onnxruntime refuses is a ManifestError naming the file."""
    try:
        return _new_session(path, so, providers)
    except _GRAPH_ERRORS as e:
        raise ManifestError(f"onnxruntime cannot load {Path(path).name!r}: "
                            f"{str(e).strip().splitlines()[0]}") from e


def _new_session(path: str, so: ort.SessionOptions, providers: list) -> ort.InferenceSession:
    global _global_pools_seen
    kernels.register(so)  # a graph may hold ortspec.Q4Gemm
    if not _global_pools_seen:
        try:
            return ort.InferenceSession(path, so, providers=providers)
        except Exception as e:  # noqa: BLE001 - only the global-thread-pool case is retried
            if "use_per_session_threads must be false" not in str(e):
                raise
            _global_pools_seen = True  # (onnxruntime printed its "EP Error" once)
    so.use_per_session_threads = False  # the application created global thread pools
    return ort.InferenceSession(path, so, providers=providers)
