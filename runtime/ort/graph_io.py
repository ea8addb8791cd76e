"""The decoder graph's interface: the names of its inputs and outputs.

Every entry point of an export is one decoder graph with these inputs and outputs (the shapes
are in `ortspec.runtime.ort.manifest`'s docstring); the manifest's architecture fixes how many
layers of KV tensors there are. The exporter writes these names, `OrtDecoder` binds them, and
the graph check (`ortspec.runtime.ort.onnx_guard`) refuses a graph whose I/O differs.
"""

from __future__ import annotations

import numpy as np

INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
POSITION_IDS = "position_ids"
LOGIT_ROWS = "logit_rows"  # optional: which positions' logits the call computes
TOKEN_ROWS = "token_rows"  # optional: which positions' tokens the call's MatMuls compute
LOGITS = "logits"
# optional: the residual streams of the manifest's hidden_state_layers at the logit_rows
# positions, [N, len(layers) * hidden] float32 (export/hidden_states.py)
HIDDEN_STATES = "hidden_states"


def past_key_name(layer: int) -> str:
    return f"past_key_values.{layer}.key"


def past_value_name(layer: int) -> str:
    return f"past_key_values.{layer}.value"


def present_key_name(layer: int) -> str:
    return f"present.{layer}.key"


def present_value_name(layer: int) -> str:
    return f"present.{layer}.value"


def decoder_io(num_layers: int, *, hidden_states: bool = False) -> \
        tuple[set[str], set[str], set[str]]:
    """(required inputs, optional inputs, required outputs) of a decoder graph with
    `num_layers` layers (and the `hidden_states` output, when its manifest lists layers)."""
    inputs = {INPUT_IDS, ATTENTION_MASK}
    outputs = {LOGITS, HIDDEN_STATES} if hidden_states else {LOGITS}
    for i in range(num_layers):
        inputs |= {past_key_name(i), past_value_name(i)}
        outputs |= {present_key_name(i), present_value_name(i)}
    return inputs, {POSITION_IDS, LOGIT_ROWS, TOKEN_ROWS}, outputs


def logit_rows_for(wanted: np.ndarray, *, min_rows: int) -> np.ndarray:
    """The `logit_rows` input for the flat positions `wanted` (non-empty, in the order the
    caller reads them): `wanted`, its last entry repeated up to `min_rows` entries. A graph
    whose rows are only exact from two on (manifest min_call_rows 2) thus never runs its LM head
    on a single row; the caller reads the first len(wanted) rows."""
    wanted = np.asarray(wanted, np.int64)
    if wanted.size >= min_rows:
        return wanted
    return np.concatenate([wanted, np.full(min_rows - wanted.size, wanted[-1], np.int64)])


def token_rows_for(real: np.ndarray, *, grid: int, min_rows: int) -> np.ndarray:
    """The `token_rows` input of a call whose real tokens sit at the flat positions `real`
    (ascending) of its B * S grid (`grid` = B * S): `real`, and when it has fewer than
    `min_rows` entries, the lowest other grid positions up to that many (a padding token, or a
    row riding along: its keys and values land past its valid length, where nothing reads
    them). The graph's MatMuls then see at least `min_rows` rows."""
    real = np.asarray(real, np.int64)
    if real.size >= min_rows:
        return real
    extra = np.setdiff1d(np.arange(grid, dtype=np.int64), real)[: min_rows - real.size]
    return np.sort(np.concatenate([real, extra]))


def call_width(rows: int, tokens: int, min_rows: int) -> int:
    """S of a call over `rows` rows whose longest block has `tokens` tokens: `tokens`, or more
    when rows * S would fall under `min_rows` (the manifest's min_call_rows, the fewest tokens a
    call runs in all). With min_call_rows 2 one row's step runs two tokens; a step of two rows
    or more runs one (the window graph's attention sees a token's G query heads as G rows, and
    runs a lone query twice when G = 1)."""
    return max(tokens, -(-min_rows // rows))
