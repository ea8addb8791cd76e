"""Bad input at every entry point: a specific OrtspecError (which is also the built-in a caller
would catch) with the offending value in the message; through the CLI, exit status 2 and one
line on stderr starting with `ortspec: error:`, never a traceback.

Python entry points: SpeculativeOptions, plain_decode, speculative_decode_with,
speculative_decode, accept_or_resample, warp, verify_block, DraftDist, PromptLookupSpeculator,
DraftModelDrafter, load_model, Model.generate, Model.stream. The decode loops run on the NumPy
`ReferenceDecoder`; load_model and the CLI on a one-layer graph written in well under a second
(`write_graph_dir`: capacity 32, vocabulary 320, no chat format).

"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
from helpers.drafters import BadDrafter, EmptyDrafter, RandomDrafter
from helpers.export import write_graph_dir

from ortspec.runtime import (
    DecoderBase,
    DraftBlock,
    DraftDist,
    DrafterError,
    DraftModelDrafter,
    InvalidDistributionError,
    InvalidOptionError,
    InvalidPromptError,
    ManifestError,
    NonFiniteLogitsError,
    PromptLookupSpeculator,
    ProviderError,
    ReferenceConfig,
    ReferenceDecoder,
    SpeculativeOptions,
    accept_or_resample,
    plain_decode,
    speculative_decode,
    speculative_decode_with,
    verify_block,
    warp,
)
from ortspec.runtime.cli.main import main as cli_main
from ortspec.runtime.load import load_model

CFG = ReferenceConfig(vocab_size=12, d_model=16, n_layers=1, n_heads=2, capacity=24, seed=3)
PROMPT = [1, 2, 3, 1, 2]


@pytest.fixture()
def decoder():
    return ReferenceDecoder(CFG)


TINY_EXPORT = None  # the tiny_dir fixture: the hand-written graph


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(tiny_dir)


@pytest.fixture(scope="module")
def poisoned_dir(tmp_path_factory):
    return write_graph_dir(tmp_path_factory.mktemp("poison") / "model", poison=True)


def cli_error(capsys, *argv: str) -> str:
    """Run the CLI, expect status 2 and exactly one line `ortspec: error: ...`; return it."""
    rc = cli_main(list(argv))
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2, (rc, out, err)
    assert len(lines) == 1 and lines[0].startswith("ortspec: error: "), err
    assert "Traceback" not in err and "Traceback" not in out
    return lines[0]


def decode_all_ways(decoder, prompt, options):
    """The three decode entry points over one prompt and options; each must raise."""
    yield lambda: plain_decode(decoder, prompt, options)
    yield lambda: speculative_decode_with(decoder, prompt, PromptLookupSpeculator(), options)
    yield lambda: speculative_decode(decoder, prompt, options.max_new_tokens)


# -- the hierarchy -----------------------------------------------------------------------------


def test_every_error_is_an_ortspec_error_and_the_builtin_a_caller_catches():
    from ortspec.runtime import errors

    builtins = {"InvalidOptionError": ValueError, "InvalidPromptError": ValueError,
                "InvalidDistributionError": ValueError, "DrafterError": ValueError,
                "NonFiniteLogitsError": ValueError, "CapacityError": ValueError,
                "ManifestError": ValueError, "ProviderError": ValueError,
                "ExportError": RuntimeError}
    for name, base in builtins.items():
        cls = getattr(errors, name)
        assert issubclass(cls, errors.OrtspecError) and issubclass(cls, base), name


# -- prompts -----------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt, match", [
    ([], r"the prompt is empty"),
    ([1, -1], r"prompt token 1 is -1; token ids must be integers in 0\.\.11"),
    ([1, 12], r"prompt token 1 is 12; token ids must be integers in 0\.\.11"),
    ([1, 2.0], r"prompt token 1 is 2\.0"),
    ([True], r"prompt token 0 is True"),
    (["a"], r"prompt token 0 is 'a'"),
    ([1] * 25, r"the prompt has 25 tokens; the model's KV capacity is 24"),
])
def test_bad_prompts_in_every_decode_entry_point(decoder, prompt, match):
    for call in decode_all_ways(decoder, prompt, SpeculativeOptions(4)):
        with pytest.raises(InvalidPromptError, match=match):
            call()


def test_bad_prompts_through_the_model(tiny):
    with pytest.raises(InvalidPromptError, match="the prompt is empty"):
        tiny.generate("")
    with pytest.raises(InvalidPromptError, match="the prompt is empty"):
        tiny.generate([])
    with pytest.raises(InvalidPromptError, match=r"token ids must be integers in 0\.\.319"):
        tiny.generate([5, 320])
    for bad in (123, b"hi", None):  # the model takes text too: the message says so
        with pytest.raises(InvalidPromptError, match="a string or a sequence of token ids, got"):
            tiny.generate(bad)
    with pytest.raises(InvalidPromptError, match=r"prompt token 0 is -3"):
        list(tiny.stream([-3, 4]))
    with pytest.raises(InvalidPromptError, match=r"the prompt has 40 tokens; the model's KV capacity is 32"):
        tiny.generate([7] * 40, drafter=None)
    with pytest.raises(InvalidPromptError, match="must be a string"):
        tiny.encode(b"bytes")  # type: ignore[arg-type]


def test_bad_prompts_through_the_cli(capsys, tiny_dir):
    line = cli_error(capsys, "generate", "--model", str(tiny_dir), "--prompt", "")
    assert "the prompt is empty" in line
    long = "The quick brown fox jumps over the lazy dog. " * 4
    line = cli_error(capsys, "generate", "--model", str(tiny_dir), "--prompt", long)
    assert re.search(r"the prompt has \d+ tokens; the model's KV capacity is 32", line)
    assert "give --prompt TEXT" in cli_error(capsys, "generate", "--model", str(tiny_dir))
    assert "not both" in cli_error(capsys, "generate", "--model", str(tiny_dir), "--prompt", "a",
                                   "--prompt-file", "x.txt")


def test_a_prompt_file_that_cannot_be_read(capsys, tmp_path, tiny_dir):
    line = cli_error(capsys, "generate", "--model", str(tiny_dir), "--prompt-file",
                     str(tmp_path / "missing.txt"))
    assert "cannot read --prompt-file" in line and "No such file" in line
    assert "Is a directory" in cli_error(capsys, "generate", "--model", str(tiny_dir),
                                         "--prompt-file", str(tmp_path))
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    assert "is not UTF-8 text" in cli_error(capsys, "generate", "--model", str(tiny_dir),
                                            "--prompt-file", str(tmp_path / "latin1.txt"))


# -- options -----------------------------------------------------------------------------------

BAD_OPTIONS = [
    (dict(max_new_tokens=0), r"max_new_tokens must be an integer >= 1, got 0"),
    (dict(max_new_tokens=-5), r"max_new_tokens must be an integer >= 1, got -5"),
    (dict(max_new_tokens=2.5), r"max_new_tokens must be an integer >= 1, got 2\.5"),
    (dict(temperature=-0.1), r"temperature must be a finite number >= 0, got -0\.1"),
    (dict(temperature=math.nan), r"temperature must be a finite number >= 0, got nan"),
    (dict(temperature=math.inf), r"temperature must be a finite number >= 0, got inf"),
    (dict(temperature="hot"), r"temperature must be a number >= 0, got 'hot'"),
    (dict(top_k=0), r"top_k must be None or an integer >= 1, got 0"),
    (dict(top_k=-3), r"top_k must be None or an integer >= 1, got -3"),
    (dict(top_k=2.0), r"top_k must be None or an integer >= 1, got 2\.0"),
    (dict(top_p=0.0), r"top_p must be None or in \(0, 1\], got 0\.0"),
    (dict(top_p=1.5), r"top_p must be None or in \(0, 1\], got 1\.5"),
    (dict(top_p=-0.2), r"top_p must be None or in \(0, 1\]"),
    (dict(top_p=math.nan), r"top_p must be None or in \(0, 1\], got nan"),
    (dict(max_draft_len=-1), r"max_draft_len must be None or an integer >= 0, got -1"),
]


@pytest.mark.parametrize("kwargs, match", BAD_OPTIONS)
def test_bad_options_are_refused_at_construction(kwargs, match):
    full = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(InvalidOptionError, match=match):
        SpeculativeOptions(**full)
    with pytest.raises(InvalidOptionError, match=match):
        speculative_decode(ReferenceDecoder(CFG), PROMPT, **full)


@pytest.mark.parametrize("kwargs, match", [b for b in BAD_OPTIONS
                                           if set(b[0]) <= {"temperature", "top_k", "top_p"}])
def test_bad_sampling_options_for_a_draft_model(decoder, kwargs, match):
    with pytest.raises(InvalidOptionError, match=match):
        DraftModelDrafter(decoder, **kwargs)


@pytest.mark.parametrize("context, match", [(0, "context must be"), (2.5, "context must be"),
                                            (CFG.capacity, "below the draft model's capacity")])
def test_a_bad_draft_context_is_refused(decoder, context, match):
    with pytest.raises(InvalidOptionError, match=match):
        DraftModelDrafter(decoder, context=context)


@pytest.mark.parametrize("flags, match", [
    (["--max-new-tokens", "0"], r"max_new_tokens must be an integer >= 1, got 0"),
    (["--max-new-tokens", "-1"], r"max_new_tokens must be an integer >= 1"),
    (["--max-new-tokens", "ten"], r"argument --max-new-tokens: invalid int value: 'ten'"),
    (["--temperature", "-1"], r"temperature must be a finite number >= 0, got -1\.0"),
    (["--temperature", "nan"], r"temperature must be a finite number >= 0, got nan"),
    (["--temperature", "warm"], r"argument --temperature: invalid float value: 'warm'"),
    (["--top-k", "0"], r"top_k must be None or an integer >= 1, got 0"),
    (["--top-p", "0"], r"top_p must be None or in \(0, 1\], got 0\.0"),
    (["--top-p", "1.01"], r"top_p must be None or in \(0, 1\], got 1\.01"),
    (["--max-draft-len", "-2"], r"max_draft_len must be (None or )?an integer >= 0, got -2"),
    (["--ngram-size", "0"], r"ngram_size must be an integer >= 1, got 0"),
    (["--seed", "-1"], r"--seed must be an integer >= 0, got -1"),
    (["--threads", "-1"], r"--threads must be an integer >= 0"),
    (["--drafter", "oracle"], r"argument --drafter: invalid choice: 'oracle'"),
    (["--draft", "elsewhere"], r"--draft is used only with --drafter draft-model"),
    (["--providers", "NoSuchExecutionProvider"],
     r"execution provider 'NoSuchExecutionProvider' is not available.*available: .*CPUExecutionProvider"),
    (["--no-such-flag"], r"unrecognized arguments: --no-such-flag \(see `ortspec generate -h`\)"),
])
def test_bad_options_through_the_cli_before_the_model_loads(capsys, monkeypatch, tmp_path, flags,
                                                            match):
    """Refused from the arguments alone: a model directory that does not exist is never read."""
    import ortspec.runtime.load as load_mod

    monkeypatch.setattr(load_mod, "load_model",
                        lambda *a, **k: pytest.fail("the model was loaded before the check"))
    line = cli_error(capsys, "generate", "--model", str(tmp_path / "none"), "--prompt", "hi", *flags)
    assert re.search(match, line), line


def test_cli_without_a_command_or_with_an_unknown_one(capsys):
    assert "required: command" in cli_error(capsys)
    assert "invalid choice: 'decode'" in cli_error(capsys, "decode")


# -- max_new_tokens beyond the capacity: generate what fits ----------------------------------------


def test_more_new_tokens_than_fit_end_with_finish_reason_capacity(decoder):
    plain = plain_decode(decoder, PROMPT, SpeculativeOptions(1000))
    spec = speculative_decode_with(decoder, PROMPT, PromptLookupSpeculator(ngram_size=1),
                                   SpeculativeOptions(1000))
    short = speculative_decode(decoder, PROMPT, 1000)
    assert plain.finish_reason == spec.finish_reason == short.finish_reason == "capacity"
    # the last token is never fed: prompt + new tokens reach capacity + 1
    assert len(plain.tokens) == CFG.capacity + 1 - len(PROMPT)
    assert spec.tokens == plain.tokens == short.tokens


def test_more_new_tokens_than_fit_through_the_model_and_the_cli(tiny, tiny_dir, capsys):
    ids = [5, 77, 30, 12]
    for drafter in (None, "prompt-lookup"):
        r = tiny.generate(ids, drafter=drafter, options=SpeculativeOptions(500, stop_token_ids=(319,)))
        assert r.finish_reason == "capacity" and len(r.tokens) == 32 + 1 - len(ids)
    rc = cli_main(["generate", "--model", str(tiny_dir), "--prompt", "Hello", "--max-new-tokens",
                   "100000", "--drafter", "none"])
    out, err = capsys.readouterr()
    assert rc == 0 and "finish=capacity" in err


def test_a_prompt_that_exactly_fills_the_capacity_still_gives_one_token(decoder):
    prompt = [1, 2, 3] * 8  # 24 = capacity: all but the last are fed
    for call in (lambda: plain_decode(decoder, prompt, SpeculativeOptions(5)),
                 lambda: speculative_decode_with(decoder, prompt, PromptLookupSpeculator(),
                                                 SpeculativeOptions(5))):
        r = call()
        assert r.finish_reason == "capacity" and len(r.tokens) == 1


# -- draft distributions and drafters ------------------------------------------------------------


@pytest.mark.parametrize("ids, probs, match", [
    ([1, 2], [0.5, 0.6], r"must sum to 1 within 1e-06, got 1\.1"),
    ([1, 2], [1.5, -0.5], r"finite and > 0"),
    ([1, 2], [np.nan, 1.0], r"finite and > 0"),
    ([1, 2], [np.inf, 0.0], r"finite and > 0"),
    ([1, 2], [1.0, 0.0], r"finite and > 0"),
    ([1, 1], [0.5, 0.5], r"must be unique"),
    ([-1, 2], [0.5, 0.5], r"must be >= 0, got -1"),
    ([1.0, 2.0], [0.5, 0.5], r"must be integers"),
    ([1, 2, 3], [0.5, 0.5], r"same non-zero length"),
    ([], [], r"same non-zero length"),
    ([[1, 2]], [[0.5, 0.5]], r"1-D token_ids and probs"),
])
def test_a_draft_dist_that_is_not_a_distribution(ids, probs, match):
    with pytest.raises(InvalidDistributionError, match=match):
        DraftDist(np.array(ids), np.array(probs))


def test_draft_dist_constructors_validate_too():
    with pytest.raises(InvalidDistributionError, match=r">= 0, got -4"):
        DraftDist.point(-4)
    with pytest.raises(InvalidDistributionError, match=r"\[vocab\] vector"):
        DraftDist.from_probs(np.ones((2, 2)) / 4)
    with pytest.raises(InvalidDistributionError, match="sum to 1"):
        DraftDist.from_probs(np.array([0.2, 0.2]))
    with pytest.raises(InvalidDistributionError, match=r"token id 7 >= vocab size 5"):
        DraftDist.point(7).dense(5)



@pytest.mark.parametrize("bad, match", [(-3, r">= 0, got -3"), (2.0, "must be an integer"),
                                        (True, "must be an integer"), ("7", "must be an integer")])
def test_a_block_of_point_masses_checks_every_token(bad, match):
    with pytest.raises(InvalidDistributionError, match=match):
        DraftBlock.points([4, bad, 5], source="prompt_lookup")


def test_a_truncated_block_keeps_its_key_and_its_own_point_masses():
    block = DraftBlock.points([4, np.int64(9), 5], source="prompt_lookup", match_len=2, prior=0.45)
    assert block.tokens == (4, 9, 5) and all(type(t) is int for t in block.tokens)
    cut = block.truncated(2)
    assert (cut.tokens, cut.source, cut.match_len, cut.prior) == ((4, 9), "prompt_lookup", 2, 0.45)
    assert [d.token_ids.tolist() for d in cut.dists] == [[4], [9]]
    assert len(block.truncated(0)) == 0 and block.truncated(3) is block
    assert DraftBlock.empty() == DraftBlock((), ()) and len(DraftBlock.empty()) == 0

def test_a_draft_block_that_contradicts_itself():
    with pytest.raises(DrafterError, match="2 tokens but 1 distributions"):
        DraftBlock((1, 2), (DraftDist.point(1),))
    with pytest.raises(DrafterError, match="token 3 is outside its own draft distribution"):
        DraftBlock((3,), (DraftDist.point(1),))
    with pytest.raises(DrafterError, match="expected a DraftDist"):
        DraftBlock((1,), ([1.0],))  # type: ignore[arg-type]


@pytest.mark.parametrize("block, options, match", [
    (DraftBlock.points([1] * 6), SpeculativeOptions(10, max_draft_len=4),
     r"the drafter returned 6 tokens; at most 4 were allowed"),
    (DraftBlock.points([12]), SpeculativeOptions(10), r"drafted token 0 is 12; token ids must be in 0\.\.11"),
    (DraftBlock((1,), (DraftDist(np.array([1, 40]), np.array([0.5, 0.5])),)), SpeculativeOptions(10),
     r"draft distribution 0 has token id 40 >= vocab 12"),
    (None, SpeculativeOptions(10), r"a drafter must return a DraftBlock, got NoneType"),
    ([1, 2], SpeculativeOptions(10), r"a drafter must return a DraftBlock, got list"),
])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_drafter_that_breaks_the_contract(decoder, block, options, match, temperature):
    import dataclasses

    options = dataclasses.replace(options, temperature=temperature)
    with pytest.raises(DrafterError, match=match):
        speculative_decode_with(decoder, PROMPT, BadDrafter(block), options)


def test_a_drafter_asked_for_too_much_near_the_end_is_still_bounded(decoder):
    """k_max shrinks with the tokens still wanted: a fixed block of 3 is too long for the last
    two tokens, and that is the drafter's fault, caught."""
    with pytest.raises(DrafterError, match="at most 1 were allowed"):
        speculative_decode_with(decoder, PROMPT, BadDrafter(DraftBlock.points([1, 2, 3])),
                                SpeculativeOptions(2))


