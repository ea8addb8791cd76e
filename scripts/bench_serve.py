"""Benchmark `ortspec serve` through the official openai client: throughput and latency by
concurrency, speculative and plain, and the server's overhead per token against in-process
`Model.generate`.

    python scripts/bench_serve.py [--model DIR] [--drafters prompt-lookup,none] \
        [--concurrency 1,4,8] [--requests 16] [--rounds 3] [--max-tokens 64] [--out DIR]
    python scripts/bench_serve.py --url http://127.0.0.1:8000 ...   # a server already running

Without --url the script starts one `ortspec serve` per drafter on free local ports
(--max-concurrent = the highest concurrency), all at once, and stops them at the end. Every
request is a chat request, streamed, temperature 0, usage included, from PROMPTS in turn.

This machine's speed drifts (other work shares its cores), so configurations are interleaved:
each round runs every (drafter, concurrency) pair once, in an order shuffled per round, and a
configuration's figures pool its rounds (latency percentiles over all its requests; throughput
as the median of its rounds, with their range).

Overhead (measured first, after the same warm-up for server and in-process model): at
concurrency 1, for each drafter, the same requests through the server (streamed,
and not) and through `Model.generate` in this process, interleaved request by request with the
order alternating; the overhead is the median over requests of served / in-process seconds per
token, minus one (per request: both decode the same prompt to the same tokens at temperature 0).
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

PROMPTS = [
    "Summarise in two sentences: the water cycle moves water between oceans, air and land.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Translate to French: The weather is nice today and we will go for a walk.",
    "List five uses of a paperclip.",
    "Explain what a hash table is to a beginner.",
    "Rewrite more formally: hey, can u send me the report by tmrw?",
    "What are the main causes of the seasons on Earth?",
    "Give three tips for writing clear emails.",
]


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def _client(url: str):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)


def _one_request(client, name: str, prompt: str, max_tokens: int, *, stream: bool = True
                 ) -> tuple[float, float, int]:
    """(end-to-end seconds, seconds to the first text, completion tokens)."""
    messages = [{"role": "user", "content": prompt}]
    t0 = time.perf_counter()
    if not stream:
        r = client.chat.completions.create(model=name, messages=messages, max_tokens=max_tokens,
                                           temperature=0)
        total = time.perf_counter() - t0
        return total, total, r.usage.completion_tokens
    first = None
    tokens = 0
    for chunk in client.chat.completions.create(
            model=name, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content and first is None:
            first = time.perf_counter() - t0
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    total = time.perf_counter() - t0
    return total, first if first is not None else total, tokens


def run_batch(url: str, name: str, concurrency: int, n_requests: int, max_tokens: int,
              offset: int = 0) -> dict:
    """`n_requests` requests from `concurrency` client threads: wall time and per request."""
    jobs = [PROMPTS[(offset + i) % len(PROMPTS)] for i in range(n_requests)]
    results: list[tuple[float, float, int]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker(k: int) -> None:
        client = _client(url)
        for i in range(k, len(jobs), concurrency):
            try:
                r = _one_request(client, name, jobs[i], max_tokens)
            except BaseException as e:  # noqa: BLE001 - reported by the caller
                errors.append(e)
                return
            with lock:
                results.append(r)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise SystemExit(f"a request failed at concurrency {concurrency}: {errors[0]!r}")
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "latency_s": [r[0] for r in results], "ttft_s": [r[1] for r in results],
            "tokens": sum(r[2] for r in results)}


def summarise(batches: list[dict]) -> dict:
    latency = [x for b in batches for x in b["latency_s"]]
    ttft = [x for b in batches for x in b["ttft_s"]]
    tok_s = [b["tokens"] / b["wall_s"] for b in batches]
    return {"requests": len(latency), "tokens": sum(b["tokens"] for b in batches),
            "tok_s_median": statistics.median(tok_s), "tok_s_min": min(tok_s),
            "tok_s_max": max(tok_s), "latency_p50_s": _percentile(latency, 50),
            "latency_p90_s": _percentile(latency, 90), "ttft_p50_s": _percentile(ttft, 50),
            "ttft_p90_s": _percentile(ttft, 90)}


def overhead(url: str, name: str, model, drafter: str, n_requests: int, max_tokens: int) -> dict:
    """Seconds per token served (streamed and not) against in-process, interleaved per request."""
    from ortspec.runtime import SpeculativeOptions

    client = _client(url)
    local_drafter = None if drafter == "none" else drafter
    rows = []
    for i in range(n_requests):
        prompt = PROMPTS[i % len(PROMPTS)]
        row: dict[str, float] = {}

        def local() -> None:
            t0 = time.perf_counter()
            r = model.generate(prompt, chat=True, drafter=local_drafter,
                               options=SpeculativeOptions(max_tokens))
            row["local"] = (time.perf_counter() - t0) / max(r.num_tokens, 1)
            row["tokens"] = r.num_tokens

        def streamed() -> None:
            total, _, tokens = _one_request(client, name, prompt, max_tokens)
            row["stream"] = total / max(tokens, 1)
            row["stream_tokens"] = tokens

        def whole() -> None:
            total, _, tokens = _one_request(client, name, prompt, max_tokens, stream=False)
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


def _machine() -> dict:
    from ortspec.runtime.machine import cpu_model

    return {"cpu": cpu_model(), "logical_cpus": os.cpu_count(), "platform": platform.platform()}


def markdown(res: dict) -> str:
    cfg = res["config"]
    lines = [f"model {cfg['model']}, max_tokens {cfg['max_tokens']}, temperature 0, chat "
             f"requests", ""]
    if res["levels"]:
        lines += [f"{cfg['requests']} streamed requests per configuration per round, "
                  f"{cfg['rounds']} rounds (configurations interleaved, order shuffled per round)",
                  "",
                  "| drafter | concurrency | requests | tok/s (median of rounds, range) "
                  "| p50 latency s | p90 latency s | p50 TTFT s | p90 TTFT s |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["levels"]:
        lines.append(f"| {r['drafter']} | {r['concurrency']} | {r['requests']} | "
                     f"{r['tok_s_median']:.1f} ({r['tok_s_min']:.1f}-{r['tok_s_max']:.1f}) | "
                     f"{r['latency_p50_s']:.2f} | {r['latency_p90_s']:.2f} | "
                     f"{r['ttft_p50_s']:.3f} | {r['ttft_p90_s']:.3f} |")
    drafters = sorted({r["drafter"] for r in res["levels"]})
    if "none" in drafters and len(drafters) > 1:
        plain = {r["concurrency"]: r["tok_s_median"] for r in res["levels"] if r["drafter"] == "none"}
        lines += ["", "| drafter | concurrency | throughput vs plain |", "|---|---:|---:|"]
        for r in res["levels"]:
            if r["drafter"] != "none" and r["concurrency"] in plain:
                lines.append(f"| {r['drafter']} | {r['concurrency']} | "
                             f"{r['tok_s_median'] / plain[r['concurrency']]:.2f}x |")
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


def main(argv: list[str] | None = None) -> int:
    import httpx

    from ortspec.runtime.cli_args import model_arg

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model directory (default: the exported default model)")
    ap.add_argument("--url", help="an `ortspec serve` already running (its drafter is whatever "
                                  "it was started with; --drafters then only labels it)")
    ap.add_argument("--drafters", default="prompt-lookup,none",
                    help="one server each (comma-separated drafter names)")
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--requests", type=int, default=16,
                    help="requests per configuration per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--overhead-requests", type=int, default=16,
                    help="interleaved request triples per drafter for the overhead (0: skip)")
    ap.add_argument("--seed", type=int, default=0, help="shuffles the order of each round")
    ap.add_argument("--out", help="directory for results.json and results.md")
    args = ap.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    drafters = [d.strip() for d in args.drafters.split(",") if d.strip()]
    if args.url and len(drafters) != 1:
        raise SystemExit("--url serves one drafter: give --drafters with one name")
    model_dir = model_arg(args.model)
    procs: list[subprocess.Popen] = []
    urls: dict[str, str] = {}
    started = time.time()
    load_before = os.getloadavg()
    try:
        if args.url:
            urls[drafters[0]] = args.url
        else:
            for d in drafters:
                proc, urls[d] = _start_server(model_dir, max(levels), d)
                procs.append(proc)
            for proc, d in zip(procs, drafters):
                _wait_ready(proc, urls[d])
        name = httpx.get(urls[drafters[0]] + "/v1/models", timeout=10).json()["data"][0]["id"]
        for d in drafters:  # warm-up: the first requests of a fresh process are slower
            run_batch(urls[d], name, 2, 4, args.max_tokens)
        over = []  # first, while the servers' draft-length policies have seen only the warm-up
        if args.overhead_requests:
            from ortspec.runtime import SpeculativeOptions, load_model

            model = load_model(model_dir, max_concurrent=1)
            for d in drafters:  # the same warm-up as the servers had
                for i in range(4):
                    model.generate(PROMPTS[i], chat=True, drafter=None if d == "none" else d,
                                   options=SpeculativeOptions(args.max_tokens))
            for d in drafters:
                o = overhead(urls[d], name, model, d, args.overhead_requests, args.max_tokens)
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
                b = run_batch(urls[d], name, c, args.requests, args.max_tokens, offset=rnd)
                batches[d, c].append(b)
                print(f"round {rnd + 1}/{args.rounds} {d} c={c}: {b['tokens'] / b['wall_s']:.1f} "
                      f"tok/s, p50 {statistics.median(b['latency_s']):.2f} s", flush=True)
        levels_out = [{"drafter": d, "concurrency": c, **summarise(batches[d, c]),
                       "rounds": batches[d, c]} for d in drafters for c in levels if batches[d, c]]
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(60)
    res = {"config": {"model": name, "model_dir": str(model_dir), "drafters": drafters,
                      "concurrency": levels, "requests": args.requests, "rounds": args.rounds,
                      "max_tokens": args.max_tokens, "temperature": 0, "seed": args.seed,
                      "server_max_concurrent": max(levels), "command": " ".join(sys.argv)},
           "versions": _versions(), "machine": _machine(),
           "started": time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(started)),
           "duration_s": time.time() - started,
           "load_average_before": load_before, "load_average_after": os.getloadavg(),
           "levels": levels_out, "overhead": over}
    table = markdown(res)
    print("\n" + table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
        (out / "results.tables.md").write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
