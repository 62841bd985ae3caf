"""The server's scheduler: concurrent completions share decode rounds and each gets its own answer; the
`exact_logprobs` extension returns the fp32 head's log-probabilities; explain calls run between rounds."""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest
from server_harness import ServerThread, tiny_served_model

from lmhead.generate import generate
from lmhead.models.heads import use_head
from lmhead.sampling import SamplingConfig
from lmhead.server import create_app

PROMPTS = ["The cat", "A dog ran", "Hello world, how", "Numbers 1 2 3", "x", "The head turns to", "Yes", "Okay so"]


@pytest.fixture(scope="module")
def served():
    model = use_head(tiny_served_model(), "exact-int8", cache=False)  # a head whose default logprobs are not exact
    app = create_app(model)
    with ServerThread(app) as server:
        yield model, app.state.runner, server.url


def body(i: int) -> dict:
    # exact logprobs: the int8 head's own differ by kernel (one row or several) within its error bound
    b = {"prompt": PROMPTS[i], "max_tokens": 12, "logprobs": 2, "exact_logprobs": True}
    return {**b, "temperature": 0} if i % 2 == 0 else {**b, "temperature": 0.9, "seed": 100 + i}


def test_concurrent_completions_share_rounds_and_each_gets_its_own_answer(served):
    model, runner, url = served
    with httpx.Client(base_url=url, timeout=60) as http:
        alone = [http.post("/v1/completions", json=body(i)).json() for i in range(len(PROMPTS))]
    rounds, tokens = runner.rounds, runner.tokens

    async def together():
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json=body(i)) for i in range(len(PROMPTS))))

    got = [r.json() for r in asyncio.run(together())]
    for a, b in zip(got, alone, strict=True):
        assert a["choices"][0]["text"] == b["choices"][0]["text"]
        assert a["choices"][0]["logprobs"]["tokens"] == b["choices"][0]["logprobs"]["tokens"]
        for x, y in zip(a["choices"][0]["logprobs"]["token_logprobs"], b["choices"][0]["logprobs"]["token_logprobs"],
                        strict=True):
            assert math.isclose(x, y, abs_tol=1e-5)
    assert runner.tokens - tokens == sum(a["usage"]["completion_tokens"] for a in got)
    assert runner.rounds - rounds < runner.tokens - tokens  # rows shared rounds


def test_exact_logprobs_are_the_fp32_heads(served):
    model, _, url = served
    req = {"prompt": "The cat sat", "max_tokens": 6, "temperature": 0.7, "seed": 4, "logprobs": 3}
    with httpx.Client(base_url=url, timeout=60) as http:
        exact = http.post("/v1/completions", json={**req, "exact_logprobs": True}).json()["choices"][0]
        default = http.post("/v1/completions", json=req).json()["choices"][0]
        chat = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0, "logprobs": True,
            "exact_logprobs": True}).json()
        bad = http.post("/v1/completions", json={**req, "exact_logprobs": "sometimes"})
    cfg = SamplingConfig(temperature=0.7, seed=4)
    want = [s.raw_logprob for s in generate(model, "The cat sat", 6, config=cfg, exact_logprobs=True)]
    assert exact["text"] == default["text"]
    assert exact["logprobs"]["token_logprobs"] == pytest.approx(want, abs=1e-5)
    assert max(abs(a - b) for a, b in zip(default["logprobs"]["token_logprobs"], want, strict=True)) > 1e-5
    assert chat["choices"][0]["logprobs"]["content"]
    assert bad.status_code == 422


def test_explain_calls_run_while_generations_decode(served):
    _, runner, url = served

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            long = [http.post("/v1/completions", json={"prompt": p, "max_tokens": 60, "temperature": 0})
                    for p in PROMPTS[:4]]
            predict = http.post("/api/predict", json={"prompt": "The cat", "top": 5})
            return await asyncio.gather(predict, *long)

    predict, *long = asyncio.run(main())
    assert predict.status_code == 200 and all(r.status_code == 200 for r in long)
    assert runner.max_live >= 2


def test_a_request_waits_for_the_models_thread_once_before_it_joins_the_batch(served):
    # while a batch decodes, each call through the runner waits for a round to end: a completion's checks are one
    # call (the prompt's tokens), a chat's one call too (its template and tokens); its sampling config is built
    # on the event loop
    _, runner, url = served
    with httpx.Client(base_url=url, timeout=60) as http:
        calls = runner.calls
        assert http.post("/v1/completions", json={"prompt": "The cat", "max_tokens": 2}).status_code == 200
        assert runner.calls - calls == 1
        calls = runner.calls
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "top_k": 5, "seed": 1}
        assert http.post("/v1/chat/completions", json=chat).status_code == 200
        assert runner.calls - calls == 1
        r = http.post("/v1/completions", json={"prompt": "The cat", "max_tokens": 2, "repetition_penalty": 1e308})
        assert r.status_code == 400 and "repetition_penalty" in r.text  # the config's own error, still a 400 naming it
