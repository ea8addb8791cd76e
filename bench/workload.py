"""The Spec-Bench workload: 480 questions, first turn, through the model's chat template.

Categories: the eight MT-bench ones (writing, roleplay, reasoning, math, coding, extraction,
stem, humanities) are reported together as "multi-turn"; then translation, summarization, qa,
math_reasoning and rag. `split="dev"` keeps even question ids (for tuning), `"heldout"` the odd
ones (for confirming only).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections import defaultdict
from pathlib import Path

from ortspec.runtime.errors import InvalidOptionError

MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
CATEGORIES = ("multi-turn", "translation", "summarization", "qa", "math_reasoning", "rag")
SPLITS = ("dev", "heldout", "all")


@dataclasses.dataclass(frozen=True)
class BenchPrompt:
    question_id: int
    category: str  # one of CATEGORIES
    subcategory: str  # Spec-Bench's own category
    text: str  # the first turn, before the chat template


def default_questions_path() -> Path:
    """$ORTSPEC_SPEC_BENCH, else shared/data/spec_bench/question.jsonl beside the repository."""
    env = os.environ.get("ORTSPEC_SPEC_BENCH")
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[1]
    return repo.parent / "shared" / "data" / "spec_bench" / "question.jsonl"


def load_questions(
    path: str | os.PathLike | None = None,
    *,
    split: str = "dev",
    per_category: int | None = None,
    categories: tuple[str, ...] | None = None,
) -> list[BenchPrompt]:
    """Prompts in a stable order. With `per_category`, multi-turn takes its questions round-robin
    over the eight MT-bench subcategories so a small sample still covers them."""
    if split not in SPLITS:
        raise InvalidOptionError(f"split must be one of {SPLITS}, got {split!r}")
    if per_category is not None and per_category < 1:
        raise InvalidOptionError(f"per_category must be >= 1, got {per_category}")
    if categories is not None:
        unknown = set(categories) - set(CATEGORIES)
        if unknown:
            raise InvalidOptionError(f"unknown categories {sorted(unknown)}; choose from {CATEGORIES}")
    p = Path(path) if path is not None else default_questions_path()
    if not p.is_file():
        raise InvalidOptionError(f"Spec-Bench questions not found at {p} (set ORTSPEC_SPEC_BENCH)")
    by_cat: dict[str, dict[str, list[BenchPrompt]]] = defaultdict(lambda: defaultdict(list))
    with open(p, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            q = json.loads(line)
            qid = int(q["question_id"])
            if (split == "dev" and qid % 2) or (split == "heldout" and not qid % 2):
                continue
            sub = q["category"]
            cat = "multi-turn" if sub in MT_BENCH else sub
            if categories is not None and cat not in categories:
                continue
            by_cat[cat][sub].append(BenchPrompt(qid, cat, sub, q["turns"][0]))
    out: list[BenchPrompt] = []
    for cat in CATEGORIES:
        subs = [by_cat[cat][s] for s in sorted(by_cat[cat])]
        merged = [q for group in _round_robin(subs) for q in group]
        out.extend(merged[:per_category] if per_category else merged)
    return out


def _round_robin(groups: list[list[BenchPrompt]]) -> list[list[BenchPrompt]]:
    rows = []
    for i in range(max((len(g) for g in groups), default=0)):
        rows.append([g[i] for g in groups if i < len(g)])
    return rows


def interleave_categories(prompts: list[BenchPrompt]) -> list[BenchPrompt]:
    """Order prompts category by category in turn, so a drift of the machine's speed over the
    run spreads over all categories instead of hitting the last ones."""
    by_cat: dict[str, list[BenchPrompt]] = defaultdict(list)
    for q in prompts:
        by_cat[q.category].append(q)
    return [q for row in _round_robin([by_cat[c] for c in CATEGORIES if c in by_cat]) for q in row]
