"""Warping, draft distributions and the speculative-sampling rule.

The rule (Leviathan et al. 2023, Chen et al. 2023): a token x drawn from the draft distribution
q is accepted with probability min(1, p(x) / q(x)); on rejection a token is drawn from
normalise(max(0, p - q)). Whatever q is, the emitted token is distributed exactly as p. Here
`p_target` is the target's warped distribution at that position and `p_draft` the draft's.

Both decode loops warp logits with the one function `warp`, so speculative and plain decoding
sample from the same distribution by construction.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import numpy as np

from ..errors import DrafterError, InvalidDistributionError, InvalidOptionError
from ..validation import check_int, check_logits, is_int

PROB_SUM_TOL = 1e-6  # a DraftDist's probabilities must sum to 1 within this
RESIDUAL_EPS = 1e-12  # a residual with less mass than this is rounding noise: fall back to p_target


# -- warping ------------------------------------------------------------------------------------


def check_sampling_options(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Raise InvalidOptionError naming the value and the allowed range."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float, np.integer, np.floating)):
        raise InvalidOptionError(f"temperature must be a number >= 0, got {temperature!r}",
                                 option="temperature")
    if not math.isfinite(temperature) or temperature < 0:
        raise InvalidOptionError(f"temperature must be a finite number >= 0, got {temperature!r}",
                                 option="temperature")
    check_int("top_k", top_k, minimum=1, allow_none=True)
    if top_p is not None and (
        isinstance(top_p, bool)
        or not isinstance(top_p, (int, float, np.integer, np.floating))
        or not math.isfinite(top_p)
        or not 0.0 < top_p <= 1.0
    ):
        raise InvalidOptionError(f"top_p must be None or in (0, 1], got {top_p!r}", option="top_p")


def _top_p_keep(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Indices of the smallest set of most likely tokens whose mass reaches `top_p`.

    Ties in probability are broken towards the lower token id. Sorting the whole vocabulary
    costs milliseconds at 49k tokens, so candidates are taken by `argpartition` in growing
    batches until their mass reaches `top_p`; the result is the same as a full sort.
    """
    vocab = probs.shape[0]
    m = min(64, vocab)
    while True:
        if m >= vocab:
            cand = np.arange(vocab)
        else:
            cand = np.argpartition(-probs, m - 1)[:m]
        # sort candidates by (-p, id): lexsort's last key is the primary one
        order = cand[np.lexsort((cand, -probs[cand]))]
        csum = np.cumsum(probs[order])
        if csum[-1] >= top_p or m >= vocab:
            # keep token i while the mass before it is still short of top_p
            n_keep = int(np.searchsorted(csum, top_p, side="left")) + 1
            return order[: min(n_keep, order.size)]
        m *= 4


def warp(
    logits: np.ndarray,  # [vocab]
    *,
    temperature: float,
    top_k: int | None = None,
    top_p: float | None = None,
) -> np.ndarray:  # [vocab] float64, sums to 1
    """Target probabilities from logits: temperature, then top-k, then top-p.

    Temperature 0 is the point mass on `np.argmax(logits)` (ties: lowest id). Top-k keeps the
    k highest logits and every token tied with the k-th. Top-p keeps the smallest set of most
    likely tokens whose probability reaches top_p.
    """
    check_sampling_options(temperature, top_k, top_p)
    logits = np.asarray(logits)
    if logits.ndim != 1 or logits.size == 0:
        raise InvalidOptionError(f"warp needs a non-empty [vocab] vector of logits, got shape {logits.shape}")
    check_logits(logits)
    vocab = logits.shape[-1]
    if temperature == 0:
        p = np.zeros(vocab)
        p[int(np.argmax(logits))] = 1.0
        return p
    z = logits.astype(np.float64) / temperature
    if top_k is not None and top_k < vocab:
        kth = np.partition(z, vocab - top_k)[vocab - top_k]
        z = np.where(z >= kth, z, -np.inf)
    z -= z.max()
    p = np.exp(z)
    p /= p.sum()
    if top_p is not None and top_p < 1.0:
        keep = _top_p_keep(p, top_p)
        q = np.zeros(vocab)
        q[keep] = p[keep]
        p = q / q.sum()
    return p


def sample_from(probs: np.ndarray, rng: np.random.Generator) -> int:  # probs: [vocab]
    """One draw by inverse CDF. Never returns a zero-probability token."""
    cdf = np.cumsum(probs)
    total = cdf[-1]
    i = int(np.searchsorted(cdf, rng.random() * total, side="right"))
    if i >= probs.shape[0] or probs[i] <= 0:  # u * total rounded up to the end of the CDF
        i = int(np.flatnonzero(probs > 0)[-1])
    return i


