"""Prompt lookup: draft the tokens that followed the last earlier occurrence of the history's tail.

Example (ngram_size=3, max_draft_len=4), history as words:

    the cat sat on the mat . the cat sat   <- tail "the cat sat" (n = 3)
    ^^^^^^^^^^^ earlier occurrence, followed by "on the mat ."
    -> draft "on the mat ." (4 point masses)

If the 3-token tail never occurred before, the tail of 2 tokens is tried, then 1, down to
`min_ngram_size`; the longest match wins. Among earlier occurrences of the same n-gram the most
recent wins by default (`prefer="recent"`; `prefer="first"` takes the earliest). No match: an
empty block.

An index from each n-gram to where it occurred is kept up to date incrementally as the history
grows, so `propose` costs O(1) amortised per new history token instead of a rescan.
"""

from __future__ import annotations

from typing import Literal, Sequence

from ..errors import InvalidOptionError
from ..decoding.history import HistoryFollower
from ..decoding.protocols import DraftLengthPolicy, DrafterBase
from ..decoding.sampling import DraftBlock
from ..validation import check_int

Prefer = Literal["recent", "first"]
SOURCE = "prompt_lookup"  # DraftBlock.source of these drafts
# The prior chance that a drafted token is accepted, by the length of the match behind it (a
# longer matched n-gram predicts its continuation better); the draft-length policy starts here.
PRIOR_BY_MATCH_LEN = {1: 0.3, 2: 0.45, 3: 0.6}


def check_lookup_sizes(ngram_size: object, min_ngram_size: object, max_draft_len: object) -> None:
    """The sizes every n-gram lookup drafter takes (this one, and those of `continuations`):
    1 <= min_ngram_size <= ngram_size, max_draft_len >= 0, else InvalidOptionError."""
    check_int("ngram_size", ngram_size, minimum=1)
    check_int("min_ngram_size", min_ngram_size, minimum=1)
    if min_ngram_size > ngram_size:  # type: ignore[operator]
        raise InvalidOptionError(
            f"min_ngram_size ({min_ngram_size}) must be <= ngram_size ({ngram_size})"
        )
    check_int("max_draft_len", max_draft_len, minimum=0)


class NgramIndex:
    """For n in [min_n, max_n]: n-gram -> end position of its chosen earlier occurrence.

    Only n-grams with at least one token after them are indexed (end < len(tokens)), so the
    history's own tail is never its own match.
    """

    def __init__(self, min_n: int, max_n: int, prefer: Prefer) -> None:
        self.min_n, self.max_n, self.prefer = min_n, max_n, prefer
        self.tokens: list[int] = []
        self._maps: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self._indexed_end = 0  # n-grams ending at positions < this are indexed

    def extend(self, new_tokens: Sequence[int]) -> None:
        self.tokens.extend(int(t) for t in new_tokens)
        toks = self.tokens
        # index every n-gram ending at e, for e up to len - 1 (each has a continuation)
        for e in range(max(self._indexed_end, 1), len(toks)):
            for n, m in self._maps.items():
                if e >= n:
                    key = tuple(toks[e - n : e])
                    if self.prefer == "recent":
                        m[key] = e
                    else:
                        m.setdefault(key, e)
        self._indexed_end = max(self._indexed_end, len(toks))

    def lookup(self) -> tuple[int, int]:
        """(start of the continuation, n) of the longest matching tail, or (-1, 0)."""
        toks = self.tokens
        for n in range(min(self.max_n, len(toks) - 1), self.min_n - 1, -1):
            e = self._maps[n].get(tuple(toks[len(toks) - n :]))
            if e is not None:
                return e, n
        return -1, 0


class PromptLookupSpeculator(DrafterBase):
    """Drafter: continuation of the longest earlier match of the last `ngram_size`..`min_ngram_size`
    tokens, up to `max_draft_len` tokens (and never more than the caller's `max_tokens`)."""

    def __init__(
        self,
        ngram_size: int = 3,
        max_draft_len: int = 8,
        min_ngram_size: int = 1,
        *,
        prefer: Prefer = "recent",
    ) -> None:
        check_lookup_sizes(ngram_size, min_ngram_size, max_draft_len)
        if prefer not in ("recent", "first"):
            raise InvalidOptionError(f"prefer must be 'recent' or 'first', got {prefer!r}")
        self.ngram_size = ngram_size
        self.min_ngram_size = min_ngram_size
        self.max_draft_len = max_draft_len
        self.prefer: Prefer = prefer
        self._index = NgramIndex(min_ngram_size, ngram_size, prefer)
        self._follower = HistoryFollower()

    def begin(self, options: object, draft_length: DraftLengthPolicy | None = None) -> None:
        """A new request: forget the previous history."""
        self.reset()

    def reset(self) -> None:
        self._index = self._fresh_index()
        self._follower = HistoryFollower()

    def _fresh_index(self) -> "NgramIndex":
        return NgramIndex(self.min_ngram_size, self.ngram_size, self.prefer)

    def _sync(self, history: Sequence[int]) -> None:
        """Bring the index up to `history` (`HistoryFollower.sync`)."""
        self._index = self._follower.sync(self._index, history, self._fresh_index)

    def propose(self, history: Sequence[int], max_tokens: int) -> DraftBlock:
        limit = min(self.max_draft_len, max_tokens)
        self._sync(history)
        if limit <= 0:
            return DraftBlock.empty()
        start, n = self._index.lookup()
        if start < 0:
            return DraftBlock.empty()
        toks = self._index.tokens
        prior = PRIOR_BY_MATCH_LEN[min(n, max(PRIOR_BY_MATCH_LEN))]
        return DraftBlock.points(toks[start : start + limit], source=SOURCE, match_len=n, prior=prior)
