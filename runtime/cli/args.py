"""Argument handling every `ortspec` subcommand shares: the parser and the common options.

Imports only the errors and the paths, so each command's module (`ortspec generate`, `check`,
`bench`) can use it without importing another command.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import OrtspecError
from ..paths import default_model_path


class UserErrorParser(argparse.ArgumentParser):
    """argparse, with a bad value reported like every other user error: one line, status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise OrtspecError(f"{message} (see `{self.prog} -h`)")


def model_arg(value: str | None, *, prefer_batched: bool = False) -> Path:
    """--model's directory, or the default model's when it was not given (which must exist);
    `prefer_batched`: its batched export (`--attention window`) when that one exists."""
    if value:
        return Path(value)
    batched = default_model_path(batched=True)
    if prefer_batched and (batched / "manifest.json").is_file():
        return batched
    path = default_model_path()
    if not (path / "manifest.json").is_file():
        raise OrtspecError(
            f"no --model given and the default model is not exported yet ({path}); "
            f"run `ortspec export` first"
        )
    return path


def check_drafter_arg(drafter: str, model_dir: Path) -> None:
    """--drafter against the model's manifest, before anything is loaded: a drafter that needs a
    trained draft head the model lacks is an InvalidOptionError (a missing draft model is
    `load_model`'s to refuse)."""
    from ..ort.manifest import read_manifest
    from ..request import check_draft_head

    # the manifest's fields only: load_model checks the files' sha256 next
    manifest = read_manifest(model_dir, verify_checksums=False)
    check_draft_head(drafter, has_draft_head=manifest.draft_head is not None, path=str(model_dir))


def providers_arg(value: str | None) -> list[str] | None:
    """--providers "A,B" as ["A", "B"]; None (the default order) when not given."""
    return [p.strip() for p in value.split(",") if p.strip()] if value else None


def add_model_options(p: argparse.ArgumentParser) -> None:
    """--model, --providers, --threads."""
    p.add_argument("--model", help="model directory (default: the exported default model)")
    p.add_argument("--providers",
                   help="comma-separated, e.g. CUDAExecutionProvider,CPUExecutionProvider")
    p.add_argument("--threads", type=int, default=None,
                   help="onnxruntime's intra-op threads (default: its own choice, the cores)")
