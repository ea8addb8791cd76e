"""The cost-model draft length: hand-worked choices, learning, calibration."""

import multiprocessing
import os
import time
import types

import numpy as np
import pytest

from ortspec.runtime import DraftBlock, PromptLookupSpeculator, ReferenceConfig, ReferenceDecoder, SpeculativeOptions
from ortspec.runtime import plain_decode, speculative_decode_with
from ortspec.runtime.ort import kernels
from ortspec.runtime.draft_length.calibration import CalibrationKey, CostCurve, calibrated_cost_curve, \
    calibrated_step_ratio
from ortspec.runtime.costs import calibration_key
from ortspec.runtime.draft_length.policy import AcceptanceModel, AdaptiveDraftLength, expected_tokens

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



def test_the_best_k_is_the_first_argmax_of_the_rates_for_any_acceptance_and_draft_cost():
    # the policy scans k in plain floats for speed; this is the vectorised definition
    # E(k) / (c'(k + 1) + k * per_draft), whose first argmax and maximum it must give
    rng = np.random.default_rng(7)
    policy = AdaptiveDraftLength(CPU_LIKE)
    for _ in range(300):
        k = int(rng.integers(1, 17))
        a = rng.uniform(0, 1, k) ** float(rng.choice([0.2, 1.0, 4.0]))
        per_draft = float(rng.choice([0.0, 0.05, 0.3]))
        rates = expected_tokens(a) / (policy.correction.costs(k + 1) + per_draft * np.arange(k + 1))
        assert policy._best_rate(a, per_draft) == (int(np.argmax(rates)), float(np.max(rates)))
        assert policy._best(a, per_draft) == int(np.argmax(rates))


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


def _calibrate_in_child(cache: str, model: str, log: str, go) -> None:
    """A process loading a model: its cost curve, measured (slowly) or read from the cache."""
    os.environ["ORTSPEC_CACHE_DIR"] = cache

    def measure(decoder, *, max_len, **_):
        with open(log, "a") as f:
            f.write(f"{os.getpid()} start {time.monotonic()}\n")
        time.sleep(0.4)
        with open(log, "a") as f:
            f.write(f"{os.getpid()} end {time.monotonic()}\n")
        return CostCurve(tuple(0.001 * (1 + 0.1 * n) for n in range(max_len)))

    CostCurve.measure = measure  # (this process only)
    go.wait()
    decoder = ReferenceDecoder(ReferenceConfig(vocab_size=32, capacity=128), max_verify_len=4)
    curve = calibrated_cost_curve(decoder, model)
    with open(log, "a") as f:
        f.write(f"{os.getpid()} got {curve.seconds}\n")


@pytest.mark.parametrize("models", [("model", "model"), ("model-a", "model-b")])
def test_processes_sharing_the_cache_measure_one_at_a_time(tmp_path, models):
    """Two processes that load models at once (two servers or Ray Serve's replicas of one
    model; a target and a draft apart): one measures while the other waits, then reads what was
    measured where it wants the same; no process times its calls while another's run, which
    would cache the other's load as the model's cost."""
    ctx = multiprocessing.get_context("fork")
    go, log = ctx.Event(), tmp_path / "log.txt"
    procs = [ctx.Process(target=_calibrate_in_child,
                         args=(str(tmp_path / "cache"), str(tmp_path / model), str(log), go))
             for model in models]
    for p in procs:
        p.start()
    go.set()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    lines = [line.split(" ", 2) for line in log.read_text().splitlines()]
    spans = {pid: [float(t) for pid_, what, t in lines if pid_ == pid and what in ("start", "end")]
             for pid, what, _ in lines if what == "start"}
    assert len(spans) == len(set(models)), "both processes measured one model"
    if len(spans) == 2:  # two measurements, one after the other
        (s0, e0), (s1, e1) = sorted(spans.values())
        assert e0 <= s1
    assert sum(what == "got" for _, what, _ in lines) == 2


