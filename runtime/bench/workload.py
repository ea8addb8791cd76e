"""The Spec-Bench workload: 480 questions, first turn, through the model's chat template.

Categories: the eight MT-bench ones (writing, roleplay, reasoning, math, coding, extraction,
stem, humanities) are reported together as "multi-turn"; then translation, summarization, qa,
math_reasoning and rag. `split="dev"` keeps even question ids (for tuning), `"heldout"` the odd
ones (for confirming only), `"all"` both.

The question file ships inside the package (`data/spec_bench/question.jsonl`, read through
`importlib.resources`); any other file in the same format can be passed as `path`. This is the
one loader of that file: the benchmark, the anchors and the scripts all sample through it.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import os
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from ortspec.runtime.errors import InvalidOptionError
from ortspec.runtime.validation import check_int

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
CATEGORIES = ("multi-turn", "translation", "summarization", "qa", "math_reasoning", "rag")
SPLITS = ("dev", "heldout", "all")


@dataclasses.dataclass(frozen=True)
class BenchPrompt:
    question_id: int
    category: str  # one of CATEGORIES (or the file's own category, for one that is none of them)
    subcategory: str  # Spec-Bench's own category
    text: str  # the first turn, before the chat template


def default_questions_path() -> Traversable:
    """The Spec-Bench question file packaged with `ortspec.runtime.bench`."""
    return importlib.resources.files("ortspec.runtime.bench") / "data" / "spec_bench" / "question.jsonl"


def _read(source: Path | Traversable) -> list[dict]:
    if not source.is_file():
        raise InvalidOptionError(f"Spec-Bench questions not found at {source}")
    with source.open("r", encoding="utf-8") as f:
        rows = []
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                q = json.loads(line)
                rows.append({"question_id": int(q["question_id"]), "category": str(q["category"]),
                             "text": q["turns"][0]})
            except (ValueError, KeyError, IndexError, TypeError) as e:
                raise InvalidOptionError(
                    f"{source}, line {n}: not a Spec-Bench question (question_id, category, turns): {e}"
                ) from None
    return rows


def load_questions(
    path: str | os.PathLike | None = None,
    *,
    split: str = "dev",
    per_category: int | None = None,
    categories: Iterable[str] | None = None,
) -> list[BenchPrompt]:
    """Prompts in a stable order: category by category (CATEGORIES first, then any other category
    the file has, in order of appearance). With `per_category`, a category takes its first n
    questions round-robin over its Spec-Bench subcategories, so a small multi-turn sample still
    covers the eight MT-bench ones. `categories` keeps those named, by reported category
    ("multi-turn") or Spec-Bench's own ("writing"). `path` None: the packaged file."""
    if split not in SPLITS:
        raise InvalidOptionError(f"split must be one of {SPLITS}, got {split!r}")
    per_category = check_int("per_category", per_category, minimum=1, allow_none=True)
    wanted = None
    if categories is not None:
        if isinstance(categories, str):
            raise InvalidOptionError(f"categories must be a sequence of names, got the string {categories!r}")
        wanted = set(categories)
    rows = _read(Path(path) if path is not None else default_questions_path())
    if wanted is not None:
        known = set(CATEGORIES) | set(MT_BENCH) | {r["category"] for r in rows}
        unknown = wanted - known
        if unknown:
            raise InvalidOptionError(f"unknown categories {sorted(unknown)}; choose from {CATEGORIES}")
    by_cat: dict[str, dict[str, list[BenchPrompt]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        qid, sub = r["question_id"], r["category"]
        if (split == "dev" and qid % 2) or (split == "heldout" and not qid % 2):
            continue
        cat = "multi-turn" if sub in MT_BENCH else sub
        if wanted is not None and cat not in wanted and sub not in wanted:
            continue
        by_cat[cat][sub].append(BenchPrompt(qid, cat, sub, r["text"]))
    order = [c for c in CATEGORIES if c in by_cat] + [c for c in by_cat if c not in CATEGORIES]
    out: list[BenchPrompt] = []
    for cat in order:
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
    order = [c for c in CATEGORIES if c in by_cat] + [c for c in by_cat if c not in CATEGORIES]
    return [q for row in _round_robin([by_cat[c] for c in order]) for q in row]
