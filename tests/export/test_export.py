"""ortspec.export end to end on tiny generated checkpoints: graph, manifest, chat format,
option checking, early refusal, and the all-or-nothing output directory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from ortspec.export.tiny import (EOS_ID, make_tiny_llama, make_tiny_qwen2, make_tokenizer,
                                 make_unsupported)
from onnx import TensorProto
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from ortspec.export import ExportOptionError, export_model
from ortspec.export import validate as validate_mod
from ortspec.runtime.check.tolerances import Bound, Tolerances
from ortspec.runtime.ort import graph_io as gio
from ortspec.runtime.ort import manifest as mf
from ortspec.runtime.errors import ExportError, ManifestError

CAP, VERIFY = 64, 4


pytestmark = pytest.mark.slow  # builds and exports torch checkpoints


@pytest.fixture(scope="module")
def llama_src(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("src") / "tiny-llama")


@pytest.fixture(scope="module")
def llama_dir(llama_src, tmp_path_factory):
    out = tmp_path_factory.mktemp("out") / "llama"
    return export_model(llama_src, out=out, capacity=CAP, max_verify_len=VERIFY, progress=False)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    src = make_tiny_qwen2(tmp_path_factory.mktemp("src") / "tiny-qwen2")
    out = tmp_path_factory.mktemp("out") / "qwen2"
    return export_model(src, out=out, capacity=CAP, max_verify_len=VERIFY, progress=False)


def _io(graph_path):
    model = onnx.load(str(graph_path), load_external_data=False)

    def dims(v):
        return [d.dim_value if d.HasField("dim_value") else d.dim_param
                for d in v.type.tensor_type.shape.dim]

    ins = {v.name: (v.type.tensor_type.elem_type, dims(v)) for v in model.graph.input}
    outs = {v.name: (v.type.tensor_type.elem_type, dims(v)) for v in model.graph.output}
    return model, ins, outs


@pytest.mark.parametrize("which", ["llama_dir", "qwen_dir"])
def test_graph_inputs_and_outputs_follow_the_manifest(which, request):
    d = request.getfixturevalue(which)
    m = mf.read_manifest(d)
    a = m.architecture
    model, ins, outs = _io(d / m.entry_points["step"].graph)
    # a dynamic batch axis (the GQA graph runs B = 1; the window flavour takes B rows)
    kv = ["batch", a.num_kv_heads, CAP, a.head_dim]
    # logit_rows: the flat positions b * S + s whose logits the call computes
    expected_in = {gio.INPUT_IDS: (TensorProto.INT64, ["batch", "sequence_length"]),
                   gio.ATTENTION_MASK: (TensorProto.INT64, ["batch", "total_sequence_length"]),
                   gio.LOGIT_ROWS: (TensorProto.INT64, ["logit_rows"])}
    expected_out = {gio.LOGITS: (TensorProto.FLOAT, ["logit_rows", a.vocab_size])}
    for i in range(a.num_layers):
        expected_in[gio.past_key_name(i)] = expected_in[gio.past_value_name(i)] = \
            (TensorProto.FLOAT, kv)
        expected_out[gio.present_key_name(i)] = expected_out[gio.present_value_name(i)] = \
            (TensorProto.FLOAT, kv)
    assert ins == expected_in
    assert outs == expected_out
    ops = {n.op_type for n in model.graph.node}
    assert {"GroupQueryAttention", "SkipSimplifiedLayerNormalization",
            "SimplifiedLayerNormalization"} <= ops
    # both entry points share one graph, so one session and one packed copy of the weights
    assert m.entry_points["step"].graph == m.entry_points["verify"].graph
    assert (m.entry_points["verify"].min_len, m.entry_points["verify"].max_len) == (1, VERIFY)


def test_the_lm_head_runs_on_the_rows_logit_rows_names(llama_dir):
    """logits row n is position logit_rows[n] of the call, in any order and with repeats, the
    same numbers as when every position is asked for."""
    import onnxruntime as ort

    m = mf.read_manifest(llama_dir)
    a = m.architecture
    session = ort.InferenceSession(str(llama_dir / "model.onnx"),
                                   providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    ids = rng.integers(0, a.vocab_size, size=(1, 6))
    past = {n: np.zeros((1, a.num_kv_heads, CAP, a.head_dim), np.float32)
            for i in range(a.num_layers) for n in (gio.past_key_name(i), gio.past_value_name(i))}

    def logits(rows):
        feed = {gio.INPUT_IDS: ids, gio.ATTENTION_MASK: np.ones((1, 6), np.int64),
                gio.LOGIT_ROWS: np.array(rows, np.int64), **past}
        return session.run([gio.LOGITS], feed)[0]

    every = logits(range(6))
    assert every.shape == (6, a.vocab_size)
    assert len({float(r.max()) for r in every}) == 6  # six different rows
    some = logits([5, 0, 5, 2])
    assert some.shape == (4, a.vocab_size)
    np.testing.assert_allclose(some, every[[5, 0, 5, 2]], rtol=0, atol=1e-5)


def test_tied_embedding_is_stored_once(llama_dir, llama_src):
    torch_model = AutoModelForCausalLM.from_pretrained(llama_src)
    params = dict(torch_model.named_parameters())  # deduplicates the tied lm_head
    assert "lm_head.weight" not in params
    head_dim = torch_model.config.hidden_size // torch_model.config.num_attention_heads
    rope_bytes = 2 * CAP * (head_dim // 2) * 4
    expected = sum(p.numel() * 4 for p in params.values()) + rope_bytes
    m = mf.read_manifest(llama_dir)
    assert m.extra["weight_bytes"] == expected
    model = onnx.load(str(llama_dir / "model.onnx"), load_external_data=False)
    locs = {t.name: {e.key: e.value for e in t.external_data} for t in model.graph.initializer
            if t.data_location == TensorProto.EXTERNAL}
    # the LM head's name points at the very bytes of the embedding table
    assert locs["embed_as_lm_head"] == locs["embed"]
    assert len({(v["offset"], v["length"]) for v in locs.values()}) == len(locs) - 1
    assert (llama_dir / "model.onnx.data").stat().st_size < expected * 1.1  # padding only


def test_untied_qwen2_keeps_its_lm_head_and_biases(qwen_dir):
    m = mf.read_manifest(qwen_dir)
    assert m.architecture.family == "qwen2" and m.extra["tied_embeddings"] is False
    model = onnx.load(str(qwen_dir / "model.onnx"), load_external_data=False)
    names = {t.name for t in model.graph.initializer}
    assert "lm_head" in names and "layers.0.qkv_bias" in names


def test_chat_format_renders_exactly_as_the_template(llama_dir):
    m = mf.read_manifest(llama_dir)
    tok = make_tokenizer()
    conv = [{"role": "user", "content": "What is {this}?"},
            {"role": "assistant", "content": "A test."}, {"role": "user", "content": "Sure?"}]
    for generation in (False, True):
        assert m.chat_format.render(conv, add_generation_prompt=generation) == \
            tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=generation)
    assert m.chat_format.default_system == "You are a tiny test model."
    assert m.chat_template == tok.chat_template
    assert m.stop_token_ids == (EOS_ID,)  # <|im_end|> is both EOS and the end of turn
    assert m.bos_token_id is None  # this tokenizer adds no BOS


def test_tokenizer_json_encodes_like_the_checkpoint_tokenizer(llama_dir):
    text = "Hello, world! Speculative decoding <|im_start|>user"
    ours = Tokenizer.from_file(str(llama_dir / "tokenizer.json")).encode(text).ids
    assert ours == make_tokenizer()(text)["input_ids"]


def test_manifest_round_trip(llama_dir):
    m = mf.read_manifest(llama_dir)
    again = mf.parse_manifest(json.loads(m.to_json()))
    assert again == m
    assert set(m.files) == {"model.onnx", "model.onnx.data", "tokenizer.json"}
    assert m.precision == m.dtype == "fp32"  # float weights: the dtype says it all
    assert m.source["kind"] == "hf" and len(m.source["sha256"]) == 64
    v = m.extra["validation"]
    assert v["step_vs_verify"] <= 1e-4 and v["verify_vs_pytorch"] <= 1e-3


def test_corrupted_weights_are_detected(llama_dir, tmp_path):
    copy = shutil.copytree(llama_dir, tmp_path / "copy")
    data = copy / "model.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one flipped bit in the middle of the weights
    data.write_bytes(bytes(raw))
    with pytest.raises(ManifestError, match="model.onnx.data"):
        mf.read_manifest(copy)
    mf.read_manifest(copy, verify_checksums=False)  # everything else is still well formed


@pytest.mark.parametrize("bad", [
    {"capacity": 8}, {"capacity": 131073}, {"capacity": "2048"}, {"capacity": True},
    {"max_verify_len": 0}, {"max_verify_len": 257}, {"capacity": 16, "max_verify_len": 17},
    {"dtype": "int8"}, {"opset": 12}, {"opset": 99},
])
def test_invalid_options_are_refused_before_anything_is_read_or_written(bad, tmp_path):
    out = tmp_path / "nested" / "out"
    # a source that does not exist: the option error must come first
    with pytest.raises(ExportOptionError) as info:
        export_model(tmp_path / "no-such-model", out=out, progress=False, **bad)
    assert isinstance(info.value, ValueError)
    assert list(tmp_path.iterdir()) == []


def test_unsupported_architecture_is_refused_before_loading(tmp_path, monkeypatch):
    src = make_unsupported(tmp_path / "gpt2")
    import ortspec.export.checkpoint as checkpoint

    def must_not_load(*a, **k):
        raise AssertionError("the checkpoint was loaded before the architecture check")

    monkeypatch.setattr(checkpoint, "load_checkpoint", must_not_load)
    with pytest.raises(ExportError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        export_model(src, out=tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_unsupported_gguf_architecture_is_refused_from_its_header(tmp_path):
    import struct

    def string(s: str) -> bytes:
        return struct.pack("<Q", len(s)) + s.encode()

    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + string("general.architecture") + \
        struct.pack("<I", 8) + string("gpt2")
    path = tmp_path / "model.gguf"
    path.write_bytes(header)
    with pytest.raises(ExportError, match="'gpt2' is not supported"):
        export_model(path, out=tmp_path / "out", progress=False)
    not_gguf = tmp_path / "junk.gguf"
    not_gguf.write_bytes(b"not a gguf file at all")
    with pytest.raises(ExportError, match="not a GGUF"):
        export_model(not_gguf, out=tmp_path / "out2", progress=False)


def test_a_failed_validation_leaves_nothing_behind(llama_src, tmp_path, monkeypatch):
    # an impossible bound: the gate must fire, and the half-written directory must vanish
    monkeypatch.setitem(validate_mod.TOLERANCES, "fp32", Tolerances(
        step_vs_verify=Bound(1.0), vs_pytorch=Bound(0.0)))
    out = tmp_path / "a" / "b" / "out"
    with pytest.raises(ExportError, match="validation failed"):
        export_model(llama_src, out=out, capacity=CAP, max_verify_len=VERIFY, progress=False)
    assert list(tmp_path.iterdir()) == []  # no output, no temp dir, no created parents


def test_an_interrupted_export_leaves_nothing_behind(llama_src, tmp_path, monkeypatch):
    import ortspec.export.api as api

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(api.chat, "save_tokenizer", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_model(llama_src, out=tmp_path / "out", capacity=CAP, max_verify_len=VERIFY,
                     progress=False)
    assert list(tmp_path.iterdir()) == []


def test_existing_output_needs_overwrite(llama_src, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="already exists"):
        export_model(llama_src, out=out, capacity=CAP, max_verify_len=VERIFY, progress=False)
    assert (out / "keep.txt").read_text() == "mine"
    export_model(llama_src, out=out, capacity=CAP, max_verify_len=VERIFY, progress=False,
                 overwrite=True)
    assert not (out / "keep.txt").exists()
    assert mf.read_manifest(out).capacity == CAP
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the old copy is gone too


def test_progress_off_a_terminal_is_one_plain_line_per_stage(llama_src, tmp_path, capfd):
    """In a log (stderr not a terminal) the export writes a line as each stage ends, and no
    carriage-return frames: neither its own bar's nor transformers' loading bars."""
    from ortspec.export.api import STAGES

    capfd.readouterr()
    export_model(llama_src, out=tmp_path / "out", capacity=CAP, max_verify_len=VERIFY,
                 progress=True)
    err = capfd.readouterr().err
    assert "\r" not in err
    lines = [line for line in err.splitlines() if line.startswith("export: ")]
    total = len(STAGES)
    assert [line.split(" (")[0] for line in lines] == [
        f"export: {i}/{total} stages" for i in range(1, total + 1)]
    assert [line.split(" (")[1].split(")")[0].split(":")[0] for line in lines] == list(STAGES)


@pytest.mark.parametrize("opset", [17, 24])
def test_supported_opsets_export_and_validate(llama_src, tmp_path, opset):
    out = export_model(llama_src, out=tmp_path / "out", capacity=32, max_verify_len=2,
                       opset=opset, progress=False)
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    assert {o.domain: o.version for o in model.opset_import}[""] == opset


def test_fp16_export_keeps_fp32_logits(llama_src, tmp_path):
    out = export_model(llama_src, out=tmp_path / "out", capacity=CAP, max_verify_len=VERIFY,
                       dtype="fp16", progress=False)
    m = mf.read_manifest(out)
    _, ins, outs = _io(out / "model.onnx")
    assert ins[gio.past_key_name(0)][0] == TensorProto.FLOAT16
    assert outs[gio.LOGITS][0] == TensorProto.FLOAT
    v = m.extra["validation"]
    assert v["verify_vs_pytorch"] <= v["bound_vs_pytorch"]
    assert v["bound_vs_pytorch"] == pytest.approx(0.02 * v["max_abs_logit"])
    assert v["verify_vs_pytorch"] > 0  # half precision really was used
    # the fp16 data file holds half the bytes of fp32 weights (the rope tables too)
    assert m.extra["weight_bytes"] * 2 == mf.read_manifest(
        export_model(llama_src, out=tmp_path / "fp32", capacity=CAP, max_verify_len=VERIFY,
                     progress=False)).extra["weight_bytes"]


def test_validation_prompt_covers_several_verify_blocks(llama_dir):
    from ortspec.export.checkpoint import load_checkpoint
    from ortspec.export.sources import identify_source

    m = mf.read_manifest(llama_dir)
    ckpt = load_checkpoint(identify_source(m.source["path"]), capacity=CAP, progress=False)
    ids = validate_mod.validation_prompt(ckpt, capacity=CAP, max_verify_len=VERIFY)
    assert ids.size >= 2 * VERIFY + 1 and ids.size <= CAP
    assert ids.min() >= 0 and ids.max() < m.architecture.vocab_size
    assert len(set(ids.tolist())) > 5  # real text, not one repeated id
    np.testing.assert_array_equal(ids, validate_mod.validation_prompt(
        ckpt, capacity=CAP, max_verify_len=VERIFY))  # fixed


def test_fp32_bounds_are_absolute_for_small_logits_and_scale_for_large_ones():
    fp32 = validate_mod.TOLERANCES["fp32"]
    assert fp32.step_vs_verify.at(2.5) == 1e-4  # tiny test models: the brief's 1e-4
    assert fp32.step_vs_verify.at(38.5) == pytest.approx(1.54e-4)  # SmolLM2's logit scale
    assert fp32.vs_pytorch.at(38.5) == 1e-3  # PyTorch comparison: 1e-3 whatever the scale


def test_integer_options_accept_numpy_integers_as_python_ints():
    from ortspec.export import api

    got = api.check_options(capacity=np.int64(64), max_verify_len=np.int32(4), dtype="fp32",
                            opset=np.int64(21))
    assert got == (64, 4, 21) and all(type(v) is int for v in got)
    with pytest.raises(ExportOptionError, match=r"opset \(with standard attention\) must be an "
                                                r"integer in 24\.\.24, got 21"):
        api.check_options(capacity=64, max_verify_len=4, dtype="fp32", opset=21,
                          attention="standard")


# -- the package's own structure ----------------------------------------------------------------


def _export_modules() -> dict[str, Path]:
    import ortspec.export

    root = Path(ortspec.export.__file__).parent
    return {p.stem: p for p in sorted(root.glob("*.py"))}


def _imported_export_modules(path: Path, modules: set[str]) -> set[str]:
    """The ortspec.export modules `path` imports anywhere (module level, functions,
    TYPE_CHECKING blocks), relative or absolute."""

    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level == 1:
                base = f"ortspec.export.{base}" if base else "ortspec.export"
            elif node.level:
                continue  # above the package
            if base == "ortspec.export":
                found |= {a.name for a in node.names if a.name in modules}
            elif base.startswith("ortspec.export."):
                found.add(base.split(".")[2])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[2] for a in node.names
                      if a.name.startswith("ortspec.export.")}
    return found & modules


def test_export_modules_import_each_other_without_cycles():
    modules = _export_modules()
    graph = {name: _imported_export_modules(path, set(modules)) - {name}
             for name, path in modules.items()}
    assert "graphs" not in graph["attention"] and "attention" in graph["graphs"]
    done: set[str] = set()

    def visit(name: str, stack: list[str]) -> None:
        if name in stack:
            raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(name):]
                                                                + [name]))
        if name in done:
            return
        for dep in sorted(graph[name]):
            visit(dep, [*stack, name])
        done.add(name)

    for name in graph:
        visit(name, [])


def test_export_modules_do_not_locate_files_through___file__():
    offenders = [name for name, path in _export_modules().items()
                 if "__file__" in path.read_text(encoding="utf-8")]
    assert offenders == []
