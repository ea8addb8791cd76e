"""The row probe of an export: a small graph of the kernels its graph runs row by row, which the
runtime runs when it loads the model to learn whether, on that machine, they compute a lone row
as they compute the same row among several (runtime/row_invariance.py, `lone_rows_exact`).

A quantized GQA graph pads only a one-token call's attention (Manifest.min_attention_rows 2)
and runs its MatMuls on the one row. That is exact where MatMulNBits (and, in the block-min
scheme, the float Gemm and MatMul of the offsets) give a row alike at every row count, as
onnxruntime 1.32 does at accuracy level 4 on an AVX-512 VNNI CPU; where a kernel takes another
path for one row (MLAS's AVX2 kernels have such a path), the runtime pads the whole call to two
rows instead. The probe holds one node for each distinct kernel configuration of the graph, with
random weights of the real input width and a narrow output; each node reads the input of its
width, `x<K>` [M, K], and writes `y<i>`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .graph_spec import MS, ORTSPEC_DOMAIN

PROBE_FILE = "row_probe.onnx"
PROBE_N = 64  # output columns of each probe node
FLOAT_OPS = ("MatMul", "Gemm")
# ortspec's row-wise ops (runtime/ort/product_ops.h): each 4-bit one reads (x, q, d, m), the
# ...Norm ones a skip and a norm weight too
Q4_OPS = ("Q4Gemm", "Q4GemmSwiGlu", "Q4GemmNorm", "Q4GemmSwiGluNorm")
ORTSPEC_OPS = (*Q4_OPS, "Q8Gemm")


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _kernel_configs(graph: onnx.GraphProto) -> list[tuple]:
    """The distinct row-wise kernel configurations: ("nbits", K, bits, block, level, zero
    points), (op, K) for ortspec's ops (ORTSPEC_OPS) and ("float", op, K)."""
    dims = {t.name: list(t.dims) for t in graph.initializer}
    seen: list[tuple] = []
    for n in graph.node:
        if n.op_type == "MatMulNBits":
            a = _attrs(n)
            key = ("nbits", a["K"], a["bits"], a["block_size"], a.get("accuracy_level", 0),
                   len(n.input) > 3 and bool(n.input[3]))
        elif n.op_type in ORTSPEC_OPS and n.domain == ORTSPEC_DOMAIN:
            key = (n.op_type, _attrs(n)["K"])
        elif n.op_type in FLOAT_OPS and n.input[1] in dims and len(dims[n.input[1]]) == 2:
            k = dims[n.input[1]][1] if _attrs(n).get("transB") else dims[n.input[1]][0]
            key = ("float", n.op_type, k)
        else:
            continue
        if key not in seen:
            seen.append(key)
    return seen


def write_row_probe(graph_path: Path, probe_path: Path, *, seed: int = 0) -> bool:
    """Write the probe of the graph at `graph_path`; False (nothing written) when the graph
    has no row-wise kernel to probe."""
    graph = onnx.load(str(graph_path), load_external_data=False).graph
    configs = _kernel_configs(graph)
    if not configs:
        return False
    rng = np.random.default_rng(seed)
    nodes, inits, widths = [], [], []
    widths_out = [PROBE_N] * len(configs)  # each output's columns
    for i, key in enumerate(configs):
        k = key[-1] if key[0] == "float" else key[1]
        x = f"x{k}"
        if k not in widths:
            widths.append(k)
        if key[0] == "float":
            w = f"w{i}"
            inits.append(numpy_helper.from_array(
                rng.standard_normal((k, PROBE_N)).astype(np.float32), w))
            if key[1] == "Gemm":  # as the block-min offsets run it: C is the 4-bit product
                c = f"c{i}"
                inits.append(numpy_helper.from_array(
                    rng.standard_normal((1, PROBE_N)).astype(np.float32), c))
                nodes.append(helper.make_node("Gemm", [x, w, c], [f"y{i}"]))
            else:
                nodes.append(helper.make_node("MatMul", [x, w], [f"y{i}"]))
            continue
        if key[0] == "Q8Gemm":  # MatMulNBits' 8-bit symmetric layout, bytes 1..255
            blocks = k // 32
            inits += [numpy_helper.from_array(rng.integers(1, 256, (PROBE_N, blocks, 32),
                                                           dtype=np.uint8), f"q{i}"),
                      numpy_helper.from_array((rng.random(PROBE_N * blocks) * 0.02 + 1e-3)
                                              .astype(np.float32), f"s{i}")]
            nodes.append(helper.make_node("Q8Gemm", [x, f"q{i}", f"s{i}"], [f"y{i}"],
                                          domain=ORTSPEC_DOMAIN, K=k, N=PROBE_N))
            continue
        if key[0] in Q4_OPS:
            blocks = k // 32
            inits += [numpy_helper.from_array(rng.integers(0, 256, (PROBE_N // 16, blocks, 4, 64),
                                                           dtype=np.uint8), f"q{i}"),
                      numpy_helper.from_array((rng.random((PROBE_N // 16, blocks, 16)) * 0.02
                                               + 1e-3).astype(np.float16), f"d{i}"),
                      numpy_helper.from_array((rng.random((PROBE_N // 16, blocks, 16)) - 0.5)
                                              .astype(np.float16) * 0.1, f"m{i}")]
            inputs, outputs, extra = [x, f"q{i}", f"d{i}", f"m{i}"], [f"y{i}"], {}
            if key[0].endswith("Norm"):  # x itself as the skip; the sum is left unread
                inits.append(numpy_helper.from_array(
                    (rng.random(k) + 0.5).astype(np.float32), f"g{i}"))
                inputs += [x, f"g{i}"]
                outputs.append(f"sum{i}")
                extra = {"epsilon": 1e-5}
            nodes.append(helper.make_node(key[0], inputs, outputs, domain=ORTSPEC_DOMAIN, K=k,
                                          N=PROBE_N, **extra))
            widths_out[i] = PROBE_N // 2 if "SwiGlu" in key[0] else PROBE_N
            continue
        _, k, bits, block, level, zero_points = key
        blocks = k // block
        inputs = [x, f"q{i}", f"s{i}"]
        inits += [numpy_helper.from_array(rng.integers(0, 256, (PROBE_N, blocks, block * bits // 8),
                                                       dtype=np.uint8), f"q{i}"),
                  numpy_helper.from_array((rng.random(PROBE_N * blocks) * 0.02 + 1e-3)
                                          .astype(np.float32), f"s{i}")]
        if zero_points:
            size = PROBE_N * (blocks if bits == 8 else (blocks + 1) // 2)
            inits.append(numpy_helper.from_array(rng.integers(0, 256, size, dtype=np.uint8),
                                                 f"z{i}"))
            inputs.append(f"z{i}")
        nodes.append(helper.make_node("MatMulNBits", inputs, [f"y{i}"], domain=MS, K=k,
                                      N=PROBE_N, bits=bits, block_size=block,
                                      accuracy_level=level))
    model = helper.make_model(
        helper.make_graph(
            nodes, "row_probe",
            [helper.make_tensor_value_info(f"x{k}", TensorProto.FLOAT, ["M", k]) for k in widths],
            [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, ["M", widths_out[i]])
             for i in range(len(configs))],
            inits),
        opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)]
        + ([helper.make_opsetid(ORTSPEC_DOMAIN, 1)]
           if any(c[0] in ORTSPEC_OPS for c in configs) else []))
    model.ir_version = 10
    probe_path.write_bytes(model.SerializeToString())
    return True
