"""linear_cross_entropy against the definition (tests/reference.py: F.cross_entropy on the full logits).

Shapes are deliberately not powers of two (N=1000, D=72, V=10007) and chunk sizes do not divide N, so the
last, short chunk and the gathered (ignored-row) paths are exercised. Every option is compared on the forward
value, the per-token lse and every gradient.
"""

from __future__ import annotations

import math

import pytest
import reference
import torch
import torch.nn.functional as F

from lmhead import linear_cross_entropy
from lmhead.loss import LossVocab, default_chunk_size, row_losses, row_stats_

N, D, V = 1000, 72, 10007


def make(gen: torch.Generator, dtype=torch.float32, shape=(N,), d=D, v=V, bias=False, ignore=0.0,
         scale=1.0):
    """hidden [*shape, d], weight [v, d], targets [*shape] with a fraction `ignore` set to -100, bias [v]."""
    hidden = torch.randn(*shape, d, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(v, d, generator=gen) * (scale / math.sqrt(d))).to(dtype).requires_grad_()
    b = (torch.randn(v, generator=gen) * 0.1).to(dtype).requires_grad_() if bias else None
    targets = torch.randint(0, v, shape, generator=gen)
    if ignore:
        targets[torch.rand(shape, generator=gen) < ignore] = -100
    return hidden, weight, targets, b


def grads_of(fn, inputs, grad_out=None, grad_lse=None):
    """Run fn() -> (loss, lse); backprop loss·grad_out (+ lse·grad_lse); return outputs and input grads."""
    for t in inputs:
        if t is not None:
            t.grad = None
    loss, lse = fn()
    total = (loss * grad_out).sum() if grad_out is not None else loss.sum()
    if grad_lse is not None:
        total = total + (lse * grad_lse).sum()
    total.backward()
    return [loss.detach(), lse.detach()] + [None if t is None else t.grad for t in inputs]


def assert_close_scaled(actual, expected, dtype, name=""):
    """Per-dtype tolerances (reference.tolerance), atol scaled by the tensor's magnitude: gradients summed over
    many tokens (dW, "sum") are large, and their rounding error grows with them."""
    if expected is None:
        assert actual is None, name
        return
    tol = reference.tolerance(dtype)
    # x2: a float32 sum over V=10,007 terms rounds by ~1e-6 on its own, in the reference as in ours
    scale = max(1.0, float(expected.detach().abs().max())) * (2.0 if dtype == torch.float32 else 1.0)
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol["rtol"], atol=tol["atol"] * scale,
                               msg=lambda m: f"{name}: {m}")


def compare(gen, *, dtype=torch.float32, shape=(N,), v=V, bias=False, ignore=0.0, chunk_size=96,
            lse_grad=False, **kw):
    hidden, weight, targets, b = make(gen, dtype, shape, v=v, bias=bias, ignore=ignore)
    inputs = [hidden, weight, b]
    per_token = targets[..., 1:].shape if kw.get("shift") else targets.shape
    # a per-token grad_output for "none", a scale otherwise
    grad_out = torch.rand(per_token if kw.get("reduction") == "none" else (), generator=gen) + 0.5
    grad_lse = torch.randn(per_token, generator=gen) if lse_grad else None
    ref = grads_of(lambda: reference.linear_cross_entropy(hidden, weight, targets, b, **kw), inputs,
                   grad_out, grad_lse)
    ours = grads_of(lambda: linear_cross_entropy(hidden, weight, targets, b, chunk_size=chunk_size,
                                                 return_lse=True, **kw), inputs, grad_out, grad_lse)
    for name, a, e in zip(["loss", "lse", "d_hidden", "d_weight", "d_bias"], ours, ref, strict=True):
        assert_close_scaled(a, e, dtype, name)
    assert ours[0].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    for g, t in zip(ours[2:], inputs, strict=True):
        assert g is None or g.dtype == t.dtype
    return ours


