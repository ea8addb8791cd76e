"""Quality and speed of int4 exports against the fp32 export of the same checkpoint.

    python -m ortspec.runtime.bench.int4_quality --compare NAME=DIR [--compare NAME=DIR ...]
        [--fp32 DIR] [--prompts 24] [--answer-tokens 64] [--reps 15] [--out DIR]

The reference is the fp32 export: for the default model, the float weights its Q4_1 GGUF
dequantizes to, i.e. the checkpoint's exact model. Each token stream is a Spec-Bench dev-split
question (even ids only; the odd ids are held out) in the chat template followed by the fp32
model's own greedy answer. Every export is teacher-forced over the same streams, and for each
the script reports:

- perplexity of the question's own tokens (human-written text, after the chat template's
  first token) and of the answer's (the fp32 model's text: low for every format, since the
  reference wrote it), each from the model's next-token distribution at temperature 1;
- top-1 agreement: the fraction of positions, question and answer, where its argmax equals
  the fp32 argmax (at temperature 0 a disagreement is where greedy output first changes);
- the step's time against the fp32 step, and the verify curve c(8)/c(1), both from calls of
  every export interleaved in one loop (`graph.time_calls`: 256 tokens of context, each call
  rolled back), so only the ratios mean anything on a machine whose speed drifts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Sequence

import numpy as np

from ..errors import InvalidOptionError, OrtspecError
from ..load import load_model
from ..ort.decoder import OrtDecoder
from ..paths import default_model_path
from .graph import time_calls
from .workload import CATEGORIES, load_questions

TIMED_LENGTHS = (1, 8)
MAX_QUESTION_TOKENS = 384  # a longer question (rag, summarization) is cut to its beginning


@dataclasses.dataclass(frozen=True)
class QualityRow:
    name: str
    question_perplexity: float
    answer_perplexity: float
    top1_agreement: float  # with the fp32 argmax, over every position
    positions: int
    step_vs_fp32: float  # median step time / the fp32 export's
    c8_over_c1: float  # median verify-of-8 time / median step time


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """logits: [n, vocab] -> [n, vocab] log-probabilities, in float64."""
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def token_nll(logits: np.ndarray, targets: Sequence[int]) -> np.ndarray:
    """logits: [n, vocab] at n positions; targets: [n] the tokens that followed. -> [n] the
    negative log-likelihood of each target."""
    targets = np.asarray(targets, dtype=np.int64)
    if logits.ndim != 2 or logits.shape[0] != targets.shape[0]:
        raise InvalidOptionError(f"logits [n, vocab] and targets [n] disagree: "
                                 f"{logits.shape} against {targets.shape}")
    return -log_softmax(logits)[np.arange(len(targets)), targets]


def perplexity(nll: np.ndarray) -> float:
    """exp of the mean negative log-likelihood."""
    return float(np.exp(np.mean(nll)))


def top1_agreement(argmax: np.ndarray, reference: np.ndarray) -> float:
    """The fraction of positions where two [n] argmax sequences agree."""
    if argmax.shape != reference.shape or argmax.size == 0:
        raise InvalidOptionError(f"need two equal, non-empty [n] sequences: {argmax.shape}, "
                                 f"{reference.shape}")
    return float(np.mean(argmax == reference))


def stream_logits(decoder: OrtDecoder, tokens: Sequence[int], start: int) -> np.ndarray:
    """Teacher-forced logits predicting tokens[start:], [len(tokens) - start, vocab] (start
    >= 1): the prefix before `start` is prefilled, the rest goes through forward_batch in blocks no
    longer than the decoder's verify limit."""
    decoder.reset()
    out = [decoder.prefill(list(tokens[:start]))[None, :]]  # predicts tokens[start]
    step = decoder.max_verify_len
    for i in range(start, len(tokens) - 1, step):
        block = list(tokens[i:min(i + step, len(tokens) - 1)])
        out.append(decoder.forward_batch(block))
    return np.concatenate(out)[:len(tokens) - start]


