"""The runtime on the real default model (SmolLM2-135M-Instruct, exported on first use).

Marked slow; CI runs them. They need the export extra (torch, transformers) only to make the
model directory the first time.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from ortspec.runtime.bench.workload import default_questions_path, interleave_categories, load_questions
from ortspec.runtime import (
    DraftModelDrafter,
    ManifestError,
    PromptLookupSpeculator,
    ProviderError,
    SpeculativeOptions,
    plain_decode,
    speculative_decode_with,
)
from ortspec.runtime.draft_length.policy import AdaptiveDraftLength, CostCurve
from ortspec.runtime.load import load_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(model_dir):
    return load_model(model_dir)


@pytest.fixture(scope="module")
def dev_prompts():
    path = default_questions_path()
    if not path.is_file():
        pytest.skip(f"Spec-Bench questions not found at {path} (set ORTSPEC_SPEC_BENCH)")
    # two per category, interleaved: multi-turn, translation, summarization, qa, math, rag
    return interleave_categories(load_questions(path, split="dev", per_category=2))


def test_speculative_greedy_is_token_for_token_plain_on_spec_bench(model, dev_prompts):
    """Temperature 0, 64 new tokens, 12 dev prompts of all six categories: identical outputs,
    with prompt lookup at a fixed draft length and with the cost-model policy."""
    policy = AdaptiveDraftLength(CostCurve((1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7, 1.8)))
    accepted = 0
    categories = set()
    for p in dev_prompts:
        ids = model.encode(p.text, chat=True)
        options = SpeculativeOptions(64, stop_token_ids=model.manifest.stop_token_ids)
        ref = plain_decode(model.decoder, ids, options)
        for draft_length in (None, policy):
            res = speculative_decode_with(
                model.decoder, ids, PromptLookupSpeculator(ngram_size=3, max_draft_len=8), options,
                draft_length=draft_length,
            )
            assert res.tokens == ref.tokens, (p.question_id, p.category)
            assert res.finish_reason == ref.finish_reason
            accepted += res.counters.accepted
        categories.add(p.category)
    assert len(dev_prompts) >= 8 and len(categories) == 6
    assert accepted > 0  # the drafts were really used


def test_seeded_sampling_repeats_exactly(model):
    ids = model.encode("Write a haiku about the sea.", chat=True)
    o = SpeculativeOptions(32, temperature=1.0, top_p=0.95, seed=1234)
    a = model.generate(ids, options=o)
    b = model.generate(ids, options=o)
    c = model.generate(ids, options=SpeculativeOptions(32, temperature=1.0, top_p=0.95, seed=99))
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens


def test_after_partial_acceptance_the_cache_equals_a_fresh_decode(model):
    """A decode with many rejections leaves the KV cache exactly as a fresh decode of the
    surviving history would: the next logits agree."""
    text = "List the numbers from one to twenty in words, separated by commas."
    ids = model.encode(text, chat=True)
    res = speculative_decode_with(
        model.decoder, ids, PromptLookupSpeculator(ngram_size=1, max_draft_len=8),
        SpeculativeOptions(40, temperature=1.0, seed=3),
    )
    assert res.counters.rejected > 0 and res.counters.accepted > 0
    history = ids + res.tokens
    # the decode loop's invariant: the cache holds all but the last token
    assert model.decoder.length == len(history) - 1
    after_decode = model.decoder.forward_token(history[-1])
    model.decoder.reset()
    model.decoder.forward_batch(history[:-1])
    fresh = model.decoder.forward_token(history[-1])
    np.testing.assert_allclose(after_decode, fresh, atol=1e-4)
    assert int(np.argmax(after_decode)) == int(np.argmax(fresh))


def test_streaming_yields_the_generated_text(model):
    ids = model.encode("Name three primary colours.", chat=True)
    o = SpeculativeOptions(24)
    stream = model.stream(ids, options=o)
    pieces = list(stream)
    assert "".join(pieces) == stream.result.text == model.generate(ids, options=o).text


def test_a_draft_model_drafter_over_the_target_itself_accepts_every_greedy_draft(model_dir, model):
    """The ONNX decoder as its own draft (a second instance): at temperature 0 every draft is
    the target's argmax."""
    other = load_model(model_dir)
    ids = model.encode("Count from one to ten.", chat=True)
    drafter = DraftModelDrafter(other.decoder, max_draft_len=3, target=model.decoder)
    res = speculative_decode_with(model.decoder, ids, drafter, SpeculativeOptions(24))
    ref = plain_decode(model.decoder, ids, SpeculativeOptions(24))
    assert res.tokens == ref.tokens
    assert res.counters.acceptance_rate == 1.0


def test_an_unavailable_provider_is_a_specific_error_naming_what_is_available(model_dir):
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        with pytest.raises(ProviderError, match="CPUExecutionProvider"):
            load_model(model_dir, providers=["CUDAExecutionProvider"])
    with pytest.raises(ProviderError):
        load_model(model_dir, providers=["NoSuchExecutionProvider"])


def test_a_corrupted_manifest_is_a_specific_error(model_dir, tmp_path):
    bad = tmp_path / "model"
    bad.mkdir()
    for f in model_dir.iterdir():
        if f.is_file():
            (bad / f.name).symlink_to(f)
    (bad / "manifest.json").unlink()
    manifest = json.loads((model_dir / "manifest.json").read_text())
    manifest["architecture"]["num_layers"] = "thirty"
    (bad / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match="num_layers"):
        load_model(bad)
    (bad / "manifest.json").write_text("{ not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        load_model(bad)
    shutil.rmtree(bad)
