"""lmhead.sampling against Hugging Face transformers' own logits processors (the exact-semantics promise)."""

from __future__ import annotations

import pytest
import torch

from lmhead.sampling import SamplingConfig, apply_penalties, probabilities, process_logits

lp = pytest.importorskip("transformers.generation.logits_process")


pytestmark = pytest.mark.usefixtures("one_thread")


def hf_probabilities(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """TemperatureLogitsWarper → TopKLogitsWarper → TopPLogitsWarper → MinPLogitsWarper, then softmax,
    each added only when enabled (as `generate` does), with HF's defaults (min_tokens_to_keep=1, -inf)."""
    scores = logits.float()
    ids = torch.zeros(scores.shape[0], 1, dtype=torch.long)
    scores = lp.TemperatureLogitsWarper(float(cfg.temperature))(ids, scores)
    if cfg.top_k:
        scores = lp.TopKLogitsWarper(cfg.top_k)(ids, scores)
    if cfg.top_p < 1.0:
        scores = lp.TopPLogitsWarper(cfg.top_p)(ids, scores)
    if cfg.min_p > 0.0:
        scores = lp.MinPLogitsWarper(cfg.min_p)(ids, scores)
    return torch.softmax(scores, dim=-1)


def lm_like(batch: int, vocab: int, seed: int, scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vocab, generator=g) * scale


SETTINGS = [
    dict(temperature=0.8, top_k=50, top_p=0.9),
    dict(temperature=1.0, top_k=1),
    dict(temperature=0.5, top_k=200),
    dict(temperature=1.2, top_p=0.9),
    dict(temperature=0.7, top_p=0.5),
    dict(temperature=1.0, top_p=0.99),
    dict(temperature=1.0, min_p=0.05),
    dict(temperature=0.9, top_k=100, top_p=0.95, min_p=0.1),
    dict(temperature=2.0, top_p=0.3, min_p=0.3),
    dict(temperature=1.5, top_k=20, min_p=0.5),
    dict(temperature=1.0, min_p=1.0),
]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize(("batch", "vocab", "scale"), [(4, 1000, 1.0), (3, 49_152, 4.0), (2, 5003, 0.3)])
def test_probabilities_equal_hf_warper_chain(settings, batch, vocab, scale):
    x = lm_like(batch, vocab, seed=vocab + batch, scale=scale)
    cfg = SamplingConfig(**settings)
    ours, theirs = probabilities(x, cfg), hf_probabilities(x, cfg)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    assert torch.equal(ours > 0, theirs > 0)  # the same kept set, not just close numbers


def test_probabilities_equal_hf_on_gemma_sized_vocabulary():
    x = lm_like(2, 262_144, seed=1, scale=3.0)
    for cfg in [SamplingConfig(temperature=0.8, top_k=50, top_p=0.9), SamplingConfig(temperature=0.8, top_p=0.9)]:
        ours, theirs = probabilities(x, cfg), hf_probabilities(x, cfg)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
        assert torch.equal(ours > 0, theirs > 0)


def test_hf_equivalence_with_low_precision_ties():
    # bfloat16 logits have many exact ties; HF's top-k keeps ties with the k-th, and so do we
    x = lm_like(4, 3000, seed=3, scale=2.0).bfloat16()
    for cfg in [SamplingConfig(top_k=10), SamplingConfig(temperature=0.7, top_k=37, min_p=0.05)]:
        ours, theirs = probabilities(x, cfg), hf_probabilities(x.float(), cfg)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_equals_hf(penalty):
    x = lm_like(3, 500, seed=4, scale=2.0)
    prev = torch.randint(0, 500, (3, 40), generator=torch.Generator().manual_seed(5))
    theirs = lp.RepetitionPenaltyLogitsProcessor(penalty)(prev, x.clone())
    torch.testing.assert_close(apply_penalties(x, prev, repetition_penalty=penalty), theirs, rtol=0, atol=0)
    cfg = SamplingConfig(repetition_penalty=penalty)
    torch.testing.assert_close(process_logits(x, cfg, prev_tokens=prev), theirs, rtol=0, atol=0)
