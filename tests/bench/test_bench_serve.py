"""The serving benchmark (`python -m ortspec.runtime.bench.serving`) end to end on a tiny batched export: it starts one `ortspec serve` per
drafter, drives them with the official openai client at several concurrencies, and its record
says what the servers did (requests per batched call, every output against its serial run)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ortspec.export.tiny import make_tiny_llama

BENCHMARK = [sys.executable, "-m", "ortspec.runtime.bench.serving"]

pytest.importorskip("openai")
pytest.importorskip("uvicorn")


@pytest.fixture(scope="module")
def tiny_window(tmp_path_factory):
    from ortspec.export import export_model

    src = make_tiny_llama(tmp_path_factory.mktemp("src") / "tiny-llama", seed=3)
    return export_model(src, out=tmp_path_factory.mktemp("out") / "llama-window", capacity=256,
                        max_verify_len=8, attention="window", progress=False)


def test_the_serving_benchmark_records_batched_calls_and_serial_outputs(tiny_window, tmp_path):
    out = tmp_path / "run"
    r = subprocess.run(
        [*BENCHMARK, "--model", str(tiny_window), "--drafters", "prompt-lookup,none",
         "--concurrency", "1,4", "--requests", "8", "--rounds", "2", "--max-tokens", "24",
         "--overhead-requests", "0", "--out", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert (out / "results.md").is_file() and (out / "throughput.png").is_file()
    levels = {(x["drafter"], x["concurrency"]): x for x in res["levels"]}
    assert set(levels) == {(d, c) for d in ("prompt-lookup", "none") for c in (1, 4)}
    for x in levels.values():
        assert x["requests"] == 16 and x["tokens"] > 0 and len(x["rounds"]) == 2
    ident = res["identical"]  # every request equals its serial text, and plain decoding's
    assert ident["requests"] == 64 and ident["all_identical"], ident["differing"][:2]
    assert ident["identical_to_serial"] == ident["identical_to_plain_serial"] == 64
    # one request at a time: every batched call carried one row; four at once: some carried more
    serial = levels["none", 1]["batch_rows"]
    assert serial["calls"] > 0 and serial["mean_rows"] == 1.0
    shared = levels["none", 4]["batch_rows"]
    assert shared["calls"] > 0 and shared["mean_rows"] > 1.0
    assert sum(n for k, n in shared["calls_by_rows"].items() if k != "1") > 0
    for x in levels.values():  # the model's time: shares of the wall time, prefill included
        t = x["model_time"]
        assert t["prefill"] > 0 and t["decode"] > 0
        assert t["prefill"] + t["decode"] + t["idle"] == pytest.approx(1.0)
    assert "| prompt-lookup | 4 | " in (out / "results.md").read_text().split("model's time")[1]
    assert res["checks"]["spec_over_plain_c4"]["prompt-lookup"]["ratio"] > 0
    paired = res["checks"]["spec_over_plain_paired"]["prompt-lookup"]
    assert set(paired) == {"1", "4"}
    for p in paired.values():
        assert p["rounds"] == 2 and p["low"] <= p["geomean"] <= p["high"]
    assert "prompt-lookup / plain, paired" in (out / "results.md").read_text()


def test_distinct_prompts_send_each_prompt_once_and_check_them_against_a_serial_pass(
        tiny_window, tmp_path):
    out = tmp_path / "run"
    r = subprocess.run(
        [*BENCHMARK, "--model", str(tiny_window), "--drafters", "none",
         "--distinct-prompts", "--concurrency", "1,2", "--requests", "2", "--rounds", "2",
         "--max-tokens", "12", "--overhead-requests", "0", "--out", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    sent = [o["prompt"] for x in res["levels"] for b in x["rounds"] for o in b["outputs"]]
    assert len(sent) == 8 and len(set(sent)) == 8  # the 8 chat prompts, each sent once
    ident = res["identical"]  # the c=2 prompts checked against the serial pass
    assert ident["requests"] == 8 and ident["identical_to_serial"] == 8, ident["differing"][:2]
    assert "serial pass none: 4 prompts" in r.stdout
    # too few prompts for distinct batches: refused before any server starts
    r = subprocess.run(
        [*BENCHMARK, "--model", str(tiny_window), "--drafters", "none",
         "--distinct-prompts", "--concurrency", "1,2", "--requests", "4", "--rounds", "2"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "--distinct-prompts needs" in r.stderr


def test_dev_split_prompts_keep_the_categories_asked_for():
    from ortspec.runtime.bench import serving as bench_serve
    from ortspec.runtime.bench.workload import load_questions
    from ortspec.runtime.errors import InvalidOptionError

    category = {q.text: q.category for q in load_questions(split="dev")}
    got = bench_serve.load_prompts("spec-bench-dev", per_category=2, categories=["qa", "translation"])
    assert len(got) == 4 and sorted(category[t] for t in got) == ["qa", "qa", "translation", "translation"]
    assert len(bench_serve.load_prompts("spec-bench-dev", per_category=2)) == 12  # all six
    with pytest.raises(InvalidOptionError, match="unknown categories"):
        bench_serve.load_prompts("spec-bench-dev", per_category=2, categories=["poetry"])
