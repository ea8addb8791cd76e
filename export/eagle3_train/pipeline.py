"""The training pipeline end to end: prompts -> distilled answers -> teacher forcing -> draft
vocabulary -> training-time-test loop -> a speculators checkpoint (see __init__.py)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..errors import ExportOptionError
from ..hidden_states import eagle3_layers
from . import distill as dst
from .loop import HeadShape, TrainableHead, sample_loss, train
from .prompts import SOURCES, training_prompts
from .teacher import teacher_force, teacher_force_exported
from .vocab import draft_vocab, maps
from .write import speculators_config, write_head


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 200
    prompts: int = 32
    max_new_tokens: int = 128
    max_prompt_chars: int = 4000  # longer prompts are cut (the long summarisation/RAG ones)
    draft_vocab: int = 4096
    seed: int = 0
    temperature: float = 0.0  # 0: greedy answers; 1: sampled at T=1
    self_instruct: float = 0.25  # share of self-instruct prompts
    ttt_steps: int = 3
    decay: float = 0.8
    lr: float = 1e-3
    schedule: str = "cosine"  # or "constant" (loop.train)
    weight_decay: float = 0.0
    validation: float = 0.1  # share of prompts held out of training to measure top-1
    device: str = "cpu"  # only the CPU so far
    sampled_copies: int = 0  # each prompt is also answered this many times at T=1 (seeded)
    runtime_model: str | None = None  # an ortspec export of the same target: it writes the
    #   answers (distill_ort.py, several requests at once), else the PyTorch model does
    workers: int = 8  # concurrent requests of the runtime distiller


@dataclasses.dataclass
class TrainResult:
    out: Path
    losses: list[float]
    train_top1: list[float]  # per TTT step, the last tenth of training
    val_top1: list[float]  # per TTT step, on the held-out samples (nan without any)
    tokens: int  # distilled tokens in training
    seconds: float


def _top1(head: TrainableHead, data, table, cfg) -> list[float]:
    if not data:
        return [float("nan")] * cfg.ttt_steps
    with torch.no_grad():
        rows = [sample_loss(head, t, table, steps=cfg.ttt_steps, decay=cfg.decay)[1]
                for t in data]
    return [float(np.nanmean([r[k] for r in rows if k < len(r)])) for k in range(cfg.ttt_steps)]


def _prompt_of(sample: dst.Sample) -> str:
    """The prompt a sample answers (the runtime distiller appends "@T<t>s<seed>")."""
    return sample.ident.split("@")[0]


def distill_jobs(prompts, cfg: TrainConfig) -> list:
    """The runtime distiller's answers to write: each prompt at cfg.temperature, then
    cfg.sampled_copies times at T=1, each with a seed of its own."""
    from .distill_ort import Job

    jobs = []
    for n, p in enumerate(prompts):
        jobs.append(Job(p, cfg.temperature, cfg.seed + n))
        jobs += [Job(p, 1.0, cfg.seed + n + (c + 1) * len(prompts))
                 for c in range(cfg.sampled_copies)]
    return jobs


def _exported_teacher(cfg: TrainConfig, layers: tuple[int, ...]):
    """An OrtDecoder of cfg.runtime_model when that export returns the hidden states of
    `layers` (then the head learns from the states it will read), else None (PyTorch)."""
    if cfg.runtime_model is None:
        return None
    from ortspec.runtime.ort import manifest as mf
    from ortspec.runtime.ort.decoder import OrtDecoder

    if mf.read_manifest(cfg.runtime_model).hidden_state_layers != tuple(layers):
        return None
    return OrtDecoder(cfg.runtime_model)


def _distill(model, tok, prompts, cfg: TrainConfig, *, cache, progress: bool,
             report: Callable[[str], None]) -> list[dst.Sample]:
    if cfg.runtime_model is None:
        return dst.distill(model, tok, prompts, max_new_tokens=cfg.max_new_tokens,
                           temperature=cfg.temperature, seed=cfg.seed,
                           max_prompt_chars=cfg.max_prompt_chars,
                           cache=Path(cache) if cache is not None else None, report=report)
    from ortspec.runtime import load_model

    from .distill_ort import distill_with_runtime

    if cache is None:
        raise ExportOptionError("the runtime distiller needs a cache directory (--cache)")
    runtime = load_model(cfg.runtime_model)
    if runtime.facts().vocab_size != model.config.vocab_size:
        raise ExportOptionError(f"runtime_model {cfg.runtime_model} has a vocabulary of "
                                f"{runtime.facts().vocab_size}, the target {model.config.vocab_size}: "
                                f"it must be an export of the same target")
    return distill_with_runtime(runtime, distill_jobs(prompts, cfg),
                                max_new_tokens=cfg.max_new_tokens,
                                max_prompt_chars=cfg.max_prompt_chars, cache=Path(cache),
                                workers=cfg.workers, report=report)


def train_head(source: str | None, out: str | Path, cfg: TrainConfig = TrainConfig(), *,
               cache: str | Path | None = None, progress: bool = True,
               report: Callable[[str], None] | None = None) -> TrainResult:
    """Train a head for `source` (None: the default model) and write it to `out`."""
    say = report or ((lambda s: print(s, flush=True)) if progress else (lambda s: None))
    if cfg.device != "cpu":
        raise ExportOptionError(f"device must be 'cpu' (training runs on the CPU), got "
                                f"{cfg.device!r}")
    if not isinstance(cfg.sampled_copies, int) or cfg.sampled_copies < 0:
        raise ExportOptionError(f"sampled_copies must be an integer >= 0, got "
                                f"{cfg.sampled_copies!r}")
    if cfg.schedule not in ("constant", "cosine"):
        raise ExportOptionError(f"schedule must be 'constant' or 'cosine', got {cfg.schedule!r}")
    if cfg.sampled_copies and cfg.runtime_model is None:
        raise ExportOptionError("sampled_copies needs runtime_model (answers at T=1 are written "
                                "by the runtime distiller)")
    for name in ("steps", "prompts", "max_new_tokens", "draft_vocab", "ttt_steps", "workers"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ExportOptionError(f"{name} must be a positive integer, got {value!r}")
    if cfg.temperature not in (0.0, 1.0) or not 0.0 <= cfg.validation < 1.0:
        raise ExportOptionError(f"temperature must be 0 or 1 and validation in [0, 1), got "
                                f"{cfg.temperature!r}, {cfg.validation!r}")
    started = time.perf_counter()
    torch.manual_seed(cfg.seed)
    ckpt = dst.load_target(source, progress=progress)
    model, tok, spec = ckpt.model, ckpt.tokenizer, ckpt.spec
    layers = eagle3_layers(spec.num_layers)
    prompts = training_prompts(cfg.prompts, seed=cfg.seed, self_instruct=cfg.self_instruct)
    say(f"{len(prompts)} prompts; distilling up to {cfg.max_new_tokens} tokens each")
    samples = _distill(model, tok, prompts, cfg, cache=cache, progress=progress, report=say)
    held = {p.ident for p in prompts[:int(len(prompts) * cfg.validation)]}
    val_s = [s for s in samples if _prompt_of(s) in held]
    train_s = [s for s in samples if _prompt_of(s) not in held]
    samples = val_s + train_s
    n_val = len(val_s)
    vocab = spec.vocab_size
    kept = draft_vocab([s.ids[s.answer_start:] for s in train_s], size=min(cfg.draft_vocab, vocab),
                       vocab=vocab)
    exported = _exported_teacher(cfg, layers)
    say(f"teacher-forcing {len(samples)} samples through "
        f"{'the export ' + cfg.runtime_model if exported is not None else 'PyTorch'}")
    teach = []
    for n, s in enumerate(samples):
        teach.append(teacher_force(model, s.ids, layers, answer_start=s.answer_start, kept=kept)
                     if exported is None else
                     teacher_force_exported(exported, s.ids, answer_start=s.answer_start,
                                            kept=kept))
        if (n + 1) % 100 == 0:
            say(f"teacher-forced {n + 1}/{len(samples)}")
    train_t, val_t = teach[n_val:], teach[:n_val]
    d2t, t2d = maps(kept, vocab)
    cfgm = model.config
    head_dim = getattr(cfgm, "head_dim", None) or spec.hidden_size // cfgm.num_attention_heads
    shape = HeadShape(spec.hidden_size, cfgm.num_attention_heads,
                      getattr(cfgm, "num_key_value_heads", None) or cfgm.num_attention_heads,
                      head_dim, cfgm.intermediate_size, float(cfgm.rms_norm_eps),
                      float(getattr(cfgm, "rope_theta", None) or 10000.0),
                      int(cfgm.max_position_embeddings), int(kept.numel()))
    table = model.get_input_embeddings().weight.detach().float()
    lm = model.get_output_embeddings().weight.detach().float()[kept]
    head = TrainableHead(shape, target_hidden=spec.hidden_size, lm_head_init=lm, seed=cfg.seed)
    say(f"training: {len(train_t)} samples, {sum(t.ids.numel() for t in train_t)} tokens, "
        f"draft vocabulary {kept.numel()}, layers {layers}")
    loop = train(head, train_t, table, steps=cfg.steps, ttt_steps=cfg.ttt_steps,
                 decay=cfg.decay, lr=cfg.lr, weight_decay=cfg.weight_decay, seed=cfg.seed,
                 schedule=cfg.schedule,
                 report=say)
    tail = loop.top1[-max(1, cfg.steps // 10):]
    train_top1 = [float(np.nanmean([r[k] for r in tail if k < len(r)]))
                  for k in range(cfg.ttt_steps)]
    val_top1 = _top1(head, val_t, table, cfg)
    say(f"validation top-1 per step: {' '.join(f'{a:.3f}' for a in val_top1)}")
    weights = dict(head.state(), d2t=d2t, t2d=t2d)
    config = speculators_config(shape, vocab=vocab, target_hidden=spec.hidden_size,
                                layer_ids=layers)
    tokens = sum(len(s.ids) for s in train_s)
    recipe = dict(dataclasses.asdict(cfg), target=str(ckpt.source.path),
                  teacher=("the export " + str(cfg.runtime_model) if exported is not None
                           else "PyTorch, float32"),
                  objective="EAGLE-3 training-time test: forward KL to the target's "
                            "distribution renormalised on the draft vocabulary, step k "
                            "weighted decay**k", optimizer="AdamW",
                  final_loss=loop.losses[-1], train_top1=train_top1, val_top1=val_top1)
    used = sorted({s.source for s in samples})
    data = dict(seed=cfg.seed, sources={k: SOURCES[k] for k in used},
                samples=[{"id": s.ident, "source": s.source, "tokens": len(s.ids),
                          "answer_tokens": len(s.ids) - s.answer_start,
                          "split": "validation" if i < n_val else "train"}
                         for i, s in enumerate(samples)],
                train_tokens=tokens, validation_tokens=sum(len(s.ids) for s in val_s),
                draft_vocab=int(kept.numel()))
    write_head(Path(out), weights, config, recipe=recipe, data=data)
    say(f"wrote {out}")
    return TrainResult(Path(out), loop.losses, train_top1, val_top1, tokens,
                       time.perf_counter() - started)
