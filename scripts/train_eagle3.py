#!/usr/bin/env python3
"""Train an EAGLE-3 head for a target by self-distillation (ortspec.export.eagle3_train) and
write it in the speculators format; import it with `ortspec export --draft-head OUT`.

    nice -n 19 python scripts/train_eagle3.py --out /tmp/head --steps 200 --prompts 32
"""

from __future__ import annotations

import argparse
import json
import sys

from ortspec.export.eagle3_train import TrainConfig, train_head


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", default=None,
                   help="target: a Hugging Face directory or .gguf (default: the default model)")
    p.add_argument("--out", required=True, help="the head directory to write")
    p.add_argument("--steps", type=int, default=200, help="AdamW steps, one sample each")
    p.add_argument("--prompts", type=int, default=32, help="training prompts")
    p.add_argument("--max-new-tokens", type=int, default=128, help="answer length cap")
    p.add_argument("--max-prompt-chars", type=int, default=4000, help="prompt length cap")
    p.add_argument("--draft-vocab", type=int, default=4096, help="reduced vocabulary size")
    p.add_argument("--temperature", type=float, default=0.0, choices=[0.0, 1.0],
                   help="distillation: 0 greedy, 1 sampled")
    p.add_argument("--ttt-steps", type=int, default=3, help="training-time-test unroll")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["cpu"], default="cpu",
                   help="training device (CPU only so far)")
    p.add_argument("--cache", default=None, help="directory caching the distilled answers")
    p.add_argument("--runtime-model", default=None,
                   help="an ortspec export of the same target (a window export decodes several "
                        "answers at once): it writes the answers instead of PyTorch")
    p.add_argument("--sampled-copies", type=int, default=0,
                   help="answer each prompt this many more times at T=1 (needs --runtime-model)")
    p.add_argument("--workers", type=int, default=8,
                   help="concurrent requests of the runtime distiller")
    p.add_argument("--half-out", default=None,
                   help="also write a copy of the head with float16 tensors here")
    p.add_argument("--self-instruct", type=float, default=0.25,
                   help="share of self-instruct prompts")
    a = p.parse_args(argv)
    cfg = TrainConfig(steps=a.steps, prompts=a.prompts, max_new_tokens=a.max_new_tokens,
                      max_prompt_chars=a.max_prompt_chars, draft_vocab=a.draft_vocab,
                      seed=a.seed, temperature=a.temperature, ttt_steps=a.ttt_steps, lr=a.lr,
                      device=a.device, runtime_model=a.runtime_model,
                      sampled_copies=a.sampled_copies, workers=a.workers,
                      self_instruct=a.self_instruct)
    r = train_head(a.source, a.out, cfg, cache=a.cache)
    if a.half_out is not None:
        from ortspec.export.eagle3_train.write import store_half

        store_half(r.out, a.half_out)
    print(json.dumps(dict(out=str(r.out), first_loss=r.losses[0], last_loss=r.losses[-1],
                          train_top1=r.train_top1, val_top1=r.val_top1, tokens=r.tokens,
                          seconds=round(r.seconds, 1)), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
