"""Benchmark `ortspec serve` through the official openai client: throughput and latency by
concurrency, speculative and plain, whether every output is the one its serial run gave, how
many requests the server's batched calls carried, and the server's overhead per token against
in-process `Model.generate`.

    python -m ortspec.runtime.bench.serving [--model DIR] [--drafters prompt-lookup,none] \
        [--concurrency 1,2,4,8,16] [--requests 16] [--rounds 3] [--max-tokens 64] \
        [--overhead-requests 16] [--out DIR]
    python -m ortspec.runtime.bench.serving --url http://127.0.0.1:8000 ...   # one already running

Without --url the benchmark starts one `ortspec serve` per drafter on free local ports
(--max-concurrent = the highest concurrency), one after another, and stops them at the end. Every
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

--distinct-prompts: no prompt is sent twice to a server during the timed rounds (each batch
takes the next `--requests` prompts), so a prefix cache finds only what prompts share (the
system prompt and chat template); the serial references of prompts that only ran concurrently
come from a serial pass after the rounds, one request at a time, untimed.

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
import random
import statistics
import sys
import threading
import time
from pathlib import Path

from . import provenance
from .server import ServerError, ServerProcess, free_port, http_get, ortspec_serve
from .serving_report import checks, identical, markdown, markdown_name, plot, rows_delta, \
    rows_summary, seconds_delta, summarise, time_shares

# what the record lists the versions of: the server's stack and the client's
VERSIONS = ("ortspec", "onnxruntime", "tokenizers", "numpy", "fastapi", "starlette", "uvicorn",
            "httptools", "uvloop", "openai", "httpx")

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


def load_prompts(kind: str, *, per_category: int,
                 categories: list[str] | None = None) -> list[str]:
    """The user messages a run sends, in the order requests take them (`categories`: those of
    the Spec-Bench dev split kept, all when None)."""
    if kind == "chat":
        return list(CHAT_PROMPTS)
    from ortspec.runtime.bench.workload import interleave_categories, load_questions

    return [q.text for q in interleave_categories(load_questions(
        split="dev", per_category=per_category, categories=categories))]


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
              max_tokens: int, offset: int = 0, indices: list[int] | None = None) -> dict:
    """`n_requests` requests from `concurrency` client threads, each sending its next request
    as soon as its last one is answered, the next of the batch's list (a closed loop of
    `concurrency` users sharing one queue, so a client with short answers takes more of them):
    wall time, and per request its latency, time to first text, prompt (index into `prompts`)
    and completion text. The prompts are those from `offset` on, in turn, or the `indices`
    given."""
    jobs = [(offset + i) % len(prompts) for i in range(n_requests)] if indices is None \
        else list(indices)
    results: list[tuple[int, tuple[float, float, int, str]]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    queue = iter(range(len(jobs)))

    def worker() -> None:
        client = _client(url)
        while not errors:
            with lock:
                i = next(queue, None)
            if i is None:
                return
            try:
                r = _one_request(client, name, prompts[jobs[i]], max_tokens)
            except BaseException as e:  # noqa: BLE001 - reported by the caller
                errors.append(e)
                return
            with lock:
                results.append((jobs[i], r))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
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


def _metric_families(url: str) -> list:
    """The server's /metrics, parsed."""
    from prometheus_client.parser import text_string_to_metric_families

    return list(text_string_to_metric_families(http_get(url + "/metrics", timeout=30)))


def scrape_prefix_cache(url: str) -> dict | None:
    """The prompt tokens the server looked up in its prefix cache and found there (vLLM's
    `prefix_cache_queries` and `prefix_cache_hits`); None if it keeps none."""
    found = {}
    for family in _metric_families(url):
        if family.name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits"):
            found[family.name.rpartition("_")[2]] = int(family.samples[0].value)
    return found or None


def call_seconds_of(families: list) -> dict | None:
    """`ortspec:batch_call_seconds_total` from a server's parsed /metrics (`_metric_families`):
    the seconds its batched model calls took so far, by kind ("prefill", "decode"); None if
    the server does not batch."""
    for family in families:
        if family.name == "ortspec:batch_call_seconds":
            return {s.labels["kind"]: float(s.value) for s in family.samples
                    if s.name.endswith("_total")}
    return None


def batch_rows_of(families: list) -> dict | None:
    """`ortspec:batch_rows` from a server's parsed /metrics (`_metric_families`): its buckets
    (cumulative, as Prometheus has them, by upper bound), count and sum; None if the server
    does not batch."""
    for family in families:
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


def _start_server(model_dir: Path, max_concurrent: int, drafter: str,
                  prefix_cache_mib: float | None) -> ServerProcess:
    port = free_port()
    extra = [] if prefix_cache_mib is None else ["--prefix-cache-mib", str(prefix_cache_mib)]
    return ServerProcess(ortspec_serve(model_dir, port, "--max-concurrent", str(max_concurrent),
                                       "--drafter", drafter, "--log-level", "warning", *extra),
                         port, ready_s=300, stop_s=60)


