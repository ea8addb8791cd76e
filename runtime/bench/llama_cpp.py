"""llama.cpp as a peer in the benchmarks: finding its binaries (and the checkout's
`convert_hf_to_gguf.py`), converting a Hugging Face checkpoint to GGUF, quantizing and
requantizing a GGUF, and the command line of `llama-server`.

Nothing here builds or downloads llama.cpp. Build it from the copy the `llama-cpp-python`
sdist vendors (docs/benchmarks/llama-server/README.md says how), then point the benchmarks at
it with `--llama-cpp DIR` or `$ORTSPEC_LLAMA_CPP`: DIR is the build's `bin/` directory, the
build directory, or the llama.cpp checkout (whose `build*/bin/` is searched). A benchmark
without it skips llama.cpp and says why (`LlamaCppMissing`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from ..errors import OrtspecError

LLAMA_CPP_ENV = "ORTSPEC_LLAMA_CPP"
SERVER, QUANTIZE = "llama-server", "llama-quantize"
CONVERTER = "convert_hf_to_gguf.py"
# what the converter imports for a Llama checkpoint (sentencepiece even for a BPE tokenizer: it
# tries a tokenizer.model first), by pip name
CONVERTER_MODULES = {"torch": "torch", "transformers": "transformers", "numpy": "numpy",
                     "sentencepiece": "sentencepiece", "google.protobuf": "protobuf"}
# a Q4_1 file laid out like the default model's: every matrix Q4_1, the (tied) embedding Q8_0
Q4_1_AS_SHIPPED = ("--pure", "--token-embedding-type", "q8_0")


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
    if _fresh(out, gguf):
        return out
    return quantize(llama, gguf, out, kind, flags=("--allow-requantize",))


def quantize(llama: LlamaCpp, gguf: Path, out: Path, kind: str, *,
             flags: tuple[str, ...] = ()) -> Path:
    """`llama-quantize FLAGS gguf out kind`, written under a temporary name and moved into
    place; OrtspecError quoting its output when it fails (nothing is left behind)."""
    return _write_by(lambda tmp: [str(llama.quantize), *flags, str(gguf), str(tmp), kind], out,
                     what=f"{QUANTIZE} {kind} of {gguf}")


def _write_by(command, out: Path, *, what: str, env: dict[str, str] | None = None) -> Path:
    """Run `command(tmp)`, a tool that writes the file `tmp`, then move it to `out`;
    OrtspecError quoting the tool's output when it fails (nothing is left behind)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    r = subprocess.run(command(tmp), capture_output=True, text=True, env=env)
    if r.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise OrtspecError(f"{what} failed ({r.returncode}): {(r.stderr or r.stdout)[-800:]}")
    os.replace(tmp, out)
    return out


def _fresh(out: Path, source: Path) -> bool:
    """`out` exists and is no older than `source` (a cached product of it)."""
    return out.is_file() and out.stat().st_mtime >= source.stat().st_mtime


def converter(llama: LlamaCpp) -> Path:
    """The `convert_hf_to_gguf.py` of the checkout `llama`'s binaries were built in (the
    bin directory or one of its three parents); LlamaCppMissing when there is none."""
    searched = [llama.bin_dir, *list(llama.bin_dir.parents)[:3]]
    for d in searched:
        if (d / CONVERTER).is_file() and (d / "gguf-py").is_dir():
            return d / CONVERTER
    raise LlamaCppMissing(f"no {CONVERTER} beside gguf-py/ in any of "
                          f"{', '.join(str(d) for d in searched)}: pass the llama.cpp checkout "
                          f"the binaries were built in")


def check_converter_modules() -> None:
    """LlamaCppMissing naming what to install when this interpreter lacks a module the
    converter imports (CONVERTER_MODULES); called before any checkpoint is built."""
    missing = [pip for module, pip in CONVERTER_MODULES.items() if not _importable(module)]
    if missing:
        raise LlamaCppMissing(f"llama.cpp's {CONVERTER} runs in this interpreter "
                              f"({sys.executable}) and needs {', '.join(missing)}: "
                              f"pip install {' '.join(missing)}")


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a dotted name whose parent is missing
        return False


def convert_hf(llama: LlamaCpp, hf_dir: Path, out: Path, *, outtype: str = "f16") -> Path:
    """The Hugging Face checkpoint `hf_dir` as a GGUF file `out` (`outtype` weights), by the
    checkout's own converter with its own gguf-py, in this interpreter (it needs
    CONVERTER_MODULES); made once and reused while newer than the checkpoint's config.json."""
    if _fresh(out, hf_dir / "config.json"):
        return out
    script = converter(llama)
    check_converter_modules()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(script.parent / "gguf-py"), os.environ.get("PYTHONPATH")]))}
    return _write_by(lambda tmp: [sys.executable, str(script), str(hf_dir), "--outfile", str(tmp),
                                  "--outtype", outtype], out, what=f"{CONVERTER} of {hf_dir}",
                     env=env)


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
