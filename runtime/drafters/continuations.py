"""What followed each n-gram of the history: the index the drafters that sample from a q share.

For n in [min_n, max_n], every n-gram of the history with a token after it maps to the position
of the token after its most recent occurrence, and to the count of each token that followed it
over all its occurrences (with the position where each last did). Example, min_n 1, max_n 2,
history `a b a c a` (positions 0..4):

    (a,)   -> most recent continuation at 3 (c); followed by b once, c once
    (b,)   -> 2 (a);  (c,) -> 4 (a);  (a, b) -> 2;  (b, a) -> 3;  (a, c) -> 4

The tail `(c, a)` has nothing after it yet, so it is not indexed: the history's own tail is
never its own match. Kept up to date incrementally, O(max_n) per new token.

`sample_lookup_block` is the drafting loop both drafters share. A block starts only where the
history's own tail matches (the longest n-gram wins), and its length is fixed before anything
is sampled: that of prompt lookup, the tokens between the most recent such occurrence and the
end of the history, cut at the limit. Each position then takes the q its drafter gives for the
longest match of the context so far (history and the tokens drafted before it), and draws its
token from that q with the request's own random stream. A context with no match at all takes
the q of the position aligned with the first match. Because the length and the block's key
(source, match length) depend on the history alone, never on the draws, a draft-length policy
that sizes the verify from them leaves the output distribution exact.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Sequence

import numpy as np

from ..decoding.history import HistoryFollower
from ..decoding.protocols import DraftLengthPolicy, DrafterBase
from ..decoding.sampling import DraftBlock, DraftDist, sample_from
from ..validation import check_int
from .prompt_lookup import PRIOR_BY_MATCH_LEN, check_lookup_sizes

if TYPE_CHECKING:
    from ..decoding.options import SpeculativeOptions


class Continuations:
    """What followed one n-gram: `recent`, the position after its most recent occurrence, and
    per following token [count, position where it last followed]."""

    __slots__ = ("recent", "followers")

    def __init__(self) -> None:
        self.recent = -1
        self.followers: dict[int, list[int]] = {}

    def add(self, token: int, position: int) -> None:
        self.recent = position
        seen = self.followers.get(token)
        if seen is None:
            self.followers[token] = [1, position]
        else:
            seen[0] += 1
            seen[1] = position

    def distribution(self) -> DraftDist:
        """The empirical distribution of the following tokens."""
        ids = np.fromiter(self.followers, dtype=np.int64, count=len(self.followers))
        counts = np.array([c for c, _ in self.followers.values()], dtype=np.float64)
        return DraftDist(ids, counts / counts.sum())

    def mode(self) -> int:
        """The most frequent following token; ties go to the one that followed most recently."""
        return max(self.followers.items(), key=lambda kv: (kv[1][0], kv[1][1]))[0]


class ContinuationIndex:
    """For n in [min_n, max_n]: n-gram -> `Continuations`, over a history that only grows."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._maps: dict[int, dict[tuple[int, ...], Continuations]] = {n: {} for n in range(min_n, max_n + 1)}

    def extend(self, new_tokens: Sequence[int]) -> None:
        toks = self.tokens
        start = len(toks)
        toks.extend(int(t) for t in new_tokens)
        for e in range(max(start, 1), len(toks)):  # the token at e follows the n-grams ending before it
            for n, m in self._maps.items():
                if e >= n:
                    key = tuple(toks[e - n : e])
                    entry = m.get(key)
                    if entry is None:
                        entry = m[key] = Continuations()
                    entry.add(toks[e], e)

    def match(self, tail: Sequence[int]) -> tuple[int, Continuations | None]:
        """(n, what followed) for the longest n-gram ending `tail` that occurred with a token
        after it, or (0, None). `tail`: the last tokens of a context (at least max_n if it has
        that many)."""
        for n in range(min(self.max_n, len(tail)), self.min_n - 1, -1):
            entry = self._maps[n].get(tuple(tail[len(tail) - n :]))
            if entry is not None:
                return n, entry
        return 0, None


    def distinct_followers(self, tail: Sequence[int], k: int) -> list[int]:
        """Up to k distinct tokens that followed the n-grams ending `tail`: the longest n-gram's
        followers, most recent first, then each shorter one's. Example, history `a b a c a`
        (min_n 1, max_n 2), tail `c a`: (c, a) has no follower yet, (a,) was followed by c at 3
        and b at 1, so k = 2 gives [c, b]."""
        out: list[int] = []
        for n in range(min(self.max_n, len(tail)), self.min_n - 1, -1):
            entry = self._maps[n].get(tuple(tail[len(tail) - n :]))
            if entry is None:
                continue
            for tok, _ in sorted(entry.followers.items(), key=lambda kv: -kv[1][1]):
                if tok not in out:
                    out.append(tok)
                    if len(out) == k:
                        return out
        return out


