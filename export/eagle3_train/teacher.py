"""Teacher forcing: run the target once over a distilled sample for what the head learns from:
the hidden states it reads (the residual stream entering each of its layers, hidden_states.py's
convention: transformers' hidden_states[i]) and the target's next-token distribution at every
position."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class Teacher:
    ids: torch.Tensor  # [n] int64 token ids
    aux: torch.Tensor  # [n, 3 * Ht] the states at each position, layers concatenated
    logp: torch.Tensor  # [n, vocab] the target's log-distribution of the token after position i
    loss_from: int  # positions >= loss_from predict answer tokens


def teacher_force(model: Any, ids: list[int], layers: tuple[int, ...], *,
                  answer_start: int) -> Teacher:
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    aux = torch.cat([out.hidden_states[i][0] for i in layers], dim=-1)  # [n, 3Ht]
    logp = torch.log_softmax(out.logits[0].float(), dim=-1)  # [n, vocab]
    return Teacher(torch.tensor(ids, dtype=torch.int64), aux.float(), logp,
                   max(answer_start - 1, 0))
