#!/usr/bin/env bash
# Reproduces the committed results under benchmarks/ (default model, this machine's CPU).
# Each run interleaves plain and speculative decoding per prompt (A B, then B A), so only the
# ratios and counts are evidence; absolute tokens/s drift with the machine.
set -euo pipefail
cd "$(dirname "$0")/.."
make setup
B=".venv/bin/ortspec bench"
# 1. the full dev split, greedy: plain vs prompt lookup with the cost-model draft length
$B --per-category 0 --temperature 0 --methods plain,prompt-lookup --out benchmarks/dev-t0
# 1b. temperature 1: plain vs prompt lookup with the cost model, 16 prompts per category, each twice
$B --per-category 16 --temperature 1 --repeats 2 --methods plain,prompt-lookup --out benchmarks/dev-t1
# 2. fixed draft lengths vs the cost model, greedy and temperature 1 (8 prompts per category)
$B --per-category 8 --temperature 0 --out benchmarks/draft-length-t0 \
   --methods plain,prompt-lookup,prompt-lookup:k2,prompt-lookup:k4,prompt-lookup:k8
$B --per-category 8 --temperature 1 --out benchmarks/draft-length-t1 \
   --methods plain,prompt-lookup,prompt-lookup:k2,prompt-lookup:k4,prompt-lookup:k8
# 3. self-speculative draft models (exported beside the target on first use), 3 prompts per category
.venv/bin/python -c "from ortspec.export import ensure_default_draft; ensure_default_draft('int4')"
for T in 0 1; do
  $B --per-category 3 --temperature $T --out benchmarks/draft-model-t$T \
     --methods plain,prompt-lookup,draft-model,prompt-lookup+draft-model
done
# 4. the drafters that sample from a q (n-gram counts, the target's cached rows), T=0.7 and 1
for T in 0.7 1; do
  $B --per-category 3 --max-new-tokens 96 --temperature $T --out benchmarks/drafters-with-q/t$T \
     --methods plain,prompt-lookup,ngram-counts,target-cache
done
# 5. the int4 draft on its target's KV buffers, alone and composed with prompt lookup, T = 0.7, 0, 1
for T in 0.7 0 1; do
  $B --per-category 4 --max-new-tokens 96 --temperature $T --out benchmarks/shared-kv-draft/t$T \
     --methods plain,prompt-lookup,draft-model,prompt-lookup+draft-model
done
# 5b. the composition on the whole dev split (about 25-30 minutes each here)
for T in 1 0.7; do
  $B --per-category 0 --max-new-tokens 96 --temperature $T --out benchmarks/dev-split-draft/t$T \
     --methods plain,prompt-lookup+draft-model
done
$B --per-category 0 --max-new-tokens 128 --temperature 0 --out benchmarks/dev-split-draft/t0 \
   --methods plain,prompt-lookup+draft-model
# 6. the target mass several model-free candidates could reach (no timing)
for T in 1 0.7; do
  .venv/bin/python scripts/candidate_mass.py --temperature $T --per-category 4 --max-new-tokens 96
done > benchmarks/candidate-mass/tables.md
# (not committed) the anchors on the same prompts, in their own environment:
#   scripts/setup_anchors.sh && $B --per-category 3 --methods plain,prompt-lookup --anchors genai,hf --out benchmarks/tmp/anchors
