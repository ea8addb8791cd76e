"""`ortspec bench`: plain vs speculative decoding on Spec-Bench, side by side, with anchors.

    ortspec bench                                   # dev split, 2 prompts per category, greedy
    ortspec bench --per-category 0 --temperature 0 --out benchmarks/tmp/dev-t0   # the full dev split
    ortspec bench --methods plain,prompt-lookup,prompt-lookup:k2,prompt-lookup:k4,prompt-lookup:k8
    ortspec bench --anchors genai,hf                # + onnxruntime-genai and HF transformers

Writes `results.md` (tables), `results.json` (every decode, the machine, the command) and, with
the bench extra (matplotlib), `speedup.png` / `acceptance.png` into `--out` (default
./benchmarks/tmp/latest), and while it runs `partial.jsonl`, each finished prompt's records, from
which `--resume` goes on after a stop. The anchors run in their own environment (a source
checkout's `scripts/setup_anchors.sh` makes it); when it is missing they are reported as
unavailable.
"""

from __future__ import annotations

import argparse
import datetime as dt
import shlex
import sys
from pathlib import Path
from typing import Any

from ortspec.runtime.cli.args import UserErrorParser, add_model_options, model_arg, providers_arg
from ortspec.runtime.decoding.options import SpeculativeOptions
from ortspec.runtime.errors import InvalidOptionError, OrtspecError
from ortspec.runtime.cli.progress import progress_bar
from ortspec.runtime.validation import check_int

from . import provenance, report
from .checkpoint import Checkpoint
from .runner import SPECULATIVE, BenchConfig, Method, method_drafter, run_pairs
from .workload import CATEGORIES, SPLITS, BenchPrompt, interleave_categories, load_questions

