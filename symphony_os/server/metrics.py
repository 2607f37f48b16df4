"""/metrics through `prometheus_client`, in a registry of the app's own.

Request metrics under vLLM's names and buckets, so that its Grafana dashboards read them, with
its `model_name` label and a `source` label: "openai" (a /v1 request) or "process" (a LIP
launched through /processes). For a process, the first token is its first output and a token is
an output frame; it finishes "exited" (code 0), "failed" (another code) or "killed":
    vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds,
    vllm:e2e_request_latency_seconds (histograms), vllm:request_success_total{finished_reason},
    vllm:prompt_tokens_total, vllm:generation_tokens_total, vllm:prefix_cache_queries_total,
    vllm:prefix_cache_hits_total (prompt tokens of /v1 requests, and those reused), and
    vllm:kv_cache_usage_perc (a fraction, as vLLM's), vllm:num_requests_waiting (preds queued).
Symphony's own (symphony_*, without the model's name), read from the engine and the process table at each scrape: processes
by state, batches, sequences, tokens, forward time, KV pages by use, KV files, evictions, /v1
totals, and symphony_pred_queue_wait_seconds, a histogram of each pred's wait for a batch (every
program's and every request's: the level-2 queue).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ..engine.loop import QUEUE_WAIT_BUCKETS_S, Engine
from ..lip.process import ProcessState


# vLLM's buckets (vllm/v1/metrics/loggers.py), in seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST
OPENAI, PROCESS = "openai", "process"


@dataclass
class CompletionCounters:
    """Totals over the OpenAI path (symphony_completion_*)."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


class RequestTimer:
    """One request's (or process's) times, observed as they happen: `token()` at each token
    (of `branch`), `finish(reason)` once."""

    __slots__ = ("metrics", "source", "started", "first_seen", "last", "finished", "_itl")

    def __init__(self, metrics: "ServerMetrics", source: str):
        self.metrics, self.source = metrics, source
        self.started = time.monotonic()
        self.first_seen = False
        self.last: dict[int, float] = {}  # branch -> the time of its last token
        self.finished = False
        self._itl = metrics.itl.labels(metrics.model_name, source)  # found once, observed every token

    def token(self, branch: int = 0) -> None:
        now = time.monotonic()
        if not self.first_seen:
            self.first_seen = True
            metrics = self.metrics
            metrics.ttft.labels(metrics.model_name, self.source).observe(now - self.started)
        previous = self.last.get(branch)
        if previous is not None:
            self._itl.observe(now - previous)
        self.last[branch] = now

    def finish(self, reason: str) -> None:
        if self.finished:
            return
        self.finished = True
        metrics = self.metrics
        metrics.e2e.labels(metrics.model_name, self.source).observe(time.monotonic() - self.started)
        metrics.finished.labels(metrics.model_name, self.source, reason).inc()


