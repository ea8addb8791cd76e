"""`OrtDraftHead` (runtime/ort/head.py) on a head built straight from random NumPy weights
(tests/helpers/export.py, no torch): shapes, the KV cache's bookkeeping (a call in pieces equals
one call; truncate and re-feed equals the first time; reset), capacity and truncate bounds,
input checks, and a head directory that is not what head.json says."""

from __future__ import annotations

import json

import numpy as np
import pytest

from helpers.export import write_head_dir
from ortspec.export.tiny import VOCAB
from ortspec.runtime.errors import (CapacityError, InvalidOptionError, InvalidPromptError,
                                    ManifestError)
from ortspec.runtime.ort import head_config as hc
from ortspec.runtime.ort.head import OrtDraftHead, open_draft_head

CAP, H, VD = 16, 32, 40
TOKENS = [5, 77, 301, 12, 190, 45]  # [6]
# float32 rows computed in one call or in several: the MatMuls' row blocking only
ATOL = 1e-5


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    return write_head_dir(tmp_path_factory.mktemp("head") / "eagle3", capacity=CAP,
                          draft_vocab=VD)


@pytest.fixture()
def head(head_dir):
    return open_draft_head(head_dir, threads=1)


def _aux(n, seed=0):
    return np.random.default_rng(seed).standard_normal((n, 3 * H)).astype(np.float32)


def test_shapes_and_sizes(head):
    assert isinstance(head, OrtDraftHead)
    assert (head.draft_vocab_size, head.capacity, head.hidden_size, head.aux_width) == \
        (VD, CAP, H, 3 * H)
    assert head.target_ids.shape == (VD,) and head.target_ids.dtype == np.int64
    assert np.unique(head.target_ids).size == VD and head.target_ids.max() < VOCAB
    assert head.layer_ids == (2, 4, 5) and head.length == 0
    logits, hidden = head.forward(TOKENS, _aux(6), from_target=True)
    assert logits.shape == (6, VD) and logits.dtype == np.float32
    assert hidden.shape == (6, H) and hidden.dtype == np.float32
    assert head.length == 6
    logits, hidden = head.forward([7], hidden[-1:].copy(), from_target=False)
    assert logits.shape == (1, VD) and hidden.shape == (1, H) and head.length == 7
    assert np.isfinite(logits).all()


def test_entries_in_pieces_equal_one_call_and_see_their_past(head):
    aux = _aux(6, seed=1)
    whole = head.forward(TOKENS, aux, from_target=True)[0].copy()
    head.reset()
    assert head.length == 0
    first = head.forward(TOKENS[:4], aux[:4], from_target=True)[0].copy()
    rest = head.forward(TOKENS[4:], aux[4:], from_target=True)[0].copy()
    np.testing.assert_allclose(np.concatenate([first, rest]), whole, atol=ATOL, rtol=0)
    head.reset()  # the last entry alone, without its past, is another distribution
    alone = head.forward(TOKENS[5:], aux[5:], from_target=True)[0]
    assert np.abs(alone[0] - whole[5]).max() > 1e-2


def test_truncate_then_refeed_gives_the_same(head):
    aux = _aux(6, seed=2)
    _, hidden = head.forward(TOKENS[:3], aux[:3], from_target=True)
    state = hidden[-1:].copy()
    drafted = []
    for token in (9, 260, 33):  # a chain fed by the head's own hidden output
        logits, hidden = head.forward([token], state, from_target=False)
        drafted.append((logits[0].copy(), state[0].copy()))
        state = hidden.copy()
    head.truncate(3)
    assert head.length == 3
    again, _ = head.forward([9, 260, 33], np.stack([s for _, s in drafted]), from_target=False)
    np.testing.assert_allclose(again, np.stack([l for l, _ in drafted]), atol=ATOL, rtol=0)
    head.truncate(3)  # and one at a time, as the first time
    for token, (logits, s) in zip((9, 260, 33), drafted):
        np.testing.assert_allclose(head.forward([token], s[None], from_target=False)[0][0],
                                   logits, atol=ATOL, rtol=0)


def test_capacity_is_enforced(head):
    head.forward(list(range(CAP - 2)), _aux(CAP - 2), from_target=True)
    with pytest.raises(CapacityError, match="capacity of 16"):
        head.forward([1, 2, 3], _aux(3), from_target=True)
    assert head.length == CAP - 2  # unchanged by the refusal
    head.forward([1, 2], _aux(2), from_target=True)
    assert head.length == CAP
    head.truncate(4)
    head.forward(list(range(CAP - 4)), _aux(CAP - 4), from_target=True)  # a call over old rows


def test_truncate_bounds(head):
    head.forward(TOKENS, _aux(6), from_target=True)
    for bad in (7, -1, 2.0, None):
        with pytest.raises(InvalidOptionError):
            head.truncate(bad)
    head.truncate(6)
    head.truncate(0)
    assert head.length == 0


