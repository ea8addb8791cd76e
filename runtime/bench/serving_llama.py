"""`ortspec serve` against llama.cpp's `llama-server` on the same weights, side by side.

    python -m ortspec.runtime.bench.serving_llama --llama-cpp DIR [--model DIR] [--gguf FILE]
        [--concurrency 1,4,8] [--requests 8] [--rounds 2] [--max-tokens 64] [--threads 2]
        [--prompts 8] [--drafter prompt-lookup] [--out DIR]

Systems, each a server on 127.0.0.1, all started first and then measured in turn:
- `ortspec plain` and `ortspec <drafter>`: `ortspec serve` on the model directory (default:
  the default model's batched export, `ortspec export --attention window`, which must exist:
  the plain export runs one request per call), drafter none and `--drafter`
  (default prompt-lookup; auto is the server's own choice);
- `llama Q4_0` (and `llama Q4_0 ngram` where the build has n-gram speculation): llama-server
  on the GGUF requantized to Q4_0, llama.cpp's fast CPU format;
- `llama Q4_1`: llama-server on the GGUF as shipped (the default model's is Q4_1).
Both servers get the same threads and as many parallel slots as the highest concurrency.

Each round sends, at each concurrency level, `--requests` chat requests from that many client
threads (the official `openai` package, streaming, greedy) to every system, the systems'
order rotated from batch to batch so the machine's drift hits them alike. Reported per
system and level: aggregate tok/s (completion tokens over the batch's wall time; median over
rounds), time to the first streamed text p50 / p90, and whether every output equals that
system's output for the same prompt at the lowest concurrency (stability under load).
Prompts: held-out Spec-Bench questions (odd ids), which nothing in ortspec is tuned on.
Without llama.cpp (`--llama-cpp`, `$ORTSPEC_LLAMA_CPP`) the llama systems are skipped with
the reason printed. `--out DIR` gets results.json and results.md, rewritten after every round
(an interrupted run keeps the rounds it finished), and each server's log.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

from . import provenance
from ..errors import OrtspecError
from ..ort import manifest as mf
from ..paths import models_dir
from .llama_cpp import LlamaCppMissing, find_llama_cpp, ngram_flags, requantized, \
    server_command
from .server import ServerError, ServerProcess, free_port, ortspec_serve
from .serving import run_batch
from .serving_report import identical, paired_ratio, paired_text, round_ratios, summarise

VERSIONS = ("ortspec", "onnxruntime", "openai", "httpx")


@dataclasses.dataclass(frozen=True)
class System:
    name: str
    command: list[str]
    port: int
    ready_path: str  # answers 200 once the model is loaded
    model_id: str  # the "model" field the server expects


def heldout_questions(n: int) -> list:
    """`n` held-out Spec-Bench questions (workload.BenchPrompt), the categories interleaved."""
    from .workload import CATEGORIES, interleave_categories, load_questions

    per_category = max(1, -(-n // len(CATEGORIES)))
    return interleave_categories(load_questions(split="heldout", per_category=per_category))[:n]


def heldout_prompts(n: int) -> list[str]:
    """`n` held-out Spec-Bench first turns, the categories interleaved."""
    return [q.text for q in heldout_questions(n)]


def rotated(items: list, k: int) -> list:
    """`items` starting at index k mod len: batch k's system order."""
    k %= len(items)
    return items[k:] + items[:k]


def stability(batches: dict[tuple[str, int], list[dict]], systems: list[str],
              levels: list[int]) -> dict[str, dict]:
    """Per system: its outputs at every level against its own at the lowest level."""
    out = {}
    for s in systems:
        mine = {k: v for k, v in batches.items() if k[0] == s}
        r = identical(mine, [s], levels)
        out[s] = {"requests": r["requests"], "identical_to_serial": r["identical_to_serial"]}
    return out


def paired(batches: dict[tuple[str, int], list[dict]], systems: list[str],
           levels: list[int]) -> dict[str, dict[int, dict]]:
    """Per system after the first and level: `paired_ratio` of its tok/s over the first
    system's in the same round (the two batches ran one after the other, on the same prompts):
    the geometric mean over rounds and its 95% interval. A machine whose speed drifts between
    rounds moves both alike, where the ratio of the medians mixes rounds."""
    base = systems[0]
    out: dict[str, dict[int, dict]] = {}
    for s in systems[1:]:
        out[s] = {}
        for c in levels:
            ratios = round_ratios(batches[s, c], batches[base, c])
            if ratios:
                out[s][c] = paired_ratio(ratios)
    return out


