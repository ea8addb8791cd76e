"""What a benchmark's record says about where it ran: the machine, the packages, the checkout.

Every benchmark writes these three the same way: `ortspec bench` (its results.json), the serving
benchmark (`serving.py`), the anchors' head-to-head run and the soak test.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import subprocess
from typing import Any

from ..ort.machine import cpu_model


def machine() -> dict[str, Any]:
    """The CPU's model, logical CPUs, memory (KiB, from /proc/meminfo), Python, onnxruntime and
    the operating system."""
    import onnxruntime as ort

    mem = None
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            mem = next((ln.split()[1] for ln in f if ln.startswith("MemTotal")), None)
    except OSError:
        pass
    return {"cpu": cpu_model(), "cpu_count": os.cpu_count(), "mem_kib": mem, "python": platform.python_version(),
            "onnxruntime": ort.__version__, "platform": platform.platform()}


def versions(packages: tuple[str, ...]) -> dict[str, str]:
    """Python's version and those of `packages` that are installed."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in packages:
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def checkout(ignore: tuple[str, ...] = ("benchmarks/",)) -> dict[str, Any]:
    """The commit of the git checkout this `ortspec` is imported from, and the tracked files
    changed since (those under `ignore`, results that do not change what runs, left out); None
    for each where there is no checkout (an installed wheel) or no git."""
    spec = importlib.util.find_spec("ortspec.runtime")
    where = next(iter(spec.submodule_search_locations or ()), None) if spec else None

    def git(*args: str, cwd: str | None) -> str | None:
        if cwd is None:
            return None
        try:
            return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                                  timeout=30, check=True).stdout
        except (OSError, subprocess.SubprocessError):
            return None

    top = git("rev-parse", "--show-toplevel", cwd=where)
    root = top.strip() if top else None
    status = git("status", "--porcelain", "--untracked-files=no", cwd=root)
    commit = git("rev-parse", "HEAD", cwd=root)
    return {"commit": commit and commit.strip(),
            "changed": None if status is None else [
                ln[3:] for ln in status.splitlines() if not ln[3:].startswith(ignore)]}

