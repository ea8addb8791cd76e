"""n-gram continuation counts: draft by sampling from what followed earlier occurrences of the context.

Example (ngram_size 2), history as words, positions 0..9:

    the cat sat . the cat ran . the cat        <- tail "the cat" (n = 2)

"the cat" was followed by "sat" once and "ran" once: q1 = {sat: 1/2, ran: 1/2}. Draw x1 from
q1, say "sat"; the context now ends "cat sat", followed once by ".": q2 = {.: 1}; then
"sat ." -> q3 = {the: 1}, ". the" -> q4 = {cat: 1} (it followed twice). The block has 4
tokens, the length prompt lookup would draft ("ran . the cat" follows the most recent "the
cat"), fixed before anything is drawn; every position re-matches its own context, the
history and the tokens drafted before it, and takes the longest n-gram of it that occurred.

A prompt-lookup draft is a point mass, accepted with probability p(x) at a temperature above 0;
this q spreads over every continuation seen, accepted with probability sum_x min(p(x), q(x)).
Each token is drawn from exactly the q the block reports, with the request's own random stream.
At temperature 0 the draft is the most frequent continuation (ties: the one that followed most
recently), a point mass. Where nothing matches the context, the position takes the token aligned
with the first match, a point mass.
"""

from __future__ import annotations

from typing import Sequence

from ..decoding.sampling import DraftBlock, DraftDist
from .continuations import Continuations, SampledLookupState

SOURCE = "ngram_counts"  # DraftBlock.source of these drafts


def counts_q(match: Continuations | None, position: int, tokens: Sequence[int], *, greedy: bool) -> DraftDist:
    """The q of one drafted position: the empirical distribution of what followed the matched
    n-gram (at temperature 0 the point mass on its most frequent follower), or without a match
    the point mass on the token at the aligned `position`."""
    if match is None:
        return DraftDist.point(tokens[position])
    return DraftDist.point(match.mode()) if greedy else match.distribution()


class NgramCountsDrafter(SampledLookupState):
    """Drafter: up to `max_draft_len` tokens, each sampled from the continuation counts of the
    longest n-gram (`ngram_size` down to `min_ngram_size` tokens) ending its context."""

    SOURCE = SOURCE

    def propose(self, history: Sequence[int], max_tokens: int) -> DraftBlock:
        greedy = self.temperature == 0
        return self.block(history, max_tokens,
                          lambda match, position: counts_q(match, position, self.index.tokens, greedy=greedy))