QOf = Callable[[Optional[Continuations], int], DraftDist]


def sample_lookup_block(index: ContinuationIndex, limit: int, q_of: QOf, rng: np.random.Generator
                        ) -> tuple[list[int], list[DraftDist], int]:
    """(tokens, the q each was drawn from, n of the first match) for the history in `index`.

    The block is empty unless the history's tail matches; its length is min(limit, tokens after
    the most recent occurrence of that match), fixed before anything is drawn. Position i takes
    q_of(what followed the longest match of its context, -1), or q_of(None, the position aligned
    with the first match) when the context matches nowhere, and draws its token from that q
    with `rng` (a point mass: its token, no draw)."""
    toks = index.tokens
    tail = toks[max(0, len(toks) - index.max_n) :]
    n_first, first = index.match(tail)
    if first is None or limit <= 0:
        return [], [], 0
    length = min(limit, len(toks) - first.recent)
    tokens: list[int] = []
    dists: list[DraftDist] = []
    for i in range(length):
        match = first if i == 0 else index.match(tail)[1]
        q = q_of(match, -1) if match is not None else q_of(None, first.recent + i)
        tok = int(q.token_ids[0]) if q.is_point else int(q.token_ids[sample_from(q.probs, rng)])
        tokens.append(tok)
        dists.append(q)
        tail = (tail + [tok])[-index.max_n :]
    return tokens, dists, n_first


class SampledLookupState(DrafterBase):
    """What both drafters keep: their configuration, the request's sampling options, their random
    stream and the index over the history (`sync` brings it up to date).

    `seed` seeds the random stream until a request brings a seed of its own, from which `begin`
    derives the stream (seed, 1), independent of the verifier's."""

    SOURCE = ""

    def __init__(self, ngram_size: int = 3, max_draft_len: int = 8, min_ngram_size: int = 1, *,
                 seed: int | None = None) -> None:
        check_lookup_sizes(ngram_size, min_ngram_size, max_draft_len)
        check_int("seed", seed, minimum=0, allow_none=True)
        self.ngram_size = ngram_size
        self.min_ngram_size = min_ngram_size
        self.max_draft_len = max_draft_len
        self.temperature = 1.0  # the request's sampling options (from begin)
        self.top_k: int | None = None
        self.top_p: float | None = None
        self.rng = np.random.default_rng(seed)
        self.index = ContinuationIndex(min_ngram_size, ngram_size)
        self._follower = HistoryFollower()

    def begin(self, options: "SpeculativeOptions", draft_length: DraftLengthPolicy | None = None) -> None:
        """A new request: forget the previous history, follow its sampling options and seed."""
        self.temperature, self.top_k, self.top_p = options.temperature, options.top_k, options.top_p
        if options.seed is not None:
            self.rng = np.random.default_rng([options.seed, 1])
        self.reset()

    def reset(self) -> None:
        self.index = self._fresh_index()
        self._follower = HistoryFollower()

    def _fresh_index(self) -> "ContinuationIndex":
        return ContinuationIndex(self.min_ngram_size, self.ngram_size)

    def sync(self, history: Sequence[int]) -> None:
        """Bring the index up to `history` (`HistoryFollower.sync`)."""
        self.index = self._follower.sync(self.index, history, self._fresh_index)

    def block(self, history: Sequence[int], max_tokens: int, q_of: QOf) -> DraftBlock:
        """Sync, then `sample_lookup_block` with `q_of`, as a DraftBlock of this drafter's
        source, keyed by the first match's length."""
        self.sync(history)
        tokens, dists, n = sample_lookup_block(self.index, min(self.max_draft_len, max_tokens), q_of, self.rng)
        if not tokens:
            return DraftBlock.empty()
        prior = PRIOR_BY_MATCH_LEN[min(n, max(PRIOR_BY_MATCH_LEN))]
        return DraftBlock(tuple(tokens), tuple(dists), source=self.SOURCE, match_len=n, prior=prior)
