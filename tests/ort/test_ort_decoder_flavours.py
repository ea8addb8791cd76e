"""The standard-ONNX-ops graph (the TensorRT flavour), checked on the CPU EP, and the
ping-pong KV mode OrtDecoder uses under TensorRT, checked against the shared in-place mode."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from ortspec.export.tiny import make_tiny_llama, make_tiny_qwen2

from ortspec.export import ExportOptionError, export_model
from ortspec.runtime.ort import manifest as mf
from ortspec.runtime.errors import InvalidOptionError
from ortspec.runtime.ort.decoder import OrtDecoder

CAP, VERIFY = 48, 4
TOKENS = [5, 77, 301, 12, 190, 45, 9, 260, 33, 101, 7]  # [11]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    return {"llama": make_tiny_llama(root / "llama", seed=5),
            "qwen2": make_tiny_qwen2(root / "qwen")}


@pytest.fixture(scope="module")
def exported(sources, tmp_path_factory):
    """(family, attention) -> model directory."""
    root = tmp_path_factory.mktemp("out")
    return {(fam, att): export_model(src, out=root / f"{fam}-{att}", capacity=CAP,
                                     max_verify_len=VERIFY, attention=att, progress=False)
            for fam, src in sources.items() for att in ("gqa", "standard")}


def _run(decoder: OrtDecoder) -> np.ndarray:
    """Prefill, a rejected draft rolled back, then steps: [n, vocab] of everything returned."""
    rows = [decoder.forward_batch(TOKENS[:6])]
    decoder.forward_batch([3, 4, 5])
    decoder.truncate(6)
    rows.append(decoder.forward_batch(TOKENS[6:9]))
    rows += [decoder.forward_token(t)[None] for t in TOKENS[9:]]
    return np.concatenate(rows)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_standard_graph_uses_only_onnx_ops_and_matches_gqa(exported, family):
    d = exported[family, "standard"]
    m = mf.read_manifest(d)
    model = onnx.load(str(d / "model.onnx"), load_external_data=False)
    assert {n.domain for n in model.graph.node} == {""}  # nothing TensorRT cannot import
    assert {"Attention", "TensorScatter", "RotaryEmbedding", "RMSNormalization"} <= \
        {n.op_type for n in model.graph.node}
    assert {o.domain: o.version for o in model.opset_import} == {"": 24}
    assert m.extra["attention"] == "Attention"
    assert m.entry_points["step"].provider == "any"
    # same checkpoint, two graphs: the logits agree to float32 rounding
    standard = _run(OrtDecoder(d))
    gqa = _run(OrtDecoder(exported[family, "gqa"]))
    assert np.abs(standard - gqa).max() <= 1e-4
    assert np.abs(gqa).max() > 0.5


@pytest.mark.parametrize("attention", ["gqa", "standard"])
def test_ping_pong_kv_gives_the_same_logits_as_shared_buffers(exported, attention):
    d = exported["llama", attention]
    shared = OrtDecoder(d)
    pingpong = OrtDecoder(d, kv_mode="ping-pong")
    assert len(pingpong._kv_sets) == 2
    np.testing.assert_array_equal(_run(pingpong), _run(shared))


def test_standard_graph_writes_the_cache_in_place(exported):
    dec = OrtDecoder(exported["qwen2", "standard"])
    key = dec._kv_sets[0][0]
    ptr = key.data_ptr()
    dec.forward_batch(TOKENS[:5])
    k = key.numpy()  # [1, kv_heads, capacity, head_dim]
    assert np.abs(k[:, :, :5]).min(axis=-1).max() > 0 and not k[:, :, 5:].any()
    assert key.data_ptr() == ptr


def test_standard_attention_needs_opset_24(sources, tmp_path):
    with pytest.raises(ExportOptionError, match="with standard attention"):
        export_model(sources["llama"], out=tmp_path / "out", attention="standard", opset=23,
                     progress=False)
    with pytest.raises(ExportOptionError, match="attention must be one of"):
        export_model(sources["llama"], out=tmp_path / "out", attention="flash", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_unknown_kv_mode_is_refused(exported):
    with pytest.raises(InvalidOptionError, match="kv_mode"):
        OrtDecoder(exported["llama", "gqa"], kv_mode="triple")
