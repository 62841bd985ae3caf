"""The packaged models read their GGUF files' own codes: every block matrix and the head, the numbers checked
weight by weight against the float32 model, logits equal to transformers' forward, greedy tokens identical."""

from __future__ import annotations

import pytest
import torch

from lmhead.models.coded_linear import coded_available

pytestmark = [pytest.mark.model,
              pytest.mark.skipif(not coded_available(), reason="no C compiler: the coded kernel is not built")]


@pytest.mark.parametrize("name", ["gemma-3-270m", "smollm2-135m"])
def test_every_matrix_reads_its_codes_and_the_logits_equal_transformers(name):
    from lmhead import load_model
    from lmhead.models.gguf_codes import codes_for_model

    model = load_model(name, progress=False)
    layers = model.config.get_text_config().num_hidden_layers
    assert model.coded_matrices == 7 * layers + 1  # q, k, v, o, gate, up, down per block, and the tied head
    assert model.exact_head.product is not None and model.head is model.exact_head
    # draft="auto": n-gram drafts where the head is the larger read (measured faster on Gemma, slower on SmolLM2)
    assert model.auto_draft() == {"gemma-3-270m": "ngram", "smollm2-135m": "none"}[name]
    codes = codes_for_model(model, build=False)
    blocks = model.hf_model.base_model.layers
    for block, key in ((blocks[0].mlp.down_proj, "layers.0.mlp.down_proj"),
                       (blocks[-1].self_attn.q_proj, f"layers.{layers - 1}.self_attn.q_proj")):
        assert torch.equal(codes[key].dequantize(), block.weight)  # lossless: the float32 weights exactly
    ids = torch.tensor([model.encode("The quick brown fox jumps over the lazy dog because")])
    with torch.no_grad():
        want = model.hf_model(ids).logits[0]
    lean = model.lean
    cache = lean.new_cache(1, ids.shape[1] + 2)
    got = []
    for t in range(ids.shape[1]):  # decode-sized calls: every product reads codes
        got.append(model.exact_head(lean(ids[:, t:t + 1], torch.tensor([[t]]), cache))[0])
    torch.testing.assert_close(torch.cat(got), want, atol=1e-4, rtol=0)


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
