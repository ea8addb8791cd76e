"""Batched decoding (`ortspec.runtime.batching.runner`): several requests, one model call a step.

On the NumPy reference model (`ReferenceBatchBackend`, one exact decoder a row) the scheduling
is tested as a user meets it, through `BatchRow` decoders in threads: every row's greedy output
equals its solo decode whatever it is batched with, rows joining and leaving (and being moved
to keep the pool contiguous) included; sampled rows follow the target's exact marginals
(chi-squared over the whole support); a row whose logits turn non-finite fails its request
only. On the real default model exported with `--attention window` (fp32 and int4): the
batched graph's rows are bitwise their solo calls, concurrent requests through `Model` give
their serial outputs, greedy and seeded, plain and speculative; and `ortspec serve` on it
answers concurrent openai clients with the serial texts, bad requests in between, and reports
the batch sizes in /metrics.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from ortspec.runtime import (
    PromptLookupSpeculator,
    ReferenceConfig,
    ReferenceDecoder,
    SpeculativeOptions,
    plain_decode,
    speculative_decode_with,
)
from ortspec.runtime.batching.backend import ReferenceBatchBackend
from ortspec.runtime.batching.runner import BatchRunner
from ortspec.runtime.draft_length.calibration import CostCurve, CostSurface
from ortspec.runtime.draft_length import batch as batch_costs
from ortspec.runtime.draft_length.batch import LOAD_MARGIN, BatchCorrection, BatchCosts
from ortspec.runtime.draft_length.policy import AcceptanceModel, AdaptiveDraftLength
from ortspec.runtime.errors import InvalidOptionError, NonFiniteLogitsError
from ortspec.runtime.ort.graph_io import TOKEN_ROWS, call_width, logit_rows_for, token_rows_for
from ortspec.runtime.decoding.sampling import DraftBlock
from helpers.stats import assert_matches_marginals
from helpers.decode import SMALL, exact_marginals
from helpers.threads import in_threads

GREEDY = ReferenceConfig(vocab_size=24, d_model=32, n_layers=2, n_heads=4, capacity=160,
                         logit_scale=4.0, seed=1)


def _prompts(n: int, seed: int = 3) -> list[list[int]]:
    """Prompts with repeats in them (so prompt lookup drafts), of different lengths."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        motif = rng.integers(0, GREEDY.vocab_size, size=5).tolist()
        noise = rng.integers(0, GREEDY.vocab_size, size=3 + 4 * i % 11).tolist()
        out.append(noise + motif + noise[:2] + motif)
    return out


# -- the scheduling, on the reference model -------------------------------------------------------


@pytest.mark.parametrize("min_rows", [1, 2])
def test_batched_rows_decode_exactly_as_alone_greedy(min_rows):
    """Six requests on four rows (two wait for a row, taking the rows others gave back), plain
    and speculative: every output equals its solo decode, and the calls did carry several rows."""
    backend = ReferenceBatchBackend(GREEDY, max_rows=4, max_call=8, min_rows=min_rows)
    runner = BatchRunner(backend, max_verify_len=8)
    prompts = _prompts(6)
    options = SpeculativeOptions(40)
    solo = ReferenceDecoder(GREEDY)
    expected = [plain_decode(solo, p, options).tokens for p in prompts]
    pool = threading.Semaphore(4)

    def decode(job):
        prompt, speculative = job
        with pool:
            row = runner.row()
            try:
                if speculative:
                    drafter = PromptLookupSpeculator(ngram_size=2, max_draft_len=5)
                    return speculative_decode_with(row, prompt, drafter, options)
                return plain_decode(row, prompt, options)
            finally:
                row.release()

    for speculative in (False, True):
        backend.calls.clear()
        results = in_threads(decode, [(p, speculative) for p in prompts])
        assert [r.tokens for r in results] == expected
        assert max(rows for rows, _ in backend.calls) >= 2
        if speculative:
            assert sum(r.counters.accepted for r in results) > 0
            assert max(s for _, s in backend.calls) > 2
        # min_rows counts a call's tokens in all: one row alone pads its step to two tokens,
        # several rows step one token each (the window graph pads their attention itself)
        assert all(rows * s >= min_rows for rows, s in backend.calls)
        if not speculative:
            assert any(rows >= 2 and s == 1 for rows, s in backend.calls)
    runner.close()


def test_a_row_of_a_backend_without_hidden_states_says_so():
    """`BatchRow.last_hidden_states` on a backend that returns none names the export option
    that adds them, before and after a call, and the row decodes on."""
    runner = BatchRunner(ReferenceBatchBackend(GREEDY, max_rows=2, max_call=8), max_verify_len=8)
    row = runner.row()
    assert row.hidden_state_layers is None
    for _ in range(2):
        with pytest.raises(InvalidOptionError, match="returns no hidden states .*--draft-head"):
            row.last_hidden_states()
        assert row.forward_token(3).shape == (GREEDY.vocab_size,)
    row.release()
    runner.close()


def test_a_row_leaving_moves_the_last_row_into_its_place():
    """A short request ends while longer ones run: the pool stays contiguous (the last row is
    moved into the hole) and the moved request goes on exactly."""
    backend = ReferenceBatchBackend(GREEDY, max_rows=3, max_call=8)
    moves: list[tuple[int, int]] = []
    move = backend.move
    backend.move = lambda src, dst, length: (moves.append((src, dst)), move(src, dst, length))
    runner = BatchRunner(backend, max_verify_len=8)
    prompts = _prompts(3, seed=5)
    budgets = [6, 50, 50]
    solo = ReferenceDecoder(GREEDY)
    expected = [plain_decode(solo, p, SpeculativeOptions(n)).tokens
                for p, n in zip(prompts, budgets, strict=True)]
    rows = [runner.row() for _ in prompts]
    for row in rows:  # take rows 0, 1, 2 in order
        row.prefill([0])
        row.reset()

    def decode(i):
        try:
            return plain_decode(rows[i], prompts[i], SpeculativeOptions(budgets[i])).tokens
        finally:
            rows[i].release()

    assert in_threads(decode, [0, 1, 2]) == expected
    assert (2, 0) in moves or (1, 0) in moves
    runner.close()


