"""OrtDecoder and the manifest's `hidden_state_layers`: the field refused when malformed, a
model without hidden states untouched (nothing allocated or bound, a clear error when asked),
and one with them read back per call. The values themselves are checked against transformers
in tests/export/test_export_hidden_states.py."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from helpers.export import write_graph_dir

from ortspec.runtime.decoding.protocols import HiddenStateSource
from ortspec.runtime.errors import InvalidOptionError, ManifestError
from ortspec.runtime.ort import manifest as mf
from ortspec.runtime.ort.decoder import OrtDecoder

TOKENS = [5, 77, 301, 12, 190, 45, 9]  # [7]
CAP, VERIFY = 64, 4


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory):
    """A model without hidden states (1 layer, hand-built graph, no torch)."""
    return write_graph_dir(tmp_path_factory.mktemp("plain") / "model")


@pytest.fixture()
def manifest_data(plain_dir):
    """plain_dir's manifest.json as a dict, its architecture made 8 layers deep."""
    data = json.loads((plain_dir / mf.MANIFEST_FILE).read_text())
    data["architecture"]["num_layers"] = 8
    return data


def test_a_well_formed_field_parses(manifest_data):
    assert mf.parse_manifest(manifest_data).hidden_state_layers is None  # absent: none
    manifest_data["hidden_state_layers"] = [2, 4, 5]
    m = mf.parse_manifest(manifest_data)
    assert m.hidden_state_layers == (2, 4, 5)
    assert m.hidden_state_width == 3 * m.architecture.hidden_size
    # written back as it was read; and a manifest without the field writes none
    assert json.loads(m.to_json())["hidden_state_layers"] == [2, 4, 5]
    del manifest_data["hidden_state_layers"]
    assert "hidden_state_layers" not in json.loads(mf.parse_manifest(manifest_data).to_json())


@pytest.mark.parametrize("value, match", [
    ("2,4,5", "a list of"),  # a string, not a list
    ([], "a list of 1..8"),
    (list(range(1, 10)), "a list of 1..8"),  # nine ids
    ([0, 4, 5], r"not a layer id in 1\.\.7"),  # 0 would be the embeddings
    ([2, 4, 8], r"not a layer id in 1\.\.7"),  # past the last layer
    ([2, -1, 5], r"not a layer id"),
    ([2, 4.0, 5], r"not a layer id"),
    ([True, 4, 5], r"not a layer id"),
    ([2, 4, 4], "repeat"),
    ({"low": 2}, "a list of"),
])
def test_a_malformed_field_is_refused(manifest_data, value, match):
    manifest_data["hidden_state_layers"] = value
    with pytest.raises(ManifestError, match=match):
        mf.parse_manifest(manifest_data)


def test_a_model_without_hidden_states_allocates_and_binds_nothing_for_them(plain_dir):
    decoder = OrtDecoder(plain_dir)
    assert decoder.hidden_state_layers is None
    decoder.forward_batch(TOKENS)
    decoder.forward_token(3)
    assert decoder._hidden is None and decoder._hidden_values == {}
    bindings = [b for per_session in decoder._bindings.values() for b in per_session]
    assert all(b._bound_hidden is None for b in bindings)
    with pytest.raises(InvalidOptionError, match="without hidden states"):
        decoder.last_hidden_states()



@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A tiny 6-layer Llama exported with hidden states [1, 3, 5], without, and as the window
    (batched) flavour with [2, 4]."""
    from ortspec.export import export_model
    from ortspec.export.tiny import make_tiny_llama

    src = make_tiny_llama(tmp_path_factory.mktemp("src") / "tiny", seed=5, num_hidden_layers=6)
    out = tmp_path_factory.mktemp("out")
    common = dict(capacity=CAP, max_verify_len=VERIFY, progress=False)
    return (export_model(src, out=out / "hs", hidden_states=[1, 3, 5], **common),
            export_model(src, out=out / "plain", **common),
            export_model(src, out=out / "window", hidden_states=[2, 4], attention="window",
                         **common))


@pytest.mark.slow  # exports torch checkpoints
def test_rows_shapes_copies_and_reset(dirs):
    decoder: HiddenStateSource = OrtDecoder(dirs[0])
    assert decoder.hidden_state_layers == (1, 3, 5)
    with pytest.raises(InvalidOptionError, match="no hidden states yet"):
        decoder.last_hidden_states()
    decoder.forward_batch(TOKENS)
    rows = decoder.last_hidden_states()
    assert rows.shape == (len(TOKENS), 3 * 64) and rows.dtype == np.float32
    rows[:] = 0  # a copy: the decoder's buffer is untouched
    assert np.abs(decoder.last_hidden_states()).max() > 0
    decoder.forward_token(3)
    assert decoder.last_hidden_states().shape == (1, 3 * 64)
    decoder.reset()
    with pytest.raises(InvalidOptionError, match="no hidden states yet"):
        decoder.last_hidden_states()


@pytest.mark.slow  # exports torch checkpoints
def test_logits_are_those_of_the_export_without_the_option(dirs):
    with_hs, plain = OrtDecoder(dirs[0]), OrtDecoder(dirs[1])
    np.testing.assert_array_equal(with_hs.forward_batch(TOKENS), plain.forward_batch(TOKENS))
    np.testing.assert_array_equal(with_hs.forward_token(3), plain.forward_token(3))


@pytest.mark.slow  # exports torch checkpoints
def test_the_hidden_states_output_is_required_by_the_manifest(dirs, tmp_path):
    copy = shutil.copytree(dirs[1], tmp_path / "plain")  # a graph without the output
    data = json.loads((copy / mf.MANIFEST_FILE).read_text())
    data["hidden_state_layers"] = [1, 3, 5]
    (copy / mf.MANIFEST_FILE).write_text(json.dumps(data))
    with pytest.raises(ManifestError, match="hidden_states"):
        mf.read_manifest(copy)


@pytest.mark.slow  # exports torch checkpoints
def test_the_batch_backend_runs_a_window_export_with_hidden_states(dirs):
    """The batched path binds logits only: the extra output stays unbound and the rows'
    logits are the solo decoder's, bitwise."""
    from ortspec.runtime.batching.backend import OrtBatchBackend
    from ortspec.runtime.ort.sessions import OrtSessions

    sessions = OrtSessions(dirs[2], providers=["CPUExecutionProvider"])
    assert sessions.manifest.hidden_state_layers == (2, 4)
    backend = OrtBatchBackend(sessions, max_rows=2)
    got = backend.run(0, 2, np.array([TOKENS, TOKENS]), np.array([0, 0]))  # [2 * n, vocab]
    expected = OrtDecoder.on(sessions).forward_batch(TOKENS)  # [n, vocab]
    np.testing.assert_array_equal(got.reshape(2, len(TOKENS), -1)[1], expected)
