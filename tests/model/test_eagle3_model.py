"""A model exported with an EAGLE-3 head (`ortspec export SOURCE --draft-head`) decodes with the
eagle3 drafter by default: `load_model(dir)` needs no other argument; greedy output is plain
greedy token for token, alone and beside prompt lookup, from several threads at once; sampled
output with a seed is reproducible; the batched export with a head drafts with it when asked,
each request getting its serial output; a model without a head refuses it."""

from __future__ import annotations

import pytest

from ortspec.runtime import SpeculativeOptions, load_model
from ortspec.runtime.errors import InvalidOptionError

pytestmark = pytest.mark.slow  # builds and exports torch checkpoints

CAP, VERIFY = 256, 8
PROMPTS = [[5, 77, 301, 12, 190, 45, 9, 260, 33, 101], [7, 8, 9, 7, 8, 9, 7, 8],
           [40, 12, 5, 5, 300, 2, 41, 41, 41]]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from ortspec.export import export_model
    from helpers.eagle3 import tiny_llama_and_head

    root = tmp_path_factory.mktemp("eagle3-model")
    src, head = tiny_llama_and_head(root)
    with_head = export_model(src, out=root / "with-head", capacity=CAP, max_verify_len=VERIFY,
                             progress=False, draft_head=head)
    window = export_model(src, out=root / "window", capacity=CAP, max_verify_len=VERIFY,
                          attention="window", progress=False, draft_head=head)
    plain = export_model(src, out=root / "plain", capacity=CAP, max_verify_len=VERIFY,
                         progress=False)
    return with_head, window, plain


def test_a_model_with_a_head_drafts_with_it_by_default_and_greedy_stays_plain(exported):
    with_head, _, _ = exported
    model = load_model(with_head)
    assert model.default_drafter == "eagle3"
    assert model.prepare().paid_steps["eagle3"] > 0  # a head step, measured against the target's
    options = SpeculativeOptions(40, temperature=0.0)
    drafted = 0
    for prompt in PROMPTS:
        plain = model.generate(prompt, drafter=None, options=options)
        for drafter in ("auto", "eagle3", "prompt-lookup+eagle3"):
            res = model.generate(prompt, drafter=drafter, options=options, draft_length=None)
            assert res.tokens == plain.tokens, drafter
            drafted += res.counters.drafted
        res = model.generate(prompt, options=options)  # every default: eagle3, the cost model
        assert res.tokens == plain.tokens
    assert drafted > 0
    res = model.generate(PROMPTS[0], options=options, draft_length=None)
    assert res.counters.accepted_by_source.keys() <= {"eagle3"}


def test_concurrent_eagle3_requests_each_get_their_serial_output(exported):
    from helpers.threads import in_threads

    with_head, _, _ = exported
    model = load_model(with_head, max_concurrent=3)
    greedy = SpeculativeOptions(32, temperature=0.0)
    sampled = [SpeculativeOptions(32, temperature=1.0, top_k=50, seed=s) for s in range(3)]
    serial = [model.generate(p, options=greedy).tokens for p in PROMPTS]
    serial_sampled = [model.generate(PROMPTS[0], options=o).tokens for o in sampled]
    jobs = [(p, greedy) for p in PROMPTS] + [(PROMPTS[0], o) for o in sampled]
    got = in_threads(lambda job: model.generate(job[0], options=job[1]).tokens, jobs)
    assert got == serial + serial_sampled


def test_eagle3_drafts_on_a_batching_model_and_each_request_gets_its_serial_output(exported):
    """The batched export with a head: its rows hand out the hidden states a solo decoder of
    the same graph computes; eagle3 greedy output is the model's plain output, and concurrent
    requests (sharing the runner's calls, each with a head of its own) get their serial output."""
    import numpy as np
    from helpers.threads import in_threads

    _, window, _ = exported
    model = load_model(window, max_concurrent=3)
    assert model.runner is not None
    assert model.default_drafter == "prompt-lookup"  # eagle3 on a batching model when asked
    with model.slots.slot() as slot:
        row, solo = slot.decoder, model.decoder
        for dec in (row, solo):
            dec.reset()
            dec.prefill(PROMPTS[0])
        np.testing.assert_array_equal(row.last_hidden_states(), solo.last_hidden_states())
        assert row.last_hidden_states().shape[0] == 1  # prefill: its last row
        np.testing.assert_array_equal(row.forward_batch([3, 4, 5]), solo.forward_batch([3, 4, 5]))
        np.testing.assert_array_equal(row.last_hidden_states(), solo.last_hidden_states())
        assert row.last_hidden_states().shape[0] == 3
    greedy = SpeculativeOptions(32, temperature=0.0)
    plain = [model.generate(p, drafter=None, options=greedy).tokens for p in PROMPTS]
    drafted = 0
    for prompt, tokens in zip(PROMPTS, plain):
        for drafter in ("eagle3", "prompt-lookup+eagle3"):
            res = model.generate(prompt, drafter=drafter, options=greedy, draft_length=None)
            assert res.tokens == tokens, drafter
            drafted += res.counters.drafted_by_source.get("eagle3", 0)
    assert drafted > 0
    assert model.prepare().paid_steps["eagle3"] > 0  # the head step priced on a batch row
    sampled = [SpeculativeOptions(32, temperature=1.0, top_k=50, seed=s) for s in range(3)]
    serial = [model.generate(PROMPTS[0], drafter="eagle3", options=o).tokens for o in sampled]
    jobs = [(p, greedy) for p in PROMPTS] + [(PROMPTS[0], o) for o in sampled]
    got = in_threads(lambda job: model.generate(job[0], drafter="eagle3", options=job[1]).tokens,
                     jobs)
    assert got == plain + serial
    assert model.runner.stats.snapshot()[0].keys() - {1}  # some calls carried several rows


def test_eagle3_is_refused_where_it_cannot_run(exported):
    _, _, plain = exported
    without = load_model(plain)
    assert without.default_drafter == "prompt-lookup"
    with pytest.raises(InvalidOptionError, match="--draft-head"):
        without.generate(PROMPTS[0], drafter="eagle3", options=SpeculativeOptions(4))