def test_drafter_constructors(decoder):
    for kwargs, match in [(dict(ngram_size=0), "ngram_size must be an integer >= 1, got 0"),
                          (dict(min_ngram_size=0), "min_ngram_size must be an integer >= 1"),
                          (dict(ngram_size=2, min_ngram_size=3), r"min_ngram_size \(3\) must be <= ngram_size \(2\)"),
                          (dict(max_draft_len=-1), "max_draft_len must be an integer >= 0, got -1"),
                          (dict(ngram_size=True), "ngram_size must be an integer >= 1, got True"),
                          (dict(prefer="oldest"), "prefer must be 'recent' or 'first', got 'oldest'")]:
        with pytest.raises(InvalidOptionError, match=match):
            PromptLookupSpeculator(**kwargs)
    with pytest.raises(InvalidOptionError, match="max_draft_len must be an integer >= 0, got -2"):
        DraftModelDrafter(decoder, max_draft_len=-2)
    other = ReferenceDecoder(ReferenceConfig(**{**CFG.__dict__, "vocab_size": 13}))
    with pytest.raises(InvalidOptionError, match=r"vocabulary \(12 tokens\) differs from the target's \(13\)"):
        DraftModelDrafter(decoder, target=other)


# -- the rule ----------------------------------------------------------------------------------


