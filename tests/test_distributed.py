"""Vocab-parallel head, loss and sampling: the same results as one process, on 2 and 3 gloo ranks.

One spawn per world size runs every check (a process group costs seconds to start on two shared cores); each
pytest test below asserts one named check's outcome on every rank. V = 1001 is divisible by neither 2 nor 3.
The process group has a timeout and the launcher a wall-clock limit, so a broken collective fails, never hangs.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import socket
import time
import traceback
from pathlib import Path

import pytest
import reference
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import lmhead.distributed as vp

pytestmark = pytest.mark.distributed

V, D = 1001, 24
GROUP_TIMEOUT_S = 30
LAUNCH_LIMIT_S = 120


# --- the checks, run on every rank ----------------------------------------------------------------------------


def _data(dtype: torch.dtype = torch.float64, n: int = 37, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, D, generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn(V, D, generator=g, dtype=torch.float64) * 0.6).to(dtype)
    bias = (torch.randn(V, generator=g, dtype=torch.float64) * 0.3).to(dtype)
    targets = torch.randint(0, V, (n,), generator=g)
    return hidden, weight, bias, targets


def _ignored(targets: torch.Tensor, how: str) -> torch.Tensor:
    t = targets.clone()
    if how == "some":
        t[::3] = -100
    elif how == "all":
        t[:] = -100
    return t


LOSS_CASES = [
    dict(reduction="mean"),
    dict(reduction="sum", label_smoothing=0.1),
    dict(reduction="none", z_loss=1e-3),
    dict(reduction="mean", label_smoothing=0.2, z_loss=1e-4, softcap=3.0, ignore="some"),
    dict(reduction="sum", ignore="all"),
    dict(reduction="mean", ignore="all"),
    dict(reduction="none", label_smoothing=0.05, ignore="some"),
]


def _split_case(case: dict) -> tuple[str, dict]:
    case = dict(case)
    return case.pop("ignore", "none"), case


def _backward(loss: torch.Tensor, seed: int = 5) -> None:
    if loss.dim():
        w = torch.rand(loss.shape, generator=torch.Generator().manual_seed(seed), dtype=loss.dtype)
        (loss * w).sum().backward()
    else:
        loss.backward()


def check_cross_entropy_matches_single_process(rank: int, world: int) -> None:
    for dtype in (torch.float64, torch.float32):
        tol = reference.tolerance(dtype)
        for case in LOSS_CASES:
            how, kw = _split_case(case)
            hidden, weight, _, targets = _data(torch.float64)
            targets = _ignored(targets, how)
            full = (hidden @ weight.t() * 2).to(dtype).requires_grad_()
            ref = reference.full_vocab_cross_entropy(full, targets, **kw)
            _backward(ref)
            local = reference.vocab_shards(full.detach(), world, dim=-1)[rank].clone().requires_grad_()
            loss = vp.vocab_parallel_cross_entropy(local, targets, vocab_size=V, **kw)
            torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6, msg=f"loss {dtype} {case}")
            _backward(loss)
            ref_grad = reference.vocab_shards(full.grad, world, dim=-1)[rank]
            torch.testing.assert_close(local.grad, ref_grad, **tol, msg=f"grad {dtype} {case}")


def check_fused_loss_matches_single_process(rank: int, world: int) -> None:
    for dtype in (torch.float64, torch.float32):
        tol = reference.tolerance(dtype)
        for i, case in enumerate(LOSS_CASES):
            how, kw = _split_case(case)
            hidden, weight, bias, targets = _data(dtype, seed=i)
            targets = _ignored(targets, how)
            use_bias = i % 2 == 0
            h_ref = hidden.clone().requires_grad_()
            w_ref = weight.clone().requires_grad_()
            b_ref = bias.clone().requires_grad_()
            logits = h_ref @ w_ref.t() + (b_ref if use_bias else 0)
            ref = reference.full_vocab_cross_entropy(logits, targets, **kw)
            _backward(ref)
            h = hidden.clone().requires_grad_()
            w = reference.vocab_shards(weight, world)[rank].clone().requires_grad_()
            b = reference.vocab_shards(bias, world)[rank].clone().requires_grad_() if use_bias else None
            loss = vp.vocab_parallel_linear_cross_entropy(h, w, targets, b, chunk_size=8, vocab_size=V, **kw)
            torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6, msg=f"loss {dtype} {case}")
            _backward(loss)
            torch.testing.assert_close(h.grad, h_ref.grad, **tol, msg=f"dHidden {dtype} {case}")
            torch.testing.assert_close(w.grad, reference.vocab_shards(w_ref.grad, world)[rank], **tol,
                                       msg=f"dW {dtype} {case}")
            if use_bias:
                torch.testing.assert_close(b.grad, reference.vocab_shards(b_ref.grad, world)[rank], **tol,
                                           msg=f"db {dtype} {case}")


def check_fused_loss_shift_and_default_chunks(rank: int, world: int) -> None:
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(3, 11, D, generator=g, dtype=torch.float64)
    weight = torch.randn(V, D, generator=g, dtype=torch.float64) * 0.5
    ids = torch.randint(0, V, (3, 11), generator=g)
    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = reference.full_vocab_cross_entropy(h_ref[:, :-1] @ w_ref.t(), ids[:, 1:], label_smoothing=0.1)
    ref.backward()
    h = hidden.clone().requires_grad_()
    w = reference.vocab_shards(weight, world)[rank].clone().requires_grad_()
    loss = vp.vocab_parallel_linear_cross_entropy(h, w, ids, shift=True, label_smoothing=0.1)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    loss.backward()
    torch.testing.assert_close(h.grad, h_ref.grad, **reference.tolerance(torch.float64))
    torch.testing.assert_close(w.grad, reference.vocab_shards(w_ref.grad, world)[rank],
                               **reference.tolerance(torch.float64))


def check_fused_loss_bfloat16(rank: int, world: int) -> None:
    hidden, weight, _, targets = _data(torch.bfloat16)
    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = reference.full_vocab_cross_entropy((h_ref @ w_ref.t()), targets, z_loss=1e-4)
    ref.backward()
    h = hidden.clone().requires_grad_()
    w = reference.vocab_shards(weight, world)[rank].clone().requires_grad_()
    loss = vp.vocab_parallel_linear_cross_entropy(h, w, targets, z_loss=1e-4, chunk_size=16)
    assert loss.dtype == torch.float32
    tol = reference.tolerance(torch.bfloat16)
    torch.testing.assert_close(loss, ref, **tol)
    loss.backward()
    assert h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    torch.testing.assert_close(h.grad, h_ref.grad, **tol)
    torch.testing.assert_close(w.grad, reference.vocab_shards(w_ref.grad, world)[rank], **tol)


def check_tied_head_and_embedding_match_single_process(rank: int, world: int) -> None:
    g = torch.Generator().manual_seed(7)
    table = torch.randn(V, D, generator=g, dtype=torch.float64) * 0.5
    ids = torch.randint(0, V, (2, 9), generator=g)
    # single process: tied embedding + head, loss on the next token
    w_ref = table.clone().requires_grad_()
    x_ref = torch.nn.functional.embedding(ids, w_ref)
    ref = reference.full_vocab_cross_entropy(torch.tanh(x_ref) @ w_ref.t(), ids.roll(-1, 1), softcap=5.0)
    ref.backward()
    emb = vp.VocabParallelEmbedding.from_weight(table)
    head = vp.VocabParallelLMHead(D, V, tie_to=emb, softcap=5.0)
    assert head.weight is emb.weight
    assert (head.vocab_start, head.vocab_end) == vp.vocab_range(V, rank, world)
    x = emb(ids)
    torch.testing.assert_close(x, x_ref.detach(), rtol=0, atol=0)
    local_logits = head(torch.tanh(x))
    assert local_logits.dtype == torch.float32 and local_logits.shape == (2, 9, head.vocab_end - head.vocab_start)
    loss = vp.vocab_parallel_cross_entropy(local_logits, ids.roll(-1, 1), vocab_size=V)
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-6, atol=1e-6)
    loss.backward()
    torch.testing.assert_close(emb.weight.grad, reference.vocab_shards(w_ref.grad, world)[rank].to(emb.weight.dtype),
                               **reference.tolerance(torch.float32))


def check_head_from_weight_gives_the_full_logits(rank: int, world: int) -> None:
    hidden, weight, bias, targets = _data(torch.float32)
    head = vp.VocabParallelLMHead.from_weight(weight, bias)
    h3 = hidden.reshape(1, 37, D)
    local = head(h3, logits_to_keep=5)
    full = vp.gather_vocab_parallel_logits(local)
    torch.testing.assert_close(full, h3[:, -5:] @ weight.t() + bias, **reference.tolerance(torch.float32))
    fused = head.loss(hidden, targets)
    plain = reference.full_vocab_cross_entropy(hidden @ weight.t() + bias, targets)
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-6)


def _sampling_cases(vocab: int, seed: int) -> tuple[torch.Tensor, list, torch.Tensor]:
    """Logits [B,V], one config per row (every path of the sharded pipeline) and prev_tokens [B,L]."""
    from lmhead import SamplingConfig as C

    g = torch.Generator().manual_seed(seed)
    cfgs = [
        C(temperature=0.0),
        C(temperature=0.8, top_k=50, top_p=0.9, seed=11),
        C(temperature=1.3, top_k=7, min_p=0.1, seed=12, logit_bias={5: 4.0, vocab - 1: 6.0}, banned_tokens=(0,)),
        C(temperature=0.7, top_p=0.9, seed=13),
        C(temperature=1.0, seed=14, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2),
        C(temperature=0.9, min_p=0.05, seed=15),
        C(temperature=0.6, top_p=0.3, min_p=0.2, seed=16),
        C(temperature=0.0, repetition_penalty=2.0, banned_tokens=(vocab // 2,)),
    ]
    logits = torch.randn(len(cfgs), vocab, generator=g) * 2.5
    logits[0, vocab - 3] = logits[0, 4] = logits[0].max() + 1  # greedy tie across shards: the lower id wins
    prev = torch.randint(0, vocab, (len(cfgs), 9), generator=g)
    prev[:, -2:] = -1
    return logits, cfgs, prev


def check_sampling_matches_single_process(rank: int, world: int) -> None:
    from lmhead import probabilities, sample

    for vocab, seed in [(V, 0), (20011, 1), (20011, 2)]:  # 20011: top-p widens its window 256 → 1024 → …
        logits, cfgs, prev = _sampling_cases(vocab, seed)
        local = reference.vocab_shards(logits, world, dim=-1)[rank]
        for step in range(3):
            ids = vp.vocab_parallel_sample(local, cfgs, prev_tokens=prev, prompt_len=3, step=step)
            want = sample(logits, cfgs, prev_tokens=prev, prompt_len=3, step=step)
            assert ids.tolist() == want.tolist(), (vocab, step, ids.tolist(), want.tolist())
        assert int(ids[0]) == 4
        probs = vp.vocab_parallel_probabilities(local, cfgs, prev_tokens=prev, prompt_len=3)
        full = probabilities(logits, cfgs, prev_tokens=prev, prompt_len=3)
        torch.testing.assert_close(probs, reference.vocab_shards(full, world, dim=-1)[rank],
                                   **reference.tolerance(torch.float32))


def check_unseeded_sampling_agrees_across_ranks(rank: int, world: int) -> None:
    from lmhead import SamplingConfig, sample

    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(3)) * 2
    local = reference.vocab_shards(logits, world, dim=-1)[rank]
    for cfg in (SamplingConfig(top_k=20, temperature=0.9), SamplingConfig(temperature=1.1),
                SamplingConfig(top_p=0.8)):
        gen, ref_gen = torch.Generator().manual_seed(99), torch.Generator().manual_seed(99)
        ids = vp.vocab_parallel_sample(local, cfg, gen)
        everyone = [torch.empty_like(ids) for _ in range(world)]
        dist.all_gather(everyone, ids)
        assert all(e.tolist() == ids.tolist() for e in everyone), everyone
        if cfg.top_p == 1.0:  # same noise layout as one process: the very same ids
            assert ids.tolist() == sample(logits, cfg, ref_gen).tolist(), cfg
    gen = torch.Generator().manual_seed(rank)  # ranks whose generators differ would pick different tokens
    _expect_error(lambda: vp.vocab_parallel_sample(local, SamplingConfig(top_k=5), gen), "generator")


def check_sharded_vocab_reduces_like_the_local_one(rank: int, world: int) -> None:
    """Each reduction of the seam, over shards, against sampling.Vocab on the full rows."""
    from lmhead.sampling import Vocab

    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(4)) * 3
    logits[1, V - 2] = logits[1, 3] = logits[1].max() + 1  # a tie across shards: the lower id
    logits[2, :400] = -math.inf
    start, end = vp.vocab_range(V, rank, world)
    local, whole, shard = logits[:, start:end], Vocab(V), vp.ShardedVocab(V, start)
    for name in ("amax", "amin", "argmax"):
        got, want = getattr(shard, name)(local), getattr(whole, name)(logits)
        for g, w in zip(got if isinstance(got, tuple) else [got], want if isinstance(want, tuple) else [want],
                        strict=True):
            assert torch.equal(g, w), (name, g, w)
    for k in (1, 7, 400, V):
        (gv, gi), (wv, wi) = shard.topk(local, k), whole.topk(logits, k)
        assert torch.equal(gv, wv), k
        finite = torch.isfinite(wv)
        finite[1] = False  # row 1's tied pair may come in either order
        assert torch.equal(gi[finite], wi[finite]), k
        assert set(gi[1].tolist()) == set(wi[1].tolist()), k
    counts = (local > 0).sum(dim=-1, keepdim=True)
    assert torch.equal(shard.sum(counts), (logits > 0).sum(dim=-1, keepdim=True))
    ids, = shard.cat(torch.arange(start, end))
    assert torch.equal(ids, torch.arange(V))
    torch.testing.assert_close(shard.softmax(local), torch.softmax(logits, dim=-1)[:, start:end],
                               **reference.tolerance(torch.float32))
    top_v, top_i = whole.topk(logits, 9)
    assert torch.equal(shard.columns(top_v, top_i, 0.0, end - start),
                       whole.columns(top_v, top_i, 0.0, V)[:, start:end])


def check_sharded_loss_vocab_combines_like_the_local_one(rank: int, world: int) -> None:
    """The loss's seam: each rank's row statistics of its columns, combined by ShardedLossVocab's all-reduces,
    against loss.LossVocab on the full rows (lse, target logit, Σz)."""
    from lmhead.loss import LossVocab, row_stats_

    g = torch.Generator().manual_seed(8)
    logits = torch.randn(6, V, generator=g, dtype=torch.float64) * 3
    targets = torch.randint(0, V, (6,), generator=g)
    start, end = vp.vocab_range(V, rank, world)
    whole, shard = LossVocab(V), vp.ShardedLossVocab(V, start, end - start)
    want = whole.lse(row_stats_(logits.clone(), targets[:, None], None, True))
    t, has_t = shard.local_targets(targets, torch.float64)
    assert torch.equal(has_t, ((targets >= start) & (targets < end)).double())
    got = shard.lse(row_stats_(logits[:, start:end].clone(), t, has_t, True))
    for name, a, b in zip(want._fields, got, want, strict=True):
        torch.testing.assert_close(a, b, **reference.tolerance(torch.float64), msg=name)


def check_sharded_sampler_is_the_pipeline(rank: int, world: int) -> None:
    """vocab_parallel_sample / _probabilities are sampling.sample / probabilities, handed a ShardedVocab."""
    from lmhead import SamplingConfig, sampling

    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(6)) * 2
    start, end = vp.vocab_range(V, rank, world)
    cfg = SamplingConfig(temperature=0.8, top_p=0.9, seed=3)
    seen = []
    real = {name: getattr(sampling, name) for name in ("sample", "probabilities")}

    def spy(name):
        def run(*args, **kwargs):
            seen.append((name, type(kwargs.get("vocab")).__name__))
            return real[name](*args, **kwargs)
        return run

    try:
        for name in real:
            setattr(sampling, name, spy(name))
        ids = vp.vocab_parallel_sample(logits[:, start:end], cfg, step=2)
        vp.vocab_parallel_probabilities(logits[:, start:end], cfg)
    finally:
        for name, fn in real.items():
            setattr(sampling, name, fn)
    assert seen == [("sample", "ShardedVocab"), ("probabilities", "ShardedVocab")], seen
    direct = sampling.sample(logits[:, start:end], cfg, step=2, vocab=vp.ShardedVocab(V, start))
    assert ids.tolist() == direct.tolist() == sampling.sample(logits, cfg, step=2).tolist()


def check_head_sample_is_the_global_argmax(rank: int, world: int) -> None:
    from lmhead import SamplingConfig

    hidden, weight, bias, _ = _data(torch.float32)
    head = vp.VocabParallelLMHead.from_weight(weight, bias)
    ids = head.sample(hidden.reshape(1, 37, D), SamplingConfig(temperature=0))
    assert ids.tolist() == (hidden[-1:] @ weight.t() + bias).argmax(dim=-1).tolist()


def _expect_error(fn, *words: str) -> None:
    try:
        fn()
    except ValueError as exc:
        for w in words:
            assert w in str(exc), f"{w!r} not in {exc}"
        return
    raise AssertionError("no ValueError raised")


def check_bad_input_raises_on_every_rank(rank: int, world: int) -> None:
    hidden, weight, _, targets = _data(torch.float32)
    shard = reference.vocab_shards(weight, world)[rank]
    # ranks disagree on V
    _expect_error(lambda: vp.VocabParallelLMHead(D, V + rank), "vocab_size")
    # a shard with the wrong rows for this rank (rank 0 holds one row too many)
    bad = weight[: shard.shape[0] + 1] if rank == 0 else shard
    _expect_error(lambda: vp.vocab_parallel_linear_cross_entropy(hidden, bad, targets, vocab_size=V),
                  "mismatched shards")
    # ranks disagree on D
    _expect_error(lambda: vp.vocab_parallel_linear_cross_entropy(hidden[:, : D - rank], shard[:, : D - rank],
                                                                 targets), "d_model")
    # ranks fed different targets
    t = targets.clone()
    t[0] = (t[0] + rank) % V
    _expect_error(lambda: vp.vocab_parallel_linear_cross_entropy(hidden, shard, t), "targets")
    # ranks disagree on an option
    _expect_error(lambda: vp.vocab_parallel_linear_cross_entropy(hidden, shard, targets,
                                                                 label_smoothing=0.1 * rank), "label_smoothing")
    # only the last rank's input is bad: it names the problem, the others name the rank
    red = "avg" if rank == world - 1 else "mean"
    _expect_error(lambda: vp.vocab_parallel_cross_entropy(hidden @ shard.t(), targets, reduction=red),
                  "reduction" if rank == world - 1 else f"rank(s) [{world - 1}]")
    # label_smoothing 1.0 is out of range, as in linear_cross_entropy
    _expect_error(lambda: vp.vocab_parallel_cross_entropy(hidden @ shard.t(), targets, label_smoothing=1.0),
                  "label_smoothing")
    # targets out of range (same on every rank)
    t = targets.clone()
    t[3] = V
    _expect_error(lambda: vp.vocab_parallel_cross_entropy(hidden @ shard.t(), t), "targets must be in [0, 1001)")
    # after all that the group still works
    loss = vp.vocab_parallel_linear_cross_entropy(hidden, shard, targets)
    torch.testing.assert_close(loss, reference.full_vocab_cross_entropy(hidden @ weight.t(), targets),
                               rtol=1e-6, atol=1e-6)


def check_missing_rank_times_out(rank: int, world: int) -> None:
    group = dist.new_group(timeout=datetime.timedelta(seconds=2))
    hidden, weight, _, targets = _data(torch.float32)
    shard = reference.vocab_shards(weight, world)[rank]
    if rank == 0:
        started = time.monotonic()
        try:
            vp.vocab_parallel_linear_cross_entropy(hidden, shard, targets, group=group)
        except RuntimeError as exc:
            elapsed = time.monotonic() - started
            assert elapsed < 20, f"took {elapsed:.1f}s"
            assert "timed out" in str(exc).lower() or "timeout" in str(exc).lower(), str(exc)
            return
        raise AssertionError("no timeout error")
    time.sleep(4)  # the other ranks never call


CHECKS = {name[len("check_"):]: fn for name, fn in globals().items() if name.startswith("check_")}
LAST = ["missing_rank_times_out"]  # leaves the default group usable, but runs last anyway


# --- launcher -----------------------------------------------------------------------------------------------


def _worker(rank: int, world: int, port: int, out_dir: str, names: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    results = {}
    for name in names:
        started = time.monotonic()
        try:
            CHECKS[name](rank, world)
            results[name] = {"ok": True, "s": round(time.monotonic() - started, 2)}
        except Exception:  # reported to the test in the parent process
            results[name] = {"ok": False, "error": traceback.format_exc()}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(world: int, names: list[str], out_dir: Path) -> list[dict]:
    ctx = mp.start_processes(_worker, args=(world, _free_port(), str(out_dir), names), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + LAUNCH_LIMIT_S
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world} ranks did not finish within {LAUNCH_LIMIT_S}s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def ranks(request, tmp_path_factory) -> list[dict]:
    names = [n for n in CHECKS if n not in LAST] + (LAST if request.param == 2 else [])
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return _launch(request.param, names, tmp_path_factory.mktemp(f"world{request.param}"))


def _assert_passed(ranks: list[dict], name: str) -> None:
    for r, results in enumerate(ranks):
        assert name in results, f"rank {r} did not run {name}"
        assert results[name]["ok"], f"rank {r}:\n{results[name]['error']}"


# --- tests --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("check", [n for n in CHECKS if n not in LAST])
def test_vocab_parallel(ranks: list[dict], check: str) -> None:
    _assert_passed(ranks, check)


def test_missing_rank_times_out_instead_of_hanging(ranks: list[dict]) -> None:
    if len(ranks) != 2:
        pytest.skip("checked with 2 ranks")
    _assert_passed(ranks, "missing_rank_times_out")


def test_uninitialised_group_gives_a_clear_error() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="not initialised"):
        vp.vocab_parallel_cross_entropy(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(RuntimeError, match="init_process_group"):
        vp.VocabParallelLMHead(8, 10)


def test_vocab_range_splits_like_tensor_split() -> None:
    for vocab, world in [(1001, 2), (1001, 3), (10, 4), (262144, 8), (7, 7)]:
        ranges = [vp.vocab_range(vocab, r, world) for r in range(world)]
        parts = torch.tensor_split(torch.arange(vocab), world)
        assert [(int(p[0]), int(p[-1]) + 1) for p in parts] == ranges
    with pytest.raises(ValueError, match="vocab_size must be >= world_size"):
        vp.vocab_range(3, 0, 4)
    with pytest.raises(ValueError, match="rank must be in"):
        vp.vocab_range(10, 2, 2)
