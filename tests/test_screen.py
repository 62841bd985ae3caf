"""The screened head (`CodedLinear.screen`, `LMHead.screen`, `decode.logits.decode_logits` with `scored`): each row's
top k exactly as the one-row product gives them and every other value below them; its bound against the exact
product; its fallbacks; the decode loop's tokens unchanged where it screens. The matrix in blocks of four rows and
in the integer path by groups' layout (kernels/groups_screen.h), where that is built."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_model

from lmhead.kernels import native
from lmhead.models import groups16
from lmhead.models.coded_linear import CodedLinear, coded_available
from lmhead.sampling import SamplingConfig

pytestmark = pytest.mark.skipif(not coded_available() or not native.avx2(),
                                reason="the screen is an AVX2 kernel of the coded library")


# the layouts the screen reads: blocks of four rows, and the integer path by groups' (K ≥ 256)
LAYOUTS = [pytest.param(False, id="rows4"),
           pytest.param(True, id="groups", marks=pytest.mark.skipif(not groups16.built(),
                                                                    reason="the path by groups needs AVX-512 VNNI"))]


@pytest.fixture(params=LAYOUTS)
def groups(request, monkeypatch) -> bool:
    if request.param:
        monkeypatch.setenv("LMHEAD_GROUPS16", "1")  # taken here whatever this machine's measured choice
    return request.param


def _q8(n: int, k: int, seed: int = 0, weight: bool = False, low: int = -127, groups: bool = False) -> CodedLinear:
    """Q8_0-like codes (int8 from `low`, one float16 scale per 32, no offsets) for an n × k matrix, as Gemma 3's
    head; `groups`: in the integer path by groups' layout."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(low, 128, (n, k), generator=g, dtype=torch.int8)
    scale = (torch.rand(n, k // 32, generator=g) * 0.004 + 1e-4).half().float()
    w = (codes.float().view(n, -1, 32) * scale[..., None]).view(n, k) if weight else None
    c = CodedLinear(codes, scale, None, w, groups16=groups)
    assert c.by_groups == groups
    return c


def _rows(m: int, k: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 2.5
    x[:, 7] = 60.0  # an outlier column, as final hidden states have: the grid's step follows it
    return x


def _one_row(c: CodedLinear, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([c(x[r:r + 1]) for r in range(x.shape[0])])


def _assert_top_k_exact(y: torch.Tensor, want: torch.Tensor, ks: list[int]) -> None:
    for r, k in enumerate(ks):
        a, b = want[r].topk(k), y[r].topk(k)
        assert torch.equal(a.indices, b.indices) and torch.equal(a.values, b.values), (r, k)
        others = torch.ones(y.shape[1], dtype=torch.bool)
        others[a.indices] = False
        exact = y[r] == want[r]
        # every value that is not the exact one lies below the k-th (the values the choice reads)
        assert bool((y[r][others & ~exact] < a.values[-1]).all()), (r, k)


@pytest.mark.parametrize("m, k", [(1, 256), (3, 256), (4, 256), (5, 256), (8, 256), (9, 256), (17, 256), (8, 96)])
def test_screen_gives_each_rows_top_k_exactly_and_the_rest_below(m, k, groups):  # every pass width, several passes
    if groups and k < 256:
        pytest.skip("the layout by groups is made for K of 256 or more")
    c = _q8(1024, k, groups=groups)
    assert c.screens
    x = _rows(m, k)
    ks = [[1, 2, 3, 41, 65, 256, 7][r % 7] for r in range(m)]
    with torch.inference_mode():
        _assert_top_k_exact(c.screen(x, ks), _one_row(c, x), ks)


@pytest.mark.parametrize("m", [4, 9])
def test_the_candidates_hold_every_token_a_rows_top_k_can_hold_with_their_exact_values(m, groups):
    c = _q8(1024, 256, 7, groups=groups)
    x = _rows(m, 256, 7)
    ks = [[1, 2, 41, 65, 3][r % 5] for r in range(m)]
    with torch.inference_mode():
        y, (vals, ids) = c.screen_candidates(x, ks)
        want = _one_row(c, x)
    assert torch.equal(y, c.screen(x, ks))
    assert vals.shape == ids.shape and vals.shape[0] == m
    for r, k in enumerate(ks):
        real = ids[r] < 1024
        count = int(real.sum())
        assert bool(real[:count].all()) and count >= k  # the padding comes last
        assert bool((ids[r, :count].diff() > 0).all())  # ascending ids
        assert torch.equal(vals[r, :count], want[r, ids[r, :count]])  # the exact values
        assert bool((vals[r, count:] == float("-inf")).all()) and bool((ids[r, count:] == 1024).all())
        top = want[r].topk(k)
        assert set(top.indices.tolist()) <= set(ids[r, :count].tolist())
        # a token that is no candidate is below the k-th largest value
        others = torch.ones(1024, dtype=torch.bool)
        others[ids[r, :count]] = False
        assert bool((want[r][others] < top.values[-1]).all())
        assert torch.equal(vals[r].topk(k).values, top.values)


def test_a_rows_allowed_tokens_are_its_only_candidates_and_its_top_k_among_them_exact(groups):
    c = _q8(1024, 256, 3, groups=groups)
    x = _rows(6, 256, 3)
    g = torch.Generator().manual_seed(4)
    allowed = [torch.rand(1024, generator=g) < 0.3, None, torch.zeros(1024, dtype=torch.bool),
               torch.rand(1024, generator=g) < 0.01, torch.ones(1024, dtype=torch.bool), None]
    allowed[2][[5, 700]] = True  # two tokens: fewer than the row's k
    ks = [2, 41, 3, 65, 2, 1]
    with torch.inference_mode():
        y, (vals, ids) = c.screen_candidates(x, ks, allowed=allowed)
        want = _one_row(c, x)
        free_y = c.screen(x, ks)
    for r, k in enumerate(ks):
        keep = torch.ones(1024, dtype=torch.bool) if allowed[r] is None else allowed[r]
        masked = want[r].masked_fill(~keep, float("-inf"))
        top = masked.topk(min(k, int(keep.sum())))
        got = ids[r][ids[r] < 1024]
        assert bool(keep[got].all())  # only allowed tokens are candidates
        assert set(top.indices.tolist()) <= set(got.tolist())
        assert torch.equal(y[r, got], want[r, got])  # with their exact values
        assert bool((y[r][~keep] == float("-inf")).all())
        if allowed[r] is None:
            assert torch.equal(y[r], free_y[r])  # a free row is screened as without masks
    with pytest.raises(ValueError, match=r"allowed\[1\] keeps no token"):
        c.screen_candidates(x[:2], [2, 2], allowed=[None, torch.zeros(1024, dtype=torch.bool)])
    with pytest.raises(ValueError, match="allowed: one entry per row"):
        c.screen_candidates(x[:2], [2, 2], allowed=[None])


def test_rows_computed_whole_give_no_candidates(groups):
    k = 256 if groups else 64
    c = _q8(512, k, 5, groups=groups)
    x = _rows(5, k, 5)
    with torch.inference_mode():
        y, cands = c.screen_candidates(x, [64] * 5, cap=40)
        assert cands is None and torch.equal(y, _one_row(c, x))
        x[2, 3] = float("nan")
        assert c.screen_candidates(x, [2] * 5)[1] is None


@pytest.mark.parametrize("k", [640, 352])  # groups in pairs, and an odd last group
def test_the_screens_values_are_within_its_bound_of_the_exact_product(k, groups):
    # ŷ within ‖w‖·β of the exact value for every token (coded_kernel.c's bound), ‖w‖ rounded up; codes down to
    # -128, a group of zeros, a group of one outlier and a group near float32's smallest beside ordinary ones
    lib = native.library()
    screen_norms, screen = ((lib.lmhead_screen_norms16, lib.lmhead_screen16) if groups
                            else (lib.lmhead_screen_norms, lib.lmhead_screen))
    for seed, spread in ((0, 1.0), (1, 30.0), (2, 1e-3)):
        c = _q8(512, k, seed, weight=True, low=-128, groups=groups)
        x = _rows(6, k, seed) * spread
        x[1, 32:64] = 0.0
        x[2, 64:96] = 1e-3 * spread
        x[2, 70] = 1e4 * spread
        x[3, 96:128] = 1e-44  # a group whose grid step underflows: its values round to 0, counted whole in β
        x[3, 100] = 0.0
        y, beta = torch.empty(6, 512), torch.empty(6, dtype=torch.float64)
        norms = torch.empty(512)
        assert screen_norms(c.codes.data_ptr(), c.scale.data_ptr(), 512, k, norms.data_ptr(), 2) == 0
        assert screen(x.data_ptr(), 6, k, c.codes.data_ptr(), c.scale.data_ptr(), 512, y.data_ptr(),
                      beta.data_ptr(), 2) == 0
        exact = x.double() @ c.weight.double().T
        assert bool((norms.double() >= c.weight.double().norm(dim=1)).all())
        bound = norms.double()[None] * beta[:, None]
        assert bool(((y.double() - exact).abs() <= bound).all()), seed
        assert bool(((_one_row(c, x).double() - y.double()).abs() <= bound).all()), seed


def test_ties_at_the_top_are_kept_whole_and_ordered_as_the_exact_product_orders_them():
    c = _q8(256, 64, 3)
    codes = native.unblock4(c.codes)
    scale = c.scale.float()
    # rows 10, 50 and 51 the same weights: their logits tie exactly, whatever x is
    for r in (50, 51):
        codes[r], scale[r] = codes[10], scale[10]
    c = CodedLinear(codes, scale)
    x = _rows(4, 64, 4)
    x = x * torch.sign(x @ c.dequantize()[10])[:, None] * 1.0  # row 10's logit positive
    x = x + 3.0 * c.dequantize()[10] / c.dequantize()[10].norm()  # and the largest
    want = _one_row(c, x)
    for k in (1, 2, 3, 4):
        with torch.inference_mode():
            y = c.screen(x, [k] * 4)
        _assert_top_k_exact(y, want, [k] * 4)
        assert torch.equal(y.argmax(1), want.argmax(1))


def test_rows_the_screen_cannot_bound_are_computed_exactly():
    c = _q8(512, 64, 5)
    x = _rows(5, 64, 5)
    with torch.inference_mode():
        want = _one_row(c, x)
        few = c.screen(x, [64] * 5, cap=40)  # more candidates than the cap: those rows exactly, whole
        assert torch.equal(few, want)
        x[2, 3] = float("nan")  # no bound holds: every row exactly (the NaN row's own NaNs included)
        got = c.screen(x, [2] * 5)
        torch.testing.assert_close(got, c(x), equal_nan=True, rtol=0, atol=0)
        # a row whose values are all near float32's smallest (its sums could leave the normal range, where the
        # relative bound does not hold; its grid steps would underflow): every row exactly
        tiny = _rows(5, 64, 6)
        tiny[3] = tiny[3] * 1e-43
        assert torch.equal(c.screen(tiny, [2] * 5), c(tiny))


@pytest.mark.skipif(not groups16.built(), reason="the path by groups needs AVX-512 VNNI")
def test_a_row_the_path_by_groups_refuses_gets_its_float32_sums_as_candidates(monkeypatch):
    # a group whose largest value is below 2⁻⁶⁰ (its slices' scale would leave float32's normal range): the whole
    # product takes that row's float32 sums (groups_kernel.h's g16_plain), and so do its candidates' values
    monkeypatch.setenv("LMHEAD_GROUPS16", "1")
    c = _q8(512, 256, 8, groups=True)
    x = _rows(3, 256, 8)
    x[1, 32:64] = 1e-20
    with torch.inference_mode():
        want = _one_row(c, x)
        y, (vals, ids) = c.screen_candidates(x, [3, 5, 2])
        assert torch.equal(c(x), want)
    for r in range(3):
        real = ids[r] < 512
        assert torch.equal(vals[r][real], want[r, ids[r][real]])
    _assert_top_k_exact(y, want, [3, 5, 2])


def test_bad_ks_are_errors_that_name_them():
    c = _q8(64, 32)
    x = _rows(2, 32)
    for ks in ([1], [0, 1], [1, 65], [1.5, 1]):
        with pytest.raises(ValueError, match="ks"):
            c.screen(x, ks)


def test_a_weight_changed_in_place_is_read_from_its_own_numbers():
    c = _q8(128, 64, 6, weight=True)
    x = _rows(4, 64, 6)
    with torch.no_grad():
        c.weight.mul_(2.0)
    with torch.inference_mode():
        torch.testing.assert_close(c.screen(x, [1] * 4), x @ c.weight.T)


def test_which_rows_read_their_top_k_only():
    from lmhead.decode.logits import SCREEN_MAX_K, screen_k

    assert screen_k(SamplingConfig(temperature=0), False) == 2
    assert screen_k(SamplingConfig(temperature=0.8, top_k=40, top_p=0.9, seed=1), False) == 41
    assert screen_k(SamplingConfig(temperature=0), True) == 0  # scored: its normaliser reads every logit
    assert screen_k(SamplingConfig(temperature=0.8, top_p=0.9), False) == 0
    assert screen_k(SamplingConfig(temperature=0.8, top_k=SCREEN_MAX_K + 1), False) == 0
    assert screen_k(SamplingConfig(temperature=0, logit_bias={3: 5.0}), False) == 0
    assert screen_k(SamplingConfig(temperature=0, repetition_penalty=1.3), False) == 0


def _coded_head_model():
    """A tiny Llama whose tied head weight is Q8_0-like numbers and reads them through a CodedLinear."""
    from lmhead import Model

    hf_model, tokenizer = tiny_model("llama", vocab_size=320)
    model = Model(hf_model, tokenizer, name="tiny-coded-head")
    w = model.exact_head.weight
    with torch.no_grad():
        scale = (w.view(w.shape[0], -1, 32).abs().amax(-1) / 127).clamp_min(1e-4).half().float()
        q = torch.round(w.view(w.shape[0], -1, 32) / scale[..., None]).clamp(-127, 127)
        w.copy_((q * scale[..., None]).view_as(w))
    model.exact_head.product = CodedLinear(q.to(torch.int8).view_as(w), scale, None, w)
    assert model.exact_head.product.screens
    return model


@pytest.mark.parametrize("draft", ["none", "ngram"])
def test_scoreless_rounds_are_screened_and_give_the_same_tokens(monkeypatch, draft):
    import lmhead.decode.logits as L
    from lmhead.decode.engine import Decoder
    from lmhead.decode.rows import prepare
    from lmhead.generate import Batch

    model = _coded_head_model()
    calls, plain = [], []
    screen = model.exact_head.screen_candidates

    def counting(hidden, ks, allowed=None):
        calls.append(len(ks))
        return screen(hidden, ks, allowed)

    monkeypatch.setattr(model.exact_head, "screen_candidates", counting)
    plain_rounds = Decoder._plain
    monkeypatch.setattr(Decoder, "_plain", lambda self, logits, *a: plain.append(1) or plain_rounds(self, logits, *a))
    prompts = ["a b c a b c a b", "hello there", "x y z", "one two one two one", "q", "the the the"]
    configs = [SamplingConfig(temperature=0) if i % 2 == 0 else SamplingConfig(temperature=0.9, top_k=12, seed=i)
               for i in range(len(prompts))]

    def run(scores: bool):
        rows = [r for p, c in zip(prompts, configs, strict=True) for r in prepare(model, p, 12, c, scores=scores)]
        batch = Batch(model, draft=draft)
        batch.add(rows)
        while batch.rows:
            batch.step()
        return [r.generated for r in rows]

    scored = run(True)  # scored rows read every logit: never screened
    assert calls == []
    plain.clear()
    screened = run(False)
    assert calls and min(calls) >= L.SCREEN_MIN_ROWS
    assert screened == scored
    if draft == "none":  # every round screened: the rows chose from their candidates, never from whole rows
        assert len(calls) >= 12 and not plain
    monkeypatch.setattr(L, "SCREEN_MIN_ROWS", 10**9)
    calls.clear()
    assert run(False) == scored and calls == []


def test_drafted_screened_rounds_draw_from_the_candidates_and_give_the_same_tokens(monkeypatch):
    """Two rows with n-gram drafts verify up to 8 positions: screened, each position's choice made from its
    candidates (a seeded top-k row beside a greedy one: the position-by-position draws), the same tokens as
    unscreened."""
    from lmhead.decode.engine import Decoder
    from lmhead.decode.rows import prepare
    from lmhead.generate import Batch

    model = _coded_head_model()
    seen = []
    draws = Decoder._draws
    monkeypatch.setattr(Decoder, "_draws", lambda self, *a: seen.append(a[-1] is not None) or draws(self, *a))
    prompts = ["a b c a b c a b c a b c a b", "one two one two one two one two"]
    configs = [SamplingConfig(temperature=0.9, top_k=12, seed=5), SamplingConfig(temperature=0)]

    def run(scores: bool):
        rows = [r for p, c in zip(prompts, configs, strict=True) for r in prepare(model, p, 16, c, scores=scores)]
        batch = Batch(model, draft="ngram")
        batch.add(rows)
        while batch.rows:
            batch.step()
        return [r.generated for r in rows]

    scored = run(True)
    assert seen and not any(seen)
    seen.clear()
    assert run(False) == scored
    assert any(seen)


@pytest.mark.parametrize("draft", ["none", "ngram"])
def test_constrained_greedy_rounds_are_screened_under_their_masks_and_give_the_same_tokens(monkeypatch, draft):
    """Scoreless greedy rows with constraints take the screened head with each position's mask (their candidates
    are allowed tokens only): the same tokens as scored rows, which read every logit and are never screened."""
    from lmhead.constrain import Choice, JSONSchema, Regex
    from lmhead.generate import Batch, prepare

    model = _coded_head_model()
    masked = []
    screen = model.exact_head.screen_candidates

    def counting(hidden, ks, allowed=None):
        masked.append(allowed is not None and any(a is not None for a in allowed))
        return screen(hidden, ks, allowed)

    monkeypatch.setattr(model.exact_head, "screen_candidates", counting)
    obj = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "yz"]}},
           "required": ["a", "b"], "additionalProperties": False}
    prompts = ["a b c a b", "hello there", "x y z", "one two one two"]
    constraints = [Choice(["abc", "abd", "b"]), Regex(r"[a-c]{2,6}"), JSONSchema(obj), None]
    greedy = SamplingConfig(temperature=0)

    def run(scores: bool):
        rows = [r for p, c in zip(prompts, constraints, strict=True)
                for r in prepare(model, p, 16, greedy, constraint=c, scores=scores)]
        batch = Batch(model, draft=draft)
        batch.add(rows)
        ends = {}
        while batch.rows:
            for row, step in batch.step():
                ends[id(row)] = step.finish_reason
        return [(r.generated, ends[id(r)]) for r in rows]

    scored = run(True)
    assert not masked
    assert run(False) == scored
    assert any(masked)


