"""How cheap can a verify row be on this machine? The arithmetic floor of c(k)/c(1) for an export.

    .venv/bin/python scripts/row_floor.py [MODEL_DIR] [--context 256] [--rows 8] [--threads 2]

A verify of k rows costs a step plus k - 1 rows of arithmetic that a step's memory traffic
cannot hide. This script puts a lower bound on that arithmetic and compares it with the
export's measured curve:

1. It compiles a small probe with the system C compiler (a development tool: the runtime never
   needs one) and times, on one core, long chains of independent 512-bit `vpdpbusd` (64 int8
   multiply-adds each; AVX-512 VNNI), 256-bit `vpmaddubsw` (32; AVX2) and 256-bit FMA (8 float
   multiply-adds), 12 accumulators deep so latency hides; and the rate at which `--threads`
   threads read memory (a 256 MiB buffer, four in turn, the best of 8 passes).
2. It reads the export's graph: every ortspec or MatMulNBits product's K x N (integer
   multiply-adds a row), and the attention's heads, head size and layers (float multiply-adds a
   row at the given context: scores and weighted values).
3. The floor of a step = the bytes it must read (every weight but the embedding table, of which
   it looks up one row, and the float32 keys and values of the context) / that rate. The floor
   of one row = integer MACs / (MACs an op) x (time an op) + attention MACs / 8 x (time
   an FMA), divided by the threads: every multiply at the core's peak, no scale or offset
   arithmetic, no activation rounding, no norm, no thread waits, perfect scaling.
4. It times the step and a verify of `--rows` tokens through OrtDecoder as
   `python -m ortspec.runtime.bench.graph` does (context filled once, calls rolled back,
   shuffled, medians), and prints the floor of c(k)/c(1) = 1 + (k - 1) x floor / c(1) beside the
   measured ratio.

The probe and the decoder run in one process, one after the other; run it twice or more, as the
machine's speed drifts. Needs the export extra (onnx) and a C compiler (`cc`).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PROBE = r"""
#include <immintrin.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
#define CHAIN(T, INIT, OP) do { T a[12];                                                  \
    _Pragma("GCC unroll 12") for (int i = 0; i < 12; i++) a[i] = INIT;                   \
    double t0 = now();                                                                   \
    for (long n = 0; n < reps; n++) {                                                    \
        _Pragma("GCC unroll 12") for (int i = 0; i < 12; i++) a[i] = OP;                 \
        __asm__ volatile("" : "+v"(a[0]), "+v"(a[1]), "+v"(a[2]), "+v"(a[3]),            \
                         "+v"(a[4]), "+v"(a[5]), "+v"(a[6]), "+v"(a[7]), "+v"(a[8]),     \
                         "+v"(a[9]), "+v"(a[10]), "+v"(a[11]));                          \
    }                                                                                    \
    return (now() - t0) / (12.0 * reps) * 1e9; } while (0)
__attribute__((target("avx512f,avx512bw,avx512vnni")))
double ns_dpbusd512(long reps) {
    __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);
    CHAIN(__m512i, _mm512_set1_epi32(i), _mm512_dpbusd_epi32(a[i], w, x));
}
__attribute__((target("avx2")))
double ns_maddubs256(long reps) {
    __m256i w = _mm256_set1_epi8(3);
    CHAIN(__m256i, _mm256_set1_epi8((char)i), _mm256_maddubs_epi16(w, a[i]));
}
__attribute__((target("avx2,fma")))
double ns_fma256(long reps) {
    __m256 y = _mm256_set1_ps(1.0001f), z = _mm256_set1_ps(0.9999f);
    CHAIN(__m256, _mm256_set1_ps((float)i), _mm256_fmadd_ps(a[i], y, z));
}

/* bytes a second that `threads` threads read from memory, each its share of a buffer of `bytes`
 * (passes over 4 buffers in turn, so none is in the cache; the best pass) */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
