"""The drafters that sample their drafts from a q: continuation counts and the target's cached
distributions. Exact marginals at temperature, greedy identity, the hook that hands them the
target's rows, and the q each reports, worked by hand."""


import numpy as np
import pytest

from helpers.drafters import Counting, RandomDrafter
from ortspec.runtime import (
    DrafterError,
    PromptLookupSpeculator,
    ReferenceDecoder,
    SpeculativeOptions,
    speculative_decode_with,
    warp,
)
from ortspec.runtime.drafters.composite import FallbackDrafter
from ortspec.runtime.drafters.continuations import ContinuationIndex
from ortspec.runtime.drafters.ngram_counts import NgramCountsDrafter
from ortspec.runtime.drafters.target_cache import TargetCacheDrafter, sparse_target
from helpers.stats import assert_matches_distribution, assert_matches_marginals, count_speculative_tokens
from helpers.decode import GREEDY, SAMPLING_CASES, SMALL, assert_greedy_identity, cost_policy, \
    exact_marginals, greedy_prompts

# words as token ids
THE, CAT, SAT, DOT, RAN, ON, MAT = range(7)
VOCAB = 7


def _options(temperature=1.0, seed=0, **kw):
    return SpeculativeOptions(8, temperature=temperature, seed=seed, **kw)


def _counts(**kw):
    return NgramCountsDrafter(**kw)


def _cache(**kw):
    return TargetCacheDrafter(**kw)


# -- exact marginals at temperature -------------------------------------------------------------

NEW_DRAFTERS = {
    "ngram_counts": lambda: NgramCountsDrafter(ngram_size=2, max_draft_len=3),
    # 3 of 5 tokens kept per row: q is a truncated, renormalised p, never p itself
    "target_cache": lambda: TargetCacheDrafter(ngram_size=2, max_draft_len=3, cached_top=3),
}


@pytest.mark.parametrize("case", sorted(SAMPLING_CASES))
@pytest.mark.parametrize("drafter_name", ["ngram_counts", "ngram_counts+policy", "target_cache",
                                          "target_cache+policy"])
def test_decodes_with_a_sampled_q_match_plain_sampling(case, drafter_name):
    """As test_decode's test of the other drafters: 8,000 speculative decodes of 4 tokens against
    the exact per-position marginals and the exact joint of the first two tokens (chi-squared),
    with the drafts' q exercised both as spread distributions and, for the cache, as rows the
    target gave earlier in the same decode."""
    kw = SAMPLING_CASES[case]
    decoder = ReferenceDecoder(SMALL)
    prompt, n_new, n_runs = [1, 3, 1, 3], 4, 8000
    marginals, joint2 = exact_marginals(decoder, prompt, n_new, **kw)
    inner = NEW_DRAFTERS[drafter_name.split("+")[0]]()
    drafter = Counting(inner)
    policy = cost_policy() if drafter_name.endswith("+policy") else None
    counts, joint_counts, accepted, drafted = count_speculative_tokens(
        decoder, prompt, drafter, kw, n_new=n_new, n_runs=n_runs, policy=policy)
    # the drafts must have been exercised both ways, with spread q's, or the test proves nothing
    assert 0 < accepted < drafted
    assert drafter.spread > n_runs // 10
    if isinstance(inner, TargetCacheDrafter):
        assert inner.rows_used > n_runs // 10
    assert_matches_marginals(counts, joint_counts, marginals, joint2, what=case)


# -- greedy identity ----------------------------------------------------------------------------


@pytest.mark.parametrize("max_verify_len", [None, 3])
def test_greedy_decodes_are_plain_greedy_token_for_token(max_verify_len):
    """Temperature 0: the target rows are point masses on the argmax, the counts drafter drafts
    the most frequent continuation; either way the output is the forward_token loop's."""
    decoder = ReferenceDecoder(GREEDY, max_verify_len=max_verify_len)
    drafters = [
        NgramCountsDrafter(ngram_size=3, max_draft_len=8),
        NgramCountsDrafter(ngram_size=1, max_draft_len=4),
        TargetCacheDrafter(ngram_size=3, max_draft_len=8),
        TargetCacheDrafter(ngram_size=2, max_draft_len=4, cached_top=1),
    ]
    accepted, rejected = assert_greedy_identity(decoder, drafters)
    assert accepted > 0 and rejected > 0
    assert drafters[2].rows_used > 0  # drafts came from the target's own (greedy) rows too