def test_accept_or_resample_refuses_a_token_that_cannot_have_been_drafted():
    rng = np.random.default_rng(0)
    with pytest.raises(DrafterError, match="token 2 has draft probability 0"):
        accept_or_resample(np.full(4, 0.25), DraftDist.point(1), 2, rng)


def test_accept_or_resample_refuses_a_token_outside_p_target():
    with pytest.raises(DrafterError, match="outside"):
        accept_or_resample(np.full(4, 0.25), DraftDist.point(9), 9, np.random.default_rng(0))


def test_accept_or_resample_refuses_a_p_target_that_is_not_a_distribution():
    rng = np.random.default_rng(0)
    for p in (np.array([np.nan, 0.5]), np.array([3.0, 0.5]), np.array([-0.5, 1.5])):
        with pytest.raises(InvalidDistributionError):
            accept_or_resample(p, DraftDist.point(1), 1, rng)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_warp_and_verify_block_refuse_non_finite_logits(bad):
    logits = np.array([0.5, bad, 1.0])
    for t in (0.0, 1.0):
        with pytest.raises(NonFiniteLogitsError, match=r"1 non-finite logits \(first at flat index 1"):
            warp(logits, temperature=t)
        with pytest.raises(NonFiniteLogitsError):
            verify_block(np.stack([logits, logits]), DraftBlock.points([2]),
                         np.random.default_rng(0), temperature=t)


