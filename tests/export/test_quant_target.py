"""int4 targets (`export_model(quant="int4")`, `ortspec export --quant int4`): MatMulNBits rows
against onnxruntime itself, the export's manifest and validation, every verify row equal to its
step bit for bit (runtime/row_invariance.py), greedy identity and the sampler checks of
`ortspec check`, the capacity the attention's padding row costs, the head and scheme choices,
and refusal of bad options before anything is read."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
from ortspec.export.tiny import make_tiny_llama, make_tiny_qwen2
from onnx import TensorProto, helper, numpy_helper

from ortspec.export import ExportOptionError, export_model
from ortspec.export import cli as export_cli
from ortspec.export.quantize import quantize_blockwise
from ortspec.export.row_probe import ORTSPEC_OPS
from ortspec.runtime import (SpeculativeOptions, load_model, plain_decode,
                             speculative_decode_with)
from ortspec.runtime.ort import kernels, manifest as mf, sessions
from ortspec.runtime.draft_length.calibration import CostCurve
from ortspec.runtime.check.checks import run_checks
from ortspec.runtime.drafters.prompt_lookup import PromptLookupSpeculator
from ortspec.runtime.errors import CapacityError
from ortspec.runtime.ort.decoder import OrtDecoder
from ortspec.runtime.ort.row_invariance import lone_rows_exact, row_differences

CAP, VERIFY = 64, 6


pytestmark = pytest.mark.slow  # builds and exports torch checkpoints


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    return {"llama": make_tiny_llama(root / "llama"), "qwen2": make_tiny_qwen2(root / "qwen2")}


# each family with one of the kernels of the block-min layers (the default picks "ortspec"
# where the package's library is built, as it is on every machine the suite runs on, and then
# attends with ortspec.CacheAttention; at opset 21 it keeps GroupQueryAttention)
@pytest.fixture(scope="module", params=[("llama", None, None), ("llama", None, 21),
                                        ("qwen2", "onnxruntime", None)],
                ids=["llama-default", "llama-default-kernel-opset21",
                     "qwen2-onnxruntime-kernel"])
def int4_dir(request, sources, tmp_path_factory):
    family, kernel, opset = request.param
    out = tmp_path_factory.mktemp("out") / f"{family}-int4"
    export_model(sources[family], out=out, capacity=CAP, max_verify_len=VERIFY,
                 progress=False, quant="int4", kernel=kernel, opset=opset)
    return out


def _kernel(directory) -> str:
    return mf.read_manifest(directory).extra["weights"]["kernel"]


def _cache_attention(directory) -> bool:
    return mf.read_manifest(directory).extra["attention"] == "CacheAttention"


def _ids(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(5, 320, n).tolist()


def _matmul_nbits_session(k: int, n: int, bits: int, accuracy_level: int, rng):
    import onnxruntime as ort

    qw = quantize_blockwise(rng.standard_normal((n, k)).astype(np.float32), bits=bits,
                            block_size=32, scheme="symmetric")
    inits = [numpy_helper.from_array(qw.packed, "B"),
             numpy_helper.from_array(qw.scales.reshape(-1), "scales")]
    node = helper.make_node("MatMulNBits", ["A", "B", "scales"], ["Y"], domain="com.microsoft",
                            K=k, N=n, bits=bits, block_size=32, accuracy_level=accuracy_level)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    return ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("bits,accuracy_level", [(4, 4), (8, 4), (4, 1)])
def test_matmul_nbits_rows_do_not_depend_on_the_row_count(bits, accuracy_level):
    """What padding a call to two rows rests on: every row of an M-row MatMulNBits call
    (2 <= M <= 17, any position) is bitwise the row computed in a 2-row call. At level 1 (float
    activations) a one-row call takes another path; at level 4 (the exports' level) whether it
    does depends on the CPU's kernels, which is why an export carries a row probe."""
    rng = np.random.default_rng(0)
    session = _matmul_nbits_session(576, 384, bits, accuracy_level, rng)
    x = rng.standard_normal((17, 576)).astype(np.float32)
    alone = [session.run(None, {"A": np.stack([v, v])})[0][0] for v in x]  # each in a pair
    for m in range(2, 18):
        y = session.run(None, {"A": x[:m]})[0]
        for i in range(m):
            np.testing.assert_array_equal(y[i], alone[i], err_msg=f"M={m}, row {i}")
    one_row = [session.run(None, {"A": v[None]})[0][0] for v in x]
    same = [np.array_equal(a, b) for a, b in zip(one_row, alone)]
    if accuracy_level == 1:
        assert not any(same)


def test_int4_export_records_its_weights_and_validates_rows_exactly(int4_dir):
    m = mf.read_manifest(int4_dir)
    cache = _cache_attention(int4_dir)  # ortspec's kernels at opset 24, the default there
    assert cache == (_kernel(int4_dir) == "ortspec" and m.extra["opset"] == 24)
    assert (m.min_call_rows, m.min_attention_rows, m.dtype) == (1, 1 if cache else 2, "fp32")
    assert (m.row_probe is None) == cache  # no lone query padded: nothing to probe
    w = m.extra["weights"]
    assert (w["format"], w["bits"], w["block_size"], w["scheme"], w["lm_head_bits"]) == \
        ("MatMulNBits", 4, 32, "block-min", 8)
    assert w["float_linear"] == []
    assert m.precision == "int4 weights (8-bit head), fp32 activations"  # as `ortspec check` says
    layers = 4 * m.architecture.num_layers
    q4 = sum(_op_count(int4_dir, op) for op in Q4_OPS)
    # a layer's gate and up product with its SiLU gating (and the skip norm before it): one
    # node on ortspec's kernel
    ortspec = _kernel(int4_dir) == "ortspec"
    assert _op_count(int4_dir, "Q4GemmSwiGluNorm") == (m.architecture.num_layers if ortspec else 0)
    # every skip norm but the final one is part of the product after it
    assert _op_count(int4_dir, "Q4GemmNorm") == (m.architecture.num_layers - 1 if ortspec else 0)
    assert _op_count(int4_dir, "SkipSimplifiedLayerNormalization") == \
        (1 if ortspec else 2 * m.architecture.num_layers)
    # + the 8-bit head (ortspec.Q8Gemm with the ortspec kernel)
    assert _op_count(int4_dir, "MatMulNBits") + q4 + _op_count(int4_dir, "Q8Gemm") == layers + 1
    # ortspec.Q4Gemm takes every block-min layer whose width is a multiple of its tile of 16
    assert (q4 > 0) == (_kernel(int4_dir) == "ortspec")
    default = "ortspec" if kernels.available() else "onnxruntime"
    assert w["kernel"] == {"llama": default, "qwen2": "onnxruntime"}[int4_dir.name.split("-")[0]]
    assert _op_count(int4_dir, "Gemm") == layers - q4  # the block minima of MatMulNBits layers
    v = m.extra["validation"]
    assert v["step_vs_verify"] == 0.0 and v["bound_step_vs_verify"] == 0.0
    assert v["verify_vs_pytorch"] <= v["bound_vs_pytorch"]
    # tiny llama: rotary; on ortspec's kernels a float16 KV cache, the default there
    attends = "RotaryCacheAttention16" if cache else "GroupQueryAttention"
    assert m.extra["kv_cache"] == ("fp16" if cache else "fp32")
    assert _op_count(int4_dir, attends) == m.architecture.num_layers
    if cache:  # flat rows from the qkv product into the attention and on to the o product
        nodes = onnx.load(str(int4_dir / "model.onnx"), load_external_data=False).graph.node
        made_by = {out: n.op_type for n in nodes for out in n.output}
        for n in nodes:
            if n.op_type == attends:
                assert made_by[n.input[0]] in {"Q4Gemm", "Q4GemmNorm"}
                assert {c.op_type for c in nodes if n.output[0] in c.input} == {"Q4Gemm"}
    assert not (int4_dir / "drafts").exists()  # no draft unless asked for


def test_a_layer_draft_of_an_int4_target_is_int4_too(sources, tmp_path):
    out = export_model(sources["llama"], out=tmp_path / "m", capacity=CAP, max_verify_len=VERIFY,
                       progress=False, quant="int4", draft_layers=1)
    d = mf.read_manifest(out / "drafts" / "layers1-int4")
    assert d.extra["draft"]["quant"] == "int4" and d.min_call_rows == 1


# ortspec's 4-bit products (runtime/ort/product_ops.h), with and without the skip norm before them
Q4_OPS = ("Q4Gemm", "Q4GemmSwiGlu", "Q4GemmNorm", "Q4GemmSwiGluNorm")


def _op_count(directory, op_type: str) -> int:
    graph = onnx.load(str(directory / "model.onnx"), load_external_data=False).graph
    return sum(n.op_type == op_type for n in graph.node)


def test_every_verify_row_equals_its_step_bitwise_and_unpadded_attention_would_not(
        int4_dir, sources, tmp_path, monkeypatch):
    prompt, cont = _ids(20, 0), _ids(VERIFY + 2, 1)
    lengths = list(range(1, VERIFY + 1))
    res = row_differences(OrtDecoder(int4_dir), prompt, cont, block_lengths=lengths,
                          offsets=(0, 1, 2))
    assert res.rows == 3 * sum(lengths) and res.differing == 0 and res.max_abs == 0.0
    # the same export attending with GroupQueryAttention (opset 21) and a lone query attended
    # alone: its steps no longer equal its verify rows, which the export's own validation
    # refuses, so the test above would catch a graph that stopped padding
    from ortspec.export import api
    from ortspec.runtime.errors import ExportError

    monkeypatch.setattr(api, "min_attention_rows", lambda **kw: 1)
    with pytest.raises(ExportError, match="verify and step logits differ"):
        export_model(sources[int4_dir.name.split("-")[0]], out=tmp_path / "unpadded",
                     capacity=CAP, max_verify_len=VERIFY, progress=False, quant="int4",
                     kernel=_kernel(int4_dir), opset=21)
    assert not (tmp_path / "unpadded").exists()


def _probe_session(path):
    from ortspec.runtime.ort.sessions import open_session, session_options

    return open_session(str(path), session_options(threads=2), ["CPUExecutionProvider"])


def _with_probe_level(src, dst, level: int):
    """A copy of the export whose row probe runs its MatMulNBits at accuracy `level`."""
    shutil.copytree(src, dst)
    probe = onnx.load(str(dst / "row_probe.onnx"))
    for node in probe.graph.node:
        for a in node.attribute:
            if a.name == "accuracy_level":
                a.i = level
    onnx.save(probe, str(dst / "row_probe.onnx"))
    data = json.loads((dst / mf.MANIFEST_FILE).read_text())
    data["files"]["row_probe.onnx"] = mf.sha256_file(dst / "row_probe.onnx")
    (dst / mf.MANIFEST_FILE).write_text(json.dumps(data))
    return dst


def test_the_row_probe_decides_whether_calls_run_two_rows(int4_dir, tmp_path, monkeypatch):
    """The export's row probe holds its graph's kernels (the 4-bit layers, the 8-bit head, the
    block-min offsets' float products); the decoder runs one-row calls where the probe finds
    them exact on this machine, and pads every call to two rows where it does not (here: the
    probe at accuracy level 1, whose one-row path differs everywhere). Both keep every verify
    row bitwise its step."""
    m = mf.read_manifest(int4_dir)
    if _cache_attention(int4_dir):
        pytest.skip("ortspec.CacheAttention pads no lone query: the export has no row probe")
    assert m.row_probe == "row_probe.onnx" and m.row_probe in m.files
    probe = onnx.load(str(int4_dir / m.row_probe)).graph
    kinds = {(n.op_type, dict((a.name, a.i) for a in n.attribute).get("bits")) for n in probe.node}
    layer_kinds = {("MatMulNBits", 4), ("MatMul", None), ("Gemm", None)}  # of MatMulNBits layers
    ortspec = _kernel(int4_dir) == "ortspec"
    if ortspec:  # every ortspec op kind of the graph (the products with their skip norm and
        # SwiGLU included), and MatMulNBits only for a layer too narrow for a tile
        graph = onnx.load(str(int4_dir / m.entry_points["step"].graph),
                          load_external_data=False).graph
        ops = {(n.op_type, None) for n in graph.node if n.op_type in ORTSPEC_OPS}
        assert {("Q4Gemm", None), ("Q4GemmNorm", None), ("Q4GemmSwiGluNorm", None),
                ("Q8Gemm", None)} <= ops
        assert ops <= kinds <= ops | layer_kinds
    else:
        assert kinds == {("MatMulNBits", 8)} | layer_kinds
    exact = lone_rows_exact(_probe_session(int4_dir / m.row_probe))
    assert OrtDecoder(int4_dir).min_call_rows == (1 if exact else 2)
    if ortspec:  # its rows are alike by construction; a probe found wanting is simulated
        assert exact
        monkeypatch.setattr(sessions, "_probe_verdict", lambda *args: False)
        padded = int4_dir
    else:
        padded = _with_probe_level(int4_dir, tmp_path / "level1", 1)
        assert not lone_rows_exact(_probe_session(padded / "row_probe.onnx"))
    dec = OrtDecoder(padded)
    assert dec.min_call_rows == 2 and dec.capacity == CAP - 1
    prompt, cont = _ids(20, 6), _ids(VERIFY + 1, 7)
    res = row_differences(dec, prompt, cont, block_lengths=list(range(1, VERIFY + 1)))
    assert res.differing == 0


def test_a_manifest_row_probe_must_be_a_listed_file(int4_dir):
    data = json.loads((int4_dir / mf.MANIFEST_FILE).read_text())
    data["row_probe"] = "missing.onnx"
    with pytest.raises(mf.ManifestError, match="row_probe"):
        mf.parse_manifest(data)


def test_padding_holds_with_ping_pong_kv_buffers_too(int4_dir):
    """The TensorRT KV mode (two buffer sets, past copied over by the graph), forced on the CPU:
    rows still equal steps bitwise, and the logits equal the in-place mode's."""
    prompt, cont = _ids(20, 4), _ids(VERIFY + 1, 5)
    pp = OrtDecoder(int4_dir, kv_mode="ping-pong")
    res = row_differences(pp, prompt, cont, block_lengths=list(range(1, VERIFY + 1)))
    assert res.differing == 0
    shared = OrtDecoder(int4_dir)
    for dec in (pp, shared):
        dec.reset()
        dec.prefill(prompt)
    for t in cont:
        np.testing.assert_array_equal(pp.forward_token(t), shared.forward_token(t))


def test_int4_speculative_greedy_equals_plain_decoding(int4_dir):
    model = load_model(int4_dir)
    options = SpeculativeOptions(max_new_tokens=40, stop_token_ids=())
    drafted = 0
    for seed in range(4):
        prompt = _ids(12, seed) * 3  # repeats, so prompt lookup drafts
        plain = plain_decode(model.decoder, prompt, options)
        spec = speculative_decode_with(model.decoder, prompt, PromptLookupSpeculator(2, 5),
                                       options)
        assert spec.tokens == plain.tokens
        drafted += spec.counters.drafted
    assert drafted > 0


def test_ortspec_check_passes_on_an_int4_export(int4_dir):
    rows = run_checks(load_model(int4_dir), draws=2000, new_tokens=16)
    assert all(r.passed for r in rows), [r for r in rows if not r.passed]
    assert any(r.name.startswith("row invariance") and r.bound == "bitwise equal" for r in rows)


def test_on_a_padded_export_one_ulp_off_fails_the_row_invariance_check(int4_dir, monkeypatch):
    from ortspec.runtime.check import checks as check

    model = load_model(int4_dir)
    real = model.decoder.forward_batch
    monkeypatch.setattr(model.decoder, "forward_batch",
                        lambda tokens: np.nextafter(real(tokens), np.inf))
    row = check.check_row_invariance(model)
    assert row.bound == "bitwise equal" and not row.passed


@pytest.mark.parametrize("field", ["min_call_rows", "min_attention_rows"])
@pytest.mark.parametrize("value", [0, 3, "2", 1.5, True])
def test_a_bad_row_minimum_is_refused_naming_the_field(int4_dir, field, value):
    data = json.loads((int4_dir / mf.MANIFEST_FILE).read_text())
    data[field] = value
    with pytest.raises(mf.ManifestError, match=field):
        mf.parse_manifest(data)


def test_a_padded_lone_query_costs_one_token_of_capacity_and_no_padding_none(int4_dir):
    padded = not _cache_attention(int4_dir)  # GroupQueryAttention pads a lone query
    dec = OrtDecoder(int4_dir)
    assert dec.capacity == CAP - padded
    dec.prefill(_ids(dec.capacity - 1, 3))
    dec.forward_token(7)  # the last position: with padding, two rows still fit in the buffers
    assert dec.length == dec.capacity
    with pytest.raises(CapacityError):
        dec.forward_token(7)


def test_a_padded_model_prices_a_step_like_a_two_token_call():
    curve = CostCurve((1.0, 1.1, 1.5, 2.0)).padded_to(2)
    assert curve.seconds == (1.1, 1.1, 1.5, 2.0)
    assert CostCurve((1.0, 1.1)).padded_to(1).seconds == (1.0, 1.1)


@pytest.mark.parametrize("lm_head,scheme", [("int4", "block-min"), ("fp32", "zero-point"),
                                            ("int8", "symmetric")])
def test_head_and_scheme_choices_export_validated_and_exact(sources, tmp_path, lm_head, scheme):
    out = export_model(sources["llama"], out=tmp_path / "m", capacity=CAP, max_verify_len=VERIFY,
                       progress=False, quant="int4", lm_head=lm_head, quant_scheme=scheme)
    m = mf.read_manifest(out)
    w = m.extra["weights"]
    assert w["scheme"] == scheme
    assert w["lm_head_bits"] == {"int8": 8, "int4": 4, "fp32": None}[lm_head]
    assert m.precision == "int4 weights" + {"int8": " (8-bit head)", "int4": "",
                                            "fp32": " (float head)"}[lm_head] + ", fp32 activations"
    assert sum(_op_count(out, op) for op in ("MatMulNBits", "Q8Gemm", *Q4_OPS)) == \
        4 * m.architecture.num_layers + (lm_head != "fp32")
    assert (_op_count(out, "Q4Gemm") > 0) == (scheme == "block-min" and kernels.available())
    assert m.extra["validation"]["step_vs_verify"] == 0.0


@pytest.mark.parametrize("kwargs,needle", [
    (dict(quant="int8"), "quant must be one of"),
    (dict(quant="int4", attention="standard"), "attention 'gqa' or 'window'"),
    (dict(quant="int4", dtype="fp16"), "dtype='fp32'"),
    (dict(lm_head="int4"), "without quant"),
    (dict(quant="int4", lm_head="int2"), "lm_head must be one of"),
    (dict(quant="int4", quant_scheme="nf4"), "quant_scheme must be one of"),
    (dict(quant="int4", draft_quant="int4"), "draft_layers"),
    (dict(quant="int4", max_verify_len=1), "max_verify_len must be at least 2"),
    (dict(quant="int4", kernel="mlas"), "kernel must be one of"),
    (dict(kernel="ortspec"), "needs quant='int4' and quant_scheme='block-min'"),
    (dict(quant="int4", quant_scheme="symmetric", kernel="ortspec"), "quant_scheme='block-min'"),
    (dict(quant="int4", kv_cache="int8"), "kv_cache must be one of"),
    (dict(kv_cache="fp16"), "needs a graph attending with ortspec's kernels"),
    (dict(quant="int4", kernel="onnxruntime", kv_cache="fp16"), "attending with ortspec's"),
])
def test_bad_quant_options_are_refused_before_anything_is_read(kwargs, needle, tmp_path):
    with pytest.raises(ExportOptionError, match=needle):
        export_model(tmp_path / "missing", out=tmp_path / "out", progress=False, **kwargs)
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not kernels.available(), reason="ortspec's kernel library is not built")
def test_kv_cache_fp32_keeps_a_float32_cache_on_ortspecs_kernels(sources, tmp_path):
    """The default int4 export on ortspec's kernels keeps its KV cache in float16; kv_cache="fp32"
    (--kv-cache fp32) keeps float32 and the float32 ops. Both validate against PyTorch and
    compute every verify row as its step, bit for bit, and their logits differ by no more than
    each's own distance to PyTorch allows."""
    outs = {}
    for kv in (None, "fp32"):
        outs[kv] = export_model(sources["llama"], out=tmp_path / f"kv-{kv}", capacity=CAP,
                                max_verify_len=VERIFY, progress=False, quant="int4", kv_cache=kv)
    for kv, dtype, op in ((None, np.float16, "RotaryCacheAttention16"),
                          ("fp32", np.float32, "RotaryCacheAttention")):
        m = mf.read_manifest(outs[kv])
        assert m.extra["kv_cache"] == np.dtype(dtype).name.replace("float", "fp")
        assert _op_count(outs[kv], op) == m.architecture.num_layers
        assert sessions.OrtSessions(outs[kv], threads=1).kv_dtype is dtype
        v = m.extra["validation"]
        assert v["step_vs_verify"] == 0.0 and v["verify_vs_pytorch"] <= v["bound_vs_pytorch"]
    ids = _ids(40, seed=3)
    logits = {}
    for kv, out in outs.items():
        dec = OrtDecoder(out)
        dec.prefill(ids[:-1])
        logits[kv] = dec.forward_token(ids[-1])
    bound = mf.read_manifest(outs[None]).extra["validation"]["bound_vs_pytorch"]
    assert 0 < np.abs(logits[None] - logits["fp32"]).max() <= 2 * bound