def test_values_at_gives_the_one_row_products_values_at_the_ids_and_minus_inf_elsewhere(groups):
    c = _q8(1024, 256, 9, groups=groups)
    x = _rows(3, 256, 9)
    ids = [torch.tensor([0, 5, 6, 1023]), torch.tensor([17]), torch.arange(0, 1024, 3)]
    with torch.inference_mode():
        y = c.values_at(x, ids)
        want = _one_row(c, x)
    for r, i in enumerate(ids):
        assert torch.equal(y[r, i], want[r, i])
        rest = torch.ones(1024, dtype=torch.bool)
        rest[i] = False
        assert bool((y[r][rest] == float("-inf")).all())
    with pytest.raises(ValueError, match=r"ids\[1\]"):
        c.values_at(x[:2], [torch.tensor([1]), torch.tensor([1024])])


@pytest.mark.parametrize("draft", ["none", "ngram"])
def test_constrained_positions_allowing_few_tokens_read_only_their_rows_with_the_same_tokens_and_scores(
        monkeypatch, draft):
    """A call whose every position is a constrained row's, each allowing few tokens, computes those tokens' logits
    alone (`LMHead.values_at`): the same tokens, logprobs, raw logprobs and alternatives as the whole head."""
    import lmhead.decode.logits as S
    from lmhead.constrain import Choice, JSONSchema, Regex

    model = _coded_head_model()
    few = []
    values_at = model.exact_head.values_at
    monkeypatch.setattr(model.exact_head, "values_at", lambda h, ids: few.append(len(ids)) or values_at(h, ids))
    obj = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "yz"]}},
           "required": ["a", "b"], "additionalProperties": False}
    prompts = ["a b c a b", "hello there", "x y z"]
    constraints = [Choice(["abc", "abd", "b"]), Regex(r"[a-c]{2,6}"), JSONSchema(obj)]
    configs = [SamplingConfig(temperature=0), SamplingConfig(temperature=0.8, top_p=0.9, seed=3),
               SamplingConfig(temperature=0)]

    def run():
        steps = list(model.generate(prompts, 16, config=configs, constraint=constraints, draft=draft,
                                    top_logprobs=3))
        tokens = [(s.index, s.token_id, s.finish_reason, [a.token_id for a in s.top_logprobs]) for s in steps]
        scores = torch.tensor([[s.logprob, s.raw_logprob, *(a.logprob for a in s.top_logprobs),
                                *(a.raw_logprob for a in s.top_logprobs)] for s in steps], dtype=torch.float64)
        return tokens, scores

    monkeypatch.setattr(S, "FEW_ALLOWED_SHARE", 10**9)  # never: the whole head, masked
    whole_tokens, whole_scores = run()
    assert not few
    monkeypatch.setattr(S, "FEW_ALLOWED_SHARE", 1)  # any mask: the allowed rows alone
    tokens, scores = run()
    assert few
    assert tokens == whole_tokens
    # the one-row product's values against the call's own (a product over several rows sums in another order)
    torch.testing.assert_close(scores, whole_scores, rtol=1.3e-6, atol=1e-5)
