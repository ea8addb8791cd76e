"""Pricing a block on a batched model: a row's share of the shared call it rides in.

`BatchCosts` reads the measured cost surface c(rows, tokens, context)
(`calibration.CostSurface`) at the rows decoding now and their mean context; `BatchCorrection`
scales the surface's excess of a block over a step by what the runner's timed calls show. The
draft-length policy (`policy.py`) prices with either these or, alone, its cost curve.
"""

from __future__ import annotations

import collections
import functools
import threading
from typing import Callable

import numpy as np

from .calibration import CostSurface

CONTEXT_STEP = 32  # BatchCosts prices the rows' mean context to this many tokens
# with other rows decoding, a block must promise this much more than a plain step (its rate,
# tokens per second of the call) before it is drafted: the acceptance it is priced at is an
# estimate, and where a drafted token costs most of what it saves (at 8 rows of the default
# model, 1.0-1.3 ms of a 1.6-1.9 ms share) a block judged worth a few percent loses as often as
# it gains, and every other row of the call waits for it
LOAD_MARGIN = 0.08
MARGIN_ROWS, MARGIN_PER_ROW = 4, 0.1


def _to_step(context: int) -> int:
    """`context` to CONTEXT_STEP tokens: the few points the cached costs are kept at."""
    return CONTEXT_STEP * round(context / CONTEXT_STEP)


class BatchCorrection:
    """How far a batched model's cost surface is off in use, learned from the runner's own
    timed calls (`BatchRunner.call_listener`): a call's wall time there is the model call
    alone, not a row's wait.

    A decode call took t seconds at a mean context L. Where the graph computes the real tokens
    only (`packs_tokens`), its B rows carrying T tokens in all are the surface's call
    c(B, T - B + 1, L) (which puts the extra tokens in one row); where it computes every row of
    the span it covers at the widest block W, c(span, W, L). A call of one token a row shows the
    base ratio r_b = t / c(B, 1, L), a running average (BASE_ALPHA); one with drafts the
    excess ratio

        r_x = (t - r_b * c(B, 1, L)) / (c(call) - c(B, 1, L)),

    averaged with decaying weights (DECAY) over PRIOR_WEIGHT pseudo-calls at r_b (no evidence:
    the extra tokens are off as the base is), each call's ratio clipped to [0, MAX_RATIO] so
    that one call held up by the scheduler cannot swing it. `factor` = r_x / r_b scales the
    surface's excess of a block over a step (`BatchCosts`): what decides k is how dear the
    extra tokens are against the call they ride in. Calls without drafts age the excess
    evidence too (IDLE_DECAY), so a factor that stopped every draft returns to 1 with time.
    Until a base call has been timed it is 1. One correction serves every row of a model: its
    state is guarded by a lock.

    `observe` runs on the runner's thread between two calls, while the rows it has just woken
    wait for the interpreter: it only queues the call's figures, and the next read of `factor`
    (a row's thread pricing a block) folds the queued calls in, in order, to the same estimate.
    The queue is folded on the runner's thread only when PENDING_MAX calls are waiting (no row
    has priced a block for that long)."""

    PRIOR_WEIGHT = 8.0
    DECAY = 0.97  # per timed call with drafts: about the last 30 count
    IDLE_DECAY = 0.998  # per call without: half the evidence is gone after about 350
    BASE_ALPHA = 0.1  # weight of the newest one-token-a-row call in r_b
    MAX_RATIO = 4.0
    PENDING_MAX = 256  # calls queued by observe before it folds them in itself

    def __init__(self, surface: CostSurface, *, packs_tokens: bool = True) -> None:
        self.surface = surface
        self.packs_tokens = packs_tokens
        self._base: float | None = None  # r_b
        self._observed = 0.0  # decayed sum of excess ratios
        self._weight = 0.0  # decayed count of calls with drafts
        self._lock = threading.Lock()
        # calls observed and not yet folded in: (rows, span, tokens, widest, context, seconds);
        # appended by the runner's thread, taken under the lock
        self._pending: collections.deque[tuple[int, int, int, int, int, float]] = \
            collections.deque()

    @property
    def factor(self) -> float:
        with self._lock:
            self._fold()
            if self._base is None:
                return 1.0
            excess = (self.PRIOR_WEIGHT * self._base + self._observed) / \
                (self.PRIOR_WEIGHT + self._weight)
            return excess / self._base

    def observe(self, *, rows: int, span: int, tokens: int, widest: int, context: int,
                seconds: float) -> None:
        """A decode call took `seconds`: `rows` rows with a block each, `tokens` tokens in all,
        the widest block `widest` tokens, over `span` rows of the pool (the others riding
        along), at a mean context of `context`. Queued; folded in when `factor` is read."""
        if not (seconds > 0 and 1 <= rows <= span and tokens >= rows and widest >= 1):
            return
        self._pending.append((rows, span, tokens, widest, context, seconds))
        if len(self._pending) >= self.PENDING_MAX:
            with self._lock:
                self._fold()

    def _fold(self) -> None:
        """The queued calls into the estimate, oldest first; the caller holds the lock."""
        while self._pending:
            self._fold_one(*self._pending.popleft())

    def _fold_one(self, rows: int, span: int, tokens: int, widest: int, context: int,
                  seconds: float) -> None:
        at = _to_step(context)
        if self.packs_tokens:
            plain, (base, extra) = tokens == rows, _call_costs(self.surface, rows, tokens - rows, at)
        else:
            plain, (base, extra) = widest == 1, _call_costs(self.surface, span, widest - 1, at)
        if plain:
            ratio = seconds / base
            self._base = ratio if self._base is None else \
                self._base + self.BASE_ALPHA * (ratio - self._base)
            self._observed *= self.IDLE_DECAY
            self._weight *= self.IDLE_DECAY
        elif self._base is not None and extra > 0:
            ratio = min(self.MAX_RATIO, max(0.0, (seconds - self._base * base) / extra))
            self._observed = self._observed * self.DECAY + ratio
            self._weight = self._weight * self.DECAY + 1.0