ANCHORS = ("genai", "genai-int4", "hf")


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = UserErrorParser(prog="ortspec bench", description=__doc__,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(ap)  # --model, --providers, --threads
    ap.add_argument("--draft", help="draft model directory for the draft-model methods")
    ap.add_argument("--questions", help="a Spec-Bench question.jsonl (default: the one packaged with ortspec)")
    ap.add_argument("--split", default="dev", choices=SPLITS,
                    help="Spec-Bench's even ids (dev, the default: tune here), odd ids (heldout) "
                         "or all")
    ap.add_argument("--per-category", type=int, default=2, help="prompts per category; 0 = all")
    ap.add_argument("--categories", help=f"comma-separated subset of {','.join(CATEGORIES)}, or of "
                                         "Spec-Bench's own categories (writing, coding, ...)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=1, help="A B then B A ... per prompt")
    ap.add_argument("--methods", default="plain,prompt-lookup",
                    help="comma-separated: plain first, then any of " + ", ".join(SPECULATIVE)
                         + ", each optionally with :kN for a fixed draft length (e.g. prompt-lookup:k4)")
    ap.add_argument("--ngram-size", type=int, default=3)
    ap.add_argument("--max-draft-len", type=int, default=8)
    ap.add_argument("--anchors", default="", help=f"comma-separated subset of {','.join(ANCHORS)}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/tmp/latest",
                    help="output directory (default benchmarks/tmp/latest, under the current one)")
    ap.add_argument("--resume", action="store_true",
                    help="go on with the run whose partial.jsonl is in --out (the same options): "
                         "measure only the prompts it lacks")
    ap.add_argument("--reaggregate", metavar="DIR", default=None,
                    help="rewrite DIR's results.md/json and plots from its results.json with this "
                         "version's aggregation (no decoding)")
    args = ap.parse_args(argv)
    check_int("--per-category", args.per_category, minimum=0)
    check_int("--max-new-tokens", args.max_new_tokens, minimum=1)
    check_int("--repeats", args.repeats, minimum=1)
    if not (args.temperature >= 0):
        raise InvalidOptionError(f"--temperature must be >= 0, got {args.temperature}")
    for a in filter(None, args.anchors.split(",")):
        if a not in ANCHORS:
            raise InvalidOptionError(f"unknown anchor {a!r}; choose from {ANCHORS}")
    return args


def _anchor_speedups(names: list[str], prompts: list[BenchPrompt], model, config: BenchConfig,
                     threads: int | None) -> tuple[dict[str, dict[str, float]], dict[str, Any]]:
    """Per-category n-gram speedup of each anchor over its own plain decoding."""
    from . import anchors as A

    chat = model.manifest.chat_format
    rendered = [{"id": f"q{p.question_id}", "category": p.category,
                 "prompt": chat.render([{"role": "user", "content": p.text}]) if chat else p.text}
                for p in prompts]
    out: dict[str, dict[str, float]] = {}
    raw: dict[str, Any] = {}
    for name in names:
        print(f"anchor {name}: {len(rendered)} prompts ...", file=sys.stderr, flush=True)
        common = dict(max_new_tokens=config.max_new_tokens, repeats=config.repeats, threads=threads,
                      temperature=config.temperature, seed=config.seed)
        if name == "hf":
            runs = A.run_hf_anchor(rendered, **common)
        else:
            runs = A.run_genai_anchor(rendered, precision="int4" if name == "genai-int4" else "fp32", **common)
        if not runs:
            print(f"  {runs}", file=sys.stderr)
            raw[name] = str(runs)
            continue
        raw[name] = runs
        label = {"genai": "genai n-gram", "genai-int4": "genai-int4 n-gram", "hf": "HF prompt lookup"}[name]
        out[label] = _ratio_by_category(runs)
    return out, raw


def _ratio_by_category(runs: list[dict[str, Any]]) -> dict[str, float]:
    sums: dict[tuple[str, str], list[float]] = {}
    for r in runs:
        for cat in (r.get("category", "unknown"), "overall"):
            s = sums.setdefault((cat, r["mode"]), [0.0, 0.0])
            s[0] += r["new_tokens"]
            s[1] += r["wall_s"]
    out = {}
    for (cat, mode), (tok, sec) in sums.items():
        if mode == "ngram" and (cat, "plain") in sums:
            ptok, psec = sums[(cat, "plain")]
            if sec > 0 and psec > 0 and ptok > 0:
                out[cat] = (tok / sec) / (ptok / psec)
    return out


def main(argv: list[str] | None = None) -> int:
    from ortspec.runtime.load import load_model

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = _parse(argv)
        if args.reaggregate:
            return reaggregate(args.reaggregate)
        methods = [Method.parse(s) for s in args.methods.split(",") if s.strip()]
        if not methods or methods[0].name != "plain":
            methods = [Method.parse("plain")] + [m for m in methods if m.name != "plain"]
        cats = tuple(args.categories.split(",")) if args.categories else None
        prompts = interleave_categories(load_questions(
            args.questions, split=args.split, per_category=args.per_category or None, categories=cats))
        needs_draft = any("draft-model" in m.drafter for m in methods)
        model_dir = model_arg(args.model)
        config = BenchConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                             repeats=args.repeats, ngram_size=args.ngram_size,
                             max_draft_len=args.max_draft_len, seed=args.seed)
        out = Path(args.out)
        checkpoint = Checkpoint(out, {
            **vars(config), "model": str(model_dir.resolve()), "draft": args.draft,
            "providers": args.providers, "threads": args.threads, "questions": args.questions,
            "split": args.split, "per_category": args.per_category, "categories": args.categories,
            "methods": [m.name for m in methods], "anchors": args.anchors})
        if args.resume:
            checkpoint.resume()
        # no prefix cache: each method reads the prompt itself, so methods compare alike
        model = load_model(model_dir, providers=providers_arg(args.providers),
                           threads=args.threads, draft=(args.draft or True) if needs_draft else None,
                           prefix_cache_mib=0)
        for m in methods:  # every method's drafter and options, before anything runs
            spec = method_drafter(m, ngram_size=args.ngram_size, max_draft_len=args.max_draft_len)
            try:
                model.check_drafter_spec(spec)
            except InvalidOptionError as e:
                raise InvalidOptionError(f"method {m.name!r}: {e}") from None
        checkpoint.begin()  # every option checked: the output directory is written from here on
    except OrtspecError as e:
        print(f"ortspec bench: error: {e}", file=sys.stderr)
        return 2
    done = checkpoint.done
    print(f"{len(prompts)} prompts ({args.split} split), methods {[m.name for m in methods]}, "
          f"temperature {args.temperature}, {args.max_new_tokens} new tokens"
          + (f"; {len(done)} measured before, resumed from {checkpoint.path}" if done else ""),
          file=sys.stderr)
    if any(m.drafter != "none" and m.fixed_k is None for m in methods):
        model.prepare()  # the cost model: read from the calibration cache or measured, now
    # warm up: thread pools, allocator
    model.generate("Hello", chat=True, drafter=None, options=SpeculativeOptions(8))
    try:
        from tqdm import tqdm
    except ImportError:  # lines instead of a bar
        tqdm = None
    bar = progress_bar(len(prompts), "bench", "prompt", bar_factory=tqdm)
    run_pairs(model, prompts, methods, config, progress=bar.update, done=done, on_prompt=checkpoint.add)
    records, skipped = checkpoint.records, checkpoint.skipped
    bar.close()
    names = [m.name for m in methods]
    anchor_names = [a for a in args.anchors.split(",") if a]
    anchors, anchor_raw = _anchor_speedups(anchor_names, prompts, model, config, args.threads) if anchor_names else ({}, {})
    command = "ortspec bench " + " ".join(shlex.quote(a) for a in argv)
    title = f"{model_dir.name}, {args.split} split, T={args.temperature}, {len(prompts)} prompts"
    meta = {"command": command, "date": dt.datetime.now().isoformat(timespec="seconds"),
            "machine": provenance.machine(), "model": str(model_dir),
            "manifest_source": model.manifest.source, "config": vars(config), "methods": names,
            "skipped": skipped, "anchors": anchors,
            "anchor_records": anchor_raw, "title": title,
            "providers": list(model.providers)}
    write_outputs(out, meta, records)
    checkpoint.finish()
    return 0


def write_outputs(out: Path, meta: dict[str, Any], records: list[dict[str, Any]]) -> None:
    """results.md, results.json and the plots in `out`, aggregated from `records`."""
    names = meta["methods"]
    anchors = meta.get("anchors") or {}
    aggs = report.aggregate(records, methods=names)
    table = report.markdown_tables(aggs, anchors=anchors)
    machine = meta.get("machine") or {}
    title = meta.get("title") or Path(meta.get("model", "model")).name
    anchor_raw = meta.get("anchor_records") or {}
    md = [f"# ortspec bench: {title}\n\n", f"Command: `{meta['command']}`\n\n",
          f"Machine: {machine.get('cpu')}, {machine.get('cpu_count')} CPUs, "
          f"providers {meta.get('providers', ['CPUExecutionProvider'])}. "
          f"Date: {str(meta.get('date', ''))[:10]}.\n\n",
          f"Skipped (prompt + new tokens over the capacity): {len(meta.get('skipped') or [])}.\n",
          "\n## Speed and acceptance\n\n", table,
          "\n## Acceptance by draft position (accepted / drafted at that position)\n\n",
          report.acceptance_table(aggs)]
    if meta.get("reaggregated"):
        md.insert(2, f"Tables re-aggregated from results.json on {meta['reaggregated']}"
                     f" (`ortspec bench --reaggregate`).\n\n")
    if anchor_raw:
        md.append("\n## Anchors\n\n")
        for name, raw in anchor_raw.items():
            md.append(f"- {name}: {raw if isinstance(raw, str) else f'{len(raw)} decodes'}\n")
    tmp = out / "results.md.tmp"
    tmp.write_text("".join(md), encoding="utf-8")
    tmp.replace(out / "results.md")
    report.write_json(out / "results.json", {**meta, "aggregates": aggs, "records": records})
    plots = report.plot(aggs, out, anchors=anchors, title=title)
    print(table)
    print(f"wrote {out / 'results.md'}, {out / 'results.json'}" + "".join(f", {p}" for p in plots)
          + ("" if plots else " (no plots: pip install 'ortspec[bench]' for matplotlib)"),
          file=sys.stderr)


def reaggregate(directory: str) -> int:
    """Rewrite a finished run's tables from its results.json with this version's aggregation."""
    import json

    out = Path(directory)
    try:
        data = json.loads((out / "results.json").read_text(encoding="utf-8"))
        records = data.pop("records")
        data.pop("aggregates", None)
        missing = [k for k in ("methods", "command") if k not in data]
        if missing:
            raise KeyError(", ".join(missing))
    except (OSError, ValueError, KeyError) as e:
        print(f"ortspec bench: error: --reaggregate needs a directory with a results.json written by "
              f"ortspec bench ({out}: {e})", file=sys.stderr)
        return 2
    if "title" not in data:
        config = data.get("config") or {}
        ids = {r["question_id"] for r in records}
        split = "dev" if all(i % 2 == 0 for i in ids) else "heldout" if all(i % 2 for i in ids) else "all"
        data["title"] = (f"{Path(data.get('model', 'model')).name}, {split} split, "
                         f"T={config.get('temperature', 0.0)}, {len(ids)} prompts")
    data["reaggregated"] = dt.date.today().isoformat()
    write_outputs(out, data, records)
    return 0
