"""Warping, DraftDist and the accept/resample rule: hand-worked cases and exact-law tests."""

import numpy as np
import pytest

from ortspec.runtime import (
    DraftBlock,
    DraftDist,
    DrafterError,
    InvalidDistributionError,
    InvalidOptionError,
    NonFiniteLogitsError,
    SpeculativeOptions,
    accept_or_resample,
    verify_block,
    warp,
)
from helpers.stats import assert_matches_distribution

# -- warp ---------------------------------------------------------------------------------------


def test_temperature_zero_is_the_point_mass_on_argmax_lowest_id_on_ties():
    p = warp(np.array([1.0, 3.0, 3.0, -2.0]), temperature=0)
    # ties go to the lowest id, as np.argmax: token 1, not token 2
    assert p.tolist() == [0.0, 1.0, 0.0, 0.0]


def test_temperature_scales_logits_before_softmax():
    logits = np.log(np.array([0.5, 0.25, 0.25]))
    np.testing.assert_allclose(warp(logits, temperature=1.0), [0.5, 0.25, 0.25], rtol=1e-12)
    # T = 0.5 squares the probabilities before renormalising: 0.25, 0.0625, 0.0625 / 0.375
    np.testing.assert_allclose(warp(logits, temperature=0.5), [2 / 3, 1 / 6, 1 / 6], rtol=1e-12)


def test_top_k_keeps_the_k_best_and_ties_with_the_kth():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    np.testing.assert_allclose(warp(logits, temperature=1, top_k=2), [4 / 7, 3 / 7, 0, 0], rtol=1e-12)
    tied = np.array([2.0, 1.0, 1.0, 0.0])
    assert (warp(tied, temperature=1, top_k=2) > 0).tolist() == [True, True, True, False]


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    logits = np.log(np.array([0.1, 0.5, 0.3, 0.1]))
    # sorted 0.5, 0.3, 0.1, 0.1: 0.5 < 0.7, 0.8 >= 0.7 -> keep {1, 2}
    np.testing.assert_allclose(warp(logits, temperature=1, top_p=0.7), [0, 0.625, 0.375, 0], rtol=1e-12)
    # the most likely token always survives, and the wrong answer "empty set" never occurs
    assert warp(logits, temperature=1, top_p=1e-9).tolist() == [0, 1, 0, 0]


def test_top_p_on_a_large_vocabulary_equals_a_full_sort():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=50_000) * 3
    for top_p in (0.1, 0.5, 0.9, 0.999):
        p = warp(logits, temperature=1.0)
        order = np.lexsort((np.arange(p.size), -p))
        before = np.cumsum(p[order]) - p[order]
        keep = order[before < top_p]
        expected = np.zeros_like(p)
        expected[keep] = p[keep] / p[keep].sum()
        np.testing.assert_allclose(warp(logits, temperature=1.0, top_p=top_p), expected, atol=1e-15)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=-0.1),
        dict(temperature=float("nan")),
        dict(temperature=1, top_k=0),
        dict(temperature=1, top_p=0.0),
        dict(temperature=1, top_p=1.5),
    ],
)
def test_bad_sampling_options_are_refused(kwargs):
    from ortspec.runtime import SpeculativeOptions

    with pytest.raises(InvalidOptionError):
        SpeculativeOptions(8, **kwargs)


def test_non_finite_logits_are_refused():
    with pytest.raises(NonFiniteLogitsError):
        warp(np.array([0.0, np.nan]), temperature=1.0)
    with pytest.raises(NonFiniteLogitsError):
        warp(np.array([0.0, np.inf]), temperature=0.0)


# -- DraftDist, DraftBlock ---------------------------------------------------------------------


def test_draft_dist_validates_its_support():
    d = DraftDist(np.array([3, 1]), np.array([0.25, 0.75]))
    assert d.prob(1) == 0.75 and d.prob(3) == 0.25 and d.prob(2) == 0.0
    assert DraftDist.point(5).prob(5) == 1.0 and DraftDist.point(5).prob(4) == 0.0
    full = DraftDist.from_probs(np.array([0.0, 0.5, 0.0, 0.5]))
    assert full.token_ids.tolist() == [1, 3]
    np.testing.assert_array_equal(full.dense(4), [0, 0.5, 0, 0.5])
    for ids, probs in [
        ([1, 1], [0.5, 0.5]),  # duplicate ids
        ([1, 2], [0.5, 0.6]),  # does not sum to 1
        ([1, 2], [1.0, 0.0]),  # zero probability inside the support
        ([[1]], [[1.0]]),  # not 1-D
        ([-1], [1.0]),  # negative id
        ([], []),  # empty support
    ]:
        with pytest.raises(InvalidDistributionError):
            DraftDist(np.array(ids), np.array(probs))


def test_draft_block_refuses_tokens_outside_their_distribution():
    with pytest.raises(DrafterError):
        DraftBlock((1,), (DraftDist.point(2),))
    with pytest.raises(DrafterError):
        DraftBlock((1, 2), (DraftDist.point(1),))
    assert len(DraftBlock.empty()) == 0


# -- the rule -----------------------------------------------------------------------------------


def test_a_token_with_target_probability_zero_is_never_accepted():
    p = np.array([0.5, 0.5, 0.0])
    rng = np.random.default_rng(0)
    outs = [accept_or_resample(p, DraftDist.point(2), 2, rng) for _ in range(2000)]
    assert not any(ok for _, ok in outs)
    assert {t for t, _ in outs} <= {0, 1}