def test_a_row_leaving_a_pool_read_in_place_stays_empty_until_a_request_takes_it():
    """Where rows are read in place (an empty row costs a call nothing), a short request ends
    while longer ones run: nothing is moved, the calls go on covering the hole, the others
    decode exactly, and the next request takes the lowest empty row."""
    backend = ReferenceBatchBackend(GREEDY, max_rows=3, max_call=8, rows_in_place=True)
    moves: list[tuple[int, int]] = []
    backend.move = lambda src, dst, length: moves.append((src, dst))
    runner = BatchRunner(backend, max_verify_len=8)
    prompts = _prompts(4, seed=6)
    budgets = [6, 50, 50, 20]
    solo = ReferenceDecoder(GREEDY)
    expected = [plain_decode(solo, p, SpeculativeOptions(n)).tokens
                for p, n in zip(prompts, budgets, strict=True)]
    rows = [runner.row() for _ in prompts[:3]]
    for row in rows:  # take pool rows 0, 1, 2 in order
        row.prefill([0])
        row.reset()
    assert [row.index for row in rows] == [0, 1, 2]
    took: list[int | None] = []

    def decode(i):
        if i < 3:
            try:
                return plain_decode(rows[i], prompts[i], SpeculativeOptions(budgets[i])).tokens
            finally:
                rows[i].release()
        while rows[0].index is not None:  # the short request has given its row back
            time.sleep(0.001)
        late = runner.row()
        try:
            out = plain_decode(late, prompts[3], SpeculativeOptions(budgets[3])).tokens
            took.append(late.index)
            return out
        finally:
            late.release()

    assert in_threads(decode, [0, 1, 2, 3]) == expected
    assert moves == []
    assert took == [0]
    runner.close()


def test_a_row_with_non_finite_logits_fails_only_its_request():
    poison = 7

    class Poisoned(ReferenceBatchBackend):
        def run(self, lo, hi, ids, lengths, *, take=None, real=None):
            out = super().run(lo, hi, ids, lengths)  # [B * S, vocab]
            out[ids.reshape(-1) == poison] = np.nan
            return out if take is None else out[take]

    backend = Poisoned(GREEDY, max_rows=4, max_call=8)
    runner = BatchRunner(backend, max_verify_len=8)
    prompts = [[p for p in prompt if p != poison] for prompt in _prompts(4)]
    bad = prompts[1][:4] + [poison] + prompts[1][4:]
    solo = ReferenceDecoder(GREEDY)
    options = SpeculativeOptions(30)

    def decode(prompt):
        row = runner.row()
        try:
            return plain_decode(row, prompt, options).tokens
        except NonFiniteLogitsError as e:
            return e
        finally:
            row.release()

    jobs = [prompts[0], bad, prompts[2], prompts[3]]
    results = in_threads(decode, jobs)
    assert isinstance(results[1], NonFiniteLogitsError)
    for i in (0, 2, 3):
        expected = plain_decode(solo, jobs[i], options).tokens
        if poison in expected:  # a row that itself produced the poison token fails too
            assert isinstance(results[i], NonFiniteLogitsError)
        else:
            assert results[i] == expected
    runner.close()


@pytest.mark.parametrize("case", ["t1.0", "t0.7-topk3"])
def test_sampled_batched_rows_match_the_exact_marginals(case):
    """6,000 sampled decodes of 4 tokens, four at a time in one batch, each with its own seed
    and prompt lookup: per-position marginals and the joint of the first two tokens against
    the exact ones of plain sampling (chi-squared)."""
    kw = {"t1.0": dict(temperature=1.0), "t0.7-topk3": dict(temperature=0.7, top_k=3)}[case]
    prompt, n_new, n_runs, width = [1, 3, 1, 3], 4, 6000, 4
    marginals, joint2 = exact_marginals(ReferenceDecoder(SMALL), prompt, n_new, **kw)
    backend = ReferenceBatchBackend(SMALL, max_rows=width, max_call=4)
    runner = BatchRunner(backend, max_verify_len=4)
    vocab = SMALL.vocab_size
    counts = np.zeros((n_new, vocab), np.int64)
    joint = np.zeros(vocab * vocab, np.int64)
    totals = {"accepted": 0, "drafted": 0}
    lock = threading.Lock()

    def worker(k: int) -> None:
        row = runner.row()
        drafter = PromptLookupSpeculator(ngram_size=1, max_draft_len=3)
        for seed in range(k, n_runs, width):
            res = speculative_decode_with(row, prompt, drafter,
                                          SpeculativeOptions(n_new, seed=seed, **kw))
            with lock:
                for i, t in enumerate(res.tokens):
                    counts[i, t] += 1
                joint[res.tokens[0] * vocab + res.tokens[1]] += 1
                totals["accepted"] += res.counters.accepted
                totals["drafted"] += res.counters.drafted
        row.release()

    in_threads(worker, list(range(width)))
    assert counts.sum() == n_runs * n_new
    assert 0 < totals["accepted"] < totals["drafted"]
    assert max(rows for rows, _ in backend.calls) == width
    assert_matches_marginals(counts, joint, marginals, joint2, what=f"batched {case}")
    runner.close()


def test_rows_decoding_together_stay_in_one_call():
    """Two requests decoding side by side share (nearly) every call: a row whose job arrived
    while the other row's call ran waits for that row instead of running alone, so the two do
    not fall into alternating single-row calls. (Calls take 20 ms here, like a real model's.)"""
    import time

    class Slow(ReferenceBatchBackend):
        def run(self, lo, hi, ids, lengths, *, take=None, real=None):
            time.sleep(0.02)
            return super().run(lo, hi, ids, lengths, take=take)

    backend = Slow(GREEDY, max_rows=2, max_call=8)
    runner = BatchRunner(backend, max_verify_len=8)
    prompts = [_prompts(2)[0], _prompts(2)[0][::-1]]

    def decode(prompt):
        row = runner.row()
        try:
            return plain_decode(row, prompt, SpeculativeOptions(40)).tokens
        finally:
            row.release()

    in_threads(decode, prompts)
    rows, _, _ = runner.stats.snapshot()
    assert rows.get(2, 0) >= 0.8 * sum(rows.values()), rows
    runner.close()