def table(results: dict) -> str:
    """The markdown table of a run's `results` (as `main` writes them)."""
    levels = results["levels"]
    head = "| system | " + " | ".join(f"c={c} tok/s | c={c} TTFT p50 / p90 s" for c in levels) \
        + " | outputs equal to c=" + str(min(levels)) + " |"
    rule = "|---|" + "---|---|" * len(levels) + "---|"
    lines = [head, rule]
    for s in results["systems"]:
        cells = []
        for c in levels:
            m = results["summary"][f"{s}/{c}"]
            cells += [f"{m['tok_s_median']:.1f}", f"{m['ttft_p50_s']:.2f} / {m['ttft_p90_s']:.2f}"]
        st = results["stability"][s]
        lines.append(f"| {s} | " + " | ".join(cells)
                     + f" | {st['identical_to_serial']}/{st['requests']} |")
    base = results["systems"][0]

    def tok_s(s: str, c: int) -> float:
        return results["summary"][f"{s}/{c}"]["tok_s_median"]

    pairs = results.get("paired", {})

    def ratio(s: str, c: int) -> str:
        text = f"c={c} {tok_s(s, c) / tok_s(base, c):.2f}x"
        if str(c) in pairs.get(s, {}):  # (JSON keys are strings)
            text += f" (paired {paired_text(pairs[s][str(c)])})"
        return text

    ratios = [f"{s}: " + ", ".join(ratio(s, c) for c in levels) for s in results["systems"][1:]]
    return ("\n".join(lines) + f"\n\nAgainst {base} (ratio of the medians; paired: the geometric "
            f"mean of each round's ratio, with its 95% interval where there are rounds enough): "
            + "; ".join(ratios) + "\n")


def _systems(args, model_dir: Path) -> tuple[list[System], list[str]]:
    """The systems to run, and the reasons any were skipped."""
    levels = [int(c) for c in args.concurrency.split(",")]
    slots = str(max(levels))
    name = model_dir.name
    systems, skipped = [], []
    for label, drafter in (("ortspec plain", "none"), (f"ortspec {args.drafter}", args.drafter)):
        port = free_port()
        systems.append(System(label, ortspec_serve(
            model_dir, port, "--max-concurrent", slots, "--drafter", drafter, "--threads",
            str(args.threads), "--served-model-name", name, "--log-level", "warning"),
            port, "/health", name))
    try:
        llama = find_llama_cpp(args.llama_cpp)
    except LlamaCppMissing as e:
        skipped.append(f"llama-server: {e}")
        return systems, skipped
    gguf = Path(args.gguf) if args.gguf else gguf_of(model_dir)
    q4_0 = requantized(llama, gguf, "Q4_0", Path(args.cache))
    ngram = ngram_flags(llama)
    variants = [("llama Q4_0", q4_0, ()), ("llama Q4_1", gguf, ())]
    if ngram is None:
        skipped.append("llama Q4_0 ngram: this llama-server build has no n-gram speculation")
    else:
        variants.insert(1, ("llama Q4_0 ngram", q4_0, ngram))
    for label, path, extra in variants:
        port = free_port()
        systems.append(System(label, server_command(
            llama, path, port, threads=args.threads, parallel=int(slots),
            context_per_slot=args.context, extra=extra), port, "/health", path.stem))
    return systems, skipped


def gguf_of(model_dir: Path) -> Path:
    """The GGUF file `model_dir` was exported from, as its manifest records it: the default
    model's, extracted into the models directory's cache, or a GGUF given by path.
    OrtspecError when it is not a GGUF export or the file is gone (pass --gguf)."""
    source = mf.read_manifest(model_dir, verify_checksums=False).source
    path = str(source.get("path", ""))
    if source.get("kind") == "default":
        found = models_dir() / "cache" / str(source.get("recipe")) / Path(path.split(":")[-1]).name
    else:
        found = Path(path)
    if found.suffix != ".gguf" or not found.is_file():
        raise OrtspecError(f"{model_dir} was not exported from a GGUF file that is still at "
                           f"{found}; pass --gguf FILE")
    return found


def served_model(model: str | None) -> Path:
    """The model directory ortspec serves: `--model`, else the default model's batched export
    (`ortspec export --attention window`), which must exist: `ortspec serve` would fall back
    to the plain export, which runs one request per call, and the comparison under load would
    measure that instead (OrtspecError naming the command that makes it)."""
    if model:
        return Path(model)
    from ..paths import default_model_path

    batched = default_model_path(batched=True)
    if not (batched / "manifest.json").is_file():
        raise OrtspecError(
            f"no --model given and the default model's batched export is not there ({batched}); "
            f"make it with `ortspec export --attention window`, or pass --model DIR")
    return batched