def main(argv: list[str] | None = None) -> int:
    from ortspec.runtime.cli.args import model_arg

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
    ap.add_argument("--categories",
                    help="with --prompts spec-bench-dev: the categories kept (comma-separated, "
                         "e.g. multi-turn,translation,qa,math_reasoning; default all)")
    ap.add_argument("--seed", type=int, default=0, help="shuffles the order of each round")
    ap.add_argument("--distinct-prompts", action="store_true",
                    help="every batch of every round takes prompts no other batch of the same "
                         "server sent (the servers' prefix caches find only what the prompts "
                         "share); outputs are checked against a serial pass at the end")
    ap.add_argument("--prefix-cache-mib", type=float, default=None,
                    help="the servers' --prefix-cache-mib (default: theirs; 0: no prefix cache)")
    ap.add_argument("--out", help="directory for results.json, results.md and throughput.png")
    args = ap.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    drafters = [d.strip() for d in args.drafters.split(",") if d.strip()]
    if args.url and len(drafters) != 1:
        raise SystemExit("--url serves one drafter: give --drafters with one name")
    model_dir = model_arg(args.model)
    categories = None if args.categories is None else \
        [c.strip() for c in args.categories.split(",") if c.strip()]
    if categories is not None and args.prompts != "spec-bench-dev":
        raise SystemExit("--categories selects Spec-Bench categories: give --prompts spec-bench-dev")
    prompts = load_prompts(args.prompts, per_category=args.per_category, categories=categories)
    if args.distinct_prompts and len(prompts) < args.rounds * len(levels) * args.requests:
        raise SystemExit(f"--distinct-prompts needs rounds x concurrency levels x requests = "
                         f"{args.rounds * len(levels) * args.requests} prompts; there are "
                         f"{len(prompts)} (raise --per-category or lower --requests)")

    def batch_prompts(rnd: int, c: int) -> list[int] | None:  # None: from the round's offset
        if not args.distinct_prompts:
            return None
        start = (rnd * len(levels) + levels.index(c)) * args.requests
        return list(range(start, start + args.requests))
    servers: list[ServerProcess] = []
    urls: dict[str, str] = {}
    started = time.time()
    load_before = os.getloadavg()
    checkout = provenance.checkout()  # what the servers load now
    try:
        if args.url:
            urls[drafters[0]] = args.url
        else:
            for d in drafters:  # one at a time: a server measures its cost curve and surface
                try:  # as it starts, and two measuring at once would each time a loaded machine
                    servers.append(_start_server(model_dir, max(levels), d, args.prefix_cache_mib))
                except ServerError as e:
                    raise SystemExit(str(e)) from None
                urls[d] = servers[-1].url
        name = json.loads(http_get(urls[drafters[0]] + "/v1/models", timeout=10))["data"][0]["id"]
        # warm-up: the first requests of a fresh process are slower; where the rounds send the
        # same prompts again, every prompt once, so that no server's first timed batch is the
        # one that reads them first (into its prefix cache) while the others' are not
        warm = 4 if args.distinct_prompts else max(4, len(prompts))
        for d in drafters:
            run_batch(urls[d], name, prompts, 2, warm, args.max_tokens)
        over = []  # first, while the servers' draft-length policies have seen only the warm-up
        if args.overhead_requests:
            from ortspec.runtime import SpeculativeOptions, load_model

            model = load_model(model_dir, max_concurrent=1, prefix_cache_mib=0)
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
                before = _metric_families(urls[d])
                b = run_batch(urls[d], name, prompts, c, args.requests, args.max_tokens,
                              offset=rnd, indices=batch_prompts(rnd, c))
                after = _metric_families(urls[d])
                b["batch_rows"] = rows_delta(batch_rows_of(before), batch_rows_of(after))
                b["call_seconds"] = seconds_delta(call_seconds_of(before), call_seconds_of(after))
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
                                   "batch_rows": rows_summary(rows),
                                   "model_time": time_shares(batches[d, c]),
                                   "rounds": batches[d, c]})
        batch_rows = {d: rows_summary(batch_rows_of(_metric_families(urls[d])))
                      for d in drafters}
        prefix_cache = {d: scrape_prefix_cache(urls[d]) for d in drafters}
        serial_pass = {}  # --distinct-prompts: the serial texts of prompts sent only concurrently
        if args.distinct_prompts and args.rounds:
            for d in drafters:
                seen = {o["prompt"] for b in batches[d, min(levels)] for o in b["outputs"]}
                rest = sorted({o["prompt"] for (dd, _), bs in batches.items() if dd == d
                               for b in bs for o in b["outputs"]} - seen)
                b = run_batch(urls[d], name, prompts, 1, len(rest), args.max_tokens, indices=rest)
                serial_pass[d] = {o["prompt"]: o["text"] for o in b["outputs"]}
                print(f"serial pass {d}: {len(rest)} prompts", flush=True)
        ident = identical(batches, drafters, levels, serial_pass) if args.rounds else None
    finally:
        for server in servers:
            server.stop()
    res = {"config": {"model": name, "model_dir": str(model_dir), "drafters": drafters,
                      "concurrency": levels, "requests": args.requests, "rounds": args.rounds,
                      "max_tokens": args.max_tokens, "temperature": 0, "seed": args.seed,
                      "prompts": args.prompts, "categories": categories, "prompt_texts": prompts,
                      "server_max_concurrent": max(levels),
                      "prefix_cache_mib": args.prefix_cache_mib,
                      "distinct_prompts": args.distinct_prompts, "command": " ".join(sys.argv)},
           "versions": provenance.versions(VERSIONS), "checkout": checkout,
           "machine": provenance.machine(),
           "started": time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(started)),
           "duration_s": time.time() - started,
           "load_average_before": load_before, "load_average_after": os.getloadavg(),
           "levels": levels_out, "batch_rows": batch_rows, "prefix_cache": prefix_cache,
           "identical": ident,
           "overhead": over}
    res["checks"] = checks(res) if levels_out else {}
    table = markdown(res)
    print("\n" + table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
        (out / markdown_name(out)).write_text(table)
        if levels_out:
            plot(res, out / "throughput.png")
    if ident and not ident["all_identical"]:
        print(f"{len(ident['differing'])} outputs differ from their serial run or plain "
              f"decoding's", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
