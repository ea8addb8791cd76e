"""What does a step of an EAGLE-3 draft head cost against a step of its target?

    .venv/bin/python scripts/bench_eagle3_head.py [--model DIR ...] [--head DIR]
        [--draft-vocab 32000] [--context 256] [--rounds 9] [--threads 2]

For each target export (default: the default model's fp32 and int4 exports), after `--context`
tokens in the target's cache and as many entries in the head's, times, interleaved round by
round in a rotated order (the machine's speed drifts; only ratios of interleaved runs mean
anything):

- target step: `OrtDecoder.forward_token`, rolled back with truncate;
- head step: `OrtDraftHead.forward` of one entry fed by its own hidden output (a drafted
  token), rolled back;
- head first step: one entry from the target's hidden states (fc, then the layer);
- head x4: four entries from the target's states in one call (the accepted tokens of a block).

Without `--head`, two random heads of the target's shapes, float32 and int8
(`--draft-head-quant int8`), (tiny_eagle3_weights: the target's
hidden size, heads and KV heads, Llama's MLP ratio, a draft vocabulary of `--draft-vocab` target ids, no embedding
of its own) are written to a temporary directory; the timings depend on shapes only. Prints the
medians and their ratio to the target step, and the head directories' sizes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def random_head(model_dir: Path, out: Path, *, draft_vocab: int,
                quant: str | None = None) -> Path:
    """A random EAGLE-3 head of the target's shapes in `out` (drafts/eagle3 layout)."""
    from ortspec.export.eagle3 import Eagle3Target, read_eagle3_head
    from ortspec.export.eagle3_export import write_head_files
    from ortspec.export.tiny import tiny_eagle3_weights, write_eagle3_head
    from ortspec.runtime.ort import manifest as mf

    m = mf.read_manifest(model_dir, verify_checksums=False)
    a = m.architecture
    inter = round(8 * a.hidden_size / 3 / 64) * 64  # Llama's ratio (SmolLM2-135M: 1536)
    weights = tiny_eagle3_weights(hidden=a.hidden_size, heads=a.num_heads,
                                  kv_heads=a.num_kv_heads, intermediate=inter,
                                  vocab=a.vocab_size, draft_vocab=draft_vocab, seed=0)
    src = write_eagle3_head(out / "checkpoint", weights, fmt="speculators",
                            heads=a.num_heads, layer_ids=None)
    target = Eagle3Target(a.hidden_size, a.vocab_size, a.num_layers)
    head = read_eagle3_head(src, target=target)
    table = np.random.default_rng(0).standard_normal((a.vocab_size, a.hidden_size))
    dest = out / f"head-{quant or 'fp32'}"
    write_head_files(dest, head, target=target, capacity=m.capacity,
                     target_embed=table.astype(np.float32), source={"kind": "random"},
                     quant=quant)
    return dest


def bench(model_dir: Path, head_dir: Path | None, *, context: int, rounds: int, threads: int,
          draft_vocab: int) -> None:
    from ortspec.runtime.ort.decoder import OrtDecoder
    from ortspec.runtime.ort.head import open_draft_head

    with tempfile.TemporaryDirectory() as tmp:
        heads = {"": head_dir} if head_dir is not None else {
            f" {q or 'fp32'}": random_head(model_dir, Path(tmp), draft_vocab=draft_vocab, quant=q)
            for q in (None, "int8")}
        target = OrtDecoder(model_dir, threads=threads)
        rng = np.random.default_rng(0)
        ids = rng.integers(0, target.vocab_size, context)
        target.prefill(ids)

        def target_step():
            target.forward_token(7)
            target.truncate(context)

        cases = {"target step": target_step}
        sizes = []
        for label, directory in heads.items():
            head = open_draft_head(directory, threads=threads)
            sizes.append(f"{label.strip() or directory.name} "
                         f"{sum(p.stat().st_size for p in directory.iterdir()) / 2 ** 20:.1f} MiB")
            head.forward(ids, rng.standard_normal((context, head.aux_width)).astype(np.float32),
                         from_target=True)
            cases.update(head_cases(head, label, context, rng))
        for fn in cases.values():  # warm up
            for _ in range(3):
                fn()
        times: dict[str, list[float]] = {name: [] for name in cases}
        names = list(cases)
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order + order[::-1]:  # A B B A
                t0 = time.perf_counter()
                for _ in range(10):
                    cases[name]()
                times[name].append((time.perf_counter() - t0) / 10)
        base = statistics.median(times["target step"])
        print(f"\n{model_dir.name}: context {context}, {threads} threads, head "
              f"Vd={head.draft_vocab_size}, H={head.hidden_size}; head dirs {', '.join(sizes)}")
        print(f"{'case':32s} {'median ms':>10s} {'vs target step':>15s}")
        for name in names:
            t = statistics.median(times[name])
            print(f"{name:32s} {t * 1e3:10.3f} {t / base:15.3f}")


def head_cases(head, label: str, context: int, rng) -> dict:
    """The timed calls of one head, each rolled back to `context` entries."""
    aux = rng.standard_normal((4, head.aux_width)).astype(np.float32)
    own = rng.standard_normal((1, head.hidden_size)).astype(np.float32)

    def step():
        head.forward([7], own, from_target=False)
        head.truncate(context)

    def first():
        head.forward([7], aux[:1], from_target=True)
        head.truncate(context)

    def four():
        head.forward([7, 8, 9, 10], aux, from_target=True)
        head.truncate(context)

    return {f"head{label} step (own hidden)": step, f"head{label} first step (fc)": first,
            f"head{label} x4 from target": four}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", type=Path, default=None)
    p.add_argument("--head", type=Path, default=None)
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    models = args.model
    if not models:
        from ortspec.export.defaults import default_model_dir

        models = [default_model_dir("fp32"), default_model_dir(quant="int4")]
    for model in models:
        bench(model, args.head, context=args.context, rounds=args.rounds,
              threads=args.threads, draft_vocab=args.draft_vocab)
    return 0


if __name__ == "__main__":
    sys.exit(main())