def _log_name(system: str) -> str:
    return system.replace(" ", "-") + ".log"


def _write(out: Path, results: dict, batches: dict[tuple[str, int], list[dict]]) -> None:
    """results.json (with every batch) and results.md (the table) in `out`."""
    (out / "results.json").write_text(json.dumps({**results, "batches": {
        f"{n}/{c}": v for (n, c), v in batches.items()}}, indent=1) + "\n", encoding="utf-8")
    (out / "results.md").write_text(table(results), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp", help="llama.cpp's build (default: $ORTSPEC_LLAMA_CPP)")
    ap.add_argument("--model", help="ortspec's model directory (default: the default model's "
                                    "batched export)")
    ap.add_argument("--gguf", help="the GGUF llama-server runs (default: the default model's)")
    ap.add_argument("--cache", default="benchmarks/tmp/llama-cpp",
                    help="where the Q4_0 requantization is kept")
    ap.add_argument("--drafter", default="prompt-lookup",
                    help="ortspec's speculative system's drafter (`ortspec serve --drafter`)")
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--requests", type=int, default=8, help="requests per batch")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=2048, help="llama-server's tokens per slot")
    ap.add_argument("--prompts", type=int, default=8, help="held-out Spec-Bench questions")
    ap.add_argument("--out", help="directory for results.json and results.md (rewritten after "
                                  "every round) and the servers' logs")
    args = ap.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    model_dir = served_model(args.model)
    max_batch = mf.read_manifest(model_dir, verify_checksums=False).max_batch
    print(f"ortspec serves {model_dir} ("
          + (f"batched: up to {max_batch} requests share a call" if max_batch > 1
             else "one request per call: its graph does not batch") + ")", file=sys.stderr)
    prompts = heldout_prompts(args.prompts)
    systems, skipped = _systems(args, model_dir)
    for reason in skipped:
        print(f"skipped: {reason}", file=sys.stderr)
    servers: dict[str, ServerProcess] = {}
    batches: dict[tuple[str, int], list[dict]] = {(s.name, c): [] for s in systems for c in levels}
    started = time.time()
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="serving-llama-"))
    out.mkdir(parents=True, exist_ok=True)
    names = [s.name for s in systems]

    def record(rounds_done: int) -> dict:
        return {"levels": levels, "systems": names, "skipped": skipped,
                "rounds_done": rounds_done,
                "summary": {f"{n}/{c}": summarise(batches[n, c]) for n in names for c in levels},
                "stability": stability(batches, names, levels),
                "paired": {n: {str(c): r for c, r in by.items()}
                           for n, by in paired(batches, names, levels).items()},
                "settings": {k: v for k, v in vars(args).items()}, "model": str(model_dir),
                "model_max_batch": max_batch,
                "commands": {s.name: s.command for s in systems},
                "machine": provenance.machine(), "versions": provenance.versions(VERSIONS),
                "started": started, "seconds": time.time() - started}

    try:
        for s in systems:  # one at a time: ortspec measures its cost curve as it starts
            print(f"starting {s.name} (its log: {out / _log_name(s.name)}) ...", file=sys.stderr)
            servers[s.name] = ServerProcess(s.command, s.port, ready_path=s.ready_path,
                                            ready_s=600, stop_s=60, log=out / _log_name(s.name))
        k = 0
        for rnd in range(args.rounds):
            for c in levels:
                for s in rotated(systems, k):
                    k += 1
                    b = run_batch(servers[s.name].url, s.model_id, prompts, c, args.requests,
                                  args.max_tokens, offset=rnd * args.requests)
                    batches[s.name, c].append(b)
                    print(f"round {rnd + 1} c={c} {s.name}: {b['tokens'] / b['wall_s']:.1f} tok/s",
                          file=sys.stderr)
            if args.out:  # every round's record, so an interrupted run keeps what it measured
                _write(out, record(rnd + 1), batches)
    except ServerError as e:
        raise SystemExit(str(e)) from None
    finally:
        for server in servers.values():
            server.stop()
    results = record(args.rounds)
    print(table(results))
    if args.out:
        _write(out, results, batches)
    return 0


if __name__ == "__main__":
    sys.exit(main())
