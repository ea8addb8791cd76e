"""Soak test: many requests on ONE loaded model, resident memory sampled after each.

    python scripts/soak.py [--tokens 100000] [--model DIR] [--prompts 32] [--max-new-tokens 192]
                           [--report docs/soak.md] [--json PATH]

The workload is a cycle that repeats exactly: `--prompts` Spec-Bench questions (all six
categories in turn, through the chat template) crossed with every combination of decoding mode
(speculative with prompt lookup and the cost-model draft length, or plain) and temperature
(0, 0.7, 1.0). Request i takes prompt i mod P, mode i mod 2 and temperature (i div 2) mod 3,
and the seed (seed + i mod period): after one period (lcm(P, 6) requests) the same requests
come again with the same random draws. One drafter and one draft-length policy serve every
speculative request, as in a server.

Why a repeating cycle: onnxruntime keeps memory per input shape it has seen (an arena sized for
the largest, and by default a memory plan per shape, ~4.5 KiB each, measured), and every
decoding step has a new attention-mask length, so the first pass over a workload grows RSS
without any leak. The first cycle is therefore the warm-up; in later cycles the shapes recur,
and growth there is a leak.

After each request: gc.collect(), then the resident set size from /proc/self/statm (the
current RSS, not the peak), split on Linux into anonymous memory (the heap) and the pages of
the model's memory-mapped weight file. onnxruntime gathers embedding rows straight from that
read-only mapping, so the first use of each token id faults in a page of it: that part grows
with the vocabulary seen, up to the file's size, and is not a leak. The slope verdict is on
the anonymous part (on all of RSS where /proc cannot split it); the report gives both. The report states RSS at start, after warm-up, at the end and at
its maximum, the least-squares slope of RSS against tokens after warm-up in KiB per 1,000
tokens, tokens, requests, finish reasons and throughput. Exit status 1 when the slope exceeds
`--max-slope` (default 100 KiB per 1,000 tokens: 10 MB over 100,000 tokens); with fewer than
`--min-judged-tokens` (20,000) tokens after warm-up the slope is reported without a verdict.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import json
import math
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np

from ortspec.runtime.bench import provenance
from ortspec.runtime.bench.workload import default_questions_path, interleave_categories, load_questions
from ortspec.runtime import PromptLookupSpeculator, SpeculativeOptions
from ortspec.runtime.paths import default_model_path
from ortspec.runtime.load import load_model

MODES = ("speculative", "plain")
TEMPERATURES = (0.0, 0.7, 1.0)
REPO = Path(__file__).resolve().parents[1]


def rss_kib() -> float:
    """Current resident set size in KiB (/proc/self/statm); the peak where /proc is missing."""
    try:
        with open("/proc/self/statm") as f:
            resident_pages = int(f.read().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE") / 1024
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / 1024 if sys.platform == "darwin" else float(peak)  # bytes on macOS


def rss_parts_kib(model_dir: Path) -> tuple[float | None, float | None]:
    """(anonymous RSS, RSS of file mappings inside `model_dir`) in KiB; None off Linux.

    Anonymous memory (RssAnon in /proc/self/status) is the heap: where a leak would show.
    onnxruntime maps the external weight file read-only and reads some initializers (the
    embedding table) straight from the mapping, so each token id seen for the first time
    faults in a page of it: that part of RSS grows with the vocabulary used, is bounded by the
    file's size and is page cache the kernel may drop, not a leak. It is measured here from
    /proc/self/smaps so the report can show it apart.
    """
    try:
        with open("/proc/self/status") as f:
            anon = next(float(line.split()[1]) for line in f if line.startswith("RssAnon:"))
        prefix = str(model_dir.resolve()) + os.sep
        mapped = 0.0
        in_model = False
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=5)  # a mapping's path may hold spaces
                if "-" in head[0] and len(head) >= 5 and ":" in head[3]:  # a mapping's header
                    in_model = len(head) >= 6 and head[5].strip().startswith(prefix)
                elif in_model and head[0] == "Rss:":
                    mapped += float(head[1])
        return anon, mapped
    except (OSError, ValueError, StopIteration, IndexError):
        return None, None


def slope_kib_per_1k(tokens: list[int], rss: list[float]) -> float:
    """Least-squares slope of RSS (KiB) against cumulative tokens, per 1,000 tokens."""
    if len(tokens) < 2 or len(set(tokens)) < 2:
        return 0.0
    x = np.asarray(tokens, np.float64) / 1000.0
    y = np.asarray(rss, np.float64)
    return float(np.polyfit(x, y, 1)[0])


@dataclasses.dataclass
class Sample:
    request: int
    cycle: int
    mode: str
    temperature: float
    prompt_tokens: int
    new_tokens: int
    finish_reason: str
    seconds: float
    tokens_total: int  # cumulative new tokens after this request
    rss_kib: float
    anon_kib: float | None  # anonymous (heap) part of rss_kib
    weights_file_kib: float | None  # part of rss_kib in mappings of the model's files


def _load(args: argparse.Namespace):
    path = None if args.model is None else Path(args.model)
    if path is None:
        path = default_model_path()
        if not (path / "manifest.json").is_file():
            from ortspec.export import ensure_default_model  # exports it (needs the export extra)

            path = ensure_default_model(progress=False)
    return path, load_model(path, threads=args.threads)


def run(args: argparse.Namespace) -> dict:
    commit = _commit()  # the code being loaded now, not whatever is checked out at the end
    path, model = _load(args)
    cap = model.capacity
    per_category = math.ceil(args.prompts / 6)
    prompts = interleave_categories(load_questions(args.questions, split="all",
                                                   per_category=per_category))[: args.prompts]
    if not prompts:
        raise SystemExit(f"no questions in {args.questions or default_questions_path()}")
    room = cap - args.max_new_tokens
    encoded = []
    for q in prompts:
        ids = model.encode(q.text, chat=True)
        encoded.append(ids[-room:] if len(ids) > room else ids)  # keep room for the reply
    period = math.lcm(len(prompts), len(MODES) * len(TEMPERATURES))
    warmup = period * args.warmup_cycles
    policy = model.draft_length_policy().for_request()
    drafter = PromptLookupSpeculator(ngram_size=3, max_draft_len=8)
    stops = model.manifest.stop_token_ids
    gc.collect()
    rss_start = rss_kib()
    samples: list[Sample] = []
    total = 0
    counters: collections.Counter = collections.Counter()
    t_start = time.perf_counter()
    i = 0
    while total < args.tokens:
        ids = encoded[i % len(prompts)]
        mode, temperature = MODES[i % 2], TEMPERATURES[(i // 2) % 3]
        options = SpeculativeOptions(args.max_new_tokens, temperature=temperature,
                                     seed=args.seed + i % period, stop_token_ids=stops)
        speculative = mode == "speculative"
        t0 = time.perf_counter()
        r = model.generate(ids, drafter=drafter if speculative else None, options=options,
                           draft_length=policy if speculative else None)
        seconds = time.perf_counter() - t0
        total += r.num_tokens
        c = r.counters
        counters["drafted"] += c.drafted
        counters["accepted"] += c.accepted
        counters["target_calls"] += c.target_calls
        gc.collect()
        anon, mapped = rss_parts_kib(path)
        samples.append(Sample(i, i // period, mode, temperature, len(ids), r.num_tokens,
                              r.finish_reason, round(seconds, 3), total, round(rss_kib(), 1),
                              anon, mapped))
        if args.verbose or (i + 1) % 25 == 0:
            s = samples[-1]
            parts = (f" (anonymous {anon / 1024:.1f}, weight file {mapped / 1024:.1f})"
                     if anon is not None else "")
            print(f"request {i + 1} (cycle {s.cycle}): {total}/{args.tokens} tokens, RSS "
                  f"{s.rss_kib / 1024:.1f} MiB{parts}; {mode} t={temperature}: {r.num_tokens} "
                  f"tokens ({r.finish_reason})", flush=True)
        i += 1
    wall = time.perf_counter() - t_start
    after = [s for s in samples if s.request >= warmup - 1]  # from the end of warm-up on
    warm = samples[warmup - 1] if len(samples) >= warmup else None
    xs = [s.tokens_total for s in after]
    total_slope = slope_kib_per_1k(xs, [s.rss_kib for s in after])
    split = bool(after) and all(s.anon_kib is not None for s in after)
    # the verdict is on the heap where /proc tells it apart (see rss_parts_kib), else on all RSS
    slope = slope_kib_per_1k(xs, [s.anon_kib for s in after]) if split else total_slope
    file_slope = (slope_kib_per_1k(xs, [s.weights_file_kib for s in after]) if split
                  else None)
    # the target's own files (drafts live in a subdirectory and are not loaded here)
    weight_files = sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file()) / 1024
    judged_tokens = after[-1].tokens_total - after[0].tokens_total if after else 0
    judged = judged_tokens >= args.min_judged_tokens
    cycles = [s for s in samples if s.request % period == period - 1]  # each cycle's last
    return {
        "commit": commit,
        "model": str(path),
        "mem_pattern": False,  # the runtime's session options turn onnxruntime's per-shape plans off
        "providers": model.providers,
        "capacity": cap,
        "prompts": len(prompts),
        "period_requests": period,
        "warmup_requests": warmup,
        "tokens_target": args.tokens,
        "tokens": total,
        "requests": len(samples),
        "max_new_tokens": args.max_new_tokens,
        "wall_seconds": round(wall, 1),
        "tokens_per_second": round(total / wall, 2) if wall > 0 else 0.0,
        "rss_start_kib": round(rss_start, 1),
        "rss_after_warmup_kib": warm.rss_kib if warm else None,
        "rss_end_kib": samples[-1].rss_kib,
        "rss_max_kib": max(s.rss_kib for s in samples),
        "rss_at_cycle_ends_kib": [s.rss_kib for s in cycles],
        "anon_at_cycle_ends_kib": [s.anon_kib for s in cycles],
        "rss_anon_after_warmup_kib": warm.anon_kib if warm else None,
        "rss_anon_end_kib": samples[-1].anon_kib,
        "weights_file_rss_after_warmup_kib": warm.weights_file_kib if warm else None,
        "weights_file_rss_end_kib": samples[-1].weights_file_kib,
        "model_files_kib": round(weight_files, 1),
        "judged_on": "anonymous RSS" if split else "RSS",
        "slope_kib_per_1k_tokens": round(slope, 2),
        "total_rss_slope_kib_per_1k_tokens": round(total_slope, 2),
        "weights_file_slope_kib_per_1k_tokens": round(file_slope, 2)
        if file_slope is not None else None,
        "max_slope_kib_per_1k_tokens": args.max_slope,
        "judged_tokens": judged_tokens,
        "min_judged_tokens": args.min_judged_tokens,
        "verdict": ("PASS" if abs(slope) <= args.max_slope else "FAIL") if judged
        else "not judged",
        "passed": not judged or abs(slope) <= args.max_slope,
        "finish_reasons": dict(collections.Counter(s.finish_reason for s in samples)),
        "requests_by_mode_temperature": {
            f"{m} t={t}": sum(1 for s in samples if s.mode == m and s.temperature == t)
            for m in MODES for t in TEMPERATURES},
        "acceptance_rate": round(counters["accepted"] / counters["drafted"], 4)
        if counters["drafted"] else 0.0,
        "tokens_per_target_call": round(total / counters["target_calls"], 3)
        if counters["target_calls"] else 0.0,
        "policy_chosen_entries": len(policy.chosen),
        "samples": [dataclasses.asdict(s) for s in samples],
    }


def _commit() -> str | None:
    """The repository's commit the runtime was loaded from (None outside a git checkout)."""
    checkout = provenance.checkout()
    if not checkout["commit"]:
        return None
    dirty = any(path.startswith("runtime/") for path in checkout["changed"] or ())
    return checkout["commit"][:10] + (" with local changes to runtime/" if dirty else "")


