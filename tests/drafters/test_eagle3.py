"""The eagle3 drafter on a NumPy target that hands out hidden states and a NumPy head: exact
marginals at temperature, greedy identity, the head rolled back to the accepted prefix, and the
q each drafted position reports."""

import pytest

from helpers.decode import GREEDY, SAMPLING_CASES, SMALL, cost_policy, exact_marginals, \
    greedy_prompts
from helpers.drafters import Counting
from helpers.eagle3 import HiddenReference, NumpyHead
from helpers.stats import assert_matches_marginals, count_speculative_tokens
from ortspec.runtime import ReferenceDecoder, SpeculativeOptions, plain_decode, \
    speculative_decode_with, warp
from ortspec.runtime.drafters.composite import CostAwareDrafter
from ortspec.runtime.drafters.eagle3 import Eagle3Drafter
from ortspec.runtime.drafters.prompt_lookup import PromptLookupSpeculator
from ortspec.runtime.errors import DrafterError


def _drafter(target, *, draft_vocab=None, max_draft_len=3, seed=0, capacity=64):
    vocab = target.vocab_size
    ids = list(range(vocab)) if draft_vocab is None else draft_vocab
    head = NumpyHead(vocab=vocab, target_ids=ids, in_dim=2 * vocab, capacity=capacity, seed=seed)
    return Eagle3Drafter(target, head, max_draft_len=max_draft_len)


class Spread(Counting):
    """Counts drafted positions whose q was not a point mass (`Counting`), and checks each q's
    support lies on the head's target ids."""

    def __init__(self, drafter):
        super().__init__(drafter)
        self.support = set()

    def propose(self, history, max_tokens):
        block = super().propose(history, max_tokens)
        for d in block.dists:
            self.support.update(int(t) for t in d.token_ids)
            assert set(d.token_ids.tolist()) <= set(self.drafter.head.target_ids.tolist())
        return block


@pytest.mark.parametrize("case", sorted(SAMPLING_CASES))
@pytest.mark.parametrize("variant", ["full-vocab", "reduced-vocab", "reduced-vocab+policy"])
def test_eagle3_decodes_match_plain_sampling(case, variant):
    """As the other drafters' tests: 8,000 speculative decodes of 4 tokens against the exact
    per-position marginals and the joint of the first two tokens (chi-squared), the head's q
    spread over its draft vocabulary (all 5 ids, or 3 of them mapped to target ids 4, 0, 2)."""
    kw = SAMPLING_CASES[case]
    target = HiddenReference(SMALL)
    prompt, n_new, n_runs = [1, 3, 1, 3], 4, 8000
    marginals, joint2 = exact_marginals(ReferenceDecoder(SMALL), prompt, n_new, **kw)
    draft_vocab = None if variant == "full-vocab" else [4, 0, 2]
    drafter = Spread(_drafter(target, draft_vocab=draft_vocab))
    policy = cost_policy() if variant.endswith("+policy") else None
    counts, joint_counts, accepted, drafted = count_speculative_tokens(
        target, prompt, drafter, kw, n_new=n_new, n_runs=n_runs, policy=policy)
    assert 0 < accepted < drafted  # drafts were accepted and rejected
    assert drafter.spread > n_runs // 10  # with spread q's, or the test proves nothing
    if draft_vocab is not None:
        assert drafter.support <= set(draft_vocab)
    assert_matches_marginals(counts, joint_counts, marginals, joint2, what=f"{case} {variant}")


@pytest.mark.parametrize("max_verify_len", [None, 3])
def test_greedy_eagle3_decodes_are_plain_greedy_token_for_token(max_verify_len):
    """Temperature 0: the head drafts its argmax (mapped to a target id) as a point mass;
    alone or beside prompt lookup, with or without the cost model, the output is the
    forward_token loop's."""
    target = HiddenReference(GREEDY, max_verify_len=max_verify_len)
    accepted = rejected = 0
    for prompt in greedy_prompts():
        options = SpeculativeOptions(40)
        reference = plain_decode(target, prompt, options)
        for make in (lambda: _drafter(target, max_draft_len=4),
                     lambda: _drafter(target, draft_vocab=list(range(0, 24, 2))),
                     lambda: CostAwareDrafter(PromptLookupSpeculator(max_draft_len=4),
                                              _drafter(target))):
            for policy in (None, cost_policy()):
                res = speculative_decode_with(target, prompt, make(), options,
                                              draft_length=policy)
                assert res.tokens == reference.tokens
                accepted += res.counters.accepted
                rejected += res.counters.rejected
    assert accepted > 0 and rejected > 0


