"""Self-distillation through the deployed target: the exported ONNX model (`ortspec.runtime`)
writes the answers instead of PyTorch. It is the model the head will draft for (the default int4
export), and it decodes many requests at once on a window export, so it writes data several
times faster than `distill.distill` on a CPU. Answers are exact draws of the target (greedy, or
sampled at T=1 with a seed per sample), speculation or not.

Each sample is cached as JSON (distill.Sample) under a key of everything it depends on, so an
interrupted run resumes where it stopped."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from .distill import Sample
from .prompts import Prompt


@dataclasses.dataclass(frozen=True)
class Job:
    """One answer to write: the prompt, and the temperature and seed it is drawn with."""

    prompt: Prompt
    temperature: float  # 0: greedy; else sampled (top-k/top-p off)
    seed: int


def _key(model_id: str, job: Job, *, max_new_tokens: int, max_prompt_chars: int) -> str:
    return hashlib.sha256(json.dumps(
        ["ort", model_id, job.prompt.text[:max_prompt_chars], job.prompt.needs_question,
         max_new_tokens, job.temperature, job.seed]).encode()).hexdigest()[:24]


def model_id(model) -> str:
    """What a cached answer depends on in the model: its source and its weights' format
    (an fp32 and an int4 export of one source write different answers)."""
    m = model.manifest
    return json.dumps([m.source, m.dtype, m.extra.get("weights")], sort_keys=True)


def distill_with_runtime(model, jobs: list[Job], *, max_new_tokens: int, max_prompt_chars: int,
                         cache: Path, workers: int = 8,
                         report: Callable[[str], None] = lambda s: None) -> list[Sample]:
    """One Sample per job, in the order of `jobs`, written by `model` (an ortspec.runtime Model)
    from `workers` threads (a window export decodes them in shared calls). A self-instruct seed
    first has the target write the question (T=1, 64 tokens, the job's seed)."""
    from ortspec.runtime import SpeculativeOptions

    ident = model_id(model)
    done = [0]
    counting = threading.Lock()  # workers finish concurrently

    def one(job: Job) -> Sample:
        key = _key(ident, job, max_new_tokens=max_new_tokens, max_prompt_chars=max_prompt_chars)
        path = cache / f"{key}.json"
        if path.is_file():
            return Sample(**json.loads(path.read_text()))
        text = job.prompt.text[:max_prompt_chars]
        if job.prompt.needs_question:
            q = model.generate(text, chat=True, options=SpeculativeOptions(
                max_new_tokens=64, temperature=1.0, seed=job.seed))
            text = (q.text or "").strip() or job.prompt.text
        ids = model.encode(text, chat=True)
        opts = SpeculativeOptions(max_new_tokens=max_new_tokens, temperature=job.temperature,
                                  seed=job.seed if job.temperature > 0 else None)
        answer = model.generate(ids, options=opts).tokens
        sample = Sample(f"{job.prompt.ident}@T{job.temperature:g}s{job.seed}", job.prompt.source,
                        list(ids) + list(answer), len(ids))
        cache.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(sample)))
        tmp.replace(path)
        with counting:
            done[0] += 1
            report(f"distilled {done[0]}/{len(jobs)} ({len(answer)} answer tokens)")
        return sample

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(one, jobs))
