"""The wheel, installed as a user installs it, works from any directory.

Builds the wheel, installs it (not editable) into a fresh virtual environment, and from a
directory outside the checkout, with a fresh per-user cache directory:
- the runtime alone (no extras) imports without torch and without the export or bench tiers,
  reports its version, and `ortspec export` says which extra it needs;
- with the extras, `ortspec export` makes the default model, `ortspec generate` decodes with
  it, and a tiny `ortspec bench` writes its tables.
Slow (several minutes: installs, a download of the default model's wheel, an export).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ortspec.runtime.ort import kernels

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TORCH = "torch==2.13.0"  # the CPU build this machine's pip takes from local disk


def _run(cmd: list[str], *, cwd: Path, env: dict[str, str], timeout: float = 900) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return r


def _ok(r: subprocess.CompletedProcess, what: str) -> str:
    assert r.returncode == 0, f"{what} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    # a copy of the working tree (tracked and untracked, not ignored): the build never writes into the checkout
    src = tmp_path_factory.mktemp("src")
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            (src / name).write_bytes((REPO / name).read_bytes())
    _ok(_run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(src)],
             cwd=src, env=dict(os.environ)), "building the wheel")
    wheels = list(out.glob("ortspec-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    """A fresh venv and a user's environment: a home and cache of their own, no checkout paths."""
    root = tmp_path_factory.mktemp("user")
    venv = root / "venv"
    _ok(_run([sys.executable, "-m", "venv", str(venv)], cwd=root, env=dict(os.environ)), "venv")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ORTSPEC_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(HOME=str(root / "home"), XDG_CACHE_HOME=str(root / "home" / ".cache"),
               PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")
    (root / "home").mkdir()
    work = root / "elsewhere"  # the user's working directory, nowhere near the checkout
    work.mkdir()
    return venv / "bin", env, work


def _status() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--ignored"], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout


def test_the_wheel_installs_and_runs_outside_the_checkout(wheel, user):
    bin_dir, env, work = user
    status_before = _status()
    py, pip, ortspec = str(bin_dir / "python"), [str(bin_dir / "python"), "-m", "pip"], str(bin_dir / "ortspec")
    quiet = ["-q", "--disable-pip-version-check"]

    # 1. the runtime alone
    _ok(_run([*pip, "install", *quiet, str(wheel)], cwd=work, env=env), "pip install the wheel")
    out = _ok(_run([py, "-c",
                    "import sys, importlib.metadata as md, ortspec.runtime as r\n"
                    "assert r.__version__ == md.version('ortspec'), (r.__version__, md.version('ortspec'))\n"
                    "from pathlib import Path\n"
                    "assert Path(r.__file__).parts[-4:-1] == ('site-packages', 'ortspec', 'runtime'), r.__file__\n"
                    "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'onnx')\n"
                    "             or m.startswith(('ortspec.export', 'ortspec.runtime.bench')))\n"
                    "assert not bad, bad\n"
                    "print('runtime', r.__version__)"], cwd=work, env=env), "importing the runtime")
    assert out.startswith("runtime ")
    r = _run([ortspec, "export"], cwd=work, env=env)
    assert r.returncode == 2 and "needs the export extra" in r.stderr, r.stderr
    r = _run([ortspec, "export", "--help"], cwd=work, env=env)  # the options, without the extra
    assert r.returncode == 0 and "--quant" in r.stdout and "--attention" in r.stdout, r.stderr

    # 2. with the extras: export the default model, generate, a tiny bench
    _ok(_run([*pip, "install", *quiet, TORCH], cwd=work, env=env, timeout=1800), "pip install torch")
    _ok(_run([*pip, "install", *quiet, f"ortspec[export,bench] @ {wheel.as_uri()}"], cwd=work, env=env,
             timeout=1800), "pip install the extras")
    out = _ok(_run([ortspec, "export"], cwd=work, env=env, timeout=1800), "ortspec export")
    cache = Path(env["XDG_CACHE_HOME"]) / "ortspec" / "models" / "exported" / "smollm2-135m-instruct-int4"
    assert (cache / "manifest.json").is_file(), out  # the per-user models directory, at int4
    # pip built the kernel library into the wheel, and the export runs its layers on it
    weights = json.loads((cache / "manifest.json").read_text())["extra"]["weights"]
    assert weights["kernel"] == ("ortspec" if kernels.available() else "onnxruntime"), weights
    r = _ok(_run([ortspec, "generate", "--prompt", "Name three colours.", "--chat", "--max-new-tokens", "16"],
                 cwd=work, env=env), "ortspec generate")
    assert r.strip(), "generate printed no text"
    bench_out = work / "bench"
    _ok(_run([ortspec, "bench", "--per-category", "1", "--categories", "qa,translation",
              "--max-new-tokens", "16", "--methods", "plain,prompt-lookup", "--out", str(bench_out)],
             cwd=work, env=env, timeout=1800), "ortspec bench")
    assert (bench_out / "results.md").is_file() and (bench_out / "results.json").is_file()
    # and nothing was written into the checkout (models, caches, build files)
    assert _status() == status_before