class BatchCosts:
    """The costs of a row of a batched model (`batching.rows.BatchRow`), from the measured
    surface c(B, t, L) at the number of rows decoding now, B, and their mean context, L
    (`context`, to CONTEXT_STEP tokens; without it, the surface's first context).

    A row's block is priced as if every row drafted alike, since under load they all run the
    same policy: the call then carries B blocks of k + 1 tokens. On a graph that computes the
    real tokens only (`packs_tokens`) that is B * k + 1 more tokens than a call of one token a
    row, as dear as c(B, B * k + 1), the surface's call in which one row appends B * k + 1
    tokens and the others one each (past the grid, its last slope); on a graph that computes
    every row at the widest block it is c(B, k + 1). A row's share is that call over B, and
    the tokens it emits are its own E(k): pricing a row's drafts against the
    tokens the other rows emit anyway, as if they did not draft, made speculation look free
    under load and run slower than plain decoding at 8 rows. Nothing is learned from a row's
    timed calls, whose wall time includes waiting for the other rows; the runner's timed calls
    (`correction`, a `BatchCorrection`) scale the excess of a block over a step. The context
    matters because every drafted token attends over its row's cache: rows deep into long
    prompts make drafts dearer than the surface's first context says, and a policy blind to it
    drafted at a loss there."""

    def __init__(self, surface: CostSurface, rows: Callable[[], int], *,
                 context: Callable[[], int] | None = None, draft: CostSurface | None = None,
                 packs_tokens: bool = True, correction: BatchCorrection | None = None) -> None:
        self.surface, self._rows, self._context, self.draft = surface, rows, context, draft
        self.packs_tokens = packs_tokens
        self.correction = correction  # the surface's excess scaled as timed calls show

    def _at_context(self) -> int | None:
        """The rows' mean context to CONTEXT_STEP tokens; None where no context is followed."""
        return None if self._context is None else _to_step(self._context())

    def costs(self, n_max: int) -> np.ndarray:  # [n_max]: a row's share of the call, n = k + 1
        got = _row_shares(self.surface, self._rows(), self._at_context(), n_max,
                          self.packs_tokens)
        if self.correction is None:
            return got
        return got[0] + self.correction.factor * (got - got[0])

    def observe(self, n_tokens: int, seconds: float) -> None:
        """Ignored (see the class docstring)."""

    def margin(self) -> float:
        """LOAD_MARGIN with other rows decoding (MARGIN_PER_ROW a row past MARGIN_ROWS);
        0 for a row alone."""
        rows = self._rows()
        return 0.0 if rows <= 1 else LOAD_MARGIN + MARGIN_PER_ROW * max(0, rows - MARGIN_ROWS)

    def draft_step(self, solo: float) -> float:
        """A row's share of a drafted token's draft step: a draft model that batches its rows'
        steps too (`draft`, its surface of one-token calls) runs one call d(B, 1) for the B
        rows (at 4 rows the int4 draft of SmolLM2-135M takes 0.72x the fp32 target's call
        there, against 0.45x alone); a draft of each row's own costs its step, `solo`."""
        if self.draft is None:
            return solo
        return _draft_share(self.draft, self._rows(), self._at_context())


@functools.lru_cache(maxsize=4096)
def _call_costs(surface: CostSurface, rows: int, extra: int,
                context: int) -> tuple[float, float]:
    """(c(B, 1, L), c(B, extra + 1, L) - c(B, 1, L)): a call of one token a row, and what
    `extra` more tokens add to it, by the surface (for `BatchCorrection`, once per point)."""
    base = surface.cost(rows, 1, context)
    return base, surface.cost(rows, extra + 1, context) - base


@functools.lru_cache(maxsize=4096)
def _draft_share(draft: CostSurface, rows: int, context: int | None) -> float:
    """`BatchCosts.draft_step` of a batched draft, kept across requests."""
    return draft.cost(rows, 1, context) / rows


@functools.lru_cache(maxsize=4096)
def _row_shares(surface: CostSurface, rows: int, context: int | None, n_max: int,
                packs_tokens: bool) -> np.ndarray:  # [n_max], read-only
    """`BatchCosts.costs`, kept across requests: each request prices with a BatchCosts of its
    own, and every request of a model asks for the same few (rows, context) points."""
    n = np.arange(1, n_max + 1)
    tokens = rows * (n - 1) + 1 if packs_tokens else n
    got = np.array([surface.cost(rows, int(t), context) for t in tokens]) / rows
    got.flags.writeable = False
    return got
