"""ortspec's plain decoding against llama-server at realistic sizes, on random-weight Llamas.

    python -m ortspec.runtime.bench.scale --llama-cpp DIR [--shapes 360m,1b] [--prompts 12]
        [--max-tokens 64] [--rounds 2] [--threads 2] [--reps 15] [--work DIR] [--out DIR]

For each shape (`ortspec.export.tiny.RANDOM_LLAMA_SHAPES`: "360m" is SmolLM2-360M's, "1b"
Llama-3.2-1B's block at SmolLM2's vocabulary, 1.07B parameters) the benchmark, caching every
product under `--work`:

1. builds a random-weight Llama with the default model's tokenizer (`make_random_llama`);
2. converts it with the llama.cpp checkout's own `convert_hf_to_gguf.py` (f16), quantizes that
   to Q4_1 laid out like the default model's GGUF (every matrix Q4_1, the tied embedding Q8_0),
   and requantizes the Q4_1 file to Q4_0, llama.cpp's fast CPU format;
3. exports the Q4_1 file with ortspec's default precision (`ortspec export Q4_1.gguf --quant
   int4`, every other option at its default);
4. starts `ortspec serve` (drafter none) and `llama-server` on the Q4_0 file, one slot each,
   the same threads, and sends every held-out Spec-Bench question (odd ids, nothing tuned on
   them) to both, one request at a time, streaming, greedy, the systems' order rotated from
   request to request (each server's log beside the export); reported: tok/s with prefill (completion tokens over request time),
   decoding tok/s (after the first text), per category and over the short-prompt categories
   (multi-turn, translation, qa, math_reasoning), as ortspec over llama-server;
5. with the servers stopped, times ortspec's verify curve through the Decoder protocol: a step
   and verify calls of 2, 4 and 8 tokens after 256 tokens of context, rolled back after each
   (`graph.time_calls`), as c(k)/c(1).

Random weights make acceptance meaningless: this is speed only, plain decoding only. The
machine's speed drifts, so read the ratios. Without llama.cpp (`--llama-cpp`,
`$ORTSPEC_LLAMA_CPP`) nothing can be built: the benchmark says so and exits with status 2.
Needs the export extra (torch, transformers) to build and export the checkpoints.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

from . import provenance
from ..errors import InvalidOptionError, OrtspecError
from .llama_cpp import Q4_1_AS_SHIPPED, LlamaCpp, LlamaCppMissing, check_converter_modules, \
    convert_hf, converter, find_llama_cpp, \
    quantize, requantized, server_command
from .server import ServerError, ServerProcess, free_port, ortspec_serve
from .serving import run_batch
from .serving_llama import heldout_questions, rotated
from .serving_report import percentile

DEFAULT_QUANT = "int4"  # the export's default precision (export.graph_spec.DEFAULT_QUANT)
SHAPES = ("360m", "1b")  # export.tiny.RANDOM_LLAMA_SHAPES' timed ones, read without torch
SHORT_PROMPTS = ("multi-turn", "translation", "qa", "math_reasoning")
ORTSPEC, LLAMA = "ortspec int4", "llama Q4_0"
VERSIONS = ("ortspec", "onnxruntime", "torch", "transformers", "openai")


@dataclasses.dataclass(frozen=True)
class Built:
    """One shape's products."""

    hf: Path  # the random checkpoint
    q4_1: Path  # the GGUF ortspec exports
    q4_0: Path  # the GGUF llama-server runs
    export: Path  # ortspec's model directory


def check_shapes(value: str) -> list[str]:
    """The comma-separated shapes of `value`; InvalidOptionError naming the allowed ones."""
    shapes = [s.strip() for s in value.split(",") if s.strip()]
    bad = [s for s in shapes if s not in SHAPES]
    if bad or not shapes:
        raise InvalidOptionError(f"--shapes takes a comma-separated list of {', '.join(SHAPES)}; "
                                 f"got {value!r}")
    return shapes


def build(shape: str, llama: LlamaCpp, work: Path, *, reexport: bool = False,
          log=print) -> Built:
    """The random checkpoint of `shape`, its GGUF files and ortspec's export, each made once
    under `work/shape` and reused (the export made again with `reexport`; the log names the
    exporter revision of one reused). The checkpoint and the export are made by the export's
    own commands in subprocesses (the benchmark never imports the export)."""
    root = work / shape
    hf = root / "hf"
    if not (hf / "config.json").is_file():
        log(f"[{shape}] building the random checkpoint")
        _run([sys.executable, "-m", "ortspec.export.tiny", str(hf), "--shape", shape])
    log(f"[{shape}] converting to GGUF and quantizing")
    f16 = convert_hf(llama, hf, root / f"random-{shape}.f16.gguf")
    q4_1 = root / f"random-{shape}.Q4_1.gguf"
    if not (q4_1.is_file() and q4_1.stat().st_mtime >= f16.stat().st_mtime):
        quantize(llama, f16, q4_1, "Q4_1", flags=Q4_1_AS_SHIPPED)
    q4_0 = requantized(llama, q4_1, "Q4_0", root)
    export = root / f"ortspec-{DEFAULT_QUANT}"
    revision = _export_revision(export)
    if revision is not None and not reexport:
        log(f"[{shape}] reusing {export} (exporter revision {revision}; --reexport makes it "
            f"again)")
    else:
        log(f"[{shape}] exporting {q4_1.name} with ortspec's default precision ({DEFAULT_QUANT})")
        _run([sys.executable, "-m", "ortspec.runtime.cli.main", "export", str(q4_1), "--out",
              str(export), "--quant", DEFAULT_QUANT, "--overwrite", "--quiet"])
    return Built(hf, q4_1, q4_0, export)


