"""Rows that begin with the prefix cache's blocks read them in place (`StaticCache.shared`: the same blocks for
every such row, never copied into its columns; the C attention reads a shared block once for all the queries of a
run): tokens and logprobs the same bits as with the blocks copied in and as each request alone; a shared run moves
with its row when rows leave, merge or are compacted."""

from __future__ import annotations

import ctypes
import os

import pytest
import torch

from lmhead.decode.rows import prepare_ids
from lmhead.generate import Batch
from lmhead.kernels import native
from lmhead.models.kv_cache import StaticCache, gather_row
from lmhead.models.lean_native import NativeStep
from lmhead.prefix_cache import BLOCK, PrefixCache
from lmhead.sampling import SamplingConfig

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler")

SYSTEM = "The cat sat on the mat. The dog went to the market to buy bread and milk, and then they went home. " * 3
QUESTIONS = [" What did the cat buy?", " Where is the market?", " Who went home first?", " And the bird?",
             " Why milk?", " When did they go?", " How far is it?", " Was it raining? And then what happened?"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tiny_gguf import write_tiny_gguf

    from lmhead import load_model

    folder = tmp_path_factory.mktemp("shared")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LMHEAD_CACHE", str(folder / "cache"))
        return load_model(str(write_tiny_gguf(folder / "m.gguf", "llama", kind="Q8_0")), progress=False)


def _steps(model, prompts: list[list[int]], cache: PrefixCache | None, config: SamplingConfig, n: int = 8,
           join_after: int = 0) -> tuple[dict[int, list], list[Batch]]:
    """Each prompt's steps (token, logprob, raw logprob, rank), its rows started together (or, join_after > 0, the
    first one alone and the others joining after that many rounds)."""
    batch = Batch(model, prefix_cache=cache)
    rows = prepare_ids(model, prompts, n, config, top_logprobs=2)
    first, rest = (rows[:1], rows[1:]) if join_after else (rows, [])
    batch.add(first)
    seen = []
    out: dict[int, list] = {}

    def take(pairs):
        for row, s in pairs:
            out.setdefault(row.index, []).append((s.token_id, s.logprob, s.raw_logprob, s.rank, s.top_logprobs))

    for _ in range(join_after):
        take(batch.step())
    if rest:
        batch.begin_join(rest)
        while batch.prefill():
            pass
    seen.append(batch.rounds.target.shared)
    while batch.rows:
        take(batch.step())
    return out, seen


@pytest.mark.parametrize("config", [SamplingConfig(temperature=0), SamplingConfig(temperature=0.8, top_k=20, seed=3)])
@pytest.mark.parametrize("join_after", [0, 2])
def test_rows_reading_shared_blocks_get_the_bits_of_copied_blocks_and_of_each_request_alone(model, config,
                                                                                           join_after, monkeypatch):
    prompts = [model.encode(SYSTEM + q) for q in QUESTIONS]
    assert len(model.encode(SYSTEM)) >= 3 * BLOCK

    def warm() -> PrefixCache:
        cache = PrefixCache()
        _steps(model, [model.encode(SYSTEM + " Tell me a story.")], cache, config, 1)
        return cache

    shared, seen = _steps(model, prompts, warm(), config, join_after=join_after)
    assert seen[0] is not None and sum(r is not None for r in seen[0].rows) == len(prompts)
    with monkeypatch.context() as mp:
        mp.setattr(NativeStep, "shares_columns", lambda self: False)
        copied, seen = _steps(model, prompts, warm(), config, join_after=join_after)
        assert seen[0] is None
    assert shared == copied
    cache = warm()
    for i, ids in enumerate(prompts):
        alone, _ = _steps(model, [ids], cache, config)
        assert alone[0] == shared[i], i


def test_a_shared_run_is_read_from_the_stores_blocks_not_copied(model):
    cache = PrefixCache()
    _steps(model, [model.encode(SYSTEM + " Tell me a story.")], cache, SamplingConfig(temperature=0), 1)
    batch = Batch(model, prefix_cache=cache)
    batch.add(prepare_ids(model, [model.encode(SYSTEM + q) for q in QUESTIONS[:3]], 2, SamplingConfig(temperature=0)))
    target = batch.rounds.target
    prompts = [model.encode(SYSTEM + q)[:-1] for q in QUESTIONS[:3]]
    m = cache.cached(prompts[0])
    _, keys, _ = cache.match(prompts[0], count=False, joined=False)
    common = len(os.path.commonprefix(prompts))
    assert common > m  # the part past the last whole block: computed once by the join's lead, shared too
    for r in range(3):
        start, n, ks, _ = target.shared.rows[r]
        assert n == common and all(a is b for a, b in zip(ks, keys, strict=False))
        assert not target.keys[:, r, :, start:start + n].any()  # the row's own columns were never written
    assert batch.prefilled == common - m + sum(len(p) - common for p in prompts)


def _shared_pair(rows: int = 3, width: int = 40):
    """A cache whose rows read a run of two blocks at different columns, and a twin holding copies of them."""
    g = torch.Generator().manual_seed(0)
    layers, kv, hd, block = 2, 2, 4, 8
    a = StaticCache(layers, rows, kv, hd, width)
    a.keys.copy_(torch.randn(a.keys.shape, generator=g))
    a.values.copy_(torch.randn(a.values.shape, generator=g))
    a.length = 30
    a.valid[:, 2:30] = True
    a.positions[:, :30] = torch.arange(30)
    blocks = [(torch.randn(layers, kv, block, hd, generator=g), torch.randn(layers, kv, block, hd, generator=g))
              for _ in range(2)]
    b = StaticCache(layers, rows, kv, hd, width)
    for t in ("keys", "values", "valid", "positions", "tokens"):
        getattr(b, t).copy_(getattr(a, t))
    b.length = a.length
    for r in range(rows):
        if r == 1:
            continue  # a row of its own beside them
        at, n = 4 + r, 13
        a.share(r, (at, n, [k for k, _ in blocks], [v for _, v in blocks]))
        a.keys[:, r, :, at:at + n] = 0  # what a shared row's own columns hold is never read
        b.keys[:, r, :, at:at + n] = torch.cat([k for k, _ in blocks], 2)[:, :, :n]
        b.values[:, r, :, at:at + n] = torch.cat([v for _, v in blocks], 2)[:, :, :n]
    return a, b


def _same(a: StaticCache, b: StaticCache) -> None:
    a.materialise()
    assert a.shared is None and a.length == b.length
    for t in ("keys", "values"):
        mask = b.valid[None, :, None, :b.length, None]
        assert torch.equal(getattr(a, t)[:, :, :, :b.length] * mask, getattr(b, t)[:, :, :, :b.length] * mask)
    for t in ("valid", "positions", "tokens"):
        assert torch.equal(getattr(a, t)[:, :b.length], getattr(b, t)[:, :b.length])


@pytest.mark.parametrize("keep", [[0, 2], [2], [1, 2], [2, 0]])
def test_a_shared_run_moves_with_its_row_when_rows_leave(keep):
    a, b = _shared_pair()
    a.select(torch.tensor(keep))
    b.select(torch.tensor(keep))
    _same(a, b)


def test_a_shared_run_moves_with_its_row_when_rows_are_gathered_or_compacted():
    a, b = _shared_pair()
    a.invalidate(2, 25)  # holes after the run
    b.invalidate(2, 25)
    a.compact()
    b.compact()
    _same(a, b)
    a, b = _shared_pair()
    da, db = StaticCache(2, 3, 2, 4, 60), StaticCache(2, 3, 2, 4, 60)
    for r in range(3):
        assert gather_row(da, r, a, r, 50) == gather_row(db, r, b, r, 50)
    da.length = db.length = 50
    _same(da, db)
    assert a.read_columns(0, torch.arange(4, 20))[0].equal(b.read_columns(0, torch.arange(4, 20))[0])


def _attend(qk, v, keys, values, mask, start, shared, hd, softcap, threads):
    """lmhead_attend for qk [B,T,H+Hkv,hd] (cos 1, sin 0: no rope) over keys/values [B,Hkv,cap,hd]; shared: None or
    (block, blocks of [1, Hkv, block, hd] (keys, values), per row (start, n)) → out [B,T,H·hd]."""
    from lmhead.kernels.abi import AttendArgs, SharedArgs

    b, t, heads = qk.shape[0], qk.shape[1], qk.shape[2] - keys.shape[1]
    cos, sin = torch.ones(b, t, hd), torch.zeros(b, t, hd)
    out = torch.empty(b, t, heads * hd)
    sh, keep = None, None
    if shared is not None:
        block, (kb, vb), spans = shared
        table = lambda bl: (ctypes.c_void_p * (b * len(bl)))(*[x.data_ptr() for _ in range(b) for x in bl])  # noqa: E731
        starts = torch.tensor([s for s, _ in spans], dtype=torch.int64)
        lens = torch.tensor([n for _, n in spans], dtype=torch.int64)
        keep = (table(kb), table(vb), starts, lens)
        sh = SharedArgs(keys=ctypes.addressof(keep[0]), values=ctypes.addressof(keep[1]), start=starts.data_ptr(),
                        len=lens.data_ptr(), n=len(kb), block=block)
    rc = native.library().lmhead_attend(AttendArgs(
        qk=qk.data_ptr(), v=v.data_ptr(), cos=cos.data_ptr(), sin=sin.data_ptr(), keys=keys.data_ptr(),
        values=values.data_ptr(), mask=None if mask is None else mask.data_ptr(), out=out.data_ptr(),
        qk_stride=qk.shape[2] * hd, v_stride=v.shape[2] * hd, B=b, T=t, H=heads, Hkv=keys.shape[1], hd=hd,
        cap=keys.shape[2], start=start, scaling=0.125, softcap=softcap, threads=threads,
        shared=None if sh is None else ctypes.addressof(sh), layer=0))
    assert rc == 0
    return out


@pytest.mark.parametrize(("hd", "softcap"), [(64, 0.0), (256, 50.0), (40, 0.0)])
@pytest.mark.parametrize("threads", [1, 2])
def test_attention_over_shared_blocks_is_the_bits_of_each_rows_own_copy_at_any_column(hd, softcap, threads):
    # rows whose first columns are shared blocks (at different columns, and some rows with none) against the same
    # rows holding copies; and a query alone against the same query among the others: the same bits
    g = torch.Generator().manual_seed(1)
    heads, kv, block, t = 4, 2, 8, 5
    kb = [torch.randn(1, kv, block, hd, generator=g) for _ in range(4)]
    vb = [torch.randn(1, kv, block, hd, generator=g) for _ in range(4)]
    spans = [(0, 29), (3, 32), (0, 0), (5, 17)]
    b, start = len(spans), 45
    cap = start + t + 3
    qk = torch.randn(b, t, heads + kv, hd, generator=g)
    v = torch.randn(b, t, kv, hd, generator=g)
    keys, values = torch.randn(b, kv, cap, hd, generator=g), torch.randn(b, kv, cap, hd, generator=g)
    mask = torch.zeros(b, t, start + t)
    for r, (s, n) in enumerate(spans):
        mask[r, :, :s] = float("-inf")  # columns before a row's own first
        mask[r, :, start:] = torch.triu(torch.full((t, t), float("-inf")), 1)
        if n:
            keys[r, :, s:s + n] = torch.cat(kb, 2)[0, :, :n]
            values[r, :, s:s + n] = torch.cat(vb, 2)[0, :, :n]
    mask[1, 2, 40] = float("-inf")  # a hole inside one query's span
    copied = _attend(qk, v, keys.clone(), values.clone(), mask, start, None, hd, softcap, threads)
    own_k, own_v = keys.clone(), values.clone()
    for r, (s, n) in enumerate(spans):
        own_k[r, :, s:s + n] = float("nan")  # never read
        own_v[r, :, s:s + n] = float("nan")
    shared = _attend(qk, v, own_k, own_v, mask, start, (block, (kb, vb), spans), hd, softcap, threads)
    assert torch.equal(shared, copied)
    for r in range(b):
        alone = _attend(qk[r:r + 1].contiguous(), v[r:r + 1].contiguous(), keys[r:r + 1].clone(),
                        values[r:r + 1].clone(), mask[r:r + 1].contiguous(), start, None, hd, softcap, 3 - threads)
        assert torch.equal(alone, copied[r:r + 1])
