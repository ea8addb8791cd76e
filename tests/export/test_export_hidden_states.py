"""`export_model(..., hidden_states=...)` on a tiny random Llama of 8 layers: the graph's
`hidden_states` output against transformers' `output_hidden_states`, verify rows against steps,
lossless decoding on such an export, early refusal, and an export without the option that is
the graph of before, node for node."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto
from transformers import AutoModelForCausalLM

from ortspec.export import ExportOptionError, export_model
from ortspec.export import graphs
from ortspec.export.hidden_states import eagle3_layers, parse_hidden_states
from ortspec.export.tiny import make_tiny_llama
from ortspec.runtime.check.tolerances import HIDDEN_STATE_TOLERANCES
from ortspec.runtime.decoding.loop import plain_decode, speculative_decode
from ortspec.runtime.decoding.options import SpeculativeOptions
from ortspec.runtime.ort import graph_io as gio
from ortspec.runtime.ort import kernels
from ortspec.runtime.ort import manifest as mf
from ortspec.runtime.ort.decoder import OrtDecoder

pytestmark = pytest.mark.slow  # builds and exports torch checkpoints

CAP, VERIFY, LAYERS, HIDDEN = 64, 4, 8, 64
AUTO = (2, 4, 5)  # eagle3_layers(8): (2, 8 // 2, 8 - 3)
TOKENS = [5, 77, 301, 12, 190, 45, 9, 260, 33, 101, 7, 250, 64, 18]  # [14]
# float32 against PyTorch: the states are of order 1-4 here, 30x below the 1e-3 logits bound
# of the export; measured ~2e-6
ATOL_VS_TORCH = 1e-4


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("src") / "tiny-llama8", seed=4,
                           num_hidden_layers=LAYERS)


@pytest.fixture(scope="module", params=["gqa", "window"])
def hs_dir(request, src, tmp_path_factory):
    return export_model(src, out=tmp_path_factory.mktemp("out") / f"hs-{request.param}",
                        capacity=CAP, max_verify_len=VERIFY, attention=request.param,
                        progress=False, hidden_states="auto")


@pytest.fixture(scope="module")
def torch_states(src):
    """transformers' hidden_states on TOKENS: LAYERS + 1 arrays [n, hidden], index 0 the
    embeddings, i + 1 the output of layer i (the last one after the final norm)."""
    model = AutoModelForCausalLM.from_pretrained(src).eval()
    with torch.no_grad():
        out = model(torch.tensor([TOKENS]), output_hidden_states=True)
    assert len(out.hidden_states) == LAYERS + 1
    return [h[0].numpy() for h in out.hidden_states]


@pytest.fixture(scope="module")
def reference(torch_states):
    """hidden_states[k] for k in AUTO, concatenated: [n, 3 * hidden]."""
    return np.concatenate([torch_states[k] for k in AUTO], axis=-1)


def _io(graph_path):
    model = onnx.load(str(graph_path), load_external_data=False)

    def dims(v):
        return [d.dim_value if d.HasField("dim_value") else d.dim_param
                for d in v.type.tensor_type.shape.dim]

    return model, {v.name: (v.type.tensor_type.elem_type, dims(v)) for v in model.graph.output}


def test_auto_is_the_eagle3_default():
    assert eagle3_layers(LAYERS) == AUTO
    assert eagle3_layers(30) == (2, 15, 27)  # SmolLM2-135M
    assert parse_hidden_states("auto") == "auto"
    assert parse_hidden_states("2,15,27") == (2, 15, 27)
    with pytest.raises(ExportOptionError, match="layer ids like"):
        parse_hidden_states("2,middle,27")


def test_the_graph_returns_hidden_states_at_the_logit_rows(hs_dir):
    m = mf.read_manifest(hs_dir)
    assert m.hidden_state_layers == AUTO
    assert json.loads((hs_dir / "manifest.json").read_text())["hidden_state_layers"] == list(AUTO)
    report = m.extra["hidden_state_validation"]
    assert report["layers"] == list(AUTO)
    assert report["verify_vs_pytorch"] <= report["bound_vs_pytorch"]
    _, outs = _io(hs_dir / m.entry_points["step"].graph)
    assert outs[gio.HIDDEN_STATES] == (TensorProto.FLOAT, ["logit_rows", 3 * HIDDEN])
    assert outs[gio.LOGITS] == (TensorProto.FLOAT, ["logit_rows", m.architecture.vocab_size])


def test_verify_and_step_match_transformers_and_each_other(hs_dir, reference, torch_states):
    decoder = OrtDecoder(hs_dir)
    verify = []  # the verify entry point in blocks, as speculative decoding calls it
    for i in range(0, len(TOKENS), VERIFY):
        decoder.forward_batch(TOKENS[i:i + VERIFY])
        verify.append(decoder.last_hidden_states())
    verify = np.concatenate(verify)  # [n, 3 * hidden]
    decoder.reset()
    step = []
    for t in TOKENS:
        decoder.forward_token(t)
        step.append(decoder.last_hidden_states())  # [1, 3 * hidden]
    step = np.concatenate(step)
    assert verify.shape == step.shape == reference.shape == (len(TOKENS), 3 * HIDDEN)
    assert np.abs(reference).max() > 0.5  # not trivially near zero
    np.testing.assert_allclose(verify, reference, rtol=0, atol=ATOL_VS_TORCH)
    np.testing.assert_allclose(step, reference, rtol=0, atol=ATOL_VS_TORCH)
    # every verify row is its step's state within the export's fp32 entry-point bound
    bound = HIDDEN_STATE_TOLERANCES["fp32"].step_vs_verify.at(float(np.abs(reference).max()))
    assert np.abs(verify - step).max() <= bound
    # the convention it must not follow: id k as the output of layer k (hidden_states[k + 1])
    off_by_one = np.concatenate([torch_states[k + 1] for k in AUTO], axis=-1)
    assert np.abs(verify - off_by_one).max() > 0.1


def test_prefill_and_a_long_batch_return_the_rows_they_return_logits_for(hs_dir, reference):
    decoder = OrtDecoder(hs_dir)
    decoder.prefill(TOKENS)
    np.testing.assert_allclose(decoder.last_hidden_states(), reference[-1:], rtol=0,
                               atol=ATOL_VS_TORCH)
    decoder.reset()
    decoder.prefill_chunk = VERIFY  # forward_batch then runs 14 tokens in 4 calls
    decoder.forward_batch(TOKENS)
    np.testing.assert_allclose(decoder.last_hidden_states(), reference, rtol=0,
                               atol=ATOL_VS_TORCH)


def test_greedy_prompt_lookup_is_plain_decoding_token_for_token(hs_dir):
    prompt = TOKENS + TOKENS[:6]  # a repeat, so prompt lookup drafts
    decoder = OrtDecoder(hs_dir)
    plain = plain_decode(decoder, prompt, SpeculativeOptions(24))
    decoder.reset()
    spec = speculative_decode(decoder, prompt, 24)
    assert spec.tokens == plain.tokens
    assert spec.counters.verify_calls < len(plain.tokens)  # it did speculate


def _block_states(out) -> tuple[np.ndarray, np.ndarray]:
    """The states of TOKENS from verify calls of VERIFY tokens and from steps: [n, 3 * hidden]."""
    decoder = OrtDecoder(out)
    verify = []
    for i in range(0, len(TOKENS), VERIFY):
        decoder.forward_batch(TOKENS[i:i + VERIFY])
        verify.append(decoder.last_hidden_states())
    decoder.reset()
    step = []
    for t in TOKENS:
        decoder.forward_token(t)
        step.append(decoder.last_hidden_states())
    return np.concatenate(verify), np.concatenate(step)


@pytest.mark.skipif(not kernels.available(), reason="ortspec's kernel library is not built")
@pytest.mark.parametrize("attention", ["gqa", "window"])
def test_int4_states_come_from_the_products_that_hold_the_skip_norms(src, tmp_path, monkeypatch,
                                                                     attention):
    """On ortspec's kernels the skip norm before each 4-bit product is inside the product's node,
    which gives out the residual sum the states are read from: the states are those of the same
    export with the norms left as nodes, within float32 rounding, and a verify row is its step's
    row bit for bit."""
    options = dict(capacity=CAP, max_verify_len=VERIFY, attention=attention, progress=False,
                   hidden_states="auto", quant="int4", kernel="ortspec")
    fused = export_model(src, out=tmp_path / "fused", **options)
    monkeypatch.setattr(graphs, "fuse_skip_norms", lambda nodes: nodes)
    apart = export_model(src, out=tmp_path / "apart", **options)
    for out, norm_nodes in ((fused, 1), (apart, 2 * LAYERS)):
        m = mf.read_manifest(out)
        model, _ = _io(out / m.entry_points["step"].graph)
        ops = Counter(n.op_type for n in model.graph.node)
        assert ops["SkipSimplifiedLayerNormalization"] == norm_nodes
        assert ops["Q4GemmNorm"] + ops["Q4GemmSwiGluNorm"] == 2 * LAYERS - norm_nodes
        report = m.extra["hidden_state_validation"]
        assert report["step_vs_verify"] == 0.0
    verify, step = _block_states(fused)
    assert np.array_equal(verify, step)
    apart_verify, _ = _block_states(apart)
    top = float(np.abs(apart_verify).max())
    assert top > 0.5
    # the same sums in another rounding order (the norm's sum of squares): the fp32 bound of
    # two entry points of one export, which differ in that way too
    assert np.abs(verify - apart_verify).max() <= \
        HIDDEN_STATE_TOLERANCES["fp32"].step_vs_verify.at(top)


@pytest.mark.parametrize("options, match", [
    (dict(attention="standard"), "attention 'gqa' or 'window'"),
    (dict(dtype="fp16"), "float32"),
    (dict(hidden_states=(0, 4, 5)), r"1\.\.7"),
    (dict(hidden_states=(2, 4, 8)), r"1\.\.7"),
    (dict(hidden_states=(2, 4, 4)), "repeat"),
    (dict(hidden_states=(2, 4.0, 5)), "integer layer ids"),
    (dict(hidden_states="all"), "'auto'"),
    (dict(hidden_states=()), "integer layer ids"),
])
def test_unsupported_requests_are_refused_before_any_work(src, tmp_path, monkeypatch, options,
                                                          match):
    import ortspec.export.api as api

    def loaded(*a, **k):
        raise AssertionError("the checkpoint was read")

    monkeypatch.setattr(api, "materialize", loaded)
    options = {"hidden_states": "auto", **options}
    with pytest.raises(ExportOptionError, match=match):
        export_model(src, out=tmp_path / "out", capacity=CAP, max_verify_len=VERIFY,
                     progress=False, **options)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("layers", [2, 6])
def test_auto_needs_seven_layers(tmp_path, layers):
    # 2 layers: (2, 1, -1) is out of range; 6: (2, 3, 3) repeats a layer
    small = make_tiny_llama(tmp_path / "src", seed=0, num_hidden_layers=layers)
    with pytest.raises(ExportOptionError, match="7 layers or more"):
        export_model(small, out=tmp_path / "out", capacity=CAP, max_verify_len=VERIFY,
                     progress=False, hidden_states="auto")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("attention", ["gqa", "window"])
def test_without_the_option_the_graph_is_unchanged(src, tmp_path, attention):
    """Byte-identical to the graph before the option existed (checked with cmp against an
    export of the previous revision when it was added); here: two exports without the option
    are byte-identical, have no hidden-state output, and are node for node (names, inputs and
    initializers) the start of the export with it, whose extra nodes come after the LM head."""
    common = dict(capacity=CAP, max_verify_len=VERIFY, attention=attention, progress=False)
    a = export_model(src, out=tmp_path / "a", **common)
    b = export_model(src, out=tmp_path / "b", **common)
    h = export_model(src, out=tmp_path / "h", hidden_states=[2, 5], **common)
    for name in ("model.onnx", "model.onnx.data"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert (a / "model.onnx.data").read_bytes() == (h / "model.onnx.data").read_bytes()
    assert "hidden_state_layers" not in json.loads((a / "manifest.json").read_text())
    assert mf.read_manifest(a).hidden_state_layers is None
    plain, outs = _io(a / "model.onnx")
    with_hs, hs_outs = _io(h / "model.onnx")
    assert gio.HIDDEN_STATES not in outs
    assert hs_outs[gio.HIDDEN_STATES] == (TensorProto.FLOAT, ["logit_rows", 2 * HIDDEN])
    nodes = list(plain.graph.node)
    assert list(with_hs.graph.node)[:len(nodes)] == nodes
    assert with_hs.graph.node[-1].output == [gio.HIDDEN_STATES]
    assert list(with_hs.graph.initializer)[:len(plain.graph.initializer)] == \
        list(plain.graph.initializer)


def test_the_command_line_refuses_a_bad_value_in_one_line(src, tmp_path, capsys):
    from ortspec.export.cli import main

    assert main([str(src), "--out", str(tmp_path / "out"), "--hidden-states", "2,x"]) == 2
    assert "--hidden-states takes 'auto' or layer ids" in capsys.readouterr().err
    assert main([str(src), "--out", str(tmp_path / "out"), "--hidden-states", "auto",
                 "--attention", "standard"]) == 2
    assert "attention 'gqa' or 'window'" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
