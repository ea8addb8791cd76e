"""Prompts read together (`BatchRunner`'s prefill calls): the prompts waiting at once share one
call, within the runner's `prefill_chunk` tokens in all, oldest first.

On the reference model: prompts submitted while the runner is busy are read in calls of
several rows, no call reads more than the budget, and every request decodes exactly as alone;
a row between the prompts' rows that has no room for the call's padding is never ridden past
its capacity (the prompt beyond it waits for the next call). On the real window export: prompts
read in one call give bitwise the logits of each prompt prefilled alone, and so does the next
step.
A prompt sharing a long prefix with an older one still being read waits for it and copies it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time

import numpy as np
import pytest

from helpers.decode import GREEDY
from ortspec.runtime import ReferenceDecoder, SpeculativeOptions, plain_decode
from ortspec.runtime.batching.backend import ReferenceBatchBackend
from ortspec.runtime.batching.runner import BatchRunner


@contextlib.contextmanager
def _runner_held(runner: BatchRunner, *, waiting: int):
    """Keeps the runner's thread busy while the body submits work; on leaving, waits until
    `waiting` prefill jobs are queued, then lets the runner go."""
    inside, gate = threading.Event(), threading.Event()

    def hold(backend, floors):
        inside.set()
        gate.wait(60)

    holder = threading.Thread(target=runner.exclusive, args=(hold,))
    holder.start()
    assert inside.wait(60)
    try:
        yield
        deadline = time.monotonic() + 60
        while True:
            with runner._cond:
                if len(runner._prefills) >= waiting:
                    break
            assert time.monotonic() < deadline, "the prefills never arrived"
            time.sleep(0.005)
    finally:
        gate.set()
        holder.join(60)


def _prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, GREEDY.vocab_size, size=n).tolist()


def _prefill_calls(backend: ReferenceBatchBackend, since: int) -> list[tuple[int, list[int]]]:
    """(rows of the call, real tokens in each row) of the calls since `since` that read
    prompts (more than one real token in a row)."""
    out = []
    for (rows, s), real in zip(backend.calls[since:], backend.real[since:], strict=True):
        per_row = np.bincount(np.asarray(real) // s, minlength=rows).tolist()
        if max(per_row) > 1:
            out.append((rows, per_row))
    return out


def _decode_queued_together(runner: BatchRunner, prompts: list[list[int]],
                            options: SpeculativeOptions) -> list[list[int]]:
    """Plain decodes of `prompts`, each on its own row and thread, their prefills all queued
    before the runner reads any of them; the tokens, in order."""
    results: list = [None] * len(prompts)

    def decode(i: int) -> None:
        row = runner.row()
        try:
            results[i] = plain_decode(row, prompts[i], options).tokens
        finally:
            row.release()

    threads = [threading.Thread(target=decode, args=(i,)) for i in range(len(prompts))]
    with _runner_held(runner, waiting=len(prompts)):
        for t in threads:
            t.start()
    for t in threads:
        t.join(120)
    return results


def test_prompts_waiting_together_share_calls_within_the_budget_and_decode_as_alone():
    backend = ReferenceBatchBackend(GREEDY, max_rows=4, max_call=32, min_rows=1)
    runner = BatchRunner(backend, max_verify_len=4, prefill_chunk=24)
    # decoding prefills all but a prompt's last token: 40 tokens. Whatever order they queue
    # in, the first call reads 24 of them from two prompts or more (no three of them sum to 24
    # or less), the second the other 16, from two or more
    prompts = [_prompt(n + 1, seed) for seed, n in enumerate((10, 14, 7, 9))]
    options = SpeculativeOptions(12)
    expected = [plain_decode(ReferenceDecoder(GREEDY), p, options).tokens for p in prompts]
    since = len(backend.calls)
    assert _decode_queued_together(runner, prompts, options) == expected
    calls = _prefill_calls(backend, since)
    assert sum(map(sum, (per_row for _, per_row in calls))) == 40
    assert [sum(per_row) for _, per_row in calls] == [24, 16]  # the budget, over all rows
    assert all(sum(n > 0 for n in per_row) >= 2 for _, per_row in calls)
    assert runner.stats.prefill_calls == 2
    runner.close()


def test_prompts_arriving_with_a_shared_prefix_compute_it_once():
    """Four prompts starting with the same 20 tokens arrive together (a chat system prompt):
    the oldest is read first, the others wait for it and copy its 20 tokens; a fifth that
    shares nothing with them is read at once, in the first call. Every output is its solo
    decode."""
    backend = ReferenceBatchBackend(GREEDY, max_rows=5, max_call=32, min_rows=1)
    runner = BatchRunner(backend, max_verify_len=4, prefill_chunk=64, prefix_cache_bytes=1 << 20)
    system = _prompt(20, 40)
    prompts = [system + _prompt(n, 41 + n) for n in (6, 9, 3, 12)]
    other = _prompt(11, 50)
    while other[0] == system[0]:
        other = other[1:]
    options = SpeculativeOptions(8)
    cases = prompts + [other]
    expected = [plain_decode(ReferenceDecoder(GREEDY), p, options).tokens for p in cases]
    since = len(backend.calls)
    assert _decode_queued_together(runner, cases, options) == expected
    queried, hit = runner.stats.prefix_snapshot()
    assert hit == 20 * 3  # the system prompt computed once, copied three times
    assert queried == sum(len(p) - 1 for p in cases)
    calls = _prefill_calls(backend, since)
    assert len(calls[0][1]) >= 2  # the first call read two prompts: the oldest and `other`
    assert sum(map(sum, (per_row for _, per_row in calls))) == \
        sum(len(p) - 1 for p in cases) - 60
    runner.close()


@pytest.mark.parametrize("rider_length, shared", [(150, False), (100, True)])
def test_a_row_between_the_prompts_is_ridden_only_where_it_has_room(rider_length, shared):
    """Rows 0 and 2 read 20 tokens while row 1, decoding, rides along between them: it takes
    the call's 20 padding positions past its valid length only if its 160 slots hold them.
    Otherwise row 2's prompt waits for a call of its own. Both prompts read exactly."""
    config = dataclasses.replace(GREEDY, capacity=160)
    backend = ReferenceBatchBackend(config, max_rows=3, max_call=32, min_rows=1)
    runner = BatchRunner(backend, max_verify_len=4, prefill_chunk=48)
    first, rider, third = runner.row(), runner.row(), runner.row()
    head, rest = _prompt(5, 10), _prompt(20, 11)
    first.prefill(head)  # row 0
    rider.prefill(_prompt(rider_length, 12))  # row 1, then decoding (no job waiting)
    assert (first.index, rider.index) == (0, 1)
    new_prompt = _prompt(20, 13)
    got: dict = {}
    since = len(backend.calls)
    with _runner_held(runner, waiting=2):
        threads = [threading.Thread(target=lambda: got.__setitem__(0, first.prefill(rest))),
                   threading.Thread(target=lambda: got.__setitem__(2, third.prefill(new_prompt)))]
        for t in threads:
            t.start()
    for t in threads:
        t.join(120)
    assert third.index == 2 and rider.length == rider_length
    calls = _prefill_calls(backend, since)
    if shared:
        assert calls == [(3, [20, 0, 20])]
    else:
        assert calls == [(1, [20]), (1, [20])]
    solo = ReferenceDecoder(config)
    np.testing.assert_allclose(got[0], solo.prefill(head + rest), rtol=1e-10, atol=1e-12)
    solo.reset()
    np.testing.assert_allclose(got[2], solo.prefill(new_prompt), rtol=1e-10, atol=1e-12)
    for row in (first, rider, third):
        row.release()
    runner.close()


