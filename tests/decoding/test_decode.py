"""The decode loops on the NumPy reference decoder: losslessness, counters, limits."""

import itertools

import numpy as np
import pytest

from helpers.drafters import BadDrafter, EmptyDrafter, OracleDrafter, RandomDrafter
from ortspec.runtime.draft_length.policy import AdaptiveDraftLength, CostCurve
from ortspec.runtime.drafters.composite import CostAwareDrafter
from ortspec.runtime.drafters.draft_model import KEY as DRAFT_MODEL_KEY
from ortspec.runtime import (
    DraftBlock,
    DraftDist,
    DrafterError,
    DraftModelDrafter,
    InvalidPromptError,
    PromptLookupSpeculator,
    ReferenceConfig,
    ReferenceDecoder,
    SpeculativeOptions,
    plain_decode,
    speculative_decode,
    speculative_decode_with,
    warp,
)
from helpers.decode import GREEDY, SAMPLING_CASES, SMALL, assert_greedy_identity, cost_policy, \
    exact_marginals, greedy_prompts
from helpers.stats import assert_matches_distribution, assert_matches_marginals, count_speculative_tokens

# -- exact marginals ----------------------------------------------------------------------------


def _drafter(name, vocab):
    if name == "random":
        return RandomDrafter(vocab, 3, seed=5)
    if name == "prompt_lookup":
        return PromptLookupSpeculator(ngram_size=2, max_draft_len=3)
    # draft_model_window: the draft reads the last 2 tokens of the prompt only
    context = 2 if name == "draft_model_window" else None
    return DraftModelDrafter(ReferenceDecoder(ReferenceConfig(**{**SMALL.__dict__, "seed": 9})), max_draft_len=3,
                             context=context)


@pytest.mark.parametrize("case", sorted(SAMPLING_CASES))
@pytest.mark.parametrize("drafter_name", ["random", "prompt_lookup", "draft_model", "draft_model_window",
                                          "prompt_lookup+policy"])
def test_speculative_decode_at_temperature_matches_plain_sampling(case, drafter_name):
    """Sampled speculative decodes (8,000 of 4 tokens) against the exact per-position marginals
    of plain sampling, and the exact joint of the first two tokens: chi-squared tests."""
    kw = SAMPLING_CASES[case]
    decoder = ReferenceDecoder(SMALL)
    prompt, n_new, n_runs = [1, 3, 1, 3], 4, 8000
    marginals, joint2 = exact_marginals(decoder, prompt, n_new, **kw)
    drafter = _drafter(drafter_name.split("+")[0], SMALL.vocab_size)
    policy = cost_policy() if drafter_name.endswith("+policy") else None
    counts, joint_counts, accepted, drafted = count_speculative_tokens(
        decoder, prompt, drafter, kw, n_new=n_new, n_runs=n_runs, policy=policy)
    # the drafts must have been exercised both ways, or the test proves nothing
    assert 0 < accepted < drafted
    assert_matches_marginals(counts, joint_counts, marginals, joint2, what=case)


@pytest.mark.parametrize("case", sorted(SAMPLING_CASES))
def test_the_cost_aware_composition_matches_plain_sampling(case):
    """Prompt lookup or the draft model, chosen per step by a policy that prices draft steps:
    the same chi-squared tests over 8,000 decodes, both drafters having drafted."""
    kw = SAMPLING_CASES[case]
    decoder = ReferenceDecoder(SMALL)
    prompt, n_new, n_runs = [1, 3, 1, 3], 4, 8000
    marginals, joint2 = exact_marginals(decoder, prompt, n_new, **kw)
    drafter = CostAwareDrafter(PromptLookupSpeculator(ngram_size=2, max_draft_len=3), _drafter("draft_model", 0))
    policy = AdaptiveDraftLength(CostCurve((1.0, 1.12, 1.25, 1.4)), draft_step_seconds=0.3)
    counts, joint_counts, accepted, drafted = count_speculative_tokens(
        decoder, prompt, drafter, kw, n_new=n_new, n_runs=n_runs, policy=policy)
    assert 0 < accepted < drafted
    assert min(drafter.chosen.values()) > 0, drafter.chosen
    assert_matches_marginals(counts, joint_counts, marginals, joint2, what=case)


