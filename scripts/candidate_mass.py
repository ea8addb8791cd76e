"""How much target mass model-free drafts can reach at a temperature: the ceiling of
several-candidate verification, measured along plain sampled decodes.

For every emitted position of a plain decode at temperature T (warped target p there), it
records:
- top-K mass: the sum of p's K largest probabilities, the most a drafter proposing K distinct
  tokens at that position could have accepted (K = 1, 2, 4, 8);
- lookup K: p's mass on the K most recent distinct continuations of the history's longest
  matching n-gram, then of shorter ones (n = ngram_size .. 1) — what verifying prompt lookup's
  candidates side by side (recursive rejection over point masses accepts exactly p(candidates))
  would accept at the first drafted position; K = 1 is prompt lookup itself;
- cache: sum_x min(p(x), q(x)) for q the renormalised top-32 of the target row cached after the
  same match (the target-cache drafter's first-position acceptance), where that row exists.

The lookup and cache columns average over the positions where the history has a match; the
top-K columns over all positions. Nothing here is timed: these are acceptance ceilings.

    python scripts/candidate_mass.py --temperature 1 --per-category 4 --max-new-tokens 96
"""

from __future__ import annotations

import argparse
import collections

import numpy as np

from ortspec.runtime.bench.workload import load_questions
from ortspec.runtime import load_model
from ortspec.runtime.cli.args import model_arg
from ortspec.runtime.drafters.continuations import ContinuationIndex
from ortspec.runtime.drafters.target_cache import sparse_target
from ortspec.runtime.decoding.sampling import sample_from, warp

TOP = (1, 2, 4, 8)
LOOKUP = (1, 2, 3, 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: the default model)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--per-category", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--ngram-size", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    model = load_model(model_arg(args.model))
    decoder = model.decoder
    rng = np.random.default_rng(args.seed)
    sums: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for q in load_questions(split="dev", per_category=args.per_category):
        ids = model.encode(q.text, chat=model.manifest.chat_format is not None)
        if len(ids) + args.max_new_tokens > decoder.capacity:
            continue
        index = ContinuationIndex(1, args.ngram_size)
        index.extend(ids)
        cached: dict[int, object] = {}  # history position -> sparse target row
        decoder.reset()
        logits = decoder.prefill(ids)
        s = sums[q.category]
        for _ in range(args.max_new_tokens):
            p = warp(logits, temperature=args.temperature)
            top = np.sort(p)[::-1]
            s["positions"] += 1
            for k in TOP:
                s[f"top{k}"] += float(top[:k].sum())
            cands = index.distinct_followers(index.tokens[-index.max_n:], max(LOOKUP))
            if cands:
                s["matched"] += 1
                for k in LOOKUP:
                    s[f"lookup{k}"] += float(p[cands[:k]].sum())
                _, match = index.match(index.tokens[-index.max_n:])
                row = cached.get(match.recent) if match is not None else None
                if row is not None:
                    s["cache_rows"] += 1
                    s["cache"] += float(np.minimum(p[row.token_ids], row.probs).sum())
            cached[len(index.tokens)] = sparse_target(logits, k=32, temperature=args.temperature)
            tok = sample_from(p, rng)
            if tok in model.manifest.stop_token_ids:
                break
            index.extend([tok])
            logits = decoder.forward_token(tok)
    head = (["category", "positions"] + [f"top-{k}" for k in TOP] + ["matched"]
            + [f"lookup {k}" for k in LOOKUP] + ["cache rows", "cache"])
    print(f"T={args.temperature}, {args.per_category} dev prompts per category, {args.max_new_tokens} tokens\n")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    total: collections.Counter = collections.Counter()
    for cat, s in list(sums.items()) + [("overall", None)]:
        if s is None:
            s = total
        else:
            total.update(s)
        n, m, c = s["positions"], max(s["matched"], 1), max(s["cache_rows"], 1)
        cells = ([cat, str(n)] + [f"{s[f'top{k}'] / n:.3f}" for k in TOP] + [f"{s['matched'] / n:.2f}"]
                 + [f"{s[f'lookup{k}'] / m:.3f}" for k in LOOKUP]
                 + [f"{s['cache_rows'] / n:.2f}", f"{s['cache'] / c:.3f}"])
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
