"""The body's oneDNN linears: the same weights and the same outputs as transformers' modules, to fp32 rounding."""

from __future__ import annotations

import pytest
import reference
import torch
import torch.nn.functional as F
from tiny import tiny_model
from torch import nn

from lmhead import Model
from lmhead.models.fast_linear import OneDNNLinear, onednn_available, with_onednn_linears
from lmhead.models.model import BODY_MODES

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")


@pytest.mark.parametrize("shape", [(1, 64), (1, 1, 64), (3, 5, 64), (257, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_linear_equals_f_linear(shape, bias):
    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(64, 96, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(96, 64, generator=g))
        if bias:
            lin.bias.copy_(torch.randn(96, generator=g))
    x = torch.randn(*shape, generator=g)
    fast = OneDNNLinear(lin)
    with torch.no_grad():
        y = fast(x).double()
        # any fp32 summation order lies within γ_{D+1}·(Σ|x||w| + |b|) of the exact value (float64 reference)
        g = 65 * 2.0**-24 / (1 - 65 * 2.0**-24)
        mass = x.double().abs() @ lin.weight.double().abs().T
        if bias:
            mass = mass + lin.bias.double().abs()
        err = (y - reference.linear(x.double(), lin.weight, lin.bias)).abs()
        assert bool((err <= g * mass + 1e-30).all())
        torch.testing.assert_close(fast(x), F.linear(x, lin.weight, lin.bias), rtol=1e-4, atol=1e-5)
    assert fast.weight is lin.weight and fast.bias is lin.bias


def test_onednn_linear_takes_f_linear_when_autograd_records_or_dtype_differs():
    lin = nn.Linear(16, 8)
    fast = OneDNNLinear(lin)
    x = torch.randn(4, 16, requires_grad=True)
    fast(x).sum().backward()  # the oneDNN op has no backward: this must go through F.linear
    assert x.grad is not None and lin.weight.grad is not None
    with torch.no_grad():
        half = lin.to(torch.bfloat16)
        y = OneDNNLinear(half)(torch.randn(2, 16, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_copy_shares_every_weight_and_leaves_the_original_alone(arch):
    hf, _ = tiny_model(arch)
    body = hf.base_model
    fast = with_onednn_linears(body)
    assert fast is not body
    original = dict(body.named_parameters())
    for name, p in fast.named_parameters():
        assert p is original[name], name
    assert not any(isinstance(m, OneDNNLinear) for m in body.modules())
    n_linear = sum(type(m) is nn.Linear for m in body.modules())
    assert n_linear > 0 and sum(isinstance(m, OneDNNLinear) for m in fast.modules()) == n_linear


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_hidden_states_and_decode_steps_equal_transformers(arch, one_thread):
    hf, tok = tiny_model(arch)
    fast = Model(hf, tok, body="onednn")
    plain = Model(hf, tok, body="transformers")
    assert plain.body is hf.base_model and fast.body is not hf.base_model
    ids = torch.tensor([fast.encode("hello world, a longer prompt")])
    tol = dict(rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(fast.hidden_states(ids), plain.hidden_states(ids), **tol)
        caches = fast.new_cache(), plain.new_cache()
        fast.hidden_states(ids, past_key_values=caches[0])
        plain.hidden_states(ids, past_key_values=caches[1])
        nxt, pos = torch.tensor([[5]]), torch.tensor([[ids.shape[1]]])
        for _ in range(3):
            a = fast.hidden_states(nxt, past_key_values=caches[0], position_ids=pos)
            b = plain.hidden_states(nxt, past_key_values=caches[1], position_ids=pos)
            torch.testing.assert_close(a, b, **tol)
            pos = pos + 1


def test_greedy_tokens_equal_with_either_body(one_thread):
    from lmhead.sampling import SamplingConfig

    hf, tok = tiny_model("gemma3", softcap=30.0)
    greedy = SamplingConfig(temperature=0.0)
    a = [s.token_id for s in Model(hf, tok, body="onednn").generate("the cat sat", 16, config=greedy)]
    b = [s.token_id for s in Model(hf, tok, body="transformers").generate("the cat sat", 16, config=greedy)]
    assert a == b


def test_an_unknown_body_mode_names_the_allowed_ones():
    hf, tok = tiny_model("llama")
    with pytest.raises(ValueError, match="body must be one of auto, lean, onednn, transformers"):
        Model(hf, tok, body="fast")
    assert BODY_MODES == ("auto", "lean", "onednn", "transformers")  # lean: issue 13
    from lmhead import load_model

    with pytest.raises(ValueError, match="body must be one of"):
        load_model("smollm2-135m", body="fast")  # checked before anything is loaded



def test_without_onednn_the_body_is_transformers_own(monkeypatch):
    from lmhead.models import fast_linear, model

    monkeypatch.setattr(fast_linear, "onednn_available", lambda: False)
    monkeypatch.setattr(model, "onednn_available", lambda: False)
    hf, tok = tiny_model("llama")
    assert Model(hf, tok).body is hf.base_model  # "auto" falls back
    with pytest.raises(ValueError, match="no oneDNN"):
        Model(hf, tok, body="onednn")
