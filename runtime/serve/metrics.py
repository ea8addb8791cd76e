"""`ServerMetrics`: the Prometheus series `/metrics` exposes, on a registry of the server's own.

Names follow vLLM's, so its dashboards read them: `vllm:num_requests_running` and
`vllm:num_requests_waiting` (gauges read from the admission queue when scraped),
`vllm:time_to_first_token_seconds` and `vllm:e2e_request_latency_seconds` (histograms, from the
request's arrival, queueing included), `vllm:prompt_tokens_total`,
`vllm:generation_tokens_total`, `vllm:request_success_total{finished_reason}` ("stop",
"length", or "abort": the client went away; an aborted request counts its tokens and drafts
up to the cancel, but no end-to-end latency), and the
speculative-decoding counters: `vllm:spec_decode_num_drafts_total` (verify calls that checked a
non-empty draft), `..._num_draft_tokens_total` (drafted), `..._num_accepted_tokens_total`
(accepted) and `..._num_accepted_tokens_per_pos_total{position}` (accepted at draft position
0, 1, ...).

A model that batches (`ortspec.runtime.batching.runner`) adds `ortspec:batch_rows` (a histogram of
the requests each batched call carried), `ortspec:batch_tokens_per_row` (of the tokens a row
each call ran, S, padding included), `ortspec:batch_padded_rows_total` (rows carried along
without a job), and `ortspec:batch_calls_total{kind}` and `ortspec:batch_call_seconds_total{kind}`
(the model calls, "prefill" reading prompt chunks and "decode" the rows' steps, and the seconds
they took: over a span of wall time, what is left is the model idle while the rows' threads
drafted, verified and handed text out), read from the runner when scraped. A model with a prefix cache (`Model.prefix_counts`)
adds vLLM's `vllm:prefix_cache_queries_total` and `vllm:prefix_cache_hits_total` (prompt tokens
looked up in the prefix cache, and found).
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

from ..batching.runner import BatchStats
from ..decoding.counters import DecodeCounters

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class ServerMetrics:
    def __init__(self, *, running: Callable[[], int], waiting: Callable[[], int],
                 batch: BatchStats | None = None,
                 prefixes: Callable[[], tuple[int, int] | None] | None = None) -> None:
        self.registry = r = CollectorRegistry()
        if batch is not None:
            r.register(_BatchCollector(batch))
        if prefixes is not None:
            r.register(_PrefixCollector(prefixes))
        Gauge("vllm:num_requests_running", "Requests decoding now", registry=r).set_function(running)
        Gauge("vllm:num_requests_waiting", "Requests queued for a decode slot",
              registry=r).set_function(waiting)
        self.ttft = Histogram("vllm:time_to_first_token_seconds",
                              "Arrival to first text, queueing included", buckets=TTFT_BUCKETS,
                              registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to last token",
                             buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests",
                                     registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated", registry=r)
        self.success = Counter("vllm:request_success", "Requests finished, by finish reason",
                               ["finished_reason"], registry=r)
        self.drafts = Counter("vllm:spec_decode_num_drafts", "Verify calls with a draft",
                              registry=r)
        self.draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Drafted tokens",
                                    registry=r)
        self.accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens", "Accepted tokens",
                                       registry=r)
        self.accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted tokens by draft position", ["position"],
                                        registry=r)

    def finished(self, *, reason: str, prompt_tokens: int, completion_tokens: int,
                 counters: DecodeCounters | None, seconds: float | None) -> None:
        if seconds is not None:
            self.e2e.observe(seconds)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.success.labels(finished_reason=reason).inc()
        if counters is not None:
            self.drafts.inc(counters.verify_calls)
            self.draft_tokens.inc(counters.drafted)
            self.accepted_tokens.inc(counters.accepted)
            for position, n in enumerate(counters.accepted_by_position):
                self.accepted_per_pos.labels(position=str(position)).inc(n)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _BatchCollector:
    """The batch runner's call statistics as Prometheus histograms, read when scraped."""

    ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    TOKEN_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128, 256)

    def __init__(self, stats: BatchStats) -> None:
        self.stats = stats

    def collect(self):
        rows, widths, padded_rows = self.stats.snapshot()
        yield _histogram("ortspec:batch_rows", "Requests carried by each batched model call",
                         rows, self.ROW_BUCKETS)
        yield _histogram("ortspec:batch_tokens_per_row",
                         "Tokens a row in each batched call (S, padding included)",
                         widths, self.TOKEN_BUCKETS)
        padded = CounterMetricFamily("ortspec:batch_padded_rows",
                                     "Rows carried along in a batched call without a job of theirs")
        padded.add_metric([], padded_rows)
        yield padded
        decode_calls, decode_seconds, prefill_calls, prefill_seconds = self.stats.seconds_snapshot()
        calls = CounterMetricFamily("ortspec:batch_calls", "Batched model calls, by kind",
                                    labels=["kind"])
        seconds = CounterMetricFamily("ortspec:batch_call_seconds",
                                      "Seconds in batched model calls, by kind", labels=["kind"])
        for kind, n, t in (("prefill", prefill_calls, prefill_seconds),
                           ("decode", decode_calls, decode_seconds)):
            calls.add_metric([kind], n)
            seconds.add_metric([kind], t)
        yield calls
        yield seconds


class _PrefixCollector:
    """The prefix cache's counts (`snapshot`: prompt tokens looked up, and found; None without
    a cache, which shows nothing), read when scraped."""

    def __init__(self, snapshot: Callable[[], tuple[int, int] | None]) -> None:
        self.snapshot = snapshot

    def collect(self):
        counts = self.snapshot()
        if counts is None:
            return
        queried, hit = counts
        for name, doc, value in (
                ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", queried),
                ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache (their keys "
                                           "and values copied, not computed)", hit)):
            counter = CounterMetricFamily(name, doc)
            counter.add_metric([], value)
            yield counter


def _histogram(name: str, doc: str, counts: dict[int, int], bounds: tuple[int, ...]
               ) -> HistogramMetricFamily:
    buckets = []
    for b in bounds:
        buckets.append((str(float(b)), sum(n for v, n in counts.items() if v <= b)))
    total = sum(counts.values())
    buckets.append(("+Inf", total))
    h = HistogramMetricFamily(name, doc)
    h.add_metric([], buckets, sum_value=float(sum(v * n for v, n in counts.items())))
    return h