def test_inputs_are_checked(head):
    with pytest.raises(InvalidOptionError, match=r"hidden must be \[2, 96\]"):
        head.forward([1, 2], np.zeros((2, H), np.float32), from_target=True)
    with pytest.raises(InvalidOptionError, match=r"hidden must be \[2, 32\]"):
        head.forward([1, 2], _aux(2), from_target=False)
    with pytest.raises(InvalidPromptError):
        head.forward([VOCAB], _aux(1), from_target=True)
    with pytest.raises(InvalidPromptError):
        head.forward([], np.zeros((0, 3 * H), np.float32), from_target=True)
    with pytest.raises(InvalidOptionError, match="from_target"):
        head.forward([1], _aux(1), from_target=1)
    assert head.length == 0


def test_a_changed_file_or_head_json_is_refused(tmp_path):
    d = write_head_dir(tmp_path / "h", capacity=CAP)
    config = json.loads((d / hc.HEAD_FILE).read_text())
    ids = np.load(d / hc.TARGET_IDS_FILE)
    np.save(d / hc.TARGET_IDS_FILE, ids[::-1].copy())
    with pytest.raises(ManifestError, match="target_ids.npy.*sha256"):
        open_draft_head(d)
    np.save(d / hc.TARGET_IDS_FILE, ids)
    open_draft_head(d)
    for change, message in (({"capacity": 0}, "capacity must be a positive integer"),
                            ({"kind": "medusa"}, "kind must be one of eagle3"),
                            ({"graphs": {"fc": "../x.onnx", "head": "head.onnx"}},
                             "files has no sha256")):
        (d / hc.HEAD_FILE).write_text(json.dumps({**config, **change}))
        with pytest.raises(ManifestError, match=message):
            open_draft_head(d)
    (d / hc.HEAD_FILE).unlink()
    with pytest.raises(ManifestError, match="has no head.json"):
        open_draft_head(d)


def test_the_returned_hidden_view_can_be_fed_straight_back(head_dir):
    # a drafter passes hidden_out[-1:] back as is: a view of the buffer the call writes
    a, b = open_draft_head(head_dir, threads=1), open_draft_head(head_dir, threads=1)
    aux = _aux(3, seed=4)
    ha = a.forward(TOKENS[:3], aux, from_target=True)[1]
    hb = b.forward(TOKENS[:3], aux, from_target=True)[1]
    for token in (9, 260, 33):
        la, ha = a.forward([token], ha[-1:], from_target=False)
        lb, hb = b.forward([token], hb[-1:].copy(), from_target=False)
        np.testing.assert_array_equal(la, lb)
        np.testing.assert_array_equal(ha, hb)


def test_heads_on_shared_sessions_keep_their_own_caches(head):
    other = OrtDraftHead.on(head.sessions)
    assert other.sessions is head.sessions and other.length == 0
    aux = _aux(6, seed=5)
    first = head.forward(TOKENS, aux, from_target=True)[0][-1].copy()
    other.forward(TOKENS[:2], aux[:2], from_target=True)  # its own KV: the first head's unmoved
    head.truncate(5)
    np.testing.assert_allclose(head.forward(TOKENS[5:], aux[5:], from_target=True)[0][0], first,
                               atol=ATOL, rtol=0)
    assert (head.length, other.length) == (6, 2)


def test_target_ids_must_be_an_int64_vector(tmp_path):
    import hashlib

    d = write_head_dir(tmp_path / "h", capacity=CAP)
    config = json.loads((d / hc.HEAD_FILE).read_text())
    for bad, message in ((np.arange(VD, dtype=np.int32), "not a 1-D int64"),
                         (np.zeros((VD, 1), np.int64), "not a 1-D int64"),
                         (np.zeros(VD, np.int64), "distinct"),
                         (np.arange(VD - 1, dtype=np.int64), r"expected int64 \[40\]")):
        np.save(d / hc.TARGET_IDS_FILE, bad)
        digest = hashlib.sha256((d / hc.TARGET_IDS_FILE).read_bytes()).hexdigest()
        files = {**config["files"], hc.TARGET_IDS_FILE: digest}
        (d / hc.HEAD_FILE).write_text(json.dumps({**config, "files": files}))
        with pytest.raises(ManifestError, match=message):
            open_draft_head(d)


def test_it_has_every_member_the_protocol_declares(head):
    import inspect

    from ortspec.runtime.decoding.protocols import DraftHead

    declared = {n for n in vars(DraftHead) if not n.startswith("_")} | \
        set(DraftHead.__annotations__)
    assert declared >= {"draft_vocab_size", "target_ids", "capacity", "length", "reset",
                        "truncate", "forward"}
    for name in declared:
        assert hasattr(head, name), name
    mine = inspect.signature(OrtDraftHead.forward).parameters
    theirs = inspect.signature(DraftHead.forward).parameters
    assert list(mine) == list(theirs)
    assert mine["from_target"].kind is inspect.Parameter.KEYWORD_ONLY
