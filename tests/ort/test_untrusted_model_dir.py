"""A model directory from someone else: every way it can reach outside itself or lie about its
contents is refused as ManifestError, with a message naming the problem, before ONNX Runtime
opens anything (no InferenceSession is created).

Each bad directory starts from a small valid one (`write_graph_dir`: one layer, random weights,
external data in model.onnx.data, built in well under a second) and breaks one thing.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers.export import write_graph_dir
from onnx import TensorProto, helper, numpy_helper

from ortspec.runtime.ort import graph_io as gio
from ortspec.runtime.ort import manifest as mf
from ortspec.runtime.errors import ManifestError
from ortspec.runtime.load import load_model
from ortspec.runtime.ort.onnx_guard import read_graph_summary
from ortspec.runtime.ort.decoder import OrtDecoder

RUNTIME = Path(mf.__file__).resolve().parents[1]  # ortspec.runtime (the manifest is in ort/)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return write_graph_dir(tmp_path_factory.mktemp("base") / "model")


@pytest.fixture()
def dir_copy(base_dir, tmp_path):
    """A fresh copy of the valid directory, inside tmp_path/work (tmp_path itself is 'outside')."""
    return Path(shutil.copytree(base_dir, tmp_path / "work" / "model"))


@pytest.fixture()
def no_sessions(monkeypatch):
    """Any InferenceSession created from here on fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"an InferenceSession was created for {args[:1]}")

    monkeypatch.setattr(ort, "InferenceSession", refuse)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _edit_manifest(d: Path, edit) -> None:
    data = json.loads((d / "manifest.json").read_text())
    edit(data)
    (d / "manifest.json").write_text(json.dumps(data))


def _relist(d: Path, *names: str) -> None:
    """Record the current sha256 of `names` in the manifest (as a careful attacker would)."""
    def edit(data):
        for n in names:
            data["files"][n] = _sha(d / n)
    _edit_manifest(d, edit)


def _point_weights_at(d: Path, location: str, *, first_only: bool = True) -> None:
    """Rewrite the external-data location of the graph's initializer(s), relist model.onnx."""
    model = onnx.load(str(d / "model.onnx"), load_external_data=False)
    done = 0
    for t in model.graph.initializer:
        if t.data_location == TensorProto.EXTERNAL:
            for e in t.external_data:
                if e.key == "location":
                    e.value = location
                    done += 1
            if first_only and done:
                break
    assert done
    (d / "model.onnx").write_bytes(model.SerializeToString())
    _relist(d, "model.onnx")


def _refused(d: Path, match: str) -> ManifestError:
    with pytest.raises(ManifestError, match=match) as e:
        load_model(d)
    with pytest.raises(ManifestError, match=match):
        mf.read_manifest(d, verify_checksums=False)
    return e.value


# -- the valid directory, and valid variations ---------------------------------------------------


def test_the_base_directory_loads_and_its_references_match_onnx(base_dir):
    m = mf.read_manifest(base_dir)
    summary = read_graph_summary(base_dir / "model.onnx")
    model = onnx.load(str(base_dir / "model.onnx"), load_external_data=False)
    expected = {(t.name, e.value) for t in model.graph.initializer for e in t.external_data
                if e.key == "location"}
    assert {(r.owner.split("'")[1], r.location) for r in summary.references} == expected
    assert {r.location for r in summary.references} == {"model.onnx.data"}
    assert set(summary.inputs) == {i.name for i in model.graph.input}
    assert set(summary.outputs) == {o.name for o in model.graph.output}
    dec = OrtDecoder(base_dir, manifest=m)
    assert np.isfinite(dec.forward_token(5)).all()


def test_weights_in_a_listed_subfolder_are_accepted(dir_copy):
    """The positive control for the rules below: a relative location inside the directory,
    listed with its sha256, loads and runs (so the guard does not refuse everything)."""
    (dir_copy / "weights").mkdir()
    shutil.move(dir_copy / "model.onnx.data", dir_copy / "weights" / "w.data")
    _point_weights_at(dir_copy, "weights/w.data", first_only=False)
    _edit_manifest(dir_copy, lambda d: d["files"].pop("model.onnx.data"))
    _relist(dir_copy, "weights/w.data")
    model = load_model(dir_copy)
    assert np.isfinite(model.decoder.forward_token(7)).all()


# -- external data that leaves the directory -----------------------------------------------------