def test_a_drafts_step_ratio_is_measured_once_per_draft_then_read_from_the_cache(tmp_path,
                                                                                  monkeypatch):
    """A seeded request's block sizes follow the draft's price, so the price must not change
    from one load to the next: measured once per (target, draft), then read back."""
    monkeypatch.setenv("ORTSPEC_CACHE_DIR", str(tmp_path / "cache"))
    key = CalibrationKey(str(tmp_path / "model"), "ab" * 8)
    draft = ReferenceDecoder(ReferenceConfig(vocab_size=32, capacity=128))
    target = ReferenceDecoder(ReferenceConfig(vocab_size=32, capacity=128, d_model=64))
    ratio = calibrated_step_ratio(draft, target, key, draft_id="head-x/1")
    assert ratio > 0

    class Untimed(ReferenceDecoder):
        def forward_token(self, token):
            raise AssertionError("measured again instead of read from the cache")

    cold = Untimed(ReferenceConfig(vocab_size=32, capacity=128))
    assert calibrated_step_ratio(cold, target, key, draft_id="head-x/1") == ratio
    with pytest.raises(AssertionError, match="measured again"):  # another draft: measured
        calibrated_step_ratio(cold, target, key, draft_id="head-y")
    with pytest.raises(AssertionError, match="measured again"):  # refresh: measured
        calibrated_step_ratio(cold, target, key, draft_id="head-x/1", refresh=True)
    names = sorted(p.name for p in (tmp_path / "cache" / "calibration").glob("*.json"))
    assert len(names) == 1 and "-step-head-x_1" in names[0]


def test_new_kernels_are_measured_anew():
    """The calibration files are named by the kernel library too: a rebuilt library (new
    kernels, other costs) does not read the old library's figures."""
    old, new = (CalibrationKey("/m/model", "ab" * 8, ("CPUExecutionProvider",), 2, 1, digest)
                for digest in ("11" * 32, "22" * 32))
    assert old.file_name() != new.file_name() and "kernels" + "1" * 12 in old.file_name()
    assert "kernels" not in CalibrationKey("/m/model", "ab" * 8).file_name()
    # ... and a loaded model's key carries the library it runs on
    sessions = types.SimpleNamespace(model_dir="/m/model", graph_digest="ab" * 8,
                                     providers=["CPUExecutionProvider"], intra_op_threads=2,
                                     min_call_rows=1)
    assert calibration_key(sessions).kernels == kernels.library_digest()
    assert kernels.library_digest() == "" or len(kernels.library_digest()) == 64


def test_a_verify_slower_than_calibrated_is_learned_and_drafting_stops_paying():
    policy = AdaptiveDraftLength(CPU_LIKE)
    a = np.full(8, 0.2)
    # calibrated: E(1) / c(2) = 1.2 / 1.1 = 1.09 beats a plain step, and k = 2 gives only 1.24 / 1.2
    assert policy._best(a, 0.0) == 1
    # blocks timed before any step cannot be compared with one: nothing is learned
    policy.observe_cost(2, 5.0)
    assert policy.correction.factor == 1.0
    # in use a step takes 1.0 s and a block of 2 takes 1.3 s: an excess of 0.3 steps where the
    # curve said 0.1, so the factor heads for 3 and c(2) for 1.3: 1.2 / 1.3 < 1, a plain step wins
    for _ in range(60):
        policy.observe_cost(1, 1.0)
        policy.observe_cost(2, 1.3)
    assert 2.5 < policy.correction.factor < 3.0
    assert policy.correction.cost(2) > 1.25
    assert policy._best(a, 0.0) == 0
    # and blocks as cheap as a step make longer drafts pay. The 8 pseudo-calls at 1 stay against
    # at most 1 / (1 - 0.97) = 33.3 decayed calls at 0: the factor floors at 8 / 41.3 = 0.19
    for _ in range(400):
        policy.observe_cost(1, 1.0)
        policy.observe_cost(3, 1.0)
    assert policy.correction.factor == pytest.approx(8 / (8 + 1 / (1 - 0.97)), rel=1e-3)
    assert policy._best(a, 0.0) >= 2


def test_one_interrupted_call_moves_the_cost_factor_only_a_little():
    policy = AdaptiveDraftLength(CPU_LIKE)
    policy.observe_cost(1, 1.0)
    policy.observe_cost(4, 100.0)  # a call that lost the CPU for a while
    # clipped at MAX_RATIO = 4 against 8 pseudo-calls at 1: (8 + 4) / 9
    assert policy.correction.factor == pytest.approx(12 / 9)


def test_the_decode_loop_times_every_target_call_for_the_policy():
    class Recording(AdaptiveDraftLength):
        def __init__(self):
            super().__init__(CPU_LIKE)
            self.timed: list[tuple[int, float]] = []

        def observe_cost(self, n_tokens, seconds):
            self.timed.append((n_tokens, seconds))
            super().observe_cost(n_tokens, seconds)

    decoder = ReferenceDecoder(ReferenceConfig(vocab_size=16, capacity=256, seed=3))
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3]
    policy = Recording()
    r = speculative_decode_with(decoder, prompt, PromptLookupSpeculator(ngram_size=2), SpeculativeOptions(40),
                                draft_length=policy)
    c = r.counters
    assert len(policy.timed) == c.target_calls
    assert sum(1 for n, _ in policy.timed if n == 1) == c.forward_token_calls
    assert sum(n - 1 for n, _ in policy.timed) == c.drafted  # block sizes are the verified drafts + 1
    assert all(t > 0 for _, t in policy.timed)


