"""`ortspec export SOURCE --draft-head PATH` (export/eagle3_export.py, eagle3_graph.py) on a tiny
random Llama of 8 layers and tiny random EAGLE-3 heads in both published formats, with and
without a reduced draft vocabulary and with and without the head's own embedding: the
exported head, run by the runtime's `OrtDraftHead`, against the PyTorch reference forward per
entry, for a first call from the target's own hidden states, for steps fed by the head's own
hidden output, and for a truncate and re-feed; adding a head to an existing export; and each
refusal, naming its key, before any work."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ortspec.export import ExportOptionError, export_model
from ortspec.export.eagle3 import EAGLE, SPECULATORS, read_eagle3_head
from ortspec.export.eagle3_export import HEAD_DIR, add_draft_head, validate_head
from ortspec.export.eagle3_reference import embed, head_forward, project_aux
from ortspec.export.tiny import VOCAB, make_tiny_llama, tiny_eagle3_weights, write_eagle3_head
from ortspec.runtime.errors import ExportError
from ortspec.runtime.ort import head_config as hc
from ortspec.runtime.ort import manifest as mf
from ortspec.runtime.ort.decoder import OrtDecoder
from ortspec.runtime.ort.head import open_draft_head

pytestmark = pytest.mark.slow  # builds and exports torch checkpoints

CAP, VERIFY, LAYERS, HIDDEN, DRAFT_VOCAB = 64, 4, 8, 64, 100
LAYER_IDS = [2, 4, 5]
PROMPT = [5, 77, 301, 12, 190, 45, 9, 260, 33, 101]  # [10]
# float32 graph against float32 PyTorch (the export's own check is 1e-4 + 2e-4 of the scale;
# measured ~5e-5 on these heads)
ATOL = 2e-4


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("src") / "tiny-llama8", seed=4,
                           num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def target_embed(src):
    from safetensors.torch import load_file

    return load_file(src / "model.safetensors")["model.embed_tokens.weight"].numpy()


def _head(tmp_path, fmt=SPECULATORS, *, draft_vocab=None, own_embedding=False, seed=3, **kw):
    weights = tiny_eagle3_weights(draft_vocab=draft_vocab, own_embedding=own_embedding,
                                  seed=seed)
    return write_eagle3_head(tmp_path / f"head-{fmt}", weights, fmt=fmt,
                             layer_ids=kw.get("layer_ids", LAYER_IDS))


def _check_against_reference(out, head_src, target_embed):
    """The exported head on the target's real hidden states, entry by entry, against the
    reference forward: a first call, three own-hidden steps, then truncate and re-feed."""
    head = read_eagle3_head(head_src)
    target = OrtDecoder(out)
    target.forward_batch(PROMPT)
    aux = target.last_hidden_states()  # [10, 3 * H]: the states after each prompt token
    # entry j: token PROMPT[j + 1] with the target's state after PROMPT[j]
    tokens, states = PROMPT[1:], aux[:-1]  # [9], [9, 3H]
    ort_head = open_draft_head(out / HEAD_DIR)
    assert ort_head.layer_ids == tuple(LAYER_IDS)
    np.testing.assert_array_equal(ort_head.target_ids, head.target_ids())
    logits, hidden = ort_head.forward(tokens, states, from_target=True)
    with torch.no_grad():
        ref = head_forward(head, project_aux(head, states), embed(head, tokens, target_embed),
                           np.arange(len(tokens)))
    np.testing.assert_allclose(logits, ref.logits.numpy(), atol=ATOL, rtol=0)
    np.testing.assert_allclose(hidden, ref.hidden.numpy(), atol=ATOL, rtol=0)
    assert logits.shape == (len(tokens), head.draft_vocab_size)
    kv, state, fed = ref.kv, ref.hidden[-1:], []
    for k in range(3):  # a chain: the draft's argmax, mapped to a target id, goes next
        token = int(head.target_ids()[int(np.argmax(logits[-1]))])
        step = head_forward(head, state, embed(head, [token], target_embed),
                            [len(tokens) + k], kv)
        fed.append((token, state.numpy()[0].copy(), step.logits.numpy()[0]))
        logits, hidden = ort_head.forward([token], state.numpy(), from_target=False)
        np.testing.assert_allclose(logits[0], step.logits.numpy()[0], atol=ATOL, rtol=0)
        np.testing.assert_allclose(hidden[0], step.hidden.numpy()[0], atol=ATOL, rtol=0)
        kv, state = step.kv, step.hidden
        logits = logits.copy()
    assert ort_head.length == len(tokens) + 3
    ort_head.truncate(len(tokens))
    again, _ = ort_head.forward([t for t, _, _ in fed], np.stack([s for _, s, _ in fed]),
                                from_target=False)
    np.testing.assert_allclose(again, np.stack([r for *_, r in fed]), atol=ATOL, rtol=0)


@pytest.mark.parametrize("fmt", [SPECULATORS, EAGLE])
@pytest.mark.parametrize("draft_vocab", [None, DRAFT_VOCAB])
@pytest.mark.parametrize("own_embedding", [False, True])
def test_exported_head_matches_the_reference(tmp_path, src, target_embed, fmt, draft_vocab,
                                             own_embedding):
    head_src = _head(tmp_path, fmt, draft_vocab=draft_vocab, own_embedding=own_embedding)
    out = export_model(src, out=tmp_path / "out", capacity=CAP, max_verify_len=VERIFY,
                       progress=False, draft_head=head_src)
    m = mf.read_manifest(out)
    assert m.draft_head == HEAD_DIR and m.hidden_state_layers == tuple(LAYER_IDS)
    config = hc.read_head_config(out / HEAD_DIR)
    assert (config.draft_vocab_size, config.vocab_size, config.capacity) == \
        (draft_vocab or VOCAB, VOCAB, CAP)
    assert config.extra["source_format"] == fmt
    assert config.extra["validation"]["max_logit_deviation"] < ATOL
    _check_against_reference(out, head_src, target_embed)


def test_a_head_is_added_to_an_existing_export(tmp_path, src, target_embed):
    out = export_model(src, out=tmp_path / "out", capacity=CAP, max_verify_len=VERIFY,
                       progress=False, hidden_states=LAYER_IDS)
    assert mf.read_manifest(out).draft_head is None
    head_src = _head(tmp_path, EAGLE, draft_vocab=DRAFT_VOCAB)
    dest = add_draft_head(out, head_src, source=src)
    assert dest == out / HEAD_DIR and mf.read_manifest(out).draft_head == HEAD_DIR
    _check_against_reference(out, head_src, target_embed)
    with pytest.raises(ExportError, match="already exists"):
        add_draft_head(out, head_src, source=src)
    # through export_model(draft_only=True) with overwrite, as `--draft-only --draft-head` does
    export_model(src, out=out, draft_only=True, draft_head=head_src, overwrite=True,
                 progress=False)
    assert mf.read_manifest(out).draft_head == HEAD_DIR


def test_adding_a_head_to_an_export_without_its_states_is_refused(tmp_path, src):
    out = export_model(src, out=tmp_path / "out", capacity=CAP, max_verify_len=VERIFY,
                       progress=False, hidden_states=[1, 3, 6])
    with pytest.raises(ExportError, match=r"eagle_aux_hidden_state_layer_ids \[2, 4, 5\]"):
        add_draft_head(out, _head(tmp_path), source=src)
    assert not (out / HEAD_DIR).exists() and mf.read_manifest(out).draft_head is None


def _narrow_head(tmp_path):  # hidden 32 against the target's 64
    weights = tiny_eagle3_weights(hidden=32, heads=4, kv_heads=2, intermediate=64, seed=2)
    return write_eagle3_head(tmp_path / "narrow", weights, fmt=EAGLE, layer_ids=LAYER_IDS)


def _far_layers_head(tmp_path):  # layer 8 of an 8-layer target
    head_src = _head(tmp_path)
    path = head_src / "config.json"
    config = json.loads(path.read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [2, 4, 8]
    path.write_text(json.dumps(config))
    return head_src


@pytest.mark.parametrize("make, key", [
    (_narrow_head, "hidden_size is 32 but the target's hidden size is 64"),
    (_far_layers_head, r"eagle_aux_hidden_state_layer_ids \[2, 4, 8\]"),
])
def test_a_misfit_head_is_refused_before_any_work_naming_the_key(tmp_path, src, make, key):
    out = tmp_path / "out"
    with pytest.raises(ExportError, match=key):
        export_model(src, out=out, capacity=CAP, max_verify_len=VERIFY, progress=False,
                     draft_head=make(tmp_path))
    assert not out.exists()


def test_a_head_over_another_vocabulary_is_refused_naming_d2t(tmp_path, src):
    # a head trained over a larger vocabulary whose draft ids map past the target's
    weights = tiny_eagle3_weights(draft_vocab=DRAFT_VOCAB, vocab=VOCAB + 40, seed=1)
    assert int((torch.arange(DRAFT_VOCAB) + weights["d2t"]).max()) >= VOCAB
    head_src = write_eagle3_head(tmp_path / "wide", weights, fmt=SPECULATORS,
                                 layer_ids=LAYER_IDS)
    with pytest.raises(ExportError, match="d2t"):
        export_model(src, out=tmp_path / "out", capacity=CAP, max_verify_len=VERIFY,
                     progress=False, draft_head=head_src)


def test_hidden_states_that_differ_from_the_heads_are_refused(tmp_path, src):
    with pytest.raises(ExportOptionError, match="draft head's layer ids"):
        export_model(src, out=tmp_path / "out", capacity=CAP, max_verify_len=VERIFY,
                     progress=False, draft_head=_head(tmp_path), hidden_states=[1, 2, 3])


def test_validation_catches_a_graph_that_is_not_the_reference(tmp_path, src, target_embed):
    head_src = _head(tmp_path, draft_vocab=DRAFT_VOCAB)
    out = export_model(src, out=tmp_path / "out", capacity=CAP, max_verify_len=VERIFY,
                       progress=False, draft_head=head_src)
    head = read_eagle3_head(head_src)
    other = read_eagle3_head(_head(tmp_path / "other", seed=9, draft_vocab=DRAFT_VOCAB))
    validate_head(out / HEAD_DIR, head, target_embed=target_embed)  # passes on its own head
    with pytest.raises(ExportError, match="differ from the PyTorch reference at entry 0"):
        validate_head(out / HEAD_DIR, other, target_embed=target_embed)


@pytest.mark.parametrize("attention", ["gqa", "window"])
def test_an_int4_target_takes_a_head(tmp_path, src, target_embed, attention):
    # the int4 graph's own states feed the head; the head itself is float32 as ever
    head_src = _head(tmp_path, SPECULATORS, draft_vocab=DRAFT_VOCAB)
    out = export_model(src, out=tmp_path / "out", capacity=CAP, max_verify_len=VERIFY,
                       quant="int4", attention=attention, progress=False, draft_head=head_src)
    m = mf.read_manifest(out)
    assert m.draft_head == HEAD_DIR and m.hidden_state_layers == tuple(LAYER_IDS)
    assert m.extra["weights"]["format"] == "MatMulNBits"
    assert "hidden_state_validation" in m.extra
    _check_against_reference(out, head_src, target_embed)


def test_the_command_line(tmp_path, src, capsys):
    from ortspec.export.cli import main

    head_src = _head(tmp_path, EAGLE, own_embedding=True)
    out = tmp_path / "out"
    assert main([str(src), "--out", str(out), "--capacity", str(CAP), "--max-verify-len",
                 str(VERIFY), "--draft-head", str(head_src), "--quiet"]) == 0
    assert capsys.readouterr().out.split() == [str(out), str(out / HEAD_DIR)]
    assert mf.read_manifest(out).draft_head == HEAD_DIR
    # a misfit head: one line, status 2, nothing written
    assert main([str(src), "--out", str(tmp_path / "bad"), "--draft-head",
                 str(_narrow_head(tmp_path)), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "hidden_size is 32" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "bad").exists()
    # onto the existing export, replacing its head
    assert main([str(src), "--out", str(out), "--draft-only", "--draft-head", str(head_src),
                 "--overwrite", "--quiet"]) == 0
    assert capsys.readouterr().out.split() == [str(out / HEAD_DIR)]


@pytest.mark.parametrize("own_embedding", [False, True])
def test_an_int8_head_matches_its_dequantized_reference(tmp_path, src, target_embed,
                                                        own_embedding):
    from ortspec.export.eagle3_export import (HEAD_QUANT_TOLERANCE, dequantized_embedding,
                                              dequantized_head)
    from ortspec.export.graph_spec import HEAD_QUANTS

    head_src = _head(tmp_path, EAGLE, draft_vocab=DRAFT_VOCAB, own_embedding=own_embedding)
    out = export_model(src, out=tmp_path / "out", capacity=CAP, max_verify_len=VERIFY,
                       progress=False, draft_head=head_src, draft_head_quant="int8")
    config = hc.read_head_config(out / HEAD_DIR)
    assert config.extra["weights"]["format"] == "MatMulNBits"
    assert config.extra["weights"]["bits"] == 8
    head = read_eagle3_head(head_src)
    reference = dequantized_head(head, HEAD_QUANTS["int8"])
    assert not np.array_equal(reference.lm_head, head.lm_head)  # it was rounded
    table = dequantized_embedding(target_embed, HEAD_QUANTS["int8"])  # the 8-bit table's rows
    assert not np.array_equal(table, target_embed)
    ort_head = open_draft_head(out / HEAD_DIR)
    aux = np.random.default_rng(5).standard_normal((6, 3 * HIDDEN)).astype(np.float32)
    tokens = PROMPT[:6]
    logits, _ = ort_head.forward(tokens, aux, from_target=True)
    with torch.no_grad():
        want = head_forward(reference, project_aux(reference, aux),
                            embed(reference, tokens, table), np.arange(6)).logits.numpy()
    bound = HEAD_QUANT_TOLERANCE.at(float(np.abs(want).max()))
    assert np.abs(logits - want).max() <= bound
    # the int8 rounding of the activations is the gap: well under the bound's share
    assert np.abs(logits - want).max() > 1e-4


def test_draft_head_quant_is_checked_before_any_work(tmp_path, src):
    with pytest.raises(ExportOptionError, match="draft_head_quant must be one of int8"):
        export_model(src, out=tmp_path / "out", progress=False, draft_head=_head(tmp_path),
                     draft_head_quant="int4")
    with pytest.raises(ExportOptionError, match="applies to a draft_head"):
        export_model(src, out=tmp_path / "out", progress=False, draft_head_quant="int8")
    assert not (tmp_path / "out").exists()
