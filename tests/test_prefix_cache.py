"""Prefix caching: a prompt that begins with a finished row's tokens starts from their keys and values (the same
tokens and logprobs as a full prefill); the store is bounded and least-recently-used entries leave first; the
server's second chat turn reuses the first's columns."""

from __future__ import annotations

import pytest
import torch
from fastapi.testclient import TestClient
from test_server_harness import tiny_served_model

import lmhead.prefix_cache as P
from lmhead.decode.rows import prepare
from lmhead.generate import Batch
from lmhead.prefix_cache import PrefixCache
from lmhead.sampling import SamplingConfig
from lmhead.server import create_app

FIRST = "the cat and the dog went to the market to buy bread and milk and then"


@pytest.fixture(scope="module")
def model():
    return tiny_served_model()


def _run(model, prompt, n, config, cache=None):
    batch = Batch(model, prefix_cache=cache)
    batch.add(prepare(model, prompt, n, config))
    out = []
    while batch.rows:
        out += [step for _, step in batch.step()]
    return out


@pytest.mark.parametrize("config", [SamplingConfig(temperature=0), SamplingConfig(temperature=0.8, top_k=30, seed=7)])
def test_a_prompt_that_begins_with_a_cached_prefix_gives_what_a_full_prefill_gives(model, config):
    cache = PrefixCache()
    first = _run(model, FIRST, 10, config, cache)
    assert len(cache) == 1
    second_prompt = FIRST + "".join(s.text for s in first) + " and the bird"
    got = _run(model, second_prompt, 12, config, cache)
    want = _run(model, second_prompt, 12, config)
    assert cache.hits == 1 and cache.reused >= P.MIN_TOKENS
    assert [s.token_id for s in got] == [s.token_id for s in want]
    assert [s.raw_logprob for s in got] == pytest.approx([s.raw_logprob for s in want], abs=1e-5)
    assert [s.logprob for s in got] == pytest.approx([s.logprob for s in want], abs=1e-5)


def test_a_prompt_sharing_too_little_prefills_whole(model):
    cache = PrefixCache()
    _run(model, FIRST, 4, SamplingConfig(temperature=0), cache)
    _run(model, "a different start " * 3, 4, SamplingConfig(temperature=0), cache)
    assert cache.hits == 0


def test_the_store_is_bounded_and_evicts_the_least_recently_used():
    def kv(n):
        return torch.zeros(2, 1, n, 4), torch.zeros(2, 1, n, 4)

    one = 2 * 2 * 1 * 20 * 4 * 4  # bytes of an entry of 20 columns
    cache = PrefixCache(max_bytes=2 * one)
    a, b, c = ([i] * 20 for i in (1, 2, 3))
    cache.put(a, *kv(20))
    cache.put(b, *kv(20))
    assert cache.match(a + [9])[0] == 20  # a is now the most recently used
    cache.put(c, *kv(20))
    assert cache.bytes <= 2 * one and len(cache) == 2
    assert cache.match(b) is None and cache.match(a)[0] == 20 and cache.match(c)[0] == 20
    cache.put(a + [5] * 10, *kv(30))  # a longer entry replaces the one it begins with
    assert cache.match(a)[1].shape[2] == 30


def test_a_chats_next_turn_reuses_the_previous_turns_columns(model):
    turn1 = [{"role": "user", "content": "tell me about the cat and the dog and the market please"}]
    body = {"temperature": 0, "max_tokens": 8}
    with TestClient(create_app(model)) as client:
        a = client.post("/v1/chat/completions", json={"messages": turn1, **body}).json()
        turn2 = [*turn1, {"role": "assistant", "content": a["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "and the bird?"}]
        b = client.post("/v1/chat/completions", json={"messages": turn2, **body}).json()
        runner = client.app.state.runner
        assert runner.prefix_cache.hits >= 1 and runner.prefix_cache.reused >= P.MIN_TOKENS
    with TestClient(create_app(model)) as fresh:
        want = fresh.post("/v1/chat/completions", json={"messages": turn2, **body}).json()
        assert fresh.app.state.runner.prefix_cache.hits == 0
    assert b["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
