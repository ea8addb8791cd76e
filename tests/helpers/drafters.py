"""Drafters for tests: deliberately bad ones and an oracle."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ortspec.runtime import DraftBlock, DraftDist, DrafterBase


class RandomDrafter(DrafterBase):
    """Drafts k tokens, each drawn from a fixed, deliberately skewed q (one per draft position)
    with its own random stream: a legitimate drafter whose q has nothing to do with the target."""

    def __init__(self, vocab: int, k: int, *, seed: int = 0, concentration: float = 0.3) -> None:
        rng = np.random.default_rng(seed + 1000)
        self.qs = [rng.dirichlet(np.full(vocab, concentration)) for _ in range(k)]
        self.qs = [q / q.sum() for q in self.qs]
        self.k = k
        self.rng = np.random.default_rng(seed)

    def propose(self, history: Sequence[int], max_tokens: int) -> DraftBlock:
        n = min(self.k, max_tokens)
        toks = [int(self.rng.choice(q.size, p=q)) for q in self.qs[:n]]
        return DraftBlock(tuple(toks), tuple(DraftDist.from_probs(q) for q in self.qs[:n]), source="random")


class OracleDrafter(DrafterBase):
    """Drafts the known continuation of `prompt` (e.g. a greedy decode's output)."""

    def __init__(self, prompt: Sequence[int], continuation: Sequence[int], k: int) -> None:
        self.full = list(prompt) + list(continuation)
        self.k = k

    def propose(self, history: Sequence[int], max_tokens: int) -> DraftBlock:
        n = len(history)
        if self.full[:n] != list(history):
            return DraftBlock.empty()
        return DraftBlock.points(self.full[n : n + min(self.k, max_tokens)], source="oracle")


class EmptyDrafter(DrafterBase):
    def propose(self, history: Sequence[int], max_tokens: int) -> DraftBlock:
        return DraftBlock.empty()


class BadDrafter(DrafterBase):
    """Returns whatever block it was given, regardless of the limit."""

    def __init__(self, block: DraftBlock) -> None:
        self.block = block

    def propose(self, history: Sequence[int], max_tokens: int) -> DraftBlock:
        return self.block


class Counting:
    """Wraps a drafter and counts the drafted positions whose q was not a point mass."""

    def __init__(self, drafter):
        self.drafter, self.spread = drafter, 0

    def begin(self, options, draft_length):
        self.drafter.begin(options, draft_length)

    def observe_target(self, start, logits):
        self.drafter.observe_target(start, logits)

    def propose(self, history, max_tokens):
        block = self.drafter.propose(history, max_tokens)
        self.spread += sum(not d.is_point for d in block.dists)
        return block