@pytest.mark.parametrize("kwargs", [dict(temperature=-1.0), dict(temperature=math.nan),
                                    dict(temperature=1.0, top_k=0), dict(temperature=1.0, top_p=0.0),
                                    dict(temperature=1.0, top_p=2.0)])
def test_warp_refuses_bad_sampling_options(kwargs):
    with pytest.raises(InvalidOptionError):
        warp(np.array([1.0, 2.0, 3.0]), **kwargs)


# -- seeds and stop tokens ----------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [dict(seed=-1), dict(seed="x"), dict(seed=1.5),
                                    dict(stop_token_ids=("a",)), dict(stop_token_ids=2),
                                    dict(stop_token_ids=(-1,))])
def test_bad_seeds_and_stop_tokens_are_refused_at_construction(kwargs):
    with pytest.raises(InvalidOptionError):
        SpeculativeOptions(4, temperature=1.0, **kwargs)


def test_numpy_floats_are_accepted_as_temperature_and_top_p():
    o = SpeculativeOptions(4, temperature=np.float32(0.7), top_p=np.float32(0.9))
    assert o.temperature == pytest.approx(0.7)


# -- non-finite logits from a model -------------------------------------------------------------


class PoisonedDecoder(DecoderBase):
    """The reference decoder, except that logits for cache positions >= `at` carry `value`."""

    def __init__(self, inner: ReferenceDecoder, at: int, value: float) -> None:
        self.inner, self.at, self.value = inner, at, value
        self.vocab_size, self.capacity = inner.vocab_size, inner.capacity

    @property
    def length(self) -> int:
        return self.inner.length

    def reset(self) -> None:
        self.inner.reset()

    def truncate(self, length: int) -> None:
        self.inner.truncate(length)

    def forward_token(self, token: int) -> np.ndarray:
        return self.forward_batch([token])[0]

    def forward_batch(self, tokens) -> np.ndarray:  # [n, vocab]
        start = self.inner.length
        out = self.inner.forward_batch(tokens).copy()
        positions = start + np.arange(len(tokens))
        out[positions >= self.at, 3] = self.value
        return out


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_non_finite_logits_mid_decode_raise_in_both_loops(value, temperature):
    """Poisoned from position 8 on: the prompt (5 tokens) decodes, then the loops stop with
    NonFiniteLogitsError instead of sampling from NaN probabilities."""
    options = SpeculativeOptions(12, temperature=temperature, seed=0)
    for run in (
        lambda d: plain_decode(d, PROMPT, options),
        lambda d: speculative_decode_with(d, PROMPT, PromptLookupSpeculator(ngram_size=1), options),
        lambda d: speculative_decode_with(d, PROMPT, RandomDrafter(CFG.vocab_size, 3, seed=1), options),
        lambda d: speculative_decode_with(d, PROMPT, EmptyDrafter(), options),
    ):
        with pytest.raises(NonFiniteLogitsError, match="non-finite logits"):
            run(PoisonedDecoder(ReferenceDecoder(CFG), at=8, value=value))