def test_the_runner_thread_ends_when_nothing_references_the_runner():
    import gc

    runner = BatchRunner(ReferenceBatchBackend(GREEDY, max_rows=2), max_verify_len=4)
    row = runner.row()
    plain_decode(row, [1, 2, 3], SpeculativeOptions(3))
    row.release()
    thread = runner._thread
    assert thread is not None and thread.is_alive()
    del runner, row
    gc.collect()
    thread.join(5)  # it checks once a second
    assert not thread.is_alive()


def test_the_padding_rules_on_worked_cases():
    """call_width: only a one-row call of one token pads (to min_rows tokens in all);
    logit_rows_for: a lone wanted row is repeated up to min_rows, more rows pass as they are."""
    assert call_width(1, 1, 2) == 2 and call_width(2, 1, 2) == 1 and call_width(8, 1, 2) == 1
    assert call_width(1, 3, 2) == 3 and call_width(3, 1, 1) == 1 and call_width(1, 1, 1) == 1
    assert logit_rows_for(np.array([4]), min_rows=2).tolist() == [4, 4]
    assert logit_rows_for(np.array([5, 0]), min_rows=2).tolist() == [5, 0]
    assert logit_rows_for(np.array([7]), min_rows=1).tolist() == [7]


# -- the cost surface and the per-row policy ------------------------------------------------------


def test_cost_surface_interpolates_and_prices_a_row_by_the_batch(monkeypatch):
    surface = CostSurface(rows=(1, 4), tokens=(2, 8),
                          seconds=((1.0, 1.3), (1.6, 4.0)))
    assert surface.cost(1, 2) == 1.0 and surface.cost(4, 8) == 4.0
    assert surface.cost(2, 2) == pytest.approx(1.2)
    assert surface.cost(4, 5) == pytest.approx(2.8)
    assert surface.cost(8, 2) == pytest.approx(2.4)  # beyond the grid: the last slope
    curve = surface.curve(1, 8)
    assert curve.seconds[0] == curve.seconds[1] == 1.0  # one token runs as two
    monkeypatch.setattr(batch_costs, "LOAD_MARGIN", 0.0)  # the prices alone (margin: below)
    rows = [1]
    policy = AdaptiveDraftLength(CostCurve((1.0,))).for_batch_row(
        BatchCosts(surface, lambda: rows[0]))
    block = DraftBlock.points([1, 2, 3, 4, 5, 6, 7], source="test", match_len=3)
    for i in range(40):  # runs of 0, 1, 2, 3 and 7 accepted drafts: E(k) grows ever slower
        policy.observe(block, 7, (0, 1, 2, 3, 7)[i % 5], 1)
    alone = policy.choose(block)
    rows[0] = 4
    batched = policy.choose(block)
    assert 1 <= batched < alone  # a wide call makes each extra token dear
    # a row's share when all 4 rows draft k alike: c(4, 4k + 1) / 4 on a packed graph,
    # c(4, k + 1) / 4 where every row runs at the widest block anyway
    packed = BatchCosts(surface, lambda: 4).costs(3)
    assert packed == pytest.approx([1.6 / 4, surface.cost(4, 5) / 4, surface.cost(4, 9) / 4])
    # asked at every step, the costs are kept per (rows, n) and follow the rows decoding now
    following = BatchCosts(surface, lambda: rows[0])
    at4 = following.costs(3)
    rows[0] = 1
    assert following.costs(3) == pytest.approx(BatchCosts(surface, lambda: 1).costs(3))
    rows[0] = 4
    assert following.costs(3) is at4 and at4 == pytest.approx(packed)
    padded = BatchCosts(surface, lambda: 4, packs_tokens=False).costs(3)
    assert padded == pytest.approx([surface.cost(4, n) / 4 for n in (1, 2, 3)])
    solo_view = AdaptiveDraftLength(CostCurve(surface.curve(4, 8).seconds))
    solo_view.acceptance = policy.acceptance
    assert batched <= solo_view.choose(block)



def test_under_load_a_block_must_beat_a_plain_step_by_the_margin_and_declined_ones_back_off():
    """With other rows decoding, a block whose expected rate beats a plain step's by less
    than LOAD_MARGIN is declined (alone the same block is drafted), and each block declined
    under load makes the request skip the drafter for 1, 2, 4, ... SKIP_MAX steps; a block
    chosen, or a new request, ends the skipping."""
    from ortspec.runtime.draft_length.policy import SKIP_MAX

    surface = CostSurface(rows=(1, 2), tokens=(1, 2), seconds=((1.0, 1.0), (2.0, 2.0)))
    rows = [2]
    policy = AdaptiveDraftLength(CostCurve((1.0,))).for_batch_row(
        BatchCosts(surface, lambda: rows[0]))
    block = DraftBlock.points([7], source="test", match_len=3)
    # a row's share of a call at 2 rows: 1.0 a step, 1.0 with a draft (a free token), so a
    # block's rate is 1 + a_1 plain steps': with every draft rejected, a_1 falls to what the
    # prior's pseudo-counts leave, below the bar
    for _ in range(400):
        policy.observe(block, 1, 0, 7)
    estimate = policy.acceptance.estimates(("test", 3), 1)[0]
    assert 0 < estimate < LOAD_MARGIN
    assert policy.choose(block) == 0  # under load: declined
    steps = []
    for _ in range(5):  # declined again each time it is asked: skips 1, 2, 4, 8, 8
        skipped = 0
        while not policy.should_propose():
            skipped += 1
        steps.append(skipped)
        assert policy.choose(block) == 0
    assert steps == [1, 2, 4, SKIP_MAX, SKIP_MAX]
    rows[0] = 1  # alone: the same block gains, and nothing is skipped after it
    policy.begin(SpeculativeOptions(4))
    assert policy.should_propose()
    assert policy.choose(block) == 1
    assert all(policy.should_propose() for _ in range(3))


