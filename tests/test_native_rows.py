"""The decode loop's passes over whole rows of logits in C (models/native.py): the top-k by threshold and the
raw scores of chosen tokens, against torch."""

from __future__ import annotations

import pytest
import reference as ref
import torch

from lmhead.models import native
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


@pytest.mark.parametrize("b", [1, 2, 5])
def test_row_scores_give_the_log_softmax_normaliser_and_the_rank(b):
    x = _rows(b, seed=10 + b)
    ids = torch.randint(0, V, (b,), generator=torch.Generator().manual_seed(b))
    lse, greater = native.row_scores(x, ids)
    # float32 exps summed in float32 lanes: the float32 tolerance against the float64 normaliser
    torch.testing.assert_close(lse, torch.logsumexp(x.double(), dim=-1), **ref.tolerance(torch.float32))
    assert greater.tolist() == [int((x[r] > x[r, ids[r]]).sum()) for r in range(b)]


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
    ids, raw = native.greedy_rows(x)
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
    assert ids.tolist() == x.argmax(dim=-1).tolist()
    assert native.greedy_rows(torch.full((1, 64), float("-inf"))) is None  # nothing to choose: torch's error
