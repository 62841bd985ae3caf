"""The server's prefix cache: a client that hangs up after its first token leaves its prompt's blocks; concurrent
requests that share a beginning compute it once, as do the rows of n > 1; and 32 concurrent clients of mixed kinds
(greedy, seeded sampling, logprobs, n > 1, prefix hits) get, bit for bit, the answers the same requests get alone
from a server without a prefix cache."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from server_harness import ServerThread

from lmhead.generate import Batch
from lmhead.prefix_cache import BLOCK
from lmhead.server import create_app

SYSTEM = "the cat and the dog went to the market to buy bread and milk and then they went home " * 2
QUESTIONS = [" what did the cat buy?", " where is the market?", " who went home first?", " and the bird?",
             " why milk?", " when did they go?", " how far is it?", " was it raining?"]


def _ids(model, text: str) -> list[int]:
    return model.encode(text)


async def _post(http: httpx.AsyncClient, body: dict) -> dict:
    r = await http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_client_that_hangs_up_after_its_first_token_leaves_its_prompts_blocks(model, monkeypatch):
    step = Batch.step

    def slow_step(self):  # a model slow enough that the hang-up comes long before the last token
        time.sleep(0.02)
        return step(self)

    monkeypatch.setattr(Batch, "step", slow_step)
    app = create_app(model)
    runner = app.state.runner
    prompt = SYSTEM + QUESTIONS[0]
    with ServerThread(app) as s:
        with httpx.Client(base_url=s.url, timeout=60) as http:
            body = {"prompt": prompt, "max_tokens": 120, "temperature": 0, "ignore_eos": True, "stream": True}
            with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data:") and json.loads(line[5:])["choices"]:
                        break  # the first token: the client goes away
            for _ in range(200):
                if runner.retired:
                    break
                time.sleep(0.05)
            assert runner.retired == 1
            ids = _ids(model, prompt)
            assert runner.prefix_cache.cached(ids) == (len(ids) - 1) // BLOCK * BLOCK > 0
            before = runner.prefilled
            longer = prompt + " and then?"
            r = http.post("/v1/completions", json={"prompt": longer, "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200
            assert runner.prefilled - before == len(_ids(model, longer)) - 1 - (len(ids) - 1) // BLOCK * BLOCK


def test_eight_concurrent_requests_sharing_a_prefix_compute_it_once(model):
    app = create_app(model)
    runner = app.state.runner
    prompts = [SYSTEM + q for q in QUESTIONS]
    lengths = [len(_ids(model, p)) for p in prompts]
    common = len(_ids(model, SYSTEM))

    async def run() -> None:
        async with httpx.AsyncClient(base_url=s.url, timeout=120) as http:
            await asyncio.gather(*(_post(http, {"prompt": p, "max_tokens": 4, "temperature": 0}) for p in prompts))

    with ServerThread(app) as s:
        asyncio.run(run())
    assert runner.prefix_cache.hits >= 7
    # the prefix once (one request alone or a lead), and each request's own tokens (those after the last block
    # of the beginning it shares)
    assert runner.prefilled <= common + sum(n - 1 - (common // BLOCK) * BLOCK for n in lengths)
    assert runner.prefilled <= sum(n - 1 for n in lengths) - 7 * (common // BLOCK) * BLOCK  # a cold prefill's less


def test_the_rows_of_n_share_their_prompt(model):
    prompt = SYSTEM + QUESTIONS[1]
    n_ids = len(_ids(model, prompt))
    with TestClient(create_app(model)) as client:
        r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "n": 4, "temperature": 0.7,
                                                 "seed": 3})
        assert r.status_code == 200
        runner = client.app.state.runner
        assert runner.prefilled <= n_ids - 1 + 4 * BLOCK  # the prompt's blocks once, each row its tail


def _mixed(i: int) -> dict:
    """The i-th of 32 requests: every kind of row, and prompts sharing a beginning (prefix hits)."""
    prompt = (SYSTEM if i % 3 else "") + QUESTIONS[i % len(QUESTIONS)] + (" please" * (i % 4))
    body = {"prompt": prompt, "max_tokens": 6 + i % 5, "ignore_eos": True}
    kind = i % 4
    if kind == 0:
        body |= {"temperature": 0}
    elif kind == 1:
        body |= {"temperature": 0.9, "top_k": 40, "seed": 100 + i}
    elif kind == 2:
        body |= {"temperature": 0, "logprobs": 3}
    else:
        body |= {"temperature": 0.8, "top_p": 0.9, "seed": 7 + i, "n": 2, "logprobs": 1}
    return body


def _together_and_alone(model) -> tuple[list[dict], list[dict], list[dict], object]:
    """The 32 `_mixed` requests sent at once to a server with a prefix cache, and one by one to a server without:
    (bodies, their answers together, alone, the busy server's runner)."""
    bodies = [_mixed(i) for i in range(32)]

    async def together(url: str) -> list[dict]:
        async with httpx.AsyncClient(base_url=url, timeout=300, limits=httpx.Limits(max_connections=40)) as http:
            return await asyncio.gather(*(_post(http, b) for b in bodies))

    async def alone(url: str) -> list[dict]:
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:
            return [await _post(http, b) for b in bodies]

    busy = create_app(model)
    with ServerThread(busy) as s:
        got = asyncio.run(together(s.url))
    with ServerThread(create_app(model, prefix_cache_bytes=0)) as s:
        want = asyncio.run(alone(s.url))
    return bodies, got, want, busy.state.runner


def test_thirty_two_concurrent_clients_of_mixed_kinds_get_bit_for_bit_what_each_request_gets_alone(tmp_path,
                                                                                                  monkeypatch):
    # a GGUF file's model, its products in the kernels (each row's sums in one order whatever the rows beside it):
    # tokens, finish reasons and logprobs equal, not close
    from tiny_gguf import write_tiny_gguf

    from lmhead import load_model

    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path / "cache"))
    model = load_model(str(write_tiny_gguf(tmp_path / "m.gguf", "llama", kind="Q8_0")), progress=False)
    bodies, got, want, runner = _together_and_alone(model)
    assert runner.prefix_cache.hits > 0 and runner.max_live > 1
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert [(c["text"], c["finish_reason"], c.get("logprobs")) for c in a["choices"]] == \
            [(c["text"], c["finish_reason"], c.get("logprobs")) for c in b["choices"]], f"request {i}: {bodies[i]}"


