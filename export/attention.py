"""The three ways the decoder graph attends over its fixed-capacity KV buffers.

All read the same graph inputs (the mask's width is past + S) and write the new keys and
values into `present.{i}.*` at positions past..past+S-1, in place when the runtime binds one
buffer as past and present.

- "gqa" (the default, for the CPU and CUDA EPs): onnxruntime's fused `GroupQueryAttention`
  contrib op, rotary embedding included; it attends over the valid length only. On ortspec's
  kernels at opset 24 (the int4 default) the rotary and cache writes are "standard"'s and one
  ortspec.CacheAttention node a layer attends, as in "window" (`attends_with_cache`).
- "standard" (for TensorRT, which does not import GQA): ONNX opset-24 ops only.
  `RotaryEmbedding` with explicit positions, `TensorScatter` to write the new keys/values into
  the cache, and `Attention` over the whole cache with a boolean mask that hides positions
  beyond each query's own (and `nonpad_kv_seqlen` = the valid length).
- "window" (the batched CPU graph: B rows, each its own past): as "standard" for the rotary and
  the cache writes, then per KV head two MatMuls (scores, then probabilities times values)
  over the first W cache slots only, W the longest row's past + S, for all of the head's
  group of query heads at once. On ortspec's kernels (WeightQuant.kernel "ortspec") one
  ortspec.CacheAttention node a layer attends instead: each packed row's queries over its own
  row of the cache, read in place up to the row's position.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
from onnx import TensorProto, numpy_helper

from ortspec.runtime.ort import graph_io as gio
from ortspec.runtime.ort.manifest import CACHE_ATTENTION_OP

from .builder import GraphBuilder
from .graph_spec import MS, NUMPY_DTYPES, ORTSPEC_DOMAIN, GraphOptions


@dataclasses.dataclass(frozen=True)
class Flavour:
    preamble: Callable[[GraphBuilder], dict[str, str]]  # graph-wide tensors the layers share
    # (builder, layer, qkv, preamble) -> [B, S, heads * hd], or [M, heads * hd] when packed
    attention: Callable[[GraphBuilder, int, str, dict[str, str]], str]
    # the layers run on the M positions `token_rows` names ([M, hidden], see `pack_tokens`);
    # only the attention sees the [B, S] grid
    packed: bool = False


# -- GroupQueryAttention ------------------------------------------------------------------------


def _gqa_preamble(b: GraphBuilder) -> dict[str, str]:
    """On ortspec's kernels (`attends_with_cache`): the rows' positions and the token rows, every
    position of the call ([B * S], B = 1 here), for ortspec.CacheAttention. Else:

    seqlens_k = row sum of the mask - 1 (int32 [1]); total_sequence_length = mask width.

    With GraphOptions.pad_lone_query, a call of S = 1 attends as a call of two tokens: both
    count one more ("extra" = max(2 - S, 0)), and "q_pads" pads the [B, S, qkv] input with a
    copy of its last row ("seq" is S, to drop the copy's output after). onnxruntime 1.32's CPU
    GroupQueryAttention computes one query row on another path than a row among several (3e-8
    apart in layer 0; through int8-rounded activations 0.5-0.7 logits at the LM head), while
    from two rows on a row's output is the same whatever S is."""
    g = b.g
    if attends_with_cache(b.options):
        ctx = _row_preamble(b, None)
        count = g.op1("Size", [gio.INPUT_IDS])  # B * S
        ctx["token_rows"] = g.op1("Range", [g.const("zero_i64", np.array(0, np.int64)), count,
                                            g.const("one_i64", np.array(1, np.int64))])  # [B * S]
        return ctx
    axes = g.const("axes_1", np.array([1], np.int64))
    mask_sum = g.op1("ReduceSum", [gio.ATTENTION_MASK, axes], keepdims=0)  # int64 [1]
    width = g.op1("Shape", [gio.ATTENTION_MASK], start=1, end=2)  # int64 [1]
    ctx = {}
    back = g.const("one_i64", np.array(1, np.int64))  # seqlens_k = mask_sum - back
    if b.options.pad_lone_query:
        s = g.op1("Shape", [gio.INPUT_IDS], start=1, end=2)  # [1]: S
        extra = _lone_query_extra(b, s)
        back = g.op1("Sub", [back, extra])  # 1 - extra
        width = g.op1("Add", [width, extra])
        ctx["q_pads"] = g.op1("Concat", [g.const("zeros_4", np.zeros(4, np.int64)), extra,
                                         g.const("zero_1d", np.array([0], np.int64))], axis=0)
        ctx["seq"] = s
    seqlens_k = g.op1("Cast", [g.op1("Sub", [mask_sum, back])], to=TensorProto.INT32)
    total = g.op1("Cast", [g.op1("Squeeze", [width])], to=TensorProto.INT32)
    return {"seqlens_k": seqlens_k, "total": total, **ctx}


def _lone_query_extra(b: GraphBuilder, s: str) -> str:
    """[1] int64: the query rows a call of S tokens (`s`, [1]) is padded by, 1 if S = 1 else 0."""
    g = b.g
    return g.op1("Max", [g.op1("Sub", [g.const("two_1d", np.array([2], np.int64)), s]),
                         g.const("zero_1d", np.array([0], np.int64))])


def _gqa_attention(b: GraphBuilder, i: int, qkv: str, ctx: dict[str, str]) -> str:
    spec = b.spec
    if attends_with_cache(b.options):  # [B * S, heads * hd] -> [B, S, heads * hd]
        y = _attend_cache(b, i, qkv, ctx, rows=ctx["token_rows"])
        if "attn_shape" not in ctx:  # made on first use: a graph on flat rows needs none
            q_dim = spec.num_heads * spec.head_dim
            ctx["attn_shape"] = b.g.op1("Concat", [b.g.op1("Shape", [gio.INPUT_IDS]), b.g.const(
                f"width_{q_dim}", np.array([q_dim], np.int64))], axis=0)  # [3]: B, S, q_dim
        return b.g.op1("Reshape", [y, ctx["attn_shape"]])
    if "q_pads" in ctx:  # [B, S', qkv]: a lone token twice (see _gqa_preamble)
        qkv = b.g.op1("Pad", [qkv, ctx["q_pads"]], mode="edge")
    inputs = [qkv, "", ""]  # packed q, k, v
    if spec.qk_norm:  # the per-head norms come before the rotary, which GQA applies itself
        q, k, v = _split_qkv(b, qkv)
        inputs = [b.head_norm(q, spec.num_heads, f"layers.{i}.q_norm"),
                  b.head_norm(k, spec.num_kv_heads, f"layers.{i}.k_norm"), v]
    rope = spec.uses_rope(i)
    # transformers' window W lets a query see itself and the W - 1 positions before it; ORT
    # 1.32's CPU GroupQueryAttention with local_window_size W attends over the same W keys
    # (step and verify blocks alike: tests/export/test_export_architectures.py)
    window = spec.window(i)
    attn, _, _ = b.g.op(
        "GroupQueryAttention",
        [*inputs, gio.past_key_name(i), gio.past_value_name(i), ctx["seqlens_k"],
         ctx["total"], *(spec.rope_tables(i) if rope else ())],
        3, domain=MS, name=f"layers.{i}.attn",
        outputs=[f"layers.{i}.attn/out0", gio.present_key_name(i), gio.present_value_name(i)],
        num_heads=spec.num_heads, kv_num_heads=spec.num_kv_heads,
        scale=float(spec.attention_scale), do_rotary=int(rope), rotary_interleaved=0,
        local_window_size=window if window else -1,
        **({"softcap": float(spec.attn_softcap)} if spec.attn_softcap else {}),
    )
    if "q_pads" in ctx:  # [B, S, heads * hd]: the copy's row dropped
        attn = b.g.op1("Slice", [attn, b.g.const("zero_1d", np.array([0], np.int64)),
                                 ctx["seq"], b.g.const("axes_1", np.array([1], np.int64))])
    return attn


def _split_qkv(b: GraphBuilder, qkv: str) -> list[str]:
    """[1, S, (heads + 2 kv_heads) * hd] -> q [1, S, heads * hd], k, v [1, S, kv_heads * hd]."""
    spec = b.spec
    q_dim, kv_dim = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    sizes = b.g.const("qkv_split", np.array([q_dim, kv_dim, kv_dim], np.int64))
    return b.g.op("Split", [qkv, sizes], 3, axis=-1)


# -- standard ONNX ops ----------------------------------------------------------------------------


def _row_preamble(b: GraphBuilder, slots: str | None, *, pad_lone_query: bool = False
                  ) -> dict[str, str]:
    """Per-row positions from the mask: row r holds past_r + S ones, so its new tokens sit at
    past_r .. past_r + S - 1 (rows of one call may have different pasts); and the causal mask
    over the key slots `slots` (an int64 tensor of slot numbers that broadcasts against
    [B, S, 1]): query s of row r sees slot j when j <= its own position.

    slots None: the positions alone, no mask (ortspec.CacheAttention reads the positions).

    pad_lone_query: the attention's queries are S' = max(S, 2) (see `_window_preamble`): the
    masks, and "positions" they are made from, cover S' queries, the last copied at S = 1;
    "q_pads" pads [B, heads, S, hd] queries alike and "seq" is S, to drop the copy after."""
    g = b.g
    axis0 = g.const("axes_0", np.array([0], np.int64))
    axis1 = g.const("axes_1", np.array([1], np.int64))
    valid = g.op1("ReduceSum", [gio.ATTENTION_MASK, axis1], keepdims=0)  # [B]: past_r + S
    s = g.op1("Shape", [gio.INPUT_IDS], start=1, end=2)  # [1]: S
    past = g.op1("Sub", [valid, s])  # [B]
    zero = g.const("zero_i64", np.array(0, np.int64))
    one = g.const("one_i64", np.array(1, np.int64))
    steps = g.op1("Range", [zero, g.op1("Squeeze", [s, axis0]), one])  # [S]: 0 .. S - 1
    positions = g.op1("Add", [g.op1("Unsqueeze", [past, axis1]),
                              g.op1("Unsqueeze", [steps, axis0])])  # [B, S]
    ctx = {
        "position_ids": positions,  # [B, S]
        "write_index": past,  # [B]: where each row's new rows go
        "valid": valid,  # [B]: nonpad_kv_seqlen
        "slots": slots,
    }
    if slots is None:
        return ctx
    queries = positions
    if pad_lone_query:
        zero_1d = g.const("zero_1d", np.array([0], np.int64))
        extra = _lone_query_extra(b, s)
        queries = g.op1("Pad", [positions, g.op1("Concat", [
            g.const("zeros_3", np.zeros(3, np.int64)), extra], axis=0)], mode="edge")  # [B, S']
        ctx["q_pads"] = g.op1("Concat", [g.const("zeros_6", np.zeros(6, np.int64)), extra,
                                         zero_1d], axis=0)  # pads of [B, heads, S, hd]
        ctx["seq"] = s
    axis_last = g.const("axes_last", np.array([-1], np.int64))
    mask = g.op1("LessOrEqual", [slots, g.op1("Unsqueeze", [queries, axis_last])])
    ctx["positions"] = queries  # [B, S'] (S' = S unless pad_lone_query)
    ctx["mask"] = g.op1("Unsqueeze", [mask, axis1])  # [B, 1, S', slots]
    return ctx


def _standard_preamble(b: GraphBuilder) -> dict[str, str]:
    """The mask covers the whole capacity (TensorRT's profiles want static key lengths)."""
    cap = b.options.capacity
    return _row_preamble(b, b.g.const("kv_slots", np.arange(cap, dtype=np.int64)[None, None, :]))


def _heads_first(b: GraphBuilder, x: str, heads: int) -> str:
    """[B, S, heads * hd] -> [B, heads, S, hd]."""
    shape = b.g.const(f"shape_heads_{heads}", np.array([0, -1, heads, b.spec.head_dim], np.int64))
    return b.g.op1("Transpose", [b.g.op1("Reshape", [x, shape])], perm=[0, 2, 1, 3])


def _window_mask(b: GraphBuilder, window: int, ctx: dict[str, str]) -> str:
    """The causal mask narrowed to a sliding window: query s sees key slot j when
    position(s) - window < j <= position(s). Made once per window size."""
    name = f"mask_window_{window}"
    if name not in ctx:
        g = b.g
        w = g.const(f"window_{window}", np.array(window, np.int64))
        start = g.op1("Unsqueeze", [g.op1("Sub", [ctx["positions"], w]),
                                    g.const("axes_last", np.array([-1], np.int64))])  # [B, S, 1]
        band = g.op1("Greater", [ctx["slots"], start])  # [B, S, slots]
        ctx[name] = g.op1("And", [ctx["mask"], g.op1(
            "Unsqueeze", [band, g.const("axes_1", np.array([1], np.int64))])])
    return ctx[name]


def _rotate_and_store(b: GraphBuilder, i: int, qkv: str, ctx: dict[str, str]
                      ) -> tuple[str, str, str]:
    """Layer i's queries (q/k norms and rotary applied) [B, S, heads * hd], and the cache
    tensors after the new keys and values went in at each row's past..past+S-1 (present is
    the same buffer as past): (q, present key, present value)."""
    g, spec = b.g, b.spec
    q, k, v = _split_qkv(b, qkv)
    if spec.qk_norm:
        q = b.head_norm(q, spec.num_heads, f"layers.{i}.q_norm")
        k = b.head_norm(k, spec.num_kv_heads, f"layers.{i}.k_norm")
    if spec.uses_rope(i):
        rope: dict[str, Any] = {"interleaved": 0}
        if spec.rotary_dims != spec.head_dim:
            rope["rotary_embedding_dim"] = spec.rotary_dims
        cos, sin = spec.rope_tables(i)
        q = g.op1("RotaryEmbedding", [q, cos, sin, ctx["position_ids"]],
                  num_heads=spec.num_heads, **rope)
        k = g.op1("RotaryEmbedding", [k, cos, sin, ctx["position_ids"]],
                  num_heads=spec.num_kv_heads, **rope)
    key, value = gio.present_key_name(i), gio.present_value_name(i)
    if half_cache(b.options):  # stored rounded to nearest, as the ...16 ops store
        k = g.op1("Cast", [k], to=TensorProto.FLOAT16)
        v = g.op1("Cast", [v], to=TensorProto.FLOAT16)
    g.op("TensorScatter", [gio.past_key_name(i), _heads_first(b, k, spec.num_kv_heads),
                           ctx["write_index"]], outputs=[key], axis=2)
    g.op("TensorScatter", [gio.past_value_name(i), _heads_first(b, v, spec.num_kv_heads),
                           ctx["write_index"]], outputs=[value], axis=2)
    return q, key, value


def _standard_attention(b: GraphBuilder, i: int, qkv: str, ctx: dict[str, str]) -> str:
    g, spec = b.g, b.spec
    q_dim = spec.num_heads * spec.head_dim
    q, key, value = _rotate_and_store(b, i, qkv, ctx)
    window = spec.window(i)
    mask = _window_mask(b, window, ctx) if window else ctx["mask"]
    y = g.op1("Attention", [_heads_first(b, q, spec.num_heads), key, value, mask, "", "",
                            ctx["valid"]], scale=float(spec.attention_scale), is_causal=0,
              **({"softcap": float(spec.attn_softcap)} if spec.attn_softcap else {}))
    flat = g.const("shape_rows_attn", np.array([0, -1, q_dim], np.int64))
    return g.op1("Reshape", [g.op1("Transpose", [y], perm=[0, 2, 1, 3]), flat])  # [B, S, q_dim]


# -- standard ONNX ops over the valid window only (the batched CPU graph) --------------------------


def _window_preamble(b: GraphBuilder) -> dict[str, str]:
    """As the standard preamble, but the mask covers the first W key slots only, W the mask's
    width (the longest row's past + S): attention reads [B, kv_heads, W, hd], not the capacity.

    The attention is two MatMuls per KV head over the queries of its whole group, G = heads /
    kv_heads of them per token, so a call multiplies S * G query rows by each head's keys.
    ONNX Runtime's float MatMul computes a single row (M = 1, alpha 1) on a GEMV path that
    rounds differently from several; from two rows on a row's result is bitwise independent
    of the other rows and of the keys past its own position (their probabilities are exact
    zeros). With G >= 2 a one-token call thus needs no padding; with G = 1 (one query head a
    KV head) the attention runs a lone query on two copies of it (Pad, edge mode), the mask
    row copied alike, and drops the copy's output.

    "mask_rows" is the causal mask as the grouped rows see it: [B, 1, S' * G, W]. An export on
    ortspec's kernels attends with ortspec.CacheAttention instead (`_cache_attention`), which
    needs the rows' positions alone."""
    g, spec = b.g, b.spec
    grid_qkv_shape = g.op1("Concat", [g.op1("Shape", [gio.INPUT_IDS]), g.const(
        f"width_{spec.qkv_dim}", np.array([spec.qkv_dim], np.int64))], axis=0)  # [3]: B, S, qkv
    if attends_with_cache(b.options):
        return {**_row_preamble(b, None), "grid_qkv_shape": grid_qkv_shape}
    width = g.op1("Shape", [gio.ATTENTION_MASK], start=1, end=2)  # [1]: W
    zero = g.const("zero_i64", np.array(0, np.int64))
    one = g.const("one_i64", np.array(1, np.int64))
    axis0 = g.const("axes_0", np.array([0], np.int64))
    slots = g.op1("Range", [zero, g.op1("Squeeze", [width, axis0]), one])  # [W]
    ctx = {**_row_preamble(b, slots, pad_lone_query=spec.query_group == 1), "width": width}
    ctx["mask_rows"] = _mask_rows(b, ctx["mask"], width)
    ctx["grid_qkv_shape"] = grid_qkv_shape
    return ctx


def pack_tokens(b: GraphBuilder, ctx: dict[str, str]) -> str:
    """The packed graph's token ids: input_ids [B, S] at the flat positions `token_rows`
    names, [M]. Also records in ctx what `to_grid` needs."""
    g = b.g
    axis_last = g.const("axes_last", np.array([-1], np.int64))
    ctx["token_index"] = g.op1("Unsqueeze", [gio.TOKEN_ROWS, axis_last])  # [M, 1]
    flat = g.op1("Reshape", [gio.INPUT_IDS, g.const("shape_flat", np.array([-1], np.int64))])
    ctx["grid_rows"] = g.op1("Shape", [flat])  # [1]: B * S
    return g.op1("Gather", [flat, gio.TOKEN_ROWS], axis=0)  # [M]


def to_grid(b: GraphBuilder, x: str, width: int, ctx: dict[str, str]) -> str:
    """Packed rows x [M, width] back on the call's grid: [B * S, width], zeros at the
    positions `token_rows` leaves out (padding, rows riding along)."""
    g = b.g
    name = f"grid_zeros_{width}"
    if name not in ctx:  # made once: ScatterND writes its result elsewhere
        shape = g.op1("Concat", [ctx["grid_rows"], g.const(f"width_{width}", np.array(
            [width], np.int64))], axis=0)
        zero = np.zeros(1, NUMPY_DTYPES[b.options.dtype])
        ctx[name] = g.op1("ConstantOfShape", [shape], value=numpy_helper.from_array(zero))
    return g.op1("ScatterND", [ctx[name], ctx["token_index"], x])


def _group_rows(b: GraphBuilder, q: str, ctx: dict[str, str]) -> str:
    """[B, S, heads * hd] -> [B, kv_heads, S' * G, hd], row s * G + j of KV head h being query
    head h * G + j at token s (S' = S, or 2 for a lone token when G = 1)."""
    g, spec = b.g, b.spec
    group = spec.query_group
    if group == 1:
        return g.op1("Pad", [_heads_first(b, q, spec.num_heads), ctx["q_pads"]], mode="edge")
    hd, kv = spec.head_dim, spec.num_kv_heads
    split = g.const("shape_q_groups", np.array([0, 0, kv, group, hd], np.int64))
    grouped = g.op1("Transpose", [g.op1("Reshape", [q, split])], perm=[0, 2, 1, 3, 4])
    return g.op1("Reshape", [grouped, g.const("shape_q_rows", np.array([0, kv, -1, hd], np.int64))])


def _window_attention(b: GraphBuilder, i: int, qkv: str, ctx: dict[str, str]) -> str:
    """qkv [M, (heads + 2 kv_heads) * hd], the packed rows -> [M, heads * hd]. The grid's
    other positions attend with zero queries, keys and values, written past their rows' valid
    lengths, and their outputs are dropped."""
    g, spec = b.g, b.spec
    q_dim, hd, kv = spec.num_heads * spec.head_dim, spec.head_dim, spec.num_kv_heads
    group = spec.query_group
    grid = g.op1("Reshape", [to_grid(b, qkv, spec.qkv_dim, ctx), ctx["grid_qkv_shape"]])
    if attends_with_cache(b.options):
        return _attend_cache(b, i, grid, ctx, rows=gio.TOKEN_ROWS)
    q, key, value = _rotate_and_store(b, i, grid, ctx)
    zero = g.const("axes_0_start", np.array([0], np.int64))
    axis2 = g.const("axes_2", np.array([2], np.int64))
    key_w = g.op1("Slice", [key, zero, ctx["width"], axis2])  # [B, kv_heads, W, hd]
    value_w = g.op1("Slice", [value, zero, ctx["width"], axis2])
    rows = g.op1("Mul", [_group_rows(b, q, ctx), g.const(
        "attn_scale", np.array(spec.attention_scale, np.float32))])  # [B, kv, S'G, hd]
    scores = g.op1("MatMul", [rows, g.op1("Transpose", [key_w], perm=[0, 1, 3, 2])])
    if spec.attn_softcap:  # [B, kv, S'G, W]
        cap = g.const(f"softcap_{i}", np.array(spec.attn_softcap, np.float32))
        scores = g.op1("Mul", [g.op1("Tanh", [g.op1("Div", [scores, cap])]), cap])
    window = spec.window(i)
    mask = _window_rows_mask(b, window, ctx) if window else ctx["mask_rows"]
    hidden = g.const("masked_score", np.array(np.finfo(np.float32).min, np.float32))
    probs = g.op1("Softmax", [g.op1("Where", [mask, scores, hidden])], axis=-1)
    y = g.op1("MatMul", [probs, value_w])  # [B, kv, S'G, hd]
    if group == 1:
        y = g.op1("Slice", [y, zero, ctx["seq"], axis2])  # [B, heads, S, hd]: the copy dropped
        y = g.op1("Transpose", [y], perm=[0, 2, 1, 3])
    else:
        y = g.op1("Reshape", [y, g.const("shape_y_groups", np.array([0, kv, -1, group, hd],
                                                                     np.int64))])
        y = g.op1("Transpose", [y], perm=[0, 2, 1, 3, 4])  # [B, S, kv, G, hd]
    flat = g.const("shape_rows_attn_flat", np.array([-1, q_dim], np.int64))
    return g.op1("Gather", [g.op1("Reshape", [y, flat]), gio.TOKEN_ROWS], axis=0)  # [M, q_dim]


CACHE_ATTENTION_OPSET = 24  # RotaryEmbedding (23) and TensorScatter (24), which it needs
# manifest extra.attention: the op that attends (revision 4 and earlier window exports: "Attention")
ATTENTION_OPS = {"gqa": "GroupQueryAttention", "standard": "Attention", "window": "MatMul"}
# ortspec.CacheAttention with the rotary and the cache writes inside (`_attend_cache`)
ROTARY_CACHE_ATTENTION_OP = "RotaryCacheAttention"


# ... each also in a float16-cache version, the name and this suffix (`half_cache`)
HALF_CACHE_SUFFIX = "16"


def attention_op(attention: str, op_types: Iterable[str]) -> str:
    """Manifest extra.attention of a graph of flavour `attention` made of `op_types`:
    ortspec.CacheAttention where it attends with it (either cache type), else the flavour's op."""
    cache = {name + suffix for name in (CACHE_ATTENTION_OP, ROTARY_CACHE_ATTENTION_OP)
             for suffix in ("", HALF_CACHE_SUFFIX)}
    return CACHE_ATTENTION_OP if not cache.isdisjoint(op_types) else ATTENTION_OPS[attention]


def half_cache(options: GraphOptions) -> bool:
    """Whether a graph keeps a float16 KV cache under float32 activations: one attending with
    ortspec's kernels (`attends_with_cache`) asked for it (GraphOptions.kv_dtype). Its
    attention nodes are the ...16 ops, which store the keys and values a call computes
    rounded to float16 and widen what they read to float32."""
    return options.cache_dtype == "fp16" and options.dtype == "fp32" and attends_with_cache(options)


def _cache_op(b: GraphBuilder, name: str) -> str:
    """The ortspec op `name` (CacheAttention or RotaryCacheAttention) in the graph's cache type:
    its float16-cache version where the graph keeps one (`half_cache`)."""
    return name + (HALF_CACHE_SUFFIX if half_cache(b.options) else "")


def attends_with_cache(options: GraphOptions) -> bool:
    """Whether a graph attends with ortspec.CacheAttention: a window or (at opset 24 and above)
    gqa graph whose products run on ortspec's kernels (WeightQuant.kernel "ortspec"), which
    registers the same library. Its rows compute alike at every call size: a gqa graph pads no
    lone query (`min_attention_rows` 1)."""
    return (options.quant is not None and options.quant.kernel == "ortspec"
            and (options.attention == "window" or options.attention == "gqa"
                 and options.opset >= CACHE_ATTENTION_OPSET))


def rotary_cache_layer(b: GraphBuilder, i: int) -> bool:
    """Whether layer i attends with one ortspec.RotaryCacheAttention node (`_attend_cache`)."""
    return attends_with_cache(b.options) and b.spec.uses_rope(i) and not b.spec.qk_norm


def attend_rows(b: GraphBuilder, i: int, qkv: str, ctx: dict[str, str]) -> str:
    """A gqa layer that is a `rotary_cache_layer` on flat rows: qkv [S, qkv] (B = 1, which the
    op reads as [1, S, qkv]) -> [S, heads * hd], with no Reshape either side."""
    assert rotary_cache_layer(b, i)
    return _attend_cache(b, i, qkv, ctx, rows=ctx["token_rows"])


def _attend_cache(b: GraphBuilder, i: int, qkv: str, ctx: dict[str, str], *, rows: str) -> str:
    """Layer i's attention on ortspec's kernels from its packed q, k, v [B, S, qkv] (before the
    rotary), the outputs of the token rows `rows`: [M, heads * hd]. A layer that rotates and
    has no q/k norms runs one ortspec.RotaryCacheAttention node (the rotary, the cache writes
    and the attention, with no split, transpose or scatter between them); else the standard
    nodes rotate and store, and ortspec.CacheAttention attends."""
    spec = b.spec
    if spec.uses_rope(i) and not spec.qk_norm:
        attrs = _cache_attention_attrs(b, i)
        attrs["rotary_dim"] = int(spec.rotary_dims)
        y, _, _ = b.g.op(
            _cache_op(b, ROTARY_CACHE_ATTENTION_OP),
            [qkv, gio.past_key_name(i), gio.past_value_name(i), ctx["position_ids"], rows,
             *spec.rope_tables(i)], 3, domain=ORTSPEC_DOMAIN, name=f"layers.{i}.attn",
            outputs=[f"layers.{i}.attn/out0", gio.present_key_name(i),
                     gio.present_value_name(i)], **attrs)
        return y
    q, key, value = _rotate_and_store(b, i, qkv, ctx)
    return _cache_attention(b, i, q, key, value, ctx, rows=rows)


def _cache_attention_attrs(b: GraphBuilder, i: int) -> dict[str, Any]:
    spec = b.spec
    attrs: dict[str, Any] = {"num_heads": spec.num_heads, "scale": float(spec.attention_scale)}
    if spec.attn_softcap:
        attrs["softcap"] = float(spec.attn_softcap)
    if spec.window(i):
        attrs["local_window_size"] = int(spec.window(i))
    return attrs


def _cache_attention(b: GraphBuilder, i: int, q: str, key: str, value: str,
                     ctx: dict[str, str], *, rows: str = gio.TOKEN_ROWS) -> str:
    """ortspec.CacheAttention: each packed row's query heads over its own cache row, slots 0 to
    its position (or its sliding window), read in place: no slice of the cache, no mask, no
    padded query; [M, heads * hd]. Every query is computed alone in a fixed order, so a row's
    output is the same whatever the call holds."""
    return b.g.op1(_cache_op(b, CACHE_ATTENTION_OP), [q, key, value, ctx["position_ids"], rows],
                   domain=ORTSPEC_DOMAIN, name=f"layers.{i}.attn", **_cache_attention_attrs(b, i))


def _mask_rows(b: GraphBuilder, mask: str, width: str) -> str:
    """A mask [B, 1, S', W] as the grouped queries see it: [B, 1, S' * G, W], row s * G + j
    being token s's (every query head of a group sees the same keys)."""
    g = b.g
    group = b.spec.query_group
    mask5 = g.op1("Unsqueeze", [mask, g.const("axes_3", np.array([3], np.int64))])
    expand = g.const(f"expand_group_{group}", np.array([1, 1, 1, group, 1], np.int64))
    flat = g.op1("Concat", [g.const("shape_mask_rows", np.array([0, 1, -1], np.int64)), width],
                 axis=0)  # [B, 1, S' * G, W]
    return g.op1("Reshape", [g.op1("Expand", [mask5, expand]), flat])


def _window_rows_mask(b: GraphBuilder, window: int, ctx: dict[str, str]) -> str:
    """The grouped rows' mask narrowed to a sliding window (see `_window_mask`)."""
    name = f"mask_rows_window_{window}"
    if name not in ctx:
        ctx[name] = _mask_rows(b, _window_mask(b, window, ctx), ctx["width"])
    return ctx[name]


FLAVOURS = {
    "gqa": Flavour(preamble=_gqa_preamble, attention=_gqa_attention),
    "standard": Flavour(preamble=_standard_preamble, attention=_standard_attention),
    "window": Flavour(preamble=_window_preamble, attention=_window_attention, packed=True),
}
