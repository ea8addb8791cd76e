"""ortspec.CacheAttention (runtime/ort/attention_simd.h), the window graph's attention on
ortspec's kernels: what it computes against float64 attention, each output row bit for bit the
same whatever else the call holds, and bad positions turned into NaN rows the runtime refuses."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from ortspec.runtime.ort import kernels
from ortspec.runtime.ort.sessions import open_session, session_options

pytestmark = pytest.mark.skipif(not kernels.available(),
                                reason="the kernel library is not built or this CPU lacks AVX2")

# (query heads, KV heads, head size, softcap, sliding window): SmolLM2-135M's grouping (9 / 3 of
# 64), one query head a KV head, head sizes off the 8- and 64-float paths, Gemma's softcap
SHAPES = [(9, 3, 64, 0.0, 0), (4, 4, 12, 0.0, 0), (8, 2, 16, 30.0, 5), (2, 1, 8, 0.0, 3),
          (4, 2, 128, 0.0, 0), (6, 3, 20, 0.0, 0)]


def _session(heads: int, scale: float, softcap: float, window: int, path):
    attrs = {"num_heads": heads, "scale": scale}
    if softcap:
        attrs["softcap"] = softcap
    if window:
        attrs["local_window_size"] = window
    node = helper.make_node("CacheAttention", ["q", "k", "v", "pos", "rows"], ["y"],
                            domain="ortspec", **attrs)
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    graph = helper.make_graph([node], "attention", [
        helper.make_tensor_value_info(name, kind, None)
        for name, kind in (("q", f), ("k", f), ("v", f), ("pos", i64), ("rows", i64))],
        [helper.make_tensor_value_info("y", f, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid("ortspec", 1)])
    path.write_bytes(model.SerializeToString())
    return open_session(str(path), session_options(threads=2), ["CPUExecutionProvider"])


def _reference(q, k, v, pos, rows, heads, scale, softcap, window) -> np.ndarray:
    """float64 attention of the named rows, query s of row b seeing slots up to pos[b, s] (and
    no further back than the window)."""
    _, s_len, width = q.shape
    kv, _, hd = k.shape[1:]
    group = heads // kv
    out = np.zeros((len(rows), width))
    for i, flat in enumerate(rows):
        b, s = divmod(int(flat), s_len)
        p = int(pos[b, s])
        lo = max(0, p - window + 1) if window else 0
        for h in range(heads):
            keys = k[b, h // group, lo:p + 1].astype(np.float64)
            values = v[b, h // group, lo:p + 1].astype(np.float64)
            score = keys @ q[b, s, h * hd:(h + 1) * hd].astype(np.float64) * scale
            if softcap:
                score = softcap * np.tanh(score / softcap)
            e = np.exp(score - score.max())
            out[i, h * hd:(h + 1) * hd] = e @ values / e.sum()
    return out


def _inputs(rng, heads, kv, hd, *, rows=3, s_len=4, cap=48):
    q = rng.standard_normal((rows, s_len, heads * hd)).astype(np.float32)
    # a pool larger than the call's rows, as the batch backend binds it; keys spread enough that
    # the softmax is far from uniform
    k = (rng.standard_normal((rows + 2, kv, cap, hd)) * 2).astype(np.float32)
    v = rng.standard_normal((rows + 2, kv, cap, hd)).astype(np.float32)
    past = np.array([5, 0, cap - s_len][:rows])
    return q, k, v, past[:, None] + np.arange(s_len)


@pytest.mark.parametrize("heads,kv,hd,softcap,window", SHAPES)
def test_the_op_is_attention_over_each_rows_own_slots(heads, kv, hd, softcap, window, tmp_path):
    rng = np.random.default_rng(heads * 1000 + hd)
    q, k, v, pos = _inputs(rng, heads, kv, hd)
    rows = np.array([0, 1, 2, 3, 4, 9, 8, 10, 11], np.int64)  # row 1's first token left out
    scale = float(hd) ** -0.5
    sess = _session(heads, scale, softcap, window, tmp_path / "a.onnx")
    got = sess.run(None, {"q": q, "k": k, "v": v, "pos": pos, "rows": rows})[0]
    want = _reference(q, k, v, pos, rows, heads, scale, softcap, window)
    assert got.shape == want.shape and got.dtype == np.float32
    # float32 products and sums over at most 48 slots of values of order 1: a few ulp of the
    # largest terms, far under 1e-5
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("heads,kv,hd,softcap,window", SHAPES[:4])
def test_a_row_is_bitwise_the_same_whatever_the_call_holds(heads, kv, hd, softcap, window,
                                                           tmp_path):
    """A token's output alone, among all of a call's tokens, in a call of another width S and
    with other rows' contents changed: the same bits (what keeps batched decoding lossless)."""
    rng = np.random.default_rng(7)
    q, k, v, pos = _inputs(rng, heads, kv, hd)
    sess = _session(heads, float(hd) ** -0.5, softcap, window, tmp_path / "a.onnx")
    every = np.arange(q.shape[0] * q.shape[1], dtype=np.int64)
    full = sess.run(None, {"q": q, "k": k, "v": v, "pos": pos, "rows": every})[0]
    for flat in every:
        alone = sess.run(None, {"q": q, "k": k, "v": v, "pos": pos,
                                "rows": np.array([flat])})[0]
        assert np.array_equal(alone[0], full[flat])
    # row 0's last token as the only token of a one-token call, the other rows changed
    b, s = 0, q.shape[1] - 1
    k2, v2 = k.copy(), v.copy()
    k2[1:], v2[1:] = rng.standard_normal(k2[1:].shape), rng.standard_normal(v2[1:].shape)
    k2[b, :, pos[b, s] + 1:] = 99.0  # slots past the query's position are never read
    one = sess.run(None, {"q": q[:, s:s + 1].copy(), "k": k2, "v": v2,
                          "pos": pos[:, s:s + 1].copy(), "rows": np.array([b], np.int64)})[0]
    assert np.array_equal(one[0], full[b * q.shape[1] + s])


def test_positions_rows_or_shapes_out_of_range_give_nan_rows(tmp_path):
    rng = np.random.default_rng(3)
    q, k, v, pos = _inputs(rng, 9, 3, 64)
    sess = _session(9, 0.125, 0.0, 0, tmp_path / "a.onnx")
    bad = pos.copy()
    bad[1, 0] = k.shape[2]  # one past the capacity
    got = sess.run(None, {"q": q, "k": k, "v": v, "pos": bad,
                          "rows": np.array([0, 4, 99], np.int64)})[0]
    assert np.isfinite(got[0]).all() and np.isnan(got[1]).all() and np.isnan(got[2]).all()
    # a query width that is not the heads times the cache's head size: every row NaN
    got = sess.run(None, {"q": q[..., :500].copy(), "k": k, "v": v, "pos": pos,
                          "rows": np.array([0, 1], np.int64)})[0]
    assert got.shape == (2, 500) and np.isnan(got).all()
