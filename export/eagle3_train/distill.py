"""Self-distillation: the target's own answers to the training prompts, so the head learns the
distribution it will draft for. The target is the PyTorch model of the source (for the default
model its GGUF, through sources.py and checkpoint.py), in float32; greedy (temperature 0) or
sampled at temperature 1, seeded per prompt."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any, Callable

import torch

from .prompts import Prompt


@dataclasses.dataclass(frozen=True)
class Sample:
    """One distilled conversation: the chat-templated prompt and the target's answer."""

    ident: str
    source: str
    ids: list[int]  # prompt + answer token ids
    answer_start: int  # ids[answer_start:] is the target's answer


def load_target(source: str | None, *, capacity: int = 2048, progress: bool = True):
    """The source's Checkpoint (model, tokenizer, spec): None is the default model."""
    from ..checkpoint import load_checkpoint
    from ..sources import identify_source, materialize

    return load_checkpoint(materialize(identify_source(source), progress=progress),
                           capacity=capacity, progress=progress)


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    """`text` as one user turn in the target's chat template, ready for the answer."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             tokenize=False, add_generation_prompt=True)
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def generate(model: Any, ids: list[int], *, max_new_tokens: int, temperature: float,
             seed: int, eos: list[int]) -> list[int]:
    """The target's continuation of `ids` (at most max_new_tokens, stopping at an eos id)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens,
                             do_sample=temperature > 0, temperature=temperature or None,
                             top_k=0 if temperature > 0 else None, top_p=None,
                             eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0)
    return out[0, len(ids):].tolist()


def distill(model: Any, tokenizer: Any, prompts: list[Prompt], *, max_new_tokens: int,
            temperature: float, seed: int, max_prompt_chars: int = 4000,
            cache: Path | None = None,
            report: Callable[[str], None] = lambda s: None) -> list[Sample]:
    """One Sample per prompt. A self-instruct seed first has the target write the question
    (sampled at T=1 for variety), then answer it. A prompt is cut to max_prompt_chars. With
    `cache`, each sample is stored under a key of everything it depends on and reused."""
    eos = [i for i in {tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id",
                                                       None)} if isinstance(i, int)]
    samples = []
    for n, p in enumerate(prompts):
        text = p.text[:max_prompt_chars]
        key = hashlib.sha256(json.dumps([model.config.name_or_path, text, p.needs_question,
                                         max_new_tokens, temperature, seed + n],
                                        ).encode()).hexdigest()[:24]
        path = cache / f"{key}.json" if cache is not None else None
        if path is not None and path.is_file():
            samples.append(Sample(**json.loads(path.read_text())))
            continue
        if p.needs_question:
            q = generate(model, chat_ids(tokenizer, text), max_new_tokens=64, temperature=1.0,
                         seed=seed + n, eos=eos)
            text = tokenizer.decode(q, skip_special_tokens=True).strip() or p.text
        ids = chat_ids(tokenizer, text)
        answer = generate(model, ids, max_new_tokens=max_new_tokens, temperature=temperature,
                          seed=seed + n, eos=eos)
        sample = Sample(p.ident, p.source, ids + answer, len(ids))
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(dataclasses.asdict(sample)))
        samples.append(sample)
        report(f"distilled {n + 1}/{len(prompts)} ({len(answer)} answer tokens)")
    return samples
