"""Chi-squared goodness of fit over a whole support, in the style of JAX's random tests."""

from __future__ import annotations

import numpy as np
from scipy import stats


def assert_matches_distribution(observed: np.ndarray, expected_p: np.ndarray, *, alpha: float, what: str) -> float:
    """observed: [support] counts; expected_p: [support] exact probabilities (may contain zeros).

    Cells with zero probability must be empty. Cells whose expected count is below 5 are pooled
    into one cell so the chi-squared approximation holds. Returns the p-value.
    """
    observed = np.asarray(observed, dtype=np.float64)
    expected_p = np.asarray(expected_p, dtype=np.float64)
    assert observed.shape == expected_p.shape
    n = observed.sum()
    zero = expected_p <= 0
    assert observed[zero].sum() == 0, (
        f"{what}: drew tokens of probability 0: {np.flatnonzero(zero & (observed > 0)).tolist()}"
    )
    exp = n * expected_p[~zero] / expected_p[~zero].sum()
    obs = observed[~zero]
    small = exp < 5
    if small.any():
        exp = np.append(exp[~small], exp[small].sum())
        obs = np.append(obs[~small], obs[small].sum())
    if exp.size < 2:
        assert obs.sum() == n
        return 1.0
    p_value = float(stats.chisquare(obs, exp).pvalue)
    assert p_value > alpha, (
        f"{what}: chi-squared p = {p_value:.3g} <= {alpha}\nexpected {np.round(exp, 1).tolist()}\n"
        f"observed {obs.astype(int).tolist()}"
    )
    return p_value
