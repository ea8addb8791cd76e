"""Drafting with a model: any `Decoder` (an ONNX draft export, or the NumPy reference).

Example: target T, draft D, history [a b c], max_draft_len 3, draft temperature 1. D's cache
already holds [a b]; it feeds [c], samples d1 from q1 = warp(D's logits), feeds d1, samples d2
from q2, feeds d2, samples d3 from q3: the block is (d1, d2, d3) with dists (q1, q2, q3) exactly
as sampled. If the verifier accepts d1 and then recovers r, the next call truncates D's cache to
[a b c d1] and feeds [r] before drafting again.

q must be the distribution each token was actually drawn from, or the verification is no longer
lossless; at draft temperature 0 the token is the argmax and q is its point mass. With top-k /
top-p the support is the truncated one that was sampled from.

`context` bounds what the draft reads. A draft prefills the prompt as the target does, and an
int4 draft's prefill is no cheaper than the fp32 target's (MatMulNBits quantises the activations
of every prompt row), so on a long prompt it can cost more than the drafts save. With
`context=W` the draft is fed only the last W tokens of the history it first sees, then every
token after them; when its cache would overflow it starts again from the last W. What the draft
reads changes only how good its proposals are: each token is still verified against the q it
was drawn from, so the output distribution is the target's whatever W is. Example, W = 2,
history [a b c d]: the draft's cache holds [c d] (positions 0, 1 of its own), the block is
drafted from there; the next call feeds the tokens emitted since.

A draft decoder that runs on its target's KV buffers (`OrtDecoder.sharing_kv`, what `Model`
makes for a self-speculative draft of the same architecture) needs neither: each block starts
from the target's own cache (`follow_owner`, which holds the history but its last token), feeds
that last token and drafts on. No prompt is prefilled twice and nothing accepted is fed again.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..errors import DrafterError, InvalidOptionError
from ..decoding.history import TokenHistory
from ..ort.decoder import OrtDecoder
from ..decoding.protocols import Decoder, DraftLengthPolicy, DrafterBase, as_decoder
from ..decoding.sampling import DraftBlock, DraftDist, check_sampling_options, draw_draft
from ..validation import check_int

if TYPE_CHECKING:
    from ..decoding.options import SpeculativeOptions

SOURCE = "draft_model"  # DraftBlock.source of these drafts
KEY = (SOURCE, 0)  # the draft-length policy's key of these drafts
DEFAULT_DRAFT_CONTEXT: int | None = None  # Model.make_drafter's context for its draft model


def check_draft_context(context: object, *, capacity: int, follows: bool, name: str = "context") -> None:
    """InvalidOptionError unless `context` suits a draft model of `capacity` tokens: None, or an
    integer 1 <= context < capacity for a draft with KV buffers of its own; a draft on its
    target's buffers (`follows`) reads the whole history, so None only."""
    check_int(name, context, minimum=1, allow_none=True)
    if context is None:
        return
    if follows:
        raise InvalidOptionError(f"{name} applies to a draft with KV buffers of its own; this draft "
                                 f"runs on its target's and reads the whole history")
    if context >= capacity:  # type: ignore[operator]
        raise InvalidOptionError(
            f"{name} ({context}) must be below the draft model's capacity ({capacity} tokens), "
            f"or None to feed the draft the whole history")


