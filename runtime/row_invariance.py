"""Does a verify row compute what a step computes? Greedy identity needs it bit for bit.

Plain decoding reads each position's logits from a step (one new token); speculative decoding
reads the same positions from rows of verify calls (several new tokens). Where the two differ,
even by a float32 ulp, an argmax can flip and the speculative output leaves the plain one.

What onnxruntime 1.32's CPU kernels do (measured op by op, `scripts/row_invariance_layers.py`):

- MatMulNBits, at every accuracy level and for 4 and 8 bits, takes a separate path for one row
  (M = 1) whose sums round differently; for M >= 2 each row's result is the same whatever M is
  and wherever the row sits. At accuracy_level 4 (int8 activations) the one-row difference
  reaches 0.6-0.8 logits on SmolLM2-135M, enough to change the argmax.
- Float MatMul/Gemm and GroupQueryAttention behave alike at float32 rounding (3e-5 logits).

So a graph whose calls never run a single row is row-invariant: `Manifest.min_call_rows = 2`
makes the decoder pad a one-token call with a copy of the token and drop the extra row (its KV
slot lies past the valid length and the next call overwrites it). `row_differences` measures
the property on a live decoder; `ortspec check` reports it, and an int4 export must show zero.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from .protocols import Decoder


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