POINT_CACHE = 1 << 16  # point masses kept (DraftDist.point)
_ONE = np.ones(1)
_ONE.setflags(write=False)

# -- draft distributions ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class DraftDist:
    """The complete support of the distribution one draft token was drawn from.

    `token_ids` are unique; `probs` are > 0 and sum to 1 (within 1e-6). `prob(t)` is 0 for any
    token outside the support.
    """

    token_ids: np.ndarray  # [support] int64
    probs: np.ndarray  # [support] float64

    def __post_init__(self) -> None:
        ids = np.asarray(self.token_ids)
        probs = np.asarray(self.probs, dtype=np.float64)
        if ids.ndim != 1 or probs.ndim != 1 or ids.shape != probs.shape or ids.size == 0:
            raise InvalidDistributionError(
                f"DraftDist needs 1-D token_ids and probs of the same non-zero length, got "
                f"shapes {ids.shape} and {probs.shape}"
            )
        if not np.issubdtype(ids.dtype, np.integer):
            raise InvalidDistributionError(f"DraftDist token_ids must be integers, got {ids.dtype}")
        if (ids < 0).any():
            raise InvalidDistributionError(f"DraftDist token_ids must be >= 0, got {ids.min()}")
        if np.unique(ids).size != ids.size:
            raise InvalidDistributionError("DraftDist token_ids must be unique")
        if not np.isfinite(probs).all() or (probs <= 0).any():
            raise InvalidDistributionError("DraftDist probs must be finite and > 0 on the support")
        total = float(probs.sum())
        if abs(total - 1.0) > PROB_SUM_TOL:
            raise InvalidDistributionError(
                f"DraftDist probs must sum to 1 within {PROB_SUM_TOL}, got {total!r}"
            )
        object.__setattr__(self, "token_ids", ids.astype(np.int64, copy=False))
        object.__setattr__(self, "probs", probs)

    @classmethod
    def point(cls, token: int) -> "DraftDist":
        """The point mass a model-free drafter (prompt lookup) proposes."""
        return _point(_checked_token(token))

    @classmethod
    def _trusted(cls, ids: np.ndarray, probs: np.ndarray) -> "DraftDist":
        """Skip validation for a support that is valid by construction (hot paths)."""
        d = object.__new__(cls)
        object.__setattr__(d, "token_ids", ids)
        object.__setattr__(d, "probs", probs)
        return d

    @classmethod
    def from_probs(cls, probs: np.ndarray) -> "DraftDist":  # probs: [vocab]
        """From a full probability vector; the support is where probs > 0."""
        probs = np.asarray(probs, dtype=np.float64)
        if probs.ndim != 1:
            raise InvalidDistributionError(f"expected a [vocab] vector, got shape {probs.shape}")
        ids = np.flatnonzero(probs > 0)
        return cls(ids, probs[ids])

    @classmethod
    def from_warped(cls, probs: np.ndarray) -> "DraftDist":  # probs: [vocab], from `warp`
        """Like `from_probs` for a vector `warp` produced (finite, >= 0, sums to 1), skipping the
        O(vocab log vocab) uniqueness check: its support is unique by construction."""
        ids = np.flatnonzero(probs > 0)
        return cls._trusted(ids, probs[ids])

    @classmethod
    def from_warped_mapped(cls, probs: np.ndarray, ids: np.ndarray) -> "DraftDist":
        """From a vector `warp` produced over a reduced vocabulary (probs: [n]) whose entry i
        is the token ids[i] ([n] distinct int64 token ids, e.g. a draft head's target_ids)."""
        support = np.flatnonzero(probs > 0)
        return cls._trusted(ids[support], probs[support])

    @property
    def is_point(self) -> bool:
        return self.token_ids.size == 1

    def prob(self, token: int) -> float:
        if self.token_ids.size == 1:
            return 1.0 if int(self.token_ids[0]) == token else 0.0
        hit = np.flatnonzero(self.token_ids == token)
        return float(self.probs[hit[0]]) if hit.size else 0.0

    def dense(self, vocab_size: int) -> np.ndarray:  # [vocab]
        if int(self.token_ids.max()) >= vocab_size:
            raise InvalidDistributionError(
                f"DraftDist has token id {int(self.token_ids.max())} >= vocab size {vocab_size}"
            )
        q = np.zeros(vocab_size)
        q[self.token_ids] = self.probs
        return q