def test_external_data_at_an_absolute_path_is_refused(dir_copy, no_sessions):
    _point_weights_at(dir_copy, str((dir_copy / "model.onnx.data").resolve()))
    _refused(dir_copy, r"absolute path")
    _point_weights_at(dir_copy, "/etc/passwd")
    e = _refused(dir_copy, r"'/etc/passwd'.*absolute path")
    assert "model.onnx" in str(e)  # names the graph file too


@pytest.mark.parametrize("location", ["C:\\Windows\\win.ini", "\\\\server\\share\\w.data"])
def test_windows_absolute_paths_are_refused_too(dir_copy, no_sessions, location):
    _point_weights_at(dir_copy, location)
    _refused(dir_copy, r"absolute path")


@pytest.mark.parametrize("location", ["../outside.data", "sub/../../outside.data",
                                      "..\\outside.data"])
def test_external_data_climbing_with_dotdot_is_refused(dir_copy, tmp_path, no_sessions, location):
    shutil.copy(dir_copy / "model.onnx.data", dir_copy.parent / "outside.data")
    _point_weights_at(dir_copy, location)
    _refused(dir_copy, r"'\.\.' leaves the model directory")


def test_external_data_through_a_symlink_leading_outside_is_refused(dir_copy, tmp_path,
                                                                    no_sessions):
    secret = tmp_path / "secret.data"
    shutil.copy(dir_copy / "model.onnx.data", secret)
    (dir_copy / "link.data").symlink_to(secret)
    _point_weights_at(dir_copy, "link.data")
    _refused(dir_copy, r"'link.data'.*resolves outside the model directory")
    # listing it with its (correct) checksum does not help: the file list has the same rule
    _relist(dir_copy, "link.data")
    _refused(dir_copy, r"'link.data'.*resolves outside the model directory")


def test_a_symlinked_folder_leading_outside_is_refused(dir_copy, tmp_path, no_sessions):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.copy(dir_copy / "model.onnx.data", outside / "w.data")
    (dir_copy / "weights").symlink_to(outside, target_is_directory=True)
    _point_weights_at(dir_copy, "weights/w.data")
    _refused(dir_copy, r"resolves outside the model directory")


def test_external_data_not_listed_in_the_manifest_is_refused(dir_copy, no_sessions):
    """Inside the directory but unchecked: its bytes could be anything."""
    shutil.copy(dir_copy / "model.onnx.data", dir_copy / "extra.data")
    _point_weights_at(dir_copy, "extra.data")
    _refused(dir_copy, r"'extra.data' is not listed with a sha256 in manifest.files")


def test_onnxruntimes_memory_address_marker_is_refused(dir_copy, no_sessions):
    """`*/_ORT_MEM_ADDR_/*` makes onnxruntime read from the address in `offset`: refused even
    when a file of that name exists and is listed."""
    marker = dir_copy / "*" / "_ORT_MEM_ADDR_" / "*"
    marker.parent.mkdir(parents=True)
    shutil.copy(dir_copy / "model.onnx.data", marker)
    _relist(dir_copy, "*/_ORT_MEM_ADDR_/*")
    _point_weights_at(dir_copy, "*/_ORT_MEM_ADDR_/*")
    _refused(dir_copy, r"in-memory marker")


def test_external_tensor_without_a_location_is_refused(dir_copy, no_sessions):
    _point_weights_at(dir_copy, "")
    _refused(dir_copy, r"location is empty")


# -- contents that do not match -----------------------------------------------------------------


