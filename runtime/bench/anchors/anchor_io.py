"""What the anchor scripts share: the prompt file, the record format, the summary.

Standard library only: this module is imported by `genai_anchor.py` under `.venv-anchors`,
by `hf_anchor.py` under the main venv, and by the benchmark through `ortspec.runtime.bench.anchors`.

Prompt file (JSON lines), one object per prompt:

    {"id": "q82", "category": "writing", "prompt": "<|im_start|>system\\n...<|im_start|>assistant\\n"}
    {"id": "q84", "category": "roleplay", "messages": [{"role": "user", "content": "..."}]}

`prompt` is text already rendered through the chat template, tokenized as it is (special tokens
in it are parsed, no BOS is added: SmolLM2's template starts with `<|im_start|>` itself). If
`prompt` is absent, `messages` are rendered by the anchor with its own framework's copy of the
model's chat template (generation prompt appended). Rendering once, with `render_chatml` (as
`ortspec.runtime.bench.anchors.load_spec_bench` does), is the way to give every system the very same text; every record carries the prompt's token
count and a digest of its token ids, so identical inputs across systems can be checked.

Record (JSON lines), one per prompt, mode and repeat:

    system, system_version, model, threads, options      which anchor, how it was set up
    id, category, mode ("plain" | "ngram"), repeat        what ran
    prompt_tokens, prompt_digest                          its input
    new_tokens, output_ids, finish_reason ("eos" | "length")
    wall_s        append of the prompt to the last token (prefill included), seconds
    prefill_s     the prompt's forward pass alone, where the system exposes it (else null)
    tokens_per_s  new_tokens / wall_s
    forward_calls model forward passes (prefill included)
    matches_plain ngram records: output_ids == the first plain output of that prompt
                  (greedy only; null when sampling); plain records: equal to their first repeat
    stats         the system's own speculative counters, where it has them
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

# The system prompt that SmolLM2-135M-Instruct's chat template (in the GGUF's
# tokenizer.chat_template) inserts when the conversation has none.
DEFAULT_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

MODES = ("plain", "ngram")


def render_chatml(
    messages: Sequence[Mapping[str, str]], system_prompt: str | None = DEFAULT_SYSTEM_PROMPT
) -> str:
    """Render messages the way SmolLM2's ChatML template does, generation prompt appended.

    A first message that is not a system message gets `system_prompt` before it (the template's
    default); pass None to leave it out.
    """
    out = []
    for i, m in enumerate(messages):
        if i == 0 and m["role"] != "system" and system_prompt is not None:
            out.append(f"<|im_start|>system\n{system_prompt}<|im_end|>\n")
        out.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
    out.append("<|im_start|>assistant\n")
    return "".join(out)


def validate_prompts(prompts: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Check the prompt objects; returns plain dicts with id (str) and category filled in."""
    out = []
    seen = set()
    for i, p in enumerate(prompts):
        if not isinstance(p, Mapping):
            raise ValueError(f"prompt {i}: expected an object, got {type(p).__name__}")
        if "prompt" not in p and "messages" not in p:
            raise ValueError(f"prompt {i}: needs 'prompt' (rendered text) or 'messages'")
        if "prompt" in p and not isinstance(p["prompt"], str):
            raise ValueError(f"prompt {i}: 'prompt' must be a string")
        q = dict(p)
        q["id"] = str(q.get("id", i))
        q.setdefault("category", "unknown")
        if q["id"] in seen:
            raise ValueError(f"prompt {i}: duplicate id {q['id']!r}")
        seen.add(q["id"])
        out.append(q)
    return out


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def prompt_digest(ids: Sequence[int]) -> str:
    """Short digest of a token id sequence: equal digests = the same input tokens."""
    return hashlib.sha256(json.dumps([int(t) for t in ids]).encode()).hexdigest()[:16]


def run_record(
    meta: Mapping[str, Any], prompt: Mapping[str, Any], *, mode: str, repeat: int, ids: Sequence[int],
    new: list[int], eos: Iterable[int], wall: float, prefill: float | None, calls: int | None,
    first_plain: list[int] | None, greedy: bool, stats: Any,
) -> dict[str, Any]:
    """One decode's record, in the format this module's docstring describes (every anchor)."""
    return {
        **meta,
        "type": "run",
        "id": prompt["id"],
        "category": prompt["category"],
        "mode": mode,
        "repeat": repeat,
        "prompt_tokens": len(ids),
        "prompt_digest": prompt_digest(ids),
        "new_tokens": len(new),
        "output_ids": new,
        "finish_reason": "eos" if new and new[-1] in set(eos) else "length",
        "wall_s": wall,
        "prefill_s": prefill,
        "tokens_per_s": len(new) / wall if wall > 0 else None,
        "forward_calls": calls,
        "matches_plain": (new == first_plain) if (greedy and first_plain is not None) else None,
        "stats": stats,
    }


