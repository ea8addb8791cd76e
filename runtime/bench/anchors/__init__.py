"""Comparison anchors for ortspec's latency benchmark: the systems a user would pick instead.

    onnxruntime-genai 0.18   plain greedy vs its n-gram (prompt-lookup) speculative mode, on the
                             graph its model builder makes from the same GGUF (fp32 or int4)
    HF transformers          greedy `generate` vs `generate(prompt_lookup_num_tokens=10)`, PyTorch
                             eager, float32 weights dequantised from the same GGUF

They stay out of ortspec's dependencies: onnxruntime-genai and its builder live in
`.venv-anchors/`, made by `scripts/setup_anchors.sh`, and each anchor runs as a subprocess
(`genai_anchor.py` under `.venv-anchors/bin/python`, `hf_anchor.py` under the current
interpreter by default). A missing venv, package or model gives an `AnchorUnavailable` with the
reason, never an exception:

    from ortspec.runtime.bench.anchors import run_genai_anchor, run_hf_anchor, load_spec_bench, summarize
    prompts = load_spec_bench(per_category=2)   # the packaged Spec-Bench file, dev split
    runs = run_genai_anchor(prompts, max_new_tokens=128, repeats=2)
    if runs:                       # AnchorUnavailable is falsy
        print(summarize(runs)["per_category"])
    else:
        print("skipped:", runs.reason)

Records and the prompt format are described in `anchor_io`. The Spec-Bench questions come from
`ortspec.runtime.bench.workload`, the one loader of that file, so the anchors and `ortspec bench` run
the same split and sample.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from ortspec.runtime.bench.workload import load_questions
from ortspec.runtime.paths import models_dir

from .anchor_io import (
    DEFAULT_SYSTEM_PROMPT,
    format_summary,
    prompt_digest,
    read_jsonl,
    render_chatml,
    summarize,
    validate_prompts,
)

__all__ = [
    "AnchorRun",
    "AnchorUnavailable",
    "DEFAULT_SYSTEM_PROMPT",
    "default_paths",
    "format_summary",
    "genai_step_latency",
    "load_spec_bench",
    "prompt_digest",
    "read_jsonl",
    "render_chatml",
    "run_genai_anchor",
    "run_hf_anchor",
    "summarize",
]

ANCHORS_VENV_ENV = "ORTSPEC_ANCHORS_VENV"  # where scripts/setup_anchors.sh made the anchor venv


def load_spec_bench(
    path: str | os.PathLike | None = None,
    *,
    split: str = "dev",
    per_category: int | None = None,
    categories: Iterable[str] | None = None,
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
) -> list[dict[str, Any]]:
    """Spec-Bench questions as anchor prompts: first turn, rendered with `render_chatml`.

    `path`, `split` ("dev": even question ids, "heldout": odd, "all"), `per_category` and
    `categories` are those of `ortspec.runtime.bench.workload.load_questions` (path None: the packaged
    file), which picks the questions; each prompt is `{"id": "q<question_id>", "category",
    "subcategory", "prompt"}`.
    """
    return [
        {
            "id": f"q{q.question_id}",
            "category": q.category,
            "subcategory": q.subcategory,
            "prompt": render_chatml([{"role": "user", "content": q.text}], system_prompt),
        }
        for q in load_questions(path, split=split, per_category=per_category, categories=categories)
    ]


def default_paths() -> dict[str, Path]:
    """The anchor venv ($ORTSPEC_ANCHORS_VENV, else `.venv-anchors` in the current directory, where
    scripts/setup_anchors.sh makes it) and the models it set up under `models_dir()/cache`."""
    cache = models_dir() / "cache"
    venv = Path(os.environ.get(ANCHORS_VENV_ENV) or Path.cwd() / ".venv-anchors")
    return {
        "anchors_python": venv / "bin" / "python",
        "genai_fp32": cache / "genai-smollm2-fp32",
        "genai_int4": cache / "genai-smollm2-int4",
        "genai_int4-acc1": cache / "genai-smollm2-int4-acc1",
        "gguf": cache / "SmolLM2-135M-Instruct.Q4_1.gguf",
    }


@dataclass(frozen=True)
class AnchorUnavailable:
    """An anchor that could not run, and why. Falsy, so `if runs:` reads naturally."""

    system: str
    reason: str

    def __bool__(self) -> bool:
        return False

    def __str__(self) -> str:
        return f"{self.system} unavailable: {self.reason}"


SETUP_HINT = "run scripts/setup_anchors.sh"


def _tail(text: str, n: int = 1500) -> str:
    text = (text or "").strip()
    return text if len(text) <= n else "..." + text[-n:]


def _missing_modules(python: str, modules: Sequence[str]) -> list[str] | str:
    """Modules `python` cannot import; a string if `python` itself cannot run."""
    if os.path.abspath(python) == os.path.abspath(sys.executable):  # venvs share symlinks: no realpath
        return [m for m in modules if importlib.util.find_spec(m) is None]
    code = (
        "import importlib.util, json; "
        f"print(json.dumps([m for m in {list(modules)!r} if importlib.util.find_spec(m) is None]))"
    )
    try:
        p = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cannot run {python}: {e}"
    if p.returncode != 0:
        return f"{python} failed: {_tail(p.stderr, 400)}"
    return json.loads(p.stdout.strip().splitlines()[-1])


def _run_script(
    system: str,
    python: str,
    module: str,
    args: Sequence[str],
    prompts: Sequence[Mapping[str, Any]] | None,
    timeout: float | None,
) -> list[dict[str, Any]] | AnchorUnavailable:
    with tempfile.TemporaryDirectory(prefix="ortspec-anchor-") as tmp:
        out = Path(tmp) / "out.jsonl"
        cmd = [python, "-m", f"{__name__}.{module}", "--out", str(out), *args]
        if prompts is not None:
            try:
                checked = validate_prompts(prompts)
            except ValueError as e:
                return AnchorUnavailable(system, f"bad prompts: {e}")
            pfile = Path(tmp) / "prompts.jsonl"
            pfile.write_text("".join(json.dumps(p) + "\n" for p in checked), encoding="utf-8")
            cmd += ["--prompts", str(pfile)]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return AnchorUnavailable(system, f"timed out after {timeout} s")
        except OSError as e:
            return AnchorUnavailable(system, f"cannot run {python}: {e}")
        if p.returncode != 0:
            return AnchorUnavailable(system, f"exit code {p.returncode}: {_tail(p.stderr)}")
        try:
            return read_jsonl(out)
        except (OSError, ValueError) as e:
            return AnchorUnavailable(system, f"unreadable output: {e}")


def _genai_ready(python: Path, model_dir: Path) -> AnchorUnavailable | None:
    system = "onnxruntime-genai"
    if not python.exists():
        return AnchorUnavailable(system, f"no anchor venv at {python.parent.parent} ({SETUP_HINT})")
    missing = _missing_modules(str(python), ["onnxruntime_genai", "numpy"])
    if isinstance(missing, str):
        return AnchorUnavailable(system, missing)
    if missing:
        return AnchorUnavailable(system, f"{python} lacks {', '.join(missing)} ({SETUP_HINT})")
    if not (model_dir / "genai_config.json").is_file():
        return AnchorUnavailable(system, f"no onnxruntime-genai model at {model_dir} ({SETUP_HINT})")
    return None


def _genai_paths(python: str | Path | None, precision: str, model_dir: str | Path | None
                 ) -> tuple[Path, Path] | AnchorUnavailable:
    """The anchors' interpreter and genai's model directory (`model_dir`, else the one of
    `precision`), or why the genai anchor cannot run with them."""
    paths = default_paths()
    python = Path(python) if python else paths["anchors_python"]
    if model_dir is None and f"genai_{precision}" not in paths:
        return AnchorUnavailable("onnxruntime-genai", f"unknown precision {precision!r}")
    model_dir = Path(model_dir) if model_dir else paths[f"genai_{precision}"]
    problem = _genai_ready(python, model_dir)
    return (python, model_dir) if problem is None else problem


@dataclass(frozen=True)
class AnchorRun:
    """The options every anchor run takes (`run_genai_anchor`'s and `run_hf_anchor`'s keyword
    `**options`), given to each anchor's script as the same flags."""

    max_new_tokens: int = 128
    repeats: int = 1
    threads: int | None = None
    temperature: float = 0.0
    seed: int = 0
    modes: Sequence[str] = ("plain", "ngram")
    warmup: bool = True
    timeout: float | None = None  # seconds the anchor's subprocess may take

    def args(self) -> list[str]:
        args = ["--max-new-tokens", str(self.max_new_tokens), "--repeats", str(self.repeats),
                "--temperature", str(self.temperature), "--seed", str(self.seed),
                "--modes", ",".join(self.modes)]
        if self.threads is not None:
            args += ["--threads", str(self.threads)]
        if not self.warmup:
            args.append("--no-warmup")
        return args


