"""Does a verify row compute what a step computes? Greedy identity needs it bit for bit.

Plain decoding reads each position's logits from a step (one new token); speculative decoding
reads the same positions from rows of verify calls (several new tokens). Where the two differ,
even by a float32 ulp, an argmax can flip and the speculative output leaves the plain one.

What onnxruntime 1.32's CPU kernels do (measured op by op, `scripts/row_invariance_layers.py`):

- GroupQueryAttention computes a lone query row (S = 1) on another path than a row among
  several: 3e-8 apart at layer 0 of SmolLM2-135M. From two rows on a row's output is the same
  whatever S is and wherever the row sits.
- MatMulNBits at accuracy level 4 (int8 activations, the int4 exports' level) computes a row
  alike at every M, one row included. At lower levels (float activations) its one-row call
  takes another path; from two rows on the rows agree.
- Float MatMul/Gemm behave alike at float32 rounding (3e-5 logits).
- In a quantized graph the next MatMulNBits rounds its activations to int8, so the attention's
  3e-8 can move an activation by a whole int8 step: 0.5-0.7 logits at the LM head, enough to
  change the argmax (genai's int4 n-gram mode, whose graph attends a lone query alone, kept its
  own plain output on 2-3 of 12-15 prompts).

So a quantized GQA graph pads a one-token call's attention to two query rows itself
(`Manifest.min_attention_rows = 2`: the token's q, k, v twice, the copy's output dropped and its
KV slot, one past the call's, overwritten by the next call), while its MatMuls run the one row.
The window graph, whose attention and block sums are float MatMuls, has every call run two rows
(`Manifest.min_call_rows = 2`: the decoder pads a one-token call with a copy of the token).
`row_differences` measures the property on a live decoder; `ortspec check` reports it, and a
graph that pads must show zero.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import onnxruntime as ort

from ..decoding.protocols import Decoder

PROBE_ROWS = 5  # the probe's rows, each also run alone


@dataclasses.dataclass(frozen=True)
class RowDifferences:
    rows: int  # verify rows compared with the step at the same position
    differing: int  # rows not bitwise equal to their step
    argmax_differing: int  # rows whose argmax is not the step's
    max_abs: float  # largest |logit difference|
    scale: float  # largest |logit| of the steps, the scale of max_abs
    block_lengths: tuple[int, ...]


def row_differences(decoder: Decoder, prompt: Sequence[int], continuation: Sequence[int], *,
                    block_lengths: Sequence[int], offsets: Sequence[int] = (0, 1)) -> \
        RowDifferences:
    """Prefill `prompt`, then compare the step logits of each `continuation` token with the
    rows of verify calls of each block length, starting `offset` tokens (fed by steps) into
    the continuation; every block must fit: offset + length <= len(continuation). The
    decoder is reset afterwards."""
    cont = [int(t) for t in continuation]
    if any(o + n > len(cont) for o in offsets for n in block_lengths):
        raise ValueError("every offset + block length must fit in the continuation")
    decoder.reset()
    decoder.prefill(list(prompt))
    base = decoder.length
    steps = np.stack([decoder.forward_token(t) for t in cont])  # [len(cont), vocab]
    rows = differing = argmax_differing = 0
    worst = 0.0
    for offset in offsets:
        for n in block_lengths:
            decoder.truncate(base)
            for t in cont[:offset]:  # the past as plain decoding writes it
                decoder.forward_token(t)
            block = decoder.forward_batch(cont[offset:offset + n])  # [n, vocab]
            ref = steps[offset:offset + n]
            diff = np.abs(block - ref).max(axis=1)  # [n]
            rows += n
            differing += int((diff > 0).sum())
            argmax_differing += int((block.argmax(1) != ref.argmax(1)).sum())
            worst = max(worst, float(diff.max()))
    decoder.reset()
    return RowDifferences(rows=rows, differing=differing, argmax_differing=argmax_differing,
                          max_abs=worst, scale=float(np.abs(steps).max()),
                          block_lengths=tuple(block_lengths))


def lone_rows_exact(probe: ort.InferenceSession) -> bool:
    """Whether every kernel of an export's row probe (export/row_probe.py: inputs `x<K>`
    [M, K], one output per kernel) computes each of PROBE_ROWS random rows alone bit for bit
    as it computes it among them, in this session (its machine, threads and providers)."""
    rng = np.random.default_rng(0)
    xs = {i.name: rng.standard_normal((PROBE_ROWS, i.shape[1])).astype(np.float32)
          for i in probe.get_inputs()}
    together = probe.run(None, xs)
    for r in range(PROBE_ROWS):
        alone = probe.run(None, {name: x[r:r + 1] for name, x in xs.items()})
        if any(not np.array_equal(a[0], t[r]) for a, t in zip(alone, together, strict=True)):
            return False
    return True
