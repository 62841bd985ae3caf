"""GET /metrics: the server's figures in Prometheus' text format (as vLLM's and llama-server's `--metrics`).

    lmhead:num_requests_running             requests with rows in the batch (gauge)
    lmhead:num_requests_waiting             requests waiting for room (gauge)
    lmhead:prompt_tokens_total              prompt tokens of the rows admitted (counter)
    lmhead:prefill_tokens_total             of those, positions computed: not found in the prefix cache (counter)
    lmhead:generation_tokens_total          tokens generated (counter)
    lmhead:request_success_total            requests whose rows all finished (counter)
    lmhead:time_to_first_token_seconds      from a request's arrival to its first token (histogram)
    lmhead:time_per_output_token_seconds    between a request's later tokens (histogram)
    lmhead:kv_cache_bytes                   the live rows' KV cache (gauge)
    lmhead:kv_cache_usage_perc              that, as a fraction of the served KV memory (`--kv-memory`) (gauge)
    lmhead:prefix_cache_bytes / _blocks     the prefix cache's blocks (gauges)
    lmhead:prefix_cache_queries_total       prompt tokens looked up in the prefix cache (counter)
    lmhead:prefix_cache_hits_total          of those, tokens found (their prefill skipped) (counter)
    lmhead:prefix_cache_stored_total / _evicted_total   blocks that entered / left for room (counters)

Each app has a registry of its own (`ServerMetrics.registry`): the counters and gauges are read from the runner
and its prefix cache when scraped; the histograms are filled by the runner as tokens are handed out.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["ServerMetrics", "router"]

router = APIRouter(tags=["monitoring"])

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class _RunnerCollector(Collector):
    """The runner's counters and gauges, read at each scrape."""

    def __init__(self, runner: Any, model_name: str) -> None:
        self.runner, self.labels = runner, {"model_name": model_name}

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=list(self.labels))
        g.add_metric(list(self.labels.values()), value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=list(self.labels))
        c.add_metric(list(self.labels.values()), value)
        return c

    def collect(self) -> Iterator[Metric]:
        r = self.runner
        running, waiting = r.load()
        yield self._gauge("lmhead:num_requests_running", "Requests with rows in the batch.", running)
        yield self._gauge("lmhead:num_requests_waiting", "Requests waiting for room in the batch.", waiting)
        yield self._counter("lmhead:prompt_tokens", "Prompt tokens of the rows admitted.", r.prompt_tokens)
        yield self._counter("lmhead:prefill_tokens", "Prompt positions computed (not found in the prefix cache).",
                            r.prefilled)
        yield self._counter("lmhead:generation_tokens", "Tokens generated.", r.tokens)
        yield self._counter("lmhead:request_success", "Requests whose rows all finished.", r.finished)
        yield self._counter("lmhead:requests_retired", "Rows retired because their client went away.", r.retired)
        kv = r.kv_bytes()
        yield self._gauge("lmhead:kv_cache_bytes", "Bytes of the live rows' KV cache.", kv)
        if r.limits is not None:
            yield self._gauge("lmhead:kv_cache_usage_perc", "The live rows' KV cache as a fraction of --kv-memory.",
                              kv / r.limits.kv_bytes)
        cache = r.prefix_cache
        yield self._gauge("lmhead:prefix_cache_bytes", "Bytes of the prefix cache's blocks.", cache.bytes)
        yield self._gauge("lmhead:prefix_cache_blocks", "Blocks in the prefix cache.", len(cache))
        yield self._counter("lmhead:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                            cache.query_tokens)
        yield self._counter("lmhead:prefix_cache_hits", "Prompt tokens found in the prefix cache.", cache.reused)
        yield self._counter("lmhead:prefix_cache_stored", "Blocks stored in the prefix cache.", cache.stored)
        yield self._counter("lmhead:prefix_cache_evicted", "Blocks that left the prefix cache for room.",
                            cache.evicted)


class ServerMetrics:
    """One app's metrics: `registry` (its own `CollectorRegistry`), the runner's figures and the two latency
    histograms, which the runner fills through `first_token` and `output_tokens`."""

    def __init__(self, runner: Any, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_RunnerCollector(runner, model_name))
        self.ttft = Histogram("lmhead:time_to_first_token_seconds", "Seconds from a request's arrival to its first "
                              "token.", ["model_name"], buckets=TTFT_BUCKETS, registry=self.registry
                              ).labels(model_name)
        self.tpot = Histogram("lmhead:time_per_output_token_seconds", "Seconds between a request's later tokens.",
                              ["model_name"], buckets=TPOT_BUCKETS, registry=self.registry).labels(model_name)
        runner.metrics = self

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def output_tokens(self, seconds: float, count: int) -> None:
        for _ in range(count):
            self.tpot.observe(seconds)

    def text(self) -> bytes:
        return generate_latest(self.registry)


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    """The app's metrics in Prometheus' text format."""
    return Response(request.app.state.metrics.text(), media_type=CONTENT_TYPE_LATEST)