def test_non_finite_logits_from_an_onnx_graph(poisoned_dir, capsys):
    model = load_model(poisoned_dir)
    with pytest.raises(NonFiniteLogitsError, match="NaN or infinite logits"):
        model.generate([5, 6, 7], drafter=None)
    with pytest.raises(NonFiniteLogitsError):
        list(model.stream([5, 6, 7]))
    for drafter in ("none", "prompt-lookup"):
        line = cli_error(capsys, "generate", "--model", str(poisoned_dir), "--prompt", "Hello",
                         "--drafter", drafter)
        assert "NaN or infinite logits" in line


# -- loading -----------------------------------------------------------------------------------


def test_load_model_errors(tmp_path, tiny_dir):
    with pytest.raises(ManifestError, match="does not exist or is not a directory$"):
        load_model(tmp_path / "missing")
    with pytest.raises(ManifestError, match="has no manifest.json"):
        load_model(tmp_path)
    with pytest.raises(ProviderError, match="'NoSuchExecutionProvider' is not available"):
        load_model(tiny_dir, providers=["NoSuchExecutionProvider"])
    with pytest.raises(ProviderError, match="neither a name nor a"):
        load_model(tiny_dir, providers=[42])
    with pytest.raises(InvalidOptionError, match="threads must be an integer >= 0"):
        load_model(tiny_dir, threads=-1)
    with pytest.raises(InvalidOptionError, match="lists no draft model"):
        load_model(tiny_dir, draft=True)


