"""The reduced draft vocabulary: the `size` most frequent target tokens of the distilled data
(ties by lower id; topped up with the lowest unused ids when the data has fewer), sorted by
target id, and the speculators maps: d2t [size] int64 offsets, target_id = draft_id +
d2t[draft_id], and t2d [vocab] bool, True at exactly the kept target ids."""

from __future__ import annotations

from collections import Counter
from typing import Iterable

import torch


def draft_vocab(sequences: Iterable[list[int]], *, size: int, vocab: int) -> torch.Tensor:
    """The kept target ids [size] int64, ascending."""
    if not 1 <= size <= vocab:
        raise ValueError(f"draft vocabulary size must lie in 1..{vocab}, got {size}")
    counts = Counter(t for seq in sequences for t in seq)
    ranked = sorted(counts, key=lambda t: (-counts[t], t))[:size]
    kept = set(ranked)
    extra = (t for t in range(vocab) if t not in kept)
    ranked += [next(extra) for _ in range(size - len(ranked))]
    return torch.tensor(sorted(ranked), dtype=torch.int64)


def maps(kept: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """d2t [size] int64 and t2d [vocab] bool for the kept target ids."""
    d2t = kept - torch.arange(kept.numel())
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    return d2t, t2d


def target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """Back from d2t to the kept target ids."""
    return torch.arange(d2t.numel()) + d2t
