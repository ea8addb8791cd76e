"""Where ortspec keeps what it downloads, exports and measures: one definition for every tier.

- `cache_root()`: $ORTSPEC_CACHE_DIR, else the per-user cache directory ($XDG_CACHE_HOME/ortspec,
  else ~/.cache/ortspec). Cost-curve calibrations live under it.
- `models_dir()`: $ORTSPEC_MODELS_DIR, else `cache_root()/models`. Downloads go to its `cache/`,
  exported model directories to its `exported/`. A checkout points $ORTSPEC_MODELS_DIR at its
  own `models/` (the Makefile does), an installed wheel uses the per-user directory.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import InvalidOptionError

MODELS_DIR_ENV = "ORTSPEC_MODELS_DIR"
CACHE_DIR_ENV = "ORTSPEC_CACHE_DIR"
# The default model's exports: int4 (the GGUF's Q4_1 blocks exactly, `ortspec export --quant
# int4`) is the default precision, fp32 one argument away.
PRECISIONS = ("int4", "fp32")
DEFAULT_PRECISION = "int4"
MODEL_NAMES = {"int4": "smollm2-135m-instruct-int4", "fp32": "smollm2-135m-instruct-fp32"}
DEFAULT_MODEL_NAME = MODEL_NAMES[DEFAULT_PRECISION]
FP32_MODEL_NAME = MODEL_NAMES["fp32"]
BATCHED_MODEL_NAME = DEFAULT_MODEL_NAME + "-window"  # its batched graph (--attention window)


def cache_root() -> Path:
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "ortspec"


def models_dir() -> Path:
    env = os.environ.get(MODELS_DIR_ENV)
    return Path(env) if env else cache_root() / "models"


def default_model_path(*, batched: bool = False, precision: str = DEFAULT_PRECISION) -> Path:
    """The default model's export: at int4 unless `precision="fp32"`; `batched`: the one
    exported with `--attention window`."""
    if precision not in PRECISIONS:
        raise InvalidOptionError(f"precision must be one of {', '.join(PRECISIONS)}, got "
                                 f"{precision!r}", option="precision")
    name = MODEL_NAMES[precision]
    return models_dir() / "exported" / (name + "-window" if batched else name)


def export_command(directory: str | os.PathLike) -> str | None:
    """The `ortspec export` command that makes `directory` where it is one of the default model's
    exports under `models_dir()` (named in the error for a missing one), else None."""
    d = Path(directory)
    if d.parent != models_dir() / "exported":
        return None
    for precision, name in MODEL_NAMES.items():
        flags = [] if precision == DEFAULT_PRECISION else [f"--dtype {precision}"]
        if d.name == name + "-window":
            flags.append("--attention window")
        elif d.name != name:
            continue
        return " ".join(["ortspec export", *flags])
    return None