@pytest.mark.parametrize("kwargs, command", [
    ({}, "ortspec export"), ({"precision": "fp32"}, "ortspec export --dtype fp32"),
    ({"batched": True}, "ortspec export --attention window"),
    ({"batched": True, "precision": "fp32"}, "ortspec export --dtype fp32 --attention window")])
def test_a_missing_default_export_names_the_command_that_makes_it(tmp_path, monkeypatch, kwargs,
                                                                  command):
    from ortspec.runtime import default_model_path

    monkeypatch.setenv("ORTSPEC_MODELS_DIR", str(tmp_path))
    with pytest.raises(ManifestError, match=re.escape(f"make it with `{command}`") + "$"):
        load_model(default_model_path(**kwargs))


def test_model_generate_errors(tiny):
    with pytest.raises(InvalidOptionError, match="has no chat format; use chat=False"):
        tiny.generate("hello", chat=True)
    with pytest.raises(InvalidOptionError, match="unknown drafter 'magic'"):
        tiny.generate("hello", drafter="magic")
    with pytest.raises(InvalidOptionError, match="needs a draft model"):
        tiny.generate("hello", drafter="draft-model")
    with pytest.raises(DrafterError, match="at most"):
        tiny.generate([5, 6], drafter=BadDrafter(DraftBlock.points([1] * 9)),
                      options=SpeculativeOptions(5))


