"""Aggregate benchmark records into tables, a JSON file and plots.

Speedup of a method in a category = plain decoding's total seconds over the method's, for the
same prompts and the same number of new tokens. At temperature 0 both produce the same tokens
and this is the ratio of tokens/s (total new tokens / total seconds, Spec-Bench's convention).
At a temperature above 0 the outputs are different samples of one distribution and their
lengths differ by chance (a 12-prompt rag run gave 1,283 plain tokens against 1,108), which
moves the prefill's share of the time and with it the raw tokens/s ratio, by several percent
either way. The speedup therefore charges each method its own prefill time plus its own decode
time per token times plain's token count:

    speedup = T_plain / (prefill_m + decode_m * N_plain / N_m)

which equals the raw ratio when N_m = N_plain. The raw tokens/s ratio (`raw_speedup`), the
decode-only ratio and the geometric mean of the per-prompt raw ratios are reported too. Mean
tokens per call counts the bonus.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Sequence

from .workload import CATEGORIES


@dataclasses.dataclass
class Aggregate:
    method: str
    category: str
    prompts: int
    new_tokens: int
    seconds: float
    tokens_per_second: float
    speedup: float  # vs plain, end to end (prefill included), length-matched (module docstring)
    raw_speedup: float  # ratio of tokens/s as measured, end to end
    decode_speedup: float  # the same ratio with the prefill time left out of both
    speedup_geomean: float  # geometric mean of per-prompt ratios
    tokens_per_call: float  # bonus included
    acceptance_rate: float
    acceptance_by_position: list[float]
    drafted_by_position: list[int]
    identical: int | None  # temperature 0: prompts whose output equals plain's
    share_ort: float
    share_draft: float
    share_sample: float
    share_other: float
    accepted_by_source: dict[str, int]


def _sum_lists(lists: Iterable[Sequence[int]]) -> list[int]:
    out: list[int] = []
    for xs in lists:
        for i, x in enumerate(xs):
            if i == len(out):
                out.append(0)
            out[i] += x
    return out


def aggregate(records: list[dict[str, Any]], *, methods: Sequence[str]) -> list[Aggregate]:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        groups[(r["method"], r["category"])].append(r)
        groups[(r["method"], "overall")].append(r)
    cats = [c for c in CATEGORIES if any(r["category"] == c for r in records)] + ["overall"]
    out = []
    for cat in cats:
        plain = groups.get(("plain", cat), [])
        plain_tps = sum(r["new_tokens"] for r in plain) / max(1e-12, sum(r["seconds"] for r in plain))
        plain_by_prompt = {(r["question_id"], r["repeat"]): r for r in plain}
        plain_decode_tps = sum(r["new_tokens"] for r in plain) / max(
            1e-12, sum(r["seconds"] - r["prefill_seconds"] for r in plain))
        for m in methods:
            rs = groups.get((m, cat), [])
            if not rs:
                continue
            tok = sum(r["new_tokens"] for r in rs)
            sec = sum(r["seconds"] for r in rs)
            tps = tok / max(1e-12, sec)
            prefill = sum(r["prefill_seconds"] for r in rs)
            decode_tps = tok / max(1e-12, sec - prefill)
            plain_tok = sum(r["new_tokens"] for r in plain)
            plain_sec = sum(r["seconds"] for r in plain)
            # this method's time for plain's token count: its prefill + its decode rate
            matched = prefill + (sec - prefill) * plain_tok / tok if tok else float("nan")
            ratios = []
            for r in rs:
                p = plain_by_prompt.get((r["question_id"], r["repeat"]))
                if p and p["seconds"] > 0 and r["seconds"] > 0 and r["new_tokens"] and p["new_tokens"]:
                    ratios.append((r["new_tokens"] / r["seconds"]) / (p["new_tokens"] / p["seconds"]))
            calls = sum(r["verify_calls"] + r["forward_token_calls"] for r in rs)
            drafted = sum(r["drafted"] for r in rs)
            emitted = sum(r["accepted"] + r["recovered"] + r["bonus"] for r in rs)
            d_pos = _sum_lists(r["drafted_by_position"] for r in rs)
            a_pos = _sum_lists(r["accepted_by_position"] for r in rs)
            ident = [r["identical_to_plain"] for r in rs if "identical_to_plain" in r]
            ort = sum(r["ort_seconds"] for r in rs)
            draft = sum(r["draft_seconds"] for r in rs)
            sample = sum(r["sample_seconds"] for r in rs)
            sources: dict[str, int] = defaultdict(int)
            for r in rs:
                for s, n in r.get("accepted_by_source", {}).items():
                    sources[s] += n
            out.append(Aggregate(
                method=m, category=cat, prompts=len({r["question_id"] for r in rs}),
                new_tokens=tok, seconds=sec, tokens_per_second=tps,
                speedup=plain_sec / matched if plain and matched > 0 else float("nan"),
                raw_speedup=tps / plain_tps if plain_tps else float("nan"),
                decode_speedup=decode_tps / plain_decode_tps if plain_decode_tps else float("nan"),
                speedup_geomean=math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else float("nan"),
                tokens_per_call=emitted / calls if calls else 0.0,
                acceptance_rate=sum(r["accepted"] for r in rs) / drafted if drafted else 0.0,
                acceptance_by_position=[a / d if d else 0.0 for a, d in zip(a_pos, d_pos)],
                drafted_by_position=d_pos,
                identical=sum(ident) if ident else None,
                share_ort=ort / sec if sec else 0.0,
                share_draft=draft / sec if sec else 0.0,
                share_sample=sample / sec if sec else 0.0,
                share_other=max(0.0, 1 - (ort + draft + sample) / sec) if sec else 0.0,
                accepted_by_source=dict(sources),
            ))
    return out


def markdown_tables(aggs: list[Aggregate], *, anchors: dict[str, dict[str, float]] | None = None) -> str:
    """One table: a row per (category, method); anchor speedups as extra columns."""
    anchors = anchors or {}
    head = ["category", "method", "prompts", "tok/s", "speedup", "raw tok/s ratio", "decode speedup",
            "tokens/call", "accept", "identical", "ORT", "draft", "sample", "other"]
    head += [f"{name} ×" for name in anchors]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for a in aggs:
        ident = "" if a.identical is None else f"{a.identical}/{a.prompts}"
        row = [a.category, a.method, str(a.prompts), f"{a.tokens_per_second:.1f}", f"{a.speedup:.2f}×",
               f"{a.raw_speedup:.2f}×", f"{a.decode_speedup:.2f}×",
               f"{a.tokens_per_call:.2f}", f"{a.acceptance_rate:.0%}" if a.method != "plain" else "",
               ident, f"{a.share_ort:.0%}", f"{a.share_draft:.1%}", f"{a.share_sample:.1%}",
               f"{a.share_other:.1%}"]
        for name, by_cat in anchors.items():
            v = by_cat.get(a.category)
            row.append(f"{v:.2f}×" if v is not None and a.method == "plain" else "")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def acceptance_table(aggs: list[Aggregate], *, positions: int = 8) -> str:
    head = ["category", "method"] + [f"pos {i + 1}" for i in range(positions)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for a in aggs:
        if a.method == "plain":
            continue
        cells = [f"{x:.2f}" for x in a.acceptance_by_position[:positions]]
        cells += [""] * (positions - len(cells))
        lines.append("| " + " | ".join([a.category, a.method, *cells]) + " |")
    return "\n".join(lines) + "\n"


def write_json(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=_jsonable), encoding="utf-8")
    tmp.replace(path)


def _jsonable(x: Any) -> Any:
    if dataclasses.is_dataclass(x):
        return dataclasses.asdict(x)
    raise TypeError(f"not JSON-serialisable: {type(x).__name__}")


def plot(aggs: list[Aggregate], out_dir: Path, *, anchors: dict[str, dict[str, float]] | None = None,
         title: str = "") -> list[Path]:
    """speedup.png (by category, methods and anchors side by side) and acceptance.png."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    anchors = anchors or {}
    cats = list(dict.fromkeys(a.category for a in aggs))
    methods = [m for m in dict.fromkeys(a.method for a in aggs) if m != "plain"]
    series = [(m, {a.category: a.speedup for a in aggs if a.method == m}) for m in methods]
    series += [(name, by_cat) for name, by_cat in anchors.items()]
    fig, ax = plt.subplots(figsize=(max(8, 1.4 * len(cats)), 4.5))
    width = 0.8 / max(1, len(series))
    for j, (name, by_cat) in enumerate(series):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(cats))]
        ys = [by_cat.get(c, float("nan")) for c in cats]
        ax.bar(xs, ys, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(cats)), cats, rotation=20)
    ax.set_ylabel("speedup over own plain decoding (tokens/s ratio)")
    ax.set_title(title or "Speedup by category")
    ax.legend(fontsize=8)
    fig.tight_layout()
    p1 = out_dir / "speedup.png"
    fig.savefig(p1, dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for a in aggs:
        if a.method == "plain" or a.category != "overall" or not a.acceptance_by_position:
            continue
        ax.plot(range(1, len(a.acceptance_by_position) + 1), a.acceptance_by_position, marker="o", label=a.method)
    first = methods[0] if methods else None
    for a in aggs:
        if a.method == first and a.category != "overall" and a.acceptance_by_position:
            ax.plot(range(1, len(a.acceptance_by_position) + 1), a.acceptance_by_position,
                    linestyle=":", alpha=0.6, label=f"{a.method} · {a.category}")
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted / drafted at this position")
    ax.set_ylim(0, 1)
    ax.set_title("Acceptance by draft position")
    if ax.get_legend_handles_labels()[0]:  # a run with no drafts has no curve to label
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    p2 = out_dir / "acceptance.png"
    fig.savefig(p2, dpi=110)
    plt.close(fig)
    return [p1, p2]
