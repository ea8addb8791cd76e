"""An EAGLE-3 head (eagle3.Eagle3Head) as two ONNX graphs, built node by node like the target's
(graphs.py), from the same pieces (builder.GraphBuilder, attention.py's GroupQueryAttention):

- `fc.onnx`: the projection of the target's hidden states, `aux` [S, K * Ht] -> `hidden`
  [S, H] (plus the bias some speculators checkpoints have). A first step runs it, then the head
  on its output; a step fed by the head's own hidden output runs the head alone.
- `head.onnx`: the decoder layer with a fixed-capacity KV cache of its own, the final norm and
  the LM head over the draft vocabulary. For S new entries at cache positions past..past+S-1:

      input_ids [1, S] int64          target token ids of the entries
      hidden [S, H] float32           fc's output, or the head's own hidden_out
      attention_mask [1, past + S]    ones: its row sum says where to write and how far to
                                      attend, exactly as the target's (runtime/ort/decoder.py)
      past_key_values.0.key/value     [1, kv_heads, capacity, head_dim], bound in place
      -> logits [S, Vd] float32, hidden_out [S, H] float32 (the pre-norm state: the next
         entry's `hidden` when the head drafts on), present.0.key/value

  Per entry (eagle3_reference.py's forward, vLLM's llama_eagle3):

      e = SimplifiedLayerNorm(embed[input_ids], input_norm)
      h = SimplifiedLayerNorm(hidden, hidden_norm);  residual = hidden (or h: norm_before_residual)
      attn = o(GroupQueryAttention(cat(e, h) @ [q; k; v], rotary at the entry positions))
      x, residual = SkipSimplifiedLayerNorm(attn, residual, post_attn_norm)
      hidden_out = down(silu(gate(x)) * up(x)) + residual
      logits = SimplifiedLayerNorm(hidden_out, norm) @ lm_head.T

The embedding table is the head's own `embed_tokens` or, without one, a copy of the target's
(vLLM shares the target's module then): the head graph is self-contained, which costs
vocab * H * 4 bytes in its data file for a head without its own table.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper

from ortspec.runtime.errors import ExportError
from ortspec.runtime.ort import graph_io as gio
from ortspec.runtime.ort.head_config import AUX, HIDDEN, HIDDEN_OUT  # beside graph_io's names

from .attention import FLAVOURS
from .builder import GraphBuilder
from .eagle3 import Eagle3Head
from .graph_spec import MS, DecoderSpec, GraphOptions, WeightQuant
from .graphs import mlp_activation
from .onnx_writer import ExternalDataWriter
from .quantize import quantize_blockwise

FC_GRAPH, FC_DATA = "fc.onnx", "fc.onnx.data"
HEAD_GRAPH, HEAD_DATA = "head.onnx", "head.onnx.data"
OPSET = 21


@dataclasses.dataclass(frozen=True)
class HeadGraphFiles:
    """The files `build_head_graphs` wrote (names relative to its directory)."""

    files: tuple[str, ...]
    weight_bytes: int


def head_spec(head: Eagle3Head, vocab_size: int) -> DecoderSpec:
    """The head's decoder layer as a one-layer DecoderSpec (what GraphBuilder shapes by)."""
    return DecoderSpec(family="llama", num_layers=1, num_heads=head.num_heads,
                       num_kv_heads=head.num_kv_heads, head_dim=head.head_dim,
                       hidden_size=head.hidden_size, intermediate_size=head.intermediate_size,
                       vocab_size=vocab_size, rms_norm_eps=head.rms_norm_eps,
                       tied_embeddings=False, attention_scale=head.head_dim ** -0.5)