def _geomean(xs: Sequence[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def summarize(records: Sequence[Mapping[str, Any]], statistic: str = "median") -> dict[str, Any]:
    """Speedup of ngram over plain: per prompt, per category and overall.

    Per prompt: `speedup` = ngram tokens/s over plain tokens/s (= plain wall / ngram wall when
    both produced the same tokens), each taken as the median over the repeats, or with
    `statistic="min"` from the fastest run of each mode (the better estimate on a machine whose
    noise only ever adds time). Both modes ran interleaved, so drift hits both alike.
    `call_ratio` = ngram tokens per forward call over plain's: the speedup the call count alone
    would give, free of timing noise. A category's figures are geometric means over its prompts;
    so are the overall ones. `ngram_identical_to_plain` counts ngram records whose output equals
    plain's.
    """
    if statistic not in ("median", "min"):
        raise ValueError(f"statistic must be median or min, not {statistic!r}")
    rate: dict[tuple[str, str], list[float]] = defaultdict(list)
    per_call: dict[tuple[str, str], list[float]] = defaultdict(list)
    walls: dict[tuple[str, str], list[float]] = defaultdict(list)
    tokens: dict[tuple[str, str], list[int]] = defaultdict(list)
    category: dict[str, str] = {}
    identical = [0, 0]
    for r in records:
        if r.get("mode") not in MODES:
            continue
        key = (r["id"], r["mode"])
        n, wall = int(r["new_tokens"]), float(r["wall_s"])
        walls[key].append(wall)
        tokens[key].append(n)
        rate[key].append(n / wall if wall > 0 else float("nan"))
        if r.get("forward_calls"):
            per_call[key].append(n / int(r["forward_calls"]))
        category[r["id"]] = r.get("category", "unknown")
        if r["mode"] == "ngram" and r.get("matches_plain") is not None:
            identical[0] += bool(r["matches_plain"])
            identical[1] += 1
    pick = statistics.median if statistic == "median" else max  # max tokens/s = min wall
    per_prompt = {}
    for pid, cat in category.items():
        if not rate.get((pid, "plain")) or not rate.get((pid, "ngram")):
            continue
        p_calls, n_calls = per_call.get((pid, "plain")), per_call.get((pid, "ngram"))
        per_prompt[pid] = {
            "category": cat,
            "speedup": pick(rate[(pid, "ngram")]) / pick(rate[(pid, "plain")]),
            "call_ratio": statistics.median(n_calls) / statistics.median(p_calls) if p_calls and n_calls else None,
            "plain_wall_s": statistics.median(walls[(pid, "plain")]),
            "ngram_wall_s": statistics.median(walls[(pid, "ngram")]),
            "plain_new_tokens": statistics.median(tokens[(pid, "plain")]),
            "ngram_new_tokens": statistics.median(tokens[(pid, "ngram")]),
        }
    by_cat: dict[str, list[float]] = defaultdict(list)
    calls_by_cat: dict[str, list[float]] = defaultdict(list)
    for v in per_prompt.values():
        by_cat[v["category"]].append(v["speedup"])
        if v["call_ratio"] is not None:
            calls_by_cat[v["category"]].append(v["call_ratio"])
    all_calls = [v["call_ratio"] for v in per_prompt.values() if v["call_ratio"] is not None]
    return {
        "statistic": statistic,
        "per_prompt": per_prompt,
        "per_category": {
            c: {"speedup": _geomean(s), "call_ratio": _geomean(calls_by_cat[c]), "prompts": len(s)}
            for c, s in sorted(by_cat.items())
        },
        "overall": _geomean([v["speedup"] for v in per_prompt.values()]),
        "overall_call_ratio": _geomean(all_calls),
        "ngram_identical_to_plain": f"{identical[0]}/{identical[1]}",
    }


def format_summary(name: str, summary: Mapping[str, Any]) -> str:
    lines = [
        f"{name}: ngram vs plain, tokens/s speedup ({summary.get('statistic', 'median')} over repeats) "
        "and tokens-per-forward-call ratio (>1 = ngram better)"
    ]
    for cat, v in summary["per_category"].items():
        lines.append(f"  {cat:22s} {v['speedup']:6.2f}x  calls {v['call_ratio']:5.2f}x  ({v['prompts']} prompts)")
    lines.append(
        f"  {'overall (geomean)':22s} {summary['overall']:6.2f}x  calls {summary['overall_call_ratio']:5.2f}x"
    )
    lines.append(f"  ngram output identical to plain: {summary['ngram_identical_to_plain']}")
    return "\n".join(lines)


def add_common_args(parser, prompts_required: bool = True) -> None:
    """CLI options every anchor script takes."""
    parser.add_argument("--prompts", required=prompts_required, help="JSON-lines prompt file (see anchor_io)")
    parser.add_argument("--out", default="-", help="JSON-lines output file ('-' = stdout)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1, help="A B pairs per prompt (interleaved)")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: the framework's)")
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (default); >0 samples, no identity check"
    )
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (temperature > 0)")
    parser.add_argument("--modes", default="plain,ngram", help="comma-separated subset of plain,ngram")
    parser.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up of each mode")


def generate_options(args: Any, **own: Any) -> dict[str, Any]:
    """The keywords of an anchor's `generate` from `add_common_args`'s options, with its own."""
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                **own)


def parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise SystemExit(f"--modes: expected a subset of {','.join(MODES)}, got {text!r}")
    return modes


class RecordWriter:
    """Writes records as JSON lines as they come (so a crash keeps what was measured)."""

    def __init__(self, path: str):
        import sys

        self._f = sys.stdout if path == "-" else open(path, "w", encoding="utf-8")
        self._close = path != "-"

    def write(self, record: Mapping[str, Any]) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._close:
            self._f.close()