class ServerMetrics:
    """The app's metrics: the request ones observed by the OpenAI routes and the process table,
    the engine's and the table's read at each scrape (`render`)."""

    def __init__(self, model_name: str, engine: Engine, completions: CompletionCounters, table: Any = None):
        """`table`: the server's process_table.ProcessTable (set once made), for processes by state."""
        self.model_name, self.engine, self.completions, self.table = model_name, engine, completions, table
        self.started_at = time.time()
        self.registry = CollectorRegistry()
        labels = ["model_name", "source"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to the first token (a process: to its "
                              "first output).", labels, buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between a branch's tokens (a process: "
                             "between its outputs).", labels, buckets=ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Time from arrival to the end.", labels,
                             buckets=E2E_BUCKETS, registry=self.registry)
        self.finished = Counter("vllm:request_success", "Requests and processes ended, by how.",
                                [*labels, "finished_reason"], registry=self.registry)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of /v1 requests.", ["model_name"],
                                     registry=self.registry)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated for /v1 requests.",
                                         ["model_name"], registry=self.registry)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens of /v1 requests looked up in "
                                      "the prefix cache.", ["model_name"], registry=self.registry)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Of those, the tokens found (reused).", ["model_name"],
                                   registry=self.registry)
        self.registry.register(_ScrapeTime(self))

    def request(self, source: str) -> RequestTimer:
        return RequestTimer(self, source)

    def prompt(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens.labels(self.model_name).inc(prompt_tokens)
        self.prefix_queries.labels(self.model_name).inc(prompt_tokens)
        self.prefix_hits.labels(self.model_name).inc(cached_tokens)

    def generated(self, tokens: int = 1) -> None:
        self.generation_tokens.labels(self.model_name).inc(tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ScrapeTime:
    """The metrics read from the engine and the process table when scraped."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self):
        metrics = self.metrics
        engine, model = metrics.engine, [metrics.model_name]
        stats, pool = engine.stats(), engine.pool.stats()

        def gauge(name: str, help_text: str, labels=()):
            """A gauge family and its add(label values, value); vLLM's carry the model's name."""
            named = name.startswith("vllm:")
            family = GaugeMetricFamily(name, help_text, labels=["model_name", *labels] if named else list(labels))
            return family, (lambda label_values, v: family.add_metric([*(model if named else ()), *label_values], v))

        def counter(name: str, help_text: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, help_text, labels=[])
            family.add_metric([], value)
            return family

        usage, add = gauge("vllm:kv_cache_usage_perc", "KV pool pages in use, as a fraction (1: full).")
        add([], pool.used / pool.total if pool.total else 0.0)
        yield usage
        waiting, add = gauge("vllm:num_requests_waiting", "Preds queued for a batch.")
        add([], len(engine.scheduler))
        yield waiting
        if metrics.table is not None:
            by_state = metrics.table.counts_by_state()
            processes, add = gauge("symphony_processes", "Processes the server remembers, by state.",
                                   ["state"])
            for state in ProcessState:
                add([state.value], by_state.get(state.value, 0))
            yield processes
        yield counter("symphony_batches", "Forward passes run.", stats.batches)
        yield counter("symphony_batch_sequences", "Sequences over all batches.", stats.sequences)
        yield counter("symphony_tokens", "Tokens through the model (prefill and decode).", stats.tokens)
        yield counter("symphony_forward_seconds", "Time in forward passes.", stats.forward_s)
        pages, add = gauge("symphony_kv_pages", "KV pool pages by use.", ["kind"])
        for kind in ("total", "used", "shared", "swapped", "free"):
            add([kind], getattr(pool, kind))
        yield pages
        files, add = gauge("symphony_kv_files", "KV files alive.")
        add([], engine.kvfs.file_count)
        yield files
        yield counter("symphony_kv_evicted_files", "Named KV files evicted under memory pressure.",
                      engine.kvfs.evicted_files)
        queue = HistogramMetricFamily("symphony_pred_queue_wait_seconds", "Each pred's wait for a batch.",
                                      labels=[])
        cumulative, buckets = 0, []
        for bound, count in zip((*map(str, QUEUE_WAIT_BUCKETS_S), "+Inf"), stats.queue_wait_counts):
            cumulative += count
            buckets.append((bound, cumulative))
        queue.add_metric([], buckets, sum_value=stats.queue_wait_s)
        yield queue
        uptime, add = gauge("symphony_uptime_seconds", "Seconds since the server started.")
        add([], time.time() - metrics.started_at)
        yield uptime
        mean, add = gauge("symphony_batch_size_mean", "Mean sequences per batch since start.")
        add([], stats.mean_batch_size)
        yield mean
        completions = metrics.completions
        yield counter("symphony_completion_requests", "/v1 requests started.", completions.requests)
        yield counter("symphony_completion_prompt_tokens", "Prompt tokens of /v1 requests.", completions.prompt_tokens)
        yield counter("symphony_completion_tokens", "Tokens generated for /v1 requests.", completions.completion_tokens)
        yield counter("symphony_completion_cached_tokens", "Prompt tokens of /v1 requests reused from the prefix "
                      "cache.", completions.cached_tokens)
