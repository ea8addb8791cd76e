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


def count_speculative_tokens(decoder, prompt, drafter, options_kw: dict, *, n_new: int, n_runs: int,
                             policy=None) -> tuple[np.ndarray, np.ndarray, int, int]:
    """`n_runs` speculative decodes of `n_new` tokens (seeds 0..n_runs-1, sampling options
    `options_kw`): (counts [n_new, vocab] per position, counts of the first two tokens' joint
    [vocab^2], tokens accepted, tokens drafted)."""
    from ortspec.runtime import SpeculativeOptions, speculative_decode_with

    vocab = decoder.vocab_size
    counts = np.zeros((n_new, vocab), dtype=np.int64)
    joint_counts = np.zeros(vocab**2, dtype=np.int64)
    accepted = drafted = 0
    for seed in range(n_runs):
        res = speculative_decode_with(
            decoder, prompt, drafter, SpeculativeOptions(n_new, seed=seed, **options_kw), draft_length=policy
        )
        assert len(res.tokens) == n_new
        for i, t in enumerate(res.tokens):
            counts[i, t] += 1
        joint_counts[res.tokens[0] * vocab + res.tokens[1]] += 1
        accepted += res.counters.accepted
        drafted += res.counters.drafted
    return counts, joint_counts, accepted, drafted


def assert_matches_marginals(counts: np.ndarray, joint_counts: np.ndarray, marginals, joint2, *,
                             what: str) -> None:
    """`count_speculative_tokens`' counts against the exact per-position marginals and first-two
    joint, at alpha 1e-3 split over the n_new + 1 tests."""
    n_new = counts.shape[0]
    alpha = 1e-3 / (n_new + 1)
    for i in range(n_new):
        assert_matches_distribution(counts[i], marginals[i], alpha=alpha, what=f"{what} position {i}")
    assert_matches_distribution(joint_counts, joint2, alpha=alpha, what=f"{what} first two tokens")
