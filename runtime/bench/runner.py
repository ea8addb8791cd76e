"""Run plain and speculative decoding side by side on one loaded model.

For each prompt, every method runs on the same decoder, one after the other, the order rotated
from prompt to prompt (and reversed on each repeat: A B, then B A), so the machine's speed drift
hits all methods alike. Only ratios between the methods of one prompt, and counts, are evidence.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Iterable

from ortspec.runtime.decoding.options import SpeculativeOptions
from ortspec.runtime.request import DrafterSpec
from ortspec.runtime.drafters import DRAFTER_NAMES, NEEDS_DRAFT_MODEL
from ortspec.runtime.errors import InvalidOptionError
from ortspec.runtime.validation import check_int

from .workload import BenchPrompt

DRAFTERS = DRAFTER_NAMES  # "none" is the plain method
SPECULATIVE = tuple(d for d in DRAFTERS if d != "none")  # the drafters a method may name


@dataclasses.dataclass(frozen=True)
class Method:
    """`plain`, or a drafter with the cost-model draft length (`prompt-lookup`) or a fixed one
    (`prompt-lookup:k4`); a drafter with a draft model may bound what the draft reads
    (`draft-model:c256`: the last 256 tokens, `DraftModelDrafter`'s context; `:c0` the whole
    history, as without the suffix)."""

    name: str
    drafter: str  # one of DRAFTERS
    fixed_k: int | None = None  # None: the cost model picks k per verify
    draft_context: int | None = None  # None: the model's default (make_drafter)

    @classmethod
    def parse(cls, spec: str) -> "Method":
        spec = spec.strip()
        if spec == "plain":
            return cls("plain", "none")
        m = re.fullmatch(r"([a-z][a-z0-9+-]*)(?::k(\d+))?(?::c(\d+))?", spec)
        if not m or m.group(1) not in SPECULATIVE:
            raise InvalidOptionError(
                f"unknown method {spec!r}; use plain, or one of {SPECULATIVE} optionally "
                f"followed by :kN for a fixed draft length (e.g. prompt-lookup:k4) and, for "
                f"{sorted(NEEDS_DRAFT_MODEL)}, :cN for the tokens the draft reads (draft-model:c256)"
            )
        k = int(m.group(2)) if m.group(2) else None
        k = check_int("fixed draft length", k, minimum=1, maximum=64, allow_none=True)
        context = int(m.group(3)) if m.group(3) else None
        if context is not None and m.group(1) not in NEEDS_DRAFT_MODEL:
            raise InvalidOptionError(f"method {spec!r}: :cN (the draft model's context) applies to "
                                     f"{sorted(NEEDS_DRAFT_MODEL)} only")
        return cls(spec, m.group(1), k, context)


def method_drafter(method: Method, *, ngram_size: int, max_draft_len: int) -> DrafterSpec:
    """The drafter a method decodes with, made on each request's slot (a draft decoder runs on
    its slot's KV buffers): its fixed draft length or `max_draft_len`, its draft context."""
    context = {} if method.draft_context is None else {"draft_context": method.draft_context or None}
    return DrafterSpec(method.drafter, ngram_size=ngram_size,
                       max_draft_len=method.fixed_k or max_draft_len, **context)


@dataclasses.dataclass
class BenchConfig:
    _: dataclasses.KW_ONLY  # options are named where a run is configured
    max_new_tokens: int = 128
    temperature: float = 0.0  # of every method (0: greedy)
    repeats: int = 1
    """each prompt's pair runs this many times, in the reversed order on every other repeat"""
    ngram_size: int = 3
    max_draft_len: int = 8
    seed: int = 0


