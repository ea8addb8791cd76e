"""EAGLE-3 head checkpoints (export/eagle3.py) and their PyTorch reference forward
(export/eagle3_reference.py), on tiny random heads written in both published formats: the two
formats read to one normalised head, the forward's shapes and its KV cache, the d2t mapping
worked by hand, and each refusal by the key it names."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from ortspec.export.eagle3 import EAGLE, SPECULATORS, Eagle3Target, check_fits, read_eagle3_head
from ortspec.export.eagle3_reference import (HeadKV, embed, head_forward, project_aux, rms_norm,
                                             to_target_logits)
from ortspec.export.tiny import VOCAB, tiny_eagle3_weights, write_eagle3_head
from ortspec.runtime.errors import ExportError

pytestmark = pytest.mark.slow  # builds torch checkpoints

HIDDEN, DRAFT_VOCAB, LAYERS = 64, 100, 8
TARGET = Eagle3Target(hidden_size=HIDDEN, vocab_size=VOCAB, num_layers=LAYERS)
IDS = [5, 77, 301, 12, 190, 45]  # [6] target token ids


def _head_dir(tmp_path, fmt=SPECULATORS, name="head", **kw):
    layer_ids = kw.pop("layer_ids", [2, 4, 5])
    return write_eagle3_head(tmp_path / f"{name}-{fmt}", tiny_eagle3_weights(**kw), fmt=fmt,
                             layer_ids=layer_ids)


@pytest.mark.parametrize("draft_vocab", [None, DRAFT_VOCAB])
@pytest.mark.parametrize("own_embedding", [False, True])
def test_both_formats_read_to_the_same_head(tmp_path, draft_vocab, own_embedding):
    weights = tiny_eagle3_weights(draft_vocab=draft_vocab, own_embedding=own_embedding, seed=3)
    heads = {fmt: read_eagle3_head(write_eagle3_head(tmp_path / fmt, weights, fmt=fmt,
                                                     layer_ids=[2, 4, 5]), target=TARGET)
             for fmt in (SPECULATORS, EAGLE)}
    assert heads[SPECULATORS].source_format == SPECULATORS and heads[EAGLE].source_format == EAGLE
    for field in dataclasses.fields(heads[SPECULATORS]):
        a, b = getattr(heads[SPECULATORS], field.name), getattr(heads[EAGLE], field.name)
        if field.name == "source_format":
            continue
        if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
            np.testing.assert_array_equal(a, b, err_msg=field.name)
        else:
            assert a == b, field.name
    head = heads[EAGLE]
    assert (head.hidden_size, head.num_heads, head.num_kv_heads, head.head_dim) == (64, 4, 2, 16)
    assert (head.intermediate_size, head.rms_norm_eps, head.rope_theta) == (128, 1e-5, 1e4)
    assert head.layer_ids == (2, 4, 5) and head.vocab_size == VOCAB
    assert head.draft_vocab_size == (draft_vocab or VOCAB)
    assert (head.d2t is None) == (draft_vocab is None)
    assert head.has_own_embedding == own_embedding
    # the weights are the checkpoint's, under their new names
    np.testing.assert_array_equal(head.q, weights["layers.0.self_attn.q_proj.weight"].numpy())
    np.testing.assert_array_equal(head.hidden_norm, weights["layers.0.hidden_norm.weight"].numpy())


def test_d2t_offsets_give_the_target_ids_t2d_marks(tmp_path):
    # target_id = draft_id + d2t[draft_id]: d2t = kept - arange, so the ids are the kept ones
    weights = tiny_eagle3_weights(draft_vocab=DRAFT_VOCAB, seed=5)
    head = read_eagle3_head(write_eagle3_head(tmp_path / "h", weights, fmt=SPECULATORS))
    kept = np.flatnonzero(weights["t2d"].numpy())
    np.testing.assert_array_equal(head.target_ids(), kept)
    assert head.target_ids()[0] == 0 + head.d2t[0]
    # not the identity: a reader that ignored d2t would give arange(100)
    assert not np.array_equal(head.target_ids(), np.arange(DRAFT_VOCAB))


def test_a_head_without_layer_ids_reads_the_default_layers(tmp_path):
    head = read_eagle3_head(_head_dir(tmp_path, layer_ids=None), target=TARGET)
    assert head.layer_ids is None
    assert head.layers_for(LAYERS) == (2, 4, 5)  # (2, L // 2, L - 3)


def _first_step(head, n=len(IDS), seed=0):
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(n, 3 * HIDDEN, generator=g) * 2.0  # [n, 3H] the target's three states
    target_embed = np.random.default_rng(seed).normal(size=(VOCAB, HIDDEN)).astype(np.float32)
    return aux, embed(head, IDS[:n], target_embed), target_embed


@pytest.mark.parametrize("own_embedding", [False, True])
def test_reference_forward_shapes_and_kv(tmp_path, own_embedding):
    head = read_eagle3_head(_head_dir(tmp_path, draft_vocab=DRAFT_VOCAB,
                                      own_embedding=own_embedding))
    aux, embeds, target_embed = _first_step(head)
    n = len(IDS)
    step = head_forward(head, project_aux(head, aux), embeds, np.arange(n))
    assert step.logits.shape == (n, DRAFT_VOCAB) and step.hidden.shape == (n, HIDDEN)
    assert step.kv.keys.shape == (2, n, 16) and step.kv.length == n
    # a later step: the head's own last hidden state and the drafted token's embedding
    token = int(head.target_ids()[step.logits[-1].argmax()])
    nxt = head_forward(head, step.hidden[-1:], embed(head, [token], target_embed), [n], step.kv)
    assert nxt.logits.shape == (1, DRAFT_VOCAB) and nxt.kv.length == n + 1
    assert torch.isfinite(nxt.logits).all()


def test_without_own_embedding_the_target_table_is_required(tmp_path):
    head = read_eagle3_head(_head_dir(tmp_path))
    with pytest.raises(ValueError, match="target's embedding table"):
        embed(head, IDS)


def test_positions_one_at_a_time_through_the_kv_equal_one_call(tmp_path):
    head = read_eagle3_head(_head_dir(tmp_path, seed=7))
    aux, embeds, _ = _first_step(head, seed=1)
    hidden = project_aux(head, aux)
    whole = head_forward(head, hidden, embeds, np.arange(len(IDS)))
    kv, rows = HeadKV.empty(head), []
    for i in range(len(IDS)):
        step = head_forward(head, hidden[i:i + 1], embeds[i:i + 1], [i], kv)
        kv = step.kv
        rows.append(step.logits)
    torch.testing.assert_close(torch.cat(rows), whole.logits, atol=1e-4, rtol=1e-5)
    # the last row must depend on the earlier ones: without the past it differs
    alone = head_forward(head, hidden[-1:], embeds[-1:], [len(IDS) - 1])
    assert not torch.allclose(alone.logits, whole.logits[-1:], atol=1e-3)


def test_the_returned_hidden_state_is_the_one_before_the_final_norm(tmp_path):
    # vLLM samples from norm(prenorm) and feeds prenorm back; logits = lm_head(norm(hidden))
    head = read_eagle3_head(_head_dir(tmp_path, seed=2))
    aux, embeds, _ = _first_step(head)
    step = head_forward(head, project_aux(head, aux), embeds, np.arange(len(IDS)))
    again = rms_norm(step.hidden, head.norm, head.rms_norm_eps) @ torch.from_numpy(head.lm_head).T
    torch.testing.assert_close(again, step.logits)
    assert not torch.allclose(step.hidden.pow(2).mean(-1), torch.ones(len(IDS)), atol=0.1)


def test_norm_before_residual_is_read_and_moves_the_residual(tmp_path):
    # vLLM's option: residual = hidden_norm(hidden) instead of the raw hidden state
    d = _head_dir(tmp_path, seed=6)
    plain = read_eagle3_head(d)
    _edit_config(d, norm_before_residual=True)
    moved = read_eagle3_head(d)
    assert not plain.norm_before_residual and moved.norm_before_residual
    aux, embeds, _ = _first_step(plain)
    hidden = project_aux(plain, aux) * 3.0  # far from unit RMS, so the two residuals differ
    a = head_forward(plain, hidden, embeds, np.arange(len(IDS)))
    b = head_forward(moved, hidden, embeds, np.arange(len(IDS)))
    assert not torch.allclose(a.hidden, b.hidden, atol=1e-2)


def test_the_mapped_argmax_is_the_argmax_of_the_full_vocabulary_scatter(tmp_path):
    head = read_eagle3_head(_head_dir(tmp_path, draft_vocab=DRAFT_VOCAB, seed=4))
    aux, embeds, _ = _first_step(head)
    step = head_forward(head, project_aux(head, aux), embeds, np.arange(len(IDS)))
    full = to_target_logits(head, step.logits, VOCAB)  # [n, VOCAB]
    assert full.shape == (len(IDS), VOCAB)
    ids = torch.from_numpy(head.target_ids())
    torch.testing.assert_close(full[:, ids], step.logits)
    unmapped = torch.ones(VOCAB, dtype=torch.bool)
    unmapped[ids] = False
    assert torch.isneginf(full[:, unmapped]).all()
    np.testing.assert_array_equal(head.target_ids()[step.logits.argmax(-1).numpy()],
                                  full.argmax(-1).numpy())


def test_a_hand_worked_d2t(tmp_path):
    # draft ids 0, 1, 2 -> target ids 0 + 3, 1 + 5, 2 + 7 = 3, 6, 9; logits 1, 4, 2 -> draft 1
    weights = tiny_eagle3_weights(draft_vocab=3, seed=0)
    weights["d2t"] = torch.tensor([3, 5, 7])
    weights["t2d"] = torch.zeros(VOCAB, dtype=torch.bool)
    weights["t2d"][[3, 6, 9]] = True
    head = read_eagle3_head(write_eagle3_head(tmp_path / "h", weights, fmt=EAGLE), target=TARGET)
    full = to_target_logits(head, torch.tensor([[1.0, 4.0, 2.0]]), VOCAB)
    assert full[0, [3, 6, 9]].tolist() == [1.0, 4.0, 2.0]
    assert int(full.argmax()) == 6  # not 1, the draft id itself


# ---- refusals, each naming its key ----

def _edit_config(directory, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def _edit_tensors(directory, drop=(), **replace):
    path = directory / "model.safetensors"
    tensors = {k: v for k, v in load_file(path).items() if k not in drop}
    tensors.update(replace)
    save_file(tensors, path)


def test_refuses_a_target_of_another_hidden_size(tmp_path):
    d = _head_dir(tmp_path)
    with pytest.raises(ExportError, match="hidden_size is 64 but the target's hidden size is 32"):
        read_eagle3_head(d, target=dataclasses.replace(TARGET, hidden_size=32))
    with pytest.raises(ExportError, match="hidden_size"):
        check_fits(read_eagle3_head(d), dataclasses.replace(TARGET, hidden_size=32))


def test_refuses_a_target_vocabulary_too_small_for_d2t(tmp_path):
    d = _head_dir(tmp_path, draft_vocab=DRAFT_VOCAB)
    top = int(read_eagle3_head(d).target_ids().max())
    small = dataclasses.replace(TARGET, vocab_size=top)  # the largest mapped id is one past it
    with pytest.raises(ExportError, match=f"d2t maps a draft id to target id {top}"):
        read_eagle3_head(d, target=small)
    with pytest.raises(ExportError, match="d2t"):
        check_fits(read_eagle3_head(d), small)
    read_eagle3_head(d, target=dataclasses.replace(TARGET, vocab_size=top + 1))  # fits


def test_refuses_layer_ids_outside_the_target(tmp_path):
    with pytest.raises(ExportError, match=r"eagle_aux_hidden_state_layer_ids \[2, 4, 8\]"):
        read_eagle3_head(_head_dir(tmp_path, fmt=EAGLE, layer_ids=[2, 4, 8]), target=TARGET)
    # without ids, the default (2, L // 2, L - 3) of a 4-layer target repeats 2
    with pytest.raises(ExportError, match="default layer ids"):
        read_eagle3_head(_head_dir(tmp_path, layer_ids=None),
                         target=dataclasses.replace(TARGET, num_layers=4))


@pytest.mark.parametrize("fmt, key", [(SPECULATORS, "layers.0.mlp.down_proj.weight"),
                                      (EAGLE, "midlayer.hidden_norm.weight"),
                                      (EAGLE, "fc.weight"), (SPECULATORS, "d2t")])
def test_refuses_a_missing_tensor(tmp_path, fmt, key):
    d = _head_dir(tmp_path, fmt=fmt, draft_vocab=DRAFT_VOCAB)
    _edit_tensors(d, drop=[key])
    with pytest.raises(ExportError, match=rf"missing tensor\(s\) \['{key}'\]"):
        read_eagle3_head(d)


def test_refuses_a_tensor_of_the_wrong_shape(tmp_path):
    d = _head_dir(tmp_path, fmt=EAGLE)
    _edit_tensors(d, **{"midlayer.self_attn.k_proj.weight": torch.zeros(32, 64)})  # 2H is 128
    with pytest.raises(ExportError, match=r"midlayer.self_attn.k_proj.weight has shape \[32, 64\]"):
        read_eagle3_head(d)


def test_refuses_t2d_that_disagrees_with_d2t(tmp_path):
    d = _head_dir(tmp_path, draft_vocab=DRAFT_VOCAB)
    _edit_tensors(d, t2d=torch.ones(VOCAB, dtype=torch.bool))
    with pytest.raises(ExportError, match="t2d marks 320 target ids"):
        read_eagle3_head(d)


def test_refuses_an_own_embedding_smaller_than_the_target_vocabulary(tmp_path):
    d = _head_dir(tmp_path, own_embedding=True)
    with pytest.raises(ExportError, match="embed_tokens.weight has 320 rows"):
        read_eagle3_head(d, target=dataclasses.replace(TARGET, vocab_size=VOCAB + 1))


def test_refuses_what_is_not_an_eagle3_head(tmp_path):
    d = _head_dir(tmp_path, fmt=EAGLE)
    _edit_config(d, architectures=["LlamaForCausalLM"])
    with pytest.raises(ExportError, match="speculators_model_type"):
        read_eagle3_head(d)
    _edit_config(d, speculators_model_type="eagle")
    with pytest.raises(ExportError, match="only 'eagle3'"):
        read_eagle3_head(d)
    with pytest.raises(ExportError, match="no config.json"):
        read_eagle3_head(tmp_path / "nowhere")