def test_the_margin_grows_with_the_rows_past_four_and_declines_what_four_rows_would_draft():
    """A block must beat a plain step by LOAD_MARGIN at 2-4 rows and by MARGIN_PER_ROW more for
    each row past MARGIN_ROWS: on a surface where a draft costs the same share at 4 and 8 rows
    (free), a block expected to gain 30% is drafted at 4 rows and declined at 8."""
    from ortspec.runtime.draft_length.batch import MARGIN_PER_ROW, MARGIN_ROWS

    surface = CostSurface(rows=(4, 8), tokens=(1, 2), seconds=((4.0, 4.0), (8.0, 8.0)))
    rows = [1]
    costs = BatchCosts(surface, lambda: rows[0])
    margins = {}
    for rows[0] in (1, 2, 4, 5, 8):
        margins[rows[0]] = costs.margin()
    assert margins[1] == 0.0 and margins[2] == margins[4] == LOAD_MARGIN
    assert margins[5] == pytest.approx(LOAD_MARGIN + MARGIN_PER_ROW)
    assert margins[8] == pytest.approx(LOAD_MARGIN + (8 - MARGIN_ROWS) * MARGIN_PER_ROW)
    assert margins[8] > 0.3 > margins[4]  # the bars the block below falls between
    policy = AdaptiveDraftLength(CostCurve((1.0,))).for_batch_row(costs)
    block = DraftBlock.points([7], source="test", match_len=3)
    for i in range(300):  # 3 drafts in 10 accepted: a rate 1.3 plain steps' at either width
        policy.observe(block, 1, int(i % 10 < 3), 7)
    assert policy.acceptance.estimates(("test", 3), 1)[0] == pytest.approx(0.3, abs=0.03)
    rows[0] = 4
    assert policy.choose(block) == 1
    rows[0] = 8
    assert policy.choose(block) == 0


def test_under_load_a_row_drafts_only_what_pays_when_every_row_drafts_alike():
    """A steep surface (each token of a call at 8 rows costs as much as at 1 row): a block that
    pays alone is refused at 8 rows, where 8 rows drafting it would cost more than the
    accepted tokens save; the rate the policy then expects is plain decoding's."""
    surface = CostSurface(rows=(1, 8), tokens=(1, 2, 4, 8, 16),
                          seconds=((1.0, 1.14, 1.42, 1.98, 3.1),
                                   (1.98, 2.12, 2.4, 2.96, 4.08)))  # 0.14 a token, at any rows
    rows = [1]
    policy = AdaptiveDraftLength(CostCurve((1.0,))).for_batch_row(
        BatchCosts(surface, lambda: rows[0]))
    block = DraftBlock.points([1, 2, 3, 4], source="test", match_len=3)
    for i in range(60):  # half the blocks fully accepted, half rejected at once: E(k) < 2
        policy.observe(block, 4, 4 if i % 2 else 0, 1)
    assert policy.choose(block) >= 1  # alone: a verify of 2 costs 1.14 steps
    rows[0] = 8
    assert policy.choose(block) == 0  # 8 rows of one draft each: c(8, 9) / c(8, 1) = 1.57
    key = AcceptanceModel.key(block)
    plain_rate = 1.0 / (surface.cost(8, 1) / 8)
    assert policy.rate(4, key=key, prior=None, paid=False) == pytest.approx(plain_rate)


def test_a_surface_is_linear_in_the_context_between_and_beyond_its_two():
    surface = CostSurface(rows=(1, 8), tokens=(1, 9), seconds=((1.0, 2.0), (2.0, 4.0)),
                          context=256, long_seconds=((1.5, 3.5), (3.0, 7.0)), long_context=1024)
    assert surface.cost(8, 9) == surface.cost(8, 9, 256) == 4.0
    assert surface.cost(8, 9, 1024) == 7.0
    assert surface.cost(8, 9, 640) == pytest.approx(5.5)  # halfway
    assert surface.cost(8, 9, 1792) == pytest.approx(10.0)  # beyond: the same slope
    assert surface.cost(8, 5, 640) == pytest.approx((3.0 + 5.0) / 2)  # halfway in both
    assert surface.cost(8, 9, 0) == pytest.approx(3.0)  # below: the slope, down to context 0
    steep = CostSurface(rows=(1,), tokens=(1,), seconds=((1.0,),), context=256,
                        long_seconds=((9.0,),), long_context=512)
    assert steep.cost(1, 1, 0) == 0.25  # ... and never below a quarter of the first context's
    without = CostSurface(rows=(1,), tokens=(1,), seconds=((1.0,),))
    assert without.cost(1, 1, 4096) == 1.0  # measured at one context: that one's
    with pytest.raises(ValueError, match="long_context"):
        CostSurface(rows=(1,), tokens=(1,), seconds=((1.0,),), context=256,
                    long_seconds=((2.0,),), long_context=256)


def test_under_load_a_row_deep_into_long_prompts_drafts_less():
    """Each drafted token attends over its row's cache, so at a long context the same block
    costs more: the rows' mean context (followed as it changes) turns a block that pays at 256
    tokens into a plain step at 2048."""
    surface = CostSurface(rows=(1, 8), tokens=(1, 2, 4, 8, 16),
                          seconds=((1.0, 1.1, 1.3, 1.7, 2.5), (2.0, 2.1, 2.3, 2.7, 3.5)),
                          context=256,
                          long_seconds=((1.2, 1.5, 2.1, 3.3, 5.7), (2.8, 3.1, 3.7, 4.9, 7.3)),
                          long_context=1024)
    context = [256]
    costs = BatchCosts(surface, lambda: 8, context=lambda: context[0])
    policy = AdaptiveDraftLength(CostCurve((1.0,))).for_batch_row(costs)
    block = DraftBlock.points([1, 2, 3, 4], source="test", match_len=3)
    for i in range(60):  # three blocks in four fully accepted, the fourth rejected at once
        policy.observe(block, 4, 0 if i % 4 == 0 else 4, 1)
    at_256 = costs.costs(5)
    assert policy.choose(block) >= 1
    context[0] = 2048 + 7  # the mean context, to 32 tokens
    assert costs.costs(5) == pytest.approx(
        [surface.cost(8, 8 * k + 1, 2048) / 8 for k in range(5)])
    assert policy.choose(block) == 0
    context[0] = 250
    assert costs.costs(5) is at_256  # kept per (rows, context, n)
    # a draft model's batched step follows the context too
    draft = CostSurface(rows=(1, 8), tokens=(1,), seconds=((0.1,), (0.4,)), context=256,
                        long_seconds=((0.2,), (0.8,)), long_context=1024)
    draft_costs = BatchCosts(surface, lambda: 8, context=lambda: context[0], draft=draft)
    context[0] = 1024
    assert draft_costs.draft_step(0.1) == pytest.approx(0.8 / 8)


