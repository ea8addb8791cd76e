"""`DecodeCounters`: what a decode did, in the vocabulary drafted / accepted / recovered / bonus."""

from __future__ import annotations

import dataclasses

from .sampling import DraftBlock


@dataclasses.dataclass
class DecodeCounters:
    """What a decode did. Tokens emitted = accepted + recovered + bonus.

    A plain step (nothing drafted) emits a bonus token: it is sampled from the target after an
    (empty) fully accepted block.
    """

    verify_calls: int = 0  # forward_batch calls that verified a non-empty draft
    forward_token_calls: int = 0  # single-token steps (nothing drafted)
    prefill_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    recovered: int = 0
    bonus: int = 0
    drafted_by_position: list[int] = dataclasses.field(default_factory=list)
    accepted_by_position: list[int] = dataclasses.field(default_factory=list)
    accepted_by_source: dict[str, int] = dataclasses.field(default_factory=dict)
    drafted_by_source: dict[str, int] = dataclasses.field(default_factory=dict)
    model_seconds: float = 0.0  # inside the decoder (prefill included)
    prefill_seconds: float = 0.0  # feeding the prompt
    draft_seconds: float = 0.0  # inside drafter.propose
    sample_seconds: float = 0.0  # warping and the accept/resample rule
    total_seconds: float = 0.0
    ort_seconds: float = 0.0  # inside ONNX Runtime's run calls, if the decoder counts them

    @property
    def target_calls(self) -> int:
        return self.verify_calls + self.forward_token_calls

    @property
    def emitted(self) -> int:
        return self.accepted + self.recovered + self.bonus

    @property
    def rejected(self) -> int:
        """Drafted tokens not accepted: failed the test, came after a failure, or after a stop."""
        return self.drafted - self.accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_tokens_per_call(self) -> float:
        """Tokens per target call, bonus included (Spec-Bench's mean accepted tokens)."""
        return self.emitted / self.target_calls if self.target_calls else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position)]

    def count_block(self, block: DraftBlock, n_accepted: int) -> None:
        """Count one verified block: its `len(block)` drafted tokens (by position and by
        `block.source`) and the first `n_accepted` of them accepted. The decode loop calls it
        once per target call (an empty block counts nothing); a loop of one's own (a batch
        runner's rows) keeps the same counts by calling it too."""
        k = len(block)
        if k == 0:
            return
        while len(self.drafted_by_position) < k:
            self.drafted_by_position.append(0)
            self.accepted_by_position.append(0)
        for i in range(k):
            self.drafted_by_position[i] += 1
        for i in range(n_accepted):
            self.accepted_by_position[i] += 1
        self.drafted += k
        self.accepted += n_accepted
        src = block.source or "draft"
        self.drafted_by_source[src] = self.drafted_by_source.get(src, 0) + k
        self.accepted_by_source[src] = self.accepted_by_source.get(src, 0) + n_accepted