def _export_revision(export: Path) -> int | None:
    """The exporter revision that wrote `export` (None: no export there)."""
    try:
        manifest = json.loads((export / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return manifest.get("extra", {}).get("exporter_revision")


def _run(command: list[str]) -> None:
    """`command`, its output passed through; OrtspecError naming it when it fails."""
    r = subprocess.run(command)
    if r.returncode != 0:
        raise OrtspecError(f"{' '.join(command)} failed with status {r.returncode}")


def race(built: Built, llama: LlamaCpp, questions: list, *, threads: int, max_tokens: int,
         rounds: int, context: int, log=print) -> list[dict]:
    """Every question to both servers, one request at a time, the order rotated per request:
    one record per request (system, round, prompt, category, tokens, latency_s, ttft_s)."""
    systems = [
        (ORTSPEC, lambda port: ortspec_serve(
            built.export, port, "--max-concurrent", "1", "--drafter", "none", "--threads",
            str(threads), "--served-model-name", "ortspec", "--log-level", "warning"),
         "ortspec"),
        (LLAMA, lambda port: server_command(llama, built.q4_0, port, threads=threads,
                                            parallel=1, context_per_slot=context),
         built.q4_0.stem),
    ]
    prompts = [q.text for q in questions]
    servers: dict[str, tuple[ServerProcess, str]] = {}
    records: list[dict] = []
    try:
        for name, command, model_id in systems:  # one at a time: ortspec calibrates as it starts
            port = free_port()
            log(f"starting {name} ...")
            log_file = built.export.parent / (name.replace(" ", "-") + ".log")
            servers[name] = (ServerProcess(command(port), port, ready_s=1200, stop_s=60,
                                           log=log_file), model_id)
        k = 0
        for rnd in range(rounds):
            for i, q in enumerate(questions):
                for name in rotated([s[0] for s in systems], k):
                    server, model_id = servers[name]
                    b = run_batch(server.url, model_id, prompts, 1, 1, max_tokens, indices=[i])
                    records.append({"system": name, "round": rnd, "prompt": i,
                                    "category": q.category, "tokens": b["tokens"],
                                    "latency_s": b["latency_s"][0], "ttft_s": b["ttft_s"][0]})
                k += 1
            log(f"round {rnd + 1}: " + ", ".join(
                f"{n} {speed([r for r in records if r['system'] == n])['tok_s']:.1f} tok/s"
                for n in servers))
    finally:
        for server, _ in servers.values():
            server.stop()
    return records


def speed(records: list[dict]) -> dict:
    """Requests' pooled speed: tok/s with prefill (tokens over request time), decoding tok/s
    (the tokens after the first text over the time after it), time to first text p50."""
    tokens = sum(r["tokens"] for r in records)
    wall = sum(r["latency_s"] for r in records)
    after = sum(r["latency_s"] - r["ttft_s"] for r in records)
    return {"requests": len(records), "tokens": tokens,
            "tok_s": tokens / wall if wall > 0 else float("nan"),
            "decode_tok_s": sum(max(0, r["tokens"] - 1) for r in records) / after
            if after > 0 else float("nan"),
            "ttft_p50_s": percentile([r["ttft_s"] for r in records], 50)}


def compare(records: list[dict]) -> list[dict]:
    """Per group (every category, the short-prompt ones, all): each system's speed and
    ortspec's over llama-server's."""
    cats = list(dict.fromkeys(r["category"] for r in records))
    groups = [(c, [c]) for c in cats] + [("short prompts", [c for c in cats if c in SHORT_PROMPTS]),
                                         ("all", cats)]
    rows = []
    for label, members in groups:
        mine = [r for r in records if r["category"] in members]
        if not mine:
            continue
        s = {n: speed([r for r in mine if r["system"] == n]) for n in (ORTSPEC, LLAMA)}
        rows.append({"group": label, ORTSPEC: s[ORTSPEC], LLAMA: s[LLAMA],
                     "ratio": s[ORTSPEC]["tok_s"] / s[LLAMA]["tok_s"],
                     "decode_ratio": s[ORTSPEC]["decode_tok_s"] / s[LLAMA]["decode_tok_s"]})
    return rows


def verify_curve(export: Path, *, threads: int, context: int = 256, reps: int = 15,
                 lengths: tuple[int, ...] = (1, 2, 4, 8)) -> dict:
    """ortspec's call time at each block length (1: the step) after `context` tokens, rolled
    back after each call: step_ms and c(k)/c(1)."""
    from ..ort.decoder import OrtDecoder
    from .graph import time_calls

    rows = time_calls({"ortspec": OrtDecoder(export, threads=threads)}, context=context,
                      lengths=list(lengths), reps=reps)
    ms = {r.block: r.median_ms for r in rows}
    return {"context": context, "reps": reps, "step_ms": ms[1],
            "ratio": {str(k): ms[k] / ms[1] for k in lengths}}


def markdown(results: dict) -> str:
    """The tables of a run's `results` (as `main` writes them): per shape, speed by group and
    the verify curve."""
    lines = []
    for shape, r in results["shapes"].items():
        lines += [f"### {shape} ({r['parameters'] / 1e9:.2f}B parameters)", "",
                  f"| prompts | {ORTSPEC} tok/s | {LLAMA} tok/s | ratio | decoding ratio | "
                  f"TTFT p50 s ({ORTSPEC} / {LLAMA}) |", "|---|---|---|---|---|---|"]
        for row in r["speed"]:
            a, b = row[ORTSPEC], row[LLAMA]
            lines.append(f"| {row['group']} | {a['tok_s']:.1f} | {b['tok_s']:.1f} | "
                         f"**{row['ratio']:.2f}x** | {row['decode_ratio']:.2f}x | "
                         f"{a['ttft_p50_s']:.2f} / {b['ttft_p50_s']:.2f} |")
        c = r.get("verify_curve")
        if c:
            ks = list(c["ratio"])
            lines += ["", f"ortspec's step: {c['step_ms']:.1f} ms after {c['context']} tokens; "
                          "verify curve:", "", "| " + " | ".join(f"c({k})/c(1)" for k in ks)
                      + " |", "|" + "---|" * len(ks),
                      "| " + " | ".join(f"{c['ratio'][k]:.2f}" for k in ks) + " |"]
        lines.append("")
    return "\n".join(lines)


def _parameters(hf: Path) -> int:
    """The checkpoint's parameter count from its config (tied embedding counted once)."""
    c = json.loads((hf / "config.json").read_text(encoding="utf-8"))
    h, i, n, v = (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"],
                  c["vocab_size"])
    head = c.get("head_dim") or h // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * head
    per_layer = 2 * h * c["num_attention_heads"] * head + 2 * h * kv + 3 * h * i + 2 * h
    return v * h * (1 if c.get("tie_word_embeddings", True) else 2) + n * per_layer + h


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp", help="llama.cpp's checkout with its build "
                                        "(default: $ORTSPEC_LLAMA_CPP)")
    ap.add_argument("--shapes", default="360m,1b", help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--prompts", type=int, default=12, help="held-out Spec-Bench questions")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=2048, help="llama-server's tokens")
    ap.add_argument("--reps", type=int, default=15, help="repetitions of the verify curve")
    ap.add_argument("--reexport", action="store_true",
                    help="export the GGUF again even where --work holds an export (after a "
                         "change to the exporter)")
    ap.add_argument("--work", default="benchmarks/tmp/scale-work",
                    help="where checkpoints, GGUF files and exports are made and kept")
    ap.add_argument("--out", help="directory for results.json and results.md")
    args = ap.parse_args(argv)
    try:
        shapes = check_shapes(args.shapes)
        llama = find_llama_cpp(args.llama_cpp)
        converter(llama)
        check_converter_modules()
    except (InvalidOptionError, LlamaCppMissing) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    questions = heldout_questions(args.prompts)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    started = time.time()
    results: dict = {"shapes": {}, "settings": vars(args), "prompts": len(questions),
                     "machine": provenance.machine(), "versions": provenance.versions(VERSIONS),
                     "started": started}
    for shape in shapes:
        try:
            built = build(shape, llama, Path(args.work), reexport=args.reexport, log=log)
            records = race(built, llama, questions, threads=args.threads,
                           max_tokens=args.max_tokens, rounds=args.rounds,
                           context=args.context, log=log)
        except ServerError as e:
            raise SystemExit(str(e)) from None
        log(f"[{shape}] timing the verify curve")
        curve = verify_curve(built.export, threads=args.threads, reps=args.reps)
        results["shapes"][shape] = {
            "parameters": _parameters(built.hf), "speed": compare(records),
            "verify_curve": curve, "records": records,
            "files": {k: str(v) for k, v in dataclasses.asdict(built).items()}}
        results["seconds"] = time.time() - started
        if args.out:  # after every shape, so an interrupted run keeps the shapes it finished
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "results.json").write_text(json.dumps(results, indent=1) + "\n",
                                              encoding="utf-8")
            (out / "results.md").write_text(markdown(results), encoding="utf-8")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