def test_the_runners_timed_calls_are_folded_in_when_a_row_reads_the_factor(monkeypatch):
    """`observe` runs on the runner's thread while the rows it woke wait for the interpreter:
    it only queues a call, and reading `factor` folds the queue in, in order, to the estimate
    that folding each call at once gives (also past PENDING_MAX calls, which observe folds
    itself)."""
    surface = CostSurface(rows=(1, 8), tokens=(1, 2, 4, 8, 16),
                          seconds=((1.0, 1.1, 1.3, 1.7, 2.5), (2.0, 2.1, 2.3, 2.7, 3.5)))
    rng = np.random.default_rng(7)
    calls = [dict(rows=8, span=8, tokens=int(t), widest=int(t) - 7, context=int(c),
                  seconds=float(sec))
             for t, c, sec in zip(rng.integers(8, 16, 600), rng.integers(64, 900, 600),
                                  rng.uniform(2.0, 6.0, 600))]
    eager, lazy = BatchCorrection(surface), BatchCorrection(surface)
    seen = []
    for call in calls:
        eager.observe(**call)
        seen.append(eager.factor)  # read after every call: each folded at once
    computed = []
    real = batch_costs._call_costs
    monkeypatch.setattr(batch_costs, "_call_costs", lambda *a: computed.append(a) or real(*a))
    for call in calls[:100]:
        lazy.observe(**call)
    assert computed == []  # nothing estimated on the observing thread
    assert lazy.factor == pytest.approx(seen[99], rel=1e-12) and len(computed) == 100
    for call in calls[100:]:  # more than PENDING_MAX unread: observe folds them itself
        lazy.observe(**call)
    assert len(computed) >= BatchCorrection.PENDING_MAX
    assert lazy.factor == pytest.approx(seen[-1], rel=1e-12) and len(computed) == len(calls)
    assert seen[-1] != 1.0


def test_the_runners_timed_calls_correct_how_dear_a_surface_says_drafts_are(monkeypatch):
    """Calls of one token a row set the base ratio r_b; calls with drafts whose extra tokens
    cost 3x what the surface says set the excess ratio r_x = 3 (averaged over decaying weights
    W = sum of 0.97^i, with 8 pseudo-calls at r_b), and factor = r_x / r_b; a row's block then
    costs that much more over a step, and the policy that drafted a block at the surface's
    price stops. Calls without drafts age that evidence back towards 1."""
    surface = CostSurface(rows=(1, 8), tokens=(1, 2, 4, 8, 16),
                          seconds=((1.0, 1.1, 1.3, 1.7, 2.5), (2.0, 2.1, 2.3, 2.7, 3.5)))
    def call(c: BatchCorrection, tokens: int, seconds: float) -> None:  # 8 rows, packed
        c.observe(rows=8, span=8, tokens=tokens, widest=tokens - 7, context=256,
                  seconds=seconds)

    correction = BatchCorrection(surface)
    assert correction.factor == 1.0
    call(correction, 12, 1.0)  # no base yet: a call with drafts teaches nothing
    assert correction.factor == 1.0
    call(correction, 8, 2.0 * 1.5)  # the base runs 1.5x the surface: r_b = 1.5 ...
    assert correction.factor == 1.0  # ... and so, without evidence, do the extra tokens
    extra = surface.cost(8, 5) - surface.cost(8, 1)  # 4 extra tokens: +0.4 by the surface
    for _ in range(150):
        call(correction, 12, 2.0 * 1.5 + 3.0 * extra)
    w = sum(0.97 ** i for i in range(150))
    expected = (8 * 1.5 + 3.0 * w) / (8 + w) / 1.5
    assert correction.factor == pytest.approx(expected) and 1.8 < expected < 2.0
    clipped, at_most = BatchCorrection(surface), BatchCorrection(surface)
    for c, seconds in ((clipped, 1e6), (at_most, 2.0 * 1.5 + BatchCorrection.MAX_RATIO * extra)):
        call(c, 8, 3.0)
        call(c, 12, seconds)  # (a call held up by the scheduler: clipped)
    assert clipped.factor == pytest.approx(at_most.factor)
    aged = BatchCorrection(surface)
    call(aged, 8, 3.0)
    for _ in range(30):
        call(aged, 12, 3.0 + 3.0 * extra)
    before = aged.factor
    for _ in range(3000):  # 0.998^3000: 0.25% of the evidence left
        call(aged, 8, 3.0)
    assert before > 1.5 and 1.0 <= aged.factor < 1.0 + (before - 1.0) * 0.05
    # a graph that computes every row at the widest block prices the call at (span, widest)
    padded = BatchCorrection(surface, packs_tokens=False)
    padded.observe(rows=2, span=8, tokens=8, widest=1, context=256, seconds=3.0)
    padded.observe(rows=2, span=8, tokens=9, widest=4, context=256,
                   seconds=3.0 + 3.0 * (surface.cost(8, 4) - surface.cost(8, 1)))
    assert padded.factor == pytest.approx((8 * 1.5 + 3.0) / (8 + 1) / 1.5)
    costs = BatchCosts(surface, lambda: 8)
    corrected = BatchCosts(surface, lambda: 8, correction=correction)
    plain, priced = costs.costs(4), corrected.costs(4)
    assert priced[0] == plain[0]  # a step is a step
    np.testing.assert_allclose(priced - priced[0], correction.factor * (plain - plain[0]))
    block = DraftBlock.points([1, 2, 3, 4], source="test", match_len=3)
    chosen = []
    monkeypatch.setattr(batch_costs, "MARGIN_PER_ROW", 0.0)  # the prices decide, at 8 rows
    for c in (costs, corrected):
        policy = AdaptiveDraftLength(CostCurve((1.0,))).for_batch_row(c)
        for i in range(60):  # half the blocks fully accepted, half rejected at once
            policy.observe(block, 4, 4 if i % 2 else 0, 1)
        chosen.append(policy.choose(block))
    assert chosen[0] >= 1 and chosen[1] == 0


