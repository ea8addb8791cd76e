"""The decoder graph, built node by node from the weights (no tracing).

One graph serves both entry points: `input_ids` has a dynamic sequence length S, so the step
(S = 1) and the verify call (S = 1..max_verify_len) run the same session with weights packed
once. Per layer, as onnxruntime-genai's model builder lays it out for the CPU:

    x -> [Skip]SimplifiedLayerNormalization -> MatMul(qkv) [+ bias] -> GroupQueryAttention
      -> MatMul(o) -> SkipSimplifiedLayerNormalization -> MatMul(gate), MatMul(up)
      -> gate * sigmoid(gate) * up -> MatMul(down) -> (next layer's skip norm adds the residual)

`GroupQueryAttention` applies the rotary embedding itself (do_rotary=1, cos/sin caches of
`capacity` rows) and writes the new keys/values into the fixed-capacity KV buffer at the
position the mask's row sum gives, in place when past and present are bound to one buffer.
The "standard" flavour (for TensorRT) replaces the contrib ops with ONNX opset-24 ones
(RMSNormalization + Add, RotaryEmbedding, TensorScatter, Attention); see attention.py.

Weights arrive under canonical names (`WEIGHT_NAMES`), already float32 NumPy, so this module
needs neither torch nor transformers. Linear weights are given as [out, in] (the PyTorch
layout) and stored transposed, [in, out], as MatMul wants them; a tied LM head is a Gemm with
transB against the embedding table, which is therefore stored once (and resident once).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from ortspec.runtime import manifest as mf

from .onnx_writer import ExternalDataWriter, NodeList, alias

MS = "com.microsoft"
ATTENTIONS = ("gqa", "standard")
# gqa: Shape(start=, end=) needs 15, ReduceSum with axes as an input 13.
# standard: TensorScatter and Attention's nonpad_kv_seqlen need 24.
MIN_OPSET = {"gqa": 17, "standard": 24}
MAX_OPSET = 24  # the newest ai.onnx opset checked against onnxruntime 1.32 here
DEFAULT_OPSET = {"gqa": 21, "standard": 24}
FAMILIES = ("llama", "qwen2")
NUMPY_DTYPES = {"fp32": np.float32, "fp16": np.float16}
ONNX_DTYPES = {"fp32": TensorProto.FLOAT, "fp16": TensorProto.FLOAT16}

# Canonical weight names. {i} is the layer index. Linear weights are [out, in].
WEIGHT_NAMES = (
    "embed",  # [vocab, hidden]
    "norm",  # [hidden], final RMSNorm
    "lm_head",  # [vocab, hidden]; absent when tied to `embed`
    "layers.{i}.attn_norm", "layers.{i}.mlp_norm",  # [hidden]
    "layers.{i}.q", "layers.{i}.k", "layers.{i}.v", "layers.{i}.o",
    "layers.{i}.q_bias", "layers.{i}.k_bias", "layers.{i}.v_bias", "layers.{i}.o_bias",  # optional
    "layers.{i}.gate", "layers.{i}.up", "layers.{i}.down",
    "layers.{i}.gate_bias", "layers.{i}.up_bias", "layers.{i}.down_bias",  # optional
)


@dataclasses.dataclass(frozen=True)
class DecoderSpec:
    """The numbers that shape the graph; sources.py reads them from the checkpoint's config."""

    family: str  # "llama" or "qwen2"
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    tied_embeddings: bool
    attention_scale: float  # multiplies q.k; 1/sqrt(head_dim) for every supported family

    def architecture(self) -> mf.Architecture:
        return mf.Architecture(
            family=self.family, num_layers=self.num_layers, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            hidden_size=self.hidden_size, vocab_size=self.vocab_size,
        )


@dataclasses.dataclass(frozen=True)
class WeightQuant:
    """Linear weights as `com.microsoft::MatMulNBits` (see quantize.py for the schemes).

    accuracy_level 4 lets the CPU kernel quantize each block of the activations to int8 and
    use integer dot products: 2-3x faster than 0 (float activations) at one token and the only
    level faster than float32 MatMul at 8 (measured on this machine's AVX-512 VNNI CPU, 576 x
    1536); its rounding of the activations is part of the draft's error.
    """

    bits: int = 4
    block_size: int = 32
    scheme: str = "block-min"  # "block-min", "zero-point" or "symmetric"
    accuracy_level: int = 4  # 0 (unset: float activations) .. 4 (int8 activations)
    lm_head_bits: int | None = 8  # None keeps the LM head float
    lm_head_scheme: str = "symmetric"

    @property
    def embed_shares_head(self) -> bool:
        """A tied embedding is read from the quantized LM head's bytes (GatherBlockQuantized)
        when the head is 8-bit symmetric, the one layout both ops share: MatMulNBits' default
        zero point for 8 bits is 128, as is GatherBlockQuantized's for uint8 data, and its B
        [N, n_blocks, block_size] is the table [vocab, hidden] row by row."""
        return self.lm_head_bits == 8 and self.lm_head_scheme == "symmetric"


