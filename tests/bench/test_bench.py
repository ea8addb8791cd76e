"""The benchmark's workload, method parsing and aggregation (no timing is asserted)."""

import json

import pytest

from ortspec.runtime.bench.report import aggregate, markdown_tables
from ortspec.runtime.bench.runner import SPECULATIVE, Method
from ortspec.runtime.bench.workload import CATEGORIES, interleave_categories, load_questions
from ortspec.runtime.errors import InvalidOptionError


@pytest.fixture()
def questions(tmp_path):
    rows = []
    qid = 0
    for sub in ["writing", "coding", "translation", "qa"]:
        for _ in range(4):
            rows.append({"question_id": qid, "category": sub, "turns": [f"{sub} question {qid}", "second turn"]})
            qid += 1
    path = tmp_path / "question.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_dev_split_is_even_ids_and_heldout_is_odd(questions):
    dev = load_questions(questions, split="dev")
    held = load_questions(questions, split="heldout")
    assert all(q.question_id % 2 == 0 for q in dev) and all(q.question_id % 2 for q in held)
    assert len(dev) + len(held) == 16
    assert {q.category for q in dev} == {"multi-turn", "translation", "qa"}
    assert all(q.text == f"{q.subcategory} question {q.question_id}" for q in dev)  # first turn only


def test_per_category_takes_multi_turn_round_robin_over_subcategories(questions):
    dev = load_questions(questions, split="dev", per_category=2)
    mt = [q for q in dev if q.category == "multi-turn"]
    assert [q.subcategory for q in mt] == ["coding", "writing"]
    assert len(dev) == 6


def test_prompts_are_interleaved_across_categories(questions):
    dev = interleave_categories(load_questions(questions, split="dev"))
    assert [q.category for q in dev[:3]] == ["multi-turn", "translation", "qa"]


def test_bad_workload_options_are_refused(questions, tmp_path):
    with pytest.raises(InvalidOptionError):
        load_questions(questions, split="test")
    with pytest.raises(InvalidOptionError):
        load_questions(questions, categories=("poetry",))
    with pytest.raises(InvalidOptionError):
        load_questions(tmp_path / "missing.jsonl")


def test_methods_parse():
    assert Method.parse("plain").drafter == "none"
    m = Method.parse("prompt-lookup:k4")
    assert (m.drafter, m.fixed_k) == ("prompt-lookup", 4)
    assert Method.parse("prompt-lookup").fixed_k is None
    m = Method.parse("draft-model:k3:c256")
    assert (m.drafter, m.fixed_k, m.draft_context) == ("draft-model", 3, 256)
    assert Method.parse("prompt-lookup+draft-model:c0").draft_context == 0  # the whole history
    for name in SPECULATIVE:  # every drafter is a method, with and without a fixed length
        assert Method.parse(name).drafter == name
        assert Method.parse(f"{name}:k3").fixed_k == 3
    for bad in ("lookup", "prompt-lookup:k0", "prompt-lookup:4", "draft-model:c256:k3"):
        with pytest.raises(InvalidOptionError):
            Method.parse(bad)
    with pytest.raises(InvalidOptionError, match=":cN .* applies to"):
        Method.parse("prompt-lookup:c64")


def _rec(method, qid, cat, tokens, seconds, prefill=0.0, **kw):
    base = dict(question_id=qid, category=cat, method=method, repeat=0, new_tokens=tokens, seconds=seconds,
                prefill_seconds=prefill, ort_seconds=seconds * 0.9, draft_seconds=0.0, sample_seconds=0.0,
                verify_calls=0, forward_token_calls=tokens, drafted=0, accepted=0, recovered=0, bonus=tokens,
                drafted_by_position=[], accepted_by_position=[])
    base.update(kw)
    return base


