"""What a decode is asked for (`SpeculativeOptions`) and what it returns
(`SpeculativeDecodeResult`): the types the loop, the drafters, the policy and the front door share."""

from __future__ import annotations

import dataclasses
from typing import Literal, Sequence

from ..errors import InvalidOptionError, InvalidPromptError
from ..validation import check_int, is_int
from .counters import DecodeCounters
from .sampling import check_sampling_options

FinishReason = Literal["length", "stop", "capacity"]


@dataclasses.dataclass(frozen=True)
class SpeculativeOptions:
    max_new_tokens: int
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    max_draft_len: int | None = None  # cap on tokens drafted per verify (None: the drafter's own)

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_new_tokens", check_int("max_new_tokens", self.max_new_tokens, minimum=1))
        check_sampling_options(self.temperature, self.top_k, self.top_p)
        object.__setattr__(self, "temperature", float(self.temperature))
        if self.top_p is not None:
            object.__setattr__(self, "top_p", float(self.top_p))
        if self.top_k is not None:
            object.__setattr__(self, "top_k", int(self.top_k))
        object.__setattr__(self, "seed", check_int("seed", self.seed, minimum=0, allow_none=True))
        stops = self.stop_token_ids
        if isinstance(stops, (str, bytes)) or not hasattr(stops, "__iter__"):
            raise InvalidOptionError(f"stop_token_ids must be a sequence of token ids, got {stops!r}")
        for t in stops:
            if not is_int(t) or t < 0:
                raise InvalidOptionError(f"stop_token_ids must be integers >= 0, got {t!r} in {stops!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stops))
        object.__setattr__(self, "max_draft_len",
                           check_int("max_draft_len", self.max_draft_len, minimum=0, allow_none=True))


@dataclasses.dataclass
class SpeculativeDecodeResult:
    tokens: list[int]  # new tokens, a stop token included when one ended the decode
    finish_reason: FinishReason
    counters: DecodeCounters
    text: str | None = None  # filled in by Model.generate

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


def check_options(options: object) -> SpeculativeOptions:
    """InvalidOptionError unless `options` is a SpeculativeOptions (which checked its fields)."""
    if not isinstance(options, SpeculativeOptions):
        raise InvalidOptionError(f"options must be a SpeculativeOptions, got {type(options).__name__}")
    return options


def is_token_sequence(prompt: object) -> bool:
    """Whether `prompt` can be a sequence of token ids: iterable, and not text or bytes."""
    return not isinstance(prompt, (str, bytes)) and hasattr(prompt, "__iter__")


def check_prompt(prompt: Sequence[int], *, vocab_size: int, capacity: int) -> list[int]:
    """The prompt as a list of ints, or InvalidPromptError: a non-empty sequence of token ids in
    0..vocab_size-1, at most `capacity` of them (the error says which token, or the length)."""
    if not is_token_sequence(prompt):
        raise InvalidPromptError(f"the prompt must be a sequence of token ids, got {type(prompt).__name__}")
    prompt = list(prompt)
    if not prompt:
        raise InvalidPromptError("the prompt is empty; at least one token is needed")
    for i, t in enumerate(prompt):
        if not is_int(t) or not 0 <= t < vocab_size:
            raise InvalidPromptError(
                f"prompt token {i} is {t!r}; token ids must be integers in 0..{vocab_size - 1}",
                token_index=i, token=t)
    if len(prompt) > capacity:
        raise InvalidPromptError(
            f"the prompt has {len(prompt)} tokens; the model's KV capacity is {capacity}",
            length=len(prompt), capacity=capacity)
    return [int(t) for t in prompt]
