"""ortspec.Q4Gemm (runtime/ort/_q4kernel.c), the package's kernel for Q4_1 weights: what it
computes against a NumPy model of its arithmetic, every row of a call bit for bit the row called
alone on both instruction sets, through onnxruntime at every input rank, and its packed layout's
round trip (export/quantize.py). ortspec.Q4GemmSwiGlu, the gated MLP's gate and up products in
one node: silu(gate) * up of the product's halves, in float64 to float32 rounding, over the
whole range of the sigmoid, rows alike at every call size and through onnxruntime."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from ortspec.export import ExportOptionError, export_model
from ortspec.export.api import resolve_kernel
from ortspec.export.quantize import quantize_q4gemm
from ortspec.runtime.ort import kernels
from ortspec.runtime.ort.sessions import open_session, session_options

pytestmark = pytest.mark.skipif(not kernels.available(),
                                reason="the kernel library is not built or this CPU lacks AVX2")

ISAS = [i for i in (3, 2, 1) if i <= kernels.isa()]  # AMX, AVX-512 VNNI where present, and AVX2


@pytest.fixture(scope="module")
def lib():
    lib = ctypes.CDLL(kernels.library_path())
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.ortspec_q4_gemm.argtypes = [p, i64, i64, i64, p, p, p, p]
    lib.ortspec_q4_swiglu.argtypes = [p, i64, i64, i64, p, p, p, p]
    lib.ortspec_q4_force_isa.argtypes = [ctypes.c_int]
    yield lib
    lib.ortspec_q4_force_isa(-1)


def _gemm(lib, x: np.ndarray, w) -> np.ndarray:
    x = np.ascontiguousarray(x, np.float32)
    rows, k = x.shape
    n = w.packed.shape[0] * 16
    y = np.full((rows, n), np.nan, np.float32)
    assert lib.ortspec_q4_gemm(x.ctypes.data, rows, k, n, w.packed.ctypes.data, w.d.ctypes.data,
                               w.m.ctypes.data, y.ctypes.data) == 0
    return y


def _q4_1_weight(rng, n: int, k: int) -> np.ndarray:
    """w [n, k] as a Q4_1 GGUF holds it: d * q + m per block of 32, d and m float16, each
    block's min at q = 0 and max at q = 15."""
    q = rng.integers(0, 16, (n, k // 32, 32))
    q[..., 0], q[..., 1] = 0, 15
    d = (rng.random((n, k // 32)) * 0.02 + 1e-3).astype(np.float16).astype(np.float32)
    m = (rng.random((n, k // 32)) * -0.2).astype(np.float16).astype(np.float32)
    return (d[..., None] * q + m[..., None]).reshape(n, k).astype(np.float32)


def _activations(rng, rows: int, k: int) -> np.ndarray:
    x = rng.standard_normal((rows, k)) * np.exp(rng.standard_normal((rows, 1)))
    x[0, :32] = 0.0  # an all-zero block (scale 0)
    return x.astype(np.float32)


def _reference(x: np.ndarray, w: np.ndarray, m: np.ndarray | None = None,
               d: np.ndarray | None = None) -> np.ndarray:
    """The op's arithmetic in float64: x rounded to int8 per row and block of 32 (scale
    max|x| / 127, to nearest even), times the dequantized weight; with the blocks' minima m
    and steps d [n, k / 32], the weight is split as the op splits it: d * (q - z) with z the integer
    nearest -m / d in 0..15 meets the int8 activations, the offset m + z * d the exact block
    sums."""
    rows, k = x.shape
    blocks = x.reshape(rows, k // 32, 32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.rint(blocks * inv)
    assert np.abs(q).max() <= 127
    xq = (q * (amax.astype(np.float64) / 127)).reshape(rows, k)
    if m is None:
        return xq @ w.T.astype(np.float64)
    m, d = m.astype(np.float64), d.astype(np.float64)
    z = np.clip(np.rint(np.divide(-m, d, out=np.zeros_like(m), where=d != 0)), 0, 15)
    offset = m + z * d
    centred = w.astype(np.float64) - np.repeat(offset, 32, axis=1)  # d * (q - z)
    return xq @ centred.T + blocks.astype(np.float64).sum(-1) @ offset.T


def test_the_packed_layout_round_trips_a_q4_1_weight_exactly():
    w = _q4_1_weight(np.random.default_rng(0), 64, 128)
    qw = quantize_q4gemm(w)
    assert (qw.packed.shape, qw.d.shape, qw.m.shape) == ((4, 4, 4, 64), (4, 4, 16), (4, 4, 16))
    assert qw.d.dtype == qw.m.dtype == np.float16
    np.testing.assert_array_equal(qw.dequantize(), w)
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_q4gemm(w[:40])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("k", [32, 576, 1536])
def test_the_product_is_the_int8_rounded_activations_times_the_weight(lib, isa, k):
    """Against float64: the only error left is float32 accumulation over K / 32 blocks."""
    rng = np.random.default_rng(k)
    w = _q4_1_weight(rng, 48, k)
    x = _activations(rng, 9, k)
    lib.ortspec_q4_force_isa(isa)
    qw = quantize_q4gemm(w)
    y = _gemm(lib, x, qw)
    def by_output(a):  # [tiles, blocks, 16] -> [n, blocks]
        return a.astype(np.float32).transpose(0, 2, 1).reshape(48, k // 32)

    ref = _reference(x, w, by_output(qw.m), by_output(qw.d))
    scale = np.abs(x).max(1, keepdims=True) * np.abs(w).sum(1)[None]  # bounds the sum of |terms|
    assert np.all(np.abs(y - ref) <= 4 * (k // 32 + 2) * np.finfo(np.float32).eps * scale)
    assert np.all(y[0] == y[0])  # the zero block gave no NaN


@pytest.mark.parametrize("isa", ISAS)
def test_every_row_of_a_call_is_bitwise_the_row_called_alone(lib, isa):
    """What lets a step and a verify row agree bit for bit (greedy identity): at every row
    count, across the 8-row (AVX-512) and 4-row (AVX2) tiles, each row is the lone row's."""
    rng = np.random.default_rng(1)
    qw = quantize_q4gemm(_q4_1_weight(rng, 64, 576))
    x = _activations(rng, 19, 576)
    lib.ortspec_q4_force_isa(isa)
    alone = np.stack([_gemm(lib, v[None], qw)[0] for v in x])
    for rows in range(1, 20):
        np.testing.assert_array_equal(_gemm(lib, x[:rows], qw), alone[:rows], err_msg=f"{rows}")


@pytest.mark.skipif(3 not in ISAS, reason="this CPU (or its kernel) gives no AMX tiles")
@pytest.mark.parametrize("k", [96, 576])
def test_a_call_on_amx_tiles_is_each_row_alone_on_avx512(lib, q8lib, k):
    """Calls of AMX_MIN_ROWS (32) rows or more multiply on AMX tiles, 16 rows a group: every row
    of such a call, in full and partial groups and over blocks in chunks of 8 with an odd last
    pair (k = 96: 3 blocks; 576: 18), is bit for bit the lone row on AVX-512, 4-bit and 8-bit."""
    rng = np.random.default_rng(5)
    qw = quantize_q4gemm(_q4_1_weight(rng, 48, k))
    b, scales, _ = _q8_weight(rng, 48, k)
    x = _activations(rng, 50, k)
    lib.ortspec_q4_force_isa(2)
    alone = np.stack([_gemm(lib, v[None], qw)[0] for v in x])
    alone8 = np.stack([_q8(q8lib, v[None], b, scales)[0] for v in x])
    lib.ortspec_q4_force_isa(3)
    for rows in (32, 33, 47, 50):
        np.testing.assert_array_equal(_gemm(lib, x[:rows], qw), alone[:rows], err_msg=f"{rows}")
        np.testing.assert_array_equal(_q8(q8lib, x[:rows], b, scales), alone8[:rows],
                                      err_msg=f"{rows}")


@pytest.mark.parametrize("isa", ISAS)
def test_a_call_of_more_rows_than_a_slab_is_its_rows_alone(lib, q8lib, isa):
    """AVX2 products take a long prompt's rows in slabs of AVX2_SLAB_ROWS (256), bounding their
    broadcast activations: a call past a slab (and not a multiple of it) is still each row's
    lone result, for 4-bit and 8-bit weights."""
    rng = np.random.default_rng(4)
    qw = quantize_q4gemm(_q4_1_weight(rng, 32, 64))
    b, scales, _ = _q8_weight(rng, 32, 64)
    x = _activations(rng, 600, 64)
    lib.ortspec_q4_force_isa(isa)
    np.testing.assert_array_equal(_gemm(lib, x, qw),
                                  np.stack([_gemm(lib, v[None], qw)[0] for v in x]))
    np.testing.assert_array_equal(_q8(q8lib, x, b, scales),
                                  np.stack([_q8(q8lib, v[None], b, scales)[0] for v in x]))


def _swiglu(lib, x: np.ndarray, w) -> np.ndarray:
    x = np.ascontiguousarray(x, np.float32)
    rows, k = x.shape
    n = w.packed.shape[0] * 16
    y = np.full((rows, n // 2), np.nan, np.float32)
    assert lib.ortspec_q4_swiglu(x.ctypes.data, rows, k, n, w.packed.ctypes.data,
                                 w.d.ctypes.data, w.m.ctypes.data, y.ctypes.data) == 0
    return y


@pytest.mark.parametrize("isa", ISAS)
def test_swiglu_is_silu_of_the_gate_times_the_up_half_of_the_product(lib, isa):
    """Against float64 silu(g) * u of the op's own product (Q4Gemm's, tested above): gate values
    from -100 to 100 (where exp(-|g|) underflows, sigmoid is 0 or 1) and every row count."""
    rng = np.random.default_rng(7)
    k, n = 576, 2 * 256
    qw = quantize_q4gemm(_q4_1_weight(rng, n, k))
    x = _activations(rng, 19, k)
    x[1] *= 400  # gates far beyond exp's range
    lib.ortspec_q4_force_isa(isa)
    product = _gemm(lib, x, qw).astype(np.float64)
    gate, up = product[:, :n // 2], product[:, n // 2:]
    assert gate.min() < -90 and gate.max() > 90
    e = np.exp(-np.abs(gate))
    sigmoid = np.where(gate >= 0, 1 / (1 + e), e / (1 + e))
    want = gate * sigmoid * up
    got = _swiglu(lib, x, qw)
    assert np.all(np.isfinite(got))
    # exp's relative error ~2e-7, then a division and two products rounded to float32
    tol = 8 * np.finfo(np.float32).eps * np.abs(gate * up) + np.finfo(np.float32).tiny
    assert np.all(np.abs(got - want) <= tol)
    alone = np.stack([_swiglu(lib, v[None], qw)[0] for v in x])
    for rows in range(1, 20):
        np.testing.assert_array_equal(_swiglu(lib, x[:rows], qw), alone[:rows], err_msg=f"{rows}")


def _session(qw, k: int, n: int, rank: int, path, *, op: str = "Q4Gemm"):
    dims = ["B", "S", "T"][:rank - 1] + [k]
    node = helper.make_node(op, ["x", "q", "d", "m"], ["y"], domain=kernels.DOMAIN, K=k, N=n)
    width = n // 2 if op == "Q4GemmSwiGlu" else n
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, dims[:-1] + [width])],
        [numpy_helper.from_array(qw.packed, "q"), numpy_helper.from_array(qw.d, "d"),
         numpy_helper.from_array(qw.m, "m")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid(kernels.DOMAIN, 1)])
    model.ir_version = 10
    path.write_bytes(model.SerializeToString())
    return open_session(str(path), session_options(threads=2), ["CPUExecutionProvider"])


@pytest.mark.parametrize("rank", [2, 3, 4])
def test_onnxruntime_runs_the_op_at_any_rank_on_its_thread_pool(lib, rank, tmp_path):
    """Through a session (the rows split among onnxruntime's threads by output tiles): the
    same numbers as the direct call, for inputs [.., K] of any rank, an empty one included."""
    rng = np.random.default_rng(rank)
    k, n = 576, 1024  # 64 tiles: several chunks a thread
    w = _q4_1_weight(rng, n, k)
    qw = quantize_q4gemm(w)
    session = _session(qw, k, n, rank, tmp_path / "q4gemm.onnx")
    lead = [2, 3, 2][:rank - 1]
    x = _activations(rng, int(np.prod(lead)), k)
    lib.ortspec_q4_force_isa(-1)
    y = session.run(None, {"x": x.reshape(*lead, k)})[0]
    assert y.shape == (*lead, n)
    np.testing.assert_array_equal(y.reshape(-1, n), _gemm(lib, x, qw))
    empty = session.run(None, {"x": np.zeros((*lead[:-1], 0, k), np.float32)})[0]
    assert empty.shape == (*lead[:-1], 0, n)


@pytest.mark.parametrize("rank", [2, 3])
def test_onnxruntime_runs_the_swiglu_op_on_its_thread_pool(lib, rank, tmp_path):
    rng = np.random.default_rng(10 + rank)
    k, n = 576, 2 * 1536  # the default model's gate and up
    qw = quantize_q4gemm(_q4_1_weight(rng, n, k))
    session = _session(qw, k, n, rank, tmp_path / "swiglu.onnx", op="Q4GemmSwiGlu")
    lead = [3, 5][:rank - 1]
    x = _activations(rng, int(np.prod(lead)), k)
    lib.ortspec_q4_force_isa(-1)
    y = session.run(None, {"x": x.reshape(*lead, k)})[0]
    assert y.shape == (*lead, n // 2)
    np.testing.assert_array_equal(y.reshape(-1, n // 2), _swiglu(lib, x, qw))


def _norm_session(qw, gamma: np.ndarray, k: int, n: int, op: str, eps: float, path):
    """Q4GemmNorm / Q4GemmSwiGluNorm(x, q, d, m, skip, gamma) -> y, sum in a session."""
    node = helper.make_node(op, ["x", "q", "d", "m", "skip", "gamma"], ["y", "sum"],
                            domain=kernels.DOMAIN, K=k, N=n, epsilon=eps)
    width = n // 2 if op == "Q4GemmSwiGluNorm" else n
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["S", k])
                      for name in ("x", "skip")],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["S", width]),
         helper.make_tensor_value_info("sum", TensorProto.FLOAT, ["S", k])],
        [numpy_helper.from_array(qw.packed, "q"), numpy_helper.from_array(qw.d, "d"),
         numpy_helper.from_array(qw.m, "m"), numpy_helper.from_array(gamma, "gamma")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid(kernels.DOMAIN, 1)])
    model.ir_version = 10
    path.write_bytes(model.SerializeToString())
    return open_session(str(path), session_options(threads=2), ["CPUExecutionProvider"])


@pytest.mark.parametrize("op", ["Q4GemmNorm", "Q4GemmSwiGluNorm"])
def test_the_norm_ops_multiply_the_rms_normalized_sum(lib, op, tmp_path):
    """sum = x + skip exactly, and y = the op's product of sum / sqrt(mean(sum^2) + eps) * gamma.
    The sums are chosen so that every step of the norm is exact in float32 (each row's squares
    average to a power of 4, eps 0, gamma of a few bits): then y must be the product (tested
    above) of the normalized rows bit for bit. Each row is the lone row's, whatever the call
    holds."""
    rng = np.random.default_rng(7)
    k, n, rows = 576, 2 * 256, 6
    qw = quantize_q4gemm(_q4_1_weight(rng, n, k))
    gamma = (rng.integers(-64, 65, k) / 16).astype(np.float32)
    total = (rng.choice([-1.0, 1.0], (rows, k)) * 2.0 ** np.arange(-2, rows - 2)[:, None])
    skip = (rng.integers(-40, 41, (rows, k)) / 8).astype(np.float32)
    x = (total - skip).astype(np.float32)  # x + skip == total exactly
    normalized = (total / np.sqrt((total ** 2).mean(1, keepdims=True)) * gamma).astype(np.float32)
    session = _norm_session(qw, gamma, k, n, op, 0.0, tmp_path / "norm.onnx")
    lib.ortspec_q4_force_isa(-1)
    y, out = session.run(None, {"x": x, "skip": skip})
    np.testing.assert_array_equal(out, x + skip)
    product = _swiglu if op == "Q4GemmSwiGluNorm" else _gemm
    np.testing.assert_array_equal(y, product(lib, normalized, qw))
    for r in range(rows):
        alone = session.run(None, {"x": x[r:r + 1], "skip": skip[r:r + 1]})
        np.testing.assert_array_equal(alone[0][0], y[r])
    # random rows, gamma and a large eps (so that dropping it would show): against the float64
    # norm. The op's float32 norm is within 1e-6 of it (relative), which may move an activation
    # across an int8 rounding boundary: each term is then off by at most its block's step
    # (max|block| / 127) times |w|, the bound below
    x, skip = _activations(rng, rows, k), _activations(rng, rows, k)
    eps, gamma = 0.5, rng.uniform(0.5, 2.0, k).astype(np.float32)
    session = _norm_session(qw, gamma, k, n, "Q4GemmNorm", eps, tmp_path / "norm2.onnx")
    y, out = session.run(None, {"x": x, "skip": skip})
    np.testing.assert_array_equal(out, x + skip)
    t = (x + skip).astype(np.float64)
    h = t / np.sqrt((t ** 2).mean(1, keepdims=True) + eps) * gamma  # [rows, k]
    w = qw.dequantize().astype(np.float64)  # [n, k]
    ref = _reference(h.astype(np.float32), qw.dequantize(), *(
        a.astype(np.float32).transpose(0, 2, 1).reshape(n, k // 32) for a in (qw.m, qw.d)))
    step = np.repeat(np.abs(h).reshape(rows, k // 32, 32).max(-1) / 127, 32, axis=1)
    assert np.all(np.abs(y - ref) <= (1e-6 * np.abs(h) + step) @ np.abs(w).T + 1e-5 * np.abs(ref))
    empty = session.run(None, {"x": np.zeros((0, k), np.float32),
                               "skip": np.zeros((0, k), np.float32)})
    assert empty[0].shape == (0, n) and empty[1].shape == (0, k)


def test_without_the_library_an_export_falls_back_or_refuses(monkeypatch, tmp_path):
    monkeypatch.setattr(kernels, "available", lambda: False)
    assert resolve_kernel(None, quant="int4", quant_scheme="block-min") == "onnxruntime"
    with pytest.raises(ExportOptionError, match="needs ortspec's kernel library"):
        export_model(tmp_path / "missing", out=tmp_path / "out", progress=False, quant="int4",
                     kernel="ortspec")
    assert not (tmp_path / "out").exists()


# ---- ortspec.Q8Gemm: the 8-bit head in MatMulNBits' own layout --------------------------------

def _q8_weight(rng, n: int, k: int):
    """MatMulNBits' symmetric 8-bit blocks: b [n, k / 32, 32] = q + 128 (q in -127..127), and
    the weight they stand for."""
    from ortspec.export.quantize import quantize_blockwise

    qw = quantize_blockwise(rng.standard_normal((n, k)).astype(np.float32), bits=8,
                            block_size=32, scheme="symmetric")
    assert qw.packed.min() >= 1  # the layout the op accepts
    return qw.packed, qw.scales.reshape(-1).astype(np.float32), qw.dequantize()


def _q8(lib, x, b, scales) -> np.ndarray:
    x = np.ascontiguousarray(x, np.float32)
    n = b.shape[0]
    y = np.full((x.shape[0], n), np.nan, np.float32)
    assert lib.ortspec_q8_gemm(x.ctypes.data, x.shape[0], x.shape[1], n, b.ctypes.data,
                               scales.ctypes.data, y.ctypes.data) == 0
    return y


@pytest.fixture(scope="module")
def q8lib(lib):
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.ortspec_q8_gemm.argtypes = [p, i64, i64, i64, p, p, p]
    return lib


@pytest.mark.parametrize("isa", ISAS)
def test_q8_product_and_rows_alike_at_every_row_count(q8lib, isa):
    rng = np.random.default_rng(2)
    k = 576
    b, scales, w = _q8_weight(rng, 80, k)
    x = _activations(rng, 19, k)
    q8lib.ortspec_q4_force_isa(isa)
    y = _q8(q8lib, x, b, scales)
    scale = np.abs(x).max(1, keepdims=True) * np.abs(w).sum(1)[None]
    assert np.all(np.abs(y - _reference(x, w)) <= 4 * (k // 32 + 2) * np.finfo(np.float32).eps
                  * scale)
    alone = np.stack([_q8(q8lib, v[None], b, scales)[0] for v in x])
    for rows in range(1, 20):
        np.testing.assert_array_equal(_q8(q8lib, x[:rows], b, scales), alone[:rows],
                                      err_msg=f"{rows}")


def test_q8_through_onnxruntime_regroups_its_constant_weight(q8lib, tmp_path):
    rng = np.random.default_rng(3)
    k, n = 576, 512
    b, scales, _ = _q8_weight(rng, n, k)
    node = helper.make_node("Q8Gemm", ["x", "b", "s"], ["y"], domain=kernels.DOMAIN, K=k, N=n)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])],
        [numpy_helper.from_array(b, "b"), numpy_helper.from_array(scales, "s")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid(kernels.DOMAIN, 1)])
    model.ir_version = 10
    (tmp_path / "q8.onnx").write_bytes(model.SerializeToString())
    session = open_session(str(tmp_path / "q8.onnx"), session_options(threads=2),
                           ["CPUExecutionProvider"])
    x = _activations(rng, 6, k)
    q8lib.ortspec_q4_force_isa(-1)
    np.testing.assert_array_equal(session.run(None, {"x": x})[0], _q8(q8lib, x, b, scales))
