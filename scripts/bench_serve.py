"""Benchmark `ortspec serve` through the official openai client: throughput and latency by
concurrency, speculative and plain, whether every output is the one its serial run gave, how
many requests the server's batched calls carried, and the server's overhead per token against
in-process `Model.generate`.

    python scripts/bench_serve.py [--model DIR] [--drafters prompt-lookup,none] \
        [--concurrency 1,2,4,8,16] [--requests 16] [--rounds 3] [--max-tokens 64] \
        [--overhead-requests 16] [--out DIR]
    python scripts/bench_serve.py --url http://127.0.0.1:8000 ...   # a server already running

Without --url the script starts one `ortspec serve` per drafter on free local ports
(--max-concurrent = the highest concurrency), all at once, and stops them at the end. Every
request is a chat request, streamed, temperature 0, usage included, from the prompt set
(--prompts: 8 short chat prompts, or the Spec-Bench dev split's first turns) in turn. A model
exported with `--attention window` batches the concurrent requests in shared calls.

This machine's speed drifts (other work shares its cores), so configurations are interleaved:
each round runs every (drafter, concurrency) pair once, in an order shuffled per round, and a
configuration's figures pool its rounds: time to first token and latency percentiles (p50,
p90, p99) over all its requests; aggregate throughput (completion tokens over the wall time
of the batch of requests) as the median of its rounds, with their range.

Identical outputs. Every request's completion text is kept. For each (drafter, prompt), the
reference is the text the serial configuration (concurrency 1, or the lowest one measured) of
that drafter gave first; each configuration reports how many of its requests gave exactly that
text ("identical to serial", k/n), and how many gave the text plain decoding's serial run gave
(temperature 0: speculative and plain must agree). Any difference makes the exit status 1,
after the results are written (the differing texts are in results.json).

Batch rows. `ortspec:batch_rows` (the histogram of requests per batched model call) is scraped
from each server's /metrics before and after every batch (the difference: that
configuration's calls) and once at the end (everything the server did, warm-up included).

Overhead (measured first, after the same warm-up for server and in-process model; skipped with
--overhead-requests 0): at concurrency 1, for each drafter, the same requests through the
server (streamed, and not) and through `Model.generate` in this process, interleaved request
by request with the order alternating; the overhead is the median over requests of served /
in-process seconds per token, minus one (per request: both decode the same prompt to the same
tokens at temperature 0).

--out DIR gets results.json (every batch, request and text), results.md (the tables and the
checks: throughput at c=8 over c=1 per drafter, speculative over plain at c=4, outputs
identical to serial) and throughput.png (aggregate tok/s by concurrency, a line per drafter).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

CHAT_PROMPTS = [
    "Summarise in two sentences: the water cycle moves water between oceans, air and land.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Translate to French: The weather is nice today and we will go for a walk.",
    "List five uses of a paperclip.",
    "Explain what a hash table is to a beginner.",
    "Rewrite more formally: hey, can u send me the report by tmrw?",
    "What are the main causes of the seasons on Earth?",
    "Give three tips for writing clear emails.",
]


def load_prompts(kind: str, *, per_category: int) -> list[str]:
    """The user messages a run sends, in the order requests take them."""
    if kind == "chat":
        return list(CHAT_PROMPTS)
    from ortspec.bench.workload import interleave_categories, load_questions

    return [q.text for q in interleave_categories(load_questions(split="dev",
                                                                 per_category=per_category))]


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def _client(url: str):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)


def _one_request(client, name: str, prompt: str, max_tokens: int, *, stream: bool = True
                 ) -> tuple[float, float, int, str]:
    """(end-to-end seconds, seconds to the first text, completion tokens, completion text)."""
    messages = [{"role": "user", "content": prompt}]
    t0 = time.perf_counter()
    if not stream:
        r = client.chat.completions.create(model=name, messages=messages, max_tokens=max_tokens,
                                           temperature=0)
        total = time.perf_counter() - t0
        return total, total, r.usage.completion_tokens, r.choices[0].message.content or ""
    first = None
    tokens = 0
    parts: list[str] = []
    for chunk in client.chat.completions.create(
            model=name, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - t0
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    total = time.perf_counter() - t0
    return total, first if first is not None else total, tokens, "".join(parts)


def run_batch(url: str, name: str, prompts: list[str], concurrency: int, n_requests: int,
              max_tokens: int, offset: int = 0) -> dict:
    """`n_requests` requests from `concurrency` client threads: wall time, and per request its
    latency, time to first text, prompt (index into `prompts`) and completion text."""
    jobs = [(offset + i) % len(prompts) for i in range(n_requests)]
    results: list[tuple[int, tuple[float, float, int, str]]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker(k: int) -> None:
        client = _client(url)
        for i in range(k, len(jobs), concurrency):
            try:
                r = _one_request(client, name, prompts[jobs[i]], max_tokens)
            except BaseException as e:  # noqa: BLE001 - reported by the caller
                errors.append(e)
                return
            with lock:
                results.append((jobs[i], r))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise SystemExit(f"a request failed at concurrency {concurrency}: {errors[0]!r}")
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "latency_s": [r[0] for _, r in results],
            "ttft_s": [r[1] for _, r in results], "tokens": sum(r[2] for _, r in results),
            "outputs": [{"prompt": p, "tokens": r[2], "text": r[3]} for p, r in results]}


def summarise(batches: list[dict]) -> dict:
    latency = [x for b in batches for x in b["latency_s"]]
    ttft = [x for b in batches for x in b["ttft_s"]]
    tok_s = [b["tokens"] / b["wall_s"] for b in batches]
    out = {"requests": len(latency), "tokens": sum(b["tokens"] for b in batches),
           "tok_s_median": statistics.median(tok_s), "tok_s_min": min(tok_s),
           "tok_s_max": max(tok_s)}
    for q in (50, 90, 99):
        out[f"latency_p{q}_s"] = _percentile(latency, q)
    for q in (50, 90, 99):
        out[f"ttft_p{q}_s"] = _percentile(ttft, q)
    return out


def identical(batches: dict[tuple[str, int], list[dict]], drafters: list[str],
              levels: list[int]) -> dict:
    """Every request's text against its drafter's serial text for the prompt, and against plain
    decoding's (the drafter "none" if measured, else the first one). The serial configuration
    is concurrency 1, or the lowest measured; its reference is its first round's text."""
    serial = min(levels)
    base = "none" if "none" in drafters else drafters[0]
    refs: dict[str, dict[int, str]] = {d: {} for d in drafters}
    for d in drafters:
        for b in batches[d, serial]:
            for o in b["outputs"]:
                refs[d].setdefault(o["prompt"], o["text"])
    per_config, differing = {}, []
    for (d, c), bs in batches.items():
        same = same_base = n = 0
        for rnd, b in enumerate(bs):
            for o in b["outputs"]:
                n += 1
                ref, ref_base = refs[d].get(o["prompt"]), refs[base].get(o["prompt"])
                same += o["text"] == ref
                same_base += o["text"] == ref_base
                if o["text"] != ref or o["text"] != ref_base:
                    differing.append({"drafter": d, "concurrency": c, "round": rnd,
                                      "prompt": o["prompt"], "text": o["text"],
                                      "serial_text": ref, "plain_serial_text": ref_base,
                                      "first_difference": _first_difference(
                                          o["text"], ref if o["text"] != ref else ref_base)})
        per_config[f"{d}/{c}"] = {"drafter": d, "concurrency": c, "requests": n,
                                  "identical_to_serial": same,
                                  "identical_to_plain_serial": same_base}
    serial_vs_plain = {d: {"prompts": len(refs[d]),
                           "identical": sum(refs[d][p] == refs[base].get(p) for p in refs[d])}
                       for d in drafters if d != base}
    n = sum(v["requests"] for v in per_config.values())
    return {"serial_concurrency": serial, "plain": base, "per_config": per_config,
            "requests": n,
            "identical_to_serial": sum(v["identical_to_serial"] for v in per_config.values()),
            "identical_to_plain_serial": sum(v["identical_to_plain_serial"]
                                             for v in per_config.values()),
            "serial_vs_plain": serial_vs_plain, "all_identical": not differing,
            "differing": differing}


