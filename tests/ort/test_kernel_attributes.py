"""ortspec's custom ops refuse a node whose attributes they cannot run with when the session is
made, naming the op, instead of leaving onnxruntime a kernel that is not there."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from ortspec.runtime.ort import kernels
from ortspec.runtime.ort.sessions import open_session, session_options

pytestmark = pytest.mark.skipif(not kernels.available(),
                                reason="ortspec's kernel library is not built")

K, N = 64, 32
F, H, I64 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.INT64


def _q4_weights() -> list:
    return [numpy_helper.from_array(np.zeros((N // 16, K // 32, 4, 64), np.uint8), "q"),
            numpy_helper.from_array(np.ones((N // 16, K // 32, 16), np.float16), "d"),
            numpy_helper.from_array(np.zeros((N // 16, K // 32, 16), np.float16), "m"),
            numpy_helper.from_array(np.ones(K, np.float32), "g")]


def _session(op: str, inputs: list[tuple[str, int]], outputs: int, attrs: dict, path):
    """A one-node graph of ortspec's `op`; inputs named q, d, m, g are the initializers. The
    outputs are float, but a float16-cache op's cache outputs (as its inputs key and value)."""
    kinds = [H if op.endswith("16") and i > 0 else F for i in range(outputs)]
    inits = [t for t in _q4_weights() if t.name in {name for name, _ in inputs}]
    names = [name for name, _ in inputs]
    node = helper.make_node(op, names, [f"out{i}" for i in range(outputs)], domain="ortspec",
                            **attrs)
    graph = helper.make_graph(
        [node], "one_op",
        [helper.make_tensor_value_info(name, kind, None) for name, kind in dict(inputs).items()
         if name not in {t.name for t in inits}],
        [helper.make_tensor_value_info(f"out{i}", kind, None) for i, kind in enumerate(kinds)],
        inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid("ortspec", 1)])
    path.write_bytes(model.SerializeToString())
    return open_session(str(path), session_options(threads=1), ["CPUExecutionProvider"])


Q4 = [("x", F), ("q", F), ("d", F), ("m", F)]
NORM = [*Q4, ("x", F), ("g", F)]
ATTENTION = [("q_in", F), ("key", F), ("value", F), ("pos", I64), ("rows", I64)]
ROTARY = [("qkv", F), ("key", F), ("value", F), ("pos", I64), ("rows", I64), ("cos", F),
          ("sin", F)]
ATTENTION16 = [(name, H if name in ("key", "value") else kind) for name, kind in ATTENTION]
ROTARY16 = [(name, H if name in ("key", "value") else kind) for name, kind in ROTARY]


@pytest.mark.parametrize("op, inputs, outputs, attrs", [
    ("Q4Gemm", Q4, 1, dict(K=K)),                                  # no N
    ("Q4Gemm", Q4, 1, dict(K=K, N=24)),                            # N not a multiple of 16
    ("Q4GemmSwiGlu", Q4, 1, dict(K=40, N=N)),                      # K not a multiple of 32
    ("Q4GemmNorm", NORM, 2, dict(K=K, N=N)),                       # no epsilon
    ("Q4GemmSwiGluNorm", NORM, 2, dict(K=K, N=N)),                 # no epsilon
    ("CacheAttention", ATTENTION, 1, dict(scale=0.125)),           # no num_heads
    ("RotaryCacheAttention", ROTARY, 3, dict(num_heads=2, scale=0.125, rotary_dim=7)),
    ("CacheAttention16", ATTENTION16, 1, dict(scale=0.125)),       # no num_heads
    ("RotaryCacheAttention16", ROTARY16, 3, dict(num_heads=2, scale=0.125, rotary_dim=7)),
], ids=["Q4Gemm-no-N", "Q4Gemm-N-24", "Q4GemmSwiGlu-K-40", "Q4GemmNorm-no-epsilon",
        "Q4GemmSwiGluNorm-no-epsilon", "CacheAttention-no-heads", "Rotary-odd-dim",
        "CacheAttention16-no-heads", "Rotary16-odd-dim"])
def test_a_node_the_op_cannot_run_is_refused_naming_the_op(op, inputs, outputs, attrs,
                                                           tmp_path):
    with pytest.raises(Exception, match=rf"ortspec\.{op}: the node's attributes"):
        _session(op, inputs, outputs, attrs, tmp_path / "op.onnx")


def test_the_same_nodes_with_their_attributes_run(tmp_path):
    """The control: each refused node above, given what it lacked, makes a session and runs."""
    x = np.ones((2, K), np.float32)
    norm = _session("Q4GemmNorm", NORM, 2, dict(K=K, N=N, epsilon=1e-5), tmp_path / "n.onnx")
    y, total = norm.run(None, {"x": x})
    assert y.shape == (2, N) and np.array_equal(total, 2 * x)
    glu = _session("Q4GemmSwiGlu", Q4, 1, dict(K=K, N=N), tmp_path / "g.onnx")
    assert glu.run(None, {"x": x})[0].shape == (2, N // 2)
