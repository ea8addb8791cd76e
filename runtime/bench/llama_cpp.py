"""llama.cpp as a peer in the benchmarks: finding its binaries, requantizing a GGUF, and the
command line of `llama-server`.

Nothing here builds or downloads llama.cpp. Build it from the copy the `llama-cpp-python`
sdist vendors (docs/benchmarks/llama-server/README.md says how), then point the benchmarks at
it with `--llama-cpp DIR` or `$ORTSPEC_LLAMA_CPP`: DIR is the build's `bin/` directory, the
build directory, or the llama.cpp checkout (whose `build*/bin/` is searched). A benchmark
without it skips llama.cpp and says why (`LlamaCppMissing`).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path

from ..errors import OrtspecError

LLAMA_CPP_ENV = "ORTSPEC_LLAMA_CPP"
SERVER, QUANTIZE = "llama-server", "llama-quantize"


class LlamaCppMissing(OrtspecError):
    """llama.cpp's binaries were not found (the message says where it looked)."""


@dataclasses.dataclass(frozen=True)
class LlamaCpp:
    """The directory holding llama.cpp's `llama-server` and `llama-quantize`."""

    bin_dir: Path

    @property
    def server(self) -> Path:
        return self.bin_dir / SERVER

    @property
    def quantize(self) -> Path:
        return self.bin_dir / QUANTIZE


def _candidates(root: Path) -> list[Path]:
    """Where under `root` a build's binaries may be: root itself, root/bin, root/build*/bin."""
    return [root, root / "bin", *sorted(p / "bin" for p in root.glob("build*") if p.is_dir())]


def find_llama_cpp(directory: str | os.PathLike | None = None) -> LlamaCpp:
    """The llama.cpp build in `directory` (else $ORTSPEC_LLAMA_CPP); LlamaCppMissing, naming
    the places searched, when neither is given or none holds both binaries."""
    given = directory if directory is not None else os.environ.get(LLAMA_CPP_ENV)
    if not given:
        raise LlamaCppMissing(f"llama.cpp not given: pass --llama-cpp DIR or set "
                              f"${LLAMA_CPP_ENV} (docs/benchmarks/llama-server/README.md builds it)")
    searched = _candidates(Path(given).expanduser())
    for d in searched:
        if (d / SERVER).is_file() and (d / QUANTIZE).is_file():
            return LlamaCpp(d)
    raise LlamaCppMissing(f"no {SERVER} and {QUANTIZE} in any of "
                          f"{', '.join(str(d) for d in searched)}")


def requantized(llama: LlamaCpp, gguf: Path, kind: str, cache: Path) -> Path:
    """`gguf` requantized to `kind` (e.g. "Q4_0", llama.cpp's fast CPU format) with
    `llama-quantize --allow-requantize`, made once into `cache` and reused."""
    out = cache / f"{gguf.stem}.{kind}.gguf"
    if out.is_file() and out.stat().st_mtime >= gguf.stat().st_mtime:
        return out
    cache.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    r = subprocess.run([str(llama.quantize), "--allow-requantize", str(gguf), str(tmp), kind],
                       capture_output=True, text=True)
    if r.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise OrtspecError(f"{QUANTIZE} {kind} of {gguf} failed ({r.returncode}): "
                           f"{(r.stderr or r.stdout)[-800:]}")
    os.replace(tmp, out)
    return out


def server_command(llama: LlamaCpp, gguf: Path, port: int, *, threads: int, parallel: int,
                   context_per_slot: int, extra: tuple[str, ...] = ()) -> list[str]:
    """`llama-server` on 127.0.0.1:`port` with `parallel` slots of `context_per_slot` tokens
    each (its -c is the total), `threads` threads for generation and for batches, and the
    flags in `extra` (e.g. its n-gram speculation)."""
    return [str(llama.server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(threads), "-tb", str(threads), "-np", str(parallel),
            "-c", str(parallel * context_per_slot), *extra]


def ngram_flags(llama: LlamaCpp) -> tuple[str, ...] | None:
    """The flags that turn on this build's draft-free n-gram speculation, read from its
    `--help`; None when it has none."""
    r = subprocess.run([str(llama.server), "--help"], capture_output=True, text=True)
    text = r.stdout + r.stderr
    if "ngram-simple" in text and "--spec-type" in text:
        return ("--spec-type", "ngram-simple")
    return None