def _checked_token(token: object) -> int:
    """`token` as an int if it is an integer >= 0, else InvalidDistributionError."""
    if not is_int(token):
        raise InvalidDistributionError(f"a token id must be an integer, got {token!r}")
    if int(token) < 0:  # type: ignore[call-overload]
        raise InvalidDistributionError(f"DraftDist token_ids must be >= 0, got {token}")
    return int(token)  # type: ignore[call-overload]


@functools.lru_cache(maxsize=POINT_CACHE)
def _point(token: int) -> DraftDist:
    """The point mass on `token` (>= 0), made once: drafters propose the same tokens again and
    again, and a DraftDist is immutable (its arrays read-only)."""
    ids = np.array([token], dtype=np.int64)
    ids.setflags(write=False)
    return DraftDist._trusted(ids, _ONE)


@dataclasses.dataclass(frozen=True)
class DraftBlock:
    """Drafted tokens and, per position, the distribution each was drawn from.

    `source` names the drafter that produced it (for counters); `match_len` is the length of the
    n-gram match behind a prompt-lookup draft (0 otherwise), a strong predictor of acceptance.
    (`source`, `match_len`) is the key under which the draft-length policy learns acceptance;
    `prior` is the drafter's own guess of the chance each drafted token is accepted, which the
    policy starts from for a key it has not seen (None: the policy's default).
    """

    tokens: tuple[int, ...]
    dists: tuple[DraftDist, ...]
    source: str = ""
    match_len: int = 0
    prior: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))
        object.__setattr__(self, "dists", tuple(self.dists))
        if len(self.tokens) != len(self.dists):
            raise DrafterError(
                f"DraftBlock has {len(self.tokens)} tokens but {len(self.dists)} distributions"
            )
        for i, (t, d) in enumerate(zip(self.tokens, self.dists)):
            if not isinstance(d, DraftDist):
                raise DrafterError(f"DraftBlock position {i}: expected a DraftDist, got {type(d)}")
            if d.token_ids.size == 1 and int(d.token_ids[0]) == t:
                continue
            if d.prob(t) <= 0:
                raise DrafterError(
                    f"DraftBlock position {i}: token {t} is outside its own draft distribution"
                )

    @classmethod
    def empty(cls) -> "DraftBlock":
        """The block of no drafts (one object: blocks are immutable)."""
        return _EMPTY_BLOCK

    @classmethod
    def points(cls, tokens: Sequence[int], *, source: str = "", match_len: int = 0,
               prior: float | None = None) -> "DraftBlock":
        """Point masses on `tokens` (each checked as `DraftDist.point` checks it; a plain int >= 0
        needs no more), as a model-free drafter proposes them."""
        tokens = tuple(t if type(t) is int and t >= 0 else _checked_token(t) for t in tokens)
        return cls._trusted(tokens, tuple(_point(t) for t in tokens), source, match_len, prior)

    @classmethod
    def _trusted(cls, tokens: tuple[int, ...], dists: tuple[DraftDist, ...], source: str,
                 match_len: int, prior: float | None) -> "DraftBlock":
        """Skip `__post_init__` for a block valid by construction (point masses on its own
        tokens, or a prefix of a checked block): the decode loop makes one or two a step."""
        block = object.__new__(cls)
        for name, value in (("tokens", tokens), ("dists", dists), ("source", source),
                            ("match_len", match_len), ("prior", prior)):
            object.__setattr__(block, name, value)
        return block

    def __len__(self) -> int:
        return len(self.tokens)

    def truncated(self, n: int) -> "DraftBlock":
        """The first `n` drafts (all of them when n >= len), with this block's source, match
        length and prior."""
        if n >= len(self.tokens):
            return self
        return DraftBlock._trusted(self.tokens[:n], self.dists[:n], self.source, self.match_len,
                                   self.prior)


_EMPTY_BLOCK = DraftBlock((), ())

# -- the rule -----------------------------------------------------------------------------------