def test_the_runner_tells_its_listener_of_every_decode_call():
    backend = ReferenceBatchBackend(GREEDY, max_rows=2, max_call=8)
    runner = BatchRunner(backend, max_verify_len=8, gather_seconds=0.5)
    heard = []
    runner.call_listener = lambda **call: heard.append(call)
    rows = [runner.row() for _ in range(2)]
    rows[0].prefill([1, 2, 3, 4, 5, 6])
    rows[1].prefill([1, 2])
    assert not heard  # prefill calls are not decode calls
    assert runner.active_context == 4  # rows that have read their prompts count at once
    in_threads(lambda row: row.forward_token(3), rows)  # both rows now decode
    assert heard and all(call["seconds"] > 0 for call in heard)
    heard.clear()  # (one call or two: the rows joined the runner at their own times)
    # both rows decoding: the runner waits for both, so the next blocks share one call
    in_threads(lambda job: job(), [lambda: rows[0].forward_batch([7, 8, 9]),
                                   lambda: rows[1].forward_token(3)])
    rows[1].release()
    rows[0].forward_token(10)
    rows[0].release()
    runner.close()
    assert [{k: v for k, v in call.items() if k != "seconds"} for call in heard] == [
        dict(rows=2, span=2, tokens=4, widest=3, context=5),  # rows of 7 and 3 tokens
        dict(rows=1, span=1, tokens=1, widest=1, context=10)]
    assert all(call["seconds"] > 0 for call in heard)


def test_a_call_whose_results_cannot_be_handed_out_fails_its_jobs_and_the_runner_serves_on():
    """A backend that fails after its call (here: its hidden states) fails every request in
    that call with its error, none left waiting, and the next call serves."""
    broken = [True]

    class Failing(ReferenceBatchBackend):
        def last_hidden(self):
            if broken[0]:
                raise RuntimeError("no hidden states")
            return np.zeros((64, 8), np.float32)

    backend = Failing(GREEDY, max_rows=2, max_call=8)
    runner = BatchRunner(backend, max_verify_len=8)
    rows = [runner.row(), runner.row()]
    for row, prompt in zip(rows, _prompts(2)):
        row.prefill(prompt[:5])
    backend.hidden_state_layers = (1,)  # from now on the calls return hidden states

    def step(row):
        with pytest.raises(RuntimeError, match="no hidden states"):
            row.forward_token(3)
        return True

    assert in_threads(step, rows, timeout=60) == [True, True]
    broken[0] = False
    assert rows[0].forward_token(3).shape == (GREEDY.vocab_size,)
    for row in rows:
        row.release()
    runner.close()


def test_a_failing_call_listener_leaves_the_runner_serving():
    runner = BatchRunner(ReferenceBatchBackend(GREEDY, max_rows=1, max_call=8), max_verify_len=8)

    def broken(**call):
        raise RuntimeError("listener bug")

    runner.call_listener = broken
    row = runner.row()
    row.prefill([1, 2, 3])
    first = row.forward_token(4)
    assert row.forward_token(5).shape == first.shape  # the runner still serves
    row.release()
    runner.close()


def test_a_batched_draft_is_priced_at_the_rows_that_share_its_call():
    """A draft model whose steps are batched too costs its call at the rows decoding now:
    cheap alone, it pays there; as dear as most of the target's call at 4 rows, it does not
    (k = 0, a plain step), where the solo price would still have drafted."""
    target = CostSurface(rows=(1, 4), tokens=(1, 2, 8), seconds=((1.0, 1.0, 1.5), (1.5, 1.6, 3.0)))
    draft = CostSurface(rows=(1, 4), tokens=(1,), seconds=((0.1,), (1.1,)))
    rows = [1]
    shared = AdaptiveDraftLength(CostCurve((1.0, 1.0)), draft_step_seconds=0.1)
    priced = shared.for_batch_row(BatchCosts(target, lambda: rows[0], draft=draft))
    solo_priced = shared.for_batch_row(BatchCosts(target, lambda: rows[0]))
    block = DraftBlock.points([1, 2, 3, 4], source="draft_model", match_len=0)
    for _ in range(40):  # 80% of the drafts accepted
        priced.observe(block, 4, 3, 1)
        priced.observe(block, 4, 4, 1)
    key = ("draft_model", 0)
    assert priced.limit(4, key=key, prior=None) >= 1
    assert BatchCosts(target, lambda: 4, draft=draft).draft_step(0.1) == pytest.approx(1.1 / 4)
    assert BatchCosts(target, lambda: 4).draft_step(0.1) == 0.1  # a draft of each row's own
    rows[0] = 4
    assert priced.limit(4, key=key, prior=None) == 0
    assert solo_priced.limit(4, key=key, prior=None) >= 1
    assert priced.rate(4, key=key, prior=None, paid=True) < \
        solo_priced.rate(4, key=key, prior=None, paid=True)


def test_token_rows_give_the_matmuls_two_rows_or_more():
    assert list(token_rows_for(np.array([0]), grid=2, min_rows=2)) == [0, 1]
    assert list(token_rows_for(np.array([3]), grid=4, min_rows=2)) == [0, 3]
    assert list(token_rows_for(np.array([0, 5]), grid=8, min_rows=2)) == [0, 5]
    assert list(token_rows_for(np.array([2]), grid=4, min_rows=1)) == [2]


def test_the_runner_names_the_real_tokens_of_each_call():
    """Prefill chunks and blocks pass their own positions as `real` (what a packing graph
    computes); a lone token's padding is not among them."""
    backend = ReferenceBatchBackend(GREEDY, max_rows=2, max_call=8, min_rows=2)
    runner = BatchRunner(backend, max_verify_len=8)
    row = runner.row()
    row.prefill(list(range(1, 6)))
    row.forward_batch([7, 8, 9])
    row.forward_token(10)
    row.release()
    runner.close()
    assert backend.calls == [(1, 5), (1, 3), (1, 2)]
    assert [list(r) for r in backend.real] == [[0, 1, 2, 3, 4], [0, 1, 2], [0]]