def run_genai_anchor(
    prompts: Sequence[Mapping[str, Any]],
    *,
    precision: str = "fp32",
    model_dir: str | Path | None = None,
    ngram_size: int = 3,
    max_draft_tokens: int = 10,
    python: str | Path | None = None,
    **options: Any,
) -> list[dict[str, Any]] | AnchorUnavailable:
    """onnxruntime-genai: plain vs n-gram speculative decoding, interleaved per prompt;
    `options`: `AnchorRun`'s.

    `precision` picks models/cache/genai-smollm2-{fp32,int4,int4-acc1} unless `model_dir` is
    given (int4: MatMulNBits with int8 activations, accuracy_level 4, the builder's default;
    int4-acc1: fp32 compute, under which the n-gram output stays identical to plain).
    """
    run = AnchorRun(**options)
    found = _genai_paths(python, precision, model_dir)
    if isinstance(found, AnchorUnavailable):
        return found
    python, model_dir = found
    args = ["--model", str(model_dir), "--ngram-size", str(ngram_size),
            "--max-draft-tokens", str(max_draft_tokens), *run.args()]
    return _run_script("onnxruntime-genai", str(python), "genai_anchor", args, prompts, run.timeout)


def genai_step_latency(
    context: int = 256,
    *,
    steps: int = 32,
    precision: str = "fp32",
    model_dir: str | Path | None = None,
    threads: int | None = None,
    python: str | Path | None = None,
    timeout: float | None = None,
) -> dict[str, Any] | AnchorUnavailable:
    """onnxruntime-genai's median single-token step latency (ms) at ~`context` cached tokens."""
    found = _genai_paths(python, precision, model_dir)
    if isinstance(found, AnchorUnavailable):
        return found
    python, model_dir = found
    args = ["--model", str(model_dir), "--step-latency", str(context), "--steps", str(steps)]
    if threads is not None:
        args += ["--threads", str(threads)]
    rows = _run_script("onnxruntime-genai", str(python), "genai_anchor", args, None, timeout)
    if not rows:
        return rows if isinstance(rows, AnchorUnavailable) else AnchorUnavailable("onnxruntime-genai", "no output")
    return rows[0]


