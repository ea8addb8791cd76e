"""ortspec and onnxruntime-genai on the same prompts, in one process, interleaved per prompt.

    scripts/setup_anchors.sh      # once: genai's models, and ortspec installed into .venv-anchors
    .venv-anchors/bin/python -m ortspec.runtime.bench.anchors.head_to_head --per-category 4 \
        --ortspec int4=models/exported/smollm2-135m-instruct-int4 \
        --ortspec fp32=models/exported/smollm2-135m-instruct-fp32 \
        --genai int4=models/cache/genai-smollm2-int4 --genai fp32=models/cache/genai-smollm2-fp32 \
        --out benchmarks/tmp/int4-vs-genai

Every system runs every prompt (Spec-Bench dev split by default, rendered as `ortspec bench`
renders it: the same token ids for every system) greedily, prefill included in the time: ortspec plain and with prompt lookup (the
cost-model draft length, one policy per model carried across prompts), genai plain and with its
n-gram mode. The order of the systems rotates from prompt to prompt, so the machine's drift
hits them alike; only the ratios of one run are evidence. Each speculative mode's output is
compared with its own system's plain output (identity at temperature 0). ortspec's prefix cache
is off, so every mode reads its prompt. Writes results.md and results.json into --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

from ortspec.runtime import load_model
from ortspec.runtime.bench import provenance
from ortspec.runtime.bench.runner import BenchConfig, Method, run_pairs
from ortspec.runtime.bench.workload import SPLITS, interleave_categories, load_questions

from . import genai_anchor

NGRAM, MAX_DRAFT = 3, 8


def _pairs(values: list[str], flag: str) -> list[tuple[str, str]]:
    out = []
    for v in values:
        name, sep, path = v.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"{flag} takes NAME=DIR, got {v!r}")
        out.append((name, path))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ortspec", action="append", default=[], metavar="NAME=DIR")
    ap.add_argument("--genai", action="append", default=[], metavar="NAME=DIR")
    ap.add_argument("--split", default="dev", choices=SPLITS)
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    # no prefix cache: every mode reads its prompt, as genai's do (with one, ortspec's second
    # mode would copy the first's prompt in, and the table would time that)
    ours = [(f"ortspec {n}", load_model(d, threads=args.threads, prefix_cache_mib=0))
            for n, d in _pairs(args.ortspec, "--ortspec")]
    theirs = [(f"genai {n}", genai_anchor.load_model(d, args.threads))
              for n, d in _pairs(args.genai, "--genai")]
    policies = {name: {"prompt-lookup": m.draft_length_policy().fresh()} for name, m in ours}
    prompts = interleave_categories(load_questions(split=args.split,
                                                   per_category=args.per_category or None))
    encoder = ours[0][1]  # every system gets the same token ids (one tokenizer, one template)
    config = BenchConfig(max_new_tokens=args.max_new_tokens, ngram_size=NGRAM,
                         max_draft_len=MAX_DRAFT)
    methods = [Method.parse("plain"), Method.parse("prompt-lookup")]
    systems = [(n, "ortspec", m) for n, m in ours] + [(n, "genai", m) for n, m in theirs]
    records = []
    started = time.time()
    for i, prompt in enumerate(prompts):
        shift = i % len(systems)
        for name, kind, obj in systems[shift:] + systems[:shift]:
            if kind == "ortspec":
                recs, skipped = run_pairs(obj, [prompt], methods, config,
                                          policies=policies[name])
                for r in recs:
                    records.append({"system": name, "mode": r["method"],
                                    "category": prompt.category, "id": prompt.question_id,
                                    "new_tokens": r["new_tokens"], "seconds": r["seconds"],
                                    "tokens": r["tokens"]})
            else:
                model, tokenizer = obj
                ids = encoder.encode(prompt.text, chat=True)
                for mode in ("plain", "ngram"):
                    new, wall, _, _, _ = genai_anchor.generate(
                        model, ids, mode=mode, max_new_tokens=args.max_new_tokens,
                        temperature=0.0, seed=0, ngram_size=NGRAM, max_draft_tokens=MAX_DRAFT)
                    records.append({"system": name, "mode": mode, "category": prompt.category,
                                    "id": prompt.question_id, "new_tokens": len(new),
                                    "seconds": wall, "tokens": new})
        print(f"prompt {i + 1}/{len(prompts)} done", file=sys.stderr, flush=True)
    table = _table(records)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": " ".join(sys.argv), "machine": provenance.machine(),
            "threads": args.threads, "split": args.split, "prompts": len(prompts),
            "max_new_tokens": args.max_new_tokens, "wall_seconds": round(time.time() - started)}
    (out / "results.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    (out / "results.md").write_text(f"```\n{meta['command']}\n```\n\n{table}\n")
    print(table)
    return 0


def _table(records: list[dict]) -> str:
    """tok/s (total new tokens / total seconds) per system, mode and category; the ratio to the
    first genai int4 plain row (or the first row); identity with the system's plain output."""
    cats = sorted({r["category"] for r in records})
    rows = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))
    plain = {(r["system"], r["id"]): r["tokens"] for r in records if r["mode"] == "plain"}
    same = defaultdict(lambda: [0, 0])
    for r in records:
        key = (r["system"], r["mode"])
        for c in (r["category"], "overall"):
            rows[key][c][0] += r["new_tokens"]
            rows[key][c][1] += r["seconds"]
        if r["mode"] != "plain":
            same[key][0] += r["tokens"] == plain[(r["system"], r["id"])]
            same[key][1] += 1
    keys = list(rows)
    ref = next((k for k in keys if k == ("genai int4", "plain")), keys[0])
    tps = {k: {c: n / s for c, (n, s) in v.items() if s} for k, v in rows.items()}
    head = ["system", "mode", "overall", *cats, f"overall / {ref[0]} {ref[1]}", "identical"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k in keys:
        ident = f"{same[k][0]}/{same[k][1]}" if k in same else ""
        cells = [k[0], k[1], f"{tps[k]['overall']:.1f}", *(f"{tps[k][c]:.1f}" for c in cats),
                 f"{tps[k]['overall'] / tps[ref]['overall']:.2f}x", ident]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Ratio to {ref[0]} {ref[1]}, per category:", "",
              "| " + " | ".join(["system", "mode", "overall", *cats]) + " |",
              "|" + "---|" * (3 + len(cats))]
    for k in keys:
        cells = [k[0], k[1], *(f"{tps[k][c] / tps[ref][c]:.2f}x" for c in ("overall", *cats))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
