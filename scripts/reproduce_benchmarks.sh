#!/usr/bin/env bash
# Regenerates the raw results behind the summaries in docs/benchmarks/ (default model, this
# machine's CPU), with the command each directory's README states. Raw results (results.json,
# results.md, plots) go to benchmarks/tmp/<directory>/, which git ignores; copy what a summary
# needs into docs/benchmarks/ by hand.
#
#   scripts/reproduce_benchmarks.sh                       # every directory (many hours)
#   scripts/reproduce_benchmarks.sh dev-t0 serve-batched  # only those
#
# Directories: dev-t0 dev-t1 draft-length draft-model drafters-with-q shared-kv-draft
# dev-split-draft candidate-mass int4-dev-t0 int4-sym4-dev-t0 serve serve-batched
# int4-quality, and int4-vs-genai, llama-server and scale (not in the default set: they need
# the anchors' environment, made by scripts/setup_anchors.sh, and a llama.cpp build).
# Each run interleaves its methods per prompt, so only the ratios and counts are evidence;
# absolute tokens/s drift with the machine.
set -euo pipefail
cd "$(dirname "$0")/.."
make setup
export ORTSPEC_MODELS_DIR="${ORTSPEC_MODELS_DIR:-$PWD/models}"
OUT=benchmarks/tmp
EXPORTED="$ORTSPEC_MODELS_DIR/exported"
PY=.venv/bin/python
B=".venv/bin/ortspec bench"
SERVING="$PY -m ortspec.runtime.bench.serving"
mkdir -p "$OUT"

# the exports the runs read, each made on first use
default_model() {  # ensure_default_model's keyword arguments, e.g. "quant='int4'"
  $PY -c "from ortspec.export import ensure_default_model; print(ensure_default_model($1))"
}
sym4_model() {
  local dir="$EXPORTED/smollm2-135m-instruct-int4-sym4"
  [ -d "$dir" ] || .venv/bin/ortspec export --quant int4 --quant-scheme symmetric --lm-head int4 --out "$dir" >&2
  echo "$dir"
}

