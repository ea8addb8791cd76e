"""One loaded model, many requests: interleaved streams and threads give the serial outputs.

A `Model` shares its sessions and gives each request a slot of its own (KV buffers, bindings,
length), its own drafter and its own policy view. Interleaving two streams, or decoding from
four threads at once, must give token for token what the same requests give one after another:
at temperature 0, and above it with a seed. State that one request owns, used by a second one
meanwhile, is a ConcurrentUseError; a pool with no free slot waits or says ModelBusyError.
"""

from __future__ import annotations

import threading

import pytest

from ortspec.runtime import (
    ConcurrentUseError,
    ModelBusyError,
    PromptLookupSpeculator,
    SpeculativeOptions,
    decode_steps,
    load_model,
)

PROMPTS = [
    "Repeat after me: the cat sat on the mat, the cat sat on the mat, the cat",
    "Speculative decoding drafts several tokens and verifies them in one pass. Speculative",
    "Hello, world! What is the capital of France? Paris is the capital. What is",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
]
# (drafter, temperature, seed): greedy and seeded sampling, speculative and plain
REQUESTS = [("prompt-lookup", 0.0, None), (None, 0.0, None), ("prompt-lookup", 0.8, 7), (None, 1.0, 3)]


TINY_EXPORT = {"seed": 11, "capacity": 256, "max_verify_len": 8}  # the tiny_dir fixture


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(tiny_dir, max_concurrent=4)


def _options(temperature, seed, n=40):
    return SpeculativeOptions(n, temperature=temperature, seed=seed)


def _serial(model, cases, n=40):
    return [model.generate(p, drafter=d, options=_options(t, s, n)).tokens for p, (d, t, s) in cases]


def _cases():
    return [(p, r) for p in PROMPTS for r in REQUESTS]


def test_interleaved_streams_give_the_serial_outputs(tiny):
    cases = _cases()
    serial = _serial(tiny, cases)
    for (pa, ra), (pb, rb), want_a, want_b in zip(cases[::2], cases[1::2], serial[::2], serial[1::2]):
        a = tiny.stream(pa, drafter=ra[0], options=_options(ra[1], ra[2]))
        b = tiny.stream(pb, drafter=rb[0], options=_options(rb[1], rb[2]))
        ia, ib = iter(a), iter(b)
        done = {"a": False, "b": False}
        while not all(done.values()):  # one piece of a, one piece of b, ...
            for name, it in (("a", ia), ("b", ib)):
                if not done[name]:
                    done[name] = next(it, None) is None
        assert a.result.tokens == want_a
        assert b.result.tokens == want_b
    assert tiny.slots.in_use == 0  # every slot went back


def test_four_threads_give_the_serial_outputs(tiny):
    cases = _cases() * 2  # 32 requests, 8 per thread
    serial = _serial(tiny, cases)
    got: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def work(worker):
        try:
            barrier.wait()
            for i in range(worker, len(cases), 4):
                p, (d, t, s) = cases[i]
                got[i] = tiny.generate(p, drafter=d, options=_options(t, s)).tokens
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert [got[i] for i in range(len(cases))] == serial
    assert 1 <= tiny.slots.made <= 4 and tiny.slots.in_use == 0