class _FixedRates:
    """A policy stand-in whose `rate` is a table by key (and whose `limit` drafts all asked)."""

    def __init__(self, rates):
        self.rates, self.asked = rates, []

    def rate(self, k_max, *, key, prior, paid):
        self.asked.append((key, k_max, paid))
        return self.rates[key]

    def limit(self, k_max, *, key, prior):
        return k_max

    def should_propose(self):
        return True


def test_the_cost_aware_composition_drafts_with_the_drafter_the_policy_rates_higher():
    history = next(greedy_prompts())  # ends with a 4-token repeat: prompt lookup has a block
    lookup = PromptLookupSpeculator(ngram_size=3, max_draft_len=4)
    lookup_block = lookup.propose(history, 4)
    lookup_key = (lookup_block.source, lookup_block.match_len)
    draft = DraftModelDrafter(ReferenceDecoder(ReferenceConfig(**{**GREEDY.__dict__, "seed": 2})), max_draft_len=3)
    both = CostAwareDrafter(lookup, draft)
    for free_rate, paid_rate, want in [(2.0, 1.0, "free"), (1.0, 2.0, "paid"), (1.5, 1.5, "free")]:
        policy = _FixedRates({lookup_key: free_rate, DRAFT_MODEL_KEY: paid_rate})
        both.begin(SpeculativeOptions(8), policy)
        block = both.propose(history, 4)
        assert block.source == ("prompt_lookup" if want == "free" else "draft_model")
        assert block.tokens == lookup_block.tokens if want == "free" else len(block) == 3
        # the lookup block was priced unpaid at its own length, the draft model paid at its limit
        assert policy.asked == [(lookup_key, len(lookup_block), False), (DRAFT_MODEL_KEY, 3, True)]
    assert both.chosen == {"free": 2, "paid": 1}
    # no policy: prompt lookup's block when there is one (FallbackDrafter's order)
    both.begin(SpeculativeOptions(8), None)
    assert both.propose(history, 4).tokens == lookup_block.tokens
    assert both.propose(history[:5], 4).source == "draft_model"  # no match in 5 random tokens


def test_plain_sampling_matches_the_exact_marginals():
    decoder = ReferenceDecoder(SMALL)
    prompt, n_new = [1, 3, 1, 3], 3
    marginals, _ = exact_marginals(decoder, prompt, n_new, temperature=1.0)
    counts = np.zeros((n_new, SMALL.vocab_size), dtype=np.int64)
    for seed in range(6000):
        res = plain_decode(decoder, prompt, SpeculativeOptions(n_new, temperature=1.0, seed=seed))
        for i, t in enumerate(res.tokens):
            counts[i, t] += 1
    for i in range(n_new):
        assert_matches_distribution(counts[i], marginals[i], alpha=1e-3 / n_new, what=f"position {i}")


# -- greedy identity ----------------------------------------------------------------------------

@pytest.mark.parametrize("max_verify_len", [None, 3])
def test_speculative_decode_matches_greedy_token_for_token(max_verify_len):
    """Temperature 0: identical to a forward_token loop, whatever the drafter proposes."""
    decoder = ReferenceDecoder(GREEDY, max_verify_len=max_verify_len)
    drafters = [
        PromptLookupSpeculator(ngram_size=3, max_draft_len=8),
        PromptLookupSpeculator(ngram_size=1, max_draft_len=4, prefer="first"),
        RandomDrafter(GREEDY.vocab_size, 5, seed=2),
        DraftModelDrafter(ReferenceDecoder(ReferenceConfig(**{**GREEDY.__dict__, "seed": 2})), max_draft_len=4),
        # a windowed draft whose cache (24 tokens) overflows within each decode and starts again
        DraftModelDrafter(ReferenceDecoder(ReferenceConfig(**{**GREEDY.__dict__, "seed": 2, "capacity": 24})),
                          max_draft_len=4, context=8),
        CostAwareDrafter(PromptLookupSpeculator(ngram_size=2, max_draft_len=4),
                         DraftModelDrafter(ReferenceDecoder(ReferenceConfig(**{**GREEDY.__dict__, "seed": 2})),
                                           max_draft_len=4)),
    ]
    accepted, rejected = assert_greedy_identity(decoder, drafters)
    assert accepted > 0 and rejected > 0


