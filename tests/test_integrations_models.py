"""The patched packaged models (SmolLM2 135M, Gemma 3 270M) give the unpatched model's loss and every gradient
(float32 rounding: loss rtol 1e-5, each gradient's relative norm error ≤ 1e-4) on a few short padded sequences
with ignored labels, a softcap and gradient accumulation."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from lmhead.integrations.transformers import apply_fused_loss  # noqa: E402

pytestmark = pytest.mark.model

TEXTS = ["The cat sat on the mat.", "Language models predict the next token, one at a time.",
         "Hello world!", "Perplexity is the exponential of the mean loss over the tokens."]


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma-3-270m"])
def models(request):
    import lmhead

    model = lmhead.load_model(request.param, head="fp32", body="transformers")
    ref = model.hf_model
    return ref, apply_fused_loss(copy.deepcopy(ref)), model.tokenizer


def micro_batches(tokenizer):
    """Two left-padded micro-batches; labels -100 at padding and over each row's first two tokens."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    out = []
    for texts in (TEXTS[:2], TEXTS[2:]):
        enc = tokenizer(texts, return_tensors="pt", padding=True)
        labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        first = enc["attention_mask"].argmax(dim=1)
        for row, start in enumerate(first.tolist()):
            labels[row, start : start + 2] = -100
        out.append((enc["input_ids"], enc["attention_mask"], labels))
    return out


def test_loss_and_gradients_equal_the_unpatched_model(models):
    ref, model, tokenizer = models
    for m in (ref, model):
        m.zero_grad(set_to_none=True)
    batches = micro_batches(tokenizer)
    items = torch.tensor(sum(int((lab[:, 1:] != -100).sum()) for *_, lab in batches))
    softcap = 30.0 if "Gemma3" in type(ref).__name__ else None  # Gemma 3 ships without one: test it anyway
    for m in (ref, model):
        m.config.final_logit_softcapping = softcap if softcap else getattr(m.config, "final_logit_softcapping", None)
    try:
        for ids, mask, labels in batches:  # gradient accumulation: sum / tokens of both micro-batches
            loss_ref = ref(ids, attention_mask=mask, labels=labels, num_items_in_batch=items).loss
            out = model(ids, attention_mask=mask, labels=labels, num_items_in_batch=items)
            assert out.logits is None
            torch.testing.assert_close(out.loss, loss_ref, rtol=1e-5, atol=1e-6)
            loss_ref.backward()
            out.loss.backward()
        g_ref = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
        g = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert g.keys() == g_ref.keys() and g
        for name, grad in g_ref.items():
            # Relative error of each parameter's gradient (Frobenius norm) ≤ 1e-4: through 30 layers float32
            # rounding reaches ~1e-5 (the unpatched model's own error against float64 is up to 1e-5 here too)
            err = float((g[name] - grad).norm() / grad.norm().clamp_min(1e-30))
            assert err <= 1e-4, f"{name}: relative gradient error {err:.2e}"
    finally:
        if softcap:
            for m in (ref, model):
                m.config.final_logit_softcapping = None
