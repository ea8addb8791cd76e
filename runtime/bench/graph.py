"""Per-call latency and memory of an exported model's graph, through OrtDecoder.

    python -m ortspec.runtime.bench.graph [MODEL_DIR] [--context 256] [--lengths 1,2,4,8,16]
                                          [--reps 30] [--threads N] [--genai-model DIR]
                                          [--compare DIR ...] [--rss]

Latency: the cache is filled to `--context` tokens once; each repetition then times one call
per block length (1 = the step entry point, forward_token; n > 1 = the verify entry point,
forward_batch), in a shuffled order, rolling back to the context after each call, so every
call sees the same past. With `--genai-model` (default: `models_dir()/cache/genai-smollm2-fp32`
when it exists) onnxruntime-genai's graph for the same model is timed in the same loop, interleaved
call by call, through the same OrtDecoder binding code; `--compare` adds other ortspec model
directories (e.g. an `--attention standard` export) the same way. This machine's speed drifts:
read the ratios, not the absolute numbers.

Without MODEL_DIR the default model's export is timed; it must exist (`ortspec export`).

Memory (`--rss`): a fresh subprocess loads the model, runs a prefill of the context and a
verify block, and reports its peak RSS against weight bytes + KV bytes. It is started before
this process loads any model: Linux carries ru_maxrss across fork + exec, so a child of a big
parent would report the parent's peak. /proc's VmHWM (reset by exec) is printed alongside.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from ..cli.args import model_arg
from ..errors import OrtspecError
from ..ort import manifest as mf
from ..ort.decoder import OrtDecoder
from ..paths import models_dir



@dataclasses.dataclass(frozen=True)
class LatencyRow:
    engine: str  # "ortspec", "genai", or the name of a --compare directory
    block: int  # tokens per call
    median_ms: float  # wall time of the call, logits copy included
    median_ort_ms: float  # of which inside run_with_iobinding
    reps: int


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    peak_rss_mib: float  # ru_maxrss after load + prefill + verify
    baseline_rss_mib: float  # after importing numpy, onnxruntime, ortspec.runtime
    vm_hwm_mib: float  # /proc/self/status VmHWM, the same peak as the kernel tracks it per process
    weight_mib: float  # the external data file
    kv_mib: float  # 2 x layers x [kv_heads, capacity, head_dim]
    load_seconds: float

    @property
    def ratio(self) -> float:
        """peak RSS / (weights + KV): the requirement is <= 1.3."""
        return self.peak_rss_mib / (self.weight_mib + self.kv_mib)

    @property
    def ratio_above_baseline(self) -> float:
        return (self.peak_rss_mib - self.baseline_rss_mib) / (self.weight_mib + self.kv_mib)


def genai_decoder(directory: Path, like: mf.Manifest, threads: int | None) -> OrtDecoder:
    """onnxruntime-genai's graph has the same I/O names and a shared-buffer GQA, so OrtDecoder
    drives it given a manifest describing it (capacity and verify length as ours)."""
    config = json.loads((directory / "genai_config.json").read_text())["model"]
    dec = config["decoder"]
    arch = mf.Architecture(family="llama", num_layers=dec["num_hidden_layers"],
                           num_heads=dec["num_attention_heads"],
                           num_kv_heads=dec["num_key_value_heads"], head_dim=dec["head_size"],
                           hidden_size=dec["hidden_size"], vocab_size=config["vocab_size"])
    graph = dec["filename"]
    manifest = dataclasses.replace(
        like, architecture=arch, source={"kind": "genai", "path": str(directory)},
        min_call_rows=1,  # genai runs a step as one row
        entry_points={name: dataclasses.replace(e, graph=graph, provider="any")
                      for name, e in like.entry_points.items()},
        files={})
    return OrtDecoder(directory, manifest=manifest, threads=threads)


def time_calls(decoders: dict[str, OrtDecoder], *, context: int, lengths: list[int], reps: int,
               seed: int = 0) -> list[LatencyRow]:
    rng = random.Random(seed)
    vocab = min(d.vocab_size for d in decoders.values())
    tokens = np.random.default_rng(seed).integers(100, vocab, context + max(lengths)).tolist()
    for d in decoders.values():
        d.reset()
        d.prefill(tokens[:context])
    wall: dict[tuple[str, int], list[float]] = {}
    inside: dict[tuple[str, int], list[float]] = {}
    jobs = [(name, n) for name in decoders for n in lengths]
    for rep in range(reps + 1):  # the first round warms up and is discarded
        rng.shuffle(jobs)
        for name, n in jobs:
            d = decoders[name]
            block = tokens[context:context + n]
            before = d.ort_seconds
            t0 = time.perf_counter()
            if n == 1:
                d.forward_token(block[0])
            else:
                d.forward_batch(block)
            elapsed = time.perf_counter() - t0
            d.truncate(context)
            if rep:
                wall.setdefault((name, n), []).append(elapsed)
                inside.setdefault((name, n), []).append(d.ort_seconds - before)
    return [LatencyRow(name, n, 1e3 * statistics.median(wall[name, n]),
                       1e3 * statistics.median(inside[name, n]), reps)
            for name in decoders for n in lengths]


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _vm_hwm_mib() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def measure_memory_here(model_dir: Path, *, context: int, threads: int | None) -> MemoryReport:
    baseline = _rss_mib()
    t0 = time.perf_counter()
    m = mf.read_manifest(model_dir, verify_checksums=False)
    dec = OrtDecoder(model_dir, manifest=m, threads=threads)
    load = time.perf_counter() - t0
    dec.prefill(list(range(100, 100 + context)))
    dec.forward_batch(list(range(10, 10 + dec.max_verify_len)))
    for t in range(5):
        dec.forward_token(t + 20)
    a = m.architecture
    itemsize = 2 if m.dtype == "fp16" else 4
    kv = 2 * a.num_layers * a.num_kv_heads * m.capacity * a.head_dim * itemsize
    weights = sum((model_dir / n).stat().st_size for n in m.files if n.endswith(".data"))
    return MemoryReport(peak_rss_mib=_rss_mib(), baseline_rss_mib=baseline,
                        vm_hwm_mib=_vm_hwm_mib(), weight_mib=weights / 2**20,
                        kv_mib=kv / 2**20, load_seconds=load)


def measure_memory(model_dir: Path, *, context: int, threads: int | None) -> MemoryReport:
    """In a fresh interpreter, so nothing else this process loaded counts."""
    cmd = [sys.executable, "-m", "ortspec.runtime.bench.graph", str(model_dir), "--context",
           str(context), "--rss-child"]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return MemoryReport(**json.loads(out.strip().splitlines()[-1]))


def _genai_default() -> Path:
    """onnxruntime-genai's export of the default model, where `scripts/setup_anchors.sh` puts it."""
    return models_dir() / "cache" / "genai-smollm2-fp32"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir", nargs="?", type=Path, default=None)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--lengths", default="1,2,4,8,16")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--genai-model", type=Path, default=None,
                   help=f"onnxruntime-genai model directory (default {_genai_default()} if present); "
                        f"'none' to skip")
    p.add_argument("--compare", type=Path, nargs="*", default=[],
                   help="other ortspec model directories to time in the same loop")
    p.add_argument("--rss", action="store_true", help="also measure peak RSS in a subprocess")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--rss-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:  # without MODEL_DIR: the default model's export, which must exist (`ortspec export`)
        model_dir = args.model_dir or model_arg(None)
    except OrtspecError as e:
        p.error(str(e))
    if args.rss_child:
        report = measure_memory_here(model_dir, context=args.context, threads=args.threads)
        print(json.dumps(dataclasses.asdict(report)))
        return 0

    result: dict = {"model": str(model_dir), "context": args.context}
    if args.rss:  # first, while this process is small (see the module docstring)
        mem = measure_memory(model_dir, context=args.context, threads=args.threads)
        result["memory"] = {**dataclasses.asdict(mem), "ratio": mem.ratio}
    lengths = [int(x) for x in args.lengths.split(",")]
    ours = OrtDecoder(model_dir, threads=args.threads)
    if max(lengths) > ours.max_verify_len or args.context + max(lengths) > ours.capacity:
        p.error(f"lengths must be <= {ours.max_verify_len} and context + length <= "
                f"{ours.capacity}")
    decoders = {"ortspec": ours}
    genai = args.genai_model if args.genai_model is not None else _genai_default()
    if str(genai) != "none" and (genai / "genai_config.json").is_file():
        decoders["genai"] = genai_decoder(genai, ours.manifest, args.threads)
    elif args.genai_model is not None and str(genai) != "none":
        print(f"note: {genai} has no genai_config.json; skipping it", file=sys.stderr)
    for other in args.compare:
        decoders[other.name] = OrtDecoder(other, threads=args.threads)
    rows = time_calls(decoders, context=args.context, lengths=lengths, reps=args.reps)

    print(f"model {model_dir}  context {args.context}  reps {args.reps}  "
          f"providers {ours.providers}")
    header = f"{'block':>5} " + " ".join(f"{name + ' ms':>12} {'(in ORT)':>9}" for name in decoders)
    others = [name for name in decoders if name != "ortspec"]
    header += "".join(f" {name[:10] + '/ours':>15}" for name in others)
    print(header)
    by = {(r.engine, r.block): r for r in rows}
    for n in lengths:
        cells = [f"{by[name, n].median_ms:>12.2f} {by[name, n].median_ort_ms:>9.2f}"
                 for name in decoders]
        line = f"{n:>5} " + " ".join(cells)
        line += "".join(f" {by[name, n].median_ms / by['ortspec', n].median_ms:>15.2f}"
                        for name in others)
        print(line)
    result["latency"] = [dataclasses.asdict(r) for r in rows]
    if args.rss:
        print(f"peak RSS {mem.peak_rss_mib:.0f} MiB (VmHWM {mem.vm_hwm_mib:.0f}, baseline "
              f"{mem.baseline_rss_mib:.0f}); weights {mem.weight_mib:.0f} MiB + KV "
              f"{mem.kv_mib:.0f} MiB; ratio {mem.ratio:.2f} ({mem.ratio_above_baseline:.2f} "
              f"above baseline); load {mem.load_seconds:.2f} s")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
