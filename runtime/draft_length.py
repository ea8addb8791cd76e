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
length (a 3-gram match is accepted far more often than a 1-gram one), starting from a prior,
apart for greedy and sampled requests, and both across requests and within the current one
(`AcceptanceModel`). A draft that was not verified still counts: the plain step's target row
gives the exact chance it would have been accepted.

The cost curve is calibrated once per model, provider and machine at a context of 256 tokens on
an idle model; in use, a verify costs more or less than that relative to a step (longer
contexts, other work on the machine, sampling k + 1 rows at a temperature above 0). The policy
therefore also times every target call (model call plus verification) and learns one factor
by which the curve's extra cost of a block over a step is off: see `CostCorrection`.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import platform
import time
from pathlib import Path
from typing import Iterator, Protocol, Sequence

import numpy as np

from .sampling import DraftBlock

CALIBRATION_VERSION = 1


class DraftLengthPolicy(Protocol):
    def limit(self, k_max: int) -> int: ...  # asked by a drafter that pays per drafted token

    def choose(self, block: DraftBlock) -> int: ...  # after drafting: how many to verify

    def observe(self, proposed: DraftBlock, n_verified: int, n_accepted: int, first_token: int) -> None: ...

    # optional: `begin(options)` when a request starts; `observe_cost(n_tokens, seconds)` after
    # every target call, with its wall time; `observe(..., first_accept_prob=)` keyword


@dataclasses.dataclass(frozen=True)
class CostCurve:
    """seconds[n - 1]: the cost of one target call with n new tokens (n = 1: the step graph)."""

    seconds: tuple[float, ...]

    def cost(self, n: int) -> float:
        if n <= len(self.seconds):
            return self.seconds[n - 1]
        # beyond the measured range: extend linearly from the last two points
        s = self.seconds
        slope = s[-1] - s[-2] if len(s) > 1 else s[-1]
        return s[-1] + slope * (n - len(s))

    def relative(self) -> list[float]:
        return [x / self.seconds[0] for x in self.seconds]

    @classmethod
    def measure(cls, decoder, *, max_len: int, context: int = 256, repeats: int = 7, seed: int = 0) -> "CostCurve":
        """Time calls of 1..max_len tokens at a context of `context` tokens, interleaved so the
        machine's drift hits every length alike; median per length, made non-decreasing."""
        rng = np.random.default_rng(seed)
        context = max(1, min(context, decoder.capacity - max_len))
        prompt = rng.integers(0, decoder.vocab_size, size=context).tolist()
        decoder.reset()
        chunk = getattr(decoder, "max_verify_len", None) or 64
        for lo in range(0, context, chunk):
            decoder.forward_batch(prompt[lo : lo + chunk])
        times: list[list[float]] = [[] for _ in range(max_len)]
        block = rng.integers(0, decoder.vocab_size, size=max_len).tolist()
        for rep in range(repeats + 1):
            order = range(1, max_len + 1) if rep % 2 else range(max_len, 0, -1)
            for n in order:
                decoder.truncate(context)
                t0 = time.perf_counter()
                if n == 1:
                    decoder.forward_token(block[0])
                else:
                    decoder.forward_batch(block[:n])
                if rep:  # the first round warms up
                    times[n - 1].append(time.perf_counter() - t0)
        decoder.reset()
        med = np.maximum.accumulate([float(np.median(t)) for t in times])
        return cls(tuple(float(x) for x in med))


