"""Where ortspec keeps downloads and exports: one definition for the runtime and the export."""

from __future__ import annotations

import os
from pathlib import Path

MODELS_DIR_ENV = "ORTSPEC_MODELS_DIR"
DEFAULT_MODEL_NAME = "smollm2-135m-instruct-fp32"  # the default recipe's fp32 export


def models_dir() -> Path:
    """The repository's `models/` (recipes, download cache, exported models); $ORTSPEC_MODELS_DIR
    overrides it."""
    env = os.environ.get(MODELS_DIR_ENV)
    return Path(env) if env else Path(__file__).resolve().parents[1] / "models"


def default_model_path() -> Path:
    return models_dir() / "exported" / DEFAULT_MODEL_NAME
