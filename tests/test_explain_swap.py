"""The head swap shown (`explain_swap`): one final hidden state through the LM head and a classification head,
each head's numbers equal to its plain computation, parameter counts from the model's file equal to transformers'
module sizes, and the terminal view."""

from __future__ import annotations

import pytest
import torch

from lmhead.explain_swap import model_parameters, render_swap, swap
from lmhead.heads.classifier import ClassificationHead, verbaliser


def test_the_same_hidden_state_goes_into_both_heads(tmp_path, monkeypatch):
    from tiny_gguf import write_tiny_gguf
    from transformers import AutoModelForCausalLM

    from lmhead import load_model

    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", kind="Q8_0")
    model = load_model(str(path), progress=False)
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    head = ClassificationHead(torch.randn(3, 32, generator=g), torch.randn(3, generator=g), ["a", "b", "c"],
                              template="{text} is")
    s = swap(model, "The cat sat", head, top=5)
    ids = torch.tensor([model.tokenizer.encode("The cat sat is")])
    with torch.no_grad():
        out = ref(ids, output_hidden_states=True)
    logits, h = out.logits[0, -1], out.hidden_states[-1][0, -1]
    probs = torch.softmax(logits.double(), -1)
    assert [r.index for r in s.lm.top] == torch.topk(logits, 5).indices.tolist()
    assert [r.probability for r in s.lm.top] == pytest.approx(probs[[r.index for r in s.lm.top]].tolist(),
                                                              abs=1e-6)
    want = torch.softmax(head.weight.detach() @ h + head.bias.detach(), -1)
    assert sorted(r.label for r in s.swapped.top) == ["a", "b", "c"]
    assert [r.probability for r in s.swapped.top] == pytest.approx(sorted(want.tolist(), reverse=True), abs=1e-6)
    assert s.hidden_norm == pytest.approx(float(h.norm()), rel=1e-5)
    # the file's tensor table counts what transformers' modules hold (a tied head once)
    total, tied = model_parameters(model)
    unique = {p.data_ptr(): p.numel() for p in ref.parameters()}
    assert total == sum(unique.values()) and tied == (ref.get_output_embeddings().weight is
                                                       ref.get_input_embeddings().weight)
    assert s.lm.parameters == ref.get_output_embeddings().weight.numel() and s.swapped.parameters == 3 * 33
    assert s.swapped.share == pytest.approx(99 / total)
    text = render_swap(s)
    assert "LM head:" in text and "classification head: 3 × 32 = 99 parameters" in text
    assert s.to_dict()["swapped"]["rows"] == 3


def test_a_verbaliser_head_agrees_with_the_lm_heads_own_ranking():
    from tiny import tiny_model

    from lmhead import Model

    model = Model(*tiny_model("llama", seed=1))
    labels = ["cat", "dog", "fox"]
    s = swap(model, "The quick brown", verbaliser(model, labels, template="{text}"), top=model.vocab_size)
    lm = {r.index: r.logit for r in s.lm.top}
    ids = [model.tokenizer.encode(" " + w, add_special_tokens=False)[0] for w in labels]
    by_lm = sorted(labels, key=lambda w: -lm[ids[labels.index(w)]])
    assert [r.label for r in s.swapped.top] == by_lm
    with pytest.raises(ValueError, match="top must be an integer >= 1"):
        swap(model, "x", verbaliser(model, labels), top=0)
