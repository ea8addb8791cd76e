"""The decoder graph's interface: the names of its inputs and outputs.

Every entry point of an export is one decoder graph with these inputs and outputs (the shapes
are in `ortspec.runtime.manifest`'s docstring); the manifest's architecture fixes how many
layers of KV tensors there are. The exporter writes these names, `OrtDecoder` binds them, and
the graph check (`ortspec.runtime.onnx_guard`) refuses a graph whose I/O differs.
"""

from __future__ import annotations

INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
POSITION_IDS = "position_ids"
LOGITS = "logits"


def past_key_name(layer: int) -> str:
    return f"past_key_values.{layer}.key"


def past_value_name(layer: int) -> str:
    return f"past_key_values.{layer}.value"


def present_key_name(layer: int) -> str:
    return f"present.{layer}.key"


def present_value_name(layer: int) -> str:
    return f"present.{layer}.value"


def decoder_io(num_layers: int) -> tuple[set[str], set[str], set[str]]:
    """(required inputs, optional inputs, required outputs) of a decoder graph with
    `num_layers` layers."""
    inputs = {INPUT_IDS, ATTENTION_MASK}
    outputs = {LOGITS}
    for i in range(num_layers):
        inputs |= {past_key_name(i), past_value_name(i)}
        outputs |= {present_key_name(i), present_value_name(i)}
    return inputs, {POSITION_IDS}, outputs