# 1. the full dev split, greedy: plain vs prompt lookup with the cost-model draft length
run_dev-t0() {
  $B --per-category 0 --temperature 0 --methods plain,prompt-lookup --out $OUT/dev-t0
}
# 1b. temperature 1: plain vs prompt lookup with the cost model, 16 prompts per category, each twice
run_dev-t1() {
  $B --per-category 16 --temperature 1 --repeats 2 --methods plain,prompt-lookup --out $OUT/dev-t1
}
# 2. fixed draft lengths vs the cost model, greedy and temperature 1 (8 prompts per category)
run_draft-length() {
  for T in 0 1; do
    $B --per-category 8 --temperature $T --out $OUT/draft-length-t$T \
       --methods plain,prompt-lookup,prompt-lookup:k2,prompt-lookup:k4,prompt-lookup:k8
  done
}
# 3. self-speculative draft models (exported beside the target on first use), 3 prompts per category
run_draft-model() {
  $PY -c "from ortspec.export import ensure_default_draft; ensure_default_draft('int4')"
  for T in 0 1; do
    $B --per-category 3 --temperature $T --out $OUT/draft-model-t$T \
       --methods plain,prompt-lookup,draft-model,prompt-lookup+draft-model
  done
}
# 4. the drafters that sample from a q (n-gram counts, the target's cached rows), T=0.7 and 1
run_drafters-with-q() {
  for T in 0.7 1; do
    $B --per-category 3 --max-new-tokens 96 --temperature $T --out $OUT/drafters-with-q/t$T \
       --methods plain,prompt-lookup,ngram-counts,target-cache
  done
}
# 5. the int4 draft on its target's KV buffers, alone and composed with prompt lookup, T = 0.7, 0, 1
run_shared-kv-draft() {
  $PY -c "from ortspec.export import ensure_default_draft; ensure_default_draft('int4')"
  for T in 0.7 0 1; do
    $B --per-category 4 --max-new-tokens 96 --temperature $T --out $OUT/shared-kv-draft/t$T \
       --methods plain,prompt-lookup,draft-model,prompt-lookup+draft-model
  done
}
# 5b. the composition on the whole dev split (about 25-30 minutes each here); the current draft
# is the one docs/benchmarks/dev-split-draft/ measured as rev3/
run_dev-split-draft() {
  $PY -c "from ortspec.export import ensure_default_draft; ensure_default_draft('int4')"
  for T in 1 0.7; do
    $B --per-category 0 --max-new-tokens 96 --temperature $T --out $OUT/dev-split-draft/t$T \
       --methods plain,prompt-lookup+draft-model
  done
  $B --per-category 0 --max-new-tokens 128 --temperature 0 --out $OUT/dev-split-draft/t0 \
     --methods plain,prompt-lookup+draft-model
}
# 6. the target mass several model-free candidates could reach (no timing)
run_candidate-mass() {
  mkdir -p $OUT/candidate-mass
  for T in 1 0.7; do
    $PY scripts/candidate_mass.py --temperature $T --per-category 4 --max-new-tokens 96
  done > $OUT/candidate-mass/tables.md
}
# 7. int4 targets, the full dev split, greedy, 64 new tokens: the default format and genai's
run_int4-dev-t0() {
  local model; model=$(default_model "quant='int4', progress=False")
  $B --model "$model" --per-category 0 --temperature 0 --methods plain,prompt-lookup \
     --max-new-tokens 64 --out $OUT/int4-dev-t0
}
run_int4-sym4-dev-t0() {
  local model; model=$(sym4_model)
  $B --model "$model" --per-category 0 --temperature 0 --methods plain,prompt-lookup \
     --max-new-tokens 64 --out $OUT/int4-sym4-dev-t0
}
# 8. `ortspec serve` on the default export: throughput, latency, the overhead per token
run_serve() {
  local fp32; fp32=$(default_model "'fp32', progress=False")
  $SERVING --model "$fp32" --drafters prompt-lookup,none --concurrency 1,4,8 \
      --requests 16 --rounds 3 --max-tokens 64 --overhead-requests 16 --out $OUT/serve
  $SERVING --model "$fp32" --drafters prompt-lookup,none --concurrency 1 --rounds 0 \
      --max-tokens 64 --overhead-requests 40 --out $OUT/serve/overhead
}
# 9. `ortspec serve` on the batched graphs (--attention window): run D's three commands, run G
# (the dev split's short prompts), run H / I (the prefix cache; prompts each sent once)
run_serve-batched() {
  local fp32 int4
  fp32=$(default_model "'fp32', attention='window', progress=False")
  int4=$(default_model "attention='window', quant='int4', progress=False")
  $SERVING --model "$fp32" --drafters prompt-lookup,none --concurrency 1,4,8 --requests 16 --rounds 4 \
      --max-tokens 64 --overhead-requests 0 --out $OUT/serve-batched/fp32
  $SERVING --model "$int4" --drafters prompt-lookup,none --concurrency 1,4,8 --requests 16 --rounds 4 \
      --max-tokens 64 --overhead-requests 0 --out $OUT/serve-batched/int4
  $SERVING --model "$fp32" --prompts spec-bench-dev --per-category 4 --drafters prompt-lookup,none \
      --concurrency 1,4,8 --requests 24 --rounds 1 --max-tokens 128 --overhead-requests 0 \
      --out $OUT/serve-batched/dev-fp32
  local G=(--model "$fp32" --prompts spec-bench-dev --categories multi-turn,translation,qa,math_reasoning
           --per-category 4 --drafters prompt-lookup,none --concurrency 1,4,8 --requests 16
           --rounds 3 --max-tokens 64 --overhead-requests 0)
  $SERVING "${G[@]}" --out $OUT/serve-batched/run-g/dev-short
  $SERVING "${G[@]}" --out $OUT/serve-batched/run-h/repeated
  $SERVING "${G[@]}" --prefix-cache-mib 0 --out $OUT/serve-batched/run-h/repeated-no-cache
  $SERVING "${G[@]}" --per-category 40 --distinct-prompts --out $OUT/serve-batched/run-i/distinct
  $SERVING "${G[@]}" --per-category 40 --distinct-prompts --seed 1 --out $OUT/serve-batched/run-i/distinct-2
}
# 10. ortspec int4 against onnxruntime-genai int4, one process, interleaved (run 4); needs
# scripts/setup_anchors.sh (genai's models, and ortspec installed into .venv-anchors)
run_int4-vs-genai() {
  local int4 sym4
  int4=$(default_model "quant='int4', progress=False")
  sym4=$(sym4_model)
  .venv-anchors/bin/python -m ortspec.runtime.bench.anchors.head_to_head --per-category 4 \
      --max-new-tokens 96 --ortspec int4-sym4="$sym4" --ortspec int4="$int4" \
      --genai int4=models/cache/genai-smollm2-int4 --out $OUT/int4-vs-genai
}
# 11. int4 formats against fp32: perplexity, top-1 agreement (no decoding timed)
run_int4-quality() {
  local fp32 int4 v
  fp32=$(default_model "'fp32', progress=False")
  int4=$(default_model "progress=False")
  local C=(--compare "int4 Q4_1-exact (default)=$int4")
  for v in "int4-head4:--lm-head int4" "symmetric:--quant-scheme symmetric" \
           "symmetric-head4:--quant-scheme symmetric --lm-head int4" "zero-point:--quant-scheme zero-point"; do
    [ -d "$OUT/int4-formats/${v%%:*}" ] || .venv/bin/ortspec export --quant int4 ${v#*:} \
        --out "$OUT/int4-formats/${v%%:*}" --quiet
    C+=(--compare "${v%%:*}=$OUT/int4-formats/${v%%:*}")
  done
  $PY -m ortspec.runtime.bench.int4_quality --fp32 "$fp32" "${C[@]}" --prompts 24 \
      --answer-tokens 64 --out $OUT/int4-quality
}
# 12. `ortspec serve` against llama-server on the same weights (needs $ORTSPEC_LLAMA_CPP, a
# llama.cpp build: docs/benchmarks/llama-server/README.md)
run_llama-server() {
  default_model "attention='window', progress=False" >/dev/null
  $PY -m ortspec.runtime.bench.serving_llama --concurrency 1,4,8 --requests 8 --rounds 2 \
      --max-tokens 64 --threads 2 --out $OUT/llama-server
}
# 13. plain decoding against llama-server Q4_0 on random-weight Llamas of 360M and 1.07B
# parameters, and ortspec's verify curve (needs $ORTSPEC_LLAMA_CPP, the llama.cpp checkout with
# its build: docs/benchmarks/scale/README.md); checkpoints, GGUF files and exports are kept in
# benchmarks/tmp/scale-work
run_scale() {
  $PY -m ortspec.runtime.bench.scale --shapes 360m,1b --prompts 12 --max-tokens 64 --rounds 2 \
      --threads 2 --work benchmarks/tmp/scale-work --out $OUT/scale
}

ALL=(dev-t0 dev-t1 draft-length draft-model drafters-with-q shared-kv-draft dev-split-draft
     candidate-mass int4-dev-t0 int4-sym4-dev-t0 serve serve-batched int4-quality)
for name in "${@:-${ALL[@]}}"; do
  if ! declare -F "run_$name" >/dev/null; then
    echo "unknown directory: $name (one of: ${ALL[*]} int4-vs-genai llama-server scale)" >&2
    exit 2
  fi
  echo "== $name -> $OUT/" >&2
  "run_$name"
done
# (not committed either) the anchors on the same prompts, in their own environment:
#   scripts/setup_anchors.sh && .venv/bin/ortspec bench --per-category 3 --methods plain,prompt-lookup \
#       --anchors genai,hf --out benchmarks/tmp/anchors
