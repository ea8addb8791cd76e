"""The target's own distributions, cached: draft from what the target said after an earlier
occurrence of the context.

Every target call hands the drafter its logits for the positions it emitted
(`Drafter.observe_target`); this drafter keeps, per position of the history, the top
`cached_top` tokens of the warped target distribution there, renormalised (at temperature 0,
the point mass on the argmax). To draft, it finds the longest earlier occurrence of the
context's n-gram suffix, as prompt lookup does, and samples the token from the distribution
cached at the position after it. Where text repeats, the target says nearly the same there
as here, so q ~ p and a drafted token is accepted with probability about 1 - TV(p, q)
(with q the renormalised top-k of p itself, exactly the mass p puts on those k tokens),
where a point mass is accepted with probability p(x).

Example (ngram_size 2): history `... 7 8 | 4 ... 7 8`, the 4 at position 20 emitted by the target
with p_20 = {4: 0.6, 5: 0.3, 9: 0.1}. The tail `7 8` matched at 18-19, so q1 is p_20's top
`cached_top` (2, say: {4: 2/3, 5: 1/3}); draw x1 = 5; the context now ends `8 5`, matched elsewhere or, if nowhere,
aligned with position 21: q2 is the row cached there.

Positions with no row (the prompt: prefill returns no rows) give the point mass on the token
that is there, so on copied prompt text this drafter is prompt lookup. The block's length and
key are prompt lookup's, fixed before anything is drawn (see `continuations`). Any q keeps the
rule lossless; the renormalised top-k only decides how often drafts are accepted.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..decoding.sampling import DraftBlock, DraftDist, warp
from ..validation import check_int
from .continuations import Continuations, SampledLookupState

SOURCE = "target_cache"  # DraftBlock.source of these drafts
CACHED_TOP = 32  # tokens kept per position


def sparse_target(logits: np.ndarray, *, k: int, temperature: float, top_k: int | None = None,
                  top_p: float | None = None) -> DraftDist:  # logits: [vocab]
    """The renormalised top-k of warp(logits, temperature, top_k, top_p); at temperature 0 the
    point mass on the argmax (ties: lowest id, as warp).

    Without top_p the top k logits, softmaxed at the temperature, are exactly that (warping is
    monotone, and top-k only cuts below them), at the cost of one partition of the vocabulary
    rather than a softmax over all of it; with top_p the full warp decides the support."""
    if temperature == 0:
        return DraftDist.point(int(np.argmax(logits)))
    vocab = logits.shape[-1]
    if top_p is not None and top_p < 1.0:
        p = warp(logits, temperature=temperature, top_k=top_k, top_p=top_p)
        ids = np.flatnonzero(p > 0)
        if ids.size > k:
            ids = ids[np.argpartition(-p[ids], k - 1)[:k]]
        probs = p[ids]
    else:
        m = min(k, vocab, top_k if top_k is not None else vocab)
        ids = np.argpartition(-logits, m - 1)[:m] if m < vocab else np.arange(vocab)
        z = logits[ids].astype(np.float64) / temperature
        probs = np.exp(z - z.max())
    keep = probs > 0
    ids, probs = ids[keep].astype(np.int64), probs[keep]
    return DraftDist(ids, probs / probs.sum())


class TargetCacheDrafter(SampledLookupState):
    """Drafter: up to `max_draft_len` tokens, each sampled from the target distribution cached
    after the longest earlier occurrence (`ngram_size` down to `min_ngram_size` tokens) of its
    context; `cached_top` tokens are kept per position.

    `rows_used` / `points_used` count the drafted positions whose q was a cached row / a point
    mass where no row was (since construction)."""

    SOURCE = SOURCE

    def __init__(self, ngram_size: int = 3, max_draft_len: int = 8, min_ngram_size: int = 1, *,
                 cached_top: int = CACHED_TOP, seed: int | None = None) -> None:
        super().__init__(ngram_size, max_draft_len, min_ngram_size, seed=seed)
        self.cached_top = check_int("cached_top", cached_top, minimum=1)
        self.rows: dict[int, DraftDist] = {}  # history position -> the q cached for it
        self.rows_used = 0
        self.points_used = 0

    def reset(self) -> None:
        super().reset()
        self.rows = {}

    def observe_target(self, start: int, logits: np.ndarray) -> None:  # logits: [n, vocab]
        for i in range(logits.shape[0]):
            self.rows[start + i] = sparse_target(logits[i], k=self.cached_top, temperature=self.temperature,
                                                 top_k=self.top_k, top_p=self.top_p)

    def _q(self, match: Continuations | None, position: int) -> DraftDist:
        """The row cached after the match (or at the aligned position), else the point mass on
        the token there."""
        if match is not None:
            position = match.recent
        row = self.rows.get(position)
        if row is not None:
            self.rows_used += 1
            return row
        self.points_used += 1
        return DraftDist.point(self.index.tokens[position])

    def propose(self, history: Sequence[int], max_tokens: int) -> DraftBlock:
        return self.block(history, max_tokens, self._q)
