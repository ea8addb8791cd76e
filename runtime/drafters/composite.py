"""Composition: try drafters in order, take the first non-empty block.

Example: `FallbackDrafter([PromptLookupSpeculator(), DraftModelDrafter(draft)])` drafts from the
history when an n-gram matches (free, and often long) and from the draft model otherwise. Each
block keeps its drafter's `source`, so the decode counters tell which drafter produced every
accepted token (`counters.accepted_by_source`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..errors import InvalidOptionError
from ..protocols import DraftLengthPolicy, Drafter
from ..sampling import DraftBlock

if TYPE_CHECKING:
    from ..decode import SpeculativeOptions


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
