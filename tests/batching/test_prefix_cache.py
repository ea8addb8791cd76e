"""The prefix cache (`ortspec.runtime.batching.prefix_cache`): prompts that start the same copy the keys
and values of the shared tokens instead of computing them.

The cache itself: longest common prefix, never a whole prompt, the byte budget, least recently
used out first, prefixes a longer prompt extends replaced. On the reference model through the
runner: a prompt sharing a prefix prefills only the rest, and every request decodes exactly as
alone, concurrent requests and sampling included. On the real default model (window export):
a prompt's prefill logits after a copied prefix are bitwise those computed whole, and chat
requests sharing the system prompt give their solo outputs; `ortspec serve` reports the hits.
On the default int4 export, which decodes each request on calls of its own, the slots' shared
cache (`SharedPrefixCache`) does the same: bitwise prefills, every request as with no cache,
concurrent requests and a conversation's next turn included; the fp32 export, whose rows are
not bitwise alike across calls, keeps none.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from helpers.decode import GREEDY
from helpers.threads import in_threads
from ortspec.runtime import (
    PromptLookupSpeculator,
    ReferenceDecoder,
    SpeculativeOptions,
    plain_decode,
    speculative_decode_with,
)
from ortspec.runtime.batching.backend import ReferenceBatchBackend
from ortspec.runtime.batching.runner import BatchRunner
from ortspec.runtime.errors import InvalidOptionError
from ortspec.runtime.batching.prefix_cache import PrefixCache

CONFIG = GREEDY  # the reference model of the greedy decode tests


def _t(*tokens: int) -> np.ndarray:
    return np.array(tokens, np.int64)


# -- the cache ---------------------------------------------------------------------------------


def test_the_longest_shared_prefix_is_found_and_the_last_token_is_left_to_compute():
    cache = PrefixCache(1000)
    cache.add(_t(1, 2, 3, 4), "a", 40)
    cache.add(_t(1, 2, 9), "b", 30)
    cache.add(_t(7, 8), "c", 20)
    assert cache.match(_t(1, 2, 3, 5, 6)) == (cache._entries[0], 3)
    entry, n = cache.match(_t(1, 2, 9, 9))
    assert (entry.kv, n) == ("b", 3)
    assert cache.match(_t(5, 1, 2)) == (None, 0)  # nothing starts the same
    entry, n = cache.match(_t(1, 2, 3, 4))  # the whole prompt cached: its last token is not
    assert (entry.kv, n) == ("a", 3)
    assert cache.match(_t(7)) == (None, 0)  # a one-token prompt computes its token


def test_the_budget_drops_the_least_recently_used_and_a_longer_prompt_replaces_its_prefix():
    cache = PrefixCache(100)
    cache.add(_t(1, 2), "a", 40)
    cache.add(_t(3, 4), "b", 40)
    cache.match(_t(1, 2, 5))  # "a" used: "b" is now the least recently used
    cache.add(_t(6, 7), "c", 40)
    assert sorted(e.kv for e in cache._entries.values()) == ["a", "c"]
    assert cache.stored_bytes == 80 and len(cache) == 2
    cache.add(_t(1, 2, 8, 9), "a+", 70)  # extends "a": "a" goes, then "c" for the budget
    assert [e.kv for e in cache._entries.values()] == ["a+"]
    assert cache.stored_bytes == 70
    assert not cache.wants(_t(1, 2, 8), 30)  # already covered by "a+"
    assert cache.wants(_t(1, 2, 7), 30)
    assert not cache.wants(_t(5, 5), 101)  # larger than the whole budget
    with pytest.raises(InvalidOptionError, match="prefix cache size"):
        PrefixCache(-1)


# -- through the runner, on the reference model ------------------------------------------------


def _prompts(n: int, shared: int, seed: int = 5) -> list[list[int]]:
    """n prompts that start with the same `shared` tokens, then differ (and repeat a motif, so
    prompt lookup drafts)."""
    rng = np.random.default_rng(seed)
    head = rng.integers(0, CONFIG.vocab_size, size=shared).tolist()
    out = []
    for i in range(n):
        tail = rng.integers(0, CONFIG.vocab_size, size=4 + 3 * i).tolist()
        out.append(head + tail + tail[:3])
    return out


def test_a_prompt_sharing_a_prefix_prefills_only_the_rest_and_decodes_as_alone():
    backend = ReferenceBatchBackend(CONFIG, max_rows=2, max_call=32, min_rows=1)
    runner = BatchRunner(backend, max_verify_len=8, prefill_chunk=32,
                         prefix_cache_bytes=1 << 20)
    prompts = _prompts(3, shared=16)  # each read in one prefill call
    options = SpeculativeOptions(24)
    for i, prompt in enumerate(prompts):
        expected = plain_decode(ReferenceDecoder(CONFIG), prompt, options).tokens
        backend.calls.clear()
        row = runner.row()
        try:
            assert plain_decode(row, prompt, options).tokens == expected
        finally:
            row.release()
        # a decode prefills all of its prompt but the last token, which its first step reads
        prefill_tokens = backend.calls[0][1]  # the first call of a request is its prefill
        assert prefill_tokens == len(prompt) - 1 - (16 if i else 0)
    queried, hit = runner.stats.prefix_snapshot()
    assert queried == sum(len(p) - 1 for p in prompts) and hit == 2 * 16
    # the same prompt again: all but its last token copied
    backend.calls.clear()
    row = runner.row()
    try:
        plain_decode(row, prompts[1], options)
    finally:
        row.release()
    assert backend.calls[0] == (1, 1)
    runner.close()


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 11)])
def test_concurrent_requests_sharing_a_prefix_give_their_solo_outputs(temperature, seed):
    """Six requests on three rows, plain and prompt lookup, all starting with the same 16
    tokens and each sent twice: every output is the one decoded alone without a cache."""
    backend = ReferenceBatchBackend(CONFIG, max_rows=3, max_call=8, min_rows=1)
    runner = BatchRunner(backend, max_verify_len=8, prefix_cache_bytes=1 << 20)
    prompts = _prompts(3, shared=16) * 2
    options = SpeculativeOptions(20, temperature=temperature, seed=seed)

    def decode(decoder, prompt, speculative):
        if speculative:
            drafter = PromptLookupSpeculator(ngram_size=2, max_draft_len=4)
            return speculative_decode_with(decoder, prompt, drafter, options).tokens
        return plain_decode(decoder, prompt, options).tokens

    cases = [(p, s) for p in prompts for s in (False, True)]
    expected = [decode(ReferenceDecoder(CONFIG), p, s) for p, s in cases]
    pool = threading.Semaphore(3)

    def run(case):
        with pool:
            row = runner.row()
            try:
                return decode(row, *case)
            finally:
                row.release()

    assert in_threads(run, cases) == expected
    _, hit = runner.stats.prefix_snapshot()
    assert hit >= 16 * (len(cases) - 3)  # all but the first requests to run found the prefix
    runner.close()


# -- the real default model --------------------------------------------------------------------


@pytest.mark.slow
def test_prefill_after_a_copied_prefix_is_bitwise_the_whole_prefill(window_fp32):
    from ortspec.runtime import load_model
    from ortspec.runtime.ort.decoder import OrtDecoder

    model = load_model(window_fp32, max_concurrent=2)
    assert model.runner is not None and model.runner.prefixes is not None
    solo = OrtDecoder.on(model.sessions)
    first = model.encode("Name a planet.", chat=True)
    second = model.encode("Name three rivers in Europe, with their lengths.", chat=True)
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert shared >= 20  # the system prompt and the template
    for prompt, hit in ((first, 0), (second, shared), (second, len(second) - 1)):
        row = model.runner.row()
        before = model.runner.stats.prefix_snapshot()[1]
        try:
            got = row.prefill(prompt)
            step = row.forward_token(int(np.argmax(got)))
        finally:
            row.release()
        assert model.runner.stats.prefix_snapshot()[1] - before == hit
        solo.reset()
        want = solo.prefill(prompt)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(step, solo.forward_token(int(np.argmax(want))))


@pytest.mark.slow
def test_chat_requests_sharing_the_system_prompt_give_their_solo_outputs(window_fp32):
    from ortspec.runtime import load_model

    solo = load_model(window_fp32, max_concurrent=1, batch=False, prefix_cache_mib=0)
    model = load_model(window_fp32, max_concurrent=3)
    off = load_model(window_fp32, max_concurrent=3, prefix_cache_mib=0)
    assert off.runner is not None and off.runner.prefixes is None
    questions = ["Name a fruit.", "What is 3 + 4?", "Say hello in French.", "Name a fruit."]
    for q in questions:
        for drafter in ("none", "prompt-lookup"):
            options = SpeculativeOptions(16)
            want = solo.generate(q, chat=True, drafter=drafter, options=options).tokens
            assert model.generate(q, chat=True, drafter=drafter, options=options).tokens == want
            assert off.generate(q, chat=True, drafter=drafter, options=options).tokens == want
    queried, hit = model.runner.stats.prefix_snapshot()
    assert hit >= 20 * (2 * len(questions) - 1) and queried > hit
    assert off.runner.stats.prefix_snapshot() == (0, 0)
    with pytest.raises(InvalidOptionError, match="prefix_cache_mib"):
        load_model(window_fp32, max_concurrent=2, prefix_cache_mib=-5)


# -- the default int4 export: a request alone on its calls, the slots sharing one cache ---------


def _chat_prompts(model) -> tuple[list[int], list[int]]:
    first = model.encode("Name a planet.", chat=True)
    second = model.encode("Name three rivers in Europe, with their lengths.", chat=True)
    return first, second


@pytest.mark.slow
def test_an_int4_prefill_after_a_copied_prefix_is_bitwise_the_whole_prefill(int4_model_dir):
    from ortspec.runtime import load_model
    from ortspec.runtime.ort.decoder import OrtDecoder

    model = load_model(int4_model_dir, max_concurrent=2)
    assert model.runner is None and model.sessions.rows_exact and model.prefixes is not None
    cached = OrtDecoder.on(model.sessions, prefixes=model.prefixes)
    solo = OrtDecoder.on(model.sessions)
    assert cached.prefixes is model.prefixes and solo.prefixes is None
    first, second = _chat_prompts(model)
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert shared >= 20  # the system prompt and the template
    # a prompt never seen, one sharing the template, the same again (all but its last token),
    # and one that extends it (a conversation's next turn)
    longer = second + model.encode(" The Danube, the Rhine and the Elbe.")
    for prompt, hit in ((first, 0), (second, shared), (second, len(second) - 1),
                        (longer, len(second))):
        before = model.prefixes.snapshot()[1]
        cached.reset()
        got = cached.prefill(prompt)
        assert model.prefixes.snapshot()[1] - before == hit
        solo.reset()
        want = solo.prefill(prompt)
        np.testing.assert_array_equal(got, want)
        token = int(np.argmax(want))
        np.testing.assert_array_equal(cached.forward_token(token), solo.forward_token(token))
        block = [token, 5, 77, 1000]
        np.testing.assert_array_equal(cached.forward_batch(block), solo.forward_batch(block))


@pytest.mark.slow
def test_a_failing_prefill_after_a_copied_prefix_leaves_an_empty_cache(int4_model_dir,
                                                                       monkeypatch):
    from ortspec.runtime import load_model
    from ortspec.runtime.ort.decoder import OrtDecoder

    model = load_model(int4_model_dir, max_concurrent=1)
    decoder = OrtDecoder.on(model.sessions, prefixes=model.prefixes)
    first, second = _chat_prompts(model)
    decoder.prefill(first)
    stored = len(model.prefixes)

    def fail(*args, **kwargs):
        raise RuntimeError("the graph failed")

    decoder.reset()
    monkeypatch.setattr(decoder, "_run", fail)
    with pytest.raises(RuntimeError, match="the graph failed"):
        decoder.prefill(second)
    assert decoder.length == 0  # the copied prefix is not left behind
    assert len(model.prefixes) == stored  # nor is the prompt kept


@pytest.mark.slow
def test_int4_requests_sharing_prefixes_decode_as_with_no_cache_at_once(int4_model_dir):
    """Greedy and seeded sampling, with and without prompt lookup, four requests at a time over
    three slots, a conversation's second turn among them: each gives its output with the cache
    off."""
    from ortspec.runtime import load_model

    model = load_model(int4_model_dir, max_concurrent=3)
    off = load_model(int4_model_dir, max_concurrent=1, prefix_cache_mib=0)
    assert off.prefixes is None and model.prefixes is not None
    turn = model.manifest.chat_format.render(
        [{"role": "user", "content": "Name a fruit."},
         {"role": "assistant", "content": "An apple."},
         {"role": "user", "content": "And a vegetable?"}])
    prompts = [model.encode(q, chat=True) for q in
               ("Name a fruit.", "What is 3 + 4?", "Say hello in French.")] + [model.encode(turn)]
    jobs = [(p, drafter, t, seed) for p in prompts for drafter in ("none", "prompt-lookup")
            for t, seed in ((0.0, None), (1.0, 3))]

    def run(m, job):
        prompt, drafter, t, seed = job
        options = SpeculativeOptions(12, temperature=t, seed=seed)
        return m.generate(prompt, drafter=drafter, options=options).tokens

    want = [run(off, job) for job in jobs]
    for start in range(0, len(jobs), 4):
        got = in_threads(lambda job: run(model, job), jobs[start:start + 4], timeout=300)
        assert got == want[start:start + 4]
    queried, hit = model.prefixes.snapshot()
    assert hit >= 20 * (len(jobs) - 1) and queried > hit


@pytest.mark.slow
def test_the_fp32_export_whose_rows_differ_across_calls_keeps_no_prefixes(model_dir):
    from ortspec.runtime import load_model
    from ortspec.runtime.batching.prefix_cache import SharedPrefixCache
    from ortspec.runtime.ort.decoder import OrtDecoder

    model = load_model(model_dir, max_concurrent=1)
    assert not model.sessions.rows_exact and model.prefixes is None
    assert model.prefix_counts() is None
    assert OrtDecoder.on(model.sessions, prefixes=SharedPrefixCache(1 << 20)).prefixes is None
