"""The record of a serving benchmark (`serving.py`), from its raw batches to its findings:
throughput and latency per configuration, every output against its serial run, requests per
batched call from `ortspec:batch_rows`, its checks (throughput at c=8 over c=1, speculative
over plain at every level with a 95% interval from the rounds' paired ratios, identical
outputs), the markdown tables and the plot."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

GENERATED = "<!-- written by ortspec.runtime.bench.serving -->"
# the same line in the records written before the benchmark moved into the package
GENERATED_BEFORE = ("<!-- written by scripts/bench_serve.py -->",)


def percentile(values: list[float], q: float) -> float:
    """The `q`th percentile of `values` (non-empty): the sorted value at index
    round(q / 100 * (n - 1)), no interpolation."""
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


# Student's t distribution's 0.975 quantile by degrees of freedom 1..30 (standard tables); past
# 30, the normal's 1.96
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
        2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def round_ratios(a: list[dict], b: list[dict]) -> list[float]:
    """Per round, the tok/s of batch a over batch b of the same round (the two ran one after
    the other, on the same prompts); a round where either wrote nothing is skipped."""
    return [(x["tokens"] / x["wall_s"]) / (y["tokens"] / y["wall_s"])
            for x, y in zip(a, b) if x["tokens"] > 0 and y["tokens"] > 0]


def paired_ratio(ratios: list[float]) -> dict:
    """The geometric mean of per-round ratios (each a system's tok/s over another's in the same
    round, the two batches run one after the other) and its 95% confidence interval: a t
    interval on the logs, which the rounds' spread sets. On a machine whose speed drifts from
    minute to minute, a ratio is only shown above (or below) 1 when the whole interval is.
    `ratios`: positive, at least one (one round: no interval, its bounds None)."""
    if not ratios or min(ratios) <= 0:
        raise ValueError(f"paired ratios must be positive and at least one, got {ratios}")
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    out = {"geomean": math.exp(mean), "rounds": len(ratios), "low": None, "high": None}
    if len(logs) > 1:
        df = len(logs) - 1
        half = (T975[df - 1] if df <= len(T975) else 1.96) * statistics.stdev(logs) / \
            math.sqrt(len(logs))
        out["low"], out["high"] = math.exp(mean - half), math.exp(mean + half)
    return out


def paired_verdict(p: dict) -> str:
    """"above 1", "below 1" or "not distinguishable from 1" at 95%, from `paired_ratio`."""
    if p["low"] is None:
        return "one round: no interval"
    if p["low"] > 1:
        return "above 1"
    if p["high"] < 1:
        return "below 1"
    return "not distinguishable from 1"


def paired_text(p: dict) -> str:
    """`paired_ratio` as text: "1.06x (95% 0.98-1.15)"."""
    if p["low"] is None:
        return f"{p['geomean']:.2f}x"
    return f"{p['geomean']:.2f}x (95% {p['low']:.2f}-{p['high']:.2f})"


def summarise(batches: list[dict]) -> dict:
    latency = [x for b in batches for x in b["latency_s"]]
    ttft = [x for b in batches for x in b["ttft_s"]]
    tok_s = [b["tokens"] / b["wall_s"] for b in batches]
    out = {"requests": len(latency), "tokens": sum(b["tokens"] for b in batches),
           "tok_s_median": statistics.median(tok_s), "tok_s_min": min(tok_s),
           "tok_s_max": max(tok_s)}
    for q in (50, 90, 99):
        out[f"latency_p{q}_s"] = percentile(latency, q)
    for q in (50, 90, 99):
        out[f"ttft_p{q}_s"] = percentile(ttft, q)
    return out


def identical(batches: dict[tuple[str, int], list[dict]], drafters: list[str],
              levels: list[int], serial_pass: dict[str, dict[int, str]] | None = None) -> dict:
    """Every request's text against its drafter's serial text for the prompt, and against plain
    decoding's (the drafter "none" if measured, else the first one). The serial configuration
    is concurrency 1, or the lowest measured; its reference is its first round's text, or for
    a prompt it never sent, the text `serial_pass[drafter][prompt]` (one request at a time)."""
    serial = min(levels)
    base = "none" if "none" in drafters else drafters[0]
    refs: dict[str, dict[int, str]] = {d: {} for d in drafters}
    for d in drafters:
        for b in batches[d, serial]:
            for o in b["outputs"]:
                refs[d].setdefault(o["prompt"], o["text"])
        for p, text in (serial_pass or {}).get(d, {}).items():
            refs[d].setdefault(p, text)
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


def rows_delta(before: dict | None, after: dict | None) -> dict | None:
    """The calls between two scrapes of `ortspec:batch_rows`."""
    if before is None or after is None:
        return None
    return {"buckets": {k: v - before["buckets"].get(k, 0) for k, v in after["buckets"].items()},
            "count": after["count"] - before["count"], "sum": after["sum"] - before["sum"]}


def seconds_delta(before: dict | None, after: dict | None) -> dict | None:
    """The seconds of model calls by kind between two scrapes of
    `ortspec:batch_call_seconds_total`."""
    if before is None or after is None:
        return None
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def time_shares(batches: list[dict]) -> dict | None:
    """Over a configuration's batches: the shares of their wall time the server's model spent
    in prefill calls and in decode calls, and the rest ("idle": the model waiting for the rows'
    threads, which draft, verify and hand text out between calls, or for requests to come);
    None where a batch has no call seconds (a server that does not batch)."""
    if not batches or any(b.get("call_seconds") is None for b in batches):
        return None
    wall = sum(b["wall_s"] for b in batches)
    prefill = sum(b["call_seconds"].get("prefill", 0.0) for b in batches) / wall
    decode = sum(b["call_seconds"].get("decode", 0.0) for b in batches) / wall
    return {"prefill": prefill, "decode": decode, "idle": max(0.0, 1.0 - prefill - decode)}


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


def checks(res: dict) -> dict:
    """From the measured data: throughput at c=8 over c=1 per drafter, speculative over plain
    at c=4 (median of rounds, and the range of the same ratio round by round), speculative over
    plain at every level as `paired_ratio` of the rounds, and whether every output was
    identical to its serial run."""
    by = {(r["drafter"], r["concurrency"]): r for r in res["levels"]}
    drafters = res["config"]["drafters"]
    plain = "none" if "none" in drafters else None

    def ratio(a: dict, b: dict) -> dict:
        per_round = round_ratios(a["rounds"], b["rounds"])
        return {"ratio": a["tok_s_median"] / b["tok_s_median"],
                "per_round_min": min(per_round), "per_round_max": max(per_round)}

    out: dict = {"scaling_c8_over_c1": {}, "target_scaling": 3.0}
    for d in drafters:
        if (d, 8) in by and (d, 1) in by:
            out["scaling_c8_over_c1"][d] = ratio(by[d, 8], by[d, 1])
    out["spec_over_plain_c4"] = {d: ratio(by[d, 4], by[plain, 4]) for d in drafters
                                 if plain and d != plain and (d, 4) in by and (plain, 4) in by}
    out["spec_over_plain_paired"] = {
        d: {str(c): paired_ratio(round_ratios(by[d, c]["rounds"], by[plain, c]["rounds"]))
            for c in res["config"]["concurrency"] if (d, c) in by and (plain, c) in by}
        for d in drafters if plain and d != plain}
    ident = res.get("identical")
    if ident:
        out["identical_to_serial"] = [ident["identical_to_serial"], ident["requests"]]
        out["identical_to_plain_serial"] = [ident["identical_to_plain_serial"], ident["requests"]]
    return out


def _rows_cell(s: dict | None) -> str:
    return "-" if not s or s["mean_rows"] is None else f"{s['mean_rows']:.2f} ({s['calls']})"


def _or_default(value: object) -> str:
    return "default" if value is None else f"{value:g}"


def _logical_cpus(machine: dict) -> object:
    """`provenance.machine`'s cpu_count (logical_cpus in the records written before it)."""
    return machine.get("cpu_count", machine.get("logical_cpus"))


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
              f"{_logical_cpus(res['machine'])} logical CPUs, load average {load} before, "
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
                   f"gave."
                   + (" Distinct prompts: no server was sent a prompt twice in the timed "
                      "rounds; prompts the serial configuration did not send were run one at a "
                      "time after them for the reference." if cfg.get("distinct_prompts")
                      else "")), "",
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
    shares = [r for r in res["levels"] if r.get("model_time")]
    if shares:
        lines += ["", ("The model's time, as shares of the batches' wall time "
                       "(`ortspec:batch_call_seconds_total`): reading prompts (prefill calls), "
                       "decoding (the rows' steps), and neither (the model waiting for the rows' "
                       "threads between calls, or for requests):"), "",
                  "| drafter | concurrency | prefill | decode | neither |",
                  "|---|---:|---:|---:|---:|"]
        for r in shares:
            t = r["model_time"]
            lines.append(f"| {r['drafter']} | {r['concurrency']} | {t['prefill']:.0%} | "
                         f"{t['decode']:.0%} | {t['idle']:.0%} |")
    cached = {d: c for d, c in (res.get("prefix_cache") or {}).items() if c and c.get("queries")}
    if cached:
        lines += ["", "Prefix cache (prompt tokens found / looked up, whole run, warm-up "
                  "included): " + "; ".join(f"{d} {c['hits']}/{c['queries']} "
                                             f"({c['hits'] / c['queries']:.0%})"
                                             for d, c in cached.items())
                  + f" (--prefix-cache-mib {_or_default(res['config'].get('prefix_cache_mib'))})."]
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
        for d, by_level in ch.get("spec_over_plain_paired", {}).items():
            cells = [f"c={c} **{paired_text(p)}**, {paired_verdict(p)}"
                     for c, p in by_level.items()]
            lines.append(f"- {d} / plain, paired (geometric mean of the rounds' ratios, 95% "
                         f"interval): " + "; ".join(cells))
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


def markdown_name(out: Path) -> str:
    """results.md, unless a results.md not written by this benchmark is there (a hand-written
    report): then results.tables.md."""
    md = out / "results.md"
    if md.exists() and not md.read_text().startswith((GENERATED, *GENERATED_BEFORE)):
        return "results.tables.md"
    return "results.md"
