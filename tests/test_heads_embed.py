"""The body alone (`Model.embed`) and the reranker: pooled final hidden states equal to transformers' `AutoModel`
`last_hidden_state` pooled the same way, batched and chunked prefills equal to one text at a time, the file's
pooling type and classification head read, rerank scores equal to the LM's yes/no logits."""

from __future__ import annotations

import pytest
import torch

from lmhead.heads import pooling as pooling_mod
from lmhead.heads import reranker as reranker_mod
from lmhead.heads.reranker import rerank_prompts, score_pairs

# Qwen3-Reranker's prompt is longer than the tiny models' 256-token context in their byte-level tokens
SHORT_TEMPLATE = "Query: {query}\nDocument: {document}\nRelevant:"
TEXTS = ["The cat sat on the mat.", "A dog", "Numbers: 1 2 3 4 5 6 7 8 9 10 100 1000 and then a few more words",
         "Hello world!\nThis is a new line."]


# The body's products on a CPU's integer path (kernels/paths.py) are within float32's error bound, not transformers'
# bits; through the layers and the final norm they move hidden states of magnitude ~7 by a few 1e-5, as the logits'
# comparison in test_gguf_file.py allows
TOL = dict(rtol=1e-4, atol=1e-4)


def _pool(h: torch.Tensor, pooling: str) -> torch.Tensor:
    return {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[pooling]


def _load_gguf(tmp_path, monkeypatch, arch: str, extra=None):
    """A tiny GGUF file (with `extra(writer)` run before its header is written), lmhead's model of it and
    transformers' AutoModel and AutoModelForCausalLM of the same file."""
    import gguf
    from tiny_gguf import write_tiny_gguf
    from transformers import AutoModel, AutoModelForCausalLM

    from lmhead import load_model

    original = gguf.GGUFWriter
    if extra is not None:
        class Writer(gguf.GGUFWriter):
            def write_header_to_file(self, *a, **kw):
                extra(self)
                return super().write_header_to_file(*a, **kw)
        monkeypatch.setattr(gguf, "GGUFWriter", Writer)
    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / f"tiny-{arch}.gguf", arch, kind="Q8_0")
    monkeypatch.setattr(gguf, "GGUFWriter", original)
    model = load_model(str(path), progress=False)
    body = AutoModel.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    lm = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    return model, body, lm


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3"])
@pytest.mark.slow
def test_pooled_embeddings_equal_transformers_hidden_states_pooled_alike(tmp_path, monkeypatch, arch):
    model, body, _ = _load_gguf(tmp_path, monkeypatch, arch)
    with torch.no_grad():
        want = [body(torch.tensor([model.tokenizer.encode(t)])).last_hidden_state[0] for t in TEXTS]
    for pooling in ("last", "mean", "cls"):
        got = model.embed(TEXTS, pooling=pooling, normalize=False)
        assert got.shape == (len(TEXTS), model.exact_head.d_model) and got.dtype == torch.float32
        ref = torch.stack([_pool(h, pooling) for h in want])
        torch.testing.assert_close(got, ref, **TOL)
        torch.testing.assert_close(model.embed(TEXTS, pooling=pooling),
                                   torch.nn.functional.normalize(ref, dim=-1), **TOL)
    per_token = model.embed(TEXTS, pooling="none", normalize=False)
    for got, ref in zip(per_token, want, strict=True):
        torch.testing.assert_close(got, ref, **TOL)
    assert pooling_mod.default_pooling(model) == "last"  # a decoder's file without a pooling_type
    torch.testing.assert_close(model.embed(TEXTS), model.embed(TEXTS, pooling="last"), rtol=0, atol=0)


