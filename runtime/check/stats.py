"""The chi-squared goodness-of-fit test, without scipy.

    chi_squared_test(counts, p)  ->  ChiSquared(statistic, df, p_value, cells, outside_support)

The p-value is Q(df/2, x/2), the regularized upper incomplete gamma function, computed here
(series and continued fraction, Numerical Recipes 6.2): the runtime does not depend on scipy.
Only NumPy and the standard library are imported, so anything (the runtime's `ortspec check`,
a test) can use it.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..validation import check_int

_MAX_ITER = 100_000
_EPS = 1e-15
_TINY = 1e-300
MIN_EXPECTED = 5  # cells expected to hold fewer draws are pooled


def regularized_gamma_q(a: float, x: float) -> float:
    """Q(a, x) = Gamma(a, x) / Gamma(a), the regularized upper incomplete gamma function.

    a > 0, x >= 0. The power series of P = 1 - Q for x < a + 1, the continued fraction of Q
    (modified Lentz) otherwise; each converges fast in its region.
    """
    if not (a > 0 and math.isfinite(a)):
        raise ValueError(f"a must be finite and > 0, got {a!r}")
    if not x >= 0:  # NaN too
        raise ValueError(f"x must be >= 0, got {x!r}")
    if x == 0:
        return 1.0
    if math.isinf(x):
        return 0.0
    log_prefactor = -x + a * math.log(x) - math.lgamma(a)  # log(e^-x x^a / Gamma(a))
    if x < a + 1:
        term = total = 1.0 / a
        ap = a
        for _ in range(_MAX_ITER):
            ap += 1.0
            term *= x / ap
            total += term
            if term < total * _EPS:
                break
        return max(0.0, 1.0 - total * math.exp(log_prefactor))
    b = x + 1.0 - a
    c = 1.0 / _TINY
    d = 1.0 / b
    h = d
    for i in range(1, _MAX_ITER):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = _TINY if abs(d) < _TINY else d
        c = b + an / c
        c = _TINY if abs(c) < _TINY else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < _EPS:
            break
    return min(1.0, math.exp(log_prefactor) * h)


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-squared with `df` degrees of freedom: Q(df / 2, x / 2)."""
    check_int("df", df, minimum=1, error=ValueError)
    return regularized_gamma_q(df / 2.0, max(0.0, float(x)) / 2.0)


@dataclasses.dataclass(frozen=True)
class ChiSquared:
    statistic: float
    df: int
    p_value: float
    cells: int  # after pooling
    outside_support: int  # draws of tokens with probability 0 (must be 0)


def chi_squared_test(observed: np.ndarray, expected_p: np.ndarray) -> ChiSquared:
    """Goodness of fit of counts `observed` [cells] to probabilities `expected_p` [cells].

    Every cell counts, drawn or not. Cells of probability 0 must be empty (any draw there makes
    the p-value 0). Cells with expected count < 5 are pooled into one; if that pool is itself
    below 5 it joins the smallest remaining cell.
    """
    observed = np.asarray(observed, dtype=np.float64)
    expected_p = np.asarray(expected_p, dtype=np.float64)
    if observed.shape != expected_p.shape or observed.ndim != 1:
        raise ValueError(f"observed {observed.shape} and expected {expected_p.shape} must be 1-D "
                         f"and the same length")
    n = observed.sum()
    zero = expected_p <= 0
    outside = int(observed[zero].sum())
    exp = n * expected_p[~zero] / expected_p[~zero].sum()
    obs = observed[~zero]
    small = exp < MIN_EXPECTED
    if small.any():
        pool_e, pool_o = exp[small].sum(), obs[small].sum()
        exp, obs = exp[~small], obs[~small]
        if pool_e >= MIN_EXPECTED or exp.size == 0:
            exp, obs = np.append(exp, pool_e), np.append(obs, pool_o)
        else:
            i = int(np.argmin(exp))
            exp[i] += pool_e
            obs[i] += pool_o
    if exp.size < 2:  # one cell: nothing to test
        return ChiSquared(0.0, 0, 0.0 if outside else 1.0, int(exp.size), outside)
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = int(exp.size - 1)
    p = 0.0 if outside else chi2_sf(stat, df)
    return ChiSquared(stat, df, p, int(exp.size), outside)
