"""The target's hidden states as an extra graph output, for EAGLE-3 draft heads.

An EAGLE-3 head reads three of the target's hidden states (a low, a middle and a high layer),
concatenates them to [3 * hidden] and projects them with its `fc`. `--hidden-states` makes the
target graph return them as the output `hidden_states`, [N, len(layers) * hidden] float32, row n
for the position `logit_rows[n]` names, exactly the rows whose logits the call computes, in the
order the layer ids are listed. Nothing is computed for the other positions: a call that does
not read them pays a Gather per layer and a Concat of N rows.

Which state a layer id k names follows vLLM and the EAGLE-3 reference code, which trained
heads are made with: the residual stream *entering* decoder layer k, i.e. the output of layer
k - 1 before any final norm. vLLM's llama.py collects `hidden_states + residual` at the top of
its loop, before layer `idx` runs, for `idx in aux_hidden_state_layers` (defaults
`get_eagle3_aux_hidden_state_layers`: (2, num_layers // 2, num_layers - 3)); SafeAILab/EAGLE's
modeling_llama_kv.py appends `hidden_states` before `decoder_layer` runs for idx 2, L // 2 and
L - 3. In transformers (5.x, `output_hidden_states=True`) that is `hidden_states[k]`: index 0
is the embedding output, index i + 1 the output of layer i (the last index is replaced by the
normed output, which is why k stops at num_layers - 1 here). Ids range over 1..num_layers - 1.

In the graph the state entering layer k is the residual sum that layer's first
SkipSimplifiedLayerNormalization already computes (its fourth output), so capturing it adds no
arithmetic; see graphs.build_decoder.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ortspec.runtime.check.tolerances import Bound, Tolerances
from ortspec.runtime.ort import graph_io as gio

from .builder import GraphBuilder
from .errors import ExportOptionError

AUTO = "auto"  # the EAGLE-3 default layers of the checkpoint (eagle3_layers)
MAX_LAYERS = 8  # the most ids one export lists (EAGLE-3 reads three)
# what the option was tested with: float32 activations (float32 or int4 weights), the GQA (CPU)
# and the window (batched) graph
ATTENTIONS = ("gqa", "window")

HiddenStatesOption = str | Sequence[int] | None  # "auto", layer ids, or None (no output)
# an int4 graph's states against PyTorch on its dequantized weights: its MatMulNBits round the
# activations to int8. Measured: 0.11% of the largest |state| on SmolLM2-135M (25.7 of 22,517:
# its outlier channels), 1.5% on the tiny random Llama of the tests; a step's rows are its
# verify rows exactly (the graph pads a lone query)
QUANT_TOLERANCES = Tolerances(step_vs_verify=Bound(0.0, 0.0), vs_pytorch=Bound(1e-3, 0.05))


def eagle3_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's and speculators' default EAGLE-3 layer ids: (2, L // 2, L - 3)."""
    return 2, num_layers // 2, num_layers - 3


def parse_hidden_states(text: str) -> str | tuple[int, ...]:
    """The command line's --hidden-states: "auto", or comma-separated layer ids "2,15,27"."""
    if text.strip() == AUTO:
        return AUTO
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ExportOptionError(f"--hidden-states takes {AUTO!r} or layer ids like 2,15,27; "
                                f"got {text!r}") from None


def check_hidden_states_option(value: HiddenStatesOption, *, attention: str,
                               quant: str | None, dtype: str) -> str | tuple[int, ...] | None:
    """Check the option before any work: its form, and that the graph it goes into is one it
    was tested with (float32 activations, gqa or window attention; quant allowed: the states
    are the quantized graph's own). Returns "auto", the
    ids as a tuple (ranges are checked against the checkpoint by resolve_layers), or None."""
    if value is None:
        return None
    if isinstance(value, str):
        if value != AUTO:
            raise ExportOptionError(f"hidden_states must be {AUTO!r}, a sequence of layer ids or "
                                    f"None, got {value!r}")
        ids: str | tuple[int, ...] = AUTO
    else:
        try:
            ids = tuple(value)
        except TypeError:
            raise ExportOptionError(f"hidden_states must be {AUTO!r}, a sequence of layer ids "
                                    f"or None, got {value!r}") from None
        if not 1 <= len(ids) <= MAX_LAYERS or not all(
                isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in ids):
            raise ExportOptionError(f"hidden_states: expected 1..{MAX_LAYERS} integer layer ids, "
                                    f"got {value!r}")
        ids = tuple(int(i) for i in ids)
    if attention not in ATTENTIONS or dtype != "fp32":
        raise ExportOptionError(
            f"hidden_states is supported on float32 graphs (int4 weights too) with attention "
            f"{' or '.join(map(repr, ATTENTIONS))}; got attention={attention!r}, "
            f"dtype={dtype!r}")
    return ids


def resolve_layers(value: str | tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """The layer ids for a checkpoint of `num_layers` layers: "auto" -> eagle3_layers, each id
    in 1..num_layers - 1 (the state entering that layer), no id twice (an EAGLE-3 head's `fc`
    reads one state per id; vLLM's membership test would return a repeated one once)."""
    ids = eagle3_layers(num_layers) if value == AUTO else tuple(value)
    # (2, L // 2, L - 3) is three distinct ids in range from L = 7 on
    why = f" from {AUTO!r}, which needs a model of 7 layers or more" if value == AUTO else ""
    if num_layers < 2 or not all(1 <= i <= num_layers - 1 for i in ids):
        raise ExportOptionError(f"hidden_states: layer ids must lie in 1..{num_layers - 1} (the "
                                f"state entering that decoder layer) for a model of {num_layers} "
                                f"layers, got {list(ids)}{why}")
    if len(set(ids)) != len(ids):
        raise ExportOptionError(f"hidden_states: layer ids repeat: {list(ids)}{why}")
    return ids


def hidden_states_output(b: GraphBuilder, states: Sequence[str], *,
                         to_grid=None) -> None:
    """The `hidden_states` output [N, len(states) * hidden] float32 from `states`, the residual
    streams captured per listed layer ([B, S, hidden] each, or the packed graph's [M, hidden]
    rows with `to_grid`, which scatters [M, width] back onto the [B * S, width] grid) at the
    positions `logit_rows` names."""
    g, hidden = b.g, b.spec.hidden_size
    width = len(states) * hidden
    if to_grid is not None:  # packed rows: one Concat of M rows, one scatter onto the grid
        grid = to_grid(g.op1("Concat", list(states), axis=-1), width)  # [B * S, width]
        out = g.op1("Gather", [grid, gio.LOGIT_ROWS], axis=0)  # [N, width]
    else:  # the rows first (N of them), then the Concat: no [B, S, width] copy of a prompt chunk
        flat = g.const("shape_rows_hidden", np.array([-1, hidden], np.int64))
        rows = [g.op1("Gather", [g.op1("Reshape", [s, flat]), gio.LOGIT_ROWS], axis=0)
                for s in states]  # [N, hidden] each
        out = g.op1("Concat", rows, axis=-1) if len(rows) > 1 else rows[0]
    g.op("Identity", [out], name="hidden_states_out", outputs=[gio.HIDDEN_STATES])