def test_a_weights_checksum_mismatch_is_refused(dir_copy, no_sessions):
    raw = bytearray((dir_copy / "model.onnx.data").read_bytes())
    raw[len(raw) // 2] ^= 0x01
    (dir_copy / "model.onnx.data").write_bytes(bytes(raw))
    with pytest.raises(ManifestError, match=r"'model.onnx.data' does not match its sha256"):
        load_model(dir_copy)


def test_a_graph_checksum_mismatch_is_refused(dir_copy, no_sessions):
    with open(dir_copy / "model.onnx", "ab") as f:
        f.write(b"\x00")
    with pytest.raises(ManifestError, match=r"'model.onnx' does not match its sha256"):
        load_model(dir_copy)


def test_a_file_that_is_not_onnx_is_refused(dir_copy, no_sessions):
    (dir_copy / "model.onnx").write_bytes(b"\xff\xff\xff\xff\xff not a protobuf")
    _relist(dir_copy, "model.onnx")
    _refused(dir_copy, r"'model.onnx' is not a well-formed ONNX model")
    (dir_copy / "model.onnx").write_bytes(b"")
    _relist(dir_copy, "model.onnx")
    _refused(dir_copy, r"'model.onnx' is empty")


def test_a_truncated_graph_is_refused(dir_copy, no_sessions):
    raw = (dir_copy / "model.onnx").read_bytes()
    (dir_copy / "model.onnx").write_bytes(raw[: len(raw) // 2])
    _relist(dir_copy, "model.onnx")
    _refused(dir_copy, r"not a well-formed ONNX model")


# -- the schema --------------------------------------------------------------------------------


@pytest.mark.parametrize("edit, match", [
    (lambda d: d.update(format_version=2), r"format_version = 2; this ortspec reads version 1"),
    (lambda d: d.update(format="gguf"), r"manifest.format: expected 'ortspec-model'"),
    (lambda d: d.update(capacity="32"), r"manifest.capacity: expected an integer, got '32'"),
    (lambda d: d.update(capacity=True), r"manifest.capacity: expected an integer"),
    (lambda d: d["architecture"].update(num_layers="one"), r"num_layers: expected an integer"),
    (lambda d: d.update(dtype="int8"), r"manifest.dtype = 'int8'"),
    (lambda d: d.update(stop_token_ids="2"), r"stop_token_ids: expected list"),
    (lambda d: d.update(files=["model.onnx"]), r"manifest.files: expected an object"),
    (lambda d: d["architecture"].update(num_layers=0), r"num_layers = 0 is out of range; allowed 1"),
    (lambda d: d["architecture"].update(vocab_size=1), r"vocab_size = 1 is out of range"),
    (lambda d: d.update(capacity=1), r"capacity = 1 is out of range"),
    (lambda d: d.update(max_verify_len=10**6), r"max_verify_len = 1000000 is out of range"),
    (lambda d: d.update(stop_token_ids=[10**9]), r"stop_token_ids: 1000000000 is not a token id"),
    (lambda d: d["entry_points"].pop("verify"), r"entry_points: missing 'verify'"),
    (lambda d: d["entry_points"].pop("step"), r"entry_points: missing 'step'"),
    (lambda d: d["entry_points"]["step"].update(graph="../model.onnx"),
     r"'\.\./model.onnx' must be a relative path inside the model directory"),
    (lambda d: d["entry_points"]["step"].update(graph="/etc/passwd"),
     r"must be a relative path inside"),
    (lambda d: d.update(tokenizer="missing.json"), r"'missing.json', which is missing"),
    (lambda d: d["files"].pop("tokenizer.json"), r"manifest.files has no sha256 for 'tokenizer.json'"),
    (lambda d: d.pop("architecture"), r"missing required field 'architecture'"),
])
def test_schema_errors_name_the_field(dir_copy, no_sessions, edit, match):
    _edit_manifest(dir_copy, edit)
    with pytest.raises(ManifestError, match=match):
        load_model(dir_copy)


def test_a_manifest_that_is_not_json_or_missing(dir_copy, tmp_path, no_sessions):
    (dir_copy / "manifest.json").write_text("{ nope")
    with pytest.raises(ManifestError, match="not valid JSON"):
        load_model(dir_copy)
    (dir_copy / "manifest.json").unlink()
    with pytest.raises(ManifestError, match="has no manifest.json"):
        load_model(dir_copy)
    with pytest.raises(ManifestError, match="does not exist"):
        load_model(tmp_path / "nowhere")


# -- graph inputs and outputs --------------------------------------------------------------------


def test_graph_io_not_matching_the_manifest_is_refused_before_a_session(dir_copy, no_sessions):
    _edit_manifest(dir_copy, lambda d: d["architecture"].update(num_layers=2))
    _refused(dir_copy, r"graph I/O does not match the manifest \(2 layers\): missing "
                        r"\[past_key_values.1.key")


def test_a_renamed_graph_input_is_refused_before_a_session(dir_copy, no_sessions):
    model = onnx.load(str(dir_copy / "model.onnx"), load_external_data=False)
    old = gio.ATTENTION_MASK
    for i in model.graph.input:
        if i.name == old:
            i.name = "mask"
    for n in model.graph.node:
        n.input[:] = ["mask" if x == old else x for x in n.input]
    (dir_copy / "model.onnx").write_bytes(model.SerializeToString())
    _relist(dir_copy, "model.onnx")
    _refused(dir_copy, r"missing \[attention_mask\], unexpected inputs \['mask'\]")


def test_ort_decoder_checks_the_io_again_at_session_creation(base_dir):
    """A manifest handed straight to OrtDecoder (no read_manifest) is still checked against the
    session's own inputs and outputs."""
    m = mf.read_manifest(base_dir)
    a = dataclasses.replace(m.architecture, num_layers=2)
    with pytest.raises(ManifestError, match=r"graph I/O does not match the manifest \(missing "
                                            r"\['past_key_values.1.key'"):
        OrtDecoder(base_dir, manifest=dataclasses.replace(m, architecture=a))


# -- everywhere a tensor can hide -------------------------------------------------------------


def _ext(name: str, location: str) -> TensorProto:
    t = numpy_helper.from_array(np.zeros(2, np.float32), name)
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", "0"), ("length", "8")):
        e = t.external_data.add()
        e.key, e.value = k, v
    return t


def test_the_reader_finds_external_data_in_every_place_onnx_allows(tmp_path):
    """Initializers, sparse initializers, Constant attributes (t and tensors), If/Loop
    subgraphs nested twice, functions, training info: all found, as onnx itself lists them."""
    inner = helper.make_graph([helper.make_node("Constant", [], ["c2"], value=_ext("deep", "deep.bin"))],
                              "inner", [], [helper.make_tensor_value_info("c2", TensorProto.FLOAT, [2])],
                              initializer=[_ext("inner_init", "inner.bin")])
    then_g = helper.make_graph(
        [helper.make_node("If", ["cond"], ["c2"], then_branch=inner, else_branch=inner)],
        "then", [], [helper.make_tensor_value_info("c2", TensorProto.FLOAT, [2])])
    sparse = onnx.SparseTensorProto()
    sparse.values.CopyFrom(_ext("sp", "sparse_values.bin"))
    sparse.indices.CopyFrom(numpy_helper.from_array(np.array([0], np.int64), "sp_idx"))
    sparse.dims.extend([4])
    nodes = [
        helper.make_node("Constant", [], ["a"], value=_ext("attr_t", "attr_t.bin")),
        helper.make_node("If", ["cond"], ["b"], then_branch=then_g, else_branch=then_g),
        helper.make_node("MyFunc", ["a"], ["z"], domain="custom"),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("b", TensorProto.FLOAT, [2])],
                              initializer=[_ext("w", "init.bin")], sparse_initializer=[sparse])
    func = helper.make_function("custom", "MyFunc", ["x"], ["z"],
                                [helper.make_node("Constant", [], ["z"], value=_ext("fn", "function.bin"))],
                                [helper.make_opsetid("", 21)])
    attr_list = helper.make_attribute("value_list", [_ext("l1", "list1.bin"), _ext("l2", "list2.bin")])
    graph.node[0].attribute.append(attr_list)
    model = helper.make_model(graph, functions=[func])
    ti = model.training_info.add()
    ti.initialization.CopyFrom(helper.make_graph([], "init", [], [], initializer=[_ext("ti", "training.bin")]))
    path = tmp_path / "m.onnx"
    path.write_bytes(model.SerializeToString())

    found = {r.location for r in read_graph_summary(path).references}
    assert found == {"init.bin", "sparse_values.bin", "attr_t.bin", "list1.bin", "list2.bin",
                     "inner.bin", "deep.bin", "function.bin", "training.bin"}
    from onnx.external_data_helper import _get_all_tensors  # onnx's own walk (no sparse, no functions)
    theirs = {e.value for t in _get_all_tensors(model) for e in t.external_data if e.key == "location"}
    assert theirs <= found


def test_nested_external_data_outside_is_refused_at_load(dir_copy, no_sessions):
    """A Constant node in the real graph whose tensor points outside: found and refused, though
    no initializer changed."""
    model = onnx.load(str(dir_copy / "model.onnx"), load_external_data=False)
    model.graph.node.append(helper.make_node("Constant", [], ["unused"],
                                             value=_ext("sneaky", "../../etc/shadow")))
    (dir_copy / "model.onnx").write_bytes(model.SerializeToString())
    _relist(dir_copy, "model.onnx")
    _refused(dir_copy, r"tensor 'sneaky' at '\.\./\.\./etc/shadow': '\.\.' leaves")


def test_an_epcontext_engine_path_outside_is_refused(dir_copy, no_sessions):
    model = onnx.load(str(dir_copy / "model.onnx"), load_external_data=False)
    model.graph.node.append(helper.make_node("EPContext", [], ["unused"], domain="com.microsoft",
                                             embed_mode=0, ep_cache_context="/tmp/engine.bin"))
    (dir_copy / "model.onnx").write_bytes(model.SerializeToString())
    _relist(dir_copy, "model.onnx")
    _refused(dir_copy, r"EPContext engine .* absolute path")


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not out[-1] & 0x80:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:  # a length-delimited protobuf field
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def test_absurdly_deep_subgraphs_are_refused(tmp_path):
    """Graph -> node -> attribute g -> graph ..., 80 deep, written byte by byte (the protobuf
    library itself refuses to build it)."""
    graph = b""
    for _ in range(80):
        graph = _field(1, _field(5, _field(6, graph)))  # GraphProto.node.attribute.g
    path = tmp_path / "deep.onnx"
    path.write_bytes(_field(7, graph))  # ModelProto.graph
    with pytest.raises(ManifestError, match="nested more than 64 deep"):
        read_graph_summary(path)
    shallow = b""
    for _ in range(10):
        shallow = _field(1, _field(5, _field(6, shallow)))
    path.write_bytes(_field(7, shallow))
    assert read_graph_summary(path).references == ()


# -- nothing is executed -------------------------------------------------------------------------


def test_the_runtime_never_unpickles_evaluates_or_executes():
    """No pickle/marshal/shelve/jinja2 import, no eval/exec/compile/__import__ call, no
    np.load (pickle-capable) anywhere in ortspec.runtime."""
    banned_modules = {"pickle", "cPickle", "dill", "marshal", "shelve", "jinja2", "yaml"}
    banned_calls = {"eval", "exec", "compile", "__import__"}
    files = sorted(RUNTIME.rglob("*.py"))
    assert len(files) >= 10
    for f in files:
        tree = ast.parse(f.read_text(), filename=str(f))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert not {a.name.split(".")[0] for a in node.names} & banned_modules, f
            elif isinstance(node, ast.ImportFrom):
                assert (node.module or "").split(".")[0] not in banned_modules, f
            elif isinstance(node, ast.Call):
                fn = node.func
                name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
                assert name not in banned_calls, f"{f}:{node.lineno} calls {name}"
                if isinstance(fn, ast.Attribute) and fn.attr == "load":
                    assert not (isinstance(fn.value, ast.Name) and fn.value.id in ("np", "numpy")), \
                        f"{f}:{node.lineno}: np.load"


def test_the_chat_template_is_data_never_code(dir_copy, no_sessions):
    """The Jinja text is only stored; the chat format is plain strings joined with str.replace,
    so template syntax and format fields in it or in messages come out literally."""
    evil = "{{ cycler.__init__.__globals__.os.popen('touch /tmp/pwned').read() }}"
    def edit(d):
        d["chat_template"] = evil
        d["chat_format"] = {"message": "<{role}>{content}{__class__}{0}</>",
                            "generation_prompt": "{% if x %}go{% endif %}", "prefix": "{{ 7*7 }}"}
    _edit_manifest(dir_copy, edit)
    m = mf.read_manifest(dir_copy)
    assert m.chat_template == evil
    text = m.chat_format.render([{"role": "user", "content": "{content} {role} {{ 1+1 }}"}])
    assert text == ("{{ 7*7 }}<user>{content} {role} {{ 1+1 }}{__class__}{0}</>"
                    "{% if x %}go{% endif %}")


# -- files that pass the checks but do not load (gaps) -------------------------------------------



def test_a_graph_onnxruntime_refuses_is_a_manifest_error(dir_copy):
    """Well-formed protobuf, right I/O, listed and checksummed, but an operator onnxruntime does
    not know."""
    model = onnx.load(str(dir_copy / "model.onnx"), load_external_data=False)
    model.graph.node.append(helper.make_node("NoSuchOp", [gio.INPUT_IDS], ["unused"]))
    (dir_copy / "model.onnx").write_bytes(model.SerializeToString())
    _relist(dir_copy, "model.onnx")
    with pytest.raises(ManifestError, match="model.onnx"):
        load_model(dir_copy)


def test_a_tokenizer_that_does_not_parse_is_a_manifest_error(dir_copy):
    (dir_copy / "tokenizer.json").write_text('{"not": a tokenizer}')
    _relist(dir_copy, "tokenizer.json")
    with pytest.raises(ManifestError, match="tokenizer.json"):
        load_model(dir_copy)