def test_a_windowed_draft_reads_the_last_context_tokens_only():
    """context=W: the draft's cache holds the history's last W tokens then its drafts, and it
    drafts exactly what a draft shown only those W tokens drafts; when the cache would overflow
    it starts again from the last W tokens."""
    cfg = ReferenceConfig(**{**GREEDY.__dict__, "seed": 2, "capacity": 20})
    history = next(greedy_prompts())  # 20 tokens
    windowed = DraftModelDrafter(ReferenceDecoder(cfg), max_draft_len=4, context=6)
    whole = DraftModelDrafter(ReferenceDecoder(cfg), max_draft_len=4)
    for d in (windowed, whole):
        d.begin(SpeculativeOptions(8), None)
    block = windowed.propose(history, 4)
    assert block.tokens == whole.propose(history[-6:], 4).tokens
    assert windowed.decoder.length == 6 + 3 and windowed.fed_tokens == 6 + 3
    # the first draft accepted, then 5: the cache keeps the window and that draft, feeds the 5
    grown = history + [block.tokens[0], 5]
    assert windowed.propose(grown, 4).tokens == whole.propose(grown[-8:], 4).tokens
    assert windowed.fed_tokens == 9 + 1 + 3
    # 8 + 10 more + 3 drafts would pass the capacity of 20: back to the last 6 tokens
    longer = grown + list(range(1, 11))
    assert windowed.propose(longer, 4).tokens == whole.propose(longer[-6:], 4).tokens
    assert windowed.decoder.length == 6 + 3


def test_the_thin_wrapper_is_greedy_prompt_lookup():
    decoder = ReferenceDecoder(GREEDY)
    for prompt in greedy_prompts():
        ref = plain_decode(decoder, prompt, SpeculativeOptions(40))
        assert speculative_decode(decoder, prompt, 40).tokens == ref.tokens


def test_a_drafter_equal_to_the_target_accepts_everything():
    target = ReferenceDecoder(GREEDY)
    prompt = next(greedy_prompts())
    for temperature in (0.0, 1.0):
        drafter = DraftModelDrafter(ReferenceDecoder(GREEDY), max_draft_len=4, target=target)
        res = speculative_decode_with(target, prompt, drafter, SpeculativeOptions(50, temperature=temperature, seed=3))
        assert res.counters.acceptance_rate == 1.0
        assert res.counters.recovered == 0
        # 50 tokens in blocks of 4 drafts + 1 bonus: 10 verify calls
        assert res.counters.target_calls == 10


def test_an_empty_drafter_reproduces_plain_decoding_with_the_same_seed():
    decoder = ReferenceDecoder(GREEDY)
    prompt = next(greedy_prompts())
    for seed in range(5):
        o = SpeculativeOptions(30, temperature=1.0, top_p=0.9, seed=seed)
        a = plain_decode(decoder, prompt, o)
        b = speculative_decode_with(decoder, prompt, EmptyDrafter(), o)
        assert a.tokens == b.tokens
        assert b.counters.verify_calls == 0 and b.counters.forward_token_calls == 30


def test_seeded_runs_repeat_exactly():
    decoder = ReferenceDecoder(GREEDY)
    prompt = next(greedy_prompts())

    def run(seed):
        return speculative_decode_with(
            decoder, prompt, RandomDrafter(GREEDY.vocab_size, 4, seed=1),
            SpeculativeOptions(40, temperature=1.0, seed=seed),
        ).tokens

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_top_k_and_top_p_outputs_stay_in_the_allowed_set():
    decoder = ReferenceDecoder(GREEDY)
    check = ReferenceDecoder(GREEDY)
    prompt = next(greedy_prompts())
    for kw in (dict(top_k=2), dict(top_p=0.5)):
        for seed in range(20):
            res = speculative_decode_with(
                decoder, prompt, RandomDrafter(GREEDY.vocab_size, 4, seed=seed),
                SpeculativeOptions(20, temperature=1.5, seed=seed, **kw),
            )
            check.reset()
            logits = check.forward_batch(prompt + res.tokens[:-1])[len(prompt) - 1 :]  # [20, vocab]
            for row, tok in zip(logits, res.tokens):
                assert warp(row, temperature=1.5, **kw)[tok] > 0


