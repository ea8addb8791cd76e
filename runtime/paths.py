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

MODELS_DIR_ENV = "ORTSPEC_MODELS_DIR"
CACHE_DIR_ENV = "ORTSPEC_CACHE_DIR"
DEFAULT_MODEL_NAME = "smollm2-135m-instruct-fp32"  # the default recipe's fp32 export
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


def default_model_path(*, batched: bool = False) -> Path:
    """The default model's export; `batched`: the one exported with `--attention window`."""
    return models_dir() / "exported" / (BATCHED_MODEL_NAME if batched else DEFAULT_MODEL_NAME)