typedef struct { const char *p; size_t n; long long sum; } Share;
__attribute__((target("avx2")))
static void *read_share(void *arg) {
    Share *s = arg;
    __m256i a = _mm256_setzero_si256(), b = a;
    for (size_t i = 0; i < s->n; i += 128) {
        a = _mm256_xor_si256(a, _mm256_load_si256((const __m256i *)(s->p + i)));
        b = _mm256_xor_si256(b, _mm256_load_si256((const __m256i *)(s->p + i + 32)));
        a = _mm256_xor_si256(a, _mm256_load_si256((const __m256i *)(s->p + i + 64)));
        b = _mm256_xor_si256(b, _mm256_load_si256((const __m256i *)(s->p + i + 96)));
    }
    s->sum = _mm256_extract_epi64(_mm256_xor_si256(a, b), 0);
    return NULL;
}
double read_bandwidth(int threads, size_t bytes, int passes) {
    if (threads < 1 || threads > 64) return -1;
    size_t share = bytes / threads / 128 * 128;
    char *buf[4];
    for (int c = 0; c < 4; c++) {
        buf[c] = aligned_alloc(4096, share * threads);
        if (!buf[c]) return -1;
        memset(buf[c], c + 1, share * threads);
    }
    double best = 0;
    for (int pass = 0; pass < passes; pass++) {
        Share s[64];
        pthread_t t[64];
        double t0 = now();
        for (int i = 0; i < threads; i++) {
            s[i].p = buf[pass % 4] + i * share;
            s[i].n = share;
            pthread_create(&t[i], NULL, read_share, &s[i]);
        }
        for (int i = 0; i < threads; i++) pthread_join(t[i], NULL);
        double rate = share * threads / (now() - t0);
        if (rate > best) best = rate;
    }
    for (int c = 0; c < 4; c++) free(buf[c]);
    return best;
}
"""


def build_probe(work: Path) -> ctypes.CDLL:
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        raise SystemExit("row_floor: no C compiler (cc) on PATH; set CC to one")
    src, lib = work / "probe.c", work / "probe.so"
    src.write_text(PROBE)
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-pthread", str(src), "-o", str(lib)],
                   check=True)
    probe = ctypes.CDLL(str(lib))
    for name in ("ns_dpbusd512", "ns_maddubs256", "ns_fma256"):
        getattr(probe, name).restype = ctypes.c_double
        getattr(probe, name).argtypes = [ctypes.c_long]
    probe.read_bandwidth.restype = ctypes.c_double
    probe.read_bandwidth.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
    return probe


def has_vnni512() -> bool:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return all(f in flags.split() for f in ("avx512f", "avx512bw", "avx512_vnni"))


def _graph(model_dir: Path):
    """(the manifest, the verify entry point's graph without its weights' data)"""
    import onnx

    from ortspec.runtime.ort import manifest as mf

    man = mf.read_manifest(model_dir)
    return man, onnx.load(str(model_dir / man.entry_points["verify"].graph),
                          load_external_data=False).graph


def step_bytes(model_dir: Path, context: int) -> int:
    """Bytes a step reads at least: every initializer but the tables it looks a row up in (an
    embedding's values and scales, the rotary cos and sin), and the keys and values of `context`
    positions (at the export's KV cache dtype)"""
    from onnx import helper

    man, graph = _graph(model_dir)
    looked_up = set()
    for node in graph.node:
        if node.op_type in ("Gather", "GatherBlockQuantized"):
            looked_up.update(node.input)
        elif node.op_type in ("RotaryCacheAttention", "RotaryCacheAttention16"):
            looked_up.update(node.input[5:7])
    total = 0
    for init in graph.initializer:
        if init.name in looked_up:
            continue
        count = 1
        for d in init.dims:
            count *= d
        total += count * helper.tensor_dtype_to_np_dtype(init.data_type).itemsize
    arch = man.architecture
    kv_bytes = 2 if man.extra.get("kv_cache") == "fp16" else 4
    return total + 2 * kv_bytes * arch.num_layers * arch.num_kv_heads * arch.head_dim * context


def graph_macs(model_dir: Path, context: int) -> tuple[int, int]:
    """(integer multiply-adds a row in the products, float ones in the attention at `context`)"""
    import onnx

    from ortspec.export.row_probe import ORTSPEC_OPS

    man, graph = _graph(model_dir)
    ints = 0
    for node in graph.node:
        attrs = {a.name: a.i for a in node.attribute if a.type == onnx.AttributeProto.INT}
        if node.op_type in (*ORTSPEC_OPS, "MatMulNBits") and "K" in attrs and "N" in attrs:
            ints += attrs["K"] * attrs["N"]
    arch = man.architecture
    attention = 2 * arch.num_layers * arch.num_heads * arch.head_dim * context
    return ints, attention


def measured_curve(model_dir: Path, *, context: int, rows: int, threads: int,
                   reps: int) -> tuple[float, float]:
    from ortspec.runtime.bench.graph import time_calls
    from ortspec.runtime.ort.decoder import OrtDecoder

    decoder = OrtDecoder(model_dir, threads=threads)
    table = time_calls({"model": decoder}, context=context, lengths=[1, rows], reps=reps)
    by_block = {row.block: row.median_ms for row in table}
    return by_block[1], by_block[rows]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", nargs="?", help="an export (default: the default model's)")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rows", type=int, default=8, help="the verify block k")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    if args.rows < 2:
        ap.error("--rows must be at least 2")
    from ortspec.runtime.paths import default_model_path

    model_dir = Path(args.model_dir) if args.model_dir else Path(default_model_path())
    with tempfile.TemporaryDirectory() as work:
        probe = build_probe(Path(work))
        reps = 5_000_000
        vnni = has_vnni512()
        int_ns, int_macs = (probe.ns_dpbusd512(reps), 64) if vnni else (probe.ns_maddubs256(reps), 32)
        fma_ns = probe.ns_fma256(reps)
        bandwidth = probe.read_bandwidth(args.threads, 256 << 20, 8)
    ints, floats = graph_macs(model_dir, args.context)
    read = step_bytes(model_dir, args.context)
    floor_ms = (ints / int_macs * int_ns + floats / 8 * fma_ns) / args.threads / 1e6
    step_ms, verify_ms = measured_curve(model_dir, context=args.context, rows=args.rows,
                                        threads=args.threads, reps=args.reps)
    k = args.rows
    op = "vpdpbusd zmm" if vnni else "vpmaddubsw ymm"
    lines = [
        f"model {model_dir}  context {args.context}  threads {args.threads}",
        "",
        "| quantity | value |",
        "|---|---|",
        f"| integer multiply-adds a row (products) | {ints / 1e6:.1f} M |",
        f"| float multiply-adds a row (attention at {args.context}) | {floats / 1e6:.2f} M |",
        f"| {op}, one core ({int_macs} MACs) | {int_ns:.3f} ns |",
        f"| FMA ymm, one core (8 MACs) | {fma_ns:.3f} ns |",
        f"| floor of one more row, {args.threads} threads | {floor_ms:.3f} ms |",
        f"| bytes a step reads (weights, KV at {args.context}) | {read / 1e6:.1f} MB |",
        f"| memory read, {args.threads} threads | {bandwidth / 1e9:.1f} GB/s |",
        f"| floor of a step (those bytes at that rate) | {read / bandwidth * 1e3:.2f} ms |",
        f"| step c(1), measured | {step_ms:.2f} ms |",
        f"| verify of {k}, measured | {verify_ms:.2f} ms |",
        f"| one more row, measured ((c({k}) - c(1)) / {k - 1}) | {(verify_ms - step_ms) / (k - 1):.3f} ms |",
        f"| floor of c({k})/c(1) = 1 + {k - 1} x floor / c(1) | {1 + (k - 1) * floor_ms / step_ms:.2f} |",
        f"| c({k})/c(1), measured | {verify_ms / step_ms:.2f} |",
    ]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
