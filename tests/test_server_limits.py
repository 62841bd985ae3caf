"""The server's limits from the model (server/limits.py): `serve_limits`' checks, KV memory admitted before a
request joins (it waits its turn), a full queue answered 503 with Retry-After, and the context's bounds in
`/api/model`-independent routes."""

from __future__ import annotations

import asyncio

import pytest
from fastapi.testclient import TestClient

from lmhead.decode.rows import prepare_ids
from lmhead.sampling import SamplingConfig
from lmhead.server import create_app
from lmhead.server.limits import ServeLimits, column_bytes, serve_limits
from lmhead.server.runner import ModelRunner, QueueFull


def test_serve_limits_default_to_the_models_context(model):
    limits = serve_limits(model, kv_memory=1 << 30)
    assert limits.context == model.context_length and limits.max_tokens == model.context_length - 1
    assert limits.column_bytes == column_bytes(model) > 0


@pytest.mark.parametrize("kwargs,option", [
    ({"ctx_size": 10_000}, "--ctx-size"), ({"ctx_size": 0}, "--ctx-size"), ({"ctx_size": 1}, "--ctx-size"),
    ({"ctx_size": 64, "max_tokens": 64}, "--max-tokens"), ({"parallel": 0}, "--parallel"),
    ({"queue": -1}, "--queue"), ({"kv_memory": 1000}, "--ctx-size"), ({"kv_memory": 0}, "--kv-memory"),
])
def test_a_bad_limit_is_a_value_error_naming_the_option(model, kwargs, option):
    with pytest.raises(ValueError, match=option):
        serve_limits(model, **{"kv_memory": 1 << 30, **kwargs})


def test_a_lower_ctx_size_bounds_prompt_and_max_tokens(model):
    app = create_app(model, serve=serve_limits(model, ctx_size=32, max_tokens=8, kv_memory=1 << 30))
    with TestClient(app) as client:
        ids = model.encode("The cat sat on the")
        r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 32 - len(ids) + 1})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert "32 tokens" in r.json()["error"]["message"]
        r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 9})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens" and "--max-tokens" in r.text
        r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                      "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 8  # the default: --max-tokens


def test_a_request_that_cannot_fit_the_kv_memory_alone_is_400_naming_n(model):
    limits = serve_limits(model, ctx_size=64, kv_memory=1 << 30)
    tight = ServeLimits(64, 63, 8, limits.batch_kv_bytes(2, 64), 8, limits.column_bytes)
    with TestClient(create_app(model, serve=tight)) as client:
        r = client.post("/v1/completions", json={"prompt": "hi", "n": 3, "max_tokens": 60})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "GiB" in r.text


def _runner(model, rows_that_fit: int, queue: int) -> ModelRunner:
    col = column_bytes(model)
    probe = ServeLimits(64, 63, 8, 0, queue, col)
    return ModelRunner(model, limits=ServeLimits(64, 63, 8, probe.batch_kv_bytes(rows_that_fit, 60), queue, col))


def _gen(runner, model, n=40):
    ids = model.encode("The cat sat")
    return runner.generate([ids], n, prepare_rows=prepare_ids, config=SamplingConfig(temperature=0),
                           ignore_eos=True, size=(1, len(ids) + n))


def test_a_request_waits_for_kv_memory_instead_of_joining(model):
    runner = _runner(model, rows_that_fit=1, queue=8)

    async def main():
        first, second = _gen(runner, model), _gen(runner, model)
        a, b = await asyncio.gather(runner.collect(first), runner.collect(second))
        return a, b

    a, b = asyncio.run(main())
    assert [s.token_id for s in a] == [s.token_id for s in b] and len(a) == 40  # never shortened
    assert runner.max_live == 1  # the second waited for the first to finish

    runner = _runner(model, rows_that_fit=2, queue=8)

    async def both():
        return await asyncio.gather(runner.collect(_gen(runner, model)), runner.collect(_gen(runner, model)))

    asyncio.run(both())
    assert runner.max_live == 2


def test_past_the_queue_bound_a_request_is_refused_at_once(model):
    runner = _runner(model, rows_that_fit=1, queue=1)

    async def main():
        first = _gen(runner, model, 200)
        await first.__anext__()  # live: it holds the KV memory
        second = _gen(runner, model)  # waits for room
        with pytest.raises(QueueFull):
            _gen(runner, model)
        await first.aclose()
        return await runner.collect(second)

    assert len(asyncio.run(main())) == 40


def test_a_full_queue_is_a_503_with_retry_after(model, monkeypatch):
    app = create_app(model, serve=serve_limits(model, kv_memory=1 << 30, queue=0))
    runner = app.state.runner

    def full(*args, **kwargs):
        raise QueueFull("1 requests are waiting for room; the limit is 0")

    monkeypatch.setattr(runner, "generate", full)
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "server_busy"


def test_api_model_reports_the_served_limits(model):
    limits = serve_limits(model, ctx_size=64, max_tokens=8, parallel=3, kv_memory=1 << 30, queue=5)
    with TestClient(create_app(model, serve=limits)) as client:
        v1 = client.get("/api/model").json()["limits"]["v1"]
    assert v1 == {"context": 64, "max_tokens": 8, "parallel": 3, "kv_bytes": 1 << 30, "queue": 5,
                  "prompt_chars": 20_000}