# -- the hook: the target's rows for the emitted positions ---------------------------------------


class Recording(RandomDrafter):
    """Random drafts (so that blocks are rejected part-way), recording what the loop hands over."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen = []  # (start, rows)

    def observe_target(self, start, logits):
        self.seen.append((start, np.array(logits)))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_loop_hands_the_drafter_the_target_rows_of_exactly_the_emitted_positions(temperature):
    decoder = ReferenceDecoder(GREEDY, max_verify_len=4)
    prompt = next(greedy_prompts())
    drafter = Recording(GREEDY.vocab_size, 5, seed=3)
    res = speculative_decode_with(decoder, prompt, drafter, SpeculativeOptions(40, temperature=temperature, seed=1))
    # one call per target call, covering every new position once, in order, nothing else (not the
    # prompt's, not the rows of drafts after a rejection)
    assert len(drafter.seen) == res.counters.target_calls
    starts = [s for s, _ in drafter.seen]
    sizes = [rows.shape[0] for _, rows in drafter.seen]
    assert starts == list(np.cumsum([len(prompt)] + sizes[:-1]))
    assert sum(sizes) == len(res.tokens) and min(sizes) >= 1
    assert max(sizes) > 1  # some blocks were accepted, at least in part
    full = prompt + res.tokens
    check = ReferenceDecoder(GREEDY)
    expected = check.forward_batch(full[:-1])  # row j: the target after full[:j + 1]
    for start, rows in drafter.seen:
        assert rows.shape[1] == GREEDY.vocab_size
        np.testing.assert_allclose(rows, expected[start - 1 : start - 1 + rows.shape[0]], rtol=1e-5, atol=1e-6)


def test_a_fallback_drafter_hands_every_drafter_the_rows():
    a, b = _cache(ngram_size=1), _cache(ngram_size=1)
    both = FallbackDrafter([a, b])
    both.begin(_options(), None)
    both.observe_target(5, np.log(np.array([[0.7, 0.2, 0.1, 1e-9, 1e-9, 1e-9, 1e-9]])))
    assert list(a.rows) == list(b.rows) == [5]


def test_a_drafter_without_the_hook_is_refused_with_a_message_naming_it():
    class Bare:
        def begin(self, options, draft_length):
            pass

        def propose(self, history, max_tokens):
            raise AssertionError("never reached")

    with pytest.raises(DrafterError, match="observe_target"):
        speculative_decode_with(ReferenceDecoder(GREEDY), [1, 2], Bare(), SpeculativeOptions(4))
    # the built-in drafters have it (a no-op where they keep nothing)
    for d in (PromptLookupSpeculator(), _counts(), _cache()):
        assert speculative_decode_with(ReferenceDecoder(GREEDY), [1, 2, 1], d, SpeculativeOptions(4)).tokens


# -- the continuation index ---------------------------------------------------------------------


def test_the_index_keeps_the_most_recent_continuation_and_the_counts_of_each_follower():
    # a b a c a (positions 0..4), n = 1..2
    idx = ContinuationIndex(1, 2)
    idx.extend([0, 1, 0, 2, 0])
    n, entry = idx.match([2, 0])
    # (c, a) is the tail itself, never followed: the 1-gram (a,) matches instead
    assert n == 1 and entry.recent == 3
    assert {t: c for t, (c, _) in entry.followers.items()} == {1: 1, 2: 1}
    n, entry = idx.match([1, 0])  # (b, a) -> c at 3
    assert (n, entry.recent) == (2, 3)
    assert idx.match([5]) == (0, None)


def test_distinct_followers_go_longest_n_gram_first_then_most_recent():
    idx = ContinuationIndex(1, 2)
    idx.extend([0, 1, 0, 2, 0])  # a b a c a
    assert idx.distinct_followers([2, 0], 2) == [2, 1]  # (a,): c at 3, then b at 1
    assert idx.distinct_followers([2, 0], 1) == [2]
    idx.extend([1, 0, 3])  # a b a c a b a d: (b, a) -> c at 3, d at 7
    assert idx.distinct_followers([1, 0], 4) == [3, 2, 1]  # (b, a)'s d, c; then (a,)'s b
    assert idx.distinct_followers([9], 3) == []


# -- continuation counts, by hand ---------------------------------------------------------------

#                0    1    2    3    4    5    6    7    8    9
CAT_HISTORY = [THE, CAT, SAT, DOT, THE, CAT, RAN, DOT, THE, CAT]


def test_counts_q_is_the_empirical_distribution_of_what_followed_then_each_context_re_matches():
    drafter = _counts(ngram_size=2)
    drafter.begin(_options(seed=0), None)
    block = drafter.propose(CAT_HISTORY, 8)
    # "the cat" was followed by "sat" (2) and "ran" (6): q1 = {sat: 1/2, ran: 1/2}
    q1 = block.dists[0]
    assert dict(zip(q1.token_ids.tolist(), q1.probs.tolist())) == {SAT: 0.5, RAN: 0.5}
    # then "cat sat" or "cat ran" -> "." ; "sat ." or "ran ." -> "the" ; ". the" -> "cat" (twice)
    assert block.tokens[1:] == (DOT, THE, CAT)
    assert all(d.is_point for d in block.dists[1:])
    # the length prompt lookup would draft: "ran . the cat" follows the most recent "the cat"
    assert len(block) == 4 and block.match_len == 2 and block.source == "ngram_counts"
    # the wrong answer: a point mass on the most recent continuation, as prompt lookup drafts
    assert not q1.is_point


def test_counts_weigh_every_occurrence():
    #          0  1  2  3  4  5  6
    history = [1, 2, 1, 2, 1, 3, 1]
    drafter = _counts(ngram_size=1)
    drafter.begin(_options(), None)
    q = drafter.propose(history, 1).dists[0]
    assert dict(zip(q.token_ids.tolist(), q.probs.tolist())) == pytest.approx({2: 2 / 3, 3: 1 / 3})


def test_counts_drafts_are_drawn_from_the_q_they_report():
    """4,000 proposals with different seeds: the first drafted token against q1 and the first two
    against q1(x1) q2(x2 | x1), chi-squared over the whole vocabulary."""
    history = [THE, CAT, SAT, ON, THE, CAT, RAN, DOT, THE, CAT, SAT, DOT, THE, CAT]
    drafter = _counts(ngram_size=2)
    first = np.zeros(VOCAB)
    pairs = np.zeros(VOCAB * VOCAB)
    expected_pairs = np.zeros(VOCAB * VOCAB)
    for seed in range(4000):
        drafter.begin(_options(seed=seed), None)
        block = drafter.propose(history, 2)
        x1, x2 = block.tokens
        q1, q2 = block.dists
        first[x1] += 1
        pairs[x1 * VOCAB + x2] += 1
        expected_pairs[x1 * VOCAB + np.asarray(q2.token_ids)] = q1.prob(x1) * q2.probs
    # "the cat" -> sat twice, ran once: q1 = {sat: 2/3, ran: 1/3}
    q1 = np.zeros(VOCAB)
    q1[[SAT, RAN]] = [2 / 3, 1 / 3]
    assert_matches_distribution(first, q1, alpha=1e-3, what="first drafted token")
    # "cat sat" -> on once, "." once; "cat ran" -> "." once
    assert expected_pairs[SAT * VOCAB + ON] == pytest.approx(1 / 3)
    assert expected_pairs[RAN * VOCAB + DOT] == pytest.approx(1 / 3)
    assert_matches_distribution(pairs, expected_pairs, alpha=1e-3, what="first two drafted tokens")


def test_greedy_counts_draft_the_most_frequent_continuation_ties_to_the_most_recent():
    drafter = _counts(ngram_size=1)
    drafter.begin(_options(temperature=0.0), None)
    # 1 was followed by 2 twice, by 3 once (most recently): the mode wins, a point mass
    block = drafter.propose([1, 2, 1, 2, 1, 3, 1], 1)
    assert block.tokens == (2,) and block.dists[0].is_point
    # "the cat" -> sat once, ran once: the tie goes to ran, the more recent
    drafter = _counts(ngram_size=2)
    drafter.begin(_options(temperature=0.0), None)
    assert drafter.propose(CAT_HISTORY, 1).tokens == (RAN,)


def test_no_match_or_no_room_gives_an_empty_block():
    for make in (_counts, _cache):
        drafter = make()
        drafter.begin(_options(), None)
        assert len(drafter.propose([THE, CAT, SAT], 8)) == 0
        assert len(drafter.propose([THE], 8)) == 0
        assert len(make().propose(CAT_HISTORY, 0)) == 0
        assert len(make(max_draft_len=2).propose(CAT_HISTORY, 8)) == 2


@pytest.mark.parametrize("make", [_counts, _cache])
def test_the_length_and_key_of_a_block_depend_on_the_history_alone_never_on_the_draws(make):
    """A draft-length policy sizes the verify from len(block) and (source, match_len): if those
    followed the draws, which drafts get verified would too, and the output would be biased."""
    history = [THE, CAT, SAT, ON, THE, CAT, RAN, DOT, THE, CAT, SAT, DOT, MAT, THE, CAT]
    shapes, drafts = set(), set()
    for seed in range(200):
        drafter = make(ngram_size=2, max_draft_len=6)
        drafter.begin(_options(seed=seed), None)
        if isinstance(drafter, TargetCacheDrafter):  # spread rows at every generated position
            drafter.observe_target(4, np.random.default_rng(seed).normal(size=(len(history) - 4, VOCAB)))
        block = drafter.propose(history, 8)
        shapes.add((len(block), block.match_len, block.source, block.prior))
        drafts.add(block.tokens)
    assert len(shapes) == 1 and len(drafts) >= 4


# -- the target's cached rows, by hand ----------------------------------------------------------


def test_the_sparse_target_is_the_renormalised_top_k_of_warp():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))

    def as_dict(d):
        return dict(zip(d.token_ids.tolist(), d.probs.tolist()))

    # top 2 of {.5, .3, .15, .05}: {0: .5/.8, 1: .3/.8}
    assert as_dict(sparse_target(logits, k=2, temperature=1.0)) == pytest.approx({0: 0.625, 1: 0.375})
    # T = 0.5 squares before renormalising: .25, .09 -> /.34
    assert as_dict(sparse_target(logits, k=2, temperature=0.5)) == pytest.approx({0: 0.25 / 0.34, 1: 0.09 / 0.34})
    # top_k 1 leaves the point mass on 0; top_p 0.7 keeps {0, 1} (0.5 < 0.7 <= 0.8) even with k = 3
    assert as_dict(sparse_target(logits, k=3, temperature=1.0, top_k=1)) == {0: 1.0}
    assert as_dict(sparse_target(logits, k=3, temperature=1.0, top_p=0.7)) == pytest.approx({0: 0.625, 1: 0.375})
    # temperature 0: the point mass on the argmax, ties to the lowest id (as warp)
    assert as_dict(sparse_target(np.array([1.0, 3.0, 3.0, 0.0]), k=4, temperature=0.0)) == {1: 1.0}
    # k beyond the vocabulary: all of it, p itself
    assert as_dict(sparse_target(logits, k=9, temperature=1.0)) == pytest.approx({0: .5, 1: .3, 2: .15, 3: .05})


def test_the_sparse_target_equals_warp_then_top_k_on_random_rows():
    rng = np.random.default_rng(0)
    for _ in range(200):
        logits = rng.normal(size=50) * 3
        kw = dict(temperature=float(rng.uniform(0.3, 2.0)), top_k=[None, 5, 30][rng.integers(3)],
                  top_p=[None, 0.5, 0.95][rng.integers(3)])
        k = int(rng.integers(1, 12))
        p = warp(logits, **kw)
        top = np.argsort(-p, kind="stable")[:k]
        top = top[p[top] > 0]
        d = sparse_target(logits, k=k, **kw)
        assert sorted(d.token_ids.tolist()) == sorted(top.tolist())
        np.testing.assert_allclose(d.dense(50)[top], p[top] / p[top].sum(), rtol=1e-9)


#               0   1  2  3  4  5  6
CACHE_PROMPT = [MAT, 1, 2, 3, 4, 1, 2]


def _row(probs):  # [vocab] logits whose softmax is `probs` (zeros -> tiny)
    return np.log(np.maximum(np.asarray(probs, dtype=np.float64), 1e-30))


def test_the_cache_drafts_from_the_row_after_the_match_and_points_where_none_is():
    drafter = _cache(ngram_size=2, cached_top=2)
    drafter.begin(_options(seed=0), None)
    history = list(CACHE_PROMPT)
    # the prompt has no rows: "1 2" matched at 1-2, followed by 3: prompt lookup's point mass
    block = drafter.propose(history, 1)
    assert block.tokens == (3,) and block.dists[0].is_point and block.source == "target_cache"
    # the target emits 3 at position 7 with p_7 = {3: .6, 4: .3, 6: .1}; then 9 ... and "2 3" again
    p7 = [0, 0, 0, 0.6, 0.3, 0, 0.1]
    history.append(3)
    drafter.observe_target(7, _row(p7)[None, :])
    history += [5, 2]
    drafter.observe_target(8, np.zeros((2, VOCAB)))  # uniform rows at 8 and 9
    # tail "5 2" never occurred; "2" last at 6, followed at 7: q1 = p_7's top 2, renormalised
    block = drafter.propose(history, 1)
    q1 = block.dists[0]
    assert dict(zip(q1.token_ids.tolist(), q1.probs.tolist())) == pytest.approx({3: 2 / 3, 4: 1 / 3})
    assert block.match_len == 1 and drafter.rows_used == 1


def test_a_context_that_matches_nowhere_takes_the_row_aligned_with_the_first_match():
    history = [1, 2, 1, 3, 1]  # positions 0..4; the target gave rows at 1..4
    rows = {1: [1 / 7] * 7,
            2: [0.5, 0, 0, 0, 0, 0.5, 0],  # after "1" at 0 (followed by 2)
            3: [0, 0, 0.1, 0, 0, 0, 0.9],  # after "1" at 2: mostly 6, a token the history never had
            4: [0, 0, 0, 0, 0.5, 0.5, 0]}
    seen = set()
    for seed in range(40):
        drafter = _cache(ngram_size=1, cached_top=2)
        drafter.begin(_options(seed=seed), None)
        drafter.observe_target(1, np.stack([_row(rows[i]) for i in (1, 2, 3, 4)]))
        # "1" last followed at 3: q1 = the row at 3; the block covers positions 3 and 4
        block = drafter.propose(history, 8)
        assert len(block) == 2
        x1, q2 = block.tokens[0], block.dists[1]
        seen.add(x1)
        if x1 == 6:  # "6" matches nowhere: the row aligned with the match's next position, 4
            np.testing.assert_allclose(q2.dense(VOCAB), rows[4], atol=1e-12)
        else:  # "2" matches, last followed at 2: that row
            assert x1 == 2
            np.testing.assert_allclose(q2.dense(VOCAB), rows[2], atol=1e-12)
    assert seen == {2, 6}


def test_greedy_rows_are_point_masses_on_the_argmax():
    drafter = _cache(ngram_size=1)
    drafter.begin(_options(temperature=0.0), None)
    drafter.observe_target(3, np.array([[0.0, 2.0, 5.0, 5.0, 0, 0, 0]]))
    row = drafter.rows[3]
    assert row.is_point and int(row.token_ids[0]) == 2  # ties: lowest id
