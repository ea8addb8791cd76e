"""Composition of drafters.

- `FallbackDrafter([PromptLookupSpeculator(), DraftModelDrafter(draft)])` tries them in order
  and takes the first non-empty block: from the history when an n-gram matches (free, and often
  long), from the draft model otherwise.
- `CostAwareDrafter(PromptLookupSpeculator(), DraftModelDrafter(draft))` asks the request's
  draft-length policy which one pays. The free drafter proposes; the policy prices its block
  (the acceptance learned for its key, e.g. prompt lookup's per match length) and the draft
  model's best block (its learned acceptance, and a draft step per drafted token) in expected
  tokens per second; the better one drafts. At temperature 0 a long n-gram match usually wins;
  above it, where a point-mass draft x is accepted with probability p(x) only and a sampled
  draft with 1 - TV(p, q), the draft model usually does.

The choice depends on the history and on earlier outcomes only, never on the draws of the
verify it feeds, so the output distribution stays the target's. Each block keeps its drafter's
`source`, so the decode counters tell which drafter produced every accepted token
(`counters.accepted_by_source`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence

import numpy as np

from ..errors import InvalidOptionError
from ..decoding.protocols import DraftLengthPolicy, Drafter
from ..decoding.sampling import DraftBlock
from ..draft_length.policy import AcceptanceModel

if TYPE_CHECKING:
    from ..decoding.options import SpeculativeOptions


class FallbackDrafter:
    def __init__(self, drafters: Sequence[Drafter]) -> None:
        if not drafters:
            raise InvalidOptionError("FallbackDrafter needs at least one drafter")
        self.drafters = list(drafters)

    def begin(self, options: "SpeculativeOptions", draft_length: DraftLengthPolicy | None) -> None:
        for d in self.drafters:
            d.begin(options, draft_length)

    def observe_target(self, start: int, logits: np.ndarray) -> None:  # logits: [n, vocab]
        """Every drafter sees every target row, whichever of them drafted."""
        for d in self.drafters:
            d.observe_target(start, logits)

    def propose(self, history: Sequence[int], max_tokens: int) -> DraftBlock:
        for d in self.drafters:
            block = d.propose(history, max_tokens)
            if len(block):
                return block
        return DraftBlock.empty()


class PaidDrafter(Drafter, Protocol):
    """A drafter that pays a model step per drafted token (a draft model, a trained head): it
    says what `policy` expects its next block to emit per second, drafting paid."""

    def rate(self, policy: DraftLengthPolicy, history: Sequence[int], max_tokens: int) -> float: ...


class CostAwareDrafter:
    """`free` (drafting costs nothing) or `paid` (a draft model or an EAGLE-3 head), whichever
    the request's policy expects to emit more tokens per second this step (see the module
    docstring). Without a policy: `free`'s block when it has one, else `paid`'s
    (FallbackDrafter's order).

    `chosen` counts the steps each drafted ({"free": n, "paid": n})."""

    def __init__(self, free: Drafter, paid: PaidDrafter) -> None:
        self.free, self.paid = free, paid
        self._policy: DraftLengthPolicy | None = None
        self.chosen = {"free": 0, "paid": 0}

    def begin(self, options: "SpeculativeOptions", draft_length: DraftLengthPolicy | None) -> None:
        self._policy = draft_length
        self.free.begin(options, draft_length)
        self.paid.begin(options, draft_length)

    def observe_target(self, start: int, logits: np.ndarray) -> None:  # logits: [n, vocab]
        self.free.observe_target(start, logits)
        self.paid.observe_target(start, logits)

    def propose(self, history: Sequence[int], max_tokens: int) -> DraftBlock:
        block = self.free.propose(history, max_tokens)
        policy = self._policy
        if len(block) and (policy is None or policy.rate(
                len(block), key=AcceptanceModel.key(block), prior=block.prior, paid=False)
                >= self.paid.rate(policy, history, max_tokens)):
            self.chosen["free"] += 1
            return block
        self.chosen["paid"] += 1
        return self.paid.propose(history, max_tokens)
