"""Benchmark `ortspec serve` through the official openai client; prints a table.

    python scripts/bench_serve.py [--model DIR] [--url http://127.0.0.1:8000] \
        [--concurrency 1,4,8] [--requests 16] [--max-tokens 64]

Without --url the script starts `ortspec serve` on a free local port (--max-concurrent = the
highest concurrency) and stops it at the end. For each concurrency it sends --requests chat
requests (streamed, temperature 0, usage included) from that many client threads and reports
throughput (completion tokens per second of wall time), p50 / p99 end-to-end latency and
p50 / p99 time to first token. Then, at concurrency 1, the server's overhead per token: the
same requests through the server and through `Model.generate` in this process, interleaved
(A B A B: this machine's speed drifts), as the difference of their milliseconds per token.
"""

from __future__ import annotations

import argparse
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


def _one_request(client, name: str, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    """(end-to-end seconds, seconds to the first text, completion tokens)."""
    t0 = time.perf_counter()
    first = None
    tokens = 0
    for chunk in client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
            temperature=0, stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content and first is None:
            first = time.perf_counter() - t0
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    total = time.perf_counter() - t0
    return total, first if first is not None else total, tokens


def run_level(url: str, name: str, concurrency: int, n_requests: int, max_tokens: int) -> dict:
    import openai

    jobs = [PROMPTS[i % len(PROMPTS)] for i in range(n_requests)]
    results: list[tuple[float, float, int]] = []
    lock = threading.Lock()

    def worker(k: int) -> None:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        for i in range(k, len(jobs), concurrency):
            r = _one_request(client, name, jobs[i], max_tokens)
            with lock:
                results.append(r)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    latency = [r[0] for r in results]
    ttft = [r[1] for r in results]
    tokens = sum(r[2] for r in results)
    return {"concurrency": concurrency, "requests": len(results), "tokens": tokens,
            "tok_s": tokens / wall, "p50": _percentile(latency, 50), "p99": _percentile(latency, 99),
            "ttft50": _percentile(ttft, 50), "ttft99": _percentile(ttft, 99)}


def overhead(url: str, name: str, model_dir: Path, n_requests: int, max_tokens: int) -> dict:
    """ms per token through the server and in-process, interleaved per request."""
    import openai

    from ortspec.runtime import SpeculativeOptions, load_model

    model = load_model(model_dir, max_concurrent=1)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    served, local = [], []
    for i in range(n_requests):
        prompt = PROMPTS[i % len(PROMPTS)]
        total, _, tokens = _one_request(client, name, prompt, max_tokens)
        served.append(total / max(tokens, 1))
        t0 = time.perf_counter()
        r = model.generate(prompt, chat=True, options=SpeculativeOptions(max_tokens))
        local.append((time.perf_counter() - t0) / max(r.num_tokens, 1))
    s, m = statistics.median(served) * 1e3, statistics.median(local) * 1e3
    return {"served_ms": s, "local_ms": m, "overhead_ms": s - m}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(model_dir: Path, max_concurrent: int) -> tuple[subprocess.Popen, str]:
    import httpx

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ortspec.runtime.cli", "serve", "--model",
                             str(model_dir), "--port", str(port), "--max-concurrent",
                             str(max_concurrent), "--log-level", "warning"])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with status {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.terminate()
    raise SystemExit("the server did not answer /health in 300 s")


def main(argv: list[str] | None = None) -> int:
    import httpx

    from ortspec.runtime.cli_args import model_arg

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model directory (default: the exported default model)")
    ap.add_argument("--url", help="an `ortspec serve` already running (default: start one)")
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--requests", type=int, default=16, help="requests per concurrency level")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    model_dir = model_arg(args.model)
    proc = None
    url = args.url
    if url is None:
        proc, url = _start_server(model_dir, max(levels))
    try:
        name = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        _one_request(__import__("openai").OpenAI(base_url=url + "/v1", api_key="none"), name,
                     PROMPTS[0], 8)  # warm-up
        print(f"model {name}, {args.requests} requests per level, max_tokens {args.max_tokens}, "
              f"temperature 0, streamed\n")
        print("| concurrency | requests | tokens | tok/s | p50 latency s | p99 latency s "
              "| p50 TTFT s | p99 TTFT s |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
        for c in levels:
            r = run_level(url, name, c, args.requests, args.max_tokens)
            print(f"| {c} | {r['requests']} | {r['tokens']} | {r['tok_s']:.1f} | {r['p50']:.2f} "
                  f"| {r['p99']:.2f} | {r['ttft50']:.3f} | {r['ttft99']:.3f} |", flush=True)
        o = overhead(url, name, model_dir, min(args.requests, 8), args.max_tokens)
        print(f"\nconcurrency 1, median ms per token: server {o['served_ms']:.1f}, in-process "
              f"Model.generate {o['local_ms']:.1f}, server overhead {o['overhead_ms']:+.1f} ms/token")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