def test_speedup_is_the_ratio_of_total_tokens_per_second_by_hand():
    records = [
        _rec("plain", 0, "qa", 100, 4.0, prefill=1.0),
        _rec("plain", 2, "qa", 100, 6.0, prefill=1.0),
        _rec("prompt-lookup", 0, "qa", 100, 2.0, prefill=1.0, verify_calls=20, forward_token_calls=10,
             drafted=60, accepted=50, recovered=10, bonus=40, drafted_by_position=[20, 20, 20],
             accepted_by_position=[20, 18, 12], identical_to_plain=True),
        _rec("prompt-lookup", 2, "qa", 100, 6.0, prefill=1.0, verify_calls=0, forward_token_calls=100,
             identical_to_plain=True),
    ]
    aggs = {(a.method, a.category): a for a in aggregate(records, methods=["plain", "prompt-lookup"])}
    pl = aggs[("prompt-lookup", "qa")]
    # plain: 200 tokens / 10 s = 20 tok/s; prompt lookup: 200 / 8 s = 25 tok/s -> 1.25x
    assert pl.speedup == pytest.approx(1.25)
    assert pl.raw_speedup == pytest.approx(1.25)  # equal token counts: the same figure
    # without prefill: 200 / 8 s vs 200 / 6 s -> 1.333x
    assert pl.decode_speedup == pytest.approx(8 / 6)
    # per-prompt ratios 2.0 and 1.0 -> geometric mean sqrt(2)
    assert pl.speedup_geomean == pytest.approx(2**0.5)
    # 200 tokens over 130 target calls, bonus included
    assert pl.tokens_per_call == pytest.approx(200 / 130)
    assert pl.acceptance_by_position == pytest.approx([1.0, 0.9, 0.6])
    assert pl.identical == 2
    assert aggs[("prompt-lookup", "overall")].speedup == pytest.approx(1.25)
    table = markdown_tables(list(aggs.values()))
    assert "| qa | prompt-lookup | 2 | 25.0 | 1.25× | 1.25× | 1.33× |" in table


def test_speedup_at_unequal_lengths_charges_each_method_plains_token_count():
    # sampled outputs: the same per-token decode rate, a shorter output by chance. Raw tokens/s
    # punishes the shorter run for its larger prefill share; the length-matched speedup does not.
    records = [
        _rec("plain", 0, "rag", 100, 3.0, prefill=1.0),  # decode 2 s for 100 tokens
        _rec("prompt-lookup", 0, "rag", 50, 2.0, prefill=1.0),  # decode 1 s for 50: same rate
    ]
    pl = {(a.method, a.category): a
          for a in aggregate(records, methods=["plain", "prompt-lookup"])}[("prompt-lookup", "rag")]
    assert pl.raw_speedup == pytest.approx((50 / 2.0) / (100 / 3.0))  # 0.75
    assert pl.decode_speedup == pytest.approx(1.0)
    assert pl.speedup == pytest.approx(1.0)  # 3 s / (1 s prefill + 1 s * 100 / 50)
    # a faster decode shows through: 50 tokens in 0.5 s -> 3 / (1 + 0.5 * 2) = 1.5
    records[1] = _rec("prompt-lookup", 0, "rag", 50, 1.5, prefill=1.0)
    pl = {(a.method, a.category): a
          for a in aggregate(records, methods=["plain", "prompt-lookup"])}[("prompt-lookup", "rag")]
    assert pl.speedup == pytest.approx(1.5)


def test_categories_are_the_documented_six():
    assert CATEGORIES == ("multi-turn", "translation", "summarization", "qa", "math_reasoning", "rag")


