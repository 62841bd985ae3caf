"""The decode loop's passes over whole rows of logits in C (kernels/native.py): the top-k by threshold and the
raw scores of chosen tokens, against torch."""

from __future__ import annotations

import pytest
import reference as ref
import torch

from lmhead.kernels import native
from lmhead.sampling import Vocab

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler")

V = 1 << 18  # Gemma 3's vocabulary: the width these passes are for


def _rows(b: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(b, V, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("b, k", [(1, 1), (1, 41), (1, 257), (1, V // 256), (3, 41), (4, 1), (4, 64)])
def test_threshold_topk_gives_torch_topk(b, k):
    x = _rows(b, seed=k + b)
    got = native.topk(x, k)
    assert got is not None
    want = torch.topk(x, k, dim=-1)
    assert torch.equal(got[0], want.values) and torch.equal(x.gather(1, got[1]), got[0])
    for r in range(b):  # the same tokens; tied values may come in another order, or be other ties of the k-th
        kth = want.values[r, -1]
        above = lambda idx, r=r, kth=kth: sorted(i for i in idx.tolist() if x[r, i] > kth)
        assert above(got[1][r]) == above(want.indices[r]) and len(set(got[1][r].tolist())) == k


def test_threshold_topk_keeps_every_tie_of_the_kth_value_it_returns():
    x = _rows(2, seed=1).round()  # integers: thousands of ties
    vals, idx = native.topk(x[:1], 100)
    want = torch.topk(x[:1], 100, dim=-1).values
    assert torch.equal(vals, want)
    assert torch.equal(x[:1].gather(1, idx), vals) and all(len(set(r)) == 100 for r in idx.tolist())


def test_threshold_topk_declines_what_torch_must_answer():
    x = _rows(1, seed=2)
    x[0, 12345] = float("nan")
    assert native.topk(x, 10) is None  # torch.topk ranks a NaN first: the caller's NaN check must see it
    assert native.topk(torch.zeros(1, V), 10) is None  # a flat row: every logit reaches the threshold
    assert native.topk(_rows(5, seed=3), 10) is None  # more rows than it is faster for
    assert native.topk(_rows(2, seed=3), 65) is None  # several rows with a larger k: likewise
    assert native.topk(_rows(1, seed=3)[:, :1000], 10) is None  # narrow
    assert native.topk(_rows(1, seed=3), V // 128) is None  # k too large for a 1-in-16 threshold
    banned = _rows(1, seed=4)
    banned[0, : V - 50] = float("-inf")
    got = Vocab(V).topk(banned, 60)  # fewer finite logits than k: torch's answer through the fallback
    assert torch.equal(got[0], torch.topk(banned, 60).values)


def test_threshold_topk_of_rows_gives_each_row_its_own_torch_topk():
    x = _rows(8, seed=20)
    x[3] = x[3].round()  # integers: ties at the k-th value
    ks = [1, 25, 90, 3, 64, 100, 7, 41]
    vals, idx = native.topk_rows(x, ks)
    assert vals.shape == idx.shape == (8, 100)
    for r, k in enumerate(ks):
        want = torch.topk(x[r], k)
        assert torch.equal(vals[r, :k], want.values) and torch.equal(x[r].gather(0, idx[r, :k]), vals[r, :k])
        assert len(set(idx[r, :k].tolist())) == k
        assert bool((vals[r, k:] == float("-inf")).all()) and not idx[r, k:].any()
    assert torch.equal(Vocab(V).topk_rows(x, ks)[0], vals)


def test_threshold_topk_of_rows_declines_what_torch_must_answer():
    x = _rows(3, seed=21)
    x[1, 999] = float("nan")
    assert native.topk_rows(x, [5, 6, 7]) is None
    assert native.topk_rows(_rows(2, seed=22), [5, V // 128]) is None  # a k too large for the threshold
    banned = _rows(2, seed=23)
    banned[1, : V - 30] = float("-inf")
    vals, _ = Vocab(V).topk_rows(banned, [10, 40])  # fewer finite logits than k: torch's answer row by row
    assert torch.equal(vals[1], torch.topk(banned[1], 40).values)
    assert torch.equal(vals[0, :10], torch.topk(banned[0], 10).values)


@pytest.mark.parametrize("b", [1, 2, 5])
def test_row_scores_give_the_log_softmax_normaliser_and_the_rank(b):
    x = _rows(b, seed=10 + b)
    ids = torch.randint(0, V, (b,), generator=torch.Generator().manual_seed(b))
    lse, greater = native.row_scores(x, ids)
    # float32 exps summed in float32 lanes: the float32 tolerance against the float64 normaliser
    torch.testing.assert_close(lse, torch.logsumexp(x.double(), dim=-1), **ref.tolerance(torch.float32))
    assert greater.tolist() == [int((x[r] > x[r, ids[r]]).sum()) for r in range(b)]


@pytest.mark.parametrize("b", [1, 3])
def test_token_scores_are_row_scores_numbers_as_python_values(b):
    x = _rows(b, seed=15 + b)
    ids = torch.randint(0, V, (b,), generator=torch.Generator().manual_seed(b))
    lse, greater = native.row_scores(x, ids)
    raw, ranks = native.token_scores(x, ids.tolist())
    assert raw == (x.gather(1, ids[:, None]).squeeze(1).double() - lse).tolist()  # the same doubles
    assert ranks == [1 + g for g in greater.tolist()]
    bad = x.clone()
    bad[b - 1, 9] = float("nan")
    assert native.token_scores(bad, ids.tolist()) is None
    for wrong in ([V] * b, [-1] * b, [0] * (b + 1), [0.0] * b):
        with pytest.raises(ValueError, match="ids must be"):
            native.token_scores(x, wrong)


def test_row_scores_leave_non_finite_rows_to_torch():
    x = _rows(2, seed=20)
    x[1, 7] = float("nan")
    assert native.row_scores(x, torch.tensor([0, 1])) is None
    x[1, 7] = float("inf")
    assert native.row_scores(x, torch.tensor([0, 1])) is None
    x = _rows(1, seed=21)
    x[0, 100:] = float("-inf")  # banned tokens count nothing
    lse, greater = native.row_scores(x, torch.tensor([3]))
    torch.testing.assert_close(lse, torch.logsumexp(x[:, :100].double(), dim=-1), **ref.tolerance(torch.float32))
    assert greater.tolist() == [int((x[0, :100] > x[0, 3]).sum())]


def test_row_scores_refuse_ids_outside_the_rows():
    x = _rows(2, seed=22)
    for ids in (torch.tensor([0, V]), torch.tensor([-1, 0]), torch.tensor([0]), torch.tensor([0.0, 1.0])):
        with pytest.raises(ValueError, match="ids must be"):
            native.row_scores(x, ids)


@pytest.mark.parametrize("b", [1, 2, 5])
def test_greedy_rows_give_the_first_argmax_and_its_raw_logprob(b):
    x = _rows(b, seed=30 + b)
    # a tie in each row, one value in each half of the row (the halves go to different threads): the first wins
    for r in range(b):
        x[r, 1000 + r] = x[r, V - 5 - r] = x[r].max() + 1
    found = native.greedy_rows(x)
    ids, raw = torch.tensor(found[0]), torch.tensor(found[1], dtype=torch.float64)
    assert ids.tolist() == x.argmax(dim=-1).tolist() == [1000 + r for r in range(b)]
    top = x.gather(1, ids[:, None]).squeeze(1).double()
    # the normaliser it implies, at the float32 tolerance of a sum of float32 exps (as row_scores')
    torch.testing.assert_close(top - raw, torch.logsumexp(x.double(), dim=-1), **ref.tolerance(torch.float32))
    # the same normaliser as the score of a chosen token: equal numbers, not just close
    lse, greater = native.row_scores(x, ids)
    assert torch.equal(raw, x.gather(1, ids[:, None]).squeeze(1).double() - lse) and greater.tolist() == [0] * b


def test_greedy_rows_leave_non_finite_rows_to_torch():
    x = _rows(2, seed=40)
    x[1, 7] = float("nan")
    assert native.greedy_rows(x) is None
    x[1, 7] = float("inf")
    assert native.greedy_rows(x) is None
    x = _rows(1, seed=41)
    x[0, :100] = float("-inf")
    ids, raw = native.greedy_rows(x)
    assert ids == x.argmax(dim=-1).tolist()
    assert native.greedy_rows(torch.full((1, 64), float("-inf"))) is None  # nothing to choose: torch's error


def _top_p_kept(row: torch.Tensor, temperature: float, p: float) -> list[int]:
    """The reference's kept ids of a row under temperature and top-p, most probable first (ties by id)."""
    xt = row / temperature
    kept = torch.isfinite(ref.sampling_top_p(xt, p)).nonzero().squeeze(1)
    order = sorted(kept.tolist(), key=lambda i: (-float(xt[i]), i))
    return order


def _lm_row(seed: int, width: int, lift: float) -> torch.Tensor:
    """A language model's row: a long tail (randn × 2) and a few dozen likely tokens lifted above it."""
    g = torch.Generator().manual_seed(seed)
    row = torch.randn(width, generator=g) * 2
    lifted = torch.randperm(width, generator=g)[:40]
    row[lifted] += lift * torch.rand(40, generator=g) + 4
    return row


@pytest.mark.parametrize("width", [49152, V])
@pytest.mark.parametrize("lift, temperature, p", [(12.0, 0.8, 0.9), (12.0, 1.0, 0.5), (8.0, 0.7, 0.95),
                                                  (16.0, 1.0, 0.99), (12.0, 0.8, 0.01), (20.0, 1.3, 0.99)])
@pytest.mark.slow
def test_top_p_row_keeps_the_references_set(width, lift, temperature, p):
    for seed in range(3):
        row = _lm_row(50 + seed, width, lift)
        vals, ids = native.top_p_row(row, temperature, p)
        assert ids[0].tolist() == _top_p_kept(row, temperature, p)
        assert torch.equal(vals[0], row[ids[0]] / temperature)  # x / T as torch divides it


def test_top_p_row_keeps_or_drops_a_tie_group_whole():
    row = torch.full((V,), -20.0)
    row[:4] = torch.tensor([5.0, 3.0, 3.0, 3.0])  # the 3.0 group straddles the cut: kept whole or not at all
    row[9000] = 3.0
    for p in (0.3, 0.5, 0.8, 0.99):
        vals, ids = native.top_p_row(row, 1.0, p)
        assert ids[0].tolist() == _top_p_kept(row, 1.0, p)
    row[100:] = float("-inf")  # banned tokens: nothing of theirs counts
    vals, ids = native.top_p_row(row, 0.5, 0.9)
    assert ids[0].tolist() == _top_p_kept(row, 0.5, 0.9)


def test_top_p_row_declines_rows_torch_must_answer_or_bin():
    row = _rows(1, seed=60)[0]
    row[7] = float("nan")
    assert native.top_p_row(row, 1.0, 0.9) is None
    row[7] = float("inf")
    assert native.top_p_row(row, 1.0, 0.9) is None
    assert native.top_p_row(torch.full((V,), float("-inf")), 1.0, 0.9) is None
    assert native.top_p_row(_rows(1, seed=61, scale=0.5)[0], 1.0, 0.9) is None  # flat: > 8,192 candidates
    assert native.top_p_row(_lm_row(63, 49152, 6.0), 1.0, 0.9) is None  # a set of ~2,000 of 49,152: too wide
    big = _rows(1, seed=62)[0]
    big[3] = 1e38
    assert native.top_p_row(big, 1e-3, 0.9) is None  # the maximum over T is not a float32


@pytest.mark.parametrize("width", [49152, V])
def test_top_p_parts_give_the_same_cut_from_c_and_from_torch(width, monkeypatch):
    """sampling's top-p without top-k settles a few CPU rows in C: the same kept set and x/T as its torch path
    (windows, or bins for the rows C declines), row by row, in a batch mixing both."""
    from lmhead.sampling import top_p as sampling  # the module that holds the top-p paths

    x = torch.stack([_lm_row(70, width, 12.0), _lm_row(71, width, 6.0), _lm_row(72, width, 16.0)])
    vocab = Vocab(width)

    def cut() -> dict[int, tuple[list[int], list[float]]]:
        out = {}
        for rows, vals, idx in sampling.top_p_parts(x, 0.8, 0.9, vocab):
            rows = list(range(x.shape[0])) if rows is None else rows.tolist()
            for j, r in enumerate(rows):
                v = vals[j] if idx is not None else vals[j]
                i = idx[j] if idx is not None else torch.arange(width)
                keep = torch.isfinite(v)
                pairs = sorted(zip(i[keep].tolist(), v[keep].tolist(), strict=True))
                out[r] = ([a for a, _ in pairs], [b for _, b in pairs])
        return out

    native_cut = cut()
    monkeypatch.setattr(sampling, "NATIVE_TOP_P_ROWS", 0)
    assert native_cut == cut()


def test_top_p_parts_name_the_batch_row_whose_logits_are_bad():
    from lmhead.sampling import top_p as sampling  # the module that holds the top-p paths

    x = torch.stack([_lm_row(80, 4096, 12.0), _lm_row(81, 4096, 12.0)])
    x[1, 9] = float("nan")
    with pytest.raises(ValueError, match=r"NaN \(row 1\)"):
        sampling.top_p_parts(x, 0.8, 0.9, Vocab(4096))


@pytest.mark.parametrize("cfg", [dict(top_p=0.9, seed=7), dict(top_p=0.9, min_p=0.02, seed=8)])
@pytest.mark.slow
def test_a_seeded_top_p_row_draws_the_same_id_whether_c_ran_or_not(cfg, monkeypatch):
    """A seeded draw races noise over its candidates in id order, so the C pass (whose candidate list is shorter
    than the torch windows') is not used for it: its id does not depend on the batch's size or on C."""
    from lmhead.sampling import SamplingConfig, sample, sample_with_logprobs
    from lmhead.sampling import top_p as sampling  # the module that holds the top-p paths

    config = SamplingConfig(temperature=0.8, **cfg)
    rows = torch.stack([_lm_row(90 + r, 49152, 12.0) for r in range(12)])
    want = [int(sample(rows[r:r + 1], config, step=3)[0]) for r in range(12)]
    alone = [int(sample_with_logprobs(rows[r:r + 1], config, step=3)[0][0]) for r in range(12)]
    together = sample_with_logprobs(rows, config, step=3)[0].tolist()  # > 8 rows: the torch path for all
    monkeypatch.setattr(sampling, "NATIVE_TOP_P_ROWS", 0)
    without = [int(sample_with_logprobs(rows[r:r + 1], config, step=3)[0][0]) for r in range(12)]
    assert alone == together == without == want


def test_the_seeded_race_in_c_is_the_first_largest_p_over_e_in_id_order():
    # `native.race_row`: the winner among the kept candidates (any order in, -inf dropped) of e^(v − max) / E in
    # id order, computed in float64 here; ties go to the lower id; a count of noise that is not the kept count is
    # refused (the caller has drawn nothing for it)
    from lmhead.kernels.native import race_row

    g = torch.Generator().manual_seed(21)
    for trial in range(200):
        m = int(torch.randint(1, 3000, (1,), generator=g))
        vals = torch.randn(m, generator=g) * float(torch.rand(1, generator=g) * 8)
        vals[torch.rand(m, generator=g) < 0.3] = float("-inf")
        vals[int(torch.randint(0, m, (1,), generator=g))] = 1.0  # at least one kept
        ids = torch.randperm(50_000, generator=g)[:m]
        kept = torch.isfinite(vals)
        noise = torch.empty(int(kept.sum())).exponential_(generator=g)
        if trial % 7 == 0:
            noise[0] = 0.0  # as small as the clamp: FLT_MIN
        assert race_row(vals, ids, noise) == ref.seeded_race(vals, ids, noise), trial
    tie = torch.tensor([0.5, 2.0, 2.0, float("-inf")])
    assert race_row(tie, torch.tensor([9, 7, 3, 1]), torch.ones(3)) == 2  # equal keys: id 3 before id 7
    assert race_row(tie, torch.tensor([9, 7, 3, 1]), torch.ones(2)) is None
    assert race_row(tie.double(), torch.tensor([9, 7, 3, 1]), torch.ones(3)) is None


def _as_the_pipeline(draw, rows: list, seeds: int, config_of) -> int:
    """Each row under config_of(seed) for each seed, at a step of its own: draw(row, config, step) is
    `sample_with_logprobs`' (id, logprob) bit for bit wherever it answers → how many times it answered."""
    from lmhead.sampling import sample_with_logprobs

    served = 0
    for r, row in enumerate(rows):
        for seed in range(seeds):
            config, step = config_of(seed), 5 * seed + r
            ids, lp = sample_with_logprobs(row[None], config, step=step)
            got = draw(row, config, step)
            if got is not None:
                served += 1
                assert got == (int(ids[0]), float(lp[0])), (r, seed)
    return served


def _declines(draw, own: dict, others: tuple) -> None:
    """draw answers None (the pipeline's turn) for rows it does not serve: its own settings unseeded, other cuts,
    a penalty, greedy, no cut at all, and a row with a NaN (the pipeline raises)."""
    from lmhead.sampling import SamplingConfig

    row = _lm_row(300, 49152, 12.0)
    for other in (own, *others, own | dict(repetition_penalty=1.1, seed=1), own | dict(temperature=0.0, seed=1),
                  dict(seed=1)):
        assert draw(row, SamplingConfig(**other), 0) is None, other
    row[7] = float("nan")
    assert draw(row, SamplingConfig(**own, seed=1), 0) is None


@pytest.mark.parametrize("temperature, top_p", [(0.8, 0.9), (1.0, 0.5), (0.7, 0.95), (1.3, 0.99), (0.6, 0.01)])
def test_a_seeded_top_p_rows_own_draw_is_the_pipelines_id_and_logprob_bit_for_bit(temperature, top_p):
    # the decode loop's seeded top-p rows skip the pipeline's generic passes (`seeded_top_p_row`): the same id and
    # processed logprob for every seed and step, or None where C does not settle the set (the pipeline answers)
    from lmhead.sampling import SamplingConfig
    from lmhead.sampling.draw import seeded_top_p_row

    rows = [_lm_row(200 + r, 49152, (8.0, 12.0, 16.0)[r % 3]) for r in range(6)]
    rows[5][[3, 99]] = float(rows[5].max())  # a tie at the top: both kept, raced in id order
    served = _as_the_pipeline(seeded_top_p_row, rows, 8,
                              lambda seed: SamplingConfig(temperature=temperature, top_p=top_p, seed=seed))
    assert served >= 8  # C settled at least one row's set (language-model rows: most)
    flat = torch.randn(49152, generator=torch.Generator().manual_seed(4)) * 0.01  # too flat for C's thresholds
    assert seeded_top_p_row(flat, SamplingConfig(temperature=1.0, top_p=0.99, seed=1), 0) is None
    _declines(seeded_top_p_row, dict(top_p=0.9),
              (dict(top_p=0.9, top_k=40, seed=1), dict(top_p=0.9, min_p=0.05, seed=1)))


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [(0.8, 40, 0.95, 0.05), (1.0, 1, 1.0, 0.0),
                                                                (0.7, 20, 0.5, 0.0), (1.3, 64, 1.0, 0.2),
                                                                (0.05, 8, 0.99, 0.0)])
def test_a_seeded_top_k_rows_own_draw_is_the_pipelines_id_and_logprob_bit_for_bit(temperature, top_k, top_p, min_p):
    # the decode loop's seeded top-k rows skip the pipeline's grouping (`seeded_top_k_row`): the same id and
    # processed logprob for every seed and step, or None where the k-th and (k+1)-th values tie (the pipeline answers)
    from lmhead.sampling import SamplingConfig
    from lmhead.sampling.draw import seeded_top_k_row

    rows = [_lm_row(400 + r, (49152, 3000)[r % 2], (8.0, 12.0, 16.0)[r % 3]) for r in range(6)]
    rows[4] = torch.round(rows[4])  # ties inside the top k: raced in id order
    rows[5][[3, 99]] = float(rows[5].max())  # a tie at the top: both kept
    served = _as_the_pipeline(seeded_top_k_row, rows, 6, lambda seed: SamplingConfig(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed))
    assert served >= 24
    edge = _lm_row(500, 49152, 12.0)
    kth = torch.topk(edge, 10).values[-1]
    edge[edge.argmin()] = kth  # the 10th and 11th largest tie: a cut of its own width, the pipeline's
    assert seeded_top_k_row(edge, SamplingConfig(top_k=10, seed=1), 0) is None
    _declines(seeded_top_k_row, dict(top_k=40), (dict(top_p=0.9, seed=1), dict(min_p=0.05, seed=1)))
    row = _lm_row(300, 49152, 12.0)
    assert seeded_top_k_row(row * 1e38, SamplingConfig(temperature=0.01, top_k=40, seed=1), 0) is None  # +inf over T


def test_top_k_row_gives_torch_topks_values_over_the_temperature():
    from lmhead.kernels.native import top_k_row

    for r, (width, k, temperature) in enumerate([(49152, 41, 0.8), (3000, 1, 1.0), (262144, 257, 0.05), (50, 49, 2.0)]):
        row = _lm_row(600 + r, width, 12.0)
        vals, ids = top_k_row(row, temperature, k)
        want = torch.topk(row, k).values / temperature
        assert torch.equal(vals[0, :k], want), r
        assert torch.equal(row[ids[0]] / temperature, vals[0])  # each value is its id's
        assert bool((vals[0, 1:] <= vals[0, :-1]).all())
    tied = torch.tensor([1.0, 3.0, 2.0, 3.0, 2.0, 0.0])
    vals, ids = top_k_row(tied, 1.0, 3)  # every token at or above the 3rd largest, ties by id
    assert vals.tolist() == [[3.0, 3.0, 2.0, 2.0]] and ids.tolist() == [[1, 3, 2, 4]]
    assert top_k_row(tied, 1.0, 6) is None and top_k_row(tied, 1.0, 0) is None  # k in 1 … V − 1
    assert top_k_row(torch.tensor([1.0, float("nan"), 0.0]), 1.0, 1) is None
    assert top_k_row(tied.double(), 1.0, 2) is None


# --- one unseeded sampled row's draw (sample_row) ------------------------------------------------------------


def _tied_row(width: int, seed: int) -> torch.Tensor:
    """`_lm_row` with a tie at the top: kept or dropped together, drawn in id order."""
    row = _lm_row(seed, width, 8.0)
    row[7] = row[11] = float(row.max())
    return row


@pytest.mark.parametrize("width", [300, 40_000])  # one piece; several pieces over the threads
@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
    (1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (0.8, 0, 0.9, 0.0), (1.3, 0, 0.5, 0.0), (0.8, 40, 1.0, 0.0),
    (0.8, 40, 0.9, 0.0), (1.0, 1, 1.0, 0.0), (1.0, 2, 1.0, 0.0), (1.2, 30, 0.6, 0.0), (0.8, 0, 1.0, 0.05),
    (1.5, 0, 1.0, 0.2), (0.8, 0, 0.95, 0.1), (0.8, 40, 0.95, 0.05)])
@pytest.mark.slow
def test_sample_row_is_the_inverse_cdf_of_the_references_distribution(width, temperature, top_k, top_p, min_p):
    from lmhead.sampling import SamplingConfig

    row = _tied_row(width, seed=width + int(top_p * 10) + top_k + int(min_p * 100))
    config = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    probs = ref.sampling_draw_probabilities(row[None], [config])[0]
    # the order the draw walks: a cut's kept tokens by x/T descending, ties by id (top-2 keeps the three tied at
    # the top); a whole row in id order
    kept = (probs > 0).nonzero().squeeze(1)
    scaled = row / temperature
    order = (sorted(kept.tolist(), key=lambda i: (-float(scaled[i]), i)) if top_k or top_p < 1.0 or min_p
             else list(range(width)))
    position = {t: j for j, t in enumerate(order)}
    upper = probs[order].cumsum(0)
    for u in [0.0, *((torch.arange(300, dtype=torch.float64) + 0.5) / 300).tolist(), 1.0 - 1e-12]:
        got = native.sample_row(row, temperature, top_k, top_p, min_p, u)
        assert got is not None
        token, logprob = got
        j = position[token]  # a token outside the kept set fails here
        assert float(upper[j] - probs[token]) - 1e-6 <= u <= float(upper[j]) + 1e-6
        assert logprob == pytest.approx(float(probs[token].log()), abs=1e-5)


def test_sample_row_declines_rows_torch_must_answer():
    row = _tied_row(V, seed=1)
    for bad in (float("nan"), float("inf")):
        broken = row.clone()
        broken[5] = bad
        for top_k, top_p, min_p in ((0, 1.0, 0.0), (0, 0.9, 0.0), (40, 1.0, 0.0), (40, 0.9, 0.1), (0, 1.0, 0.1)):
            assert native.sample_row(broken, 1.0, top_k, top_p, min_p, 0.5) is None
    flat = torch.zeros(V)
    assert native.sample_row(flat, 1.0, 0, 0.5, 0.0, 0.5) is None  # a flat row's top-p set: the bins' path
    assert native.sample_row(flat, 1.0, 40, 1.0, 0.0, 0.5) is None  # a top-40 that keeps every tied token
    assert native.sample_row(flat, 1.0, 0, 1.0, 0.5, 0.5) is None  # a min-p that keeps every tied token
    assert native.sample_row(row, 1.0, 10_000, 1.0, 0.0, 0.5) is None  # a top-k wider than C's buffers
    assert native.sample_row(row * 1e37, 0.01, 0, 1.0, 0.0, 0.5) is None  # the maximum over T overflows
    assert native.sample_row(row, 1.0, 0, 1.0, 0.0, 1.0) is None  # u outside [0, 1)
    assert native.sample_row(row, 1.0, 0, 1.0, 1.5, 0.5) is None  # min_p outside [0, 1]
    assert native.sample_row(row.double(), 1.0, 0, 1.0, 0.0, 0.5) is None
