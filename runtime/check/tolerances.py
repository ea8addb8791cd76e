"""How far an exported graph's logits may stray: one definition for the export and the runtime.

Two comparisons, each as max |difference| over every position and token of a fixed prompt of
`comparison_length(capacity, max_verify_len)` tokens:

- verify vs step: the verify entry point run over the prompt in blocks of max_verify_len (so
  every block after the first has a past), against the step entry point called token by token.
  The two differ only in how ONNX Runtime batches the arithmetic. Speculative decoding reads
  the target's distribution from verify calls and plain decoding from steps: if they disagree,
  the two decodes sample different distributions.
- vs PyTorch: the same logits against one forward pass of the checkpoint in float32 (the export
  only; the runtime has no PyTorch).

Each bound is max(absolute, relative x the largest |logit| of the reference; where there is no
PyTorch reference, the step entry point's):

- fp32, verify vs step: 1e-4, or 4e-6 of the logit scale (about 32 float32 ulps) for models
  whose logits are large: SmolLM2-135M's reach 38, and 30 layers of differently batched
  float32 sums put the standard-ops graph at 1.02e-4 (the GQA graph at 7.5e-5).
- fp32, vs PyTorch: 1e-3 (SmolLM2-135M measures 1.0e-4).
- fp16 rounds weights, activations and KV to half precision: 1% of the logit scale between
  the entry points and 2% against float32 PyTorch (SmolLM2-135M measures 0.2% and 0.4%).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Bound:
    absolute: float
    relative: float = 0.0  # times the largest |logit| of the reference

    def at(self, scale: float) -> float:
        """The bound for logits whose largest magnitude is `scale`."""
        return max(self.absolute, self.relative * scale)


@dataclasses.dataclass(frozen=True)
class Tolerances:
    step_vs_verify: Bound
    vs_pytorch: Bound


TOLERANCES = {
    "fp32": Tolerances(step_vs_verify=Bound(1e-4, 4e-6), vs_pytorch=Bound(1e-3)),
    "fp16": Tolerances(step_vs_verify=Bound(0.0, 1e-2), vs_pytorch=Bound(0.0, 2e-2)),
}


# The hidden_states output (the residual streams an EAGLE-3 head reads), checked at export with
# the logits' style of bound, scaled by the largest |value| of the PyTorch reference's states:
# 1e-4 or 4e-6 of the scale (about 32 float32 ulps) both between the entry points and against
# PyTorch. The residual stream carries outlier dimensions far above the logits' scale:
# SmolLM2-135M's states entering layers 2, 15, 27 reach 22517 (one float32 ulp there is 0.002),
# and measure 2.6e-4 verify vs step and 1.95e-3 against PyTorch, under bounds of 0.09. float32
# only: the option is refused for other graphs.
HIDDEN_STATE_TOLERANCES = {
    "fp32": Tolerances(step_vs_verify=Bound(1e-4, 4e-6), vs_pytorch=Bound(1e-3, 4e-6)),
}


def comparison_length(capacity: int, max_verify_len: int) -> int:
    """Tokens in the comparison prompt: min(capacity, max(48, 2 * max_verify_len + 5)), at
    least two full verify blocks and a partial one where the capacity allows."""
    return min(capacity, max(48, 2 * max_verify_len + 5))
