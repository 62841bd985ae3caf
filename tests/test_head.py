"""LMHead against the plain definition (tests/reference.py: F.linear in the weight's dtype, upcast, softcap)."""

from __future__ import annotations

import pytest
import reference
import torch
from torch import nn

from lmhead import LMHead, linear_cross_entropy

B, T, D, V = 2, 9, 24, 301


@pytest.fixture
def hidden(gen) -> torch.Tensor:
    return torch.randn(B, T, D, generator=gen)


def make_head(gen, **kw) -> LMHead:
    head = LMHead(D, V, **kw)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, D, generator=gen) * 0.3)
        if head.bias is not None:
            head.bias.copy_(torch.randn(V, generator=gen))
    return head


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_logits_match_reference_for_batched_and_flat_hidden(gen, hidden, bias, softcap):
    head = make_head(gen, bias=bias, softcap=softcap)
    expected = reference.lm_head_logits(hidden, head.weight, head.bias, softcap)
    out = head(hidden)
    assert out.shape == (B, T, V) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, **reference.tolerance(torch.float32))
    flat = head(hidden.reshape(B * T, D))  # [N,D] rows are positions -> [N,V]
    torch.testing.assert_close(flat, expected.reshape(B * T, V), **reference.tolerance(torch.float32))


def test_softcap_bounds_logits_and_applies_the_same_with_and_without_grad(gen, hidden):
    head = make_head(gen, softcap=1.5)
    with torch.no_grad():
        inference = head(hidden * 10)  # in-place path
    training = head(hidden * 10)
    assert training.requires_grad
    assert inference.abs().max() <= 1.5
    torch.testing.assert_close(inference, training.detach(), rtol=0, atol=0)
    raw = reference.lm_head_logits(hidden * 10, head.weight)
    assert raw.abs().max() > 1.5  # the cap did something


@pytest.mark.parametrize("k", [1, 4, T, T + 5])
def test_logits_to_keep_projects_only_the_last_positions(gen, hidden, k):
    head = make_head(gen)
    out = head(hidden, logits_to_keep=k)
    assert out.shape == (B, min(k, T), V)
    torch.testing.assert_close(out, head(hidden)[:, -k:], **reference.tolerance(torch.float32))
    expected = reference.lm_head_logits(hidden, head.weight, logits_to_keep=k)
    torch.testing.assert_close(out, expected, **reference.tolerance(torch.float32))
    assert head(hidden.reshape(B * T, D), logits_to_keep=k).shape == (min(k, B * T), V)


def test_logits_to_keep_zero_keeps_every_position(gen, hidden):
    head = make_head(gen)
    torch.testing.assert_close(head(hidden, logits_to_keep=0), head(hidden), rtol=0, atol=0)


