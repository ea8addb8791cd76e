"""Drafting with a model: any `Decoder` (an ONNX draft export, or the NumPy reference).

Example: target T, draft D, history [a b c], max_draft_len 3, draft temperature 1. D's cache
already holds [a b]; it feeds [c], samples d1 from q1 = warp(D's logits), feeds d1, samples d2
from q2, feeds d2, samples d3 from q3: the block is (d1, d2, d3) with dists (q1, q2, q3) exactly
as sampled. If the verifier accepts d1 and then recovers r, the next call truncates D's cache to
[a b c d1] and feeds [r] before drafting again.

q must be the distribution each token was actually drawn from, or the verification is no longer
lossless; at draft temperature 0 the token is the argmax and q is its point mass. With top-k /
top-p the support is the truncated one that was sampled from.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..errors import InvalidOptionError
from ..history import TokenHistory
from ..protocols import Decoder, DraftLengthPolicy, DrafterBase
from ..sampling import DraftBlock, DraftDist, check_sampling_options, sample_from, warp
from ..validation import check_int

if TYPE_CHECKING:
    from ..decode import SpeculativeOptions

SOURCE = "draft_model"  # DraftBlock.source of these drafts


class DraftModelDrafter(DrafterBase):
    """Autoregressive drafts from `decoder`, its KV cache kept in step with the history.

    `temperature=None` (and top_k / top_p None) follow the request's own sampling options, which
    maximises the chance that q matches the target; set them to fix the draft's sampling.
    `target`, if given, is checked for the same vocabulary at construction. `prior` is the
    chance a drafted token is accepted before anything is learned (e.g. the top-1 agreement the
    export measured between draft and target); the draft-length policy starts from it.
    """

    def __init__(
        self,
        decoder: Decoder,
        *,
        max_draft_len: int = 4,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        target: Decoder | None = None,
        seed: int | None = None,
        prior: float | None = None,
    ) -> None:
        check_int("max_draft_len", max_draft_len, minimum=0)
        check_sampling_options(0.0 if temperature is None else temperature, top_k, top_p)
        if target is not None and target.vocab_size != decoder.vocab_size:
            raise InvalidOptionError(
                f"the draft model's vocabulary ({decoder.vocab_size} tokens) differs from the "
                f"target's ({target.vocab_size}); draft and target must share a tokenizer"
            )
        self.decoder = decoder
        self.max_draft_len = max_draft_len
        self._fixed = (temperature, top_k, top_p)
        self.temperature, self.top_k, self.top_p = (0.0 if temperature is None else temperature), top_k, top_p
        self._rng = np.random.default_rng(seed)
        self._fed: list[int] = []  # exactly the tokens in the draft decoder's cache
        self._confirmed = 0  # history length at the previous call
        self._source: Sequence[int] | None = None  # the history object seen then
        self._source_edits = -1
        self._policy: DraftLengthPolicy | None = None
        self.prior = prior
        self.steps = 0  # draft forward calls
        self.seconds = 0.0  # time in the draft model

    def begin(self, options: "SpeculativeOptions", draft_length: DraftLengthPolicy | None) -> None:
        """Called by the decode loop at the start of a request: adopt its sampling options where
        none were fixed, reseed from its seed, start from an empty cache, and ask `draft_length`
        (its `limit`) how many tokens are worth drafting, since each costs a draft step."""
        t, k, p = self._fixed
        self.temperature = options.temperature if t is None else t
        self.top_k = options.top_k if k is None and t is None else k
        self.top_p = options.top_p if p is None and t is None else p
        if options.seed is not None:
            # a stream independent of the verifier's: the draft seed is (seed, 1)
            self._rng = np.random.default_rng([options.seed, 1])
        self._fed = []
        self._confirmed = 0
        self._policy = draft_length
        self.decoder.reset()

    def _sync(self, history: Sequence[int]) -> np.ndarray:  # -> [vocab] logits after history
        """Truncate the draft cache to its common prefix with `history`, feed the rest."""
        fed = self._fed
        n = min(len(fed), len(history) - 1)  # the last history token is always fed again
        if self.decoder.length != len(fed):  # the cache was touched elsewhere: start over
            n = 0
        # an unedited TokenHistory (what the decode loops pass) keeps the previous call's prefix:
        # compare from there, O(new tokens); any other history is compared from the start
        unedited = (history is self._source and isinstance(history, TokenHistory)
                    and history.edits == self._source_edits)
        common = min(self._confirmed, n) if unedited else 0
        while common < n and fed[common] == history[common]:
            common += 1
        if common:
            self.decoder.truncate(common)
        else:
            self.decoder.reset()
        del fed[common:]
        new = [int(t) for t in history[common:]]
        logits = self.decoder.forward_batch(new)[-1] if len(new) > 1 else self.decoder.forward_token(new[0])
        self.steps += 1
        fed.extend(new)
        self._confirmed = len(history)
        self._source, self._source_edits = history, history.edits if isinstance(history, TokenHistory) else -1
        return logits

    def propose(self, history: Sequence[int], max_tokens: int) -> DraftBlock:
        # the cache will hold the history and all drafts but the last
        k = min(self.max_draft_len, max_tokens, self.decoder.capacity - len(history) + 1)
        if self._policy is not None and k > 0:
            k = max(0, min(k, int(self._policy.limit(k, key=(SOURCE, 0), prior=self.prior))))
        if k <= 0 or not history:
            return DraftBlock.empty()
        t0 = time.perf_counter()
        logits = self._sync(history)
        tokens: list[int] = []
        dists: list[DraftDist] = []
        for i in range(k):
            if self.temperature == 0:
                tok = int(np.argmax(logits))
                dist = DraftDist.point(tok)
            else:
                q = warp(logits, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)
                tok = sample_from(q, self._rng)
                dist = DraftDist.from_warped(q)
            tokens.append(tok)
            dists.append(dist)
            if i + 1 < k:
                logits = self.decoder.forward_token(tok)
                self.steps += 1
                self._fed.append(tok)
        self.seconds += time.perf_counter() - t0
        return DraftBlock(tuple(tokens), tuple(dists), source=SOURCE, prior=self.prior)
