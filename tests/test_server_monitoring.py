"""/health answers 200 while the model can answer and 503 with a JSON reason when its scheduler has stopped;
/metrics is Prometheus' text format with the requests, tokens, latencies, KV memory and prefix-cache figures,
one registry per app."""

from __future__ import annotations

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from lmhead.server import create_app


def _samples(text: str) -> dict[str, float]:
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if not s.labels.get("le")}


def test_health_is_200_when_the_model_is_loaded_and_503_with_a_reason_after_the_scheduler_failed(model):
    with TestClient(create_app(model)) as client:
        ok = client.get("/health")
        assert ok.status_code == 200 and ok.json() == {"status": "ok"}
        client.post("/v1/completions", json={"prompt": "the cat", "max_tokens": 2, "temperature": 0})
        assert client.get("/health").status_code == 200
        client.app.state.runner.failed = RuntimeError("boom")  # what `_run` records when its loop dies
        bad = client.get("/health")
        assert bad.status_code == 503
        assert bad.json()["status"] == "error" and "boom" in bad.json()["error"]


def test_metrics_count_requests_tokens_latencies_and_prefix_cache_queries(model):
    with TestClient(create_app(model)) as client:
        before = _samples(client.get("/metrics").text)
        assert before["lmhead:generation_tokens_total"] == 0 and before["lmhead:num_requests_running"] == 0
        r = client.post("/v1/completions", json={"prompt": "the cat and the dog", "max_tokens": 5,
                                                 "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200
        page = client.get("/metrics")
        assert page.headers["content-type"].startswith("text/plain")
        after = _samples(page.text)
        usage = r.json()["usage"]
        assert after["lmhead:generation_tokens_total"] == usage["completion_tokens"] == 5
        assert after["lmhead:prompt_tokens_total"] == usage["prompt_tokens"]
        assert after["lmhead:request_success_total"] == 1
        assert after["lmhead:time_to_first_token_seconds_count"] == 1
        assert after["lmhead:time_per_output_token_seconds_count"] == 4
        assert after["lmhead:time_to_first_token_seconds_sum"] > 0
        assert after["lmhead:prefix_cache_queries_total"] > 0
        assert 0 < after["lmhead:prefill_tokens_total"] <= usage["prompt_tokens"]
        assert 0 <= after["lmhead:kv_cache_usage_perc"] <= 1
        for name in ("lmhead:num_requests_waiting", "lmhead:kv_cache_bytes", "lmhead:prefix_cache_bytes",
                     "lmhead:prefix_cache_hits_total"):
            assert name in after
    with TestClient(create_app(model)) as other:  # a registry of its own: nothing carried over
        assert _samples(other.get("/metrics").text)["lmhead:generation_tokens_total"] == 0