def test_every_logit_is_exact_so_exact_k_changes_nothing(gen, hidden):
    # the call signature every head shares: a compressed head makes its top exact_k exact, this one all V
    head = make_head(gen)
    assert head.exact_k == V
    for k in (0, 5, V, None):
        torch.testing.assert_close(head(hidden, logits_to_keep=2, exact_k=k), head(hidden, logits_to_keep=2),
                                   rtol=0, atol=0)
    for k in (-1, V + 1, 2.5, True):
        with pytest.raises(ValueError, match=r"exact_k must be an int in \[0, 301\]"):
            head(hidden, exact_k=k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_weight_multiplies_in_16bit_and_returns_float32(gen, hidden, dtype):
    head = make_head(gen, dtype=dtype, bias=True)
    assert head.weight.dtype == dtype
    out = head(hidden.to(dtype))
    assert out.dtype == torch.float32
    # exactly the reference: the matmul in 16 bits (its rounding included), then the upcast
    expected = reference.lm_head_logits(hidden.to(dtype), head.weight, head.bias)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    fp32 = reference.lm_head_logits(hidden.to(dtype).float(), head.weight.float(), head.bias.float())
    torch.testing.assert_close(out, fp32, **reference.tolerance(dtype))


def test_float64_weight_keeps_float64_logits(gen, hidden):
    head = make_head(gen, dtype=torch.float64)
    assert head(hidden.double()).dtype == torch.float64


def test_tie_to_shares_the_embedding_parameter(gen, hidden):
    emb = nn.Embedding(V, D)
    head = LMHead(D, V, tie_to=emb)
    assert head.weight is emb.weight and head.tied
    model = nn.ModuleDict({"emb": emb, "head": head})
    assert len(list(model.parameters())) == 1  # one Parameter, counted once
    ids = torch.randint(0, V, (B, T), generator=gen)
    logits = head(emb(ids))
    logits.sum().backward()
    assert emb.weight.grad is not None  # both uses accumulate into the one gradient
    with torch.no_grad():
        emb.weight[0].fill_(1.0)
    assert torch.all(head.weight[0] == 1.0)


def test_gradients_flow_to_hidden_weight_and_bias_like_reference(gen, hidden):
    head = make_head(gen, bias=True, softcap=3.0)
    h = hidden.clone().requires_grad_()
    grad = torch.randn(B, T, V, generator=gen)
    (head(h) * grad).sum().backward()
    h2 = hidden.clone().requires_grad_()
    w2 = head.weight.detach().clone().requires_grad_()
    b2 = head.bias.detach().clone().requires_grad_()
    (reference.lm_head_logits(h2, w2, b2, 3.0) * grad).sum().backward()
    for ours, ref in ((h.grad, h2.grad), (head.weight.grad, w2.grad), (head.bias.grad, b2.grad)):
        torch.testing.assert_close(ours, ref, **reference.tolerance(torch.float32))


def test_from_weight_wraps_without_copying(gen):
    weight = nn.Parameter(torch.randn(V, D, generator=gen))
    bias = nn.Parameter(torch.randn(V, generator=gen))
    head = LMHead.from_weight(weight, bias, softcap=30.0)
    assert head.weight is weight and head.bias is bias and head.softcap == 30.0
    assert (head.d_model, head.vocab_size) == (D, V)
    plain = torch.randn(V, D, generator=gen)
    wrapped = LMHead.from_weight(plain)
    assert wrapped.weight.data_ptr() == plain.data_ptr() and wrapped.bias is None
    assert [n for n, _ in wrapped.named_parameters()] == ["weight"]


@pytest.mark.parametrize("options", [{}, {"reduction": "sum", "shift": True, "label_smoothing": 0.1}])
def test_loss_uses_the_heads_weight_bias_and_softcap(gen, hidden, options):
    head = make_head(gen, bias=True, softcap=4.0)
    targets = torch.randint(0, V, (B, T), generator=gen)
    ours = head.loss(hidden, targets, **options)
    direct = linear_cross_entropy(hidden, head.weight, targets, bias=head.bias, softcap=4.0, **options)
    torch.testing.assert_close(ours, direct, rtol=0, atol=0)
    expected, _ = reference.linear_cross_entropy(hidden, head.weight, targets, head.bias, softcap=4.0, **options)
    torch.testing.assert_close(ours, expected, **reference.tolerance(torch.float32))
    ours.backward()
    assert head.weight.grad is not None and head.bias.grad is not None
    with pytest.raises(TypeError, match="softcap"):
        head.loss(hidden, targets, softcap=2.0)


BAD_CONSTRUCT = [
    (dict(d_model=0, vocab_size=V), ValueError, "d_model"),
    (dict(d_model=D, vocab_size=-1), ValueError, "vocab_size"),
    (dict(d_model=D, vocab_size=2.5), ValueError, "vocab_size"),
    (dict(d_model=D, vocab_size=V, softcap=0.0), ValueError, "softcap"),
    (dict(d_model=D, vocab_size=V, softcap=float("inf")), ValueError, "softcap"),
    (dict(d_model=D, vocab_size=V, tie_to=nn.Linear(D, V)), TypeError, "tie_to"),
    (dict(d_model=D, vocab_size=V, tie_to=nn.Embedding(V + 1, D)), ValueError, r"tie_to.*\[301, 24\]"),
    (dict(d_model=D, vocab_size=V, tie_to=nn.Embedding(V, D), dtype=torch.bfloat16), TypeError, "dtype"),
    (dict(d_model=D, vocab_size=V, bias=torch.zeros(V)), TypeError, "bias"),
]


@pytest.mark.parametrize("kwargs,error,match", BAD_CONSTRUCT)
def test_bad_construction_raises_error_naming_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        LMHead(**kwargs)


def test_bad_forward_input_raises_error_naming_the_argument(gen, hidden):
    head = make_head(gen)
    with pytest.raises(ValueError, match=r"hidden must be .* D = d_model = 24, got shape \[2, 9, 23\]"):
        head(hidden[..., :-1])
    with pytest.raises(ValueError, match="hidden"):
        head(hidden[0, 0])
    with pytest.raises(TypeError, match="hidden dtype torch.float64"):
        head(hidden.double())
    with pytest.raises(ValueError, match="hidden is on meta"):
        head(hidden.to("meta"))
    with pytest.raises(TypeError, match="hidden must be a torch.Tensor"):
        head(hidden.tolist())
    for k in (-1, 1.5, True):
        with pytest.raises(ValueError, match="logits_to_keep"):
            head(hidden, logits_to_keep=k)


def test_from_weight_rejects_mismatched_bias(gen):
    weight = torch.randn(V, D, generator=gen)
    with pytest.raises(ValueError, match="bias"):
        LMHead.from_weight(weight, torch.zeros(V - 1))
    with pytest.raises(TypeError, match="bias"):
        LMHead.from_weight(weight, torch.zeros(V, dtype=torch.float64))
    with pytest.raises(ValueError, match="weight"):
        LMHead.from_weight(torch.randn(V))