OPTIONS = [
    pytest.param({}, id="mean"),
    pytest.param({"reduction": "sum"}, id="sum"),
    pytest.param({"reduction": "none"}, id="none"),
    pytest.param({"label_smoothing": 0.1}, id="label_smoothing"),
    pytest.param({"z_loss": 1e-3}, id="z_loss"),
    pytest.param({"softcap": 3.0}, id="softcap"),
    pytest.param({"bias": True}, id="bias"),
    pytest.param({"label_smoothing": 0.2, "z_loss": 1e-2, "softcap": 2.5, "bias": True, "reduction": "none"},
                 id="everything-none"),
    pytest.param({"label_smoothing": 0.05, "z_loss": 1e-4, "bias": True, "reduction": "sum"},
                 id="smoothing-zloss-bias-sum"),
]


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("ignore", [0.0, 0.3], ids=["no-ignored", "some-ignored"])
def test_forward_and_gradients_match_full_logits_definition(gen, options, ignore):
    compare(gen, ignore=ignore, **options)


@pytest.mark.parametrize("options", [{}, {"reduction": "none", "label_smoothing": 0.1}, {"softcap": 2.0}])
def test_shift_predicts_next_token_from_batched_hidden(gen, options):
    ours = compare(gen, shape=(3, 211), v=3001, ignore=0.1, shift=True, **options)
    if options.get("reduction") == "none":
        assert ours[0].shape == (3, 210)
    assert ours[1].shape == (3, 210)
    assert ours[2][:, -1].abs().max() == 0  # the last position predicts nothing