def test_more_threads_than_slots_wait_for_one(tiny_dir):
    model = load_model(tiny_dir, max_concurrent=2)
    want = model.generate(PROMPTS[0], options=_options(0.0, None)).tokens
    results: list[list[int]] = []
    threads = [threading.Thread(target=lambda: results.append(
        model.generate(PROMPTS[0], options=_options(0.0, None)).tokens)) for _ in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert results == [want] * 6
    assert model.slots.made <= 2


def test_a_full_pool_refuses_with_a_specific_error_when_told_not_to_wait(tiny_dir):
    model = load_model(tiny_dir, max_concurrent=1, when_busy="error")
    first = iter(model.stream(PROMPTS[0], options=_options(0.0, None)))
    next(first)  # holds the only slot
    second = model.stream(PROMPTS[1], options=_options(0.0, None))
    with pytest.raises(ModelBusyError, match="all 1 decode slots of this model are in use"):
        next(iter(second))
    first.close()  # an abandoned stream gives its slot back
    assert model.slots.in_use == 0
    assert model.generate(PROMPTS[1], options=_options(0.0, None)).tokens


def test_a_thread_holding_every_slot_is_refused_instead_of_waiting_for_itself(tiny_dir):
    model = load_model(tiny_dir, max_concurrent=2)  # when_busy="wait"
    held = [iter(model.stream(p, options=_options(0.0, None))) for p in PROMPTS[:2]]
    for it in held:
        next(it)
    with pytest.raises(ModelBusyError, match="held by this thread"):
        next(iter(model.stream(PROMPTS[2], options=_options(0.0, None))))
    for it in held:
        it.close()


def test_a_wait_for_a_slot_can_time_out(tiny_dir):
    model = load_model(tiny_dir, max_concurrent=1, busy_timeout=0.2)
    held = iter(model.stream(PROMPTS[0], options=_options(0.0, None)))
    next(held)
    failed: list[BaseException] = []

    def other():
        try:
            model.generate(PROMPTS[1], options=_options(0.0, None))
        except ModelBusyError as e:
            failed.append(e)

    th = threading.Thread(target=other)
    th.start()
    th.join(timeout=30)
    assert len(failed) == 1 and "waited 0.2 s" in str(failed[0])
    held.close()


def test_state_one_request_owns_is_refused_to_a_second(tiny):
    """A drafter object, a policy object or a decoder passed to two decodes at once."""
    drafter = PromptLookupSpeculator()
    a = iter(tiny.stream(PROMPTS[0], drafter=drafter, options=_options(0.0, None)))
    next(a)
    with pytest.raises(ConcurrentUseError, match="this drafter"):
        next(iter(tiny.stream(PROMPTS[1], drafter=drafter, options=_options(0.0, None))))
    a.close()
    assert tiny.generate(PROMPTS[1], drafter=drafter, options=_options(0.0, None)).tokens  # free again

    policy = tiny.draft_length_policy().for_request()
    a = iter(tiny.stream(PROMPTS[0], draft_length=policy, options=_options(0.0, None)))
    next(a)
    with pytest.raises(ConcurrentUseError, match="this policy"):
        next(iter(tiny.stream(PROMPTS[1], draft_length=policy, options=_options(0.0, None))))
    a.close()

    ids = tiny.encode(PROMPTS[0])
    dec = tiny.decoder  # the caller's own decoder, outside the pool
    one = decode_steps(dec, ids, None, _options(0.0, None))  # plain decoding
    next(one)
    two = decode_steps(dec, ids, PromptLookupSpeculator(), _options(0.0, None))
    with pytest.raises(ConcurrentUseError, match="this decoder"):
        next(two)
    one.close()


def test_a_decoder_called_from_a_second_thread_mid_call_is_an_error_not_a_crash(tiny):
    dec = tiny.decoder
    dec.reset()
    dec._busy.acquire()  # as while another thread's call runs
    try:
        with pytest.raises(ConcurrentUseError, match="in use by another thread"):
            dec.forward_token(5)
        with pytest.raises(ConcurrentUseError):
            dec.truncate(0)
    finally:
        dec._busy.release()
    assert dec.length == 0  # nothing was half done
    dec.forward_token(5)
    assert dec.length == 1


def test_the_shared_policy_learns_from_every_thread(tiny):
    shared = tiny.draft_length_policy()
    before = len(shared.chosen)
    threads = [threading.Thread(target=tiny.generate, args=(p,), kwargs={"options": _options(0.0, None)})
               for p in PROMPTS]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(shared.chosen) > before  # each request's view recorded its choices in the shared report
    assert shared.acceptance._global  # and its outcomes in the shared counts


def test_slot_memory_is_what_the_docs_state(tiny):
    s = tiny.sessions
    a = s.manifest.architecture
    assert s.kv_bytes_per_decoder == a.num_layers * 2 * a.num_kv_heads * s.capacity * a.head_dim * 4
    assert tiny.slot_bytes == s.kv_bytes_per_decoder + s.logits_bytes_per_decoder


def test_load_model_refuses_bad_pool_options(tiny_dir):
    from ortspec.runtime import InvalidOptionError

    with pytest.raises(InvalidOptionError, match="max_concurrent must be an integer >= 1, got 0"):
        load_model(tiny_dir, max_concurrent=0)
    with pytest.raises(InvalidOptionError, match="when_busy must be one of wait, error, got 'later'"):
        load_model(tiny_dir, when_busy="later")
    with pytest.raises(InvalidOptionError, match="busy_timeout must be None or a number"):
        load_model(tiny_dir, busy_timeout=-1)


# -- the real default model ---------------------------------------------------------------------


@pytest.mark.slow
def test_the_default_model_serves_interleaved_and_threaded_requests_exactly():
    pytest.importorskip("onnx", reason="the export extra makes the default model")
    from ortspec import export
    model = load_model(export.ensure_default_model("fp32", progress=False))
    prompts = ["Write a haiku about the sea.", "List three prime numbers and explain why each is prime.",
               "Rewrite this sentence in the past tense: the cat sits on the mat and the dog sits on the mat.",
               "What is the capital of France?"]
    cases = [(p, r) for p in prompts for r in REQUESTS[:3]]

    def run(p, r):
        o = SpeculativeOptions(32, temperature=r[1], seed=r[2])
        return model.generate(p, chat=True, drafter=r[0], options=o).tokens

    serial = [run(p, r) for p, r in cases]
    streams = [model.stream(p, chat=True, drafter=r[0], options=SpeculativeOptions(32, temperature=r[1], seed=r[2]))
               for p, r in cases[:2]]
    its = [iter(s) for s in streams]
    live = [True, True]
    while any(live):
        for i, it in enumerate(its):
            if live[i]:
                live[i] = next(it, None) is not None
    assert [s.result.tokens for s in streams] == serial[:2]

    got: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda w=w: got.update(
        {i: run(*cases[i]) for i in range(w, len(cases), 4)})) for w in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert [got.get(i) for i in range(len(cases))] == serial