def test_cli_model_errors(capsys, tmp_path, tiny_dir):
    assert "does not exist or is not a directory" in cli_error(
        capsys, "generate", "--model", str(tmp_path / "missing"), "--prompt", "hi")
    assert "has no chat format" in cli_error(capsys, "generate", "--model", str(tiny_dir),
                                             "--prompt", "hi", "--chat")
    assert "lists no draft model" in cli_error(capsys, "generate", "--model", str(tiny_dir),
                                               "--prompt", "hi", "--drafter", "draft-model")


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("drafter", ["eagle3", "prompt-lookup+eagle3"])
def test_a_drafter_needing_a_draft_head_the_model_lacks_is_refused_before_loading(
        capsys, monkeypatch, tiny_dir, command, drafter):
    if command == "serve":
        pytest.importorskip("fastapi", reason="the serve extra")
    import ortspec.runtime.load

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before its drafter was checked")

    monkeypatch.setattr(ortspec.runtime.load, "load_model", loaded)
    argv = [command, "--model", str(tiny_dir), "--drafter", drafter]
    line = cli_error(capsys, *(argv + ["--prompt", "hi"] if command == "generate" else argv))
    assert f"drafter {drafter!r} needs a trained draft head" in line
    assert "--draft-head" in line


def test_a_graph_onnxruntime_refuses_is_one_line_from_the_cli(capsys, tmp_path):
    import hashlib
    import json

    import onnx
    from onnx import helper

    d = write_graph_dir(tmp_path / "model")
    graph = onnx.load(str(d / "model.onnx"), load_external_data=False)
    graph.graph.node.append(helper.make_node("NoSuchOp", ["input_ids"], ["unused"]))
    (d / "model.onnx").write_bytes(graph.SerializeToString())
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["files"]["model.onnx"] = hashlib.sha256((d / "model.onnx").read_bytes()).hexdigest()
    (d / "manifest.json").write_text(json.dumps(manifest))
    assert "model.onnx" in cli_error(capsys, "generate", "--model", str(d), "--prompt", "hi")


