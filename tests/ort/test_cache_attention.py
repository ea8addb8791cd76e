"""ortspec.CacheAttention (runtime/ort/attention_simd.h), the window graph's attention on
ortspec's kernels: what it computes against float64 attention, each output row bit for bit the
same whatever else the call holds, and bad positions turned into NaN rows the runtime refuses;
each with a float32 cache and with a float16 one (CacheAttention16, RotaryCacheAttention16)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from ortspec.runtime.ort import kernels
from ortspec.runtime.ort.sessions import open_session, session_options

pytestmark = pytest.mark.skipif(not kernels.available(),
                                reason="the kernel library is not built or this CPU lacks AVX2")

# (query heads, KV heads, head size, softcap, sliding window): SmolLM2-135M's grouping (9 / 3 of
# 64), one query head a KV head, head sizes off the 8- and 32-float paths, Gemma's softcap, and
# groups the kernel takes three queries at a time from with one or two left (4 and 5 of 32, 96)
SHAPES = [(9, 3, 64, 0.0, 0), (4, 4, 12, 0.0, 0), (8, 2, 16, 30.0, 5), (2, 1, 8, 0.0, 3),
          (4, 2, 128, 0.0, 0), (6, 3, 20, 0.0, 0), (8, 2, 32, 0.0, 0), (10, 2, 96, 0.0, 7)]


def _session(heads: int, scale: float, softcap: float, window: int, path, *, half: bool = False):
    attrs = {"num_heads": heads, "scale": scale}
    if softcap:
        attrs["softcap"] = softcap
    if window:
        attrs["local_window_size"] = window
    node = helper.make_node("CacheAttention16" if half else "CacheAttention",
                            ["q", "k", "v", "pos", "rows"], ["y"], domain="ortspec", **attrs)
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    c = TensorProto.FLOAT16 if half else f
    graph = helper.make_graph([node], "attention", [
        helper.make_tensor_value_info(name, kind, None)
        for name, kind in (("q", f), ("k", c), ("v", c), ("pos", i64), ("rows", i64))],
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


def _inputs(rng, heads, kv, hd, *, rows=3, s_len=4, cap=48, half=False):
    q = rng.standard_normal((rows, s_len, heads * hd)).astype(np.float32)
    # a pool larger than the call's rows, as the batch backend binds it; keys spread enough that
    # the softmax is far from uniform
    cache = np.float16 if half else np.float32
    k = (rng.standard_normal((rows + 2, kv, cap, hd)) * 2).astype(cache)
    v = rng.standard_normal((rows + 2, kv, cap, hd)).astype(cache)
    past = np.array([5, 0, cap - s_len][:rows])
    return q, k, v, past[:, None] + np.arange(s_len)


@pytest.mark.parametrize("half", [False, True], ids=["f32", "f16"])
@pytest.mark.parametrize("heads,kv,hd,softcap,window", SHAPES)
def test_the_op_is_attention_over_each_rows_own_slots(heads, kv, hd, softcap, window, half,
                                                      tmp_path):
    """Against float64 attention over the cache's values as stored (a float16 cache's widened
    exactly): the arithmetic after the load is float32 either way."""
    rng = np.random.default_rng(heads * 1000 + hd)
    q, k, v, pos = _inputs(rng, heads, kv, hd, half=half)
    rows = np.array([0, 1, 2, 3, 4, 9, 8, 10, 11], np.int64)  # row 1's first token left out
    scale = float(hd) ** -0.5
    sess = _session(heads, scale, softcap, window, tmp_path / "a.onnx", half=half)
    got = sess.run(None, {"q": q, "k": k, "v": v, "pos": pos, "rows": rows})[0]
    want = _reference(q, k, v, pos, rows, heads, scale, softcap, window)
    assert got.shape == want.shape and got.dtype == np.float32
    # float32 products and sums over at most 48 slots of values of order 1: a few ulp of the
    # largest terms, far under 1e-5
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("half", [False, True], ids=["f32", "f16"])
@pytest.mark.parametrize("heads,kv,hd,softcap,window", SHAPES[:4] + SHAPES[6:7])
def test_a_row_is_bitwise_the_same_whatever_the_call_holds(heads, kv, hd, softcap, window, half,
                                                           tmp_path):
    """A token's output alone, among all of a call's tokens, in a call of another width S and
    with other rows' contents changed: the same bits (what keeps batched decoding lossless)."""
    rng = np.random.default_rng(7)
    q, k, v, pos = _inputs(rng, heads, kv, hd, half=half)
    sess = _session(heads, float(hd) ** -0.5, softcap, window, tmp_path / "a.onnx", half=half)
    every = np.arange(q.shape[0] * q.shape[1], dtype=np.int64)
    full = sess.run(None, {"q": q, "k": k, "v": v, "pos": pos, "rows": every})[0]
    for flat in every:
        alone = sess.run(None, {"q": q, "k": k, "v": v, "pos": pos,
                                "rows": np.array([flat])})[0]
        assert np.array_equal(alone[0], full[flat])
    # row 0's last token as the only token of a one-token call, the other rows changed
    b, s = 0, q.shape[1] - 1
    k2, v2 = k.copy(), v.copy()
    k2[1:] = rng.standard_normal(k2[1:].shape).astype(k.dtype)
    v2[1:] = rng.standard_normal(v2[1:].shape).astype(v.dtype)
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


