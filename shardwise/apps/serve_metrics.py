"""Prometheus metrics of ``shardwise serve`` (``GET /metrics``, text exposition format).

Each app has a registry of its own (several servers can live in one process, as in the tests):

* ``shardwise_requests_total{endpoint, status}``: finished HTTP requests by path and status code
  (a streamed answer counts with the status it started with);
* ``shardwise_prompt_tokens_total`` / ``shardwise_generation_tokens_total``: tokens read and generated;
* ``shardwise_requests_running`` / ``shardwise_requests_waiting``: requests in the decoding batch and
  queued for it, read at scrape time;
* ``shardwise_time_to_first_token_seconds``: from submission to the first sampled token;
  ``shardwise_time_per_output_token_seconds``: the mean time between later tokens of a request;
  ``shardwise_request_latency_seconds``: submission to the last token (all histograms);
* ``shardwise_kv_cache_<field>``: each number of the engine's ``kv_cache_stats()`` (blocks total/used,
  bytes, prefix hits, ...) and ``shardwise_kv_cache_usage_ratio`` (used / total blocks, or bytes).
"""
from __future__ import annotations

import re
import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

__all__ = ["CONTENT_TYPE_LATEST", "CountRequests", "ServeMetrics"]

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


class _KvCacheCollector:
    """Reads the engine's KV cache statistics when Prometheus scrapes."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def describe(self):
        return []  # values are read at collect time; nothing to check at registration

    def collect(self):
        stats_of = getattr(self.engine, "kv_cache_stats", None)
        stats = stats_of() if stats_of is not None else {}
        for key, value in sorted(stats.items()):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            name = "shardwise_kv_cache_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)
            yield GaugeMetricFamily(name, f"KV cache: {key} (engine kv_cache_stats)", value=float(value))
        used, total = stats.get("blocks_used"), stats.get("blocks_total")
        if not total:
            used, total = stats.get("bytes_used"), stats.get("bytes_total")
        if total:
            yield GaugeMetricFamily("shardwise_kv_cache_usage_ratio", "KV cache in use, 0..1", value=used / total)


class ServeMetrics:
    def __init__(self, engine) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.requests = Counter("shardwise_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("shardwise_prompt_tokens", "prompt tokens of generation and scoring jobs",
                                     registry=r)
        self.generation_tokens = Counter("shardwise_generation_tokens", "tokens generated", registry=r)
        running = Gauge("shardwise_requests_running", "generation jobs in the decoding batch", registry=r)
        running.set_function(lambda: engine.running)
        waiting = Gauge("shardwise_requests_waiting", "generation jobs queued for the batch", registry=r)
        waiting.set_function(lambda: engine.waiting)
        self.ttft = Histogram("shardwise_time_to_first_token_seconds", "submission to first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("shardwise_time_per_output_token_seconds",
                              "mean time between the tokens after the first, per request", buckets=TPOT_BUCKETS,
                              registry=r)
        self.latency = Histogram("shardwise_request_latency_seconds", "submission to last token",
                                 buckets=LATENCY_BUCKETS, registry=r)
        r.register(_KvCacheCollector(engine))

    def watch(self, job) -> None:
        """Record ``job``'s tokens and latencies when it ends (its done callback, any thread)."""
        job.future.add_done_callback(lambda future: self._finished(job, future))

    def _finished(self, job, future) -> None:
        now = time.monotonic()
        if future.cancelled():
            return
        exc = future.exception()
        answer = getattr(exc, "answer", None) if exc is not None else future.result()
        self.prompt_tokens.inc(len(job.prompt_ids))
        if answer is None:
            return
        self.generation_tokens.inc(answer.completion_tokens)
        first = getattr(job, "first_token_at", None)
        self.latency.observe(max(0.0, now - job.submitted))
        if first is not None and answer.completion_tokens:
            self.ttft.observe(max(0.0, first - job.submitted))
            if answer.completion_tokens > 1:
                self.tpot.observe(max(0.0, now - first) / (answer.completion_tokens - 1))

    def scored(self, tokens: int) -> None:
        self.prompt_tokens.inc(tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)

class CountRequests:
    """ASGI middleware counting each HTTP response by path and status (``app.add_middleware``)."""

    def __init__(self, app, metrics: ServeMetrics) -> None:
        self.app = app
        self.counter = metrics.requests

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = {"code": None}

        async def send_and_count(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_count)
        finally:
            code = status["code"] or 499  # nothing was sent: the client went away first
            self.counter.labels(_endpoint(scope.get("path", "")), str(code)).inc()


_KNOWN = {"/", "/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize", "/health",
          "/ready", "/metrics"}


def _endpoint(path: str) -> str:
    """The path as a label; unknown paths fold into one value so a scanner cannot grow the series."""
    return path if path in _KNOWN else "other"
