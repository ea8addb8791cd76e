"""Drafting with a trained EAGLE-3 head (`DraftHead`) over the target's own hidden states.

The head keeps a KV cache of its own whose entries are consecutive history positions: entry j
pairs the token at position t with the target's hidden states after it processed position
t - 1 (`HiddenStateSource.last_hidden_states`, the rows of the call that computed position t's
logits). Those rows come with every target call the decode loop makes, through
`observe_target`, so feeding the head needs no target call of its own.

Example: history [.. a b], the target's last call computed the logits of a and b. `propose`
truncates the head to the entries the target has confirmed, feeds (a, h_a), (b, h_b) in one
call (`from_target`), and samples d1 from the head's last row; then feeds (d1, the head's own
hidden output) and samples d2, and so on. If the verifier accepts d1 and recovers r, the next
call drops the head's entries for the drafts and feeds (d1, h_d1), (r, h_r) from the target's
verify rows.

Each drafted position carries the exact distribution its token was drawn from: the head's
softmax over its draft vocabulary under the request's temperature, top-k and top-p (`warp`),
mapped to target ids through `target_ids`. At temperature 0 it drafts the argmax as a point
mass. Whatever the head proposes, the verifier keeps the target's distribution.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..decoding.protocols import DraftHead, DraftLengthPolicy, DrafterBase, HiddenStateSource
from ..decoding.sampling import DraftBlock, DraftDist, check_sampling_options, draw_draft
from ..errors import DrafterError
from ..validation import check_int

if TYPE_CHECKING:
    from ..decoding.options import SpeculativeOptions

SOURCE = "eagle3"  # DraftBlock.source of these drafts
KEY = (SOURCE, 0)  # the draft-length policy's key of these drafts


class Eagle3Drafter(DrafterBase):
    """Chains of up to `max_draft_len` tokens from `head`, fed by `source`'s hidden states
    (see the module docstring). `source` is the decoder the request decodes on: its
    `hidden_state_layers` must be the head's (a model exported with `--draft-head`). `prior`:
    the chance a drafted token is accepted before anything is learned. Counters: `steps`
    (head calls), `seconds` (time in the head)."""

    def __init__(self, source: HiddenStateSource, head: DraftHead, *, max_draft_len: int = 4,
                 prior: float | None = None) -> None:
        check_int("max_draft_len", max_draft_len, minimum=0)
        if source.hidden_state_layers is None:
            raise DrafterError("the eagle3 drafter needs a target that returns hidden states "
                               "(export it with `ortspec export --draft-head HEAD_DIR`)")
        self.source, self.head = source, head
        self.max_draft_len = max_draft_len
        self.prior = prior
        self.temperature, self.top_k, self.top_p = 0.0, None, None
        self._rng = np.random.default_rng()
        self._policy: DraftLengthPolicy | None = None
        self._next = -1  # the history position the head's next confirmed entry holds
        self._confirmed = 0  # head entries fed from the target's states
        self._pending: list[tuple[int, np.ndarray]] = []  # (start, [n, K * H]) not yet fed
        self.steps = 0
        self.seconds = 0.0

    def begin(self, options: "SpeculativeOptions", draft_length: DraftLengthPolicy | None) -> None:
        """Follow the request's sampling options, seed from its seed (the stream (seed, 1),
        independent of the verifier's), start from an empty head cache."""
        check_sampling_options(options.temperature, options.top_k, options.top_p)
        self.temperature, self.top_k, self.top_p = options.temperature, options.top_k, options.top_p
        self._rng = np.random.default_rng(None if options.seed is None else [options.seed, 1])
        self._policy = draft_length
        self._next, self._confirmed, self._pending = -1, 0, []
        self.head.reset()

    def observe_target(self, start: int, logits: np.ndarray) -> None:  # logits: [n, vocab]
        """Keep the target's hidden states of the rows just emitted, row i the state before
        position start + i (copied: the source's array is valid until its next call)."""
        n = logits.shape[0]
        states = self.source.last_hidden_states()  # [rows, K * H]
        if states.shape[0] < n:
            raise DrafterError(f"the target returned hidden states for {states.shape[0]} rows, "
                               f"the loop emitted {n}")
        self._pending.append((start, np.array(states[:n], dtype=np.float32)))

    def rate(self, policy: DraftLengthPolicy, history: Sequence[int], max_tokens: int) -> float:
        """What `policy` expects this drafter's next block to emit per second (drafting paid)."""
        k = min(self.max_draft_len, max_tokens)
        return policy.rate(k, key=KEY, prior=self.prior, paid=True) if k > 0 and history else 0.0

    def _sync(self, history: Sequence[int]) -> tuple[np.ndarray, np.ndarray] | None:
        """Drop the head's draft entries and feed it the newest contiguous run of pending target
        states; the head's last (logits [Vd], hidden [H]), or None when that run does not reach
        the end of the history (nothing to draft from)."""
        if not self._pending:
            return None
        start, runs = self._pending[-1][0], [self._pending[-1][1]]
        for s, states in reversed(self._pending[:-1]):
            if s + states.shape[0] != start:
                break
            start = s
            runs.insert(0, states)
        self._pending = []
        states = np.concatenate(runs)  # [m, K * H]
        m = states.shape[0]
        if start + m != len(history):
            self._next = -1
            return None
        if start == self._next and self._confirmed + m + self.max_draft_len <= self.head.capacity:
            self.head.truncate(self._confirmed)
        else:  # a gap, or a full cache: the head starts afresh here
            self.head.reset()
            self._confirmed = 0
        tokens = [int(t) for t in history[start:start + m]]
        logits, hidden = self.head.forward(tokens, states, from_target=True)
        self.steps += 1
        self._confirmed += m
        self._next = start + m
        return logits[-1], hidden[-1]

    def propose(self, history: Sequence[int], max_tokens: int) -> DraftBlock:
        t0 = time.perf_counter()
        try:
            last = self._sync(history)
            k = min(self.max_draft_len, max_tokens)
            if self._policy is not None and k > 0:
                k = max(0, min(k, int(self._policy.limit(k, key=KEY, prior=self.prior))))
            if last is None or k <= 0:
                return DraftBlock.empty()
            logits, hidden = last
            target_ids = self.head.target_ids
            tokens: list[int] = []
            dists: list[DraftDist] = []
            for i in range(k):
                tok, dist = draw_draft(logits, self._rng, temperature=self.temperature,
                                       top_k=self.top_k, top_p=self.top_p, ids=target_ids)
                tokens.append(tok)
                dists.append(dist)
                if i + 1 < k:
                    out, hid = self.head.forward([tok], np.array(hidden[None, :]),
                                                 from_target=False)
                    self.steps += 1
                    logits, hidden = out[0], hid[0]
            return DraftBlock(tuple(tokens), tuple(dists), source=SOURCE, prior=self.prior)
        finally:
            self.seconds += time.perf_counter() - t0
