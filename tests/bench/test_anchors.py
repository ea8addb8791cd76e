"""The benchmark's comparison anchors: prompt handling, summaries, and that an anchor which
cannot run is reported (AnchorUnavailable), never a crash. Nothing here needs the anchor venv;
the one end-to-end check skips when scripts/setup_anchors.sh has not been run."""

from __future__ import annotations

import json
import sys

import pytest

from ortspec.runtime.bench.anchors import (
    AnchorUnavailable,
    default_paths,
    genai_step_latency,
    load_spec_bench,
    render_chatml,
    run_genai_anchor,
    run_hf_anchor,
    summarize,
)
from ortspec.runtime.bench.anchors.anchor_io import validate_prompts

PROMPT = {"id": "a", "category": "c", "prompt": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"}


def test_render_chatml_inserts_the_default_system_prompt():
    text = render_chatml([{"role": "user", "content": "Hi there"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    own = render_chatml([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert own.startswith("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU")
    assert render_chatml([{"role": "user", "content": "U"}], system_prompt=None).startswith("<|im_start|>user")


def test_load_spec_bench_keeps_the_dev_split_first_turn(tmp_path):
    path = tmp_path / "q.jsonl"
    rows = [
        {"question_id": 1, "category": "x", "turns": ["odd", "t2"]},
        {"question_id": 2, "category": "x", "turns": ["two", "t2"]},
        {"question_id": 4, "category": "x", "turns": ["four"]},
        {"question_id": 6, "category": "y", "turns": ["six"]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dev = load_spec_bench(path)
    assert [p["id"] for p in dev] == ["q2", "q4", "q6"]
    assert dev[0]["prompt"].endswith("<|im_start|>user\ntwo<|im_end|>\n<|im_start|>assistant\n")
    assert [p["id"] for p in load_spec_bench(path, per_category=1)] == ["q2", "q6"]
    assert [p["id"] for p in load_spec_bench(path, split="heldout")] == ["q1"]
    assert [p["id"] for p in load_spec_bench(path, categories=["y"])] == ["q6"]


def test_validate_prompts_rejects_what_an_anchor_cannot_run():
    with pytest.raises(ValueError):
        validate_prompts([{"id": "x"}])
    with pytest.raises(ValueError):
        validate_prompts([PROMPT, PROMPT])
    assert validate_prompts([{"prompt": "p"}])[0] == {"prompt": "p", "id": "0", "category": "unknown"}


def _run(pid, cat, mode, wall, same=True):
    return {"id": pid, "category": cat, "mode": mode, "wall_s": wall, "new_tokens": 10,
            "forward_calls": 10, "matches_plain": same if mode == "ngram" else True}


def test_summarize_reports_medians_and_geometric_means():
    runs = [
        _run("a", "c1", "plain", 2.0), _run("a", "c1", "ngram", 1.0),
        _run("a", "c1", "plain", 2.0), _run("a", "c1", "ngram", 1.0),
        _run("b", "c1", "plain", 1.0), _run("b", "c1", "ngram", 2.0, same=False),
        _run("c", "c2", "plain", 3.0), _run("c", "c2", "ngram", 1.0),
    ]  # fmt: skip
    s = summarize(runs)
    assert s["per_prompt"]["a"]["speedup"] == pytest.approx(2.0)
    assert s["per_category"]["c1"]["speedup"] == pytest.approx(1.0)  # sqrt(2 * 0.5)
    assert s["per_category"]["c2"] == {"speedup": pytest.approx(3.0), "call_ratio": 1.0, "prompts": 1}
    assert s["ngram_identical_to_plain"] == "3/4"
    runs[1] = _run("a", "c1", "ngram", 0.5)
    assert summarize(runs, statistic="min")["per_prompt"]["a"]["speedup"] == pytest.approx(4.0)
    assert summarize(runs)["per_prompt"]["a"]["speedup"] == pytest.approx(15.0 / 5.0)  # median of tokens/s


def test_missing_anchor_venv_is_reported_not_fatal(tmp_path):
    missing = tmp_path / "nowhere" / "bin" / "python"
    r = run_genai_anchor([PROMPT], python=missing)
    assert isinstance(r, AnchorUnavailable) and not r
    assert "setup_anchors.sh" in r.reason
    r = genai_step_latency(256, python=missing)
    assert isinstance(r, AnchorUnavailable)


def test_missing_packages_are_reported_not_fatal(tmp_path):
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("this interpreter has onnxruntime_genai")
    r = run_genai_anchor([PROMPT], python=sys.executable, model_dir=tmp_path)
    assert isinstance(r, AnchorUnavailable)
    assert "onnxruntime_genai" in r.reason


def test_broken_interpreter_is_reported_not_fatal(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho boom >&2\nexit 7\n")
    fake.chmod(0o755)
    for r in (run_genai_anchor([PROMPT], python=fake), run_hf_anchor([PROMPT], python=fake)):
        assert isinstance(r, AnchorUnavailable)
        assert "boom" in r.reason


def test_missing_model_is_reported_not_fatal(tmp_path):
    r = run_hf_anchor([PROMPT], gguf=tmp_path / "absent.gguf")
    assert isinstance(r, AnchorUnavailable)
    assert "absent.gguf" in r.reason or "lacks" in r.reason


def test_bad_prompts_are_reported_not_fatal():
    r = run_hf_anchor([{"id": "x"}], gguf=__file__)
    assert isinstance(r, AnchorUnavailable)


@pytest.mark.slow
def test_genai_anchor_end_to_end_when_set_up():
    paths = default_paths()
    if not paths["anchors_python"].exists() or not (paths["genai_int4"] / "genai_config.json").exists():
        pytest.skip("anchors not set up (scripts/setup_anchors.sh)")
    r = run_genai_anchor([PROMPT], precision="int4", max_new_tokens=8, timeout=600)
    assert r, getattr(r, "reason", "")
    assert [x["mode"] for x in r] == ["plain", "ngram"]
    assert all(1 <= x["new_tokens"] <= 8 for x in r)
    assert r[1]["matches_plain"] is True
