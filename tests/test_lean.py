"""The lean body (models/lean.py) equals transformers' forward: prefill, decode steps, padded batches, rollback."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_model

from lmhead.models.lean import LeanBody, StaticCache

ATOL = 1e-5  # fp32: the lean body sums in another order (fused products, batched heads) than transformers
# the tiny Phi-3 of three layers gathers more rounding: transformers' own forward is 9e-6 from a float64 forward
# there, the lean body's 2e-5 (and both are 1e-5 or less on other seeds)
# the tiny Mistral's unpadded 14-token row (every layer sliding) built for AVX-512 sums in yet another order:
# 1.1e-5 from transformers at values up to 4.4, 1.7e-5 from a float64 forward (transformers' own 6e-6)
ARCH_ATOL = {"phi3": 3e-5, "mistral": 2e-5}


def _other(arch: str, seed: int = 0, layers: int = 2):
    """A tiny model of an architecture tiny.py does not build (4 heads, 2 key heads, random norms and biases)."""
    from transformers import AutoModelForCausalLM, Gemma2Config, MistralConfig, Phi3Config, Qwen2Config, Qwen3Config

    common = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=False, initializer_range=0.3)
    if arch == "mistral":  # a window shorter than the tests' sequences: every layer slides
        config = MistralConfig(sliding_window=8, **common)
    elif arch == "phi3":  # fused q/k/v and gate/up; every layer slides, as Mistral's
        config = Phi3Config(sliding_window=8, pad_token_id=0, **common)
    elif arch == "gemma2":  # sliding layers alternate; a softcap small enough to bend the scores
        config = Gemma2Config(sliding_window=8, head_dim=8, query_pre_attn_scalar=16, attn_logit_softcapping=2.0,
                              **common)
    else:
        config = Qwen2Config(**common) if arch == "qwen2" else Qwen3Config(head_dim=8, **common)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name or "bias" in name:
                    param.add_(0.5 * torch.randn_like(param))
    return model.eval()


def _model(arch: str, layers: int = 2):
    if arch in ("llama", "gemma3"):
        return tiny_model(arch, layers=layers)[0]
    return _other(arch, layers=layers)


def _reference(hf_model, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' own final hidden states [B,T,D] (after the final norm) for the whole sequence."""
    positions = None if mask is None else (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return hf_model.base_model(input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state


ARCHS = ["llama", "gemma3", "qwen2", "qwen3", "mistral", "gemma2", "phi3"]


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_then_steps_equal_the_full_forward(arch):
    hf_model = _model(arch, layers=3)
    lean = LeanBody(hf_model)
    ids = torch.randint(4, 290, (1, 20), generator=torch.Generator().manual_seed(1))
    want = _reference(hf_model, ids)
    cache = lean.new_cache(1, 32)
    got = [lean(ids[:, :11], torch.arange(11)[None], cache)]
    for t in range(11, 16):  # one token at a time
        got.append(lean(ids[:, t:t + 1], torch.tensor([[t]]), cache))
    got.append(lean(ids[:, 16:], torch.arange(16, 20)[None], cache))  # several at once (verification)
    torch.testing.assert_close(torch.cat(got, dim=1), want, atol=ARCH_ATOL.get(arch, ATOL), rtol=0)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "mistral", "gemma2", "phi3"])
def test_left_padded_rows_equal_each_row_alone(arch):
    hf_model = _model(arch)
    lean = LeanBody(hf_model)
    g = torch.Generator().manual_seed(2)
    rows = [torch.randint(4, 290, (n,), generator=g) for n in (14, 9)]  # 14 > sliding window 8 in gemma3
    width = 14
    ids = torch.zeros((2, width), dtype=torch.long)
    mask = torch.zeros((2, width), dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, width - len(row):] = row
        mask[r, width - len(row):] = 1
    cache = lean.new_cache(2, 20)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    hidden = lean(ids, positions, cache, valid=mask.bool())
    nxt = torch.tensor([[7], [9]])
    step = lean(nxt, positions[:, -1:] + 1, cache)
    for r, row in enumerate(rows):
        alone = _reference(hf_model, torch.cat([row, nxt[r]])[None])
        atol = ARCH_ATOL.get(arch, ATOL)
        torch.testing.assert_close(hidden[r, width - len(row):], alone[0, :-1], atol=atol, rtol=0)
        torch.testing.assert_close(step[r], alone[0, -1:], atol=atol, rtol=0)