# -- stops, capacity, counters ------------------------------------------------------------------


def test_a_stop_token_inside_an_accepted_block_ends_the_decode_there():
    decoder = ReferenceDecoder(GREEDY)
    prompt = next(greedy_prompts())
    continuation = plain_decode(decoder, prompt, SpeculativeOptions(40)).tokens
    stop_at = 6
    stop = continuation[stop_at]
    first = continuation.index(stop)
    res = speculative_decode_with(
        decoder, prompt, OracleDrafter(prompt, continuation, 8),
        SpeculativeOptions(40, stop_token_ids=(stop,)),
    )
    assert res.finish_reason == "stop"
    assert res.tokens == continuation[: first + 1]
    # the oracle's block of 8 was accepted past the stop, but only what was emitted counts
    assert res.counters.emitted == len(res.tokens)
    assert res.counters.verify_calls == 1
    plain = plain_decode(decoder, prompt, SpeculativeOptions(40, stop_token_ids=(stop,)))
    assert plain.tokens == res.tokens and plain.finish_reason == "stop"


def test_capacity_ends_generation_cleanly_with_everything_generated():
    cfg = ReferenceConfig(**{**GREEDY.__dict__, "capacity": 24})
    decoder = ReferenceDecoder(cfg)
    prompt = next(greedy_prompts())  # 20 tokens
    plain = plain_decode(decoder, prompt, SpeculativeOptions(50))
    spec = speculative_decode_with(decoder, prompt, PromptLookupSpeculator(ngram_size=1), SpeculativeOptions(50))
    # the last token is never fed, so prompt + new may reach capacity + 1
    assert plain.finish_reason == spec.finish_reason == "capacity"
    assert len(plain.tokens) == cfg.capacity + 1 - len(prompt)
    assert spec.tokens == plain.tokens


def test_bad_prompts_are_refused_before_decoding():
    decoder = ReferenceDecoder(GREEDY)
    o = SpeculativeOptions(4)
    for prompt in ([], [0, GREEDY.vocab_size], [-1], list(range(10)) * 30):
        with pytest.raises(InvalidPromptError):
            speculative_decode_with(decoder, prompt, EmptyDrafter(), o)
        with pytest.raises(InvalidPromptError):
            plain_decode(decoder, prompt, o)


def test_drafts_that_break_the_contract_are_refused():
    decoder = ReferenceDecoder(GREEDY)
    prompt = next(greedy_prompts())
    too_long = BadDrafter(DraftBlock.points([1] * 9))
    with pytest.raises(DrafterError, match="at most 8"):
        speculative_decode_with(decoder, prompt, too_long, SpeculativeOptions(10, max_draft_len=8))
    out_of_range = BadDrafter(DraftBlock.points([GREEDY.vocab_size + 3]))
    with pytest.raises(DrafterError, match="token ids must be in"):
        speculative_decode_with(decoder, prompt, out_of_range, SpeculativeOptions(10))
    wide = BadDrafter(DraftBlock((1,), (DraftDist(np.array([1, 99]), np.array([0.5, 0.5])),)))
    with pytest.raises(DrafterError, match="vocab"):
        speculative_decode_with(decoder, prompt, wide, SpeculativeOptions(10))


def test_counters_add_up():
    decoder = ReferenceDecoder(GREEDY)
    for prompt, (temperature, seed) in zip(greedy_prompts(), itertools.product((0.0, 1.0), range(3))):
        res = speculative_decode_with(
            decoder, prompt, RandomDrafter(GREEDY.vocab_size, 4, seed=seed),
            SpeculativeOptions(37, temperature=temperature, seed=seed),
        )
        c = res.counters
        assert c.emitted == len(res.tokens) == 37
        assert c.drafted == c.accepted + c.rejected
        assert c.drafted == sum(c.drafted_by_position) and c.accepted == sum(c.accepted_by_position)
        assert c.recovered + c.bonus == c.target_calls  # every call ends in exactly one of them
        assert c.model_seconds + c.draft_seconds + c.sample_seconds <= c.total_seconds