def _pairs(items) -> str:
    return ", ".join(f"{k}: {v}" for k, v in items)


def markdown(r: dict, command: str) -> str:
    def mib(k: float) -> str:
        return f"{k / 1024:.1f} MiB"

    verdict = r["verdict"]
    if verdict == "not judged":
        verdict += (f" ({r['judged_tokens']:,} tokens after warm-up; a verdict needs "
                    f"{r['min_judged_tokens']:,})")
    cycle_ends = ", ".join(mib(k) for k in r["rss_at_cycle_ends_kib"]) or "none completed"
    after_warmup = (mib(r["rss_after_warmup_kib"]) if r["rss_after_warmup_kib"] is not None
                    else f"warm-up not completed ({r['requests']} of {r['warmup_requests']} "
                         f"requests)")
    lines = [
        "# Soak test",
        "",
        f"`{command}`" + (f" (runtime at commit {r['commit']})" if r.get("commit") else ""),
        "",
        f"One loaded model ({r['model']}, {', '.join(r['providers'])}, capacity {r['capacity']}"
        f"{'' if r['mem_pattern'] else ', memory-pattern cache off'}). A cycle of "
        f"{r['period_requests']} requests ({r['prompts']} Spec-Bench prompts through the chat "
        f"template x speculative with prompt lookup and the cost-model draft length, or plain x "
        f"temperature 0 / 0.7 / 1.0; up to {r['max_new_tokens']} new tokens each) repeats with the "
        f"same seeds; the first {r['warmup_requests']} requests are warm-up. Resident memory "
        f"(/proc/self/statm) after each request, split into anonymous memory (the heap, where "
        f"a leak shows; RssAnon) and pages of the memory-mapped weight file "
        f"(/proc/self/smaps). onnxruntime reads the embedding table straight from that "
        f"read-only mapping, so every token id seen for the first time faults in a page: that "
        f"part grows with the vocabulary used, is bounded by the file and is page cache the "
        f"kernel may reclaim, so the verdict is on the anonymous part.",
        "",
        "| figure | value |",
        "|---|---|",
        f"| tokens decoded | {r['tokens']:,} |",
        f"| requests | {r['requests']:,} |",
        f"| wall time | {r['wall_seconds']:,.0f} s ({r['tokens_per_second']:.1f} tokens/s) |",
        f"| RSS at start (model loaded) | {mib(r['rss_start_kib'])} |",
        f"| RSS after warm-up | {after_warmup} |",
        f"| RSS at the end | {mib(r['rss_end_kib'])} |",
        f"| RSS maximum | {mib(r['rss_max_kib'])} |",
        f"| RSS at the end of each cycle | {cycle_ends} |",
    ]
    if r["judged_on"] == "anonymous RSS":
        anon_ends = ", ".join(mib(k) for k in r["anon_at_cycle_ends_kib"]) or "none completed"
        warm_anon = r["rss_anon_after_warmup_kib"]
        warm_file = r["weights_file_rss_after_warmup_kib"]
        lines += [
            f"| anonymous RSS (heap) after warm-up / at the end | "
            f"{mib(warm_anon) if warm_anon is not None else 'n/a'} / "
            f"{mib(r['rss_anon_end_kib'])} |",
            f"| anonymous RSS at the end of each cycle | {anon_ends} |",
            f"| RSS in the mapped weight file after warm-up / at the end (bound: the model's "
            f"files, {mib(r['model_files_kib'])}) | "
            f"{mib(warm_file) if warm_file is not None else 'n/a'} / "
            f"{mib(r['weights_file_rss_end_kib'])} |",
            f"| slope of all RSS / of the weight-file part after warm-up | "
            f"{r['total_rss_slope_kib_per_1k_tokens']:+.2f} / "
            f"{r['weights_file_slope_kib_per_1k_tokens']:+.2f} KiB per 1,000 tokens |",
        ]
    lines += [
        f"| slope of {r['judged_on']} after warm-up (least squares) | "
        f"{r['slope_kib_per_1k_tokens']:+.2f} KiB per 1,000 tokens (bound "
        f"{r['max_slope_kib_per_1k_tokens']:g}): {verdict} |",
        f"| finish reasons | {_pairs(sorted(r['finish_reasons'].items()))} |",
        f"| requests per mode and temperature | "
        f"{_pairs(r['requests_by_mode_temperature'].items())} |",
        f"| acceptance (speculative requests) | {r['acceptance_rate']:.1%}; "
        f"{r['tokens_per_target_call']:.2f} tokens per target call over all requests |",
        f"| entries in the draft-length policy's `chosen` list | {r['policy_chosen_entries']:,} |",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=100_000, help="new tokens to decode in all")
    ap.add_argument("--model", default=None, help="model directory (default: the default model)")
    ap.add_argument("--prompts", type=int, default=32, help="distinct prompts in the cycle")
    ap.add_argument("--max-new-tokens", type=int, default=192, help="per request")
    ap.add_argument("--warmup-cycles", type=int, default=1,
                    help="cycles before the slope is fitted")
    ap.add_argument("--max-slope", type=float, default=100.0,
                    help="KiB per 1,000 tokens above which the run fails")
    ap.add_argument("--min-judged-tokens", type=int, default=20_000,
                    help="tokens after warm-up below which the slope is reported, not judged")
    ap.add_argument("--questions", default=None,
                    help=f"Spec-Bench question.jsonl (default {default_questions_path()})")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--report", default=str(REPO / "docs" / "soak.md"))
    ap.add_argument("--json", default=None, help="also write every sample as JSON here")
    ap.add_argument("--verbose", action="store_true", help="a line per request")
    args = ap.parse_args(argv)
    for name in ("tokens", "prompts", "max_new_tokens", "warmup_cycles"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    r = run(args)
    command = "python scripts/soak.py " + " ".join(sys.argv[1:] if argv is None else argv)
    text = markdown(r, command.strip())
    print(text)
    Path(args.report).parent.mkdir(parents=True, exist_ok=True)
    Path(args.report).write_text(text, encoding="utf-8")
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1) + "\n", encoding="utf-8")
    return 0 if r["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