def _first_difference(a: str, b: str | None) -> int | None:
    """The first character where a and b differ (None when equal or b is missing)."""
    if b is None or a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def scrape_batch_rows(url: str) -> dict | None:
    """`ortspec:batch_rows` from the server's /metrics: its buckets (cumulative, as Prometheus
    has them, by upper bound), count and sum; None if the server does not batch."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        if family.name != "ortspec:batch_rows":
            continue
        out: dict = {"buckets": {}, "count": 0, "sum": 0.0}
        for s in family.samples:
            if s.name.endswith("_bucket"):
                out["buckets"][s.labels["le"]] = int(s.value)
            elif s.name.endswith("_count"):
                out["count"] = int(s.value)
            elif s.name.endswith("_sum"):
                out["sum"] = float(s.value)
        return out
    return None


def rows_delta(before: dict | None, after: dict | None) -> dict | None:
    """The calls between two scrapes of `ortspec:batch_rows`."""
    if before is None or after is None:
        return None
    return {"buckets": {k: v - before["buckets"].get(k, 0) for k, v in after["buckets"].items()},
            "count": after["count"] - before["count"], "sum": after["sum"] - before["sum"]}


def rows_summary(h: dict | None) -> dict | None:
    """Calls, mean rows per call, and calls per bucket (rows in (previous bound, bound])."""
    if h is None:
        return None

    def bound(k: str) -> float:
        return float("inf") if k == "+Inf" else float(k)

    per_bucket, previous, lo = {}, 0, 0.0
    for k in sorted(h["buckets"], key=bound):
        hi = bound(k)
        label = "+Inf" if hi == float("inf") else (f"{hi:g}" if hi - lo <= 1
                                                   else f"{lo + 1:g}-{hi:g}")
        per_bucket[label] = h["buckets"][k] - previous
        previous, lo = h["buckets"][k], hi
    return {"calls": h["count"], "mean_rows": h["sum"] / h["count"] if h["count"] else None,
            "calls_by_rows": per_bucket, "cumulative_buckets": h["buckets"]}


def overhead(url: str, name: str, prompts: list[str], model, drafter: str, n_requests: int,
             max_tokens: int) -> dict:
    """Seconds per token served (streamed and not) against in-process, interleaved per request."""
    from ortspec.runtime import SpeculativeOptions

    client = _client(url)
    local_drafter = None if drafter == "none" else drafter
    rows = []
    for i in range(n_requests):
        prompt = prompts[i % len(prompts)]
        row: dict[str, float] = {}

        def local() -> None:
            t0 = time.perf_counter()
            r = model.generate(prompt, chat=True, drafter=local_drafter,
                               options=SpeculativeOptions(max_tokens))
            row["local"] = (time.perf_counter() - t0) / max(r.num_tokens, 1)
            row["tokens"] = r.num_tokens

        def streamed() -> None:
            total, _, tokens, _ = _one_request(client, name, prompt, max_tokens)
            row["stream"] = total / max(tokens, 1)
            row["stream_tokens"] = tokens

        def whole() -> None:
            total, _, tokens, _ = _one_request(client, name, prompt, max_tokens, stream=False)
            row["whole"] = total / max(tokens, 1)

        order = [local, streamed, whole]
        for f in (order if i % 2 == 0 else order[::-1]):
            f()
        if row["stream_tokens"] != row["tokens"]:
            raise SystemExit(f"server and in-process decoded different lengths: {row}")
        rows.append(row)

    def ratio(key: str) -> float:
        return statistics.median(r[key] / r["local"] for r in rows) - 1

    def interval(key: str) -> tuple[float, float]:
        """95% bootstrap interval of the median ratio (over requests, resampled)."""
        rng = random.Random(0)
        ratios = [r[key] / r["local"] for r in rows]
        meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) - 1
                      for _ in range(2000))
        return meds[50], meds[1949]

    ms = {k: statistics.median(r[k] for r in rows) * 1e3 for k in ("local", "stream", "whole")}
    return {"drafter": drafter, "requests": len(rows), "local_ms_per_token": ms["local"],
            "stream_ms_per_token": ms["stream"], "whole_ms_per_token": ms["whole"],
            "stream_overhead": ratio("stream"), "whole_overhead": ratio("whole"),
            "stream_overhead_95": interval("stream"), "whole_overhead_95": interval("whole"),
            "stream_overhead_ms_per_token": statistics.median(r["stream"] - r["local"] for r in rows) * 1e3,
            "pairs": rows}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(model_dir: Path, max_concurrent: int, drafter: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ortspec.runtime.cli", "serve", "--model",
                             str(model_dir), "--port", str(port), "--max-concurrent",
                             str(max_concurrent), "--drafter", drafter, "--log-level", "warning"])
    return proc, f"http://127.0.0.1:{port}"


def _wait_ready(proc: subprocess.Popen, url: str) -> None:
    import httpx

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with status {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.3)
    raise SystemExit("the server did not answer /health in 300 s")


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("ortspec", "onnxruntime", "tokenizers", "numpy", "fastapi", "starlette",
                "uvicorn", "httptools", "uvloop", "openai", "httpx"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def _checkout() -> dict:
    """The commit of the checkout the servers run, and the tracked files changed since (outside
    benchmarks/, results that do not change what runs)."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                                  timeout=30, check=True).stdout
        except (OSError, subprocess.SubprocessError):
            return None

    status = git("status", "--porcelain", "--untracked-files=no")
    commit = git("rev-parse", "HEAD")
    return {"commit": commit and commit.strip(),
            "changed": None if status is None else [
                ln[3:] for ln in status.splitlines() if not ln[3:].startswith("benchmarks/")]}


