"""Choosing how many drafted tokens to verify, from a measured cost curve and learned acceptance.

A verify call of n tokens costs c(n) (on a CPU, c(8) is about 1.5x c(1), not 1x), and a block of
k drafts yields E(k) = 1 + sum_{i=1..k} prod_{j<=i} a_j tokens, a_j being the chance that draft j
is accepted given that the ones before it were. Per verify, the policy picks

    k* = argmax_k  E(k) / (c(k + 1) + k * c_draft)

over k = 0 .. len(block); k = 0 is a plain single-token step. The choice depends only on what
happened before this verify (the history, the draft, earlier outcomes and call times), never on
the random draws that verify makes, so every emitted token still has the target's conditional
distribution: the losslessness tests hold with the policy on.

The a_j are learned online per drafter (`DraftBlock.source`) and, for prompt lookup, per match
length (a 3-gram match is accepted far more often than a 1-gram one), starting from the prior
the drafter states (`DraftBlock.prior`),
apart for greedy and sampled requests, and both across requests and within the current one
(`AcceptanceModel`). A draft that was not verified still counts: the plain step's target row
gives the exact chance it would have been accepted.

The cost curve is calibrated once per model, provider and machine at a context of 256 tokens on
an idle model; in use, a verify costs more or less than that relative to a step (longer
contexts, other work on the machine, sampling k + 1 rows at a temperature above 0). The policy
therefore also times every target call (model call plus verification) and learns one factor
by which the curve's extra cost of a block over a step is off: see `CostCorrection`.

One loaded model serves many requests: `for_request()` gives each its own policy object (its
within-request counts and exploration state) over the one set of cross-request estimates and
cost correction, which are guarded by locks. Measuring the curve is `calibration.py`'s job.
"""


from __future__ import annotations

import collections
import threading
from typing import Iterator, Protocol

import numpy as np

from .calibration import CostCurve
from ..decoding.sampling import DraftBlock

# -- acceptance ---------------------------------------------------------------------------------

DEFAULT_PRIOR = 0.6  # mean acceptance per draft position for a key whose drafter states none
PRIOR_WEIGHT = 3.0  # pseudo-observations behind each prior
DECAY = 0.98  # per observation of a key: about the last 50 count