def make_streams(reference, *, prompts: int, answer_tokens: int) -> list[tuple[list[int], int]]:
    """(tokens, answer start) for `prompts` dev-split questions spread over the categories:
    the chat-formatted question followed by the reference model's greedy answer."""
    from ..decoding.options import SpeculativeOptions

    per_category = max(1, -(-prompts // len(CATEGORIES)))
    questions = load_questions(split="dev", per_category=per_category)[:prompts]
    streams = []
    for q in questions:
        ids = reference.encode(q.text, chat=True)[:MAX_QUESTION_TOKENS]
        answer = reference.generate(ids, drafter=None,
                                    options=SpeculativeOptions(answer_tokens, temperature=0.0))
        if answer.tokens:
            streams.append((ids + list(answer.tokens), len(ids)))
    return streams


def measure(fp32_dir: Path, compare: dict[str, Path], *, prompts: int, answer_tokens: int,
            reps: int, threads: int | None) -> list[QualityRow]:
    models = {"fp32": load_model(fp32_dir, threads=threads)}
    models.update({name: load_model(d, threads=threads) for name, d in compare.items()})
    print(f"answers of the fp32 model to {prompts} dev-split questions ...", file=sys.stderr)
    streams = make_streams(models["fp32"], prompts=prompts, answer_tokens=answer_tokens)
    nll_q: dict[str, list[np.ndarray]] = {name: [] for name in models}
    nll_a: dict[str, list[np.ndarray]] = {name: [] for name in models}
    argmax: dict[str, list[np.ndarray]] = {name: [] for name in models}
    for i, (tokens, start) in enumerate(streams):
        for name, model in models.items():
            logits = stream_logits(model.decoder, tokens, 1)  # predicts tokens[1:]
            nll = token_nll(logits, tokens[1:])
            nll_q[name].append(nll[:start - 1])
            nll_a[name].append(nll[start - 1:])
            argmax[name].append(logits.argmax(axis=-1))
        print(f"  stream {i + 1}/{len(streams)}", file=sys.stderr)
    print(f"timing {', '.join(models)} interleaved ...", file=sys.stderr)
    rows = time_calls({name: m.decoder for name, m in models.items()}, context=256,
                      lengths=list(TIMED_LENGTHS), reps=reps)
    ms = {(r.engine, r.block): r.median_ms for r in rows}
    reference = np.concatenate(argmax["fp32"])
    return [QualityRow(name, perplexity(np.concatenate(nll_q[name])),
                       perplexity(np.concatenate(nll_a[name])),
                       top1_agreement(np.concatenate(argmax[name]), reference), reference.size,
                       ms[name, 1] / ms["fp32", 1], ms[name, 8] / ms[name, 1])
            for name in models]


def markdown(rows: list[QualityRow]) -> str:
    lines = ["| export | perplexity, questions | perplexity, fp32's answers | top-1 agreement "
             "with fp32 | step vs fp32 | c(8)/c(1) |", "|---|---|---|---|---|---|"]
    lines += [f"| {r.name} | {r.question_perplexity:.2f} | {r.answer_perplexity:.3f} | "
              f"{r.top1_agreement:.3f} | "
              f"{r.step_vs_fp32:.2f}x | {r.c8_over_c1:.2f} |" for r in rows]
    return "\n".join(lines) + f"\n\n{rows[0].positions} positions.\n"


def _compare_arg(value: str) -> tuple[str, Path]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--compare takes NAME=DIR, got {value!r}")
    return name, Path(path)


def main(argv: list[str] | None = None) -> int:
    from ..cli.args import UserErrorParser

    p = UserErrorParser(prog="python -m ortspec.runtime.bench.int4_quality",
                        description=__doc__.splitlines()[0])
    p.add_argument("--fp32", type=Path, default=None,
                   help="the fp32 reference export (default: the default model's)")
    p.add_argument("--compare", type=_compare_arg, action="append", required=True,
                   metavar="NAME=DIR", help="an export to measure against it (repeatable)")
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--answer-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=None, help="write results.json and table.md here")
    try:
        args = p.parse_args(argv)
        compare = dict(args.compare)
        if "fp32" in compare:
            raise InvalidOptionError("--compare NAME must not be 'fp32', the reference's name")
        rows = measure(args.fp32 or default_model_path(precision="fp32"), compare,
                       prompts=args.prompts, answer_tokens=args.answer_tokens, reps=args.reps,
                       threads=args.threads)
    except OrtspecError as e:
        print(f"int4_quality: error: {e}", file=sys.stderr)
        return 2
    table = markdown(rows)
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "table.md").write_text(table, encoding="utf-8")
        (args.out / "results.json").write_text(
            json.dumps([dataclasses.asdict(r) for r in rows], indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
