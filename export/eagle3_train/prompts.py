"""Training prompts, each with its source and licence.

- Spec-Bench (hemingkx/Spec-Bench, Apache-2.0), the question file packaged under
  runtime/bench/data/spec_bench: the DEV split only (even question ids). The odd ids are the
  held-out split the benchmarks confirm results on; a head trained on them would be measured on
  its own training data, so they are never yielded.
- Self-instruct: seed requests written here (this project's licence) that ask the target to
  write a user question on a topic; the target's answer becomes a prompt (distill.py).
"""

from __future__ import annotations

import dataclasses
import random

from ortspec.runtime.bench.workload import load_questions

SPEC_BENCH = "spec-bench-dev"
SELF_INSTRUCT = "self-instruct"
SOURCES = {
    SPEC_BENCH: {"name": "Spec-Bench question.jsonl, dev split (even question_id)",
                 "url": "https://github.com/hemingkx/Spec-Bench",
                 "licence": "Apache-2.0"},
    SELF_INSTRUCT: {"name": "seed requests in ortspec.export.eagle3_train.prompts; the "
                            "questions are written by the target itself",
                    "licence": "the project's licence; the generated text is the target's "
                               "output, under the target model's licence"},
}

TOPICS = ("cooking", "history", "physics", "programming in Python", "gardening", "travel",
          "personal finance", "music", "health and exercise", "mathematics", "geography",
          "writing an email", "chemistry", "animals", "space", "job interviews", "movies",
          "climate", "databases", "poetry")
KINDS = ("a short factual question", "a request for step-by-step instructions",
         "a request to explain a concept simply", "a request for a short story or poem",
         "a request to compare two things", "a small math word problem")


@dataclasses.dataclass(frozen=True)
class Prompt:
    text: str
    source: str  # a key of SOURCES
    ident: str  # e.g. "spec-bench:82", "self-instruct:3"
    needs_question: bool = False  # a self-instruct seed: the target writes the question first


def spec_bench_dev_prompts() -> list[Prompt]:
    """The first turn of every Spec-Bench dev question (even ids), in a stable order."""
    out = [Prompt(q.text, SPEC_BENCH, f"spec-bench:{q.question_id}")
           for q in load_questions(split="dev")]
    assert all(int(p.ident.split(":")[1]) % 2 == 0 for p in out)  # never the held-out split
    return out


def self_instruct_seeds(n: int, *, seed: int) -> list[Prompt]:
    """`n` seeded requests asking the target to write one user question."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        topic, kind = rng.choice(TOPICS), rng.choice(KINDS)
        text = (f"Write {kind} that a user might ask an assistant about {topic}. "
                f"Reply with the question only.")
        out.append(Prompt(text, SELF_INSTRUCT, f"self-instruct:{i}", needs_question=True))
    return out


def training_prompts(n: int, *, seed: int, self_instruct: float = 0.25) -> list[Prompt]:
    """`n` prompts: round(n * self_instruct) self-instruct seeds, the rest Spec-Bench dev
    questions drawn without replacement (seeded), all shuffled together."""
    if n < 1 or not 0.0 <= self_instruct <= 1.0:
        raise ValueError(f"need n >= 1 and 0 <= self_instruct <= 1, got {n}, {self_instruct}")
    rng = random.Random(seed)
    n_self = round(n * self_instruct)
    bench = spec_bench_dev_prompts()
    rng.shuffle(bench)
    picked = bench[:n - n_self] + self_instruct_seeds(n_self + max(0, n - n_self - len(bench)),
                                                      seed=seed)
    rng.shuffle(picked)
    return picked
