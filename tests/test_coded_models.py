"""The packaged models read their GGUF files' own codes: every block matrix and the head, the numbers checked
weight by weight against the float32 model, logits equal to transformers' forward, greedy tokens identical."""

from __future__ import annotations

import copy

import pytest
import torch

from lmhead.models.coded_linear import coded_available

pytestmark = [pytest.mark.model,
              pytest.mark.skipif(not coded_available(), reason="no C compiler: the coded kernel is not built")]


@pytest.mark.parametrize("name", ["gemma-3-270m", "smollm2-135m"])
def test_every_matrix_reads_its_codes_and_the_logits_equal_transformers(name):
    from lmhead import load_model

    model = load_model(name, progress=False)
    layers = model.config.get_text_config().num_hidden_layers
    assert model.coded_matrices == 7 * layers + 1  # q, k, v, o, gate, up, down per block, and the tied head
    assert model.exact_head.product is not None and model.head is model.exact_head
    # draft="auto": n-gram drafts where the head is the larger read (measured faster on Gemma, slower on SmolLM2)
    assert model.auto_draft() == {"gemma-3-270m": "ngram", "smollm2-135m": "none"}[name]
    blocks = model.hf_model.base_model.layers
    down = model.lean.layers[0].coded["down"].dequantize()
    q = model.lean.layers[-1].coded["qkv"].dequantize()[:blocks[-1].self_attn.q_proj.weight.shape[0]]
    for codes, block in ((down, blocks[0].mlp.down_proj), (q, blocks[-1].self_attn.q_proj)):
        assert torch.equal(codes, block.weight)  # lossless: the file's codes are the float32 weights exactly
    ids = torch.tensor([model.encode("The quick brown fox jumps over the lazy dog because")])
    with torch.no_grad():
        want = model.hf_model(ids).logits[0]
        exact = copy.deepcopy(model.hf_model).double()(ids).logits[0]  # the same weights' float64 forward
    lean = model.lean
    cache = lean.new_cache(1, ids.shape[1] + 2)
    got = []
    for t in range(ids.shape[1]):  # decode-sized calls: every product reads codes
        got.append(model.exact_head(lean(ids[:, t:t + 1], torch.tensor([[t]]), cache))[0])
    got = torch.cat(got).detach()
    # about as near the float64 logits as transformers' own float32 forward is (two float32 forwards that sum in
    # other orders differ from each other by about twice that). Torch's own error follows its BLAS's summation order,
    # which differs by CPU, and the integer path's slices add their representation error (at most 2^-23 of a group's
    # largest activation a weight, docs/decode.md) to the float32 rounding
    ours, theirs = float((got.double() - exact).abs().max()), float((want.double() - exact).abs().max())
    assert ours <= 1.5 * theirs, (ours, theirs)
    torch.testing.assert_close(got, want, atol=2.5 * theirs, rtol=0)


@pytest.mark.parametrize("name", ["gemma-3-270m", "smollm2-135m"])
def test_greedy_tokens_with_codes_and_ngram_drafts_equal_transformers(name):
    from lmhead import SamplingConfig, load_model

    model = load_model(name, progress=False)
    for prompt in ("The three most important inventions of the twentieth century are",
                   "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"):
        enc = model.tokenizer(prompt, return_tensors="pt")
        with torch.inference_mode():
            out = model.hf_model.generate(**enc, max_new_tokens=40, do_sample=False, temperature=None, top_p=None,
                                          top_k=None, pad_token_id=model.tokenizer.pad_token_id)
        want = out[0, enc["input_ids"].shape[1]:].tolist()
        got = [s.token_id for s in model.generate(prompt, len(want), config=SamplingConfig(temperature=0))]
        assert got == want[:len(got)] and len(got) >= len(want) - 1  # both stop at the end-of-text token


@pytest.mark.parametrize("name", ["gemma-3-270m", "smollm2-135m"])
def test_the_heads_screen_gives_the_exact_top_k_and_scoreless_greedy_tokens_equal_transformers(name):
    # both tied heads are Q8_0 codes: screened, each row's top k exact and the rest below; the greedy tokens of
    # scoreless rows (screened rounds of 4) are the float32 model's
    from lmhead import SamplingConfig, load_model
    from lmhead.kernels import native

    model = load_model(name, progress=False)
    product = model.exact_head.product
    assert product.screens == native.avx2()
    prompt = "The three most important inventions of the twentieth century are"
    ids = torch.tensor([model.encode(prompt)])
    with torch.inference_mode():
        hidden = model.hidden_states(ids)[0, -8:].contiguous()
        got = model.exact_head.screen(hidden, [41] * 8) if product.screens else model.exact_head(hidden)
        for r in range(8):
            want = model.exact_head(hidden[r:r + 1])[0].topk(41)
            top = got[r].topk(41)
            assert torch.equal(top.indices, want.indices) and torch.equal(top.values, want.values)
        enc = model.tokenizer(prompt, return_tensors="pt")
        out = model.hf_model.generate(**enc, max_new_tokens=24, do_sample=False, temperature=None, top_p=None,
                                      top_k=None, pad_token_id=model.tokenizer.pad_token_id)
    want = out[0, enc["input_ids"].shape[1]:].tolist()
    greedy = SamplingConfig(temperature=0)
    steps = list(model.generate([prompt] * 4, 24, config=greedy, scores=False))  # 4 rows: screened rounds
    rows = [[s.token_id for s in steps if s.index == b] for b in range(4)]
    assert all(r == want[:len(r)] and len(r) >= len(want) - 1 for r in rows)