def test_thirty_two_concurrent_clients_of_a_torch_model_get_bit_for_bit_what_each_request_gets_alone(model):
    # a transformers model's float32 weights: its products in the kernel's float32 product over the same weights
    # (`Model.use_dense`), each row summed in one order whatever the rows beside it, as a GGUF file's codes are
    if not model.use_dense():
        pytest.skip("the kernels are not built here: torch's products sum a row by the number of rows")
    bodies, got, want, runner = _together_and_alone(model)
    assert runner.prefix_cache.hits > 0 and runner.max_live > 1
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert [(c["text"], c["finish_reason"], c.get("logprobs")) for c in a["choices"]] == \
            [(c["text"], c["finish_reason"], c.get("logprobs")) for c in b["choices"]], f"request {i}: {bodies[i]}"


def test_requests_sent_alone_get_bit_for_bit_the_answers_of_a_server_without_a_prefix_cache(model):
    bodies = [_mixed(i) for i in range(12)]

    async def alone(url: str) -> list[dict]:
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:
            return [await _post(http, b) for b in bodies]

    cached = create_app(model)
    with ServerThread(cached) as s:
        got = asyncio.run(alone(s.url))
    assert cached.state.runner.prefix_cache.reused > 0
    with ServerThread(create_app(model, prefix_cache_bytes=0)) as s:
        want = asyncio.run(alone(s.url))
    assert [r["choices"] for r in got] == [r["choices"] for r in want]
