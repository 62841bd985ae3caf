"""Classification heads on the body: the training objective and its gradients against the plain computation, save
and load with the label names, the verbaliser equal to the LM head's logits of the label words, training that
keeps the best held-out step, the shipped data set, and (packaged models) accuracy against the zero-shot start
and scikit-learn's logistic regression on the same features."""

from __future__ import annotations

import pytest
import torch

from lmhead.heads.classifier import ClassificationHead, features, verbaliser
from lmhead.heads.train import head_loss, split, train_head


def _plain_loss(x, w, b, y, cw, smoothing, l2):
    logits = x @ w.T + b
    per = torch.nn.functional.cross_entropy(logits, y, reduction="none", label_smoothing=smoothing)
    loss = per.mean() if cw is None else (per * cw[y]).sum() / cw[y].sum()
    return loss + 0.5 * l2 * w.pow(2).sum()


@pytest.mark.parametrize("smoothing,weighted,l2", [(0.0, False, 0.0), (0.1, True, 1e-2), (0.0, True, 0.0)])
def test_head_loss_and_gradients_equal_the_plain_computation(smoothing, weighted, l2):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 24, generator=g, dtype=torch.float64)
    y = torch.randint(0, 5, (37,), generator=g)
    cw = torch.rand(5, generator=g, dtype=torch.float64) + 0.2 if weighted else None
    grads = []
    for fn in (head_loss, _plain_loss):
        w = torch.randn(5, 24, generator=torch.Generator().manual_seed(1), dtype=torch.float64).requires_grad_()
        b = torch.randn(5, generator=torch.Generator().manual_seed(2), dtype=torch.float64).requires_grad_()
        loss = fn(x, w, b, y, cw, smoothing, l2)
        loss.backward()
        grads.append((loss.detach(), w.grad, b.grad))
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    if weighted and smoothing == 0:  # torch's own weighted cross-entropy is the same rule
        w = torch.ones(5, 24, dtype=torch.float64)
        torch.testing.assert_close(head_loss(x, w, None, y, cw),
                                   torch.nn.functional.cross_entropy(x @ w.T, y, weight=cw))


def test_a_head_saves_and_loads_with_its_labels_and_refuses_another_width(tmp_path):
    from tiny import tiny_model

    from lmhead import Model

    head = ClassificationHead(torch.randn(3, 32), torch.randn(3), ["a", "b", "c"], pooling="mean",
                              template="Q: {text}")
    path = head.save(tmp_path / "head.safetensors")
    back = ClassificationHead.load(path)
    assert back.labels == ["a", "b", "c"] and back.pooling == "mean" and back.template == "Q: {text}"
    torch.testing.assert_close(back.weight, head.weight, rtol=0, atol=0)
    torch.testing.assert_close(back.bias, head.bias, rtol=0, atol=0)
    assert not list(tmp_path.glob(".*tmp"))  # written atomically: no temporary left
    model = Model(*tiny_model("llama"))  # width 32
    wide = ClassificationHead(torch.randn(2, model.exact_head.d_model + 1), None, ["x", "y"])
    with pytest.raises(ValueError, match="the head is 33 wide but the model.s hidden state is 32"):
        model.classify(["some text"], wide)
    (tmp_path / "bad.safetensors").write_bytes(b"not a file")
    with pytest.raises(ValueError, match="is not a safetensors file"):
        ClassificationHead.load(tmp_path / "bad.safetensors")
    with pytest.raises(ValueError, match="labels: 2 names for 3 rows"):
        ClassificationHead(torch.randn(3, 4), None, ["a", "b"])


def test_the_verbaliser_gives_the_lm_heads_logits_of_the_label_words():
    from tiny import tiny_model

    from lmhead import Model

    hf_model, tokenizer = tiny_model("llama", seed=1)
    model = Model(hf_model, tokenizer)
    labels = ["cat", "dog", "fox"]
    head = verbaliser(model, labels, template="{text} The")
    texts = ["The quick brown fox jumps", "A cat and a dog are"]
    probs = model.classify(texts, head)
    ids = [tokenizer.encode(" " + w, add_special_tokens=False)[0] for w in labels]
    with torch.no_grad():
        logits = torch.stack([hf_model(torch.tensor([tokenizer.encode(t + " The")])).logits[0, -1, ids]
                              for t in texts])
    torch.testing.assert_close(probs, torch.softmax(logits, dim=-1), rtol=1e-5, atol=1e-5)
    assert head.num_parameters == 3 * model.exact_head.d_model