def test_cli_exports_an_int4_target(sources, tmp_path, capsys):
    out = tmp_path / "cli-int4"
    assert export_cli.main([str(sources["llama"]), "--out", str(out), "--quant", "int4",
                            "--capacity", str(CAP), "--max-verify-len", str(VERIFY),
                            "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == str(out.absolute())
    assert mf.read_manifest(out).min_attention_rows == (1 if kernels.available() else 2)
    assert export_cli.main([str(sources["llama"]), "--out", str(tmp_path / "x"),
                            "--lm-head", "int4", "--quiet"]) == 2

    assert "without quant" in capsys.readouterr().err


@pytest.mark.skipif(not kernels.available(), reason="ortspec's kernel library is not built")
def test_a_draft_names_the_attention_op_of_its_own_graph(sources, tmp_path):
    """The target attends with ortspec.CacheAttention; its int4 draft runs MatMulNBits (kernel
    "onnxruntime") and so GroupQueryAttention, and each manifest names its own graph's op."""
    out = export_model(sources["llama"], out=tmp_path / "m", capacity=CAP, max_verify_len=VERIFY,
                       progress=False, quant="int4", draft_layers=1)
    draft = out / "drafts" / "layers1-int4"  # a quantized target's draft is quantized too
    for directory, op, node in ((out, "CacheAttention", "RotaryCacheAttention16"),
                                (draft, "GroupQueryAttention", "GroupQueryAttention")):
        assert mf.read_manifest(directory).extra["attention"] == op
        assert _op_count(directory, node) > 0