def test_truncate_rolls_back_rejected_columns():
    hf_model = _model("gemma3", layers=2)
    lean = LeanBody(hf_model)
    ids = torch.randint(4, 290, (1, 12), generator=torch.Generator().manual_seed(3))
    cache = lean.new_cache(1, 16)
    lean(ids[:, :8], torch.arange(8)[None], cache)
    lean(torch.tensor([[5, 6, 7]]), torch.arange(8, 11)[None], cache)  # a draft that gets rejected
    cache.truncate(8)
    got = lean(ids[:, 8:], torch.arange(8, 12)[None], cache)
    torch.testing.assert_close(got, _reference(hf_model, ids)[:, 8:], atol=ATOL, rtol=0)


def test_a_rope_over_part_of_each_head_is_left_to_transformers():
    from transformers import AutoModelForCausalLM, Phi3Config

    config = Phi3Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, pad_token_id=0,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    model = AutoModelForCausalLM.from_config(config)
    assert not LeanBody.supports(model)
    with pytest.raises(ValueError, match="partial_rotary_factor 0.5"):
        LeanBody(model)


def test_weights_are_shared_not_copied():
    hf_model = _model("llama")
    before = sum(p.numel() for p in hf_model.parameters())
    lean = LeanBody(hf_model)
    attn = hf_model.model.layers[0].self_attn
    assert attn.q_proj.weight.untyped_storage().data_ptr() == lean.layers[0].qkv.untyped_storage().data_ptr()
    assert sum(p.numel() for p in hf_model.parameters()) == before
    LeanBody(hf_model)  # a second lean body on the same model reuses the fused buffer
    assert attn.q_proj.weight.untyped_storage().data_ptr() == lean.layers[0].qkv.untyped_storage().data_ptr()


def _filled_cache(batch: int, seed: int = 0, capacity: int = 12) -> StaticCache:
    """A cache of `batch` rows, 9 columns used: row r's valid columns from column r on (its left padding), a
    hole at column 6 in odd rows (a rejected draft), numbered keys, values, positions and ids."""
    g = torch.Generator().manual_seed(seed)
    cache = StaticCache(layers=2, batch=batch, kv_heads=1, head_dim=3, capacity=capacity)
    cache.length = 9
    for r in range(batch):
        cache.valid[r, r % 9:9] = True
        if r % 2:
            cache.valid[r, 6] = False
    cache.keys[:, :, :, :9] = torch.randn(2, batch, 1, 9, 3, generator=g)
    cache.values[:, :, :, :9] = torch.randn(2, batch, 1, 9, 3, generator=g)
    cache.positions[:, :9] = torch.arange(9) + 100 * torch.arange(batch)[:, None]
    cache.tokens[:, :9] = torch.randint(0, 50, (batch, 9), generator=g)
    return cache


def _row(cache: StaticCache, r: int) -> tuple:
    """What attention reads of row r: its validity, and keys, values, positions and ids of its valid columns."""
    cols = cache.valid[r, :cache.length].nonzero().squeeze(1)
    return (cache.valid[r, :cache.length].clone(), cache.keys[:, r, :, cols].clone(),
            cache.values[:, r, :, cols].clone(), cache.positions[r, cols].clone(), cache.tokens[r, cols].clone())


@pytest.mark.parametrize("keep", [[0, 2], [1, 2, 3], [0, 1], [2], [0, 1, 4], [0, 3, 4], [1, 3], [3, 0, 2], []])
def test_select_keeps_each_kept_rows_columns(keep):
    cache = _filled_cache(5)
    before = [_row(cache, r) for r in range(5)]
    cache.select(torch.tensor(keep, dtype=torch.long))
    assert cache.batch == len(keep) and cache.length == 9
    for i, r in enumerate(keep):
        for got, want in zip(_row(cache, i), before[r], strict=True):
            assert torch.equal(got, want)
    assert cache.in_blocks()