@dataclasses.dataclass(frozen=True)
class GraphOptions:
    capacity: int  # rows of the KV buffers and of the cos/sin caches
    dtype: str  # "fp32" or "fp16": weights, activations and KV; logits are always fp32
    opset: int = DEFAULT_OPSET["gqa"]
    attention: str = "gqa"  # "gqa" (ORT contrib ops, the CPU graph) or "standard" (ONNX ops)
    quant: WeightQuant | None = None  # None: float MatMul weights (the target)


@dataclasses.dataclass(frozen=True)
class GraphFiles:
    graph: Path  # the .onnx file
    data: Path  # its one external data file
    weight_bytes: int  # payload of the data file (without alignment padding)
    quantized: tuple[str, ...] = ()  # the weights stored as MatMulNBits (names as in the graph)
    float_linear: tuple[str, ...] = ()  # with `quant`, the ones left float (K % block_size)


@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A weight [N, K] written for MatMulNBits: its initializers, by name."""

    name: str
    inputs: tuple[str, ...]  # B, scales[, zero_points]: MatMulNBits' inputs after A
    offsets: str | None  # [n_blocks, N], the block-min scheme's offsets
    n: int
    k: int
    bits: int


GetWeight = Callable[[str], "np.ndarray | None"]  # canonical name -> float32 array, or None


def build_decoder(spec: DecoderSpec, options: GraphOptions, get_weight: GetWeight,
                  rope_cos: np.ndarray, rope_sin: np.ndarray, *, graph_path: Path,
                  data_path: Path, on_layer: Callable[[int], None] | None = None) -> GraphFiles:
    """Write `graph_path` and its weights `data_path` (same directory).

    rope_cos, rope_sin: [capacity, head_dim // 2] float32, cos/sin of position * inv_freq
    (times the RoPE attention scaling), exactly as the PyTorch model computes them.
    """
    if rope_cos.shape != (options.capacity, spec.head_dim // 2) or rope_sin.shape != rope_cos.shape:
        raise ValueError(f"rope caches must be [{options.capacity}, {spec.head_dim // 2}], "
                         f"got {rope_cos.shape} and {rope_sin.shape}")
    check_opset(options.attention, options.opset)
    if options.quant is not None and options.attention != "gqa":
        raise ValueError("quantized weights (MatMulNBits, a com.microsoft op) need the gqa "
                         "attention flavour")
    from . import attention  # the two attention flavours; they use GraphBuilder

    flavour = attention.FLAVOURS[options.attention]
    with ExternalDataWriter(data_path) as writer:
        b = GraphBuilder(spec, options, get_weight, writer)
        b.add_tensor("rope_cos", rope_cos)
        b.add_tensor("rope_sin", rope_sin)
        context = flavour.preamble(b)
        x = b.embedding()  # [1, S, hidden]
        residual = None
        for i in range(spec.num_layers):
            p = f"layers.{i}."
            h, residual = b.norm(x, residual, p + "attn_norm")
            qkv = b.linear(h, [p + "q", p + "k", p + "v"],
                           [p + "q_bias", p + "k_bias", p + "v_bias"], fused=p + "qkv")
            attn = flavour.attention(b, i, qkv, context)  # [1, S, heads * head_dim]
            o = b.linear(attn, [p + "o"], [p + "o_bias"])
            h, residual = b.norm(o, residual, p + "mlp_norm")
            if options.quant is None:
                gate = b.linear(h, [p + "gate"], [p + "gate_bias"])
                up = b.linear(h, [p + "up"], [p + "up_bias"])
            else:  # one MatMulNBits call (and one block-sum product) for both
                gate_up = b.linear(h, [p + "gate", p + "up"], [p + "gate_bias", p + "up_bias"],
                                   fused=p + "gate_up")
                half = b.g.const("gate_up_split", np.array([spec.intermediate_size] * 2,
                                                           np.int64))
                gate, up = b.g.op("Split", [gate_up, half], 2, axis=-1)
            act = b.g.op1("Mul", [b.g.op1("Mul", [gate, b.g.op1("Sigmoid", [gate])]), up])
            x = b.linear(act, [p + "down"], [p + "down_bias"])  # SiLU(gate) * up -> down
            if on_layer is not None:
                on_layer(i)
        h, _ = b.norm(x, residual, "norm")
        b.lm_head(h)
        weight_bytes = writer.bytes_written

    model = _make_model(spec, options, b.g, b.inits)
    graph_path.write_bytes(model.SerializeToString())
    return GraphFiles(graph=graph_path, data=data_path, weight_bytes=weight_bytes,
                      quantized=tuple(b.quantized), float_linear=tuple(b.float_linear))


def check_opset(attention: str, opset: int) -> None:
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    lo = MIN_OPSET[attention]
    if not lo <= opset <= MAX_OPSET:
        raise ValueError(f"opset {opset} is outside {lo}..{MAX_OPSET} for {attention} attention")


class GraphBuilder:
    """The node list, the weights file, and the pieces both attention flavours share."""

    def __init__(self, spec: DecoderSpec, options: GraphOptions, get_weight: GetWeight,
                 writer: ExternalDataWriter):
        self.spec, self.options, self.g = spec, options, NodeList()
        self.inits: list[TensorProto] = []  # external initializers
        self._get, self._writer = get_weight, writer
        self.wdt = NUMPY_DTYPES[options.dtype]
        self.quantized: list[str] = []
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
        arrs = [np.asarray(self._get(n), dtype=np.float32) for n in names]
        w = np.concatenate(arrs, axis=0)  # [out, in]
        del arrs
        q = self.options.quant
        if q is not None and w.shape[1] % q.block_size == 0:
            y = self.matmul_nbits(x, self.add_quantized(name, w, bits=q.bits, scheme=q.scheme))
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

    def embedding(self) -> str:
        """input_ids -> [1, S, hidden]: a Gather from the float table, or, when the quantized
        LM head can share its bytes (WeightQuant.embed_shares_head), a GatherBlockQuantized
        from the head's 8-bit table: stored once, and for a Q8_0 GGUF table exactly the
        target's embedding."""
        spec, q = self.spec, self.options.quant
        if not (q is not None and q.embed_shares_head and spec.tied_embeddings
                and self._head_quantizable()):
            return self.g.op1("Gather", [self.weight("embed"), mf.INPUT_IDS])
        self._head = self.add_quantized("lm_head", np.asarray(self._get("embed"), np.float32),
                                        bits=8, scheme="symmetric")
        packed, scales = self._head.inputs[:2]  # [vocab, n_blocks, block], [vocab * n_blocks]
        self.inits += [
            alias(self._init(packed), "embed.q", dims=[spec.vocab_size, spec.hidden_size]),
            alias(self._init(scales), "embed.scales",
                  dims=[spec.vocab_size, spec.hidden_size // q.block_size])]
        self.quantized.append("embed")
        return self.g.op1("GatherBlockQuantized", ["embed.q", mf.INPUT_IDS, "embed.scales"],
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
        from .quantize import quantize_blockwise

        block = self.options.quant.block_size
        qw = quantize_blockwise(w, bits=bits, block_size=block, scheme=scheme)
        inputs = [self.add_raw(name + ".q", qw.packed),
                  self.add_tensor(name + ".scales", qw.scales.reshape(-1))]
        if qw.zero_points is not None:
            inputs.append(self.add_raw(name + ".zero_points", qw.zero_points.reshape(-1)))
        offsets = None if qw.mins is None else \
            self.add_tensor(name + ".offsets", qw.mins.T)  # [n_blocks, N]
        return QuantizedWeight(name=name, inputs=tuple(inputs), offsets=offsets, n=w.shape[0],
                               k=w.shape[1], bits=bits)

    def matmul_nbits(self, x: str, w: "QuantizedWeight") -> str:
        """x [1, S, K] @ w.T through MatMulNBits, plus the block-min offsets' product."""
        q = self.options.quant
        y = self.g.op1("MatMulNBits", [x, *w.inputs], domain=MS, name=w.name + "/matmul_nbits",
                       K=w.k, N=w.n, bits=w.bits, block_size=q.block_size,
                       accuracy_level=q.accuracy_level)
        if w.offsets is not None:  # + sum over blocks b of (sum of x over b) * offset[n, b]
            y = self.g.op1("Add", [y, self.g.op1("MatMul", [self.block_sums(x, w.k), w.offsets])])
        self.quantized.append(w.name)
        return y

    def block_sums(self, x: str, k: int) -> str:
        """[1, S, K] -> [1, S, K / block_size]: x summed over each quantization block (once per
        input: q, k, v share one, and so do gate and up)."""
        if x not in self._block_sums:
            bs = self.options.quant.block_size
            shape = self.g.const(f"shape_blocks_{k}", np.array([1, -1, k // bs, bs], np.int64))
            axes = self.g.const("axes_last", np.array([-1], np.int64))
            self._block_sums[x] = self.g.op1(
                "ReduceSum", [self.g.op1("Reshape", [x, shape]), axes], keepdims=0)
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

    def lm_head(self, h: str) -> None:
        g, spec, q = self.g, self.spec, self.options.quant
        if self._head is not None:  # written by embedding(), which reads the same bytes
            logits = self.matmul_nbits(h, self._head)
        elif q is not None and self._head_quantizable():
            w = np.asarray(self._get("embed" if spec.tied_embeddings else "lm_head"), np.float32)
            logits = self.matmul_nbits(h, self.add_quantized(
                "lm_head", w, bits=q.lm_head_bits, scheme=q.lm_head_scheme))
        elif spec.tied_embeddings:
            # Gemm(A [S, hidden], embed [vocab, hidden], transB): the table is stored once; the
            # Gemm reads it under a second name (see onnx_writer.alias) so that ORT's packed
            # copy does not keep the Gather's memory-mapped original resident
            lm_head = "embed_as_lm_head"
            self.inits.append(alias(self._init("embed"), lm_head))
            flat = g.op1("Reshape", [h, g.const("shape_rows_hidden",
                                                np.array([-1, spec.hidden_size], np.int64))])
            rows = g.op1("Gemm", [flat, lm_head], transB=1)  # [S, vocab]
            logits = g.op1("Reshape", [rows, g.const("shape_logits",
                                                     np.array([1, -1, spec.vocab_size], np.int64))])
        else:
            logits = g.op1("MatMul", [h, self.weight("lm_head", transpose=True)])
        if self.options.dtype != "fp32":
            logits = g.op1("Cast", [logits], to=TensorProto.FLOAT)
        g.op("Identity", [logits], name="logits_out", outputs=[mf.LOGITS])


def _out_dims(spec: DecoderSpec, names: list[str]) -> list[int]:
    dims = {"q": spec.num_heads * spec.head_dim, "k": spec.num_kv_heads * spec.head_dim,
            "v": spec.num_kv_heads * spec.head_dim, "o": spec.hidden_size,
            "gate": spec.intermediate_size, "up": spec.intermediate_size, "down": spec.hidden_size}
    return [dims[n.rsplit(".", 1)[1]] for n in names]


def _make_model(spec: DecoderSpec, options: GraphOptions, g: NodeList,
                inits: list[TensorProto]) -> onnx.ModelProto:
    kv_type = ONNX_DTYPES[options.dtype]
    kv_shape = [1, spec.num_kv_heads, options.capacity, spec.head_dim]
    inputs = [
        helper.make_tensor_value_info(mf.INPUT_IDS, TensorProto.INT64, [1, "sequence_length"]),
        helper.make_tensor_value_info(mf.ATTENTION_MASK, TensorProto.INT64,
                                      [1, "total_sequence_length"]),
    ]
    outputs = [helper.make_tensor_value_info(mf.LOGITS, TensorProto.FLOAT,
                                             [1, "sequence_length", spec.vocab_size])]
    for i in range(spec.num_layers):
        for past, present in ((mf.past_key_name(i), mf.present_key_name(i)),
                              (mf.past_value_name(i), mf.present_value_name(i))):
            inputs.append(helper.make_tensor_value_info(past, kv_type, kv_shape))
            outputs.append(helper.make_tensor_value_info(present, kv_type, kv_shape))
    graph = helper.make_graph(g.nodes, "ortspec_decoder", inputs, outputs,
                              initializer=[*g.initializers, *inits])
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", options.opset)]
        + ([helper.make_opsetid(MS, 1)] if options.attention == "gqa" else []),
        producer_name="ortspec.export",
    )
    model.ir_version = min(model.ir_version, 10)  # onnxruntime 1.20+ reads IR 10
    return model
