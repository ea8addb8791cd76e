"""scripts/row_floor.py: the arithmetic it counts in an export's graph, and the script end to end
(probe compiled, curve timed, table printed). No timing is asserted: the machine's speed drifts."""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

import pytest

from ortspec.runtime.ort.manifest import read_manifest

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "row_floor.py"


@pytest.fixture(scope="module")
def row_floor():
    spec = importlib.util.spec_from_file_location("row_floor", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_it_counts_every_multiply_add_of_a_row_in_the_int4_graph(row_floor, int4_model_dir):
    # SmolLM2-135M as published: 30 layers, hidden 576, 9 query heads and 3 KV heads of 64, MLP
    # 1536, vocabulary 49152 (tied head). Whatever the exporter fuses (q, k, v into one product;
    # gate and up into one; norms into them), a row multiplies by every weight once.
    per_layer = 576 * (576 + 2 * 192) + 576 * 576 + 576 * 2 * 1536 + 1536 * 576
    ints, floats = row_floor.graph_macs(Path(int4_model_dir), 256)
    assert ints == 30 * per_layer + 576 * 49152
    assert floats == 2 * 30 * 9 * 64 * 256  # scores and weighted values of every query head
    assert row_floor.graph_macs(Path(int4_model_dir), 512)[1] == 2 * floats


def test_a_step_reads_every_weight_but_the_embedding_table_and_the_context(row_floor,
                                                                          int4_model_dir):
    directory = Path(int4_model_dir)
    # keys and values, float16 (the int4 default on ortspec's kernels; float32 elsewhere), 3 KV
    # heads of 64, 30 layers
    element = 2 if read_manifest(directory).extra["kv_cache"] == "fp16" else 4
    kv_256 = 2 * element * 30 * 3 * 64 * 256
    at_256, at_512 = row_floor.step_bytes(directory, 256), row_floor.step_bytes(directory, 512)
    assert at_512 - at_256 == kv_256
    weights = at_256 - kv_256
    products = 30 * (576 * (576 + 2 * 192) + 576 * 576 + 576 * 2 * 1536 + 1536 * 576)
    head = 576 * 49152
    # the 4-bit products (half a byte a weight; float16 d and m for each 32: 0.125 more) and the
    # 8-bit head (a float32 scale for each 32), the norms' weights within a MiB; the embedding
    # table, as big as the head, is looked up a row at a time, not read
    assert products // 2 + head < weights <= products * 5 // 8 + head * 9 // 8 + (1 << 20)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler for the probe")
def test_the_script_prints_the_floor_beside_the_measured_curve(row_floor, int4_model_dir, capsys):
    assert row_floor.main([str(int4_model_dir), "--reps", "2", "--rows", "4"]) == 0
    out = capsys.readouterr().out
    floor = float(re.search(r"floor of c\(4\)/c\(1\) = 1 \+ 3 x floor / c\(1\) \| ([0-9.]+)", out)[1])
    measured = float(re.search(r"c\(4\)/c\(1\), measured \| ([0-9.]+)", out)[1])
    assert floor > 1 and measured > 0
    for ns in re.findall(r"one core \(\d+ MACs\) \| ([0-9.]+) ns", out):
        assert float(ns) > 0
    assert float(re.search(r"memory read, 2 threads \| ([0-9.]+) GB/s", out)[1]) > 0


def test_it_refuses_a_block_of_one_row(row_floor):
    with pytest.raises(SystemExit):
        row_floor.main(["--rows", "1"])