# -- ortspec.RotaryCacheAttention: the rotary and the cache writes inside the attention --------


def _rotary_session(heads: int, rotary_dim: int, window: int, path, *, half: bool = False):
    attrs = {"num_heads": heads, "scale": 0.125, "rotary_dim": rotary_dim}
    if window:
        attrs["local_window_size"] = window
    node = helper.make_node("RotaryCacheAttention16" if half else "RotaryCacheAttention",
                            ["qkv", "past_k", "past_v", "pos", "rows", "cos", "sin"],
                            ["y", "present_k", "present_v"], domain="ortspec", **attrs)
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    c = TensorProto.FLOAT16 if half else f
    graph = helper.make_graph([node], "rotary_attention", [
        helper.make_tensor_value_info(name, kind, None)
        for name, kind in (("qkv", f), ("past_k", c), ("past_v", c), ("pos", i64),
                           ("rows", i64), ("cos", f), ("sin", f))],
        [helper.make_tensor_value_info(name, kind, None)
         for name, kind in (("y", f), ("present_k", c), ("present_v", c))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid("ortspec", 1)])
    path.write_bytes(model.SerializeToString())
    return open_session(str(path), session_options(threads=2), ["CPUExecutionProvider"])


def _rotated(x, cos, sin, p, rd):  # x [..., hd] at position p: the first rd dims in halves
    half = rd // 2
    out = x.astype(np.float64).copy()
    x1, x2 = out[..., :half].copy(), out[..., half:rd].copy()
    out[..., :half] = x1 * cos[p] - x2 * sin[p]
    out[..., half:rd] = x2 * cos[p] + x1 * sin[p]
    return out


