"""Run the anchors on Spec-Bench prompts and print ngram-vs-plain speedups per category.

    .venv/bin/python -m ortspec.runtime.bench.anchors.spec_bench --per-category 1 --max-new-tokens 128

The Spec-Bench questions packaged with ortspec (or --questions FILE), sampled as `ortspec bench`
samples them (ortspec.runtime.bench.workload): dev split (even question ids) by default, first turn,
rendered through SmolLM2's ChatML template with its default system prompt. Records go to
benchmarks/tmp/anchors-<system>.jsonl (git-ignored). Anchors that cannot run are reported and
skipped.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ortspec.runtime.bench.workload import SPLITS
from ortspec.runtime.errors import InvalidOptionError

from ortspec.runtime.bench.anchors import (
    format_summary,
    genai_step_latency,
    load_spec_bench,
    run_genai_anchor,
    run_hf_anchor,
    summarize,
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", default=None,
                    help="a Spec-Bench question.jsonl (default: the one packaged with ortspec)")
    ap.add_argument("--split", default="dev", choices=SPLITS)
    ap.add_argument("--per-category", type=int, default=1, help="prompts per category; 0 = all")
    ap.add_argument("--categories", default=None, help="comma-separated (default: all)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--systems", default="genai,hf", help="comma-separated subset of genai,genai-int4,genai-int4-acc1,hf")
    ap.add_argument("--step-latency", type=int, default=None, metavar="CONTEXT",
                    help="also measure onnxruntime-genai's step latency at this context")
    ap.add_argument("--outdir", default="benchmarks/tmp")
    args = ap.parse_args(argv)

    cats = args.categories.split(",") if args.categories else None
    try:
        prompts = load_spec_bench(args.questions, split=args.split, per_category=args.per_category or None,
                                  categories=cats)
    except InvalidOptionError as e:
        print(f"spec_bench: error: {e}", file=sys.stderr)
        return 2
    print(f"{len(prompts)} prompts ({args.split} split), max_new_tokens {args.max_new_tokens}, "
          f"repeats {args.repeats}", flush=True)
    outdir = Path(args.outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    common = dict(max_new_tokens=args.max_new_tokens, repeats=args.repeats, threads=args.threads)
    runners = {
        "genai": lambda: run_genai_anchor(prompts, precision="fp32", **common),
        "genai-int4": lambda: run_genai_anchor(prompts, precision="int4", **common),
        "genai-int4-acc1": lambda: run_genai_anchor(prompts, precision="int4-acc1", **common),
        "hf": lambda: run_hf_anchor(prompts, **common),
    }
    for name in args.systems.split(","):
        if name not in runners:
            print(f"unknown system {name!r}", file=sys.stderr)
            return 2
        runs = runners[name]()
        if not runs:
            print(f"\n{name}: skipped: {runs.reason}", flush=True)
            continue
        path = outdir / f"anchors-{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in runs))
        print(f"\n{format_summary(name, summarize(runs))}", flush=True)
        if args.repeats > 1:
            print(format_summary(name, summarize(runs, statistic="min")), flush=True)
        print(f"  records: {path}", flush=True)
    if args.step_latency:
        for precision in ("fp32", "int4"):
            r = genai_step_latency(args.step_latency, precision=precision, threads=args.threads)
            if r:
                print(f"\nonnxruntime-genai {precision} step at context {r['context']}: "
                      f"median {r['median_ms']:.1f} ms (p10 {r['p10_ms']:.1f}, p90 {r['p90_ms']:.1f})")
            else:
                print(f"\nstep latency {precision}: skipped: {r.reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
