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
MIN_OPSET = 17  # Shape(start=, end=) needs 15, ReduceSum with axes as an input 13
MAX_OPSET = 23  # the newest ai.onnx opset checked against onnxruntime 1.32 here
DEFAULT_OPSET = 21
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
class GraphOptions:
    capacity: int  # rows of the KV buffers and of the cos/sin caches
    dtype: str  # "fp32" or "fp16": weights, activations and KV; logits are always fp32
    opset: int = DEFAULT_OPSET


@dataclasses.dataclass(frozen=True)
class GraphFiles:
    graph: Path  # the .onnx file
    data: Path  # its one external data file
    weight_bytes: int  # payload of the data file (without alignment padding)


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
    wdt = NUMPY_DTYPES[options.dtype]
    g = NodeList()
    with ExternalDataWriter(data_path) as writer:
        inits: list[TensorProto] = []

        def weight(name: str, *, transpose: bool = False, required: bool = True) -> str | None:
            arr = get_weight(name)
            if arr is None:
                if required:
                    raise KeyError(f"checkpoint has no weight for {name!r}")
                return None
            arr = np.asarray(arr, dtype=np.float32)
            if transpose:
                arr = arr.T  # [out, in] -> [in, out]
            inits.append(writer.add(name, arr.astype(wdt)))
            return name

        def linear(x: str, names: list[str], bias_names: list[str]) -> str:
            """x @ concat(names).T (+ concat(biases)); several weights fuse into one MatMul."""
            arrs = [np.asarray(get_weight(n), dtype=np.float32) for n in names]
            fused = names[0] if len(names) == 1 else names[0].rsplit(".", 1)[0] + ".qkv"
            inits.append(writer.add(fused, np.concatenate(arrs, axis=0).T.astype(wdt)))
            del arrs
            y = g.op1("MatMul", [x, fused])
            biases = [get_weight(b) for b in bias_names]
            if any(b is not None for b in biases):
                rows = [np.zeros(a_out, np.float32) if b is None else np.asarray(b, np.float32)
                        for b, a_out in zip(biases, _out_dims(spec, names), strict=True)]
                bname = fused + "_bias"
                inits.append(writer.add(bname, np.concatenate(rows).astype(wdt)))
                y = g.op1("Add", [y, bname])
            return y

        # seqlens_k = row sum of the mask - 1 (int32 [1]); total_sequence_length = mask width
        axes = g.const("axes_1", np.array([1], np.int64))
        mask_sum = g.op1("ReduceSum", [mf.ATTENTION_MASK, axes], keepdims=0)  # int64 [1]
        one = g.const("one_i64", np.array(1, np.int64))
        seqlens_k = g.op1("Cast", [g.op1("Sub", [mask_sum, one])], to=TensorProto.INT32)
        width = g.op1("Shape", [mf.ATTENTION_MASK], start=1, end=2)
        total_len = g.op1("Cast", [g.op1("Squeeze", [width])], to=TensorProto.INT32)
        inits.append(writer.add("rope_cos", rope_cos.astype(wdt)))
        inits.append(writer.add("rope_sin", rope_sin.astype(wdt)))

        embed = weight("embed")
        x = g.op1("Gather", [embed, mf.INPUT_IDS])  # [1, S, hidden]
        residual = None
        eps = float(spec.rms_norm_eps)
        for i in range(spec.num_layers):
            p = f"layers.{i}."
            attn_norm = weight(p + "attn_norm")
            if residual is None:
                h = g.op1("SimplifiedLayerNormalization", [x, attn_norm], axis=-1, epsilon=eps,
                          stash_type=1)
                residual = x
            else:
                h, _, _, residual = g.op("SkipSimplifiedLayerNormalization",
                                         [x, residual, attn_norm], 4, domain=MS, epsilon=eps)
            qkv = linear(h, [p + "q", p + "k", p + "v"], [p + "q_bias", p + "k_bias", p + "v_bias"])
            attn, _, _ = g.op(
                "GroupQueryAttention",
                [qkv, "", "", mf.past_key_name(i), mf.past_value_name(i), seqlens_k, total_len,
                 "rope_cos", "rope_sin"],
                3, domain=MS, name=f"layers.{i}.attn", num_heads=spec.num_heads,
                kv_num_heads=spec.num_kv_heads, scale=float(spec.attention_scale), do_rotary=1,
                rotary_interleaved=0, local_window_size=-1,
            )
            # GQA's 2nd/3rd outputs are the present buffers: rename them to the graph outputs
            gqa = g.nodes[-1]
            gqa.output[1], gqa.output[2] = mf.present_key_name(i), mf.present_value_name(i)
            o = linear(attn, [p + "o"], [p + "o_bias"])
            mlp_norm = weight(p + "mlp_norm")
            h, _, _, residual = g.op("SkipSimplifiedLayerNormalization", [o, residual, mlp_norm],
                                     4, domain=MS, epsilon=eps)
            gate = linear(h, [p + "gate"], [p + "gate_bias"])
            up = linear(h, [p + "up"], [p + "up_bias"])
            act = g.op1("Mul", [g.op1("Mul", [gate, g.op1("Sigmoid", [gate])]), up])  # SiLU(g)*u
            x = linear(act, [p + "down"], [p + "down_bias"])
            if on_layer is not None:
                on_layer(i)
        final_norm = weight("norm")
        h, _, _, _ = g.op("SkipSimplifiedLayerNormalization", [x, residual, final_norm], 4,
                          domain=MS, epsilon=eps)
        if spec.tied_embeddings:
            # Gemm(A [S, hidden], embed [vocab, hidden], transB): the table is stored once; the
            # Gemm reads it under a second name (see onnx_writer.alias) so that ORT's packed
            # copy does not keep the Gather's memory-mapped original resident
            lm_head = "embed_as_lm_head"
            inits.append(alias(next(t for t in inits if t.name == embed), lm_head))
            flat = g.op1("Reshape", [h, g.const("shape_rows_hidden",
                                                np.array([-1, spec.hidden_size], np.int64))])
            rows = g.op1("Gemm", [flat, lm_head], transB=1)
            logits = g.op1("Reshape", [rows, g.const("shape_logits",
                                                     np.array([1, -1, spec.vocab_size], np.int64))])
        else:
            logits = g.op1("MatMul", [h, weight("lm_head", transpose=True)])
        if options.dtype != "fp32":
            logits = g.op1("Cast", [logits], to=TensorProto.FLOAT)
        g.op("Identity", [logits], 1, name="logits_out")
        g.nodes[-1].output[0] = mf.LOGITS
        weight_bytes = writer.bytes_written

    model = _make_model(spec, options, g, inits)
    graph_path.write_bytes(model.SerializeToString())
    return GraphFiles(graph=graph_path, data=data_path, weight_bytes=weight_bytes)


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
        opset_imports=[helper.make_opsetid("", options.opset), helper.make_opsetid(MS, 1)],
        producer_name="ortspec.export",
    )
    model.ir_version = min(model.ir_version, 10)  # onnxruntime 1.20+ reads IR 10
    return model