def test_a_request_unlike_the_last_ones_is_recognised_after_a_few_drafts():
    model = AcceptanceModel()
    key = ("prompt_lookup", 3)
    model.begin_request(sampled=False)
    for _ in range(200):  # a request whose 3-gram drafts always pass
        model.update(key, 1, 1)
    assert model.estimates(key, 1)[0] > 0.95
    model.begin_request(sampled=False)  # the next request's drafts all fail
    for _ in range(6):
        model.update(key, 1, 0)
    # across requests: ~50 decayed tries, ~44 hits -> (44.3 + 1.8) / (50 + 3) = 0.87; this
    # request: 0 / 5.7 decayed tries over that estimate with weight 4 -> 0.87 * 4 / 9.7 = 0.36
    assert model.estimates(key, 1)[0] < 0.4
    tries, hits = model._arrays(model._global, key)
    across = (hits[0] + model.prior(key) * 3.0) / (tries[0] + 3.0)
    assert across > 0.8


def test_greedy_and_sampled_requests_learn_apart():
    model = AcceptanceModel()
    key = ("prompt_lookup", 2)
    model.begin_request(sampled=True)
    for _ in range(100):
        model.update(key, 2, 0)
    assert model.estimates(key, 1)[0] < 0.1
    model.begin_request(sampled=False)
    np.testing.assert_allclose(model.estimates(key, 2), model.prior(key))  # untouched


def test_a_plain_step_reports_the_exact_chance_its_draft_had():
    from ortspec.runtime.decoding.sampling import warp

    class Recording(AdaptiveDraftLength):
        def __init__(self):
            # verifying never pays on this curve: every step is plain, every draft unverified
            super().__init__(CostCurve((1.0, 100.0, 200.0, 300.0)))
            self.seen: list[tuple[list[int], int, float]] = []
            self.history = None

        def observe(self, proposed, n_verified, n_accepted, first_token, *, first_accept_prob=None):
            assert n_verified == 0
            if len(proposed):
                assert first_accept_prob is not None
                self.seen.append((list(self.history), proposed.tokens[0], first_accept_prob))
            super().observe(proposed, n_verified, n_accepted, first_token, first_accept_prob=first_accept_prob)

    class Lookup(PromptLookupSpeculator):
        def propose(self, history, max_tokens):
            policy.history = history  # observe() comes before the step's token is appended
            return super().propose(history, max_tokens)

    cfg = ReferenceConfig(vocab_size=12, capacity=128, seed=5, logit_scale=2.0)
    decoder = ReferenceDecoder(cfg)
    policy = Recording()
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    options = SpeculativeOptions(24, temperature=0.8, seed=2)
    speculative_decode_with(decoder, prompt, Lookup(ngram_size=1, max_draft_len=3), options, draft_length=policy)
    assert len(policy.seen) >= 10
    check = ReferenceDecoder(cfg)
    for history, draft, chance in policy.seen:
        check.reset()
        p = warp(check.forward_batch(history)[-1], temperature=0.8)
        assert chance == pytest.approx(p[draft], abs=1e-9)


def test_a_seeded_request_gets_a_policy_of_its_own_and_repeats_exactly():
    cfg = ReferenceConfig(vocab_size=16, capacity=256, seed=7, logit_scale=2.0)
    decoder = ReferenceDecoder(cfg)
    shared = AdaptiveDraftLength(CPU_LIKE)
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]
    options = SpeculativeOptions(40, temperature=1.0, seed=11)
    drafter = lambda: PromptLookupSpeculator(ngram_size=1, max_draft_len=4)  # noqa: E731
    first = speculative_decode_with(decoder, prompt, drafter(), options, draft_length=shared.for_seeded_request())
    # the shared policy learns in between (other requests, timings) ...
    speculative_decode_with(decoder, prompt, drafter(), SpeculativeOptions(40, temperature=1.0, seed=3),
                            draft_length=shared)
    for _ in range(50):
        shared.observe_cost(1, 1.0)
        shared.observe_cost(3, 5.0)
    copy = shared.for_seeded_request()
    assert copy.learn_costs is False and copy.correction.factor == 1.0
    copy.observe_cost(1, 1.0)
    copy.observe_cost(3, 5.0)
    assert copy.correction.factor == 1.0  # timings are ignored
    # ... and the seeded request still repeats token for token
    again = speculative_decode_with(decoder, prompt, drafter(), options, draft_length=shared.for_seeded_request())
    assert again.tokens == first.tokens
    # while the shared policy itself, having learned, may size blocks differently
    assert shared.correction.factor > 1.5