def test_errors_keep_the_decoder_usable(decoder):
    """After a refused request the same decoder decodes normally."""
    ref = plain_decode(decoder, PROMPT, SpeculativeOptions(6)).tokens
    with pytest.raises(DrafterError):
        speculative_decode_with(decoder, PROMPT, BadDrafter(DraftBlock.points([99])), SpeculativeOptions(6))
    with pytest.raises(InvalidPromptError):
        plain_decode(decoder, [99], SpeculativeOptions(6))
    assert speculative_decode(decoder, PROMPT, 6).tokens == ref


def test_only_ortspec_errors_leave_the_cli_as_one_line(capsys, tiny_dir):
    """A sanity check of the harness itself: a good run prints text and a summary, status 0."""
    rc = cli_main(["generate", "--model", str(tiny_dir), "--prompt", "Hello", "--max-new-tokens", "3"])
    out, err = capsys.readouterr()
    assert rc == 0 and "[3 tokens" in err and "ortspec: error" not in err



# -- the real model: capacity runs out in the middle of a drafted block --------------------------


@pytest.fixture(scope="module")
def real_model():
    pytest.importorskip("onnx", reason="the export extra makes the default model")
    from ortspec import export
    return load_model(export.ensure_default_model("fp32", progress=False))


@pytest.mark.slow
def test_capacity_runs_out_mid_block_on_the_real_model(real_model):
    """A repetitive prompt 10 tokens short of the 2,048-token capacity: prompt lookup drafts up
    to 8 tokens a step and would run past the end; the decode stops cleanly with every token
    that fits (capacity + 1 - prompt = 11), finish_reason "capacity", and greedy identity with
    plain decoding. Sampling ends the same way."""
    m = real_model
    unit = m.encode("1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, ")
    cap = m.decoder.capacity
    prompt = (unit * (cap // len(unit) + 1))[: cap - 10]
    options = SpeculativeOptions(64)  # no stop tokens: only the capacity can end it
    plain = plain_decode(m.decoder, prompt, options)
    spec = speculative_decode_with(m.decoder, prompt, PromptLookupSpeculator(3, 8), options)
    assert plain.finish_reason == spec.finish_reason == "capacity"
    assert len(plain.tokens) == cap + 1 - len(prompt) == 11
    assert spec.tokens == plain.tokens
    assert spec.counters.accepted > 0  # drafts were really verified up to the end
    assert m.decoder.length <= cap
    # a stop id of its own, or generate() would take the model's (end of turn)
    rare = m.decoder.vocab_size - 1
    sampled = m.generate(prompt, options=SpeculativeOptions(64, temperature=0.8, seed=3,
                                                            stop_token_ids=(rare,)))
    assert sampled.finish_reason == "capacity" and len(sampled.tokens) == 11


def test_recalibrate_measures_the_curve_again_and_refuses_a_fixed_length(capsys, tmp_path, monkeypatch, tiny_dir):
    monkeypatch.setenv("ORTSPEC_CACHE_DIR", str(tmp_path / "cache"))
    argv = ["generate", "--model", str(tiny_dir), "--prompt", "ab", "--max-new-tokens", "2"]
    assert cli_main(argv) == 0
    (cached,) = (tmp_path / "cache" / "calibration").glob("*.json")
    cached.write_text(json.dumps({**json.loads(cached.read_text()), "stale": True}))
    assert cli_main(argv) == 0
    assert "stale" in cached.read_text()  # a plain run reads the cache
    assert cli_main(argv + ["--recalibrate"]) == 0
    assert "stale" not in cached.read_text()  # --recalibrate wrote a new measurement
    capsys.readouterr()
    assert "no use with --fixed-draft-len" in cli_error(capsys, *argv, "--recalibrate", "--fixed-draft-len")


def test_an_unknown_draft_length_string_is_refused(tiny):
    with pytest.raises(InvalidOptionError, match="draft_length must be 'auto'"):
        tiny.generate("ab", draft_length="fast")