def accept_or_resample(
    p_target: np.ndarray,  # [vocab] warped target probabilities at this position
    draft: DraftDist,
    token: int,
    rng: np.random.Generator,
) -> tuple[int, bool]:
    """Accept `token` with probability min(1, p_target[token] / p_draft[token]); otherwise
    return a token drawn from normalise(max(0, p_target - p_draft)).

    Returns (emitted token, accepted?). A token with p_target = 0 is never accepted. If the
    residual has no mass left (rounding), the token is drawn from p_target instead.
    """
    if not isinstance(draft, DraftDist):
        raise DrafterError(f"draft must be a DraftDist, got {type(draft).__name__}")
    if not isinstance(rng, np.random.Generator):
        raise InvalidOptionError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
    p_target = np.asarray(p_target, dtype=np.float64)
    if p_target.ndim != 1 or not np.isfinite(p_target).all() or (p_target < 0).any() or abs(
        float(p_target.sum()) - 1.0
    ) > PROB_SUM_TOL:
        raise InvalidDistributionError(
            f"p_target must be a [vocab] vector of finite probabilities >= 0 summing to 1, got "
            f"shape {p_target.shape}, sum {float(np.nansum(p_target))!r}"
        )
    if not 0 <= token < p_target.shape[0]:
        raise DrafterError(f"token {token} is outside the vocabulary 0..{p_target.shape[0] - 1}")
    return _accept_or_resample(p_target, draft, token, rng)


def _accept_or_resample(
    p_target: np.ndarray, draft: DraftDist, token: int, rng: np.random.Generator
) -> tuple[int, bool]:
    """The rule, for inputs already known to be valid (p_target from `warp`)."""
    q = draft.prob(token)
    if q <= 0:
        raise DrafterError(f"token {token} has draft probability 0: it cannot have been drafted")
    p = float(p_target[token])
    if p >= q or (p > 0 and rng.random() < p / q):
        return token, True
    residual = p_target - draft.dense(p_target.shape[0])
    np.maximum(residual, 0.0, out=residual)
    if residual.sum() <= RESIDUAL_EPS:
        return sample_from(p_target, rng), False
    return sample_from(residual, rng), False


@dataclasses.dataclass(frozen=True)
class BlockOutcome:
    """What verifying one draft block produced."""

    tokens: list[int]  # accepted drafts, then one recovered or bonus token
    n_accepted: int
    recovered: bool  # the last token was resampled after a rejection (else it is the bonus)
    p_bonus: np.ndarray | None = None  # [vocab] warped target the bonus was drawn from (T > 0)


def verify_block(
    logits: np.ndarray,  # [k + 1, vocab]: row i is the target after the drafts before position i
    block: DraftBlock,  # k drafted tokens
    rng: np.random.Generator,
    *,
    temperature: float,
    top_k: int | None = None,
    top_p: float | None = None,
) -> BlockOutcome:
    """Run the rule left to right over a block; stop at the first rejection.

    At temperature 0 the target is a point mass on the argmax, so the rule reduces to exact
    matching: a draft is accepted iff it is the argmax, and a rejection yields the argmax. That
    case is computed directly (same result, no softmax over the vocabulary). Above temperature
    0, rows are warped lazily: only as many as the accepted prefix needs.
    """
    k = len(block)
    if temperature == 0:
        check_logits(logits)
        targets = np.argmax(logits, axis=-1)
        out = []
        for i in range(k):
            t = int(targets[i])
            if block.tokens[i] != t:
                return BlockOutcome(out + [t], i, True)
            out.append(t)
        return BlockOutcome(out + [int(targets[k])], k, False)
    out = []
    for i in range(k):
        p_target = warp(logits[i], temperature=temperature, top_k=top_k, top_p=top_p)
        tok, ok = _accept_or_resample(p_target, block.dists[i], block.tokens[i], rng)
        out.append(tok)
        if not ok:
            return BlockOutcome(out, i, True)
    p_target = warp(logits[k], temperature=temperature, top_k=top_k, top_p=top_p)
    out.append(sample_from(p_target, rng))
    return BlockOutcome(out, k, False, p_target)


def draw_draft(logits: np.ndarray, rng: np.random.Generator, *, temperature: float,
               top_k: int | None, top_p: float | None,
               ids: np.ndarray | None = None) -> tuple[int, DraftDist]:
    """One drafted token from a model's `logits` ([n]) and the exact distribution it was drawn
    from: at temperature 0 the argmax as a point mass, else a draw from `warp(logits)` under
    the options. `ids` ([n] distinct int64): the token id of entry i (a draft head's target
    ids over its reduced vocabulary); None: entry i is token i."""
    if temperature == 0:
        i = int(np.argmax(logits))
        tok = i if ids is None else int(ids[i])
        return tok, DraftDist.point(tok)
    q = warp(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    i = sample_from(q, rng)
    if ids is None:
        return i, DraftDist.from_warped(q)
    return int(ids[i]), DraftDist.from_warped_mapped(q, ids)