def _machine() -> dict:
    from ortspec.runtime.machine import cpu_model

    return {"cpu": cpu_model(), "logical_cpus": os.cpu_count(), "platform": platform.platform()}


GENERATED = "<!-- written by scripts/bench_serve.py -->"


def checks(res: dict) -> dict:
    """From the measured data: throughput at c=8 over c=1 per drafter, speculative over plain
    at c=4 (median of rounds, and the range of the same ratio round by round), and whether every
    output was identical to its serial run."""
    by = {(r["drafter"], r["concurrency"]): r for r in res["levels"]}
    drafters = res["config"]["drafters"]
    plain = "none" if "none" in drafters else None

    def ratio(a: dict, b: dict) -> dict:
        per_round = [(x["tokens"] / x["wall_s"]) / (y["tokens"] / y["wall_s"])
                     for x, y in zip(a["rounds"], b["rounds"])]
        return {"ratio": a["tok_s_median"] / b["tok_s_median"],
                "per_round_min": min(per_round), "per_round_max": max(per_round)}

    out: dict = {"scaling_c8_over_c1": {}, "target_scaling": 3.0}
    for d in drafters:
        if (d, 8) in by and (d, 1) in by:
            out["scaling_c8_over_c1"][d] = ratio(by[d, 8], by[d, 1])
    out["spec_over_plain_c4"] = {d: ratio(by[d, 4], by[plain, 4]) for d in drafters
                                 if plain and d != plain and (d, 4) in by and (plain, 4) in by}
    ident = res.get("identical")
    if ident:
        out["identical_to_serial"] = [ident["identical_to_serial"], ident["requests"]]
        out["identical_to_plain_serial"] = [ident["identical_to_plain_serial"], ident["requests"]]
    return out