class DraftModelDrafter(DrafterBase):
    """Autoregressive drafts from `decoder`, its KV cache kept in step with the history.

    `temperature=None` (and top_k / top_p None) follow the request's own sampling options, which
    maximises the chance that q matches the target; set them to fix the draft's sampling.
    `target`, if given, is checked for the same vocabulary at construction. `prior` is the
    chance a drafted token is accepted before anything is learned (e.g. the top-1 agreement the
    export measured between draft and target); the draft-length policy starts from it.
    `context`: the most history tokens the draft is first fed (None: all; see the module
    docstring). `decoder` needs only the seven members of `Decoder` (`as_decoder`).
    `fed_tokens` counts the tokens fed to the draft model (prefill included). A
    decoder sharing its target's KV buffers drafts from the target's cache (module docstring).
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
        context: int | None = None,
    ) -> None:
        decoder = as_decoder(decoder, role="draft decoder")  # DecoderBase's defaults if needed
        check_int("max_draft_len", max_draft_len, minimum=0)
        # a draft on its target's KV buffers drafts from the target's cache: nothing to sync
        self._follows = isinstance(decoder, OrtDecoder) and decoder.kv_owner is not None
        check_draft_context(context, capacity=decoder.capacity, follows=self._follows)
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
        self.context = context
        self._start = 0  # the history position of the draft cache's first token
        self._fed: list[int] = []  # exactly the tokens in the draft decoder's cache: history[_start:]
        self._confirmed = 0  # history length at the previous call
        self._source: Sequence[int] | None = None  # the history object seen then
        self._source_edits = -1
        self._policy: DraftLengthPolicy | None = None
        self.prior = prior
        self.steps = 0  # draft forward calls
        self.fed_tokens = 0  # tokens fed to the draft model, prompts included
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
        self._start = 0
        self._confirmed = 0
        self._policy = draft_length
        self.decoder.reset()

    def _sync(self, history: Sequence[int], k: int) -> np.ndarray:  # -> [vocab] logits after history
        """Truncate the draft cache to its common prefix with `history[_start:]`, feed the rest
        (room is left for `k` - 1 drafts). A fresh start, or one past the cache's capacity,
        begins at the last `context` tokens."""
        fed, start = self._fed, self._start
        n = min(len(fed), len(history) - 1 - start)  # the last history token is always fed again
        if self.decoder.length != len(fed) or n < 0:  # the cache was touched elsewhere
            n = 0
        # an unedited TokenHistory (what the decode loops pass) keeps the previous call's prefix:
        # compare from there, O(new tokens); any other history is compared from the start
        unedited = (history is self._source and isinstance(history, TokenHistory)
                    and history.edits == self._source_edits)
        common = max(0, min(self._confirmed - start, n)) if unedited else 0
        while common < n and fed[common] == history[start + common]:
            common += 1
        if common == 0 or len(history) - start + k - 1 > self.decoder.capacity:
            start = self._start = self._window_start(len(history))
            common = 0
        if common:
            self.decoder.truncate(common)
        else:
            self.decoder.reset()
        del fed[common:]
        new = [int(t) for t in history[start + common:]]
        # the tokens it has not read yet: only the last one's logits are drafted from
        logits = self.decoder.prefill(new) if len(new) > 1 else self.decoder.forward_token(new[0])
        self.steps += 1
        self.fed_tokens += len(new)
        fed.extend(new)
        self._confirmed = len(history)
        self._source, self._source_edits = history, history.edits if isinstance(history, TokenHistory) else -1
        return logits

    def _follow(self, history: Sequence[int]) -> np.ndarray:  # -> [vocab] logits after history
        """Start from the target's cache, which must hold the history but its last token (the
        decode loop's state when it asks for a draft), and feed that token."""
        n = self.decoder.follow_owner()
        if n != len(history) - 1:
            raise DrafterError(
                f"this draft runs on the KV buffers of a target whose cache holds {n} tokens, but "
                f"the history has {len(history)}: a drafter on a target's buffers serves that "
                f"target's decode (Model.generate and stream make one per request; pass the "
                f"drafter's name or a DrafterSpec)")
        logits = self.decoder.forward_token(int(history[-1]))
        self.steps += 1
        self.fed_tokens += 1
        return logits

    def _window_start(self, n: int) -> int:
        """Where the draft's cache starts for a history of n tokens, fed afresh."""
        return 0 if self.context is None else max(0, n - self.context)

    def rate(self, policy: DraftLengthPolicy, history: Sequence[int], max_tokens: int) -> float:
        """What `policy` expects this drafter's next block to emit per second (drafting paid)."""
        k = min(self.max_draft_len, max_tokens)
        return policy.rate(k, key=KEY, prior=self.prior, paid=True) if k > 0 and history else 0.0

    def propose(self, history: Sequence[int], max_tokens: int) -> DraftBlock:
        # the cache will hold the history (from its window's start) and all drafts but the last
        room = self.decoder.capacity - (len(history) - self._window_start(len(history))) + 1
        k = min(self.max_draft_len, max_tokens, room)
        if self._policy is not None and k > 0:
            k = max(0, min(k, int(self._policy.limit(k, key=KEY, prior=self.prior))))
        if k <= 0 or not history:
            return DraftBlock.empty()
        t0 = time.perf_counter()
        logits = self._follow(history) if self._follows else self._sync(history, k)
        tokens: list[int] = []
        dists: list[DraftDist] = []
        for i in range(k):
            tok, dist = draw_draft(logits, self._rng, temperature=self.temperature,
                                   top_k=self.top_k, top_p=self.top_p)
            tokens.append(tok)
            dists.append(dist)
            if i + 1 < k:
                logits = self.decoder.forward_token(tok)
                self.steps += 1
                self.fed_tokens += 1
                if not self._follows:
                    self._fed.append(tok)
        self.seconds += time.perf_counter() - t0
        return DraftBlock(tuple(tokens), tuple(dists), source=SOURCE, prior=self.prior)
