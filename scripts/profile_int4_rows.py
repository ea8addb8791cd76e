"""What does one more row cost in `com.microsoft::MatMulNBits`, against an fp32 MatMul?

    .venv/bin/python scripts/profile_int4_rows.py [--rounds 7] [--threads 2] [--json out.json]

Single-op microbenchmarks at the default model's shapes (SmolLM2-135M: hidden 576,
intermediate 1536, 3 KV heads of 64, vocab 49152): q/o 576->576, k/v 576->192, fused qkv
576->960, gate/up 576->1536, fused gate_up 576->3072, down 1536->576 and the LM head
576->49152 (4 and 8 bits). For each shape, every MatMulNBits configuration (accuracy level
0, 1, 4; block size 32, 64, 128; no zero points (symmetric, the default zero point) or uint8
zero points) and the fp32 MatMul of the same shape run at M = 1, 2, 4, 8, 16 rows, interleaved:
each round runs every (configuration, M) once in an order rotated from round to round, and the
table gives the median over rounds (the machine's speed drifts 2-3x over minutes, so only the
ratios of interleaved runs mean anything).

A graph holds R copies of the op (distinct initializers, the same input), so that the session's
dispatch is amortised; t is the time per op call (graph time / R). Columns: t(1) in
microseconds, t(M)/t(1), and `row vs fp32` = (t(8) - t(1)) / (tf(8) - tf(1)), the cost of an
extra row relative to the fp32 MatMul's extra row (1.0: an int4 row costs as much as an fp32
row), the same from the medians' minima, and `2->16 vs fp32` = (t(16) - t(2)) / (tf(16) - tf(2))
(leaves out the one-row paths: onnxruntime's M = 1 kernels differ from its M > 1 ones). `--profile` also runs onnxruntime's session profiler on one case per accuracy level and
prints what its node events say. `--models INT4_DIR FP32_DIR [--skip-ops]`: the verify-cost
curve through the runtime (a step, verifies of 1, 2, 4, 8 tokens after 256 tokens of context,
rolled back with truncate, the models interleaved) and, with --profile, each model's
onnxruntime profile of steps and 8-token verifies summed by op type. Needs the export extra (onnx); weights from
export/quantize.py's `quantize_blockwise`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from ortspec.export.quantize import quantize_blockwise

SHAPES = [  # name, K, N, bits
    ("q/o", 576, 576, 4), ("k/v", 576, 192, 4), ("qkv", 576, 960, 4),
    ("gate/up", 576, 1536, 4), ("gate_up", 576, 3072, 4), ("down", 1536, 576, 4),
    ("lm_head", 576, 49152, 4), ("lm_head", 576, 49152, 8),
]
ROWS = (1, 2, 4, 8, 16)
LEVELS = (0, 1, 4)
BLOCKS = (32, 64, 128)
ZP = ("none", "uint8")


def _graph(name: str, k: int, n: int, copies: int, node, inits) -> bytes:
    a = helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])
    outs = [helper.make_tensor_value_info(f"Y{i}", TensorProto.FLOAT, ["M", n])
            for i in range(copies)]
    nodes = [node(i) for i in range(copies)]
    g = helper.make_graph(nodes, name, [a], outs, initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                            helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 8
    return m.SerializeToString()


def fp32_model(w: np.ndarray, copies: int) -> bytes:
    n, k = w.shape
    inits = [numpy_helper.from_array(np.ascontiguousarray(w.T), f"W{i}") for i in range(copies)]
    return _graph("fp32", k, n, copies,
                  lambda i: helper.make_node("MatMul", ["A", f"W{i}"], [f"Y{i}"]), inits)


def nbits_model(w: np.ndarray, copies: int, *, bits: int, block: int, level: int,
                zp: str) -> bytes:
    n, k = w.shape
    if k % block:  # K = 576 in blocks of 128: the last block is padded (MatMulNBits' own layout)
        w = np.pad(w, ((0, 0), (0, -k % block)))
    qw = quantize_blockwise(w, bits=bits, block_size=block,
                            scheme="symmetric" if zp == "none" else "zero-point")
    inits = []
    for i in range(copies):
        inits.append(numpy_helper.from_array(qw.packed, f"B{i}"))
        inits.append(numpy_helper.from_array(qw.scales.reshape(-1), f"S{i}"))
        if qw.zero_points is not None:
            inits.append(numpy_helper.from_array(qw.zero_points.reshape(-1), f"Z{i}"))

    def node(i):
        ins = ["A", f"B{i}", f"S{i}"] + ([f"Z{i}"] if qw.zero_points is not None else [])
        return helper.make_node("MatMulNBits", ins, [f"Y{i}"], domain="com.microsoft",
                                K=k, N=n, bits=bits, block_size=block, accuracy_level=level)
    return _graph("nbits", k, n, copies, node, inits)


def row_int8_model(w: np.ndarray, copies: int) -> bytes:
    """The candidate of `--row-int8`: int8 weights with a scale per output column (symmetric),
    activations quantized per row (scale max|a| / 127, stored as uint8 around a zero point of
    128), `MatMulInteger` (MLAS's u8s8 integer GEMM, int32 sums) and the two scales applied
    after. Every row's result is
    that row's alone, whatever the other rows hold (integer sums are exact), so a call of any
    row count computes what a lone row does."""
    n, k = w.shape
    col = np.maximum(np.abs(w).max(axis=1), 1e-12) / 127.0  # [N]
    wq = np.clip(np.round(w / col[:, None]), -127, 127).astype(np.int8)  # [N, K]
    inits = [numpy_helper.from_array(np.array(1e-12, np.float32), "eps"),
             numpy_helper.from_array(np.array(127.0, np.float32), "q"),
             # uint8 activations around a zero point of 128: MLAS's u8s8 integer GEMM
             numpy_helper.from_array(np.array(128.0, np.float32), "off"),
             numpy_helper.from_array(np.array(128, np.uint8), "azp")]
    for i in range(copies):
        inits.append(numpy_helper.from_array(np.ascontiguousarray(wq.T), f"B{i}"))
        inits.append(numpy_helper.from_array(col.astype(np.float32), f"C{i}"))

    def chain(i):
        return [
            helper.make_node("Abs", ["A"], [f"abs{i}"]),
            helper.make_node("ReduceMax", [f"abs{i}"], [f"amax{i}"], axes=[1], keepdims=1),
            helper.make_node("Max", [f"amax{i}", "eps"], [f"amaxe{i}"]),
            helper.make_node("Div", [f"amaxe{i}", "q"], [f"s{i}"]),  # [M, 1]
            helper.make_node("Div", ["A", f"s{i}"], [f"as{i}"]),
            helper.make_node("Round", [f"as{i}"], [f"ar{i}"]),
            helper.make_node("Add", [f"ar{i}", "off"], [f"ao{i}"]),
            helper.make_node("Cast", [f"ao{i}"], [f"aq{i}"], to=TensorProto.UINT8),
            helper.make_node("MatMulInteger", [f"aq{i}", f"B{i}", "azp"], [f"y32{i}"]),
            helper.make_node("Cast", [f"y32{i}"], [f"yf{i}"], to=TensorProto.FLOAT),
            helper.make_node("Mul", [f"yf{i}", f"s{i}"], [f"yr{i}"]),
            helper.make_node("Mul", [f"yr{i}", f"C{i}"], [f"Y{i}"]),
        ]
    a = helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])
    outs = [helper.make_tensor_value_info(f"Y{i}", TensorProto.FLOAT, ["M", n])
            for i in range(copies)]
    g = helper.make_graph([node for i in range(copies) for node in chain(i)], "row_int8", [a],
                          outs, initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m.SerializeToString()


def session(model: bytes, threads: int, profile: str | None = None) -> ort.InferenceSession:
    so = ort.SessionOptions()  # as runtime/ort/sessions.py's session_options(threads=2)
    so.enable_mem_pattern = False
    so.intra_op_num_threads = threads
    if profile:
        so.enable_profiling = True
        so.profile_file_prefix = profile
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


class Case:
    """One session, bound once per row count (inputs and outputs preallocated)."""

    def __init__(self, key, sess: ort.InferenceSession, k: int, n: int, copies: int):
        self.key, self.sess, self.copies = key, sess, copies
        rng = np.random.default_rng(0)
        self.bind = {}
        for m in ROWS:
            b = sess.io_binding()
            b.bind_ortvalue_input("A", ort.OrtValue.ortvalue_from_numpy(
                rng.standard_normal((m, k)).astype(np.float32)))
            for i in range(copies):
                b.bind_ortvalue_output(f"Y{i}", ort.OrtValue.ortvalue_from_numpy(
                    np.empty((m, n), np.float32)))
            self.bind[m] = b
        self.times = {m: [] for m in ROWS}

    def run(self, m: int, calls: int) -> None:
        b = self.bind[m]
        self.sess.run_with_iobinding(b)  # warm
        t0 = time.perf_counter()
        for _ in range(calls):
            self.sess.run_with_iobinding(b)
        self.times[m].append((time.perf_counter() - t0) / calls / self.copies)

    def t(self, m: int) -> float:
        return statistics.median(self.times[m])


def bench_shape(name, k, n, bits, args) -> list[dict]:
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    copies = 1 if n > 10000 else args.copies
    calls = 3 if n > 10000 else args.calls
    cases = [Case(("fp32", None, None, None), session(fp32_model(w, copies), args.threads), k, n,
                  copies)]
    if args.row_int8:
        cases.append(Case(("int8-row", None, None, None),
                          session(row_int8_model(w, copies), args.threads), k, n, copies))
    for level in (args.levels if args.levels is not None else LEVELS):
        for block in (args.blocks if args.blocks is not None else BLOCKS):
            for zp in ZP:
                model = nbits_model(w, copies, bits=bits, block=block, level=level, zp=zp)
                cases.append(Case((f"int{bits}", level, block, zp),
                                  session(model, args.threads), k, n, copies))
    work = [(c, m) for c in cases for m in ROWS]
    for r in range(args.rounds):
        shift = (r * 7) % len(work)
        order = work[shift:] + work[:shift]
        if r % 2:
            order.reverse()
        for c, m in order:
            c.run(m, calls)
    f = cases[0]
    f_row = (f.t(8) - f.t(1)) / 7
    out = []
    for c in cases:
        fmt, level, block, zp = c.key
        row = (c.t(8) - c.t(1)) / 7
        out.append(dict(shape=name, K=k, N=n, format=fmt, accuracy_level=level, block=block,
                        zero_points=zp, t_us={m: c.t(m) * 1e6 for m in ROWS},
                        t_min_us={m: min(c.times[m]) * 1e6 for m in ROWS},
                        ratio={m: c.t(m) / c.t(1) for m in ROWS},
                        row_vs_fp32=row / f_row if f_row > 0 else float("nan"),
                        row_us=row * 1e6, t1_vs_fp32=c.t(1) / f.t(1),
                        slope_vs_fp32=((c.t(16) - c.t(2)) / (f.t(16) - f.t(2))),
                        row_vs_fp32_min=(min(c.times[8]) - min(c.times[1]))
                        / (min(f.times[8]) - min(f.times[1]))))
    return out


def table(results: list[dict]) -> str:
    lines = ["| shape | K->N | format | acc | block | zp | t(1) us | t(1)/fp32 | "
             + " | ".join(f"t({m})/t(1)" for m in ROWS[1:]) + " | row us | row vs fp32 | (mins) | 2->16 vs fp32 |",
             "|---|---|---|---|---|---|---|---|" + "---|" * (len(ROWS) - 1) + "---|---|---|---|"]
    for r in results:
        acc = "" if r["accuracy_level"] is None else r["accuracy_level"]
        lines.append(
            f"| {r['shape']} | {r['K']}->{r['N']} | {r['format']} | {acc} | {r['block'] or ''} | "
            f"{r['zero_points'] or ''} | {r['t_us'][1]:.1f} | {r['t1_vs_fp32']:.2f} | "
            + " | ".join(f"{r['ratio'][m]:.2f}" for m in ROWS[1:])
            + f" | {r['row_us']:.2f} | {r['row_vs_fp32']:.2f} | {r['row_vs_fp32_min']:.2f} | "
            f"{r['slope_vs_fp32']:.2f} |")
    return "\n".join(lines)


def profile_cases(args) -> str:
    """One op per accuracy level through the session profiler: what its node events say."""
    k, n = 576, 1536
    w = (np.random.default_rng(1).standard_normal((n, k)) * 0.05).astype(np.float32)
    lines = []
    tmp = tempfile.mkdtemp()
    for level in LEVELS:
        for m in (1, 8):
            s = session(nbits_model(w, 1, bits=4, block=32, level=level, zp="none"),
                        args.threads, profile=os.path.join(tmp, f"p{level}_{m}"))
            a = np.random.default_rng(0).standard_normal((m, k)).astype(np.float32)
            for _ in range(20):
                s.run(None, {"A": a})
            path = s.end_profiling()
            with open(path) as fh:
                events = json.load(fh)
            kern = [e for e in events if e.get("cat") == "Node"
                    and e.get("name", "").endswith("_kernel_time")]
            durs = sorted(e["dur"] for e in kern)
            argkeys = sorted({key for e in kern for key in e.get("args", {})})
            a0 = kern[-1].get("args", {}) if kern else {}
            lines.append(f"| {level} | {m} | {a0.get('op_name')} | {a0.get('provider')} | "
                         f"{durs[len(durs) // 2] if durs else ''} | {', '.join(argkeys)} |")
    return ("| acc | M | op_name | provider | median kernel us | event args |\n"
            "|---|---|---|---|---|---|\n" + "\n".join(lines))


CONTEXT = 256
VERIFY = (1, 2, 4, 8)


def model_curves(dirs: list[str], args) -> str:
    """c(k)/c(1) through the runtime: a step (forward_token) and verifies of k tokens
    (forward_batch) after CONTEXT tokens, each rolled back with truncate; the models
    interleaved (A B B A), medians over rounds."""
    from ortspec.runtime import load_model
    decs = []
    for d in dirs:
        dec = load_model(d, threads=args.threads, draft=False).decoder
        dec.prefill(list(range(1000, 1000 + CONTEXT)))
        decs.append(dec)
    toks = list(range(2000, 2016))
    times = {(i, k): [] for i in range(len(dirs)) for k in ("step",) + VERIFY}
    for r in range(args.model_rounds):
        order = list(range(len(decs)))
        for i in (order if r % 2 == 0 else order[::-1]):
            dec = decs[i]
            # untimed: the model timed before this one leaves its intra-op threads spinning for
            # a while, which would fall on whichever call came first
            dec.forward_token(toks[0])
            dec.truncate(CONTEXT)
            for k in ("step",) + VERIFY:
                calls = []
                for _ in range(args.model_calls):
                    t0 = time.perf_counter()
                    if k == "step":
                        dec.forward_token(toks[0])
                    else:
                        dec.forward_batch(toks[:k])
                    calls.append(time.perf_counter() - t0)
                    dec.truncate(CONTEXT)
                times[i, k].append(statistics.median(calls))
    lines = ["| model | step ms | " + " | ".join(f"c({k})/step" for k in VERIFY) + " |",
             "|---|---|" + "---|" * len(VERIFY)]
    for i, d in enumerate(dirs):
        step = statistics.median(times[i, "step"])
        ratios = [statistics.median(a / b for a, b in zip(times[i, k], times[i, "step"]))
                  for k in VERIFY]
        lines.append(f"| {os.path.basename(d.rstrip('/'))} | {step * 1e3:.2f} | "
                     + " | ".join(f"{x:.2f}" for x in ratios) + " |")
    return "\n".join(lines)


def _category(name: str, op: str) -> str:
    if "lm_head" in name or "lm_head" in op:
        return "LM head (" + op + ")"
    return op


def model_profile(d: str, args) -> str:
    """onnxruntime's profiler over N steps then N verifies of 8 (rolled back): mean
    microseconds a call by op type (the LM head apart)."""
    from ortspec.runtime.ort.decoder import OrtDecoder
    from ortspec.runtime.ort.sessions import OrtSessions, session_options
    n = args.model_calls * 4
    so = session_options(threads=args.threads)
    so.enable_profiling = True
    so.profile_file_prefix = os.path.join(tempfile.mkdtemp(), "model")
    sessions = OrtSessions(d, threads=args.threads, session_options=so)
    dec = OrtDecoder.on(sessions)
    dec.prefill(list(range(1000, 1000 + CONTEXT)))
    toks = list(range(2000, 2016))
    for _ in range(n):
        dec.forward_token(toks[0])
        dec.truncate(CONTEXT)
    for _ in range(n):
        dec.forward_batch(toks[:8])
        dec.truncate(CONTEXT)
    path = next(iter(sessions.by_entry.values())).end_profiling()
    with open(path) as fh:
        events = json.load(fh)
    runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])
    nodes = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    groups = {"step": runs[-2 * n:-n], "verify 8": runs[-n:]}
    sums = {g: {} for g in groups}
    for g, rs in groups.items():
        spans = [(r["ts"], r["ts"] + r["dur"]) for r in rs]
        for e in nodes:
            if any(a <= e["ts"] <= b for a, b in spans):
                cat = _category(e["name"], e["args"].get("op_name", "?"))
                sums[g][cat] = sums[g].get(cat, 0) + e["dur"] / n
        sums[g]["(run total)"] = sum(r["dur"] for r in rs) / n
    cats = sorted(set(sums["step"]) | set(sums["verify 8"]),
                  key=lambda c: -sums["verify 8"].get(c, 0))
    lines = [f"{os.path.basename(d.rstrip('/'))}: mean us a call over {n} calls each",
             "", "| op | step us | verify-8 us | ratio |", "|---|---|---|---|"]
    for c in cats:
        a, b = sums["step"].get(c, 0), sums["verify 8"].get(c, 0)
        lines.append(f"| {c} | {a:.0f} | {b:.0f} | {b / a if a else float('nan'):.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=10, help="calls per timing (small shapes)")
    ap.add_argument("--copies", type=int, default=8, help="ops per graph (small shapes)")
    ap.add_argument("--shapes", default="", help="comma-separated shape names (default: all)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--row-int8", action="store_true",
                    help="also time int8 weights with per-row int8 activations (MatMulInteger)")
    ap.add_argument("--levels", type=lambda t: [int(x) for x in t.split(",")],
                    help="accuracy levels (default: 0,1,4)")
    ap.add_argument("--blocks", type=lambda t: [int(x) for x in t.split(",")],
                    help="block sizes (default: 32,64,128)")
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--models", nargs="*", default=[],
                    help="model directories: the verify-cost curve through the runtime, "
                         "interleaved (and --profile: an onnxruntime profile of the first)")
    ap.add_argument("--model-rounds", type=int, default=9)
    ap.add_argument("--model-calls", type=int, default=5)
    ap.add_argument("--skip-ops", action="store_true", help="only the --models part")
    args = ap.parse_args(argv)
    want = set(filter(None, args.shapes.split(",")))
    print(f"onnxruntime {ort.__version__}, {args.threads} threads, {args.rounds} rounds, "
          f"medians", flush=True)
    results = []
    for name, k, n, bits in SHAPES:
        if args.skip_ops or (want and name not in want):
            continue
        res = bench_shape(name, k, n, bits, args)
        results += res
        print(f"\n### {name} {k}->{n}, {bits} bits\n\n{table(res)}", flush=True)
    if args.models:
        print(f"\n### verify cost through the runtime ({CONTEXT} tokens of context)\n\n"
              + model_curves(args.models, args), flush=True)
        if args.profile:
            for d in args.models:
                print("\n### profile by op type, " + model_profile(d, args), flush=True)
    if args.profile and not args.skip_ops:
        print("\n### session profiler, gate/up 576->1536, int4, block 32\n\n"
              + profile_cases(args), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