def _rotary_inputs(rng, heads, kv, hd, rd, *, rows=3, s_len=4, cap=48, half=False):
    q, k, v, pos = _inputs(rng, heads, kv, hd, rows=rows, s_len=s_len, cap=cap, half=half)
    qkv = rng.standard_normal((rows, s_len, (heads + 2 * kv) * hd)).astype(np.float32)
    angles = np.arange(cap)[:, None] * 10000.0 ** (-np.arange(rd // 2) / (rd // 2))
    return qkv, k, v, pos, np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


@pytest.mark.parametrize("half", [False, True], ids=["f32", "f16"])
@pytest.mark.parametrize("heads,kv,hd,rd,window", [(9, 3, 64, 64, 0), (4, 2, 16, 8, 5),
                                                   (2, 1, 12, 12, 0)])
def test_the_rotary_op_rotates_stores_and_attends(heads, kv, hd, rd, window, half, tmp_path):
    """Against float64: every position's key rotated and its value stored at its position of
    its own cache row (nothing else changed), and the named rows' rotated queries attending as
    CacheAttention does. A float16 cache stores each key and value rounded to nearest (the
    value exactly as NumPy rounds it; the key, rotated in float32, within half a float16 ulp
    of the exact rotation and a float32 error), and the attention reads what it stored."""
    rng = np.random.default_rng(heads + hd + rd)
    qkv, k, v, pos, cos, sin = _rotary_inputs(rng, heads, kv, hd, rd, half=half)
    rows = np.array([0, 2, 3, 5, 8, 11], np.int64)
    sess = _rotary_session(heads, rd, window, tmp_path / "r.onnx", half=half)
    y, k_out, v_out = sess.run(None, {"qkv": qkv, "past_k": k, "past_v": v, "pos": pos,
                                      "rows": rows, "cos": cos, "sin": sin})
    want_k, want_v = k.astype(np.float64), v.astype(np.float64)
    b_len, s_len = pos.shape
    q = np.zeros((b_len, s_len, heads * hd))
    for b in range(b_len):
        for s in range(s_len):
            p = int(pos[b, s])
            x = qkv[b, s].reshape(heads + 2 * kv, hd)
            q[b, s] = _rotated(x[:heads], cos, sin, p, rd).reshape(-1)
            want_k[b, :, p] = _rotated(x[heads:heads + kv], cos, sin, p, rd)
            want_v[b, :, p] = x[heads + kv:]
    assert k_out.dtype == k.dtype and v_out.dtype == v.dtype
    written = np.zeros(k.shape, bool)
    for b in range(b_len):
        written[b, :, pos[b]] = True
    assert np.array_equal(k_out[~written], k[~written])  # nothing else changed
    np.testing.assert_allclose(k_out, want_k, rtol=2.0 ** -11 if half else 0, atol=1e-5)
    assert np.array_equal(v_out, want_v.astype(v.dtype))
    # the attention over the cache as written (float16 widened exactly)
    want = _reference(q, k_out.astype(np.float64), v_out.astype(np.float64), pos, rows, heads,
                      0.125, 0.0, window)
    np.testing.assert_allclose(y, want, rtol=0, atol=1e-5)


def test_the_rotary_op_takes_one_row_of_tokens_flat(tmp_path):
    """qkv [S, width] (a graph on flat rows, no reshape) is one row of S tokens: the same bits
    as [1, S, width]; positions still [1, S]."""
    rng = np.random.default_rng(3)
    heads, kv, hd, rd = 9, 3, 64, 64
    qkv, k, v, pos, cos, sin = _rotary_inputs(rng, heads, kv, hd, rd, rows=1, s_len=5)
    rows = np.arange(5, dtype=np.int64)
    sess = _rotary_session(heads, rd, 0, tmp_path / "r.onnx")
    feeds = {"past_k": k, "past_v": v, "pos": pos, "rows": rows, "cos": cos, "sin": sin}
    grid = sess.run(None, {"qkv": qkv, **feeds})
    flat = sess.run(None, {"qkv": qkv[0], **feeds})
    for a, b in zip(grid, flat, strict=True):
        np.testing.assert_array_equal(a, b)
    assert not np.isnan(flat[0]).any()
    bad = sess.run(None, {"qkv": qkv[0, :4], **feeds})[0]  # 4 tokens, positions for 5
    assert np.isnan(bad).all()


@pytest.mark.parametrize("half", [False, True], ids=["f32", "f16"])
def test_the_rotary_op_writes_in_place_and_a_row_is_the_same_in_every_call(half, tmp_path):
    """Past and present bound to one buffer (as the runtime binds them): the new keys and
    values land in it, the rest untouched, and the outputs equal an unbound run's; a token's
    output alone equals its output among the call's tokens, bit for bit."""
    import onnxruntime as ort

    rng = np.random.default_rng(11)
    heads, kv, hd = 9, 3, 64
    qkv, k, v, pos, cos, sin = _rotary_inputs(rng, heads, kv, hd, hd, half=half)
    sess = _rotary_session(heads, hd, 0, tmp_path / "r.onnx", half=half)
    every = np.arange(pos.size, dtype=np.int64)
    feeds = {"qkv": qkv, "past_k": k, "past_v": v, "pos": pos, "cos": cos, "sin": sin}
    y, k_out, v_out = sess.run(None, {**feeds, "rows": every})
    cache_k, cache_v = (ort.OrtValue.ortvalue_from_numpy(x.copy()) for x in (k, v))
    binding = sess.io_binding()
    for name, x in {**feeds, "rows": every}.items():
        if name not in ("past_k", "past_v"):
            binding.bind_cpu_input(name, x)
    binding.bind_ortvalue_input("past_k", cache_k)
    binding.bind_ortvalue_input("past_v", cache_v)
    binding.bind_output("y")
    binding.bind_ortvalue_output("present_k", cache_k)
    binding.bind_ortvalue_output("present_v", cache_v)
    sess.run_with_iobinding(binding)
    assert np.array_equal(binding.copy_outputs_to_cpu()[0], y)
    assert np.array_equal(cache_k.numpy(), k_out) and np.array_equal(cache_v.numpy(), v_out)
    for flat in every:
        alone = sess.run(None, {**feeds, "rows": np.array([flat])})[0]
        assert np.array_equal(alone[0], y[flat])


@pytest.mark.parametrize("half", [False, True], ids=["f32", "f16"])
def test_the_rotary_op_refuses_positions_out_of_range_and_writes_nothing(half, tmp_path):
    rng = np.random.default_rng(5)
    qkv, k, v, pos, cos, sin = _rotary_inputs(rng, 9, 3, 64, 64, half=half)
    sess = _rotary_session(9, 64, 0, tmp_path / "r.onnx", half=half)
    bad = pos.copy()
    bad[2, 3] = k.shape[2]  # one past the capacity
    y, k_out, v_out = sess.run(None, {"qkv": qkv, "past_k": k, "past_v": v, "pos": bad,
                                      "rows": np.array([0, 4], np.int64), "cos": cos,
                                      "sin": sin})
    assert np.isnan(y).all() and np.array_equal(k_out, k) and np.array_equal(v_out, v)
