"""lmhead.integrations.generation: lmhead's pipeline inside `generate()` gives transformers' own warpers'
tokens for the same settings (draw=False, same torch seed), lmhead.sample's tokens (draw=True), and seeded rows
independent of the batch."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from tiny import tiny_model  # noqa: E402

from lmhead.integrations.generation import (  # noqa: E402
    SamplingLogitsProcessor,
    config_from_generation_config,
    generate_kwargs,
)
from lmhead.sampling import SamplingConfig, sample  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # many tiny ops: thread handshakes cost more than the ops

SETTINGS = [
    dict(temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.3),
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=1.3, top_p=0.7),
    dict(temperature=0.0, repetition_penalty=1.2),
]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")[0]


def prompts(seed: int = 0, b: int = 3, t: int = 6) -> torch.Tensor:
    return torch.randint(4, 300, (b, t), generator=torch.Generator().manual_seed(seed))


def hf_kwargs(s: dict) -> dict:
    """transformers' own processors for the same settings."""
    return dict(do_sample=s["temperature"] > 0, temperature=s["temperature"] or 1.0, top_k=s.get("top_k", 0),
                top_p=s.get("top_p", 1.0), min_p=s.get("min_p"), repetition_penalty=s.get("repetition_penalty", 1.0))


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_draw_false_gives_the_tokens_of_transformers_warpers(model, settings):
    ids = prompts()
    torch.manual_seed(0)
    theirs = model.generate(ids, max_new_tokens=12, pad_token_id=0, **hf_kwargs(settings))
    torch.manual_seed(0)
    ours = model.generate(ids, max_new_tokens=12, pad_token_id=0,
                          **generate_kwargs(SamplingConfig(**settings), draw=False))
    assert torch.equal(ours, theirs)


def test_draw_true_takes_lmhead_sample_tokens(model):
    """Step by step, the processor's token is lmhead.sample's on the same logits with the same generator."""
    cfg = SamplingConfig(temperature=0.9, top_k=40, presence_penalty=0.5, frequency_penalty=0.3,
                         logit_bias={7: 2.0}, banned_tokens=(8,))
    ids = prompts(1)
    out = model.generate(ids, max_new_tokens=8, pad_token_id=0,
                         **generate_kwargs(cfg, generator=torch.Generator().manual_seed(5)))
    gen = torch.Generator().manual_seed(5)
    seq = ids
    for _ in range(8):
        with torch.no_grad():
            logits = model(seq).logits[:, -1].float()
        nxt = sample(logits, cfg, gen, prev_tokens=seq, prompt_len=ids.shape[1])
        seq = torch.cat([seq, nxt[:, None]], dim=1)
    assert torch.equal(out, seq)
    assert not (out[:, ids.shape[1]:] == 8).any()


def test_seeded_rows_do_not_depend_on_the_batch_or_global_rng(model):
    cfg = SamplingConfig(temperature=1.0, top_p=0.95, seed=11)
    ids = prompts(2)
    torch.manual_seed(1)
    batch = model.generate(ids, max_new_tokens=10, pad_token_id=0, **generate_kwargs(cfg))
    torch.manual_seed(2)
    alone = model.generate(ids[2:3], max_new_tokens=10, pad_token_id=0, **generate_kwargs(cfg))
    assert torch.equal(batch[2:3], alone)


def test_one_processor_follows_consecutive_generate_calls(model):
    """A second generate call with the same processor starts a new prompt (penalties, seeded steps)."""
    kw = generate_kwargs(SamplingConfig(temperature=0.7, repetition_penalty=1.5, seed=3))
    ids = prompts(3, b=2)
    first = model.generate(ids, max_new_tokens=6, pad_token_id=0, **kw)
    again = model.generate(ids, max_new_tokens=6, pad_token_id=0, **kw)
    assert torch.equal(first, again)


def test_per_row_configs(model):
    configs = [SamplingConfig(temperature=0.0), SamplingConfig(temperature=1.0, top_k=5, seed=1)]
    ids = prompts(4, b=2)
    out = model.generate(ids, max_new_tokens=5, pad_token_id=0, **generate_kwargs(configs))
    greedy = model.generate(ids[:1], max_new_tokens=5, pad_token_id=0, do_sample=False)
    assert torch.equal(out[:1], greedy)


def test_generation_config_mapping():
    from transformers import GenerationConfig

    gc = GenerationConfig(do_sample=True, temperature=0.7, top_k=64, top_p=0.95, repetition_penalty=1.1,
                          bad_words_ids=[[5], [9]])
    assert config_from_generation_config(gc) == SamplingConfig(
        temperature=0.7, top_k=64, top_p=0.95, repetition_penalty=1.1, banned_tokens=(5, 9))
    assert config_from_generation_config({"do_sample": False}).is_greedy
    assert config_from_generation_config(GenerationConfig(do_sample=True, typical_p=0.5, bad_words_ids=[[5, 6]])) \
        == SamplingConfig(typical_p=0.5, bad_words=((5, 6),), samplers="transformers")
    with pytest.raises(ValueError, match="sequence_bias"):
        config_from_generation_config(GenerationConfig(do_sample=True, sequence_bias={(5,): 1.0}))
    with pytest.raises(ValueError, match="num_beams"):
        config_from_generation_config(GenerationConfig(num_beams=4))


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="seed needs draw=True"):
        SamplingLogitsProcessor(SamplingConfig(seed=1), draw=False)
    with pytest.raises(TypeError, match="config must be"):
        SamplingLogitsProcessor(0.7)
    with pytest.raises(TypeError, match="generator"):
        SamplingLogitsProcessor(generator=1)
    with pytest.raises(ValueError, match="top_k"):
        SamplingLogitsProcessor({"top_k": -1})
    proc = SamplingLogitsProcessor([SamplingConfig(), SamplingConfig()])
    with pytest.raises(ValueError, match="one SamplingConfig per row"):
        proc(torch.zeros(3, 4, dtype=torch.long), torch.zeros(3, 10))