def test_cost_surface_measured_on_a_backend_is_monotone_and_writes_past_the_floors():
    backend = ReferenceBatchBackend(GREEDY, max_rows=3, max_call=8, min_rows=2)
    for dec in backend.rows:
        dec.forward_batch(list(range(20)))
    floors = np.array([20, 20, 20])
    before = [dec.forward_batch([1])[0].copy() for dec in backend.rows]
    for dec in backend.rows:  # (the reference rows run at lengths they hold: the long context)
        dec.truncate(20)
        dec.forward_batch(list(range(10)))
    backend.calls.clear()
    surface = CostSurface.measure(backend, max_len=8, floors=floors, context=10,
                                  long_context=25, repeats=1)
    assert surface.rows == (1, 2, 3) and surface.tokens == (1, 2, 4, 8)
    # the first context is under the floors: its calls ran at the floors, and say so
    assert surface.context == 20 and surface.long_context == 25
    assert len(backend.calls) == 2 * 2 * 3 * 4  # two contexts, two rounds, 3 x 4 points
    near, far = np.asarray(surface.seconds), np.asarray(surface.long_seconds)
    assert (far >= near).all() and (np.diff(far, axis=0) >= 0).all() \
        and (np.diff(far, axis=1) >= 0).all()
    # each point timed as the runner calls it: one row's one-token call runs two tokens
    assert (1, 1) not in backend.calls and (1, 2) in backend.calls and (2, 1) in backend.calls
    # ... and as a drafting row meets the others: one row's block, the others one token each
    for (r, s), real in zip(backend.calls, backend.real, strict=True):
        assert real is not None
        rows, cols = np.divmod(real, s)
        assert list(rows[rows > 0]) == list(range(1, r)) and not cols[rows > 0].any()
        assert list(cols[rows == 0]) == list(range((rows == 0).sum()))
    assert {len(real) - (r - 1) for (r, _), real in zip(backend.calls, backend.real)} \
        == {1, 2, 4, 8}
    grid = np.asarray(surface.seconds)
    assert (np.diff(grid, axis=0) >= 0).all() and (np.diff(grid, axis=1) >= 0).all()
    for dec, logits in zip(backend.rows, before, strict=True):  # the first 20 tokens intact
        dec.truncate(20)
        np.testing.assert_array_equal(dec.forward_batch([1])[0], logits)


# -- the real default model, exported with --attention window ---------------------------------


@pytest.fixture(scope="module", params=["fp32", "int4"])
def window_dir(request):
    from ortspec.export import ensure_default_model

    if request.param == "fp32":
        return ensure_default_model("fp32", attention="window", progress=False)
    return ensure_default_model(quant="int4", attention="window", progress=False)


@pytest.mark.slow
def test_the_window_export_takes_batches_and_its_rows_are_bitwise_their_solo_calls(window_dir):
    from ortspec.runtime import load_model
    from ortspec.runtime.batching.backend import OrtBatchBackend
    from ortspec.runtime.ort.manifest import read_manifest
    from ortspec.runtime.ort.decoder import OrtDecoder

    m = read_manifest(window_dir)
    # a lone row runs unpadded only where no onnxruntime matmul is left (ortspec's kernels)
    assert m.max_batch == 16
    assert m.min_call_rows == (1 if m.extra["attention"] == "CacheAttention" else 2)
    model = load_model(window_dir, max_concurrent=1, batch=False)
    assert TOKEN_ROWS in {i.name for i in model.sessions.by_entry["verify"].get_inputs()}
    backend = OrtBatchBackend(model.sessions, max_rows=4)
    solo = OrtDecoder.on(model.sessions)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 49152, size=n) for n in (5, 40, 17, 90)]
    blocks = [rng.integers(0, 49152, size=k) for k in (1, 4, 2, 7)]
    expected = []
    for p, b in zip(prompts, blocks, strict=True):
        solo.reset()
        solo.prefill(p)
        expected.append(solo.forward_batch(b))
    for i, p in enumerate(prompts):  # each row prefilled alone, in its own row of the pool
        backend.run(i, i + 1, p[None, :], np.array([0]))
    for lo, hi in ((0, 4), (1, 3), (2, 3), (0, 1)):  # batched with others, and alone
        s = max(2, max(blocks[i].size for i in range(lo, hi)))
        ids = np.stack([np.concatenate([blocks[i], np.full(s - blocks[i].size, blocks[i][-1])])
                        for i in range(lo, hi)])
        lengths = np.array([p.size for p in prompts[lo:hi]])
        every = backend.run(lo, hi, ids, lengths).reshape(hi - lo, s, -1)  # all positions
        for r, i in enumerate(range(lo, hi)):
            np.testing.assert_array_equal(every[r, :blocks[i].size], expected[i])
        # the rows the runner takes (each block's own positions, no padding), in its order
        take = np.concatenate([r * s + np.arange(blocks[i].size)
                               for r, i in reversed(list(enumerate(range(lo, hi))))])
        taken = backend.run(lo, hi, ids, lengths, take=take)
        np.testing.assert_array_equal(
            taken, np.concatenate([expected[i] for i in reversed(range(lo, hi))]))
        # packed: the MatMuls run on those positions only (token_rows), the same logits
        packed = backend.run(lo, hi, ids, lengths, take=take, real=np.sort(take))
        np.testing.assert_array_equal(packed, taken)
    # several rows' one-token steps run unpadded (S = 1: the attention's MatMuls see each
    # token's 3 query heads as rows), bitwise the solo step (two tokens, or one on ortspec's
    # kernels)
    steps = rng.integers(0, 49152, size=4)
    lengths = np.array([p.size for p in prompts])
    alone = []
    for p, t in zip(prompts, steps, strict=True):
        solo.reset()
        solo.prefill(p)
        alone.append(solo.forward_token(int(t)))
    for lo, hi in ((0, 4), (1, 3)):
        got = backend.run(lo, hi, steps[lo:hi, None], lengths[lo:hi])  # [rows, vocab]
        np.testing.assert_array_equal(got, np.stack(alone[lo:hi]))


