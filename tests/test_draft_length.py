"""The cost-model draft length: hand-worked choices, learning, calibration."""

import numpy as np

from ortspec.runtime import DraftBlock, PromptLookupSpeculator, ReferenceConfig, ReferenceDecoder, SpeculativeOptions
from ortspec.runtime import plain_decode, speculative_decode_with
from ortspec.runtime.draft_length import (
    AcceptanceModel,
    AdaptiveDraftLength,
    CostCurve,
    calibrated_cost_curve,
    expected_tokens,
)

CPU_LIKE = CostCurve((1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7, 1.8))  # c(n) = 0.9 + 0.1 n


def test_expected_tokens_counts_the_bonus():
    # a = (0.5, 0.5): E(0) = 1, E(1) = 1.5, E(2) = 1.75
    np.testing.assert_allclose(expected_tokens(np.array([0.5, 0.5])), [1.0, 1.5, 1.75])


def test_the_best_k_maximises_tokens_per_second_by_hand():
    policy = AdaptiveDraftLength(CPU_LIKE)
    # a = 0.9 everywhere: E(k)/c(k+1): k=0 1.0, k=1 1.9/1.1=1.73, ... k=8 7.13/1.8=3.96 (the max)
    assert policy._best(np.full(8, 0.9), 0.0) == 8
    # a = 0.05: E(1)/c(2) = 1.05/1.1 < 1: drafting does not pay, a plain step is chosen
    assert policy._best(np.full(8, 0.05), 0.0) == 0
    # a = 0.5: E = 1, 1.5, 1.75, 1.875, ... / 1, 1.1, 1.2, 1.3 -> 1.0, 1.36, 1.46, 1.44: k = 2
    assert policy._best(np.full(8, 0.5), 0.0) == 2
    # a draft step costing 0.3 of a target step makes the same acceptance worth fewer drafts
    assert policy._best(np.full(8, 0.9), 0.3) < 8


def test_acceptance_is_learned_per_match_length_and_recovers_after_a_plain_step():
    model = AcceptanceModel()
    long_match = DraftBlock.points([5, 6, 7, 8], source="prompt_lookup", match_len=3)
    short = DraftBlock.points([5, 6], source="prompt_lookup", match_len=1)
    for _ in range(50):
        model.update(AcceptanceModel.key(long_match), 4, 4)
        model.update(AcceptanceModel.key(short), 2, 0)
    assert model.estimates(AcceptanceModel.key(long_match), 4).min() > 0.9
    assert model.estimates(AcceptanceModel.key(short), 1)[0] < 0.1
    # a plain step whose token equals the first draft counts as a would-be acceptance
    for _ in range(100):
        model.update_unverified(AcceptanceModel.key(short), True)
    assert model.estimates(AcceptanceModel.key(short), 1)[0] > 0.8


def test_poor_drafts_fall_back_to_plain_steps_and_the_output_is_unchanged():
    cfg = ReferenceConfig(vocab_size=24, d_model=32, n_layers=2, n_heads=4, capacity=256, logit_scale=4.0, seed=1)
    decoder = ReferenceDecoder(cfg)
    prompt = list(range(24)) * 2  # every 1-gram matches, and the continuations are useless
    options = SpeculativeOptions(80)
    ref = plain_decode(decoder, prompt, options)
    fixed = speculative_decode_with(decoder, prompt, PromptLookupSpeculator(ngram_size=1), options)
    policy = AdaptiveDraftLength(CPU_LIKE)
    adaptive = speculative_decode_with(decoder, prompt, PromptLookupSpeculator(ngram_size=1), options, draft_length=policy)
    assert adaptive.tokens == fixed.tokens == ref.tokens
    # fewer wasted drafts: the policy verifies less of what prompt lookup proposes
    assert adaptive.counters.drafted < fixed.counters.drafted
    assert adaptive.counters.forward_token_calls > 0


def test_calibration_is_measured_once_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ORTSPEC_CACHE_DIR", str(tmp_path / "cache"))
    decoder = ReferenceDecoder(ReferenceConfig(vocab_size=32, capacity=128), max_verify_len=6)
    curve = calibrated_cost_curve(decoder, tmp_path / "model")
    assert len(curve.seconds) == 6 and all(b >= a for a, b in zip(curve.seconds, curve.seconds[1:]))
    files = list((tmp_path / "cache" / "calibration").glob("*.json"))
    assert len(files) == 1
    again = calibrated_cost_curve(decoder, tmp_path / "model")
    assert again == curve  # read back, not re-measured