def _rows_cell(s: dict | None) -> str:
    return "-" if not s or s["mean_rows"] is None else f"{s['mean_rows']:.2f} ({s['calls']})"


def markdown(res: dict) -> str:
    cfg = res["config"]
    ident = res.get("identical") or {}
    per_config = ident.get("per_config", {})
    serial = ident.get("serial_concurrency", 1)
    load = ", ".join(f"{x:.1f}" for x in res["load_average_before"])
    load_after = ", ".join(f"{x:.1f}" for x in res["load_average_after"])
    lines = [GENERATED, "",
             (f"model {cfg['model']}, max_tokens {cfg['max_tokens']}, temperature 0, chat "
              f"requests; servers with --max-concurrent {cfg['server_max_concurrent']}; "
              f"{res['machine']['logical_cpus']} logical CPUs, load average {load} before, "
              f"{load_after} after; {res['duration_s'] / 60:.1f} min"
              + (f"; checkout {res['checkout']['commit'][:10]}"
                 + (f" (changed: {', '.join(res['checkout']['changed'])})"
                    if res["checkout"].get("changed") else "")
                 if (res.get("checkout") or {}).get("commit") else "")), ""]
    if res["levels"]:
        lines += [(f"{cfg['requests']} streamed requests per configuration per round, "
                   f"{cfg['rounds']} rounds (configurations interleaved, order shuffled per "
                   f"round). tok/s: completion tokens / wall time of the batch, median of rounds "
                   f"(range). Mean rows/call: `ortspec:batch_rows` over this configuration's "
                   f"batched calls (calls in brackets). Identical to serial: requests whose text "
                   f"is the one the concurrency-{serial} run of the same drafter gave for that "
                   f"prompt; to plain serial: the one plain decoding's concurrency-{serial} run "
                   f"gave."), "",
                  ("| drafter | concurrency | requests | tok/s (range) | p50 TTFT s | p99 TTFT s "
                   "| p50 latency s | p90 latency s | p99 latency s | mean rows/call (calls) "
                   "| identical to serial | identical to plain serial |"),
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["levels"]:
        i = per_config.get(f"{r['drafter']}/{r['concurrency']}")
        same = f"{i['identical_to_serial']}/{i['requests']}" if i else "-"
        same_base = f"{i['identical_to_plain_serial']}/{i['requests']}" if i else "-"
        lines.append(f"| {r['drafter']} | {r['concurrency']} | {r['requests']} | "
                     f"{r['tok_s_median']:.1f} ({r['tok_s_min']:.1f}-{r['tok_s_max']:.1f}) | "
                     f"{r['ttft_p50_s']:.3f} | {r['ttft_p99_s']:.3f} | "
                     f"{r['latency_p50_s']:.2f} | {r['latency_p90_s']:.2f} | "
                     f"{r['latency_p99_s']:.2f} | {_rows_cell(r.get('batch_rows'))} | "
                     f"{same} | {same_base} |")
    if ident:
        verdict = "all identical" if ident["all_identical"] else \
            f"{len(ident['differing'])} requests differ (see results.json, identical.differing)"
        lines += ["", f"Outputs identical to serial: {ident['identical_to_serial']}/"
                  f"{ident['requests']} requests; identical to plain decoding's serial output: "
                  f"{ident['identical_to_plain_serial']}/{ident['requests']}; "
                  + "; ".join(f"{d}'s serial outputs vs plain's: {v['identical']}/{v['prompts']} "
                              f"prompts" for d, v in ident["serial_vs_plain"].items())
                  + f" — {verdict}."]
    drafters = sorted({r["drafter"] for r in res["levels"]})
    if "none" in drafters and len(drafters) > 1:
        plain = {r["concurrency"]: r["tok_s_median"] for r in res["levels"] if r["drafter"] == "none"}
        lines += ["", "| drafter | concurrency | throughput vs plain |", "|---|---:|---:|"]
        for r in res["levels"]:
            if r["drafter"] != "none" and r["concurrency"] in plain:
                lines.append(f"| {r['drafter']} | {r['concurrency']} | "
                             f"{r['tok_s_median'] / plain[r['concurrency']]:.2f}x |")
    if res.get("batch_rows"):
        def upper(k: str) -> float:
            return float("inf") if k == "+Inf" else float(k.split("-")[-1])

        # the buckets up to the one holding --max-concurrent, and any higher with calls in them
        bounds = sorted({k for s in res["batch_rows"].values() if s
                         for k, n in s["calls_by_rows"].items()
                         if n or upper(k) / 2 < cfg["server_max_concurrent"]}, key=upper)
        lines += ["", ("`ortspec:batch_rows` scraped from each server's /metrics at the end "
                       "(every batched decode call since it started, warm-up included): calls by "
                       "rows per call"), "",
                  "| drafter | calls | mean rows/call | " + " | ".join(
                      f"{b} row{'' if b == '1' else 's'}" for b in bounds) + " |",
                  "|---|---:|---:|" + "---:|" * len(bounds)]
        for d, s in res["batch_rows"].items():
            if s is None:
                lines.append(f"| {d} | (no batch_rows: the model does not batch) |")
                continue
            mean = "-" if s["mean_rows"] is None else f"{s['mean_rows']:.2f}"
            lines.append(f"| {d} | {s['calls']} | {mean} | " + " | ".join(
                str(s["calls_by_rows"].get(b, 0)) for b in bounds) + " |")
    ch = res.get("checks") or {}
    if ch:
        lines += ["", ("Checks (from the data above; throughput as median of rounds, the range "
                       "is the same ratio round by round):"), ""]
        for d, v in ch["scaling_c8_over_c1"].items():
            ok = "meets" if v["ratio"] >= ch["target_scaling"] else "misses"
            lines.append(f"- {d}: throughput at c=8 / c=1 = **{v['ratio']:.2f}x** "
                         f"({v['per_round_min']:.2f}-{v['per_round_max']:.2f}); {ok} the "
                         f"{ch['target_scaling']:g}x target")
        for d, v in ch["spec_over_plain_c4"].items():
            ok = "beats" if v["ratio"] > 1 else "does not beat"
            lines.append(f"- {d} / plain throughput at c=4 = **{v['ratio']:.2f}x** "
                         f"({v['per_round_min']:.2f}-{v['per_round_max']:.2f}); speculative "
                         f"{ok} plain")
        if "identical_to_serial" in ch:
            k, n = ch["identical_to_serial"]
            kb, _ = ch["identical_to_plain_serial"]
            lines.append(f"- outputs identical to their serial run: **{k}/{n}**; to plain "
                         f"decoding's serial run: **{kb}/{n}**")
    if res.get("overhead"):
        lines += ["", "Server overhead at concurrency 1 (median over interleaved requests of "
                  "served / in-process seconds per token, minus one):", "",
                  "| drafter | requests | in-process ms/token | served streamed ms/token "
                  "| overhead streamed (95% interval) | served whole ms/token "
                  "| overhead whole (95% interval) |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for o in res["overhead"]:
            (sl, sh), (wl, wh) = o["stream_overhead_95"], o["whole_overhead_95"]
            lines.append(f"| {o['drafter']} | {o['requests']} | {o['local_ms_per_token']:.2f} | "
                         f"{o['stream_ms_per_token']:.2f} | {o['stream_overhead']:+.1%} "
                         f"({sl:+.1%} to {sh:+.1%}) | {o['whole_ms_per_token']:.2f} | "
                         f"{o['whole_overhead']:+.1%} ({wl:+.1%} to {wh:+.1%}) |")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    """Aggregate tok/s (median of rounds, bars: range) by concurrency, a line per drafter."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for d in res["config"]["drafters"]:
        rows = sorted((r for r in res["levels"] if r["drafter"] == d),
                      key=lambda r: r["concurrency"])
        if not rows:
            continue
        x = [r["concurrency"] for r in rows]
        y = [r["tok_s_median"] for r in rows]
        err = [[r["tok_s_median"] - r["tok_s_min"] for r in rows],
               [r["tok_s_max"] - r["tok_s_median"] for r in rows]]
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3,
                    label="plain" if d == "none" else d)
    levels = res["config"]["concurrency"]
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("aggregate completion tok/s")
    top = max((r["tok_s_max"] for r in res["levels"]), default=1.0)
    ax.set_ylim(0, top * 1.1)
    rounds = res["config"]["rounds"]
    ax.set_title(f"{res['config']['model']}: median of {rounds} round{'s' * (rounds != 1)} "
                 f"(bars: range)", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _markdown_name(out: Path) -> str:
    """results.md, unless a results.md not written by this script is there (a hand-written
    report): then results.tables.md."""
    md = out / "results.md"
    if md.exists() and not md.read_text().startswith(GENERATED):
        return "results.tables.md"
    return "results.md"


def main(argv: list[str] | None = None) -> int:
    import httpx

    from ortspec.runtime.cli_args import model_arg

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model directory (default: the exported default model)")
    ap.add_argument("--url", help="an `ortspec serve` already running (its drafter is whatever "
                                  "it was started with; --drafters then only labels it)")
    ap.add_argument("--drafters", default="prompt-lookup,none",
                    help="one server each (comma-separated drafter names)")
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    ap.add_argument("--requests", type=int, default=16,
                    help="requests per configuration per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--overhead-requests", type=int, default=16,
                    help="interleaved request triples per drafter for the overhead (0: skip)")
    ap.add_argument("--prompts", choices=("chat", "spec-bench-dev"), default="chat",
                    help="chat: the 8 short CHAT_PROMPTS; spec-bench-dev: the first turns of the "
                         "packaged Spec-Bench dev split (even ids), --per-category of each "
                         "category, categories interleaved")
    ap.add_argument("--per-category", type=int, default=4,
                    help="Spec-Bench questions per category with --prompts spec-bench-dev")
    ap.add_argument("--seed", type=int, default=0, help="shuffles the order of each round")
    ap.add_argument("--out", help="directory for results.json, results.md and throughput.png")
    args = ap.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    drafters = [d.strip() for d in args.drafters.split(",") if d.strip()]
    if args.url and len(drafters) != 1:
        raise SystemExit("--url serves one drafter: give --drafters with one name")
    model_dir = model_arg(args.model)
    prompts = load_prompts(args.prompts, per_category=args.per_category)
    procs: list[subprocess.Popen] = []
    urls: dict[str, str] = {}
    started = time.time()
    load_before = os.getloadavg()
    checkout = _checkout()  # what the servers load now
    try:
        if args.url:
            urls[drafters[0]] = args.url
        else:
            for d in drafters:  # one at a time: a server measures its cost curve and surface
                proc, urls[d] = _start_server(model_dir, max(levels), d)  # as it starts, and
                procs.append(proc)  # two measuring at once would each time a loaded machine
                _wait_ready(proc, urls[d])
        name = httpx.get(urls[drafters[0]] + "/v1/models", timeout=10).json()["data"][0]["id"]
        for d in drafters:  # warm-up: the first requests of a fresh process are slower
            run_batch(urls[d], name, prompts, 2, 4, args.max_tokens)
        over = []  # first, while the servers' draft-length policies have seen only the warm-up
        if args.overhead_requests:
            from ortspec.runtime import SpeculativeOptions, load_model

            model = load_model(model_dir, max_concurrent=1)
            for d in drafters:  # the same warm-up as the servers had
                for i in range(4):
                    model.generate(prompts[i % len(prompts)], chat=True,
                                   drafter=None if d == "none" else d,
                                   options=SpeculativeOptions(args.max_tokens))
            for d in drafters:
                o = overhead(urls[d], name, prompts, model, d, args.overhead_requests, args.max_tokens)
                over.append(o)
                print(f"overhead {d}: in-process {o['local_ms_per_token']:.2f} ms/token, "
                      f"streamed {o['stream_overhead']:+.1%}, whole {o['whole_overhead']:+.1%}",
                      flush=True)
            del model
        rng = random.Random(args.seed)
        batches: dict[tuple[str, int], list[dict]] = {(d, c): [] for d in drafters for c in levels}
        for rnd in range(args.rounds):
            order = list(batches)
            rng.shuffle(order)
            for d, c in order:
                before = scrape_batch_rows(urls[d])
                b = run_batch(urls[d], name, prompts, c, args.requests, args.max_tokens, offset=rnd)
                b["batch_rows"] = rows_delta(before, scrape_batch_rows(urls[d]))
                batches[d, c].append(b)
                rows = b["batch_rows"]
                mean = (f", {rows['sum'] / rows['count']:.2f} rows/call"
                        if rows and rows["count"] else "")
                print(f"round {rnd + 1}/{args.rounds} {d} c={c}: {b['tokens'] / b['wall_s']:.1f} "
                      f"tok/s, p50 {statistics.median(b['latency_s']):.2f} s{mean}", flush=True)
        levels_out = []
        for d in drafters:
            for c in levels:
                if not batches[d, c]:
                    continue
                deltas = [b["batch_rows"] for b in batches[d, c]]
                rows = None if None in deltas else {
                    "buckets": {k: sum(x["buckets"].get(k, 0) for x in deltas)
                                for k in deltas[0]["buckets"]},
                    "count": sum(x["count"] for x in deltas), "sum": sum(x["sum"] for x in deltas)}
                levels_out.append({"drafter": d, "concurrency": c, **summarise(batches[d, c]),
                                   "batch_rows": rows_summary(rows), "rounds": batches[d, c]})
        batch_rows = {d: rows_summary(scrape_batch_rows(urls[d])) for d in drafters}
        ident = identical(batches, drafters, levels) if args.rounds else None
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(60)
    res = {"config": {"model": name, "model_dir": str(model_dir), "drafters": drafters,
                      "concurrency": levels, "requests": args.requests, "rounds": args.rounds,
                      "max_tokens": args.max_tokens, "temperature": 0, "seed": args.seed,
                      "prompts": args.prompts, "prompt_texts": prompts,
                      "server_max_concurrent": max(levels), "command": " ".join(sys.argv)},
           "versions": _versions(), "checkout": checkout, "machine": _machine(),
           "started": time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(started)),
           "duration_s": time.time() - started,
           "load_average_before": load_before, "load_average_after": os.getloadavg(),
           "levels": levels_out, "batch_rows": batch_rows, "identical": ident,
           "overhead": over}
    res["checks"] = checks(res) if levels_out else {}
    table = markdown(res)
    print("\n" + table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
        (out / _markdown_name(out)).write_text(table)
        if levels_out:
            plot(res, out / "throughput.png")
    if ident and not ident["all_identical"]:
        print(f"{len(ident['differing'])} outputs differ from their serial run or plain "
              f"decoding's", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