def test_shift_on_flat_hidden_equals_manual_slicing(gen):
    hidden, weight, targets, _ = make(gen, shape=(300,))
    shifted = linear_cross_entropy(hidden, weight, targets, shift=True, chunk_size=64)
    manual = linear_cross_entropy(hidden[:-1], weight, targets[1:], chunk_size=64)
    torch.testing.assert_close(shifted, manual, rtol=0, atol=0)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_return_lse_gradient_flows_into_hidden_and_weight(gen, reduction):
    compare(gen, shape=(400,), v=3001, ignore=0.2, lse_grad=True, reduction=reduction, z_loss=1e-3, bias=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("options", [{}, {"label_smoothing": 0.1, "z_loss": 1e-3, "bias": True},
                                     {"softcap": 3.0, "reduction": "none"}])
def test_16bit_inputs_match_reference_and_return_float32_loss(gen, dtype, options):
    compare(gen, dtype=dtype, shape=(400,), v=3001, ignore=0.2, chunk_size=64, **options)


def test_bf16_weight_gradient_is_accumulated_in_float32(gen):
    """dW summed over many chunks: a bf16 running sum would drift; ours stays at the float32-accumulated sum
    (computed here in float64 from the same bf16 logits) to bf16 rounding of the final value."""
    hidden, weight, targets, _ = make(gen, torch.bfloat16, shape=(2048,), d=32, v=257)
    linear_cross_entropy(hidden, weight, targets, chunk_size=32, reduction="sum").backward()
    logits = F.linear(hidden.detach(), weight.detach()).double()
    g = torch.softmax(logits, -1) - F.one_hot(targets, 257).double()
    exact = g.t() @ hidden.detach().double()
    err = (weight.grad.double() - exact).abs() / exact.abs().max()
    assert float(err.max()) < 8e-3  # bf16 has 8 bits of mantissa: one rounding of the final value ~ 4e-3


@pytest.fixture
def one_thread():
    """Tiny problems gain nothing from threads, and on a loaded 2-core machine every OpenMP launch of the
    softmax kernel can wait a whole scheduler slice: gradcheck makes hundreds of calls."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_float64_gradcheck_on_tiny_problem(gen, one_thread):
    hidden = torch.randn(7, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(11, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    bias = torch.randn(11, dtype=torch.float64, generator=gen, requires_grad=True)
    targets = torch.tensor([0, 3, -100, 10, 5, 5, 1])
    for kw in ({}, {"reduction": "none", "label_smoothing": 0.1, "z_loss": 0.01, "softcap": 2.0},
               {"reduction": "sum", "label_smoothing": 0.2, "z_loss": 0.1}):
        assert torch.autograd.gradcheck(
            lambda h, w, b, kw=kw: linear_cross_entropy(h, w, targets, b, chunk_size=3, **kw),
            (hidden, weight, bias))
    assert torch.autograd.gradcheck(
        lambda h, w: linear_cross_entropy(h, w, targets, chunk_size=2, return_lse=True, z_loss=0.01),
        (hidden, weight))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_targets_ignored_gives_zero_loss_and_zero_gradients(gen, reduction):
    hidden, weight, targets, bias = make(gen, shape=(4, 9), bias=True)
    targets = torch.full_like(targets, -100)
    loss, lse = linear_cross_entropy(hidden, weight, targets, bias, reduction=reduction, return_lse=True)
    assert torch.all(loss == 0) and torch.all(lse == 0)
    assert loss.shape == ((4, 9) if reduction == "none" else ())
    loss.sum().backward()
    for t in (hidden, weight, bias):
        assert t.grad is not None and t.grad.shape == t.shape and torch.all(t.grad == 0)
    if reduction == "mean":  # what we deliberately differ from: torch's mean over zero tokens
        assert torch.isnan(F.cross_entropy(F.linear(hidden, weight, bias).reshape(-1, V), targets.reshape(-1)))


def test_ignored_rows_never_enter_the_projection(gen):
    """NaN hidden states at ignored positions (e.g. garbage padding) would poison dW in the plain computation
    (0·NaN); dropped before the projection, they cannot."""
    hidden, weight, targets, _ = make(gen, shape=(200,))
    targets[::3] = -100
    poisoned = hidden.detach().clone()
    poisoned[::3] = float("nan")
    poisoned.requires_grad_()
    loss = linear_cross_entropy(poisoned, weight, targets, chunk_size=50)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(weight.grad).all()
    keep = targets != -100
    expected = linear_cross_entropy(hidden.detach()[keep], weight.detach(), targets[keep])
    torch.testing.assert_close(loss.detach(), expected, **reference.tolerance(torch.float32))
    assert torch.all(poisoned.grad[~keep] == 0)


def test_backward_twice_with_retain_graph_accumulates_identical_gradients(gen):
    hidden, weight, targets, bias = make(gen, shape=(300,), bias=True, ignore=0.2)
    loss = linear_cross_entropy(hidden, weight, targets, bias, chunk_size=64, label_smoothing=0.1)
    loss.backward(retain_graph=True)
    first = [t.grad.clone() for t in (hidden, weight, bias)]
    loss.backward(retain_graph=True)  # precomputed buffers were handed over: this one recomputes
    loss.backward()
    for g, t in zip(first, (hidden, weight, bias), strict=True):
        torch.testing.assert_close(t.grad, 3 * g, rtol=1e-5, atol=1e-6)


def test_scaled_loss_scales_every_gradient(gen):
    hidden, weight, targets, bias = make(gen, shape=(300,), bias=True)
    linear_cross_entropy(hidden, weight, targets, bias, chunk_size=64).backward()
    base = [t.grad.clone() for t in (hidden, weight, bias)]
    for t in (hidden, weight, bias):
        t.grad = None
    (linear_cross_entropy(hidden, weight, targets, bias, chunk_size=64) * -2.5).backward()
    for g, t in zip(base, (hidden, weight, bias), strict=True):
        torch.testing.assert_close(t.grad, -2.5 * g, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("chunk_size", [1, 7, 99, 300, 5000, None])
def test_chunk_size_does_not_change_the_result(gen, chunk_size):
    compare(gen, shape=(300,), v=1009, ignore=0.1, chunk_size=chunk_size, label_smoothing=0.1)


def test_frozen_weight_or_hidden_get_no_gradient(gen):
    hidden, weight, targets, _ = make(gen, shape=(100,))
    weight.requires_grad_(False)
    linear_cross_entropy(hidden, weight, targets).backward()
    assert hidden.grad is not None and weight.grad is None
    hidden.grad = None
    hidden.requires_grad_(False)
    weight.requires_grad_(True)
    linear_cross_entropy(hidden, weight, targets).backward()
    assert hidden.grad is None and weight.grad is not None


def test_no_grad_forward_equals_reference(gen):
    hidden, weight, targets, _ = make(gen, shape=(2, 150), ignore=0.1)
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, targets, z_loss=1e-3, chunk_size=40)
    assert not loss.requires_grad
    expected, _ = reference.linear_cross_entropy(hidden, weight, targets, z_loss=1e-3)
    torch.testing.assert_close(loss, expected.detach(), **reference.tolerance(torch.float32))


def test_noncontiguous_hidden_and_int32_targets(gen):
    hidden, weight, targets, _ = make(gen, shape=(50, 4))
    h = hidden.detach().transpose(0, 1).requires_grad_()  # [4,50,D], not contiguous
    t = targets.t()
    ours = linear_cross_entropy(h, weight, t.to(torch.int32), chunk_size=17)
    ours.backward()
    h2 = h.detach().contiguous().requires_grad_()
    expected, _ = reference.linear_cross_entropy(h2, weight, t)
    expected.backward()
    torch.testing.assert_close(ours, expected, **reference.tolerance(torch.float32))
    torch.testing.assert_close(h.grad, h2.grad, **reference.tolerance(torch.float32))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("bias", [False, True])
def test_agrees_with_torch_linear_cross_entropy(gen, reduction, bias):
    """torch 2.13's own fused op (chunked path) supports bias, ignore_index and the reductions."""
    if not hasattr(F, "linear_cross_entropy"):
        pytest.skip("this torch has no F.linear_cross_entropy")
    hidden, weight, targets, b = make(gen, shape=(500,), v=3001, bias=bias, ignore=0.2)
    inputs = [hidden, weight, b]
    kw = {"linear_bias": b} if bias else {}
    theirs = grads_of(lambda: (F.linear_cross_entropy(hidden, weight, targets, reduction=reduction,
                                                      options=torch.nn.LinearCrossEntropyOptions(), **kw),
                               torch.zeros(())), inputs)
    ours = grads_of(lambda: (linear_cross_entropy(hidden, weight, targets, b, reduction=reduction,
                                                  chunk_size=128), torch.zeros(())), inputs)
    for name, a, e in zip(["loss", "", "d_hidden", "d_weight", "d_bias"], ours, theirs, strict=True):
        if name:
            assert_close_scaled(a, e, torch.float32, name)


def test_default_chunk_size_follows_the_documented_budget():
    # float32 [c,V] chunk <= min(256 MiB, max(1/16 of the full [n,V] logits, 8 MiB)), multiple of 32, >= 32
    assert default_chunk_size(4096, 49152) == 256
    assert default_chunk_size(4096, 262144) == 256
    assert default_chunk_size(8192, 262144) == 256  # the 256 MiB cap
    assert default_chunk_size(100_000, 32000) == 2080  # 256 MiB / (32000·4 B) = 2097 -> 2080
    assert default_chunk_size(300, 50000) == 32  # floor
    assert default_chunk_size(10, 50000) == 10  # never more rows than there are
    assert default_chunk_size(500, 4000) == 500  # full logits 8 MB: one chunk
    for n, v in [(1000, 10007), (4096, 262144), (12345, 151936)]:
        c = default_chunk_size(n, v)
        assert c * v * 4 <= max(min(256 * 2**20, max(n * v * 4 // 16, 8 * 2**20)), 32 * v * 4)


BAD = [
    (lambda h, w, t: dict(hidden=h[0, 0]), ValueError, "hidden"),
    (lambda h, w, t: dict(weight=w[:, :-1]), ValueError, "hidden"),
    (lambda h, w, t: dict(weight=w[0]), ValueError, "weight"),
    (lambda h, w, t: dict(weight=w.double()), TypeError, "weight dtype"),
    (lambda h, w, t: dict(weight=w.to("meta")), ValueError, "weight is on"),
    (lambda h, w, t: dict(hidden=h.long()), TypeError, "hidden"),
    (lambda h, w, t: dict(targets=t.float()), TypeError, "targets"),
    (lambda h, w, t: dict(targets=t[:, :-1]), ValueError, "targets must have shape"),
    (lambda h, w, t: dict(targets=torch.full_like(t, 17)), ValueError, r"targets must be token ids in \[0, 17\)"),
    (lambda h, w, t: dict(targets=torch.full_like(t, -1)), ValueError, "targets"),
    (lambda h, w, t: dict(bias=torch.zeros(16)), ValueError, "bias"),
    (lambda h, w, t: dict(bias=torch.zeros(17, dtype=torch.float64)), TypeError, "bias"),
    (lambda h, w, t: dict(reduction="avg"), ValueError, "reduction"),
    (lambda h, w, t: dict(label_smoothing=1.0), ValueError, "label_smoothing"),
    (lambda h, w, t: dict(label_smoothing=-0.1), ValueError, "label_smoothing"),
    (lambda h, w, t: dict(z_loss=-1e-4), ValueError, "z_loss"),
    (lambda h, w, t: dict(z_loss=float("nan")), ValueError, "z_loss"),
    (lambda h, w, t: dict(softcap=0.0), ValueError, "softcap"),
    (lambda h, w, t: dict(chunk_size=0), ValueError, "chunk_size"),
    (lambda h, w, t: dict(chunk_size=2.5), ValueError, "chunk_size"),
    (lambda h, w, t: dict(ignore_index=None), TypeError, "ignore_index"),
    (lambda h, w, t: dict(shift=1), TypeError, "shift"),
]


@pytest.mark.parametrize("bad,error,match", BAD)
def test_bad_input_raises_error_naming_the_argument(gen, bad, error, match):
    hidden, weight, targets, _ = make(gen, shape=(2, 5), d=8, v=17)
    args = dict(hidden=hidden, weight=weight, targets=targets)
    args.update(bad(hidden, weight, targets))
    with pytest.raises(error, match=match):
        linear_cross_entropy(**args)


def test_sum_over_a_large_vocabulary_with_outlier_hidden_states_stays_float32_accurate():
    """Real hidden states have outlier dimensions; a softmax reduced along a strided axis accumulates its
    float32 rounding over V and drifted 2e-6 relative here (and 1.2e-4 on a real model's perplexity)."""
    g = torch.Generator().manual_seed(0)
    n, d, v = 96, 64, 50021
    hidden = torch.randn(n, d, generator=g)
    hidden[:, :3] *= 40
    weight = torch.randn(v, d, generator=g) * 0.05
    targets = torch.randint(0, v, (n,), generator=g)
    exact = F.cross_entropy(hidden.double() @ weight.double().T, targets, reduction="sum")
    got = linear_cross_entropy(hidden, weight, targets, reduction="sum")
    torch.testing.assert_close(got.double(), exact, rtol=5e-7, atol=0)


@pytest.mark.parametrize("options", [{}, {"label_smoothing": 0.1, "z_loss": 1e-3}])
def test_core_row_statistics_give_torch_cross_entropy_per_row(gen, options):
    """The per-chunk core that the vocab-parallel loss shares: statistics of the whole vocabulary (combined
    in-process by LossVocab) → torch's per-row loss, its logsumexp, and the chunk left holding log p."""
    logits = torch.randn(37, 1009, generator=gen) * 3
    targets = torch.randint(0, 1009, (37,), generator=gen)
    eps, zl = options.get("label_smoothing", 0.0), options.get("z_loss", 0.0)
    vocab = LossVocab(1009)
    t, has_t = vocab.local_targets(targets, torch.float32)
    assert has_t is None and torch.equal(t[:, 0], targets)
    z = logits.clone()
    lse, z_t, total = vocab.lse(row_stats_(z, t, has_t, bool(eps)))
    expected = F.cross_entropy(logits, targets, reduction="none", label_smoothing=eps)
    expected = expected + zl * torch.logsumexp(logits, -1) ** 2
    tol = reference.tolerance(torch.float32)
    torch.testing.assert_close(row_losses(lse, z_t, total, 1009, eps, zl), expected, **tol)
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1), **tol)
    torch.testing.assert_close(z, torch.log_softmax(logits, -1), **tol)