def run_hf_anchor(
    prompts: Sequence[Mapping[str, Any]],
    *,
    gguf: str | Path | None = None,
    prompt_lookup_num_tokens: int = 10,
    ngram_size: int | None = None,
    python: str | Path | None = None,
    **options: Any,
) -> list[dict[str, Any]] | AnchorUnavailable:
    """HF transformers on PyTorch: greedy generate vs prompt lookup, interleaved per prompt;
    `options`: `AnchorRun`'s.

    Runs under `python` (default: this interpreter, i.e. the main venv), in a subprocess.
    """
    run = AnchorRun(**options)
    system = "hf-transformers"
    python = str(python) if python else sys.executable
    gguf = Path(gguf) if gguf else default_paths()["gguf"]
    missing = _missing_modules(python, ["torch", "transformers", "gguf"])
    if isinstance(missing, str):
        return AnchorUnavailable(system, missing)
    if missing:
        return AnchorUnavailable(system, f"{python} lacks {', '.join(missing)} (pip install 'ortspec[export]')")
    if not gguf.exists():
        return AnchorUnavailable(system, f"no model at {gguf} ({SETUP_HINT} extracts the GGUF)")
    args = ["--gguf", str(gguf), "--prompt-lookup-num-tokens", str(prompt_lookup_num_tokens),
            *run.args()]
    if ngram_size is not None:
        args += ["--ngram-size", str(ngram_size)]
    return _run_script(system, python, "hf_anchor", args, prompts, run.timeout)