def _record(prompt: BenchPrompt, method: Method, rep: int, n_prompt: int, result: Any) -> dict[str, Any]:
    c = result.counters
    return {
        "question_id": prompt.question_id,
        "category": prompt.category,
        "subcategory": prompt.subcategory,
        "method": method.name,
        "repeat": rep,
        "prompt_tokens": n_prompt,
        "new_tokens": result.num_tokens,
        "finish_reason": result.finish_reason,
        "seconds": c.total_seconds,
        "prefill_seconds": c.prefill_seconds,
        "ort_seconds": c.ort_seconds,
        "model_seconds": c.model_seconds,
        "draft_seconds": c.draft_seconds,
        "sample_seconds": c.sample_seconds,
        "verify_calls": c.verify_calls,
        "forward_token_calls": c.forward_token_calls,
        "drafted": c.drafted,
        "accepted": c.accepted,
        "recovered": c.recovered,
        "bonus": c.bonus,
        "drafted_by_position": list(c.drafted_by_position),
        "accepted_by_position": list(c.accepted_by_position),
        "accepted_by_source": dict(c.accepted_by_source),
        "tokens": list(result.tokens),
    }


def run_pairs(
    model: Any,
    prompts: Iterable[BenchPrompt],
    methods: list[Method],
    config: BenchConfig,
    *,
    progress: Callable[[int], None] | None = None,
    policies: dict[str, Any] | None = None,
    done: frozenset[int] = frozenset(),
    on_prompt: Callable[[list[dict[str, Any]], list[dict[str, Any]]], None] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(records, skipped). Each record is one decode; at temperature 0 each speculative record
    says whether its tokens equal the plain decode's of the same prompt and repeat.

    policies: method name -> its draft-length policy, for a caller that runs one prompt at a
    time and keeps what each method learned (missing ones are made fresh here).
    done: question ids already measured (a resumed run): skipped, each method keeping the
    order it has at that prompt's place in `prompts`. on_prompt: called with each prompt's
    records and skipped entries as soon as it is finished."""
    if not methods or methods[0].name != "plain":
        raise InvalidOptionError("the first method must be 'plain': every speedup is relative to it")
    # each cost-model method learns on its own (two methods drafting with prompt lookup must not
    # pool their estimates), from the model's calibrated curve
    auto = [m.name for m in methods if m.drafter != "none" and m.fixed_k is None]
    given = policies or {}
    shared = model.draft_length_policy() if set(auto) - set(given) else None
    policies = {m.name: given[m.name] if m.name in given else
                shared.fresh() if m.name in auto else None for m in methods}
    capacity = model.decoder.capacity
    records: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    for i, prompt in enumerate(prompts):
        if prompt.question_id in done:
            if progress:
                progress(1)
            continue
        ids = model.encode(prompt.text, chat=model.manifest.chat_format is not None)
        if len(ids) + config.max_new_tokens > capacity + 1:
            skipped.append({"question_id": prompt.question_id, "category": prompt.category,
                            "prompt_tokens": len(ids), "reason": f"does not fit the capacity {capacity}"})
            if on_prompt:
                on_prompt([], skipped[-1:])
            if progress:
                progress(1)
            continue
        shift = i % len(methods)
        order = methods[shift:] + methods[:shift]
        for rep in range(config.repeats):
            seq = order if rep % 2 == 0 else order[::-1]
            plain_tokens: list[int] | None = None
            by_method: dict[str, dict[str, Any]] = {}
            for m in seq:
                drafter = method_drafter(m, ngram_size=config.ngram_size, max_draft_len=config.max_draft_len)
                options = SpeculativeOptions(
                    config.max_new_tokens, temperature=config.temperature,
                    seed=config.seed * 1_000_003 + prompt.question_id * 101 + rep,
                    stop_token_ids=model.manifest.stop_token_ids, max_draft_len=drafter.max_draft_len,
                )
                result = model.generate(ids, drafter=drafter, options=options, draft_length=policies[m.name])
                by_method[m.name] = _record(prompt, m, rep, len(ids), result)
                if m.name == "plain":
                    plain_tokens = list(result.tokens)
            for m in methods:
                rec = by_method[m.name]
                if config.temperature == 0 and m.name != "plain":
                    rec["identical_to_plain"] = rec["tokens"] == plain_tokens
                records.append(rec)
        if on_prompt:
            on_prompt(records[-config.repeats * len(methods):], [])
        if progress:
            progress(1)
    return records, skipped
