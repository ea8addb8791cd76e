"""The demo: export the default model (once; cached), then decode one input-grounded prompt
plainly and speculatively on the same loaded model and compare.

    python scripts/demo.py [--model DIR | --precision int4|fp32] [--max-new-tokens 160]
                           [--temperature 0]

On the CPU the default model runs at int4, its native precision (the GGUF's Q4_1 blocks
exactly, `ortspec export --quant int4`): lossless under speculation, and a step takes about
half the time of an fp32 step on a CPU. `--precision fp32` runs the float export instead.
"""

from __future__ import annotations

import argparse
import sys
import time

from ortspec.runtime import SpeculativeOptions
from ortspec.runtime.load import load_model

PROMPT = """Summarize the following text in two sentences.

The city council voted on Tuesday to expand the bike lane network by 40 kilometres over the next three years. The plan, which costs 12 million euros, adds protected lanes on the four busiest roads into the city centre and connects the university campus to the main train station. Council members who opposed the plan said the money should go to road repairs instead. Supporters pointed to a 30 percent rise in cycling since 2020 and said safer lanes would cut car traffic at peak hours."""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--precision", choices=("int4", "fp32"), default="int4",
                    help="the default model's export to run when --model is not given")
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args()
    path = args.model
    if path is None:
        from ortspec.export import ensure_default_model

        t0 = time.perf_counter()
        path = ensure_default_model(args.precision if args.precision == "fp32" else None)
        print(f"default model ready at {path} ({time.perf_counter() - t0:.1f} s)")
    model = load_model(path, prefix_cache_mib=0)  # each run reads the prompt: timed alike
    print(f"loaded {model.path.name}: providers {model.providers}")
    model.draft_length_policy()  # the cost model: calibrated once per machine, cached
    ids = model.encode(PROMPT, chat=True)
    opts = SpeculativeOptions(args.max_new_tokens, temperature=args.temperature, seed=0)
    model.generate(ids[:8], drafter=None, options=SpeculativeOptions(4))  # warm-up
    runs = {}
    for name in ("plain", "speculative", "plain", "speculative"):  # A B A B: drift hits both
        r = model.generate(ids, drafter=None if name == "plain" else "prompt-lookup", options=opts,
                           draft_length=None if name == "plain" else "auto")
        runs.setdefault(name, []).append(r)
    plain, spec = runs["plain"][-1], runs["speculative"][-1]
    print("\n--- prompt ---\n" + PROMPT)
    print("\n--- speculative output ---\n" + (spec.text or ""))
    tps = {k: sum(r.num_tokens for r in v) / sum(r.counters.total_seconds for r in v) for k, v in runs.items()}
    c = spec.counters
    same = plain.tokens == spec.tokens
    print("\n--- comparison (two interleaved runs each) ---")
    print(f"outputs identical: {same} ({spec.num_tokens} tokens; finish: {spec.finish_reason})"
          if args.temperature == 0 else f"temperature {args.temperature}: outputs differ in general (same distribution)")
    print(f"plain:       {tps['plain']:6.1f} tok/s, {plain.counters.target_calls} forward calls")
    print(f"speculative: {tps['speculative']:6.1f} tok/s, {c.target_calls} forward calls "
          f"({c.verify_calls} verifies, {c.forward_token_calls} single steps)")
    print(f"speedup: {tps['speculative'] / tps['plain']:.2f}x; {c.mean_tokens_per_call:.2f} tokens per call "
          f"(bonus included); acceptance {c.acceptance_rate:.0%} ({c.accepted}/{c.drafted} drafted); "
          f"{c.recovered} recovered, {c.bonus} bonus")
    print(f"time: ORT {c.ort_seconds / c.total_seconds:.1%}, drafting {c.draft_seconds / c.total_seconds:.1%}, "
          f"sampling {c.sample_seconds / c.total_seconds:.1%}, outside ORT "
          f"{1 - c.ort_seconds / c.total_seconds:.1%} of wall time")
    return 0 if same or args.temperature > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