def rope_tables(head: Eagle3Head, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [capacity, head_dim // 2] float32 at positions 0..capacity-1: Llama's default
    rotary (position * theta ** (-2i / head_dim)) in NumPy, or with the config's rope_scaling
    the reference's (transformers' LlamaRotaryEmbedding under the head's config)."""
    half = head.head_dim // 2
    if head.rope_scaling is None:  # what LlamaRotaryEmbedding computes for rope_type default
        inv_freq = 1.0 / head.rope_theta ** (np.arange(0, head.head_dim, 2, dtype=np.int64)
                                             .astype(np.float32) / head.head_dim)
        angles = np.arange(capacity, dtype=np.float32)[:, None] * inv_freq[None, :]
        return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    from .eagle3_reference import rope

    cos, sin = rope(head, np.arange(capacity))  # [capacity, head_dim], rotate-half layout
    return cos[:, :half].numpy().copy(), sin[:, :half].numpy().copy()


def check_buildable(head: Eagle3Head) -> None:
    """ExportError for a head these graphs cannot hold (before any work)."""
    if head.head_dim % 16:
        raise ExportError(f"EAGLE-3 head: head_dim {head.head_dim} is not a multiple of 16, "
                          f"which onnxruntime's GroupQueryAttention requires")


def build_head_graphs(head: Eagle3Head, directory: Path, *, capacity: int,
                      embed: np.ndarray | None = None,
                      quant: WeightQuant | None = None) -> HeadGraphFiles:
    """Write fc.onnx and head.onnx (with their data files) into `directory`.

    embed: the target's embedding table [vocab, H] float32, for a head without its own
    (required then; ignored otherwise). quant: the linear weights and the LM head as
    MatMulNBits and the embedding as 8-bit GatherBlockQuantized (graph_spec.HEAD_QUANTS);
    None: float32 throughout."""
    check_buildable(head)
    table = head.embed if head.embed is not None else embed
    if table is None:
        raise ValueError("this head has no embed_tokens: pass the target's embedding table")
    table = np.asarray(table, np.float32)
    weight_bytes = _build_fc(head, directory, quant=quant)
    weight_bytes += _build_head(head, directory, capacity=capacity, table=table, quant=quant)
    return HeadGraphFiles(files=(FC_GRAPH, FC_DATA, HEAD_GRAPH, HEAD_DATA),
                          weight_bytes=weight_bytes)


def _build_fc(head: Eagle3Head, directory: Path, *, quant: WeightQuant | None) -> int:
    width = head.fc.shape[1]
    spec = head_spec(head, vocab_size=1)
    with ExternalDataWriter(directory / FC_DATA) as writer:
        b = GraphBuilder(spec, GraphOptions(capacity=1, dtype="fp32", opset=OPSET, quant=quant),
                         {"fc": head.fc}.get, writer)
        out = b.linear(AUX, ["fc"], [])  # [S, H]
        if head.fc_bias is not None:
            out = b.g.op1("Add", [out, b.add_tensor("fc_bias", head.fc_bias)])
        b.g.op("Identity", [out], name="hidden_out", outputs=[HIDDEN])
        weight_bytes = writer.bytes_written
    inputs = [helper.make_tensor_value_info(AUX, TensorProto.FLOAT, ["rows", width])]
    outputs = [helper.make_tensor_value_info(HIDDEN, TensorProto.FLOAT,
                                             ["rows", head.hidden_size])]
    _save(b, inputs, outputs, directory / FC_GRAPH, "ortspec_eagle3_fc")
    return weight_bytes


def _build_head(head: Eagle3Head, directory: Path, *, capacity: int, table: np.ndarray,
                quant: WeightQuant | None) -> int:
    spec = head_spec(head, vocab_size=table.shape[0])
    options = GraphOptions(capacity=capacity, dtype="fp32", opset=OPSET, attention="gqa",
                           quant=quant)
    weights = {"embed": table, "input_norm": head.input_norm, "hidden_norm": head.hidden_norm,
               "layers.0.q": head.q, "layers.0.k": head.k, "layers.0.v": head.v,
               "layers.0.o": head.o, "layers.0.post_attn_norm": head.post_attn_norm,
               "layers.0.gate": head.gate, "layers.0.up": head.up, "layers.0.down": head.down,
               "norm": head.norm, "lm_head": head.lm_head}
    cos, sin = rope_tables(head, capacity)
    flavour = FLAVOURS["gqa"]
    h_size = head.hidden_size
    with ExternalDataWriter(directory / HEAD_DATA) as writer:
        b = GraphBuilder(spec, options, weights.get, writer)
        g = b.g
        b.add_tensor("rope_cos", cos)
        b.add_tensor("rope_sin", sin)
        context = flavour.preamble(b)
        e, _ = b.norm(_embedding(b, table, quant), None, "input_norm")  # [1, S, H]
        hidden = g.op1("Unsqueeze", [HIDDEN, g.const("axes_0", np.array([0], np.int64))])
        h, _ = b.norm(hidden, None, "hidden_norm")  # [1, S, H]
        residual = h if head.norm_before_residual else hidden
        x = g.op1("Concat", [e, h], axis=-1)  # [1, S, 2H]
        qkv = b.linear(x, ["layers.0.q", "layers.0.k", "layers.0.v"], [], fused="layers.0.qkv")
        attn = flavour.attention(b, 0, qkv, context)  # [1, S, heads * D]
        x, residual = b.norm(b.linear(attn, ["layers.0.o"], []), residual,
                             "layers.0.post_attn_norm")
        act = g.op1("Mul", [mlp_activation(b, b.linear(x, ["layers.0.gate"], [])),
                            b.linear(x, ["layers.0.up"], [])])
        mlp = b.linear(act, ["layers.0.down"], [])
        normed, prenorm = b.norm(mlp, residual, "norm")  # the sum is hidden_out
        rows = g.const("shape_rows_hidden", np.array([-1, h_size], np.int64))
        g.op("Reshape", [prenorm, rows], name="hidden_out", outputs=[HIDDEN_OUT])  # [S, H]
        normed = g.op1("Reshape", [normed, rows])  # [S, H]
        if quant is None or h_size % quant.block_size:  # (as builder.linear leaves them)
            logits = g.op1("MatMul", [normed, b.weight("lm_head", transpose=True)])  # [S, Vd]
        else:
            logits = b.matmul_nbits(normed, b.add_quantized(
                "lm_head", head.lm_head, bits=quant.lm_head_bits, scheme=quant.lm_head_scheme))
        g.op("Identity", [logits], name="logits_out", outputs=[gio.LOGITS])
        weight_bytes = writer.bytes_written
    kv_shape = [1, head.num_kv_heads, capacity, head.head_dim]
    inputs = [
        helper.make_tensor_value_info(gio.INPUT_IDS, TensorProto.INT64, [1, "rows"]),
        helper.make_tensor_value_info(gio.ATTENTION_MASK, TensorProto.INT64,
                                      [1, "total_sequence_length"]),
        helper.make_tensor_value_info(HIDDEN, TensorProto.FLOAT, ["rows", h_size]),
    ]
    outputs = [
        helper.make_tensor_value_info(gio.LOGITS, TensorProto.FLOAT,
                                      ["rows", head.draft_vocab_size]),
        helper.make_tensor_value_info(HIDDEN_OUT, TensorProto.FLOAT, ["rows", h_size]),
    ]
    for past, present in ((gio.past_key_name(0), gio.present_key_name(0)),
                          (gio.past_value_name(0), gio.present_value_name(0))):
        inputs.append(helper.make_tensor_value_info(past, TensorProto.FLOAT, kv_shape))
        outputs.append(helper.make_tensor_value_info(present, TensorProto.FLOAT, kv_shape))
    _save(b, inputs, outputs, directory / HEAD_GRAPH, "ortspec_eagle3_head")
    return weight_bytes


def embeds_quantized(quant: WeightQuant | None, hidden_size: int) -> bool:
    """Whether a `quant` head stores its embedding table at 8 bits (GatherBlockQuantized)."""
    return quant is not None and hidden_size % quant.block_size == 0


def _embedding(b: GraphBuilder, table: np.ndarray, quant: WeightQuant | None) -> str:
    """input_ids [1, S] -> [1, S, H]: a Gather from the float table, or with `quant` a
    GatherBlockQuantized from its 8-bit symmetric blocks (uint8 levels [vocab, H] with the
    default zero point 128, scales [vocab, H / block]), the rows dequantized as gathered."""
    if not embeds_quantized(quant, table.shape[1]):
        return b.embedding(gio.INPUT_IDS)
    vocab, hidden = table.shape
    qw = quantize_blockwise(table, bits=8, block_size=quant.block_size, scheme="symmetric")
    data = b.add_raw("embed.q", qw.packed.reshape(vocab, hidden))
    scales = b.add_tensor("embed.scales", qw.scales.reshape(vocab, hidden // quant.block_size))
    return b.g.op1("GatherBlockQuantized", [data, gio.INPUT_IDS, scales], domain=MS, bits=8,
                   block_size=quant.block_size, gather_axis=0, quantize_axis=1)


def _save(b: GraphBuilder, inputs, outputs, path: Path, name: str) -> None:
    graph = helper.make_graph(b.g.nodes, name, inputs, outputs,
                              initializer=[*b.g.initializers, *b.inits])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                    helper.make_opsetid(MS, 1)],
                              producer_name="ortspec.export")
    model.ir_version = min(model.ir_version, 10)  # onnxruntime 1.20+ reads IR 10
    path.write_bytes(model.SerializeToString())
