"""What the decode-loop tests share: small reference models, the sampling cases, exact
marginals by enumeration, and the greedy-identity check over several drafters."""

import itertools

import numpy as np

from ortspec.runtime import ReferenceConfig, SpeculativeOptions, plain_decode, \
    speculative_decode_with, warp
from ortspec.runtime.draft_length.policy import AdaptiveDraftLength, CostCurve


def exact_marginals(decoder, prompt, n, *, temperature, top_k=None, top_p=None):
    """Per-position marginals of n sampled tokens, and the joint of the first two, enumerated
    exactly over every prefix (vocab^(n-1) of them) with the shared warping function."""
    vocab = decoder.vocab_size
    marginals = [np.zeros(vocab) for _ in range(n)]
    joint2 = np.zeros((vocab, vocab))

    def walk(prefix, prob):
        decoder.reset()
        logits = decoder.forward_batch(list(prompt) + list(prefix))[-1]
        p = warp(logits, temperature=temperature, top_k=top_k, top_p=top_p)
        depth = len(prefix)
        marginals[depth] += prob * p
        if depth == 1:
            joint2[prefix[0]] += prob * p
        if depth + 1 < n:
            for t in np.flatnonzero(p > 0):
                walk(prefix + [int(t)], prob * p[t])

    walk([], 1.0)
    return marginals, joint2.reshape(-1)


SMALL = ReferenceConfig(vocab_size=5, d_model=16, n_layers=2, n_heads=2, capacity=16, logit_scale=1.5, seed=4)
SAMPLING_CASES = {
    "t1.0": dict(temperature=1.0),
    "t0.7-topk3": dict(temperature=0.7, top_k=3),
    "t1.5-topp0.8": dict(temperature=1.5, top_p=0.8),
}


def cost_policy():
    """The cost-model policy with a CPU-like cost curve: it varies k from step to step."""
    return AdaptiveDraftLength(CostCurve((1.0, 1.12, 1.25, 1.4)))


GREEDY = ReferenceConfig(vocab_size=24, d_model=32, n_layers=2, n_heads=4, capacity=256, logit_scale=4.0, seed=1)


def assert_greedy_identity(decoder, drafters, new_tokens: int = 60) -> tuple[int, int]:
    """Each drafter, with and without the cost model, decodes each greedy prompt exactly as plain
    decoding does; returns the (accepted, rejected) drafts over all of them."""
    accepted = rejected = 0
    for prompt in greedy_prompts():
        options = SpeculativeOptions(new_tokens)
        reference = plain_decode(decoder, prompt, options)
        assert reference.counters.forward_token_calls == new_tokens
        for drafter, policy in itertools.product(drafters, (None, cost_policy())):
            res = speculative_decode_with(decoder, prompt, drafter, options, draft_length=policy)
            assert res.tokens == reference.tokens, type(drafter).__name__
            assert res.counters.emitted == len(res.tokens) == new_tokens
            accepted += res.counters.accepted
            rejected += res.counters.rejected
    return accepted, rejected


def greedy_prompts():
    rng = np.random.default_rng(8)
    for _ in range(6):
        motif = rng.integers(0, GREEDY.vocab_size, size=6).tolist()
        yield motif + rng.integers(0, GREEDY.vocab_size, size=10).tolist() + motif[:4]
