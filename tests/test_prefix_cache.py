"""Prefix caching by blocks: a block is keyed by every token up to its end; a prompt takes the longest run of stored
blocks at its start and prefills the rest, with the same tokens and logprobs as a full prefill; blocks enter the
store as prefill pieces compute them and when rows leave; rows of one join that share a beginning compute it once;
the store is bounded and its least recently used blocks leave first, a run's last blocks before its first."""

from __future__ import annotations

import pytest
import torch
from fastapi.testclient import TestClient

import lmhead.prefix_cache as P
from lmhead.decode.rows import prepare, prepare_ids
from lmhead.generate import Batch
from lmhead.prefix_cache import PrefixCache
from lmhead.sampling import SamplingConfig
from lmhead.server import create_app

FIRST = "the cat and the dog went to the market to buy bread and milk and then " * 3
B = P.BLOCK


def _run(model, prompt, n, config, cache=None, rows=None):
    batch = Batch(model, prefix_cache=cache)
    batch.add(rows if rows is not None else prepare(model, prompt, n, config))
    out = []
    while batch.rows:
        out += [step for _, step in batch.step()]
    return out, batch


def _kv(n: int, fill: float = 0.0):
    return torch.full((2, 1, n, 4), fill), torch.full((2, 1, n, 4), fill)


# --- the store ----------------------------------------------------------------------------------------------