class Checked(Eagle3Drafter):
    """Checks, at every proposal, that the head holds exactly the history positions the target
    confirmed (the drafts of earlier blocks rolled back), ending at the history's end."""

    def propose(self, history, max_tokens):
        block = super().propose(history, max_tokens)
        fed = self.head.fed
        if self._next == len(history):  # the head drafted from the target's states
            confirmed = fed[:self._confirmed]
            assert confirmed == list(history[len(history) - len(confirmed):])
            assert len(fed) == self._confirmed + max(0, len(block) - 1)  # + the drafts fed back
            self.checked += 1
        return block


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_head_is_rolled_back_to_the_accepted_prefix_after_every_verify(temperature):
    target = HiddenReference(GREEDY, max_verify_len=5)
    head = NumpyHead(vocab=24, target_ids=list(range(24)), in_dim=48, capacity=256)
    drafter = Checked(target, head, max_draft_len=4)
    drafter.checked = 0
    prompt = next(greedy_prompts())
    res = speculative_decode_with(target, prompt, drafter,
                                  SpeculativeOptions(60, temperature=temperature, seed=3))
    assert drafter.checked > 10
    assert res.counters.rejected > 0 and res.counters.drafted > 0


def test_a_full_head_cache_starts_afresh_and_decoding_goes_on():
    target = HiddenReference(GREEDY)
    prompt = next(greedy_prompts())
    reference = plain_decode(target, prompt, SpeculativeOptions(60))
    res = speculative_decode_with(target, prompt, _drafter(target, max_draft_len=4, capacity=12),
                                  SpeculativeOptions(60))
    assert res.tokens == reference.tokens and res.counters.drafted > 0


def test_q_is_the_heads_warped_distribution_mapped_to_target_ids():
    """One proposal by hand: the head's logits after the target's states, warped with the
    request's top-k, are the q of the first drafted position, on target ids."""
    target = HiddenReference(SMALL)
    ids = [4, 0, 2]
    drafter = _drafter(target, draft_vocab=ids, max_draft_len=1)
    options = SpeculativeOptions(4, temperature=0.7, top_k=2, seed=0)
    drafter.begin(options, None)
    target.reset()
    target.prefill([1, 3])
    logits = target.forward_token(1)[None, :]
    drafter.observe_target(3, logits)
    twin = NumpyHead(vocab=5, target_ids=ids, in_dim=10, seed=0)
    head_logits, _ = twin.forward([1], target.last_hidden_states(), from_target=True)
    block = drafter.propose([1, 3, 1, 1], 1)
    q = warp(head_logits[0], temperature=0.7, top_k=2)  # [3]
    (dist,) = block.dists
    assert dist.token_ids.size == 2  # top-k of the draft vocabulary
    for i, t in enumerate(ids):
        assert dist.prob(t) == pytest.approx(q[i])


def test_a_target_without_hidden_states_is_refused():
    with pytest.raises(DrafterError, match="--draft-head"):
        Eagle3Drafter(_NoStates(), NumpyHead(
            vocab=5, target_ids=range(5), in_dim=10))


class _NoStates:
    hidden_state_layers = None


def test_the_policy_prices_a_drafted_token_at_its_drafters_own_step():
    """paid_steps prices eagle3's drafted tokens at the head's step, not at a draft model's:
    with the same acceptance, a head as dear as a target step drafts nothing where a cheap
    draft model drafts, and the rate it expects is that of a plain step."""
    from ortspec.runtime.draft_length.calibration import CostCurve
    from ortspec.runtime.draft_length.policy import AdaptiveDraftLength
    from ortspec.runtime.drafters.eagle3 import KEY
    from ortspec.runtime.drafters.draft_model import KEY as DRAFT_KEY

    policy = AdaptiveDraftLength(CostCurve((1.0, 1.05, 1.1, 1.15, 1.2)), draft_step_seconds=0.05,
                                 paid_steps={"eagle3": 1.0})
    assert policy.for_request().paid_steps is policy.paid_steps  # views share what prepare measured
    assert policy.limit(4, key=DRAFT_KEY, prior=0.6) >= 1
    assert policy.limit(4, key=KEY, prior=0.6) == 0
    assert policy.rate(4, key=KEY, prior=0.6, paid=True) == pytest.approx(1.0)
    policy.paid_steps["eagle3"] = 0.05
    assert policy.limit(4, key=KEY, prior=0.6) >= 1