def test_select_moves_the_side_of_a_dropped_row_that_holds_less():
    def first_row_after(keep: list[int], short: int) -> int:
        """Which row of the cache's memory is the first kept one after `select(keep)`, row `short` holding one
        column."""
        cache = _filled_cache(5)
        cache.valid[short, :8] = False
        base, row = cache.keys.data_ptr(), cache.keys.stride(1) * cache.keys.element_size()
        before = [_row(cache, r) for r in keep]
        cache.select(torch.tensor(keep))
        for i, want in enumerate(before):
            assert all(torch.equal(a, b) for a, b in zip(_row(cache, i), want, strict=True))
        return (cache.keys.data_ptr() - base) // row

    assert first_row_after([1, 2, 3, 4], short=0) == 1  # a run of rows: a narrower view, nothing moved
    assert first_row_after([0, 1, 2, 4], short=4) == 0  # row 4 moved next to rows 0..2
    assert first_row_after([0, 2, 3, 4], short=0) == 1  # row 0 moved next to rows 2..4


def test_a_view_is_rows_of_its_cache():
    cache = _filled_cache(4)
    view = cache.view(1, 3)
    assert view.batch == 2 and view.in_blocks() and view.layer_stride == cache.layer_stride
    view.keys[1, 1, 0, 10, 2] = 7.0
    view.valid[1, 10] = True
    assert float(cache.keys[1, 2, 0, 10, 2]) == 7.0 and bool(cache.valid[2, 10])
    with pytest.raises(ValueError, match=r"rows must be within \[0, 4\]"):
        cache.view(2, 5)


def test_new_large_caches_are_zeros_until_written():
    from lmhead.models.lean import LAZY_BYTES, cache_zeros

    big = cache_zeros((LAZY_BYTES // 4 + 5,), torch.float32)
    small = cache_zeros((3, 2), torch.long)
    assert big.dtype == torch.float32 and not bool(big.any()) and not bool(small.any())
    big[-1] = 2.0
    assert float(big.sum()) == 2.0
    cache = StaticCache(layers=2, batch=3, kv_heads=1, head_dim=64, capacity=4096)  # 3 MiB of keys: mapped
    assert not bool(cache.keys.any()) and not bool(cache.valid.any()) and cache.in_blocks()


def test_unsupported_model_and_overflow_are_clear_errors():
    from transformers import GPT2Config, GPT2LMHeadModel

    with pytest.raises(ValueError, match="lean body supports"):
        LeanBody(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50)))
    lean = LeanBody(_model("llama"))
    with pytest.raises(ValueError, match="cache holds 4 columns"):
        lean(torch.zeros((1, 5), dtype=torch.long), torch.arange(5)[None], lean.new_cache(1, 4))
    with pytest.raises(ValueError, match="length must be in"):
        lean.new_cache(1, 4).truncate(2)


def test_compact_gives_back_holes_without_changing_attention():
    hf_model = _model("gemma3", layers=2)
    lean = LeanBody(hf_model)
    ids = torch.randint(4, 290, (2, 12), generator=torch.Generator().manual_seed(4))
    cache = lean.new_cache(2, 24)
    lean(ids[:, :8], torch.arange(8).expand(2, 8), cache)
    lean(torch.tensor([[5, 6, 7], [5, 6, 7]]), torch.arange(8, 11).expand(2, 3), cache)
    cache.invalidate(0, 8)  # row 0 rejected all three, row 1 kept one
    cache.invalidate(1, 9)
    before = lean(ids[:, 8:9], torch.tensor([[8], [9]]), cache)
    cache.truncate(cache.length - 1)
    cache.compact()
    assert cache.length == 9
    after = lean(ids[:, 8:9], torch.tensor([[8], [9]]), cache)
    torch.testing.assert_close(after, before, atol=ATOL, rtol=0)


def test_a_fused_model_still_saves_and_reloads_its_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    hf_model = _model("llama")
    LeanBody(hf_model)  # q/k/v and gate/up now view one buffer each
    hf_model.save_pretrained(tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    for name, tensor in hf_model.state_dict().items():
        assert torch.equal(back[name], tensor), name


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_rope_table_rows_equal_the_rotary_module_at_any_position(arch):
    lean = LeanBody(_model(arch))
    x = torch.zeros(1, 1, 4)
    for positions in (torch.tensor([[3]]), torch.tensor([[0, 7, 511, 512, 1500]]), torch.tensor([[2], [9]])):
        for kind in lean.layer_types:
            got, want = lean._rotary(x, positions, kind), lean._rotary_rows(x, positions, kind)
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, atol=1e-6, rtol=0)