def test_a_blocks_key_depends_on_every_token_up_to_its_end():
    cache = PrefixCache(block=4)
    a = cache.chain([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert len(a) == 2  # full blocks only
    assert cache.chain([1, 2, 3, 4, 5, 6, 7, 8]) == a
    b = cache.chain([0, 2, 3, 4, 5, 6, 7, 8])
    assert b[0] != a[0] and b[1] != a[1]  # the second block's tokens are equal, what comes before is not
    assert cache.chain([1, 2, 3, 4, 5, 6, 7, 0])[0] == a[0]


def test_the_longest_run_of_stored_blocks_is_found_and_its_columns_returned():
    cache = PrefixCache(block=4)
    tokens = list(range(10, 22))  # three blocks
    keys = torch.arange(2 * 1 * 12 * 4, dtype=torch.float32).reshape(2, 1, 12, 4)
    assert cache.put(tokens, keys, -keys) == 3 and len(cache) == 3
    assert cache.put(tokens[:8], keys, -keys) == 0  # stored already
    m, k, v = cache.match(tokens[:9] + [99, 98, 97])
    assert m == 8 and torch.equal(k, keys[:, :, :8]) and torch.equal(v, -keys[:, :, :8])
    assert cache.match([5] + tokens[1:]) is None
    assert cache.match(tokens[:3]) is None  # no full block
    assert (cache.queries, cache.hits, cache.reused, cache.query_tokens) == (3, 1, 8, 12 + 12 + 3)
    assert cache.cached(tokens + [1]) == 12


def test_the_store_stays_within_its_bound_and_evicts_the_least_recently_used_runs_last_blocks_first():
    one = 2 * 2 * 1 * 4 * 4 * 4  # bytes of a block of 4 columns (keys and values)
    cache = PrefixCache(max_bytes=5 * one, block=4)
    a, b = list(range(100, 112)), list(range(200, 212))  # three blocks each
    cache.put(a, *_kv(12))
    cache.put(b, *_kv(12))
    assert cache.bytes <= 5 * one and len(cache) == 5 and cache.evicted == 1
    assert cache.cached(a) == 8  # a's last block left first: its first two still make a run
    assert cache.match(a)[0] == 8  # a is now the most recently used
    cache.put(list(range(300, 308)), *_kv(8))
    assert cache.bytes <= 5 * one and cache.evicted == 3
    assert cache.cached(b) == 4 and cache.cached(a) == 8  # b's last blocks went, not a's
    assert PrefixCache(max_bytes=one - 1, block=4).put(a, *_kv(12)) == 0  # a block over the bound is not kept


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_a_bad_bound_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match="max_bytes"):
        PrefixCache(max_bytes=bad)


# --- the engine ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", [SamplingConfig(temperature=0), SamplingConfig(temperature=0.8, top_k=30, seed=7)])
def test_a_prompt_that_begins_with_stored_blocks_gives_what_a_full_prefill_gives(model, config):
    cache = PrefixCache()
    first, _ = _run(model, FIRST, 10, config, cache)
    assert len(cache) >= 2
    second_prompt = FIRST + "".join(s.text for s in first) + " and the bird"
    got, batch = _run(model, second_prompt, 12, config, cache)
    want, cold = _run(model, second_prompt, 12, config)
    assert cache.hits >= 1 and cache.reused >= 2 * B
    assert batch.prefilled <= cold.prefilled - 2 * B
    assert [s.token_id for s in got] == [s.token_id for s in want]
    assert [s.raw_logprob for s in got] == pytest.approx([s.raw_logprob for s in want], abs=1e-5)
    assert [s.logprob for s in got] == pytest.approx([s.logprob for s in want], abs=1e-5)


def test_a_prompt_sharing_less_than_a_block_prefills_whole(model):
    cache = PrefixCache()
    _run(model, FIRST, 4, SamplingConfig(temperature=0), cache)
    _, batch = _run(model, "a different start " * 3, 4, SamplingConfig(temperature=0), cache)
    assert cache.hits == 0 and batch.prefilled == len(model.encode("a different start " * 3)) - 1


def test_a_prompts_blocks_are_stored_as_its_prefill_computes_them(model):
    cache = PrefixCache()
    ids = model.encode(FIRST)
    batch = Batch(model, prefix_cache=cache)
    batch.add(prepare_ids(model, [ids], 1, SamplingConfig(temperature=0)))  # no step: the row never finishes
    assert cache.cached(ids) == (len(ids) - 1) // B * B > 0


def test_rows_of_a_prompt_list_and_of_n_share_their_common_beginning_computed_once(model):
    cache = PrefixCache()
    config = SamplingConfig(temperature=0)
    common = model.encode(FIRST)[:3 * B]
    tails = [model.encode(" and the bird flew away"), model.encode(" so"), model.encode(" then they sat down")]
    prompts = [common + t for t in tails] + [common + tails[0]]  # the last: the first one again (n > 1)
    rows = prepare_ids(model, prompts, 6, config)
    got, batch = _run(model, None, 6, config, cache, rows)
    assert batch.prefilled <= 3 * B + sum(len(t) for t in tails) + len(tails[0])  # the beginning once
    for i, ids in enumerate(prompts):
        want, _ = _run(model, None, 6, config, rows=prepare_ids(model, [ids], 6, config))
        mine = [s for s in got if s.index == i]
        assert [s.token_id for s in mine] == [s.token_id for s in want]
        assert [s.raw_logprob for s in mine] == pytest.approx([s.raw_logprob for s in want], abs=1e-5)


def test_a_row_joining_a_running_batch_starts_from_the_stored_blocks(model):
    cache = PrefixCache()
    config = SamplingConfig(temperature=0)
    ids = model.encode(FIRST)
    _run(model, None, 2, config, cache, prepare_ids(model, [ids[:3 * B + 5]], 2, config))
    batch = Batch(model, prefix_cache=cache)
    batch.add(prepare_ids(model, [model.encode("once upon a time")], 20, config))
    before = batch.prefilled
    joining = prepare_ids(model, [ids], 8, config)
    batch.begin_join(joining)
    while batch.prefill():
        pass
    assert batch.prefilled - before == len(ids) - 1 - 3 * B
    got = []
    while batch.rows:
        got += [s for r, s in batch.step() if r is joining[0]]
    want, _ = _run(model, None, 8, config, rows=prepare_ids(model, [ids], 8, config))
    assert [s.token_id for s in got] == [s.token_id for s in want]
    assert [s.raw_logprob for s in got] == pytest.approx([s.raw_logprob for s in want], abs=1e-5)


def test_a_retired_row_leaves_its_blocks(model):
    cache = PrefixCache()
    config = SamplingConfig(temperature=0)
    ids = model.encode(FIRST)[:2 * B - 3]
    batch = Batch(model, prefix_cache=cache)
    rows = prepare_ids(model, [ids], 40, config)
    batch.add(rows)
    for _ in range(6):
        batch.step()
    fed = ids + rows[0].generated[:-1]  # the columns it holds: its prompt and the tokens it fed
    assert cache.cached(fed) == B  # its prompt's one full block
    batch.remove(rows)  # its client hung up
    assert cache.cached(fed) == len(fed) // B * B == 2 * B


# --- the server ---------------------------------------------------------------------------------------------


def test_a_chats_next_turn_reuses_the_previous_turns_columns(model):
    turn1 = [{"role": "user", "content": "tell me about the cat and the dog and the market please " * 3}]
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


# --- the file -----------------------------------------------------------------------------------------------

IDENT = {"lmhead": "0.1.0", "model": "tiny", "layers": 2}


def _filled() -> PrefixCache:
    cache = PrefixCache(block=4)
    keys = torch.arange(2 * 1 * 12 * 4, dtype=torch.float32).reshape(2, 1, 12, 4)
    cache.put(list(range(10, 22)), keys, -keys)
    cache.put(list(range(50, 58)), keys[:, :, :8] + 1, keys[:, :, :8] - 1)
    return cache


def test_a_saved_store_loads_with_its_blocks_and_their_order(tmp_path):
    cache = _filled()
    cache.match(list(range(10, 22)))  # the first run is now the most recently used
    path = tmp_path / "prefix.pt"
    cache.save(path, IDENT)
    assert [p.name for p in tmp_path.iterdir()] == ["prefix.pt"]  # no temporary file left
    back = PrefixCache(block=4)
    assert back.load(path, IDENT) is None
    assert len(back) == len(cache) and back.bytes == cache.bytes
    m, k, v = back.match(list(range(10, 22)))
    want = cache.match(list(range(10, 22)))
    assert m == 12 and torch.equal(k, want[1]) and torch.equal(v, want[2])
    small = PrefixCache(max_bytes=3 * 2 * 2 * 4 * 4 * 4, block=4)  # room for three blocks: the most recent run
    assert small.load(path, IDENT) is None and small.cached(list(range(10, 22))) == 12 and len(small) == 3
    assert PrefixCache(block=4).load(tmp_path / "none.pt", IDENT) is None  # no file yet: an empty start


def test_a_file_of_another_model_or_version_or_a_damaged_one_is_refused_and_never_used(tmp_path):
    path = tmp_path / "prefix.pt"
    _filled().save(path, IDENT)
    other = PrefixCache(block=4)
    assert other.load(path, {**IDENT, "model": "another"}) == "written for another model"
    assert other.load(path, {**IDENT, "lmhead": "9.9"}) == "written for another lmhead"
    assert len(other) == 0
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a flipped byte inside a block
    path.write_bytes(bytes(data))
    why = other.load(path, IDENT)
    assert why is not None and "damaged" in why and len(other) == 0
    path.write_bytes(b"not a file of ours")
    assert "damaged" in other.load(path, IDENT) and len(other) == 0


def test_the_server_keeps_its_prefix_cache_across_a_restart(model, tmp_path):
    from lmhead.server.prefix_file import keep_prefix_cache

    path = tmp_path / "prefix.pt"
    body = {"prompt": FIRST, "max_tokens": 2, "temperature": 0}
    app = create_app(model)
    assert keep_prefix_cache(app, path) is None
    with TestClient(app) as client:
        assert client.post("/v1/completions", json=body).status_code == 200
    assert path.exists()  # written at shutdown
    again = create_app(model)
    assert keep_prefix_cache(again, path) is None and len(again.state.runner.prefix_cache) > 0
    with TestClient(again) as client:
        assert client.post("/v1/completions", json=body).status_code == 200
        assert again.state.runner.prefix_cache.hits == 1
    path.write_bytes(b"damaged")
    assert "damaged" in keep_prefix_cache(create_app(model), path)
