"""The development scripts under scripts/, each run as a reader of the docs runs it (a subprocess,
from outside the checkout), with the smallest arguments that still exercise every part: what
they print must hold what their docs promise. The default model's int4 export is made on first
use (the export extra); scripts/demo.py is tests/model/test_real_int4.py's, row_floor.py
tests/bench/test_row_floor.py's, train_eagle3.py's training export/eagle3_train's."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def run_script(name: str, *args: str, cwd: Path, timeout: int = 300) -> str:
    """The script's stdout; its exit status must be 0."""
    done = subprocess.run([sys.executable, str(SCRIPTS / name), *args], cwd=cwd, env=os.environ,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def test_row_invariance_layers_compares_every_node_of_an_int4_export(int4_model_dir, tmp_path):
    out = run_script("row_invariance_layers.py", str(int4_model_dir), "--block-lengths", "2,5",
                     cwd=tmp_path)
    lines = re.findall(r"block of +(\d+): first differing node (.+) \((\d+) node outputs "
                       r"compared\); logits max \|diff\| (\S+)", out)
    assert [line[0] for line in lines] == ["2", "5"], out
    for _, first, compared, logits in lines:
        # 30 layers of products and attention: every one a [rows, width] output compared
        assert int(compared) > 30 * 4, out
        # the int4 export runs every row as its step does (ortspec's kernels), so nothing differs
        assert (first, float(logits)) == ("none", 0.0), out


def test_profile_int4_rows_prints_its_table(tmp_path):
    pytest.importorskip("onnx", reason="the export extra")
    out = run_script("profile_int4_rows.py", "--shapes", "qkv", "--rounds", "1", "--calls", "1",
                     "--copies", "2", "--levels", "4", "--blocks", "32", cwd=tmp_path)
    rows = [line for line in out.splitlines() if line.startswith("| qkv | 576->960 |")]
    # fp32 MatMul, then MatMulNBits without and with zero points at level 4, block 32
    assert [r.split("|")[3].strip() for r in rows] == ["fp32", "int4", "int4"], out


def test_candidate_mass_gives_probabilities_per_category(int4_model_dir, tmp_path):
    out = run_script("candidate_mass.py", "--model", str(int4_model_dir), "--per-category", "1",
                     "--max-new-tokens", "6", "--temperature", "1", cwd=tmp_path)
    overall = next(line for line in out.splitlines() if line.startswith("| overall |"))
    cells = [c.strip() for c in overall.strip("|").split("|")]
    assert int(cells[1]) == 6 * 6  # six categories, one prompt each, six positions each
    masses = [float(c) for c in cells[2:6]]  # top-1, 2, 4, 8 mass: non-decreasing in K
    assert all(0 <= m <= 1 for m in masses) and masses == sorted(masses), overall


def test_soak_runs_its_request_mix_and_reports_memory(int4_model_dir, tmp_path):
    report = tmp_path / "soak.md"
    run_script("soak.py", "--model", str(int4_model_dir), "--tokens", "150", "--prompts", "2",
               "--max-new-tokens", "12", "--warmup-cycles", "1", "--report", str(report),
               cwd=tmp_path)
    text = report.read_text()
    mix = re.search(r"requests per mode and temperature \| (.+) \|", text)[1]
    modes = dict(re.findall(r"(\w+ t=[0-9.]+): (\d+)", mix))
    # speculative and plain requests at temperatures 0, 0.7 and 1, on the one loaded model
    assert {m.split()[0] for m in modes} == {"speculative", "plain"}, mix
    assert {m.split("=")[1] for m in modes} == {"0.0", "0.7", "1.0"}, mix


def test_bench_eagle3_head_times_random_heads_against_the_target(int4_model_dir, tmp_path):
    out = run_script("bench_eagle3_head.py", "--model", str(int4_model_dir), "--rounds", "1",
                     "--context", "16", cwd=tmp_path)
    for kind in ("fp32", "int8"):
        for what in ("step (own hidden)", "first step (fc)", "x4 from target"):
            assert re.search(rf"head {kind} {re.escape(what)} +[0-9.]+ +[0-9.]+", out), out


def test_gpu_check_dry_run_on_the_cpu(tmp_path):
    pytest.importorskip("torch", reason="the export extra")
    out = run_script("gpu_check.py", "--cpu-dry-run", "--work", str(tmp_path / "work"),
                     cwd=tmp_path, timeout=600)
    assert "CPUExecutionProvider: greedy identity 3/3 PASS" in out, out
    assert re.search(r"\| CPUExecutionProvider \| 3/3 \|", out), out