class AcceptanceModel:
    """Per (drafter, match length) and draft position j: P(draft j accepted | 1..j-1 accepted).

    Two levels of counts per key, both kept apart for greedy and for sampled requests (a
    point-mass draft is accepted iff it is the argmax at temperature 0, with probability p(x)
    above it: the same drafts fare very differently):
    - across requests, over a prior (`prior`, PRIOR_WEIGHT): shared by every `for_request()`
      view of this model and guarded by its lock;
    - within the current request (from `begin_request`), over the cross-request estimate as its
      prior with REQUEST_PRIOR_WEIGHT, so a request whose drafts fare unlike the last ones (a rag
      answer after a translation) is recognised after a few drafts: owned by one view.
    Both decay per observation of the key (DECAY), so recent behaviour counts most.

    The prior of a key is the one its drafter stated on the first block seen of it
    (`DraftBlock.prior`: prompt lookup's by match length, a draft model's from the top-1
    agreement its export measured), else DEFAULT_PRIOR."""

    REQUEST_PRIOR_WEIGHT = 4.0

    def __init__(self, max_len: int = 64, *, shared: "AcceptanceModel | None" = None) -> None:
        self.max_len = max_len
        self.sampled = False  # the current request samples (temperature > 0)
        if shared is None:
            self._lock = threading.Lock()
            self._global: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}  # key -> (tries, hits)
            self._priors: dict[tuple[str, int], float] = {}
        else:
            self._lock, self._global, self._priors = shared._lock, shared._global, shared._priors
        self._request: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

    def for_request(self) -> "AcceptanceModel":
        """A view for one request: these cross-request counts, within-request counts of its own."""
        return AcceptanceModel(self.max_len, shared=self)

    @staticmethod
    def key(block: DraftBlock) -> tuple[str, int]:
        return (block.source or "draft", block.match_len)

    def learn_prior(self, key: tuple[str, int], prior: float | None) -> None:
        if prior is not None and key not in self._priors:
            with self._lock:
                self._priors.setdefault(key, min(0.99, max(0.01, float(prior))))

    def prior(self, key: tuple[str, int]) -> float:
        return self._priors.get(key, DEFAULT_PRIOR)

    def begin_request(self, *, sampled: bool) -> None:
        self.sampled = sampled
        self._request.clear()

    def _arrays(self, table: dict, key: tuple[str, int]) -> tuple[np.ndarray, np.ndarray]:
        full = (*key, self.sampled)
        if full not in table:
            table[full] = (np.zeros(self.max_len), np.zeros(self.max_len))
        return table[full]

    def estimates(self, key: tuple[str, int], k: int) -> np.ndarray:  # [k]
        with self._lock:
            tries, hits = self._arrays(self._global, key)
            across = (hits[:k] + self.prior(key) * PRIOR_WEIGHT) / (tries[:k] + PRIOR_WEIGHT)
        r_tries, r_hits = self._arrays(self._request, key)
        w = self.REQUEST_PRIOR_WEIGHT
        return (r_hits[:k] + across * w) / (r_tries[:k] + w)

    def _decayed(self, key: tuple[str, int]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Both levels' (tries, hits) for `key`, aged by one observation, to be added to; the
        caller holds the lock."""
        for table in (self._global, self._request):
            tries, hits = self._arrays(table, key)
            tries *= DECAY
            hits *= DECAY
            yield tries, hits

    def update(self, key: tuple[str, int], n_verified: int, n_accepted: int) -> None:
        seen = min(n_accepted + 1, n_verified)  # positions actually tested
        with self._lock:
            for tries, hits in self._decayed(key):
                tries[:seen] += 1
                hits[:n_accepted] += 1

    def update_unverified(self, key: tuple[str, int], would_accept: float) -> None:
        """A draft that was not verified (k = 0 chosen) still teaches something: the chance it
        would have been accepted, sum_x min(p_target(x), p_draft(x)) for the target row the plain
        step used (p_target of the drafted token for a point mass; 0 or 1 at temperature 0), or
        a 0/1 outcome of it. Without this, a pessimistic estimate would never be revisited."""
        with self._lock:
            for tries, hits in self._decayed(key):
                tries[0] += 1
                hits[0] += float(would_accept)


def expected_tokens(a: np.ndarray) -> np.ndarray:  # a: [K] -> [K + 1], E(k) for k = 0..K
    return np.concatenate([[1.0], 1.0 + np.cumsum(np.cumprod(a))])


EXPLORE_EVERY = 16  # a model drafter judged not worth it still drafts 1 token this often
# with other rows decoding (`CallCosts.margin` > 0), a block judged not worth verifying makes the
# request skip the drafter for 1, then 2, 4, ... up to this many steps (a block chosen resets
# it): under load most blocks are declined, and asking for them costs each row Python time in
# every shared call, which the call's other rows wait for
SKIP_MAX = 8


class CostCorrection:
    """How far the calibrated curve is off in use, learned from timed calls.

    The curve says a block of n costs rel(n) = c(n) / c(1) steps. A call of n > 1 tokens that
    took t seconds, against a recent single step's time t1 (an average of recent steps, so the
    machine's drift cancels), shows an excess of t / t1 - 1 steps where the curve said
    rel(n) - 1. One factor s scales every predicted excess:

        c'(n) = c(1) * (1 + s * (rel(n) - 1))

    s is the ratio of observed to predicted excess summed over recent calls (decaying weights),
    with PRIOR_WEIGHT pseudo-calls at s = 1, each call's ratio clipped to [0, MAX_RATIO] so one
    call interrupted by the scheduler cannot swing it. Until a step has been timed there is
    nothing to compare with, and s stays 1.
    """

    PRIOR_WEIGHT = 8.0
    DECAY = 0.97  # per timed block: about the last 30 verifies count
    STEP_ALPHA = 0.2  # weight of the newest step in the running step time
    MAX_RATIO = 4.0

    def __init__(self, curve: CostCurve) -> None:
        self.curve = curve
        self.step_seconds: float | None = None  # running average of single-step calls
        self._observed = 0.0  # decayed sum of observed excess ratios (weights 1 each)
        self._weight = 0.0  # decayed count of timed blocks
        self._lock = threading.Lock()  # one correction serves every request of a model
        # n_max -> (c(1), c(n) / c(1) - 1 for n = 1..n_max); setdefault keeps it thread-safe
        self._relative: dict[int, tuple[float, np.ndarray]] = {}

    @property
    def factor(self) -> float:
        with self._lock:
            return (self.PRIOR_WEIGHT + self._observed) / (self.PRIOR_WEIGHT + self._weight)

    def observe(self, n_tokens: int, seconds: float) -> None:
        if not (seconds > 0 and n_tokens >= 1):
            return
        with self._lock:
            self._observe(n_tokens, seconds)

    def _observe(self, n_tokens: int, seconds: float) -> None:
        if n_tokens == 1:
            prev = self.step_seconds
            self.step_seconds = seconds if prev is None else prev + self.STEP_ALPHA * (seconds - prev)
            return
        if self.step_seconds is None:
            return
        predicted = self.curve.cost(n_tokens) / self.curve.cost(1) - 1.0
        if predicted <= 0:
            return
        ratio = min(self.MAX_RATIO, max(0.0, (seconds / self.step_seconds - 1.0) / predicted))
        self._observed = self._observed * self.DECAY + ratio
        self._weight = self._weight * self.DECAY + 1.0

    def costs(self, n_max: int) -> np.ndarray:  # [n_max]: c'(1) .. c'(n_max)
        rel = self._relative.get(n_max)
        if rel is None:  # the curve is immutable: its relative costs are made once per length
            raw = np.array([self.curve.cost(n) for n in range(1, n_max + 1)])
            excess = raw / raw[0] - 1.0
            excess.setflags(write=False)
            rel = self._relative.setdefault(n_max, (float(raw[0]), excess))
        step, excess = rel
        return step * (1.0 + self.factor * excess)

    def cost(self, n: int) -> float:
        return float(self.costs(n)[-1])

    def draft_step(self, solo: float) -> float:
        """A decoder of its own drafts on a draft of its own: `solo` as measured."""
        return solo

    def margin(self) -> float:
        """A request alone drafts for any expected gain: what a block costs is its own."""
        return 0.0


class CallCosts(Protocol):
    """What a policy prices a block with: c'(1) .. c'(n_max), learned from timed calls or not;
    and the margin by which a block's expected rate must beat a plain step's before it is
    drafted (0: any gain)."""

    def costs(self, n_max: int) -> np.ndarray: ...  # [n_max]

    def observe(self, n_tokens: int, seconds: float) -> None: ...

    def draft_step(self, solo: float) -> float: ...  # a draft step's seconds (solo: its own call)

    def margin(self) -> float: ...


class AdaptiveDraftLength:
    """The cost-model policy: k* = argmax E(k) / (c(k + 1) + k * c_draft), with c the call's
    cost (alone: the decoder's curve; in a batch, `BatchCosts`: the row's share). `rate`
    is that maximum, by which a composite drafter picks the drafter for a step.

    Serves one request at a time (the decode loop claims it); `for_request()` makes another
    over the same cross-request estimates, cost correction and report of recent choices."""

    def __init__(self, curve: CostCurve, *, draft_step_seconds: float = 0.0,
                 paid_steps: dict[str, float] | None = None,
                 acceptance: AcceptanceModel | None = None, learn_costs: bool = True,
                 correction: CallCosts | None = None,
                 chosen: "collections.deque[int] | None" = None) -> None:
        self.curve = curve
        self.draft_step_seconds = draft_step_seconds  # a draft model's drafted token
        # the seconds a drafted token of other paid drafters costs, by their blocks' source
        # (e.g. "eagle3", a head step); shared by every view of this policy
        self.paid_steps: dict[str, float] = {} if paid_steps is None else paid_steps
        self.acceptance = acceptance or AcceptanceModel()
        self.correction = correction or CostCorrection(curve)
        self.learn_costs = learn_costs  # False: the curve as calibrated, no timed calls
        self._skipped = 0  # consecutive steps limit() ruled out drafting
        self._skip = 0  # plain steps left before the drafter is asked again
        self._backoff = 0  # the last skip (doubled after each block declined under load)
        # recent k, for reports (deque appends are atomic, so views may share it)
        self.chosen: collections.deque[int] = chosen if chosen is not None else collections.deque(maxlen=4096)

    def for_request(self) -> "AdaptiveDraftLength":
        """A policy for one more request: its own within-request state, this one's shared
        estimates, correction and report."""
        return AdaptiveDraftLength(
            self.curve, draft_step_seconds=self.draft_step_seconds, paid_steps=self.paid_steps,
            acceptance=self.acceptance.for_request(), learn_costs=self.learn_costs,
            correction=self.correction, chosen=self.chosen)

    def for_batch_row(self, costs: CallCosts) -> "AdaptiveDraftLength":
        """A policy for one request on a batched model: this one's shared acceptance estimates
        and report, the batch's costs."""
        return AdaptiveDraftLength(
            self.curve, draft_step_seconds=self.draft_step_seconds, paid_steps=self.paid_steps,
            acceptance=self.acceptance.for_request(), learn_costs=False, correction=costs,
            chosen=self.chosen)

    def _solo_step(self, key: tuple[str, int]) -> float:
        """Seconds a drafted token with `key` costs its drafter: `paid_steps` of its source, else
        the draft model's step as measured against the target's."""
        return self.paid_steps.get(key[0], self.draft_step_seconds)

    def _draft_step(self, key: tuple[str, int]) -> float:
        """`_solo_step`, or, in a batch whose draft batches too, its call at the current rows."""
        return self.correction.draft_step(self._solo_step(key))

    def _best(self, a: np.ndarray, per_draft: float) -> int:
        return self._best_rate(a, per_draft)[0]

    def _best_rate(self, a: np.ndarray, per_draft: float) -> tuple[int, float]:
        """(k, tokens per second) of the best block: the first k = 0..K maximising
        E(k) / (c'(k + 1) + k * per_draft), E as `expected_tokens`, where a block (k >= 1)
        must beat the plain step's rate by the costs' `margin` to be chosen. In plain floats: a
        block has at most a few dozen drafts, and at that size each NumPy call costs more than
        the arithmetic, on a path every row of a batch runs once a step."""
        costs = self.correction.costs(a.size + 1).tolist()  # c'(1) .. c'(K + 1)
        plain = 1.0 / costs[0]
        best_k, best = 0, plain * (1.0 + self.correction.margin())  # the bar a block must pass
        run, tokens = 1.0, 0.0  # prod a_1..a_k; sum of those products (as `expected_tokens`)
        for k, (a_k, c_k) in enumerate(zip(a.tolist(), costs[1:]), 1):
            run *= a_k
            tokens += run
            rate = (1.0 + tokens) / (c_k + per_draft * k)
            if rate > best:
                best_k, best = k, rate
        return best_k, best if best_k else plain

    def rate(self, k_max: int, *, key: tuple[str, int], prior: float | None, paid: bool) -> float:
        """The tokens per second expected of the best block of at most `k_max` drafts with
        `key` (k = 0, a plain step, included); `paid`: each drafted token first costs a draft
        step. What a composite drafter compares its drafters by, before either drafts."""
        self.acceptance.learn_prior(key, prior)
        a = self.acceptance.estimates(key, k_max)
        return self._best_rate(a, self._draft_step(key) if paid else 0.0)[1]

    def limit(self, k_max: int, *, key: tuple[str, int], prior: float | None) -> int:
        """How many tokens a model drafter should draft (it pays `_solo_step(key)` each);
        `key` and `prior` are those its blocks will carry."""
        if self._solo_step(key) <= 0:
            return k_max
        self.acceptance.learn_prior(key, prior)
        a = self.acceptance.estimates(key, k_max)
        k = self._best(a, self._draft_step(key))
        if k == 0:  # keep learning: without drafts the estimate could never recover
            self._skipped += 1
            if self._skipped % EXPLORE_EVERY == 0:
                return 1
        else:
            self._skipped = 0
        return k

    def choose(self, block: DraftBlock) -> int:
        key = AcceptanceModel.key(block)
        self.acceptance.learn_prior(key, block.prior)
        a = self.acceptance.estimates(key, len(block))
        k = self._best(a, 0.0)  # the drafting is already paid for
        self.chosen.append(k)
        if k == 0 and self.correction.margin() > 0:  # declined under load: skip a while
            self._backoff = min(SKIP_MAX, max(1, 2 * self._backoff))
            self._skip = self._backoff
        elif k > 0:
            self._backoff = 0
        return k

    def should_propose(self) -> bool:
        """Whether the decode loop asks the drafter at this step: not for the steps a block
        declined under load skips (SKIP_MAX). Depends on earlier choices only, never on a
        verify's random draws, so the output is distributed as before."""
        if self._skip > 0:
            self._skip -= 1
            return False
        return True

    def begin(self, options) -> None:
        """A request starts (called by the decode loop with its SpeculativeOptions)."""
        self.acceptance.begin_request(sampled=options.temperature > 0)
        self._skip = self._backoff = 0

    def observe_cost(self, n_tokens: int, seconds: float) -> None:
        """The wall time of one target call of `n_tokens` (model call and verification)."""
        if self.learn_costs:
            self.correction.observe(n_tokens, seconds)

    def fresh(self, *, learn_costs: bool = True) -> "AdaptiveDraftLength":
        """An independent policy with this one's cost curve and draft cost and nothing learned
        (e.g. one per method in a benchmark, so methods do not share estimates)."""
        return AdaptiveDraftLength(self.curve, draft_step_seconds=self.draft_step_seconds,
                                   paid_steps=self.paid_steps,
                                   acceptance=AcceptanceModel(self.acceptance.max_len),
                                   learn_costs=learn_costs)

    def for_seeded_request(self) -> "AdaptiveDraftLength":
        """A policy for one seeded request: `fresh`, and timing nothing, so its choices depend on
        that request alone and the same seed gives the same output (with a shared policy,
        earlier requests and the machine's speed would change the block sizes, hence which
        random draws go where)."""
        return self.fresh(learn_costs=False)

    def observe(self, proposed: DraftBlock, n_verified: int, n_accepted: int, first_token: int,
                *, first_accept_prob: float | None = None) -> None:
        """After a target call: `proposed` is the whole draft, `n_verified` of it were verified.
        With none verified, `first_accept_prob` (when the loop knows it) is the chance the first
        draft would have been accepted; otherwise whether the emitted token equals it."""
        key = AcceptanceModel.key(proposed)
        self.acceptance.learn_prior(key, proposed.prior)
        if n_verified:
            self.acceptance.update(key, n_verified, n_accepted)
        elif len(proposed):
            would = (first_accept_prob if first_accept_prob is not None
                     else float(proposed.tokens[0] == first_token))
            self.acceptance.update_unverified(key, would)