def step_cost_ratio(a, b, *, context: int = 128, repeats: int = 12, seed: int = 0) -> float:
    """Median over interleaved pairs of (one step of decoder a) / (one step of decoder b)."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, min(a.vocab_size, b.vocab_size), size=context).tolist()
    for d in (a, b):
        d.reset()
        chunk = getattr(d, "max_verify_len", None) or 64
        for lo in range(0, context, chunk):
            d.forward_batch(prompt[lo : lo + chunk])
    ratios = []
    for rep in range(repeats + 1):
        t = []
        for d in (a, b) if rep % 2 else (b, a):
            d.truncate(context)
            t0 = time.perf_counter()
            d.forward_token(prompt[rep % context])
            t.append(time.perf_counter() - t0)
        if rep:  # the first pair warms up
            ratios.append(t[0] / t[1] if rep % 2 else t[1] / t[0])
    a.reset()
    b.reset()
    return float(np.median(ratios))


def machine_key(providers: Sequence[str]) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    key = f"{providers[0] if providers else 'unknown'}-{cpu}-{os.cpu_count()}cpu"
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in key)


def cache_dir() -> Path:
    """$ORTSPEC_CACHE_DIR, else ~/.cache/ortspec: calibrations live here, not in the model
    directory, which a re-export replaces whole."""
    env = os.environ.get("ORTSPEC_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "ortspec"


def _model_key(decoder, model_dir: str | os.PathLike) -> str:
    manifest = getattr(decoder, "manifest", None)
    if manifest is not None:
        graph = manifest.entry_points["verify"].graph
        digest = manifest.files.get(graph, "")
        if digest:
            return f"{Path(model_dir).resolve().name}-{digest[:16]}"
    return Path(model_dir).resolve().name


def calibrated_cost_curve(decoder, model_dir: str | os.PathLike, *, refresh: bool = False) -> CostCurve:
    """The decoder's cost curve, cached per model graph, provider, machine and thread count under
    `cache_dir()/calibration/`; measured (a few seconds) when missing or on `refresh`."""
    providers = list(getattr(decoder, "providers", []) or [])
    max_len = getattr(decoder, "max_verify_len", None) or 16
    threads = getattr(decoder, "intra_op_threads", 0) or 0
    suffix = f"-{threads}threads" if threads else ""
    path = cache_dir() / "calibration" / f"{_model_key(decoder, model_dir)}-{machine_key(providers)}{suffix}.json"
    if not refresh:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            secs = data["seconds"]
            if data.get("version") == CALIBRATION_VERSION and len(secs) == max_len and all(
                isinstance(x, float) and x > 0 for x in secs
            ):
                return CostCurve(tuple(secs))
        except (OSError, ValueError, KeyError, TypeError):
            pass
    curve = CostCurve.measure(decoder, max_len=max_len)
    payload = json.dumps({"version": CALIBRATION_VERSION, "providers": providers, "model": str(model_dir),
                          "seconds": list(curve.seconds), "relative": curve.relative()}, indent=1)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(payload, encoding="utf-8")
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache only costs a re-measurement next time
    return curve


# -- acceptance ---------------------------------------------------------------------------------

# Prior mean acceptance per draft position, before anything is observed. Prompt lookup by match
# length: a longer matched n-gram predicts its continuation better.
PRIOR_LOOKUP = {1: 0.3, 2: 0.45, 3: 0.6}
PRIOR_MODEL = 0.6
PRIOR_WEIGHT = 3.0  # pseudo-observations behind each prior
DECAY = 0.98  # per observation of a key: about the last 50 count


class AcceptanceModel:
    """Per (drafter, match length) and draft position j: P(draft j accepted | 1..j-1 accepted).

    Two levels of counts per key, both kept apart for greedy and for sampled requests (a
    point-mass draft is accepted iff it is the argmax at temperature 0, with probability p(x)
    above it: the same drafts fare very differently):
    - across requests, over a prior (`prior`, PRIOR_WEIGHT);
    - within the current request (from `begin_request`), over the cross-request estimate as its
      prior with REQUEST_PRIOR_WEIGHT, so a request whose drafts fare unlike the last ones (a rag
      answer after a translation) is recognised after a few drafts.
    Both decay per observation of the key (DECAY), so recent behaviour counts most.

    `model_prior` replaces PRIOR_MODEL for draft models, e.g. with the top-1 agreement the export
    measured between draft and target (recorded in the draft's manifest)."""

    REQUEST_PRIOR_WEIGHT = 4.0

    def __init__(self, max_len: int = 64, *, model_prior: float | None = None) -> None:
        self.max_len = max_len
        self.model_prior = PRIOR_MODEL if model_prior is None else min(0.99, max(0.01, model_prior))
        self.sampled = False  # the current request samples (temperature > 0)
        self._global: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}  # key -> (tries, hits)
        self._request: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

    @staticmethod
    def key(block: DraftBlock) -> tuple[str, int]:
        if block.source == "prompt_lookup":
            return ("prompt_lookup", min(max(block.match_len, 1), 3))
        return (block.source or "draft", 0)

    def prior(self, key: tuple[str, int]) -> float:
        if key[0] == "prompt_lookup":
            return PRIOR_LOOKUP[key[1]]
        return self.model_prior

    def begin_request(self, *, sampled: bool) -> None:
        self.sampled = sampled
        self._request.clear()

    def _arrays(self, table: dict, key: tuple[str, int]) -> tuple[np.ndarray, np.ndarray]:
        full = (*key, self.sampled)
        if full not in table:
            table[full] = (np.zeros(self.max_len), np.zeros(self.max_len))
        return table[full]

    def estimates(self, key: tuple[str, int], k: int) -> np.ndarray:  # [k]
        tries, hits = self._arrays(self._global, key)
        across = (hits[:k] + self.prior(key) * PRIOR_WEIGHT) / (tries[:k] + PRIOR_WEIGHT)
        r_tries, r_hits = self._arrays(self._request, key)
        w = self.REQUEST_PRIOR_WEIGHT
        return (r_hits[:k] + across * w) / (r_tries[:k] + w)

    def _decayed(self, key: tuple[str, int]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Both levels' (tries, hits) for `key`, aged by one observation, to be added to."""
        for table in (self._global, self._request):
            tries, hits = self._arrays(table, key)
            tries *= DECAY
            hits *= DECAY
            yield tries, hits

    def update(self, key: tuple[str, int], n_verified: int, n_accepted: int) -> None:
        seen = min(n_accepted + 1, n_verified)  # positions actually tested
        for tries, hits in self._decayed(key):
            tries[:seen] += 1
            hits[:n_accepted] += 1

    def update_unverified(self, key: tuple[str, int], would_accept: float) -> None:
        """A draft that was not verified (k = 0 chosen) still teaches something: the chance it
        would have been accepted, sum_x min(p_target(x), p_draft(x)) for the target row the plain
        step used (p_target of the drafted token for a point mass; 0 or 1 at temperature 0), or
        a 0/1 outcome of it. Without this, a pessimistic estimate would never be revisited."""
        for tries, hits in self._decayed(key):
            tries[0] += 1
            hits[0] += float(would_accept)


def expected_tokens(a: np.ndarray) -> np.ndarray:  # a: [K] -> [K + 1], E(k) for k = 0..K
    return np.concatenate([[1.0], 1.0 + np.cumsum(np.cumprod(a))])


EXPLORE_EVERY = 16  # a model drafter judged not worth it still drafts 1 token this often


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

    @property
    def factor(self) -> float:
        return (self.PRIOR_WEIGHT + self._observed) / (self.PRIOR_WEIGHT + self._weight)

    def observe(self, n_tokens: int, seconds: float) -> None:
        if not (seconds > 0 and n_tokens >= 1):
            return
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
        raw = np.array([self.curve.cost(n) for n in range(1, n_max + 1)])
        return raw[0] * (1.0 + self.factor * (raw / raw[0] - 1.0))

    def cost(self, n: int) -> float:
        return float(self.costs(n)[-1])


class AdaptiveDraftLength:
    """The cost-model policy: k* = argmax E(k) / (c(k + 1) + k * c_draft)."""

    def __init__(self, curve: CostCurve, *, draft_step_seconds: float = 0.0,
                 acceptance: AcceptanceModel | None = None, learn_costs: bool = True) -> None:
        self.curve = curve
        self.draft_step_seconds = draft_step_seconds
        self.acceptance = acceptance or AcceptanceModel()
        self.correction = CostCorrection(curve)
        self.learn_costs = learn_costs  # False: the curve as calibrated, no timed calls
        self._skipped = 0  # consecutive steps limit() ruled out drafting
        self.chosen: collections.deque[int] = collections.deque(maxlen=4096)  # recent k, for reports

    @classmethod
    def for_model(cls, model, *, refresh: bool = False) -> "AdaptiveDraftLength":
        curve = calibrated_cost_curve(model.decoder, model.path, refresh=refresh)
        draft_cost = 0.0
        if getattr(model, "draft", None) is not None:
            # timings taken at different moments are not comparable on a drifting machine: the
            # draft's step is measured against the target's, interleaved, and scaled to the curve
            draft_cost = step_cost_ratio(model.draft, model.decoder) * curve.cost(1)
            agreement = model.draft.manifest.extra.get("agreement", {}).get("top1")
            prior = float(agreement) if isinstance(agreement, (int, float)) else None
            return cls(curve, draft_step_seconds=draft_cost, acceptance=AcceptanceModel(model_prior=prior))
        return cls(curve)

    def _best(self, a: np.ndarray, per_draft: float) -> int:
        e = expected_tokens(a)
        costs = self.correction.costs(a.size + 1) + per_draft * np.arange(a.size + 1)  # k = 0..K
        return int(np.argmax(e / costs))

    def limit(self, k_max: int) -> int:
        """How many tokens a model drafter should draft (it pays `draft_step_seconds` each)."""
        if self.draft_step_seconds <= 0:
            return k_max
        a = self.acceptance.estimates(("draft_model", 0), k_max)
        k = self._best(a, self.draft_step_seconds)
        if k == 0:  # keep learning: without drafts the estimate could never recover
            self._skipped += 1
            if self._skipped % EXPLORE_EVERY == 0:
                return 1
        else:
            self._skipped = 0
        return k

    def choose(self, block: DraftBlock) -> int:
        a = self.acceptance.estimates(AcceptanceModel.key(block), len(block))
        k = self._best(a, 0.0)  # the drafting is already paid for
        self.chosen.append(k)
        return k

    def begin(self, options) -> None:
        """A request starts (called by the decode loop with its SpeculativeOptions)."""
        self.acceptance.begin_request(sampled=float(getattr(options, "temperature", 0.0)) > 0)

    def observe_cost(self, n_tokens: int, seconds: float) -> None:
        """The wall time of one target call of `n_tokens` (model call and verification)."""
        if self.learn_costs:
            self.correction.observe(n_tokens, seconds)

    def for_seeded_request(self) -> "AdaptiveDraftLength":
        """A policy for one seeded request: this one's cost curve, draft cost and priors, with
        nothing learned yet and no timing, so its choices depend on that request alone and the
        same seed gives the same output (with a shared policy, earlier requests and the
        machine's speed would change the block sizes, hence which random draws go where)."""
        return AdaptiveDraftLength(
            self.curve, draft_step_seconds=self.draft_step_seconds,
            acceptance=AcceptanceModel(self.acceptance.max_len, model_prior=self.acceptance.model_prior),
            learn_costs=False)

    def observe(self, proposed: DraftBlock, n_verified: int, n_accepted: int, first_token: int,
                *, first_accept_prob: float | None = None) -> None:
        """After a target call: `proposed` is the whole draft, `n_verified` of it were verified.
        With none verified, `first_accept_prob` (when the loop knows it) is the chance the first
        draft would have been accepted; otherwise whether the emitted token equals it."""
        key = AcceptanceModel.key(proposed)
        if n_verified:
            self.acceptance.update(key, n_verified, n_accepted)
        elif len(proposed):
            would = (first_accept_prob if first_accept_prob is not None
                     else float(proposed.tokens[0] == first_token))
            self.acceptance.update_unverified(key, would)
