"""`fuse_skip_norms` (export/builder.py) on hand-made node lists: which skip norms go into the
ortspec product after them, what the fused node reads and gives, and every case where the norm
must stay a node because the product could not give what its other readers need."""

from __future__ import annotations

import pytest
from onnx import helper

from ortspec.export.builder import fuse_skip_norms
from ortspec.export.graph_spec import MS, ORTSPEC_DOMAIN


def _norm(*, inputs=("attn", "residual", "gamma"), eps=1e-5, name="norm"):
    attrs = {} if eps is None else {"epsilon": eps}
    return helper.make_node("SkipSimplifiedLayerNormalization", list(inputs),
                            ["h", "mean", "inv_std", "total"], name=name, domain=MS, **attrs)


def _product(op="Q4Gemm", x="h"):
    return helper.make_node(op, [x, "q", "d", "m"], ["y"], name="proj", domain=ORTSPEC_DOMAIN,
                            K=64, N=128)


def _after(reads="total"):
    return helper.make_node("Add", ["y", reads], ["out"], name="add")


@pytest.mark.parametrize("op, fused_op", [("Q4Gemm", "Q4GemmNorm"),
                                          ("Q4GemmSwiGlu", "Q4GemmSwiGluNorm")])
def test_a_norm_before_a_product_becomes_part_of_it(op, fused_op):
    nodes = fuse_skip_norms([_norm(eps=1e-6), _product(op), _after()])
    assert [n.op_type for n in nodes] == [fused_op, "Add"]
    fused = nodes[0]
    assert fused.domain == ORTSPEC_DOMAIN and fused.name == "proj"
    assert list(fused.input) == ["attn", "q", "d", "m", "residual", "gamma"]
    assert list(fused.output) == ["y", "total"]  # the sum keeps its name for later readers
    attrs = {a.name: helper.get_attribute_value(a) for a in fused.attribute}
    assert attrs["K"] == 64 and attrs["N"] == 128
    assert attrs["epsilon"] == pytest.approx(1e-6)


@pytest.mark.parametrize("nodes", [
    # the norm's normalized rows also feed another node
    [_norm(), _product(), helper.make_node("Relu", ["h"], ["r"]), _after()],
    # the product reads the rows as something other than its x
    [_norm(), helper.make_node("Q4Gemm", ["x", "h", "d", "m"], ["y"], domain=ORTSPEC_DOMAIN),
     _after()],
    # the next node is not an ortspec product
    [_norm(), helper.make_node("MatMul", ["h", "w"], ["y"]), _after()],
    # a node before the product reads the sum, which the product would only make later
    [_norm(), helper.make_node("Relu", ["total"], ["r"]), _product(), _after()],
    # the product reads the sum too, which it would then make itself
    [_norm(), helper.make_node("Q4Gemm", ["h", "q", "total", "m"], ["y"], domain=ORTSPEC_DOMAIN),
     _after()],
    # the mean or the inverse deviation is read
    [_norm(), _product(), _after(reads="inv_std")],
    # a bias input, which the fused op does not take
    [_norm(inputs=("attn", "residual", "gamma", "bias")), _product(), _after()],
    # no epsilon to carry over
    [_norm(eps=None), _product(), _after()],
], ids=["two-readers", "not-x", "not-ortspec", "sum-read-before", "sum-read-by-product",
        "stats-read", "bias", "no-epsilon"])
def test_a_norm_stays_a_node_where_the_product_cannot_stand_for_it(nodes):
    assert [n.op_type for n in fuse_skip_norms(nodes)] == [n.op_type for n in nodes]