def test_reaggregate_rewrites_a_finished_run_with_this_versions_tables(tmp_path, capsys):
    from ortspec.runtime.bench.cli import main as bench_main

    records = [
        _rec("plain", 0, "rag", 100, 3.0, prefill=1.0),
        _rec("prompt-lookup", 0, "rag", 50, 2.0, prefill=1.0),
    ]
    run = tmp_path / "run"
    run.mkdir()
    (run / "results.json").write_text(json.dumps({
        "command": "ortspec bench --temperature 1", "methods": ["plain", "prompt-lookup"],
        "config": {"temperature": 1.0}, "model": "/m/tiny", "aggregates": ["stale"], "records": records}))
    assert bench_main(["--reaggregate", str(run)]) == 0
    md = (run / "results.md").read_text()
    assert "re-aggregated from results.json" in md
    assert "dev split, T=1.0, 1 prompts" in md  # title rebuilt from the records (even id: dev)
    # the length-matched speedup (1.00x) beside the raw tokens/s ratio (0.75x)
    assert "| rag | prompt-lookup | 1 | 25.0 | 1.00× | 0.75× | 1.00× |" in md
    data = json.loads((run / "results.json").read_text())
    assert data["records"] == records and data["aggregates"] != ["stale"]
    # a directory without a run's results.json is refused in one line
    capsys.readouterr()
    assert bench_main(["--reaggregate", str(tmp_path)]) == 2
    assert "--reaggregate needs a directory with a results.json" in capsys.readouterr().err


TINY_EXPORT = {"seed": 5, "capacity": 512, "max_verify_len": 8}  # the tiny_dir fixture


def test_an_interrupted_run_resumes_where_it_stopped(tiny_dir, tmp_path, monkeypatch, capsys):
    """A run killed after some prompts leaves their records in partial.jsonl; --resume with the
    same options decodes only the rest and writes the tables a whole run writes; other options
    are refused before anything is decoded."""
    from ortspec.runtime.bench import checkpoint
    from ortspec.runtime.bench.cli import main as bench_main
    from ortspec.runtime.model import Model

    argv = ["--model", str(tiny_dir), "--per-category", "1", "--categories", "qa,translation,math_reasoning,rag",
            "--max-new-tokens", "6", "--methods", "plain,prompt-lookup"]
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert bench_main(argv + ["--out", str(whole)]) == 0
    err = capsys.readouterr().err  # off a terminal: a line per prompt, no bar frames
    assert "\r" not in err and [line.split(",")[0] for line in err.splitlines()
                                if line.startswith("bench: ")] == [
        f"bench: {i}/4 prompts" for i in range(1, 5)]
    assert not (whole / checkpoint.FILE_NAME).exists()  # removed once the tables are written
    data = json.loads((whole / "results.json").read_text())
    expected = data["records"]
    # translation, qa and math_reasoning decoded by both methods; the rag prompt does not fit
    assert len(expected) == 6 and [s["category"] for s in data["skipped"]] == ["rag"]

    calls = []
    real_generate = Model.generate

    def generate(self, ids, **kw):  # the bench's warm-up and two prompts' decodes, then killed
        if len(calls) == 5:
            raise KeyboardInterrupt
        calls.append(kw.get("drafter"))
        return real_generate(self, ids, **kw)

    monkeypatch.setattr(Model, "generate", generate)
    with pytest.raises(KeyboardInterrupt):
        bench_main(argv + ["--out", str(part)])
    assert not (part / "results.json").exists()
    lines = (part / checkpoint.FILE_NAME).read_text().splitlines()
    assert len(lines) == 3  # the run's options, then two finished prompts

    capsys.readouterr()
    assert bench_main(argv[:-2] + ["--methods", "plain", "--out", str(part), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "from a run with other options (methods" in err and "--resume" in err
    assert bench_main(argv + ["--out", str(tmp_path / "none"), "--resume"]) == 2
    assert "does not exist" in capsys.readouterr().err

    calls.clear()
    assert bench_main(argv + ["--out", str(part), "--resume"]) == 0
    assert len(calls) == 1 + 2  # the warm-up, then the third prompt's two methods only
    data = json.loads((part / "results.json").read_text())
    resumed = data["records"]
    assert [s["category"] for s in data["skipped"]] == ["rag"]
    key = lambda r: (r["question_id"], r["method"])  # noqa: E731
    assert sorted(map(key, resumed)) == sorted(map(key, expected))
    by_key = {key(r): r for r in expected}
    for r in resumed:  # greedy: each decode is the uninterrupted run's
        assert r["tokens"] == by_key[key(r)]["tokens"]
        assert r.get("identical_to_plain") == by_key[key(r)].get("identical_to_plain")
    assert not (part / checkpoint.FILE_NAME).exists()
