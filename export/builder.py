"""`GraphBuilder`: the node list, the weights file, and the pieces of the decoder graph that
both attention flavours share (embedding, linear layers plain or as MatMulNBits, RMSNorm, the
LM head). graphs.py drives it layer by layer; attention.py adds each layer's attention to it.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper

from ortspec.runtime.ort import graph_io as gio

from .graph_spec import MS, NUMPY_DTYPES, ORTSPEC_DOMAIN, DecoderSpec, GraphOptions
from .onnx_writer import ExternalDataWriter, NodeList, alias
from .quantize import Q4GEMM_TILE, quantize_blockwise, quantize_q4gemm


@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A weight [N, K] written for MatMulNBits or ortspec.Q4Gemm: its initializers, by name."""

    name: str
    inputs: tuple[str, ...]  # the op's inputs after A: B, scales[, zero_points] or q, d, m
    offsets: str | None  # [n_blocks, N], the block-min scheme's offsets (MatMulNBits only)
    n: int
    k: int
    bits: int
    op: str = "MatMulNBits"  # or "Q4Gemm", "Q8Gemm" (ortspec's ops; add_quantized decides)


GetWeight = Callable[[str], "np.ndarray | None"]  # canonical name -> float32 array, or None


class GraphBuilder:
    """The node list, the weights file, and the pieces both attention flavours share."""

    def __init__(self, spec: DecoderSpec, options: GraphOptions, get_weight: GetWeight,
                 writer: ExternalDataWriter):
        self.spec, self.options, self.g = spec, options, NodeList()
        self.inits: list[TensorProto] = []  # external initializers
        self._get, self._writer = get_weight, writer
        self.wdt = NUMPY_DTYPES[options.dtype]
        self.quantized: list[str] = []
        # checkpoint names whose weight a Q4Gemm multiplies by (quantize_q4gemm's float16 d and
        # m): the validation's reference dequantizes them the same way
        self.kernel_weights: list[str] = []
        self.float_linear: list[str] = []
        self._block_sums: dict[str, str] = {}  # input name -> its per-block sums
        self._head: QuantizedWeight | None = None  # the LM head, when the embedding shares it

    def add_tensor(self, name: str, array: np.ndarray) -> str:
        self.inits.append(self._writer.add(name, np.asarray(array).astype(self.wdt)))
        return name

    def add_raw(self, name: str, array: np.ndarray) -> str:
        """An initializer stored in its own dtype (uint8 packed weights), not the graph's."""
        self.inits.append(self._writer.add(name, array))
        return name

    def weight(self, name: str, *, transpose: bool = False) -> str:
        arr = self._get(name)
        if arr is None:
            raise KeyError(f"checkpoint has no weight for {name!r}")
        arr = np.asarray(arr, dtype=np.float32)
        return self.add_tensor(name, arr.T if transpose else arr)  # [out, in] -> [in, out]

    def linear(self, x: str, names: list[str], bias_names: list[str], *,
               fused: str | None = None) -> str:
        """x @ concat(names).T (+ concat(biases)); several weights fuse into one MatMul."""
        name = fused or names[0]
        w = self._stacked(names)  # [out, in]
        q = self.options.quant
        if q is not None and w.shape[1] % q.block_size == 0:
            qw = self.add_quantized(name, w, bits=q.bits, scheme=q.scheme)
            if qw.op == "Q4Gemm":
                self.kernel_weights += names
            y = self.matmul_nbits(x, qw)
        else:
            if q is not None:
                self.float_linear.append(name)
            self.add_tensor(name, w.T)
            y = self.g.op1("MatMul", [x, name])
        del w
        biases = [self._get(b) for b in bias_names]
        if any(b is not None for b in biases):
            rows = [np.zeros(n_out, np.float32) if b is None else np.asarray(b, np.float32)
                    for b, n_out in zip(biases, _out_dims(self.spec, names), strict=True)]
            y = self.g.op1("Add", [y, self.add_tensor(name + "_bias", np.concatenate(rows))])
        return y

    def swiglu(self, x: str, names: list[str], bias_names: list[str], *, fused: str) -> str | None:
        """silu(x @ gate.T) * (x @ up.T) (names: gate, up) as one ortspec.Q4GemmSwiGlu node
        over the two weights stacked, where they would run on ortspec.Q4Gemm and have no bias;
        None otherwise, with nothing added (the caller builds the product, split and gating)."""
        q = self.options.quant
        if q is None or (q.kernel, q.bits, q.scheme, q.block_size) != \
                ("ortspec", 4, "block-min", 32) or any(self._get(b) is not None for b in bias_names):
            return None
        w = self._stacked(names)  # [2 * intermediate, in]
        if w.shape[1] % q.block_size or w.shape[0] % (2 * Q4GEMM_TILE):
            return None
        qw = self.add_quantized(fused, w, bits=4, scheme="block-min")
        del w
        assert qw.op == "Q4Gemm"  # what add_quantized makes of such a weight
        self.kernel_weights += names
        return self.matmul_nbits(x, dataclasses.replace(qw, op="Q4GemmSwiGlu"))

    def _stacked(self, names: list[str]) -> np.ndarray:  # [sum of outs, in] float32
        """The checkpoint's weights `names` stacked along their outputs."""
        return np.concatenate([np.asarray(self._get(n), dtype=np.float32) for n in names], axis=0)

    def embedding(self, ids: str = gio.INPUT_IDS) -> str:
        """ids (input_ids [B, S], or the packed graph's [M]) -> [*ids.shape, hidden]: a Gather
        from the float table, or, when the quantized
        LM head can share its bytes (WeightQuant.embed_shares_head), a GatherBlockQuantized
        from the head's 8-bit table: stored once, and for a Q8_0 GGUF table exactly the
        target's embedding."""
        spec, q = self.spec, self.options.quant
        if not (q is not None and q.embed_shares_head and spec.tied_embeddings
                and self._head_quantizable()):
            return self.g.op1("Gather", [self.weight("embed"), ids])
        self._head = self.add_quantized("lm_head", np.asarray(self._get("embed"), np.float32),
                                        bits=8, scheme="symmetric")
        packed, scales = self._head.inputs[:2]  # [vocab, n_blocks, block], [vocab * n_blocks]
        self.inits += [
            alias(self._init(packed), "embed.q", dims=[spec.vocab_size, spec.hidden_size]),
            alias(self._init(scales), "embed.scales",
                  dims=[spec.vocab_size, spec.hidden_size // q.block_size])]
        self.quantized.append("embed")
        return self.g.op1("GatherBlockQuantized", ["embed.q", ids, "embed.scales"],
                          domain=MS, bits=8, block_size=q.block_size, gather_axis=0,
                          quantize_axis=1)

    def _head_quantizable(self) -> bool:
        q = self.options.quant
        return q is not None and q.lm_head_bits is not None and \
            self.spec.hidden_size % q.block_size == 0

    def _init(self, name: str) -> TensorProto:
        return next(t for t in self.inits if t.name == name)

    def add_quantized(self, name: str, w: np.ndarray, *, bits: int, scheme: str) -> \
            "QuantizedWeight":
        """Quantize w [N, K] (K a multiple of the block) and write its initializers."""
        q = self.options.quant
        block = q.block_size
        if q.kernel == "ortspec" and (bits, scheme, block) == (4, "block-min", 32) \
                and w.shape[0] % Q4GEMM_TILE == 0:
            qw4 = quantize_q4gemm(w)
            inputs = (self.add_raw(name + ".q4", qw4.packed), self.add_raw(name + ".d", qw4.d),
                      self.add_raw(name + ".m", qw4.m))
            return QuantizedWeight(name=name, inputs=inputs, offsets=None, n=w.shape[0],
                                   k=w.shape[1], bits=bits, op="Q4Gemm")
        qw = quantize_blockwise(w, bits=bits, block_size=block, scheme=scheme)
        # ortspec.Q8Gemm reads MatMulNBits' own symmetric 8-bit initializers (which a tied
        # embedding's GatherBlockQuantized reads too) and regroups them when loaded
        op = "Q8Gemm" if q.kernel == "ortspec" and (bits, scheme, block) == (8, "symmetric", 32) \
            and w.shape[0] % Q4GEMM_TILE == 0 else "MatMulNBits"
        inputs = [self.add_raw(name + ".q", qw.packed),
                  self.add_tensor(name + ".scales", qw.scales.reshape(-1))]
        if qw.zero_points is not None:
            inputs.append(self.add_raw(name + ".zero_points", qw.zero_points.reshape(-1)))
        offsets = None if qw.mins is None else \
            self.add_tensor(name + ".offsets", qw.mins.T)  # [n_blocks, N]
        return QuantizedWeight(name=name, inputs=tuple(inputs), offsets=offsets, n=w.shape[0],
                               k=w.shape[1], bits=bits, op=op)

    def matmul_nbits(self, x: str, w: "QuantizedWeight") -> str:
        """x [rows, K] @ w.T through MatMulNBits, plus the block-min offsets' product (or
        through the ortspec op add_quantized chose, which holds the block minima itself)."""
        q = self.options.quant
        if w.op != "MatMulNBits":  # ortspec.Q4Gemm, Q4GemmSwiGlu or Q8Gemm
            self.quantized.append(w.name)
            return self.g.op1(w.op, [x, *w.inputs], domain=ORTSPEC_DOMAIN,
                              name=f"{w.name}/{w.op.lower()}", K=w.k, N=w.n)
        y = self.g.op1("MatMulNBits", [x, *w.inputs], domain=MS, name=w.name + "/matmul_nbits",
                       K=w.k, N=w.n, bits=w.bits, block_size=q.block_size,
                       accuracy_level=q.accuracy_level)
        if w.offsets is not None:  # + sum over blocks b of (sum of x over b) * offset[n, b]
            # x is [rows, K] here (build_decoder keeps the quantized layers' rows flat), so
            # one Gemm (C = y) does the product and the sum: a node fewer than MatMul + Add,
            # 0.91x the time of a draft step on SmolLM2-135M (the node's cost is its dispatch)
            y = self.g.op1("Gemm", [self.block_sums(x, w.k), w.offsets, y])
        self.quantized.append(w.name)
        return y

    def block_sums(self, x: str, k: int) -> str:
        """[..., K] -> [..., K / block_size]: x summed over each quantization block (once per
        input: q, k, v share one, and so do gate and up)."""
        if x not in self._block_sums:  # one MatMul with a 0/1 block indicator [K, K / block]
            bs = self.options.quant.block_size
            name = f"block_indicator_{k}"
            if name not in self._writer.names:
                self.add_tensor(name, np.kron(np.eye(k // bs, dtype=np.float32),
                                              np.ones((bs, 1), np.float32)))
            self._block_sums[x] = self.g.op1("MatMul", [x, name])
        return self._block_sums[x]

    def norm(self, x: str, residual: str | None, weight_name: str) -> tuple[str, str]:
        """RMSNorm(x + residual) and the new residual (x itself before the first layer)."""
        w, eps = self.weight(weight_name), float(self.spec.rms_norm_eps)
        if self.options.attention == "standard":  # standard ONNX ops only (TensorRT imports them)
            total = x if residual is None else self.g.op1("Add", [x, residual])
            return self.g.op1("RMSNormalization", [total, w], axis=-1, epsilon=eps,
                              stash_type=1), total
        if residual is None:
            return self.g.op1("SimplifiedLayerNormalization", [x, w], axis=-1, epsilon=eps,
                              stash_type=1), x
        h, _, _, total = self.g.op("SkipSimplifiedLayerNormalization", [x, residual, w], 4,
                                   domain=MS, epsilon=eps)
        return h, total

    def head_norm(self, x: str, heads: int, weight_name: str) -> str:
        """RMSNorm over each head of x [B, S, heads * head_dim] with one [head_dim] weight
        (Qwen3's q_norm and k_norm): reshaped to [B, S, heads, head_dim] and back (a 0 in a
        Reshape shape keeps that input dimension)."""
        g, hd = self.g, self.spec.head_dim
        w, eps = self.weight(weight_name), float(self.spec.rms_norm_eps)
        split = g.const(f"shape_head_rows_{heads}", np.array([0, -1, heads, hd], np.int64))
        flat = g.const(f"shape_head_flat_{heads}", np.array([0, -1, heads * hd], np.int64))
        op = "RMSNormalization" if self.options.attention == "standard" else \
            "SimplifiedLayerNormalization"
        y = g.op1(op, [g.op1("Reshape", [x, split]), w], axis=-1, epsilon=eps, stash_type=1)
        return g.op1("Reshape", [y, flat])

    def lm_head(self, h: str) -> None:
        """logits [N, vocab] float32 for the positions `logit_rows` names (N of them, flat
        indices b * S + s into h [B, S, hidden]): the head runs on those rows only."""
        g, spec, q = self.g, self.spec, self.options.quant
        flat = g.op1("Reshape", [h, g.const("shape_rows_hidden",
                                            np.array([-1, spec.hidden_size], np.int64))])
        h = g.op1("Gather", [flat, gio.LOGIT_ROWS], axis=0)  # [N, hidden]
        if self._head is not None:  # written by embedding(), which reads the same bytes
            logits = self.matmul_nbits(h, self._head)
        elif q is not None and self._head_quantizable():
            w = np.asarray(self._get("embed" if spec.tied_embeddings else "lm_head"), np.float32)
            head = self.add_quantized("lm_head", w, bits=q.lm_head_bits, scheme=q.lm_head_scheme)
            if head.op == "Q4Gemm":
                self.kernel_weights.append("lm_head")
            logits = self.matmul_nbits(h, head)
        elif spec.tied_embeddings:
            # Gemm(A [N, hidden], embed [vocab, hidden], transB): the table is stored once; the
            # Gemm reads it under a second name (see onnx_writer.alias) so that ORT's packed
            # copy does not keep the Gather's memory-mapped original resident
            lm_head = "embed_as_lm_head"
            self.inits.append(alias(self._init("embed"), lm_head))
            logits = g.op1("Gemm", [h, lm_head], transB=1)  # [N, vocab]
        else:
            logits = g.op1("MatMul", [h, self.weight("lm_head", transpose=True)])
        if self.options.dtype != "fp32":
            logits = g.op1("Cast", [logits], to=TensorProto.FLOAT)
        if spec.final_softcap:  # cap * tanh(logits / cap), in float32
            cap = g.const("final_softcap", np.array(spec.final_softcap, np.float32))
            logits = g.op1("Mul", [g.op1("Tanh", [g.op1("Div", [logits, cap])]), cap])
        g.op("Identity", [logits], name="logits_out", outputs=[gio.LOGITS])


def _out_dims(spec: DecoderSpec, names: list[str]) -> list[int]:
    dims = {"q": spec.num_heads * spec.head_dim, "k": spec.num_kv_heads * spec.head_dim,
            "v": spec.num_kv_heads * spec.head_dim, "o": spec.hidden_size,
            "gate": spec.intermediate_size, "up": spec.intermediate_size, "down": spec.hidden_size}
    return [dims[n.rsplit(".", 1)[1]] for n in names]


# the ortspec products a preceding skip norm folds into (runtime/ort/product_ops.h)
NORM_FUSABLE = {"Q4Gemm": "Q4GemmNorm", "Q4GemmSwiGlu": "Q4GemmSwiGluNorm"}


def fuse_skip_norms(nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """`nodes` with each SkipSimplifiedLayerNormalization whose normalized output only feeds an
    ortspec Q4Gemm or Q4GemmSwiGlu (as its x) folded into that product: Q4GemmNorm(x, q, d, m,
    skip, gamma) -> y, sum, which normalizes x + skip itself and gives the sum out under the
    norm's name for it. The norm's node and its dispatch go (about 10% of a one-token step of
    SmolLM2-135M at int4); the other nodes keep their order."""
    users: dict[str, list[tuple[onnx.NodeProto, int]]] = defaultdict(list)
    for n in nodes:
        for i, name in enumerate(n.input):
            users[name].append((n, i))
    place = {id(n): i for i, n in enumerate(nodes)}
    fused: dict[int, onnx.NodeProto] = {}  # id(product node) -> its fused replacement
    dropped: set[int] = set()
    for n in nodes:
        eps = [helper.get_attribute_value(a) for a in n.attribute if a.name == "epsilon"]
        if n.op_type != "SkipSimplifiedLayerNormalization" or n.domain != MS \
                or len(n.input) != 3 or len(n.output) != 4 or len(eps) != 1 \
                or any(users[o] for o in n.output[1:3] if o):
            continue  # (a bias input, or no epsilon given: the node stays)
        (user, slot), *more = users[n.output[0]] or [(None, -1)]
        if more or user is None or slot != 0 or user.domain != ORTSPEC_DOMAIN \
                or user.op_type not in NORM_FUSABLE \
                or any(place[id(c)] <= place[id(user)] for c, _ in users[n.output[3]]):
            continue  # (the sum is made where the product runs: neither it nor an earlier node
            # may read it)
        attrs = {a.name: helper.get_attribute_value(a) for a in user.attribute}
        fused[id(user)] = helper.make_node(
            NORM_FUSABLE[user.op_type], [n.input[0], *user.input[1:4], n.input[1], n.input[2]],
            [user.output[0], n.output[3]], name=user.name, domain=ORTSPEC_DOMAIN,
            epsilon=float(eps[0]), **attrs)
        dropped.add(id(n))
    return [fused.get(id(n), n) for n in nodes if id(n) not in dropped]