@pytest.mark.slow
def test_concurrent_requests_on_the_batched_model_give_their_serial_outputs(window_dir):
    """Eight chat requests at once on four rows, plain and prompt lookup, greedy and seeded at
    temperature 0.8: each equals the same request decoded alone without batching."""
    from ortspec.runtime import load_model

    solo = load_model(window_dir, max_concurrent=1, batch=False)
    model = load_model(window_dir, max_concurrent=4)
    assert model.runner is not None
    questions = ["Name a fruit.", "What is 3 + 4?", "Say hello in French.", "Name a planet.",
                 "Repeat: one two three, one two three.", "Write a haiku about rain.",
                 "List the days of the week.", "What colour is the sky?"]
    cases = [(q, d, t, s) for q in questions for d in ("none", "prompt-lookup")
             for (t, s) in ((0.0, None), (0.8, 7))]

    def run(m, case):
        q, d, t, s = case
        return m.generate(q, chat=True, drafter=d,
                          options=SpeculativeOptions(24, temperature=t, seed=s)).tokens

    serial = [run(solo, c) for c in cases]
    assert in_threads(lambda c: run(model, c), cases) == serial
    assert max(model.runner.stats.rows) >= 2
    greedy = {(q, d): tok for (q, d, t, _), tok in zip(cases, serial, strict=True) if t == 0}
    assert all(greedy[q, "none"] == greedy[q, "prompt-lookup"] for q in questions)


@pytest.mark.slow
def test_a_batched_draft_model_drafts_in_shared_calls_with_every_serial_output():
    """The fp32 window export's int4 draft (its own flavour: batched too) drafts the
    concurrent requests' tokens in shared calls of the draft runner. Every greedy output is
    the plain serial one, and every seeded one (temperature 0.8) the same request's decoded
    alone on that model: the draft's rows, padded like its target's, are row-invariant too."""
    from ortspec.export import add_draft, ensure_default_model
    from ortspec.runtime import load_model

    window_dir = ensure_default_model("fp32", attention="window", progress=False)
    if not (window_dir / "drafts" / "int4").is_dir():
        add_draft(window_dir, quant="int4", progress=False)
    solo = load_model(window_dir, max_concurrent=1, batch=False)
    model = load_model(window_dir, draft=window_dir / "drafts" / "int4", max_concurrent=4)
    assert model.draft_runner is not None
    questions = ["Name a fruit.", "Repeat: one two three, one two three.", "What is 3 + 4?",
                 "List the days of the week.", "Say hello in French.", "Count from 1 to 10."]

    def run(m, q, drafter, temperature=0.0, seed=None):
        return m.generate(q, chat=True, drafter=drafter, draft_length=None,
                          options=SpeculativeOptions(24, temperature=temperature,
                                                     seed=seed)).tokens

    serial = [run(solo, q, "none") for q in questions]
    assert in_threads(lambda q: run(model, q, "draft-model"), questions) == serial
    assert max(model.draft_runner.stats.rows) >= 2  # draft steps shared a call
    # one request at a time on the same model: each row drafts alone in its calls
    seeded = [run(model, q, "draft-model", 0.8, 5) for q in questions]
    assert in_threads(lambda q: run(model, q, "draft-model", 0.8, 5), questions) == seeded


@pytest.mark.slow
def test_serve_batches_concurrent_openai_clients_with_their_serial_texts(window_dir):
    pytest.importorskip("fastapi", reason="the serve extra is not installed")
    import httpx
    import openai

    from helpers.serve import Server
    from ortspec.runtime import load_model

    solo = load_model(window_dir, max_concurrent=1, batch=False)
    name = window_dir.name
    questions = ["Name a fruit.", "What is 3 + 4?", "Say hello in French.", "Name a planet.",
                 "List three colours.", "Count from one to five."]
    server = Server(window_dir, "--max-concurrent", "4", "--max-queue", "32")
    try:
        def ask(i: int):
            c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                              timeout=300)
            if i % 4 == 3:  # bad input between the good: an OpenAI error, the rest unharmed
                with pytest.raises(openai.BadRequestError) as e:
                    c.chat.completions.create(model=name, messages=[{"role": "user",
                                                                     "content": "hi"}],
                                              max_tokens=-1)
                return ("bad", e.value.status_code)
            q = questions[i % len(questions)]
            r = c.chat.completions.create(model=name, messages=[{"role": "user", "content": q}],
                                          max_tokens=16, temperature=0)
            return (q, r.choices[0].message.content)

        def call_seconds() -> float:
            return sum(server.metric(f'ortspec:batch_call_seconds_total{{kind="{k}"}}')
                       for k in ("prefill", "decode"))

        before, t0 = call_seconds(), time.perf_counter()
        answers = in_threads(ask, list(range(12)))
        # the model's calls run one at a time on the runner's thread: their seconds fit in the
        # wall time they ran in
        assert 0 < call_seconds() - before <= time.perf_counter() - t0
        for q, text in answers:
            if q == "bad":
                assert text == 400
            else:
                assert text == solo.generate(q, chat=True, options=SpeculativeOptions(16)).text
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        assert "ortspec:batch_rows_bucket" in metrics
        calls = server.metric("ortspec:batch_rows_count")
        rows = server.metric("ortspec:batch_rows_sum")
        assert calls > 0 and rows / calls > 1.0  # several requests shared calls
        assert server.metric('ortspec:batch_calls_total{kind="decode"}') == calls
        assert server.metric('ortspec:batch_calls_total{kind="prefill"}') > 0
        assert server.metric('ortspec:batch_call_seconds_total{kind="prefill"}') > 0
        # every chat prompt starts with the same system prompt: the later ones copied it
        hits = server.metric("vllm:prefix_cache_hits_total")
        assert 20 * 8 <= hits < server.metric("vllm:prefix_cache_queries_total")
    finally:
        server.stop()


def test_serve_without_a_model_prefers_the_default_models_batched_export(tmp_path, monkeypatch):
    from ortspec.runtime.cli.args import model_arg
    from ortspec.runtime.paths import default_model_path

    monkeypatch.setenv("ORTSPEC_MODELS_DIR", str(tmp_path))
    plain, batched = default_model_path(), default_model_path(batched=True)
    plain.mkdir(parents=True)
    (plain / "manifest.json").write_text("{}")
    assert model_arg(None, prefer_batched=True) == plain  # no batched export: the plain one
    batched.mkdir(parents=True)
    (batched / "manifest.json").write_text("{}")
    assert model_arg(None, prefer_batched=True) == batched
    assert model_arg(None) == plain  # generate, check, bench: the plain export
    assert model_arg(str(tmp_path / "x")) == tmp_path / "x"