def test_a_draft_distribution_equal_to_the_target_is_always_accepted():
    p = np.array([0.2, 0.8])
    rng = np.random.default_rng(1)
    d = DraftDist(np.array([0, 1]), np.array([0.2, 0.8]))  # p / q = 1 everywhere
    assert all(accept_or_resample(p, d, t, rng)[1] for t in (0, 1) for _ in range(500))


def test_empty_residual_falls_back_to_the_target_without_nan():
    # q dominates p everywhere p > 0 except by rounding: the residual is ~0
    p = np.array([0.5, 0.5, 0.0])
    q = DraftDist(np.array([0, 1]), np.array([0.5, 0.5]))
    p_rounded = p.copy()
    p_rounded[0] -= 1e-17
    rng = np.random.default_rng(2)
    for _ in range(200):
        tok, _ = accept_or_resample(p_rounded, q, 0, rng)
        assert tok in (0, 1)


def test_a_token_outside_the_draft_support_is_an_error_not_a_division_by_zero():
    with pytest.raises(DrafterError):
        accept_or_resample(np.array([0.5, 0.5]), DraftDist.point(0), 1, np.random.default_rng(0))


P_TARGET = np.array([0.30, 0.22, 0.18, 0.12, 0.09, 0.05, 0.03, 0.01, 0.0, 0.0])
BAD_DRAFTS = {
    "point mass on a rare token": DraftDist.point(7),
    "point mass on an impossible token": DraftDist.point(9),
    "uniform": DraftDist.from_probs(np.full(10, 0.1)),
    "reversed": DraftDist.from_probs(np.arange(1, 11) / 55.0),
    "mass on impossible tokens": DraftDist(np.array([8, 9, 0]), np.array([0.45, 0.45, 0.1])),
}


@pytest.mark.parametrize("name", sorted(BAD_DRAFTS))
def test_resampling_reproduces_the_target_distribution(name):
    """200,000 tokens through the rule; the emitted tokens must be distributed as p_target.

    Each draft token is drawn from q, then accepted or resampled; a chi-squared test over the
    whole vocabulary (zero-probability tokens must never appear) with a fixed seed.
    """
    draft = BAD_DRAFTS[name]
    rng = np.random.default_rng(20231130)
    n = 200_000
    q_dense = draft.dense(P_TARGET.size)
    drafted = rng.choice(P_TARGET.size, size=n, p=q_dense)
    counts = np.zeros(P_TARGET.size, dtype=np.int64)
    for t in drafted:
        tok, _ = accept_or_resample(P_TARGET, draft, int(t), rng)
        counts[tok] += 1
    assert_matches_distribution(counts, P_TARGET, alpha=1e-3 / len(BAD_DRAFTS), what=name)


def test_the_chi_squared_check_rejects_a_biased_rule():
    """Power check: always accepting the draft (what argmax matching does to a point-mass
    draft) is biased, and the same test must catch it."""
    draft = BAD_DRAFTS["uniform"]
    rng = np.random.default_rng(7)
    toks = rng.choice(10, size=200_000, p=draft.dense(10))
    counts = np.bincount(toks, minlength=10)
    with pytest.raises(AssertionError):
        assert_matches_distribution(counts, P_TARGET, alpha=1e-3, what="biased")


def test_accepted_count_per_block_follows_its_law():
    """Drafts i.i.d. from q against a target p at every position: the first rejection comes at
    position i with probability a^i (1 - a), a = sum(min(p, q)); a full block with a^k."""
    p = np.array([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
    q = np.array([0.10, 0.15, 0.20, 0.25, 0.15, 0.15])
    a = np.minimum(p, q).sum()
    k, n = 4, 20_000
    logits = np.tile(np.log(p), (k + 1, 1))  # temperature 1 recovers p exactly
    dist = DraftDist.from_probs(q)
    rng = np.random.default_rng(11)
    counts = np.zeros(k + 1, dtype=np.int64)
    for _ in range(n):
        toks = rng.choice(p.size, size=k, p=q)
        block = DraftBlock(tuple(toks), (dist,) * k)
        out = verify_block(logits, block, rng, temperature=1.0)
        assert len(out.tokens) == out.n_accepted + 1
        counts[out.n_accepted] += 1
    law = np.array([a**i * (1 - a) for i in range(k)] + [a**k])
    assert_matches_distribution(counts, law, alpha=1e-3, what="accepted per block")


def test_greedy_verify_is_exact_matching_against_the_argmax():
    logits = np.array([[0, 5, 0], [9, 0, 0], [0, 0, 1], [1, 0, 0]], dtype=float)
    rng = np.random.default_rng(0)
    full = verify_block(logits, DraftBlock.points([1, 0, 2]), rng, temperature=0)
    assert (full.tokens, full.n_accepted, full.recovered) == ([1, 0, 2, 0], 3, False)
    miss = verify_block(logits, DraftBlock.points([1, 2, 2]), rng, temperature=0)
    # rejected at position 1: the recovered token is the argmax 0, never the draft 2
    assert (miss.tokens, miss.n_accepted, miss.recovered) == ([1, 0], 1, True)


@pytest.mark.parametrize("field, value", [("temperature", -1.0), ("temperature", float("nan")),
                                          ("top_k", 0), ("top_p", 1.5), ("seed", -3),
                                          ("max_draft_len", True)])
def test_an_option_error_names_its_option(field, value):
    with pytest.raises(InvalidOptionError, match=field) as err:
        SpeculativeOptions(8, **{field: value})
    assert err.value.option == field


def test_an_error_about_no_single_option_names_none():
    with pytest.raises(InvalidOptionError) as err:
        SpeculativeOptions(8, stop_token_ids="2")
    assert err.value.option is None
