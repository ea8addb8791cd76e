"""Self-speculative drafts exported beside the target (export/drafts.py, export/quantize.py):
the MatMulNBits layout against onnxruntime itself, the int4 and layer-skip graphs against
PyTorch, the manifest pairing, greedy identity of speculative decoding with a draft, refusal of
bad options before anything is written, and the all-or-nothing update of a target directory.

The tiny models come from ortspec.export.tiny; the last tests (marked slow) use the real default
model, whose drafts they export on first use into its cached directory."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers.threads import in_threads
from ortspec.export.tiny import make_tiny_llama, make_tiny_qwen2
from onnx import TensorProto, helper, numpy_helper

from ortspec.export import DraftOptionError, ExportOptionError, add_draft, export_model
from ortspec.export import drafts as drafts_mod
from ortspec.export.quantize import quantize_blockwise
from ortspec.runtime import (DraftModelDrafter, DrafterSpec, SpeculativeOptions, load_model,
                             plain_decode, speculative_decode_with)
from ortspec.runtime.ort import graph_io as gio
from ortspec.runtime.ort import manifest as mf
from ortspec.runtime.errors import DrafterError, ExportError, InvalidOptionError, ManifestError
from ortspec.runtime.ort.decoder import OrtDecoder

CAP, VERIFY = 64, 4
LAYERS = 2  # of the tiny Llama


pytestmark = pytest.mark.slow  # builds and exports torch checkpoints


@pytest.fixture(scope="module")
def llama_src(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("src") / "tiny-llama")


@pytest.fixture(scope="module")
def target_dir(llama_src, tmp_path_factory):
    """The tiny Llama with an int4 draft exported alongside, then a layer-skip one added."""
    out = tmp_path_factory.mktemp("out") / "llama"
    export_model(llama_src, out=out, capacity=CAP, max_verify_len=VERIFY, progress=False,
                 draft_quant="int4")
    add_draft(out, None, layers=1, progress=False)
    return out


@pytest.fixture(scope="module")
def checkpoint(llama_src):
    from ortspec.export.checkpoint import load_checkpoint
    from ortspec.export.sources import identify_source

    return load_checkpoint(identify_source(llama_src), capacity=CAP, progress=False)


def _ids(n: int = 40, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(5, 320, n).tolist()


def _graph_ops(directory: Path) -> set[str]:
    model = onnx.load(str(directory / "model.onnx"), load_external_data=False)
    return {n.op_type for n in model.graph.node}


# -- the quantizer, against onnxruntime's MatMulNBits itself ------------------------------------


def _q4_1_grid(rng, n: int, k: int) -> np.ndarray:
    """Weights exactly as transformers dequantises a llama.cpp Q4_1 tensor: d * q + m, d and m
    float16, q in 0..15 with each block's min at 0 and max at 15 (llama.cpp's quantizer)."""
    blocks = k // 32
    d = rng.uniform(0.005, 0.05, (n, blocks)).astype(np.float16).astype(np.float32)
    m = rng.uniform(-0.5, 0.1, (n, blocks)).astype(np.float16).astype(np.float32)
    q = rng.integers(0, 16, (n, blocks, 32))
    q[..., 3], q[..., 17] = 0, 15
    return (d[..., None] * q + m[..., None]).reshape(n, k).astype(np.float32)


def test_block_min_recovers_a_q4_1_tensor_exactly():
    w = _q4_1_grid(np.random.default_rng(0), 48, 96)
    qw = quantize_blockwise(w, bits=4, block_size=32, scheme="block-min")
    # the same 16 levels per block: float32 rounding of d * q + m only, not a re-rounding
    assert np.abs(qw.dequantize() - w).max() <= 1e-6 * np.abs(w).max()
    # whereas an integer zero point alone re-rounds every element, up to half a step
    zp = quantize_blockwise(w, bits=4, block_size=32, scheme="zero-point")
    err = np.abs(zp.dequantize() - w).reshape(48, 3, 32)
    assert 0.05 < (err.max(-1) / zp.scales).max() <= 0.5 + 1e-5


def test_symmetric_8_bit_recovers_a_q8_0_tensor_exactly():
    rng = np.random.default_rng(1)
    d = rng.uniform(1e-3, 1e-2, (20, 4)).astype(np.float16).astype(np.float32)
    q = rng.integers(-127, 128, (20, 4, 32))
    q[..., 0] = 127  # llama.cpp maps each block's largest |x| to +-127
    w = (d[..., None] * q).reshape(20, 128).astype(np.float32)
    qw = quantize_blockwise(w, bits=8, block_size=32, scheme="symmetric")
    assert qw.zero_points is None and qw.mins is None  # MatMulNBits' default zero point, 128
    assert np.abs(qw.dequantize() - w).max() <= 1e-6 * np.abs(w).max()


@pytest.mark.parametrize("bits,scheme", [(4, "block-min"), (4, "zero-point"), (4, "symmetric"),
                                         (8, "symmetric"), (8, "block-min")])
def test_onnxruntime_multiplies_by_exactly_the_dequantized_weight(bits, scheme):
    """One MatMulNBits node with float activations (accuracy_level 0) against NumPy with
    `dequantize()`: the packing, the scales, the zero points and the block-min offset are
    what onnxruntime reads, to float32 rounding."""
    import onnxruntime as ort

    rng = np.random.default_rng(2)
    n, k = 40, 96  # 3 blocks: an odd count, so the 4-bit zero points are padded
    w = rng.standard_normal((n, k)).astype(np.float32)
    qw = quantize_blockwise(w, bits=bits, block_size=32, scheme=scheme)
    inits = [numpy_helper.from_array(qw.packed, "B"),
             numpy_helper.from_array(qw.scales.reshape(-1), "scales")]
    inputs = ["A", "B", "scales"]
    if qw.zero_points is not None:
        inits.append(numpy_helper.from_array(qw.zero_points.reshape(-1), "zp"))
        inputs.append("zp")
    nodes = [helper.make_node("MatMulNBits", inputs, ["Y0"], domain="com.microsoft", K=k, N=n,
                              bits=bits, block_size=32, accuracy_level=0)]
    if qw.mins is not None:  # as builder.py adds the offsets back: blocksum(A) @ offsets.T
        inits += [numpy_helper.from_array(qw.mins.T.copy(), "offsets"),
                  numpy_helper.from_array(np.array([1, -1, k // 32, 32], np.int64), "shape"),
                  numpy_helper.from_array(np.array([-1], np.int64), "axes")]
        nodes += [helper.make_node("Reshape", ["A", "shape"], ["A4"]),
                  helper.make_node("ReduceSum", ["A4", "axes"], ["sums"], keepdims=0),
                  helper.make_node("MatMul", ["sums", "offsets"], ["Y1"]),
                  helper.make_node("Add", ["Y0", "Y1"], ["Y"])]
    else:
        nodes.append(helper.make_node("Identity", ["Y0"], ["Y"]))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [1, "S", k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, "S", n])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    a = rng.standard_normal((1, 5, k)).astype(np.float32)
    got = session.run(None, {"A": a})[0][0]  # [5, n]
    expected = a[0] @ qw.dequantize().T
    np.testing.assert_allclose(got, expected, atol=1e-4 * np.abs(expected).max())
    # and the quantization itself is within half a step of the float weight
    step = np.repeat(qw.scales, 32, axis=1)
    assert (np.abs(qw.dequantize() - w) <= 0.5 * step + 1e-6).all()


def test_quantizer_refuses_bad_options():
    w = np.zeros((4, 64), np.float32)
    with pytest.raises(ValueError, match="bits"):
        quantize_blockwise(w, bits=3)
    with pytest.raises(ValueError, match="scheme"):
        quantize_blockwise(w, scheme="float-zero-point")
    with pytest.raises(ValueError, match="power of two"):
        quantize_blockwise(w, block_size=24)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_blockwise(np.zeros((4, 48), np.float32))
    # a constant block quantizes to its value exactly, in every scheme
    for scheme in ("block-min", "zero-point", "symmetric"):
        c = np.full((2, 32), 0.25, np.float32)
        assert np.abs(quantize_blockwise(c, scheme=scheme).dequantize() - c).max() < 0.25 / 7


# -- the int4 draft -----------------------------------------------------------------------------


def test_int4_draft_uses_matmul_nbits_and_shares_the_8_bit_table(target_dir):
    d = target_dir / "drafts" / "int4"
    ops = _graph_ops(d)
    assert {"MatMulNBits", "GatherBlockQuantized", "GroupQueryAttention"} <= ops
    model = onnx.load(str(d / "model.onnx"), load_external_data=False)
    # no float head, no float table: the one Gather picks the hidden rows logit_rows names,
    # and the Gemms are the layers' block-min offsets (the 8-bit head has none), on flat rows
    gemms = [n for n in model.graph.node if n.op_type == "Gemm"]
    assert len(gemms) == 4 * LAYERS and all(n.input[1].endswith(".offsets") for n in gemms)
    assert "Add" not in ops
    assert [list(n.input)[1] for n in model.graph.node if n.op_type == "Gather"] == [
        gio.LOGIT_ROWS]
    nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    # per layer: qkv, o, gate+up (fused), down; then the LM head
    assert len(nbits) == 4 * LAYERS + 1
    bits = {n.name: {a.name: a.i for a in n.attribute}["bits"] for n in nbits}
    assert bits.pop("lm_head/matmul_nbits") == 8 and set(bits.values()) == {4}
    locs = {t.name: {e.key: e.value for e in t.external_data} for t in model.graph.initializer
            if t.data_location == TensorProto.EXTERNAL}
    assert locs["embed.q"] == locs["lm_head.q"]  # the embedding reads the head's bytes
    assert "embed" not in locs
    m = mf.read_manifest(d)
    assert m.extra["quantized_weights"] == 4 * LAYERS + 2 and m.extra["float_linear_weights"] == []
    # 4-bit layers + an 8-bit table: well under a third of the float32 target's bytes
    assert m.extra["weight_bytes"] < 0.33 * mf.read_manifest(target_dir).extra["weight_bytes"]


def test_int4_graph_with_float_activations_equals_pytorch_with_its_dequantized_weights(
        checkpoint, tmp_path):
    """The packing is exact: with accuracy_level 0 (no int8 rounding of the activations) the
    graph's logits are PyTorch's with the dequantized weights swapped in, to float32 rounding
    (the target's own bound against PyTorch, 1e-3)."""
    from ortspec.export.graph_spec import GraphOptions, WeightQuant
    from ortspec.export.graphs import build_decoder
    from ortspec.export.validate import run_graph, validation_prompt

    target = mf.read_manifest(_export_plain(checkpoint, tmp_path))
    options = GraphOptions(capacity=CAP, dtype="fp32", quant=WeightQuant(accuracy_level=0))
    cos, sin = checkpoint.rope_tables(CAP)
    (tmp_path / "q").mkdir()
    build_decoder(checkpoint.spec, options, checkpoint.weight, cos, sin,
                  graph_path=tmp_path / "q" / "model.onnx",
                  data_path=tmp_path / "q" / "model.onnx.data")
    ids = validation_prompt(checkpoint, capacity=CAP, max_verify_len=VERIFY)
    verify, step = run_graph(tmp_path / "q", target, ids)
    reference = checkpoint.torch_logits(
        ids, replace=drafts_mod.dequantized_weights(checkpoint, checkpoint.spec, options))
    assert np.abs(verify - reference).max() <= 1e-3
    assert np.abs(step - reference).max() <= 1e-3
    # ...and the checkpoint itself was restored afterwards (tied head included)
    np.testing.assert_array_equal(checkpoint.torch_logits(ids[:8]),
                                  checkpoint.torch_logits(ids[:8]))
    assert checkpoint.model.lm_head.weight is checkpoint.model.model.embed_tokens.weight


def _export_plain(checkpoint, tmp_path) -> Path:
    return export_model(checkpoint.source.path, out=tmp_path / "plain", capacity=CAP,
                        max_verify_len=VERIFY, progress=False)


def test_int4_draft_logits_are_close_to_the_fp32_graphs(target_dir):
    """The shipped draft against the fp32 target, on a random prompt.

    The tolerance, from the int4 error: a block of 32 weights spans about 4 standard deviations
    (random normal weights, 32 draws), so 4-bit steps are 4/15 = 0.27 sigma and the rounding
    error has an RMS of 0.27 / sqrt(12) = 8% of the weights' own RMS. Each product then carries
    ~8% relative noise; through 2 layers (4 products each, on the residual stream) and the head
    that compounds to roughly 8% x sqrt(9) = 24% RMS of the logits' RMS in the worst case, and
    the int8 activations add a few percent. Bound: RMS difference <= 30% of the target logits'
    RMS, and top-1 agreement well above chance (1/320)."""
    target = OrtDecoder(target_dir)
    draft = OrtDecoder(target_dir / "drafts" / "int4")
    ids = _ids()
    t = target.forward_batch(ids)  # [n, vocab]
    d = draft.forward_batch(ids)
    rms = float(np.sqrt(np.mean(t ** 2)))
    assert float(np.sqrt(np.mean((d - t) ** 2))) <= 0.3 * rms
    assert float(np.sqrt(np.mean((d - t) ** 2))) > 1e-4 * rms  # really quantized
    assert drafts_mod.top1_agreement(d, t) >= 0.5


# -- the layer-skip draft -----------------------------------------------------------------------


def test_layer_skip_draft_equals_pytorch_truncated_to_its_layers(target_dir, llama_src):
    """An independent reference: transformers builds a 1-layer model from the same checkpoint
    (the second layer's weights unused)."""
    import torch
    from transformers import AutoModelForCausalLM

    d = target_dir / "drafts" / "layers1"
    m = mf.read_manifest(d)
    assert m.architecture.num_layers == 1 and m.draft_of == ".."
    assert m.extra["draft"]["layers"] == 1 and m.extra["draft"]["of_layers"] == LAYERS
    assert "MatMulNBits" not in _graph_ops(d)
    truncated = AutoModelForCausalLM.from_pretrained(llama_src, num_hidden_layers=1).eval()
    ids = _ids()
    with torch.no_grad():
        reference = truncated(torch.tensor([ids]), use_cache=False).logits[0].numpy()
    decoder = OrtDecoder(d)
    verify = decoder.forward_batch(ids)
    decoder.reset()
    step = np.stack([decoder.forward_token(t) for t in ids])
    assert np.abs(verify - reference).max() <= 1e-3
    assert np.abs(step - reference).max() <= 1e-3
    assert np.abs(verify - OrtDecoder(target_dir).forward_batch(ids)).max() > 0.1  # not the target


# -- pairing through the manifests ---------------------------------------------------------------


def test_target_manifest_lists_its_drafts_and_keeps_its_checksums(target_dir):
    m = mf.read_manifest(target_dir)  # every checksum verified, after two drafts were added
    assert m.extra["drafts"] == ["drafts/int4", "drafts/layers1"]  # in the order added
    assert m.draft_of is None
    for rel in m.extra["drafts"]:
        d = mf.read_manifest(target_dir / rel)
        assert d.draft_of == ".." and d.source == m.source
        assert d.architecture.vocab_size == m.architecture.vocab_size
        assert (d.capacity, d.max_verify_len) == (m.capacity, m.max_verify_len)
        assert set(d.files) == {"model.onnx", "model.onnx.data", "tokenizer.json"}
        assert d.files["tokenizer.json"] == m.files["tokenizer.json"]  # the same tokenizer
        assert d.stop_token_ids == m.stop_token_ids and d.chat_format == m.chat_format
        agreement = d.extra["agreement"]
        assert 0.0 <= agreement["top1"] <= 1.0 and agreement["prompt_tokens"] >= 2 * VERIFY
    int4 = mf.read_manifest(target_dir / "drafts" / "int4").extra["agreement"]
    assert int4["top1_vs_unquantized"] >= drafts_mod.MIN_AGREEMENT


def test_load_model_pairs_the_listed_draft(target_dir):
    model = load_model(target_dir, draft=True)
    assert isinstance(model.draft, OrtDecoder)
    assert model.draft.vocab_size == model.decoder.vocab_size
    assert model.draft.model_dir == target_dir / "drafts" / "int4"  # the first listed
    explicit = load_model(target_dir, draft=target_dir / "drafts" / "layers1")
    assert explicit.draft.manifest.architecture.num_layers == 1
    assert load_model(target_dir).draft is None  # only when asked for


@pytest.mark.parametrize("draft_name", ["int4", "layers1"])
def test_speculative_greedy_with_the_draft_equals_plain_decoding(target_dir, draft_name):
    model = load_model(target_dir, draft=target_dir / "drafts" / draft_name)
    drafter = DraftModelDrafter(model.draft, max_draft_len=4, target=model.decoder)
    options = SpeculativeOptions(max_new_tokens=40, stop_token_ids=())
    for seed in (0, 1):
        prompt = _ids(10, seed)
        plain = plain_decode(model.decoder, prompt, options)
        spec = speculative_decode_with(model.decoder, prompt, drafter, options)
        assert spec.tokens == plain.tokens  # token for token
        c = spec.counters
        assert c.drafted > 0 and c.accepted <= c.drafted
        if draft_name == "int4":
            assert c.accepted > 0  # the 4-bit copy agrees often enough to be accepted


def test_make_drafter_uses_the_paired_draft(target_dir):
    model = load_model(target_dir, draft=True)
    drafter = model.make_drafter("draft-model")
    options = SpeculativeOptions(max_new_tokens=24, stop_token_ids=())
    prompt = _ids(12, 3)
    assert speculative_decode_with(model.decoder, prompt, drafter, options).tokens == \
        plain_decode(model.decoder, prompt, options).tokens


@pytest.mark.parametrize("draft_name, shares", [("int4", True), ("layers1", False)])
def test_a_draft_of_the_targets_layout_runs_on_its_kv_buffers(target_dir, draft_name, shares):
    """The int4 draft has the target's KV layout: it drafts over the target's own cache, so it
    is fed one token a draft and never the prompt; the one-layer draft keeps buffers of its
    own and prefills. Greedy output is plain decoding's either way."""
    model = load_model(target_dir, draft=target_dir / "drafts" / draft_name)
    assert model.draft_shares_kv is shares
    assert model.draft.kv_owner is None  # the caller's own draft keeps buffers of its own
    with model.slots.slot() as slot:  # a request's draft runs on its target's
        assert (slot.draft.kv_owner is slot.decoder) is shares
    own_kv = model.draft_sessions.kv_bytes_per_decoder
    assert model.slot_bytes == (model.sessions.kv_bytes_per_decoder + model.sessions.logits_bytes_per_decoder
                                + model.draft_sessions.logits_bytes_per_decoder + (0 if shares else own_kv))
    options = SpeculativeOptions(max_new_tokens=30, stop_token_ids=())
    prompt = _ids(20, 3)
    plain = plain_decode(model.decoder, prompt, options)
    draft = OrtDecoder.sharing_kv(model.draft_sessions, model.decoder) if shares else model.draft
    drafter = DraftModelDrafter(draft, max_draft_len=4)
    spec = speculative_decode_with(model.decoder, prompt, drafter, options)
    assert spec.tokens == plain.tokens
    c = spec.counters
    assert c.drafted > 0 and c.rejected > 0  # both outcomes, so rollbacks were exercised
    if shares:  # per block of k: the pending token, then k - 1 drafts
        assert drafter.fed_tokens == drafter.steps == c.drafted
    else:
        assert drafter.fed_tokens > len(prompt) + c.drafted - c.verify_calls


def test_concurrent_requests_each_draft_on_their_own_slots_buffers(target_dir):
    import threading

    model = load_model(target_dir, draft=True, max_concurrent=3)
    options = SpeculativeOptions(max_new_tokens=24, stop_token_ids=())
    prompts = [_ids(12 + i, i) for i in range(6)]
    serial = [plain_decode(model.decoder, p, options).tokens for p in prompts]
    out: dict[int, object] = {}

    def run(i: int) -> None:
        spec = DrafterSpec("draft-model", max_draft_len=3) if i % 2 else "prompt-lookup+draft-model"
        out[i] = model.generate(prompts[i], drafter=spec, options=options, draft_length=None)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [out[i].tokens for i in range(len(prompts))] == serial
    assert all(out[i].counters.accepted_by_source.get("draft_model", 0) > 0 for i in range(len(prompts)))
    assert all(slot.draft.kv_owner is slot.decoder for slot in model.slots._free)


def test_a_listed_draft_loads_on_the_first_request_that_needs_it_once(target_dir, monkeypatch):
    """No `draft` argument: the manifest's draft is loaded by the first request with a
    draft-model drafter, once although four threads ask at the same moment, and counted in
    the slot's memory from then on; the output is plain decoding's."""
    import ortspec.runtime.load as load_mod

    opened: list[Path] = []
    real = load_mod.OrtSessions

    def counting(directory, **kwargs):
        opened.append(Path(directory))
        return real(directory, **kwargs)

    monkeypatch.setattr(load_mod, "OrtSessions", counting)
    model = load_model(target_dir, max_concurrent=4)
    assert opened == [target_dir] and model.draft_sessions is None  # only the target, so far
    assert model.listed_draft.path == target_dir / "drafts" / "int4"
    target_only = model.slot_bytes
    options = SpeculativeOptions(max_new_tokens=24, stop_token_ids=())
    prompts = [_ids(12 + i, i) for i in range(4)]
    serial = [plain_decode(model.decoder, p, options).tokens for p in prompts]
    assert model.generate(prompts[0], drafter=None, options=options).tokens == serial[0]
    assert model.draft_sessions is None  # plain decoding needs no draft

    # every draft verified whole, so the draft model's drafts are surely tried
    out = in_threads(lambda p: model.generate(p, drafter="prompt-lookup+draft-model",
                                              options=options, draft_length=None), prompts)
    assert [r.tokens for r in out] == serial  # greedy: token for token
    assert all(r.counters.drafted_by_source.get("draft_model", 0) for r in out)
    assert opened == [target_dir, target_dir / "drafts" / "int4"]  # the draft's sessions: once
    sessions = model.draft_sessions
    # with the cost model, which prices the draft's step now that it is loaded
    assert model.generate(prompts[1], drafter="draft-model", options=options).tokens == serial[1]
    assert model.draft_length_policy().draft_step_seconds > 0
    assert model.draft_sessions is sessions and len(opened) == 2
    # counted like a draft loaded up front: its logits buffer (it runs on the target's KV)
    assert model.slot_bytes == target_only + sessions.logits_bytes_per_decoder
    assert model.slot_bytes == load_model(target_dir, draft=True).slot_bytes
    # the cost model prepared before the draft loads prices its step when it does
    prepared = load_model(target_dir, calibrate=True)
    assert prepared.draft_length_policy().draft_step_seconds == 0
    assert prepared.generate(prompts[2], drafter="draft-model", options=options).tokens == serial[2]
    assert prepared.draft_length_policy().draft_step_seconds > 0


@pytest.mark.parametrize("drafter", ["draft-model", "prompt-lookup+draft-model"])
def test_the_cli_generates_with_the_paired_draft(target_dir, drafter, capsys):
    from ortspec.runtime.cli.main import main

    argv = ["generate", "--model", str(target_dir), "--prompt", "a b a b a b", "--max-new-tokens", "12",
            "--fixed-draft-len", "--drafter", drafter]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "[12 tokens" in err and "acceptance" in err and "(0/0)" not in err


def test_the_bench_refuses_a_context_for_a_draft_on_its_targets_buffers(target_dir, tmp_path, capsys):
    from ortspec.runtime.bench.cli import main

    argv = ["--model", str(target_dir), "--per-category", "1", "--methods", "plain,draft-model:c16",
            "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    assert "reads the whole history" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before anything ran or was written


def test_a_draft_on_another_decoders_buffers_is_refused_with_a_message(target_dir):
    model = load_model(target_dir, draft=True)
    options = SpeculativeOptions(max_new_tokens=8, stop_token_ids=())
    follower = OrtDecoder.sharing_kv(model.draft_sessions, model.decoder)
    model.decoder.prefill(_ids(30))  # the draft's owner now holds another history
    with pytest.raises(DrafterError, match="pass the drafter's name or a DrafterSpec"):
        model.generate(_ids(12), drafter=DraftModelDrafter(follower), options=options,
                       draft_length=None)
    # a decoder on another's buffers never writes below that one's length
    follower.reset()
    with pytest.raises(InvalidOptionError, match="would overwrite that decoder's cache"):
        follower.forward_token(1)
    assert follower.follow_owner() == 30
    follower.forward_token(1)  # past the owner's length: allowed
    with pytest.raises(InvalidOptionError, match="context applies to a draft with KV buffers"):
        DraftModelDrafter(follower, context=8)
    # a spec's options are checked when the request is made, before any decoding
    with pytest.raises(InvalidOptionError, match="draft_context applies to a draft with KV buffers"):
        model.stream(_ids(12), drafter=DrafterSpec("draft-model", draft_context=8), options=options)
    with pytest.raises(InvalidOptionError, match="max_draft_len"):
        model.stream(_ids(12), drafter=DrafterSpec("draft-model", max_draft_len=-1), options=options)
    # a drafter made on the model's own draft serves any decode
    assert model.generate(_ids(12), drafter=model.make_drafter("draft-model"), options=options,
                          draft_length=None).tokens == plain_decode(model.decoder, _ids(12), options).tokens
    layers = load_model(target_dir, draft=target_dir / "drafts" / "layers1")
    with pytest.raises(ManifestError, match="KV tensors 2 against 4"):
        OrtDecoder.sharing_kv(layers.draft_sessions, model.decoder)


# -- bad options: refused before anything is read or written ------------------------------------


@pytest.mark.parametrize("bad", [
    {"draft_layers": 0}, {"draft_layers": -1}, {"draft_layers": True}, {"draft_layers": "8"},
    {"draft_layers": 2.0}, {"draft_quant": "int8"}, {"draft_quant": "INT4"},
    {"draft_quant": "int4", "attention": "standard"},
    {"draft_only": True}, {"draft_only": "yes", "draft_quant": "int4"},
])
def test_bad_draft_options_are_refused_before_anything_is_read(bad, tmp_path):
    with pytest.raises(ExportOptionError) as info:
        export_model(tmp_path / "no-such-model", out=tmp_path / "nested" / "out", progress=False,
                     **bad)
    assert isinstance(info.value, ValueError)
    assert list(tmp_path.iterdir()) == []


def test_draft_layers_may_be_a_numpy_integer_and_is_kept_as_an_int():
    options = drafts_mod.draft_options("int4", np.int64(8))
    assert options.layers == 8 and type(options.layers) is int and options.name == "layers8-int4"
    with pytest.raises(DraftOptionError, match=r"draft_layers must be an integer >= 1 \(and at "
                                               r"most the model's layer count\), got 0"):
        drafts_mod.draft_options(None, 0)


@pytest.mark.parametrize("layers", [LAYERS + 1, 30, LAYERS])
def test_draft_layers_beyond_the_model_are_refused_before_writing(llama_src, tmp_path,
                                                                  monkeypatch, layers):
    """> num_layers is known from config.json alone; == num_layers without quantization would
    be the target itself."""
    import ortspec.export.checkpoint as checkpoint

    def must_not_load(*a, **k):
        raise AssertionError("the checkpoint was loaded before the layer count was checked")

    monkeypatch.setattr(checkpoint, "load_checkpoint", must_not_load)
    with pytest.raises(DraftOptionError, match=f"1..{LAYERS if layers > LAYERS else LAYERS - 1}"):
        export_model(llama_src, out=tmp_path / "out", capacity=CAP, max_verify_len=VERIFY,
                     progress=False, draft_layers=layers)
    assert list(tmp_path.iterdir()) == []


def test_add_draft_refuses_bad_requests_and_leaves_the_target_alone(target_dir, tmp_path):
    before = {p.relative_to(target_dir): p.read_bytes() for p in target_dir.rglob("*")
              if p.is_file()}
    with pytest.raises(DraftOptionError, match="1..2"):
        add_draft(target_dir, layers=3, progress=False)
    with pytest.raises(DraftOptionError, match="needs quant and/or layers"):
        add_draft(target_dir, progress=False)
    with pytest.raises(DraftOptionError, match="draft_quant"):
        add_draft(target_dir, quant="int2", progress=False)
    with pytest.raises(ExportError, match="already exists"):
        add_draft(target_dir, quant="int4", progress=False)
    with pytest.raises(ExportError, match="itself a draft"):
        add_draft(target_dir / "drafts" / "int4", layers=1, progress=False)
    other = make_tiny_llama(tmp_path / "other", seed=7)  # not the target's checkpoint
    with pytest.raises(ExportError, match="is not the checkpoint"):
        add_draft(target_dir, other, quant="int4", overwrite=True, progress=False)
    after = {p.relative_to(target_dir): p.read_bytes() for p in target_dir.rglob("*")
             if p.is_file()}
    assert after == before  # byte for byte, manifest included; no temporary directory left


def test_a_failed_draft_validation_leaves_the_target_unchanged(llama_src, tmp_path,
                                                               monkeypatch):
    out = export_model(llama_src, out=tmp_path / "t", capacity=CAP, max_verify_len=VERIFY,
                       progress=False)
    manifest_bytes = (out / "manifest.json").read_bytes()
    monkeypatch.setattr(drafts_mod, "MIN_AGREEMENT", 1.01)  # no draft can pass
    with pytest.raises(ExportError, match="floor"):
        add_draft(out, quant="int4", progress=False)
    assert (out / "manifest.json").read_bytes() == manifest_bytes
    assert not (out / "drafts").exists()
    mf.read_manifest(out)
    # and exported together with the target, the target is not written either
    with pytest.raises(ExportError, match="floor"):
        export_model(llama_src, out=tmp_path / "t2", capacity=CAP, max_verify_len=VERIFY,
                     progress=False, draft_quant="int4")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t"]


def test_overwrite_replaces_a_draft_and_keeps_one_listing(llama_src, tmp_path):
    out = export_model(llama_src, out=tmp_path / "t", capacity=CAP, max_verify_len=VERIFY,
                       progress=False, draft_layers=1)
    first = mf.read_manifest(out / "drafts" / "layers1").files
    add_draft(out, llama_src, layers=1, overwrite=True, progress=False)
    assert mf.read_manifest(out).extra["drafts"] == ["drafts/layers1"]
    assert mf.read_manifest(out / "drafts" / "layers1").files == first  # deterministic export
    assert sorted(p.name for p in (out / "drafts").iterdir()) == ["layers1"]


def test_register_draft_first_moves_it_to_the_front(tmp_path):
    data = {"extra": {"drafts": ["drafts/layers8", "drafts/int4"]}}
    assert drafts_mod.with_draft_listed(data, "drafts/int4", first=True)["extra"]["drafts"] == \
        ["drafts/int4", "drafts/layers8"]
    assert drafts_mod.with_draft_listed(data, "drafts/int4")["extra"]["drafts"] == \
        ["drafts/layers8", "drafts/int4"]
    assert data["extra"]["drafts"] == ["drafts/layers8", "drafts/int4"]  # input untouched


def test_combined_layer_skip_int4_draft_on_an_untied_qwen2(tmp_path):
    """Untied head, q/k/v biases: the head is quantized on its own, the embedding stays a float
    Gather; the depth-1 int4 draft is checked against PyTorch truncated with its weights."""
    src = make_tiny_qwen2(tmp_path / "qwen2")
    out = export_model(src, out=tmp_path / "t", capacity=CAP, max_verify_len=VERIFY,
                       progress=False, draft_quant="int4", draft_layers=1)
    d = out / "drafts" / "layers1-int4"
    m = mf.read_manifest(d)
    assert m.architecture.num_layers == 1 and m.extra["draft"]["quant"] == "int4"
    assert {"MatMulNBits", "Gather"} <= _graph_ops(d)
    assert "GatherBlockQuantized" not in _graph_ops(d)
    assert m.extra["quantized_weights"] == 4 + 1  # one layer's four products and the head
    v = m.extra["validation"]
    assert v["verify_vs_pytorch"] <= v["bound_vs_pytorch"]


def test_an_int4_draft_of_the_batched_flavour_takes_batches_too(llama_src, tmp_path):
    """A window-attention target (the batched graph) gets an int4 draft in its own flavour:
    several rows a call like its target, MatMulNBits, within the quantization bound; its
    steps drafted in shared calls when the model batches (test_batching's real-model test)."""
    out = export_model(llama_src, out=tmp_path / "t", capacity=CAP, max_verify_len=VERIFY,
                       attention="window", progress=False, draft_quant="int4")
    d = out / "drafts" / "int4"
    m = mf.read_manifest(d)
    assert m.max_batch == mf.read_manifest(out).max_batch > 1 and m.min_call_rows == 2
    assert "MatMulNBits" in _graph_ops(d) and "GroupQueryAttention" not in _graph_ops(d)
    v = m.extra["validation"]
    assert v["verify_vs_pytorch"] <= v["bound_vs_pytorch"]
    model = load_model(out, draft=True, max_concurrent=2)
    assert model.runner is not None and model.draft_runner is not None
    ids = _ids(12)
    want = plain_decode(OrtDecoder(out), ids, SpeculativeOptions(10)).tokens
    assert model.generate(ids, drafter="draft-model", draft_length=None,
                          options=SpeculativeOptions(10)).tokens == want


def test_layer_skip_draft_of_a_standard_attention_target(llama_src, tmp_path):
    """The TensorRT flavour (ONNX ops only) takes layer-skip drafts; only int4 needs gqa."""
    out = export_model(llama_src, out=tmp_path / "t", capacity=CAP, max_verify_len=VERIFY,
                       attention="standard", progress=False, draft_layers=1)
    d = mf.read_manifest(out / "drafts" / "layers1")
    assert d.extra["attention"] == "Attention" and d.extra["opset"] == 24
    assert "GroupQueryAttention" not in _graph_ops(out / "drafts" / "layers1")
    assert d.extra["validation"]["verify_vs_pytorch"] <= 1e-3
    with pytest.raises(DraftOptionError, match="attention='gqa'"):
        add_draft(out, quant="int4", progress=False)
    # added later, the draft is built in its target's flavour too (not the batched one, whose
    # earlier manifests also said "Attention")
    again = add_draft(out, layers=1, overwrite=True, progress=False)
    assert "Attention" in _graph_ops(again) and mf.read_manifest(again).max_batch == 1


def test_cli_exports_a_draft_and_adds_another(llama_src, tmp_path, capsys):
    from ortspec.export.cli import main

    out = tmp_path / "t"
    args = [str(llama_src), "--out", str(out), "--capacity", str(CAP), "--max-verify-len",
            str(VERIFY), "--quiet"]
    assert main(args + ["--draft-layers", "1"]) == 0
    assert capsys.readouterr().out.split() == [str(out), str(out / "drafts" / "layers1")]
    assert main(args + ["--draft-only", "--draft-quant", "int4"]) == 0
    assert capsys.readouterr().out.split() == [str(out / "drafts" / "int4")]
    assert mf.read_manifest(out).extra["drafts"] == ["drafts/layers1", "drafts/int4"]
    assert main(args + ["--draft-only", "--draft-layers", "0"]) == 2
    assert "draft_layers must be an integer >= 1" in capsys.readouterr().err


# -- the real default model ---------------------------------------------------------------------


PROMPTS = ["Summarize in two sentences why the sky is blue.",
           "Write a Python function that returns the n-th Fibonacci number."]


@pytest.fixture(scope="module")
def default_drafts():
    from ortspec.export import ensure_default_draft

    return {"int4": ensure_default_draft("int4", progress=False),
            "layers": ensure_default_draft("layers", progress=False)}



@pytest.mark.slow
def test_default_model_drafts_are_exported_and_agree(default_drafts):
    from ortspec.export import default_model_dir

    target = default_model_dir("fp32")
    m = mf.read_manifest(target)  # the target's checksums are intact
    assert m.extra["drafts"][0] == "drafts/int4"  # ensure_default_draft lists int4 first
    assert {"drafts/int4", "drafts/layers15"} <= set(m.extra["drafts"])
    int4 = mf.read_manifest(default_drafts["int4"])
    # measured 0.979 on the validation prompt (the only difference: int8 activations)
    assert int4.extra["agreement"]["top1"] >= 0.85
    assert int4.extra["weight_bytes"] < 0.25 * m.extra["weight_bytes"]
    layers = mf.read_manifest(default_drafts["layers"])
    assert layers.architecture.num_layers == 15
    assert 0.0 <= layers.extra["agreement"]["top1"] <= 1.0  # recorded; no floor


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["int4", "layers"])
def test_default_model_speculative_with_its_draft_equals_plain(default_drafts, kind):
    from ortspec.export import default_model_dir

    model = load_model(default_model_dir("fp32"), draft=default_drafts[kind])
    drafter = DraftModelDrafter(model.draft, max_draft_len=4, target=model.decoder)
    options = SpeculativeOptions(max_new_tokens=32, stop_token_ids=())
    accepted = 0
    for text in PROMPTS:
        ids = model.encode(text, chat=True)
        plain = plain_decode(model.decoder, ids, options)
        spec = speculative_decode_with(model.decoder, ids, drafter, options)
        assert spec.tokens == plain.tokens
        accepted += spec.counters.accepted
    if kind == "int4":
        assert accepted >= 32  # of 64 tokens: the 4-bit copy is accepted most of the time
