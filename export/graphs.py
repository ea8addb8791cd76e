"""The decoder graph, built node by node from the weights (no tracing).

One graph serves both entry points: `input_ids` has a dynamic sequence length S, so the step
(S = 1) and the verify call (S = 1..max_verify_len) run the same session with weights packed
once. Per layer, as onnxruntime-genai's model builder lays it out for the CPU:

    x -> [Skip]SimplifiedLayerNormalization -> MatMul(qkv) [+ bias] -> GroupQueryAttention
      -> MatMul(o) -> SkipSimplifiedLayerNormalization -> MatMul(gate), MatMul(up)
      -> gate * sigmoid(gate) * up -> MatMul(down) -> (next layer's skip norm adds the residual)

and after the last layer the final norm, then the LM head on the rows `logit_rows` names only
(a prompt chunk needs its last position's logits, a padded block its real positions'). With
`GraphOptions.hidden_state_layers` the same rows of the listed layers' residual streams are a
second output, `hidden_states` (hidden_states.py); without, no node of it exists.

`GroupQueryAttention` applies the rotary embedding itself (do_rotary=1, cos/sin caches of
`capacity` rows) and writes the new keys/values into the fixed-capacity KV buffer at the
position the mask's row sum gives, in place when past and present are bound to one buffer.
The "standard" flavour (for TensorRT) replaces the contrib ops with ONNX opset-24 ones
(RMSNormalization + Add, RotaryEmbedding, TensorScatter, Attention); see attention.py. The
pieces both flavours share are builder.py's `GraphBuilder`.

The other families are this layout with per-layer options from the `DecoderSpec`: per-head
q/k RMSNorms (Qwen3, Gemma 3), sliding windows (GQA's local_window_size, or a banded mask in
the standard flavour; Mistral, Phi-3, Gemma), layers without rotary (SmolLM3), partial rotary
(Phi-3), and Gemma's scaled embedding, GeGLU, norms after attention and MLP, soft-capping and
local rotary tables. With none of them set the graph is the one above, node for node.

Weights arrive under canonical names (`graph_spec.WEIGHT_NAMES`), already float32 NumPy, so this
module needs neither torch nor transformers. Linear weights are given as [out, in] (the PyTorch
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

from ortspec.runtime.ort import graph_io as gio

from .attention import FLAVOURS, attend_rows, half_cache, pack_tokens, rotary_cache_layer, to_grid
from .builder import GetWeight, GraphBuilder, fuse_skip_norms
from .graph_spec import MS, NUMPY_DTYPES, ORTSPEC_DOMAIN, DecoderSpec, GraphOptions, check_opset
from .hidden_states import hidden_states_output
from .onnx_writer import ExternalDataWriter, NodeList

ONNX_DTYPES = {"fp32": TensorProto.FLOAT, "fp16": TensorProto.FLOAT16}


@dataclasses.dataclass(frozen=True)
class GraphFiles:
    graph: Path  # the .onnx file
    data: Path  # its one external data file
    weight_bytes: int  # payload of the data file (without alignment padding)
    quantized: tuple[str, ...] = ()  # the weights stored as MatMulNBits (names as in the graph)
    float_linear: tuple[str, ...] = ()  # with `quant`, the ones left float (K % block_size)
    kernel_weights: tuple[str, ...] = ()  # checkpoint names multiplied by ortspec.Q4Gemm
    op_types: frozenset[str] = frozenset()  # the graph's node types



def build_decoder(spec: DecoderSpec, options: GraphOptions, get_weight: GetWeight,
                  rope_cos: np.ndarray, rope_sin: np.ndarray, *, graph_path: Path,
                  data_path: Path, on_layer: Callable[[int], None] | None = None,
                  local_rope: tuple[np.ndarray, np.ndarray] | None = None) -> GraphFiles:
    """Write `graph_path` and its weights `data_path` (same directory).

    rope_cos, rope_sin: [capacity, rotary_dims // 2] float32 (rotary_dims = head_dim unless
    the rotary is partial), cos/sin of position * inv_freq (times the RoPE attention scaling),
    exactly as the PyTorch model computes them. local_rope: the same for the sliding layers,
    when spec.local_rope says they have their own (Gemma 3).
    """
    half = spec.rotary_dims // 2
    tables = [rope_cos, rope_sin, *(local_rope or ())]
    if any(t.shape != (options.capacity, half) for t in tables):
        raise ValueError(f"rope caches must be [{options.capacity}, {half}], "
                         f"got {', '.join(str(t.shape) for t in tables)}")
    if spec.local_rope != (local_rope is not None):
        raise ValueError("local_rope tables are needed exactly when spec.local_rope is set")
    check_opset(options.attention, options.opset)
    if options.cache_dtype not in ONNX_DTYPES:
        raise ValueError(f"kv_dtype must be one of {tuple(ONNX_DTYPES)} or None, got "
                         f"{options.kv_dtype!r}")
    if options.cache_dtype != options.dtype and not half_cache(options):
        raise ValueError(f"a {options.cache_dtype} KV cache under {options.dtype} activations "
                         f"needs a graph attending with ortspec's kernels (int4 weights on "
                         f"kernel 'ortspec', window or gqa attention)")
    if options.quant is not None and options.attention == "standard":
        raise ValueError("quantized weights (MatMulNBits, a com.microsoft op) need the gqa or "
                         "window attention flavour")
    if not all(0 <= i < spec.num_layers for i in options.hidden_state_layers):
        raise ValueError(f"hidden_state_layers {options.hidden_state_layers} must lie in "
                         f"0..{spec.num_layers - 1}")
    flavour = FLAVOURS[options.attention]
    with ExternalDataWriter(data_path) as writer:
        b = GraphBuilder(spec, options, get_weight, writer)
        b.add_tensor("rope_cos", rope_cos)
        b.add_tensor("rope_sin", rope_sin)
        if local_rope is not None:
            b.add_tensor("rope_cos_local", local_rope[0])
            b.add_tensor("rope_sin_local", local_rope[1])
        context = flavour.preamble(b)
        # [B, S, hidden], or packed: [M, hidden], the positions token_rows names
        x = b.embedding(pack_tokens(b, context) if flavour.packed else gio.INPUT_IDS)
        # block-min layers run on rows [B * S, hidden] (their offsets are a Gemm, which is
        # 2-D); only the attention sees [B, S, ...]. The other schemes keep [B, S, hidden]: a
        # Reshape each side of the attention costs its dispatch (~3% of an int4 step)
        flat = options.quant is not None and options.quant.scheme == "block-min" \
            and not flavour.packed
        if flat:
            x = b.g.op1("Reshape", [x, b.g.const("shape_rows_hidden",
                                                 np.array([-1, spec.hidden_size], np.int64))])
        grid_qkv: str | None = None  # the [B, S, qkv] shape, made once a layer reshapes
        if spec.embed_scale != 1.0:  # Gemma: times sqrt(hidden), in the weights' dtype
            x = b.g.op1("Mul", [x, b.g.const("embed_scale", np.array(
                spec.embed_scale, NUMPY_DTYPES[options.dtype]))])
        residual = None
        states: dict[int, str] = {}  # layer id -> the residual stream entering that layer
        for i in range(spec.num_layers):
            p = f"layers.{i}."
            h, residual = b.norm(x, residual, p + "attn_norm")
            if i in options.hidden_state_layers:  # the norm's own sum: no node added
                states[i] = residual
            qkv = b.linear(h, [p + "q", p + "k", p + "v"],
                           [p + "q_bias", p + "k_bias", p + "v_bias"], fused=p + "qkv")
            if flat and rotary_cache_layer(b, i):  # flat rows in, flat rows out
                attn = attend_rows(b, i, qkv, context)  # [B * S, heads * head_dim]
            else:
                if flat:
                    if grid_qkv is None:
                        grid_qkv = b.g.op1("Concat", [b.g.op1("Shape", [gio.INPUT_IDS]), b.g.const(
                            f"width_{spec.qkv_dim}", np.array([spec.qkv_dim], np.int64))], axis=0)
                    qkv = b.g.op1("Reshape", [qkv, grid_qkv])  # [B, S, qkv_dim]
                attn = flavour.attention(b, i, qkv, context)  # [B, S | M, heads * head_dim]
                if flat:
                    attn = b.g.op1("Reshape", [attn, b.g.const(
                        "shape_rows_attn", np.array([-1, spec.num_heads * spec.head_dim],
                                                    np.int64))])  # [B * S, heads * head_dim]
            o = b.linear(attn, [p + "o"], [p + "o_bias"])
            if spec.sandwich_norms:
                o, _ = b.norm(o, None, p + "post_attn_norm")
            h, residual = b.norm(o, residual, p + "mlp_norm")
            act = b.swiglu(h, [p + "gate", p + "up"], [p + "gate_bias", p + "up_bias"],
                           fused=p + "gate_up") if spec.mlp_act == "silu" else None
            if act is None:
                if options.quant is None:
                    gate = b.linear(h, [p + "gate"], [p + "gate_bias"])
                    up = b.linear(h, [p + "up"], [p + "up_bias"])
                else:  # one MatMulNBits call (and one block-sum product) for both
                    gate_up = b.linear(h, [p + "gate", p + "up"],
                                       [p + "gate_bias", p + "up_bias"], fused=p + "gate_up")
                    half = b.g.const("gate_up_split", np.array([spec.intermediate_size] * 2,
                                                               np.int64))
                    gate, up = b.g.op("Split", [gate_up, half], 2, axis=-1)
                act = b.g.op1("Mul", [mlp_activation(b, gate), up])
            x = b.linear(act, [p + "down"], [p + "down_bias"])  # act(gate) * up -> down
            if spec.sandwich_norms:
                x, _ = b.norm(x, None, p + "post_mlp_norm")
            if on_layer is not None:
                on_layer(i)
        h, _ = b.norm(x, residual, "norm")
        if flavour.packed:  # logit_rows are grid positions
            h = to_grid(b, h, spec.hidden_size, context)
        b.lm_head(h)
        if options.hidden_state_layers:
            hidden_states_output(b, [states[i] for i in options.hidden_state_layers],
                                 to_grid=(lambda t, w: to_grid(b, t, w, context))
                                 if flavour.packed else None)
        weight_bytes = writer.bytes_written

    if options.quant is not None and options.quant.kernel == "ortspec":
        b.g.nodes = fuse_skip_norms(b.g.nodes)
    model = _make_model(spec, options, b.g, b.inits)
    graph_path.write_bytes(model.SerializeToString())
    return GraphFiles(graph=graph_path, data=data_path, weight_bytes=weight_bytes,
                      quantized=tuple(b.quantized), float_linear=tuple(b.float_linear),
                      kernel_weights=tuple(b.kernel_weights),
                      op_types=frozenset(n.op_type for n in model.graph.node))


def mlp_activation(b: GraphBuilder, gate: str) -> str:
    """The MLP's gate activation: SiLU as x * sigmoid(x), or GELU with the tanh approximation
    (ONNX Gelu from opset 20, onnxruntime's FastGelu below that)."""
    g = b.g
    if b.spec.mlp_act == "silu":
        return g.op1("Mul", [gate, g.op1("Sigmoid", [gate])])
    if b.options.opset >= 20:
        return g.op1("Gelu", [gate], approximate="tanh")
    return g.op1("FastGelu", [gate], domain=MS)


def _make_model(spec: DecoderSpec, options: GraphOptions, g: NodeList,
                inits: list[TensorProto]) -> onnx.ModelProto:
    kv_type = ONNX_DTYPES[options.cache_dtype]
    batch = "batch"  # B rows, each with its own valid length (its mask row's sum)
    kv_shape = [batch, spec.num_kv_heads, options.capacity, spec.head_dim]
    inputs = [
        helper.make_tensor_value_info(gio.INPUT_IDS, TensorProto.INT64, [batch, "sequence_length"]),
        helper.make_tensor_value_info(gio.ATTENTION_MASK, TensorProto.INT64,
                                      [batch, "total_sequence_length"]),
        helper.make_tensor_value_info(gio.LOGIT_ROWS, TensorProto.INT64, ["logit_rows"]),
    ]
    if FLAVOURS[options.attention].packed:
        inputs.append(helper.make_tensor_value_info(gio.TOKEN_ROWS, TensorProto.INT64,
                                                    ["token_rows"]))
    outputs = [helper.make_tensor_value_info(gio.LOGITS, TensorProto.FLOAT,
                                             ["logit_rows", spec.vocab_size])]
    if options.hidden_state_layers:
        width = len(options.hidden_state_layers) * spec.hidden_size
        outputs.append(helper.make_tensor_value_info(gio.HIDDEN_STATES, TensorProto.FLOAT,
                                                     ["logit_rows", width]))
    for i in range(spec.num_layers):
        for past, present in ((gio.past_key_name(i), gio.present_key_name(i)),
                              (gio.past_value_name(i), gio.present_value_name(i))):
            inputs.append(helper.make_tensor_value_info(past, kv_type, kv_shape))
            outputs.append(helper.make_tensor_value_info(present, kv_type, kv_shape))
    graph = helper.make_graph(g.nodes, "ortspec_decoder", inputs, outputs,
                              initializer=[*g.initializers, *inits])
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", options.opset)]
        + ([helper.make_opsetid(MS, 1)] if options.attention != "standard" else [])
        + ([helper.make_opsetid(ORTSPEC_DOMAIN, 1)]
           if options.quant is not None and options.quant.kernel == "ortspec" else []),
        producer_name="ortspec.export",
    )
    model.ir_version = min(model.ir_version, 10)  # onnxruntime 1.20+ reads IR 10
    return model