def test_training_keeps_the_best_held_out_step_and_beats_its_start(one_thread):
    from tiny import tiny_model

    from lmhead import Model

    model = Model(*tiny_model("llama", seed=2))
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(3, model.exact_head.d_model, generator=g) * 3
    y = torch.randint(0, 3, (90,), generator=g)
    x = centres[y] + torch.randn(90, model.exact_head.d_model, generator=g)
    texts = [f"text {i}" for i in range(90)]
    labels = [["cat", "dog", "fox"][i] for i in y.tolist()]
    for start in ("verbaliser", "random"):
        head = train_head(model, texts, labels, start=start, x=x, max_steps=300, patience=300, lr=0.05,
                          progress=False)
        report = head.report
        assert head.labels == ["cat", "dog", "fox"] and report.train_size == 72 and report.val_size == 18
        assert report.val_accuracy >= 0.9 > report.start_accuracy or report.start_accuracy >= 0.9
        assert report.val_loss == min(v for _, v in report.history)
        tr, va = split(90, 0.2, 0)
        got = (head(x[va]).argmax(-1) == y[va]).float().mean().item()
        assert got == pytest.approx(report.val_accuracy)
    with pytest.raises(ValueError, match=r"labels\[0\] = 'emu' is not one of \['cat', 'dog', 'fox'\]"):
        train_head(model, texts[:3], ["emu", "dog", "fox"], label_names=["cat", "dog", "fox"], x=x[:3])
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        train_head(model, texts, labels, x=x, label_smoothing=1.0)
    with pytest.raises(ValueError, match="class_weights must be 'balanced' or 3 weights"):
        train_head(model, texts, labels, x=x, class_weights=[1.0, 2.0])


def test_the_shipped_topic_set_has_four_classes_of_sixty():
    from collections import Counter

    from lmhead.data import TOPIC_LABELS, topics

    texts, labels = topics()
    assert Counter(labels) == dict.fromkeys(TOPIC_LABELS, 60)
    assert len(set(texts)) == len(texts) == 240 and all(5 <= len(t.split()) <= 20 for t in texts)
    assert labels[:4] == list(TOPIC_LABELS)  # interleaved: any prefix holds every class


@pytest.mark.model
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma-3-270m"])
def test_a_trained_head_beats_zero_shot_and_matches_logistic_regression(name, tmp_path):
    from sklearn.linear_model import LogisticRegression

    from lmhead import load_model
    from lmhead.data import topics
    from lmhead.heads.train import cached_features

    model = load_model(name, progress=False)
    texts, labels = topics()
    x = cached_features(model, texts, "last", "Text: {text}\nTopic:")
    torch.testing.assert_close(cached_features(model, texts, "last", "Text: {text}\nTopic:"), x)  # cached
    # the same features in a batch of 4 (other padding, other product shapes): equal to float32's rounding
    norm = torch.nn.functional.normalize
    torch.testing.assert_close(norm(x[:4], dim=-1), norm(features(model, texts[:4]), dim=-1), rtol=1e-5, atol=1e-5)
    head = train_head(model, texts, labels, x=x, progress=False)
    report = head.report
    names = sorted(set(labels))
    y = torch.tensor([names.index(label) for label in labels])
    tr, va = split(len(y), 0.2, 0)
    reference = LogisticRegression(max_iter=2000).fit(x[tr].numpy(), y[tr].numpy()).score(x[va].numpy(),
                                                                                           y[va].numpy())
    assert report.val_accuracy > report.start_accuracy or report.start_accuracy == 1.0
    assert report.val_accuracy >= reference - 0.02
    head.save(tmp_path / "head.safetensors")
    probs = model.classify(texts[:8], tmp_path / "head.safetensors")
    assert probs.shape == (8, 4)


def test_features_are_computed_once_and_read_back_from_the_cache(tmp_path, monkeypatch):
    from tiny_gguf import write_tiny_gguf

    from lmhead import load_model
    from lmhead.heads import train

    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path / "cache"))
    model = load_model(str(write_tiny_gguf(tmp_path / "tiny.gguf", "llama")), progress=False)
    calls = []
    real = train.features
    monkeypatch.setattr(train, "features", lambda *a, **k: calls.append(1) or real(*a, **k))
    texts = ["The cat sat", "A dog", "Numbers: 1 2 3"]
    first = train.cached_features(model, texts, "last", "{text}")
    again = train.cached_features(model, texts, "last", "{text}")
    assert len(calls) == 1 and torch.equal(first, again)
    assert len(list((tmp_path / "cache" / "features").glob("*.safetensors"))) == 1
    train.cached_features(model, texts, "mean", "{text}")  # another pooling: another entry
    assert len(calls) == 2 and len(list((tmp_path / "cache" / "features").glob("*.safetensors"))) == 2
