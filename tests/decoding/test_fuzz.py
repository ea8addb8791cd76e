"""Property-based tests (hypothesis) of the sampler, the prompt-lookup drafter and the decode
loop, on random shapes, extreme logits (+-1e4), ties, and random drafters.

Each property holds for every input; the sampler's distribution itself is tested statistically
elsewhere (test_sampling.py, test_decode.py). Bounded: about 20 s in all.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from ortspec.runtime import (
    DraftBlock,
    DraftDist,
    DrafterBase,
    PromptLookupSpeculator,
    ReferenceConfig,
    ReferenceDecoder,
    SpeculativeOptions,
    accept_or_resample,
    plain_decode,
    speculative_decode_with,
    verify_block,
    warp,
)

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ_SLOW = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- strategies ----------------------------------------------------------------------------------

# logits: ordinary values, exact ties (a few integers), and extremes
_logit = st.one_of(
    st.floats(-30, 30, allow_nan=False),
    st.sampled_from([-1e4, 1e4, 0.0, 1.0, 2.0]),
)


@st.composite
def logits_vectors(draw, min_vocab: int = 1, max_vocab: int = 40) -> np.ndarray:
    vocab = draw(st.integers(min_vocab, max_vocab))
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    return np.array(draw(st.lists(_logit, min_size=vocab, max_size=vocab)), dtype=dtype)


@st.composite
def sampling(draw, vocab: int) -> dict:
    temperature = draw(st.one_of(st.just(0.0), st.floats(0.05, 4.0)))
    top_k = draw(st.one_of(st.none(), st.integers(1, vocab + 3)))
    top_p = draw(st.one_of(st.none(), st.floats(1e-3, 1.0), st.just(1.0)))
    return dict(temperature=temperature, top_k=top_k, top_p=top_p)


@st.composite
def draft_dists(draw, vocab: int, rng: np.random.Generator) -> tuple[int, DraftDist]:
    """A draft distribution over part of the vocabulary, and a token really drawn from it."""
    if draw(st.booleans()):
        t = draw(st.integers(0, vocab - 1))
        return t, DraftDist.point(t)
    support = np.array(sorted(draw(st.sets(st.integers(0, vocab - 1), min_size=1, max_size=vocab))))
    concentration = draw(st.sampled_from([0.1, 1.0, 10.0]))
    probs = rng.dirichlet(np.full(support.size, concentration))
    probs = np.maximum(probs, 1e-12)
    probs /= probs.sum()
    d = DraftDist(support, probs)
    return int(rng.choice(support, p=probs)), d


def _assert_distribution(p: np.ndarray, vocab: int) -> None:
    assert p.shape == (vocab,)
    assert np.isfinite(p).all() and (p >= 0).all()
    assert abs(p.sum() - 1.0) < 1e-9


# -- warp --------------------------------------------------------------------------------------


@FUZZ
@given(data=st.data())
def test_warp_is_always_a_distribution_with_the_promised_support(data):
    logits = data.draw(logits_vectors())
    vocab = logits.size
    opts = data.draw(sampling(vocab))
    p = warp(logits, **opts)
    _assert_distribution(p, vocab)
    top = int(np.argmax(logits))  # ties: lowest id
    if opts["temperature"] == 0:
        assert p[top] == 1.0  # the point mass on the argmax, nothing else
        return
    z = logits.astype(np.float64) / opts["temperature"]
    untruncated = warp(logits, temperature=opts["temperature"], top_k=opts["top_k"])
    assert untruncated[int(np.argmax(z))] > 0  # top-k keeps the highest logit
    # the most likely token (ties: lowest id; logits 0 and 1e-306 tie once exponentiated)
    assert p[int(np.argmax(untruncated))] > 0
    kept = p > 0
    if opts["top_k"] is not None and opts["top_k"] < vocab:
        kth = np.sort(z)[vocab - opts["top_k"]]
        assert (z[kept] >= kth).all()  # top-k keeps the k highest and their ties, no others
    # monotone in the logits; tied logits that are both kept get equal probability
    order = np.argsort(z, kind="stable")
    zs, ps = z[order], p[order]
    assert (np.diff(ps)[np.diff(zs) > 0] >= 0).all()
    for v in np.unique(z[kept]):
        tied = kept & (z == v)
        assert np.ptp(p[tied]) == 0


@FUZZ
@given(data=st.data())
def test_top_p_keeps_the_smallest_prefix_reaching_the_mass(data):
    logits = data.draw(logits_vectors(min_vocab=2))
    temperature = data.draw(st.floats(0.1, 3.0))
    top_k = data.draw(st.one_of(st.none(), st.integers(1, logits.size)))
    top_p = data.draw(st.floats(1e-3, 0.999))
    full = warp(logits, temperature=temperature, top_k=top_k)
    cut = warp(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    kept = np.flatnonzero(cut > 0)
    mass = full[kept].sum()
    assert mass >= top_p - 1e-9  # reaches top_p
    assert mass - full[kept].min() < top_p + 1e-9  # the last kept token was needed
    dropped = np.setdiff1d(np.flatnonzero(full > 0), kept)
    if dropped.size:
        assert full[dropped].max() <= full[kept].min()  # a prefix of the most likely tokens
    np.testing.assert_allclose(cut[kept], full[kept] / mass, rtol=1e-9)


# -- accept_or_resample ---------------------------------------------------------------------------


@FUZZ
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_accept_or_resample_emits_a_possible_token(data, seed):
    rng = np.random.default_rng(seed)
    logits = data.draw(logits_vectors(min_vocab=1, max_vocab=30))
    vocab = logits.size
    p_target = warp(logits, **data.draw(sampling(vocab)))
    token, draft = data.draw(draft_dists(vocab, rng))
    out, accepted = accept_or_resample(p_target, draft, token, rng)
    assert isinstance(out, int) and 0 <= out < vocab
    assert p_target[out] > 0  # never a token the target cannot produce
    q = draft.prob(token)
    if accepted:
        assert out == token
    if p_target[token] >= q:
        assert accepted  # min(1, p / q) = 1: certain
    if p_target[token] == 0:
        assert not accepted  # impossible for the target: never accepted
    if not accepted and draft.is_point and p_target[token] < 1 - 1e-9:
        assert out != token  # the residual of a point mass has no mass on the drafted token


# -- verify_block --------------------------------------------------------------------------------


@FUZZ
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_verify_block_emits_accepted_drafts_then_one_token(data, seed):
    rng = np.random.default_rng(seed)
    vocab = data.draw(st.integers(1, 16))
    k = data.draw(st.integers(0, 6))
    logits = np.array(data.draw(st.lists(st.lists(_logit, min_size=vocab, max_size=vocab),
                                         min_size=k + 1, max_size=k + 1)))  # [k + 1, vocab]
    drafts = [data.draw(draft_dists(vocab, rng)) for _ in range(k)]
    block = DraftBlock(tuple(t for t, _ in drafts), tuple(d for _, d in drafts))
    opts = data.draw(sampling(vocab))
    outcome = verify_block(logits, block, rng, **opts)
    n = outcome.n_accepted
    assert 0 <= n <= k and len(outcome.tokens) == n + 1
    assert outcome.tokens[:n] == list(block.tokens[:n])
    assert outcome.recovered == (n < k)
    for i, tok in enumerate(outcome.tokens):
        assert 0 <= tok < vocab
        assert warp(logits[i], **opts)[tok] > 0
    if opts["temperature"] == 0:
        greedy = np.argmax(logits, axis=-1)
        first_miss = next((i for i in range(k) if block.tokens[i] != greedy[i]), k)
        assert n == first_miss and outcome.tokens[-1] == greedy[n]


# -- prompt lookup against a brute-force reference -----------------------------------------------


def lookup_reference(history: Sequence[int], max_n: int, min_n: int, limit: int,
                     prefer: str) -> tuple[list[int], int]:
    """The longest tail of max_n..min_n tokens that occurred earlier with a continuation; the
    most recent (or first) such occurrence; up to `limit` tokens after it."""
    h = list(history)
    if limit <= 0:
        return [], 0
    for n in range(min(max_n, len(h) - 1), min_n - 1, -1):
        tail = h[len(h) - n:]
        ends = [e for e in range(n, len(h)) if h[e - n:e] == tail]  # e < len(h): continues
        if ends:
            e = max(ends) if prefer == "recent" else min(ends)
            return h[e:e + limit], n
    return [], 0


@FUZZ
@given(
    alphabet=st.integers(1, 4),
    ops=st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 3), max_size=12)),
                 min_size=1, max_size=8),
    max_n=st.integers(1, 4),
    min_n_delta=st.integers(0, 3),
    max_draft_len=st.integers(0, 6),
    max_tokens=st.lists(st.integers(0, 8), min_size=8, max_size=8),
    prefer=st.sampled_from(["recent", "first"]),
)
def test_prompt_lookup_matches_the_brute_force_reference(alphabet, ops, max_n, min_n_delta,
                                                         max_draft_len, max_tokens, prefer):
    """Over a growing history (the decode loop's usage: one list, appended to) and histories
    that diverge (a new request, an edited history): the incremental index agrees with a
    rescan every time, and never modifies the history."""
    min_n = max(1, max_n - min_n_delta)
    drafter = PromptLookupSpeculator(max_n, max_draft_len, min_n, prefer=prefer)
    history: list[int] = []
    for (fresh, tokens), mt in zip(ops, max_tokens):
        tokens = [t % alphabet for t in tokens]
        if fresh:
            history = list(tokens)  # a different list object: the drafter must notice
        else:
            history.extend(tokens)
        if not history:
            continue
        before = list(history)
        block = drafter.propose(history, mt)
        assert history == before
        expected, n = lookup_reference(history, max_n, min_n, min(max_draft_len, mt), prefer)
        assert list(block.tokens) == expected, (history, max_n, min_n, mt)
        if expected:
            assert block.match_len == n and block.source == "prompt_lookup"
            assert all(d.is_point for d in block.dists)


@FUZZ
@given(history=st.lists(st.integers(0, 2), min_size=1, max_size=40),
       cut=st.integers(0, 40), extra=st.lists(st.integers(0, 2), max_size=10))
@example(history=[0, 0, 1, 0], cut=0, extra=[0, 0, 0])
def test_prompt_lookup_after_the_history_shrinks_or_changes_in_place(history, cut, extra):
    """The same list object truncated and regrown (an edited conversation): still the reference.

    Found: history [0, 0, 1, 0], proposed; cut to [0] and regrown to [0, 0, 0, 0] in place:
    the index still holds the old [0, 0, 1, 0] and drafts [1, 0] where a rescan gives [0].
    (The decode loops only ever append, so their drafts are unaffected; a caller that reuses
    one list gets stale drafts: still lossless, but rejected.)"""
    drafter = PromptLookupSpeculator(3, 5)
    drafter.propose(history, 5)
    del history[min(cut, len(history) - 1) + 1:]
    history.extend(extra)
    block = drafter.propose(history, 5)
    assert list(block.tokens) == lookup_reference(history, 3, 1, 5, "recent")[0]


# -- the decode loop with random drafters ----------------------------------------------------------


class FuzzDrafter(DrafterBase):
    """Blocks of random length (0..max_tokens) of random tokens, each drawn from a random
    distribution (point masses or Dirichlet over a random support), from its own seed."""

    def __init__(self, vocab: int, seed: int, point_share: float) -> None:
        self.vocab, self.rng, self.point_share = vocab, np.random.default_rng(seed), point_share

    def propose(self, history: Sequence[int], max_tokens: int) -> DraftBlock:
        k = int(self.rng.integers(0, max_tokens + 1))
        tokens, dists = [], []
        for _ in range(k):
            if self.rng.random() < self.point_share:
                t = int(self.rng.integers(0, self.vocab))
                d = DraftDist.point(t)
            else:
                size = int(self.rng.integers(1, self.vocab + 1))
                support = np.sort(self.rng.choice(self.vocab, size=size, replace=False))
                probs = self.rng.dirichlet(np.full(size, 0.5)) + 1e-9
                d = DraftDist(support, probs / probs.sum())
                t = int(self.rng.choice(support, p=d.probs))
            tokens.append(t)
            dists.append(d)
        return DraftBlock(tuple(tokens), tuple(dists), source="fuzz")


@FUZZ_SLOW
@given(
    vocab=st.integers(2, 9),
    capacity=st.integers(4, 40),
    prompt_len=st.integers(1, 40),
    max_new=st.integers(1, 48),
    temperature=st.one_of(st.just(0.0), st.floats(0.2, 2.5)),
    top_k=st.one_of(st.none(), st.integers(1, 9)),
    top_p=st.one_of(st.none(), st.floats(0.05, 1.0)),
    seed=st.integers(0, 10_000),
    drafter_kind=st.sampled_from(["random", "points", "lookup"]),
    max_draft_len=st.one_of(st.none(), st.integers(0, 6)),
    max_verify_len=st.one_of(st.none(), st.integers(1, 5)),
    n_stops=st.integers(0, 2),
)
def test_decode_loop_invariants_with_random_drafters(vocab, capacity, prompt_len, max_new,
                                                     temperature, top_k, top_p, seed, drafter_kind,
                                                     max_draft_len, max_verify_len, n_stops):
    assume(prompt_len <= capacity)
    cfg = ReferenceConfig(vocab_size=vocab, d_model=8, n_layers=1, n_heads=2, capacity=capacity,
                          logit_scale=3.0, seed=seed % 7)
    decoder = ReferenceDecoder(cfg, max_verify_len=max_verify_len)
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, vocab, size=prompt_len).tolist()
    stops = tuple(int(t) for t in rng.choice(vocab, size=n_stops, replace=False))
    options = SpeculativeOptions(max_new, temperature=temperature, top_k=top_k, top_p=top_p,
                                 seed=seed, stop_token_ids=stops, max_draft_len=max_draft_len)
    if drafter_kind == "lookup":
        drafter = PromptLookupSpeculator(ngram_size=2, max_draft_len=4)
    else:
        drafter = FuzzDrafter(vocab, seed + 1, 1.0 if drafter_kind == "points" else 0.3)
    res = speculative_decode_with(decoder, prompt, drafter, options)
    toks = res.tokens
    c = res.counters

    assert all(isinstance(t, int) and 0 <= t < vocab for t in toks)
    assert 1 <= len(toks) <= max_new
    assert not any(t in stops for t in toks[:-1])  # a stop token ends the decode at once
    if res.finish_reason == "length":
        assert len(toks) == max_new and (not toks or toks[-1] not in stops)
    elif res.finish_reason == "stop":
        assert toks[-1] in stops
    else:
        assert res.finish_reason == "capacity"
        assert len(prompt) + len(toks) == capacity + 1  # the last token is never fed
    assert decoder.length <= capacity

    assert c.emitted == len(toks)  # tokens = accepted + recovered + bonus
    assert 0 <= c.accepted <= c.drafted and c.rejected == c.drafted - c.accepted >= 0
    assert c.drafted == sum(c.drafted_by_position) and c.accepted == sum(c.accepted_by_position)
    # every target call ends in one recovered or bonus token, except a call whose accepted
    # drafts already emitted a stop token
    stopped_in_block = res.finish_reason == "stop" and c.recovered + c.bonus == c.target_calls - 1
    assert c.recovered + c.bonus == c.target_calls or stopped_in_block
    if max_draft_len is not None:
        assert len(c.drafted_by_position) <= max_draft_len
    if max_verify_len is not None:
        assert len(c.drafted_by_position) <= max(0, max_verify_len - 1)
    if temperature == 0:
        decoder.reset()
        assert toks == plain_decode(decoder, prompt, options).tokens  # greedy identity