@pytest.mark.parametrize("drafter", ["prompt-lookup", None])
def test_a_stream_closed_early_keeps_its_tokens_and_counts(tiny, drafter):
    """What a server needs after a stop string or a client gone: the tokens and counters so far."""
    s = tiny.stream(PROMPTS[0], drafter=drafter, options=_options(0.0, None))
    it = iter(s)
    for _ in range(3):
        next(it)
    it.close()
    assert s.result is None and tiny.slots.in_use == 0
    full = tiny.generate(PROMPTS[0], drafter=drafter, options=_options(0.0, None)).tokens
    assert s.tokens and s.tokens == full[:len(s.tokens)]
    assert s.counters.emitted == len(s.tokens)
    assert s.counters.target_calls >= 3


def test_start_gives_a_token_stream_that_owns_its_slot_and_prepares_up_front(tiny_dir, monkeypatch):
    """`Model.start`: the cost model is made before the stream is returned, never inside its
    first next(); the stream yields a list of tokens per target call, takes its slot at the
    first next() and gives it back at the end; generate and stream give the same tokens, and
    the text of any token iterator is its detokenised text."""
    import ortspec.runtime.costs as costs_mod
    from ortspec.runtime import Detokenizer, detokenize

    model = load_model(tiny_dir, max_concurrent=2)
    assert not model.prepared
    stream = model.start(PROMPTS[0], options=_options(0.0, None))
    assert model.prepared and model.slots.in_use == 0  # prepared in start; no slot yet
    monkeypatch.setattr(costs_mod, "calibrated_cost_curve",
                        lambda *a, **k: pytest.fail("calibrated inside the stream"))
    steps = list(stream)
    assert model.slots.in_use == 0 and all(isinstance(s, list) and s for s in steps)
    assert [t for s in steps for t in s] == stream.tokens == stream.result.tokens
    assert stream.result.counters.target_calls == len(steps)
    assert stream.result.tokens == model.generate(PROMPTS[0], options=_options(0.0, None)).tokens
    assert stream.result.text == "".join(detokenize(iter(stream.tokens), model.decode))
    detok = Detokenizer(model.decode)
    text = "".join(detok.add(t) for t in stream.tokens) + detok.finish()
    assert text == stream.result.text == "".join(model.stream(PROMPTS[0], options=_options(0.0, None)))


def test_load_model_can_calibrate_up_front(tiny_dir):
    assert load_model(tiny_dir, calibrate=True).prepared
