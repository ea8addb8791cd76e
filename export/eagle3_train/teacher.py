"""Teacher forcing: run the target once over a distilled sample for what the head learns from:
the hidden states it reads (the residual stream entering each of its layers, hidden_states.py's
convention: transformers' hidden_states[i]) and the target's next-token distribution at every
position, kept on the draft vocabulary only (the loss renormalises it there).

The head's context is what the drafter feeds it at run time: the target's states from the
position that produced the first answer token on (a prefill returns the last prompt row's
states only), so a Teacher starts at position answer_start - 1 of the sample; the target still
reads the whole prompt, so the states themselves carry it."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class Teacher:
    ids: torch.Tensor  # [n] int64: the token at each position, from answer_start - 1 on
    aux: torch.Tensor  # [n, 3 * Ht] the states at each position, layers concatenated
    logp: torch.Tensor  # [n, Vd] the target's log-probabilities of the kept ids after position i
    loss_from: int  # positions >= loss_from predict answer tokens


def teacher_force(model: Any, ids: list[int], layers: tuple[int, ...], *, answer_start: int,
                  kept: torch.Tensor) -> Teacher:
    """`kept` [Vd] int64: the draft vocabulary's target ids."""
    first = max(answer_start - 1, 0)
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    aux = torch.cat([out.hidden_states[i][0, first:] for i in layers], dim=-1)  # [n, 3Ht]
    logp = torch.log_softmax(out.logits[0, first:].float(), dim=-1)[:, kept]  # [n, Vd]
    return Teacher(torch.tensor(ids[first:], dtype=torch.int64), aux.float().contiguous(),
                   logp.half(), 0)


def teacher_force_exported(decoder: Any, ids: list[int], *, answer_start: int,
                           kept: torch.Tensor) -> Teacher:
    """The same Teacher from an exported target that returns hidden states (an
    ortspec.runtime OrtDecoder of a model exported with the head's layers): the states the
    drafter will read at run time, at that export's precision (int4 for the default model).
    The prompt before answer_start - 1 is prefilled; the rest is one forward_batch."""
    first = max(answer_start - 1, 0)
    decoder.reset()
    if first:
        decoder.prefill(ids[:first])
    logits = torch.from_numpy(decoder.forward_batch(ids[first:]))  # [n, vocab]
    aux = torch.from_numpy(decoder.last_hidden_states())  # [n, 3Ht]
    decoder.reset()
    logp = torch.log_softmax(logits, dim=-1)[:, kept]  # [n, Vd]
    return Teacher(torch.tensor(ids[first:], dtype=torch.int64), aux.contiguous(), logp.half(), 0)
