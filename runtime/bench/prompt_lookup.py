"""Time PromptLookupSpeculator.propose as the history grows, as a decode loop calls it.

    python -m ortspec.runtime.bench.prompt_lookup [--max-history 32768]

Each row: the history length when `propose` was called, and the median / 99th-percentile time
of one call (index update for the tokens appended since the previous call + lookup). Histories
are natural-text-like token streams, held in a `TokenHistory` as the decode loops hold them, (Zipf-distributed ids with repeated spans) so matches occur.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from ..decoding.history import TokenHistory
from ..drafters.prompt_lookup import PromptLookupSpeculator


def synthetic_history(n: int, vocab: int = 49152, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    out: list[int] = []
    while len(out) < n:
        if len(out) > 64 and rng.random() < 0.3:  # copy an earlier span, as edits and quotes do
            s = int(rng.integers(0, len(out) - 32))
            out.extend(out[s : s + int(rng.integers(4, 32))])
        else:
            out.extend((rng.zipf(1.3, size=int(rng.integers(4, 32))) % vocab).tolist())
    return out[:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-history", type=int, default=32768)
    ap.add_argument("--step", type=int, default=3, help="tokens appended between calls (accepted + 1)")
    args = ap.parse_args()
    tokens = synthetic_history(args.max_history + 1)
    checkpoints = [c for c in (256, 1024, 4096, 8192, 16384, 32768) if c <= args.max_history]
    print(f"{'history':>8} | {'ngram':>5} | {'median us':>9} | {'p99 us':>7} | {'drafted/call':>12}")
    print("-" * 56)
    for ngram in (3, 5):
        spec = PromptLookupSpeculator(ngram_size=ngram, max_draft_len=8)
        history = TokenHistory()  # what the decode loops pass: appends are O(1) to index
        times: dict[int, list[float]] = {c: [] for c in checkpoints}
        drafted: dict[int, int] = {c: 0 for c in checkpoints}
        pos = 0
        while pos < args.max_history:
            history.extend(tokens[pos : pos + args.step])
            pos += args.step
            t0 = time.perf_counter()
            block = spec.propose(history, 8)
            dt = time.perf_counter() - t0
            for c in checkpoints:  # calls within the last 256 tokens before each checkpoint
                if c - 256 < len(history) <= c:
                    times[c].append(dt)
                    drafted[c] += len(block)
        for c in checkpoints:
            t = np.array(times[c]) * 1e6
            print(f"{c:>8} | {ngram:>5} | {np.median(t):>9.1f} | {np.percentile(t, 99):>7.1f} | "
                  f"{drafted[c] / max(1, len(t)):>12.2f}")


if __name__ == "__main__":
    main()