# -- the real default model --------------------------------------------------------------------


@pytest.mark.slow
def test_prompts_read_in_one_call_are_bitwise_each_read_alone(window_fp32):
    from ortspec.runtime import load_model
    from ortspec.runtime.ort.decoder import OrtDecoder

    model = load_model(window_fp32, max_concurrent=3, prefix_cache_mib=0)
    runner = model.runner
    assert runner is not None
    shapes: list[tuple[int, int, int]] = []  # (rows, S, real tokens) of each call
    run = runner.backend.run

    def recording_run(lo, hi, ids, lengths, *, take=None, real=None):
        shapes.append((hi - lo, ids.shape[1], ids.size if real is None else len(real)))
        return run(lo, hi, ids, lengths, take=take, real=real)

    runner.backend.run = recording_run
    prompts = [model.encode(q, chat=True) for q in
               ("Name a planet.", "Write two lines about rivers and the sea at night.",
                "What is 12 times 7?")]
    rows = [runner.row() for _ in prompts]
    got: list = [None] * len(prompts)
    steps: list = [None] * len(prompts)

    def read(i: int) -> None:
        got[i] = rows[i].prefill(prompts[i])
        steps[i] = rows[i].forward_token(int(np.argmax(got[i])))

    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(prompts))]
    with _runner_held(runner, waiting=len(prompts)):
        for t in threads:
            t.start()
    for t in threads:
        t.join(120)
    for row in rows:
        row.release()
    assert any(rows_ >= 2 and real > rows_ for rows_, _, real in shapes)  # prompts shared a call
    solo = OrtDecoder.on(model.sessions)
    for prompt, logits, step in zip(prompts, got, steps, strict=True):
        solo.reset()
        want = solo.prefill(prompt)
        np.testing.assert_array_equal(logits, want)
        np.testing.assert_array_equal(step, solo.forward_token(int(np.argmax(want))))
