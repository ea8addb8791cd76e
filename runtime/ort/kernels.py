"""ortspec's own onnxruntime kernels (runtime/ort/_q4kernel.c): the custom ops `ortspec.Q4Gemm`
and `ortspec.Q8Gemm` (the int4 layers and the 8-bit head), `ortspec.Q4GemmSwiGlu` (a gated
MLP's gate and up product with its SiLU gating, one node), `ortspec.Q4GemmNorm` and
`ortspec.Q4GemmSwiGluNorm` (the same products with the skip RMSNorm before them inside the
node), `ortspec.CacheAttention` (the
attention over the KV cache, read in place) and `ortspec.RotaryCacheAttention` (the same with
the rotary embedding and the cache writes inside).

pip builds the C file as an extension module of this package; onnxruntime loads it with
`SessionOptions.register_custom_ops_library`, and `_new_session` (sessions.py) does that for
every session the runtime opens, so a graph that holds the op loads like any other. The library
is never imported. Where it was not built, or the CPU lacks AVX2 and FMA, `available()` is
False and the exporter writes onnxruntime's MatMulNBits instead.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.util
from pathlib import Path

import onnxruntime as ort

DOMAIN = "ortspec"
OP = "Q4Gemm"
_MODULE = "ortspec.runtime.ort._q4kernel"
_MARK = "ortspec.kernels.registered"  # a session config entry: the library is on these options
ISA_NAMES = {0: "none", 1: "avx2", 2: "avx512-vnni", 3: "avx512-vnni+amx"}


@functools.lru_cache(maxsize=1)
def library_path() -> str | None:
    """The built library's file, or None where the install did not build it."""
    spec = importlib.util.find_spec(_MODULE)
    return spec.origin if spec is not None and spec.origin else None


@functools.lru_cache(maxsize=1)
def library_digest() -> str:
    """The sha256 of the built library's file, "" where there is none: measurements of calls
    that may run its ops (the draft-length policy's cost curves) are filed under it."""
    path = library_path()
    return "" if path is None else hashlib.sha256(Path(path).read_bytes()).hexdigest()


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    path = library_path()
    return None if path is None else ctypes.CDLL(path)


def isa() -> int:
    """Which kernel runs here: 3 AVX-512 VNNI with AMX-INT8 (for products of several rows),
    2 AVX-512 VNNI, 1 AVX2, 0 none (or no library)."""
    lib = _library()
    return 0 if lib is None else int(lib.ortspec_q4_isa())


def available() -> bool:
    """Whether ortspec's ops can run in this process."""
    return isa() > 0


def register(so: ort.SessionOptions) -> None:
    """Put the library on `so` (once; a no-op where it is not available)."""
    if not available():
        return
    try:
        if so.get_session_config_entry(_MARK) == "1":
            return
    except Exception:  # noqa: BLE001 - onnxruntime raises for an entry never set
        pass
    so.register_custom_ops_library(library_path())
    so.add_session_config_entry(_MARK, "1")