@pytest.mark.parametrize("body", ["lean", "transformers"])
def test_batches_and_chunked_prefill_give_each_text_alone(monkeypatch, one_thread, body):
    from tiny import tiny_model

    from lmhead import Model

    hf_model, tokenizer = tiny_model("llama", seed=3)
    model = Model(hf_model, tokenizer, body=body)
    assert (model.lean is not None) == (body == "lean")  # else transformers' body with its attention mask
    alone = [model.embed([t], pooling="mean", normalize=False)[0] for t in TEXTS]
    monkeypatch.setattr(pooling_mod, "CHUNK", 3)          # pieces of 3 columns through one cache
    monkeypatch.setattr(pooling_mod, "BATCH_TOKENS", 40)  # several batches of left-padded rows
    together = model.embed(TEXTS * 3, pooling="mean", normalize=False)
    torch.testing.assert_close(together, torch.stack(alone * 3), rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(pooling_mod, "SCORES_BYTES", 1)   # pieces of one column: the scores' bound decides
    torch.testing.assert_close(model.embed(TEXTS, pooling="mean", normalize=False), torch.stack(alone), rtol=1e-5,
                               atol=1e-5)
    with torch.no_grad():  # and transformers' forward of each text alone
        ref = torch.stack([hf_model.model(torch.tensor([tokenizer.encode(t)])).last_hidden_state[0].mean(0)
                           for t in TEXTS])
    torch.testing.assert_close(torch.stack(alone), ref, rtol=1e-5, atol=1e-5)
    # token ids are taken as given
    ids = [tokenizer.encode(t) for t in TEXTS]
    torch.testing.assert_close(model.embed(ids, pooling="mean", normalize=False), ref, rtol=1e-5, atol=1e-5)


def test_bad_inputs_name_the_argument_and_truncation_keeps_the_last_tokens():
    from tiny import tiny_model

    from lmhead import Model

    model = Model(*tiny_model("llama"))
    for bad, words in (([], "non-empty list"), ([""], r"input\[0\] is an empty string"),
                       (["ok", 3], r"input\[1\] must be a string"), ([[1, 2], []], r"input\[1\] is an empty list"),
                       ([[1, 10**6]], r"input\[0\] holds token id 1000000")):
        with pytest.raises((ValueError, TypeError), match=words):
            model.embed(bad)
    with pytest.raises(ValueError, match="pooling must be one of last, mean, cls, none"):
        model.embed(["x"], pooling="max")
    long = [5] * (model.context_length + 1)
    with pytest.raises(ValueError, match=rf"{model.context_length + 1} tokens, more than the model's context"):
        model.embed([long])
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be an integer >= 1"):
        model.embed(["x"], truncate_prompt_tokens=0)
    ids = model.tokenizer.encode(TEXTS[2])
    torch.testing.assert_close(model.embed([ids], truncate_prompt_tokens=4),
                               model.embed([ids[-4:]]), rtol=0, atol=0)


def test_the_files_pooling_type_and_classification_head_are_read(tmp_path, monkeypatch):
    import numpy as np

    rng = np.random.default_rng(0)
    cls_weight = rng.standard_normal((2, 32)).astype(np.float32)
    cls_bias = rng.standard_normal(2).astype(np.float32)

    def extra(w):
        arch = w.arch
        w.add_uint32(f"{arch}.pooling_type", 4)  # rank, as llama.cpp's converter writes a reranker's file
        w.add_array(f"{arch}.classifier.output_labels", ["yes", "no"])
        w.add_tensor("cls.output.weight", cls_weight)
        w.add_tensor("cls.output.bias", cls_bias)

    model, _, lm = _load_gguf(tmp_path, monkeypatch, "qwen3", extra=extra)
    monkeypatch.setattr(reranker_mod, "QWEN3_TEMPLATE", SHORT_TEMPLATE)
    assert pooling_mod.default_pooling(model) == "rank"
    from lmhead.heads.classifier import from_file

    head = from_file(model)
    assert head.labels == ["yes", "no"]
    torch.testing.assert_close(head.weight.detach(), torch.from_numpy(cls_weight), rtol=0, atol=0)
    docs = ["The cat sat on the mat.", "Numbers: 1 2 3", "A dog"]
    got = score_pairs(model, "cat", docs)  # "auto": the file's head, its pooling "rank"
    with torch.no_grad():
        last = torch.stack([lm.model(torch.tensor([model.tokenizer.encode(p)])).last_hidden_state[0, -1]
                            for p in rerank_prompts(model, "cat", docs)])
    want = torch.softmax(last @ torch.from_numpy(cls_weight).T + torch.from_numpy(cls_bias), dim=-1)[:, 0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_rerank_scores_are_the_lm_heads_yes_against_no_at_the_last_position(tmp_path, monkeypatch):
    model, _, lm = _load_gguf(tmp_path, monkeypatch, "qwen3")
    monkeypatch.setattr(reranker_mod, "QWEN3_TEMPLATE", SHORT_TEMPLATE)
    docs = ["The cat sat on the mat.", "Numbers: 1 2 3 4", "The dog sat on the log.", "Hello world!"]
    yes, no = (model.tokenizer.encode(w, add_special_tokens=False)[0] for w in ("yes", "no"))
    with torch.no_grad():
        logits = torch.stack([lm(torch.tensor([model.tokenizer.encode(p)])).logits[0, -1]
                              for p in rerank_prompts(model, "Where did the cat sit?", docs)])
    want = torch.softmax(logits[:, [no, yes]], dim=-1)[:, 1]  # Qwen3-Reranker's rule
    got = score_pairs(model, "Where did the cat sit?", docs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    ranked = model.rerank("Where did the cat sit?", docs, top_n=2)
    assert [r["index"] for r in ranked] == want.argsort(descending=True)[:2].tolist()
    assert ranked[0]["document"] == docs[ranked[0]["index"]] and ranked[0]["relevance_score"] >= \
        ranked[1]["relevance_score"]
    with pytest.raises(ValueError, match="top_n must be an integer >= 1"):
        model.rerank("q", docs, top_n=0)
    with pytest.raises(ValueError, match=r"documents\[1\] must be a non-empty string"):
        model.rerank("q", ["a", ""])
    with pytest.raises(ValueError, match="head='file': the model's file holds no classification head"):
        score_pairs(model, "q", docs, head="file")


@pytest.mark.model
@pytest.mark.parametrize("name", ["gemma-3-270m", "smollm2-135m"])
def test_packaged_models_embeddings_equal_transformers_hidden_states(name):
    from lmhead import load_model

    model = load_model(name, progress=False)
    texts = ["The quick brown fox jumps over the lazy dog.", "Embeddings", "A longer sentence about the weather "
             "in the mountains, where it snows in winter and rains in spring."]
    with torch.no_grad():
        want = [model.hf_model.base_model(torch.tensor([model.encode(t)])).last_hidden_state[0] for t in texts]
    for pooling in ("last", "mean"):
        ref = torch.nn.functional.normalize(torch.stack([_pool(h, pooling) for h in want]), dim=-1)
        torch.testing.assert_close(model.embed(texts, pooling=pooling), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.model
@pytest.mark.parametrize("name", ["gemma-3-270m", "smollm2-135m"])
def test_packaged_models_rerank_scores_equal_transformers_yes_against_no(name):
    from lmhead import load_model

    model = load_model(name, progress=False)
    query, docs = "Where did the cat sit?", ["The cat sat on the mat.", "Stocks fell sharply on Monday."]
    yes, no = (model.tokenizer.encode(w, add_special_tokens=False)[0] for w in ("yes", "no"))
    with torch.no_grad():
        logits = torch.stack([model.hf_model(torch.tensor([model.encode(p)])).logits[0, -1]
                              for p in rerank_prompts(model, query, docs)])
    want = torch.softmax(logits[:, [no, yes]], dim=-1)[:, 1]
    torch.testing.assert_close(score_pairs(model, query, docs), want, rtol=1e-5, atol=1e-5)
