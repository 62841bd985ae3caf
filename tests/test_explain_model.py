"""explain.py on the real packaged models (converted once, cached under $LMHEAD_CACHE)."""

from __future__ import annotations

import math

import pytest
import torch
from reference import hf_sliding_window_nll

from lmhead import explain

pytestmark = pytest.mark.model

TEXT = (
    "The cat sat on the mat and looked out of the window. It was raining, and the garden was grey and wet. "
    "Somewhere a dog barked twice, then went quiet. The cat yawned, stretched, and went back to sleep.\n"
    "Language models assign a probability to every token of a text; perplexity is the exponential of the "
    "mean negative log-likelihood of the tokens, so lower is better."
)


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma-3-270m"])
def model(request):
    from lmhead import load_model

    return load_model(request.param, progress=False)


def test_perplexity_equals_transformers(model):
    ids = torch.tensor([model.tokenizer(TEXT)["input_ids"]])
    with torch.no_grad():
        expected = math.exp(float(model.hf_model(ids, labels=ids).loss))
    ev = explain.evaluate(model, TEXT)
    print(f"\n{model.name}: perplexity lmhead {ev.perplexity:.6f}, transformers {expected:.6f}, "
          f"rel diff {abs(ev.perplexity / expected - 1):.2e} ({ev.token_count} tokens)")
    assert ev.windows == 1 and ev.token_count == ids.shape[1]
    assert ev.perplexity == pytest.approx(expected, rel=1e-4)
    assert model.perplexity(TEXT) == pytest.approx(ev.perplexity, rel=1e-9)


def test_sliding_window_equals_the_transformers_recipe(model):
    ids = torch.tensor([model.tokenizer(TEXT)["input_ids"]])
    total, count = hf_sliding_window_nll(model.hf_model, ids, window=48, stride=16)
    ev = explain.evaluate(model, TEXT, window=48, stride=16)
    assert ev.scored_count == count == ids.shape[1] - 1
    assert ev.perplexity == pytest.approx(math.exp(total / count), rel=1e-4)


def test_logit_lens_last_layer_is_the_models_logits(model):
    ids = torch.tensor([model.tokenizer("The capital of France is")["input_ids"]])
    with torch.no_grad():
        logits = model.hf_model(ids).logits[0, -1].float()
    lens = explain.lens_logits(model, ids)
    assert lens.shape[0] == model.config.num_hidden_layers + 1
    torch.testing.assert_close(lens[-1], logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("body", ["transformers", "default"])
def test_predict_on_the_real_model(model, body):
    """With transformers' own modules as the body the probabilities are those of the exact head over transformers'
    final hidden state (its product in float64) to 1e-6 — transformers' float32 head is itself a few 1e-7 off them,
    by its BLAS's summation order —; the default (lean) body sums in another order: 1e-5 of transformers' (the
    explainer's promise against transformers)."""
    from lmhead import Model
    from lmhead.sampling import SamplingConfig, probabilities

    if body == "transformers":
        model = Model.from_parts(model.hf_model, model.tokenizer, model.head)
    config = SamplingConfig(temperature=0.8, top_k=50, top_p=0.9)
    pred = model.predict("The capital of France is", top=20, config=config, layers=True)
    ids = torch.tensor([model.tokenizer("The capital of France is")["input_ids"]])
    with torch.no_grad():
        out = model.hf_model(ids, output_hidden_states=True)
        logits = out.logits[:, -1].float()
        if body == "transformers":  # the exact head: the final (normed) hidden state times the head in float64
            weight = model.hf_model.get_output_embeddings().weight
            exact = (out.hidden_states[-1][:, -1].double() @ weight.double().T).float()
            torch.testing.assert_close(exact, logits, rtol=0, atol=1e-4)  # the same logits: the reference is right
            logits = exact
    probs = probabilities(logits, config, prev_tokens=ids, prompt_len=ids.shape[1])[0]
    for c in pred.candidates:
        assert c.probability == pytest.approx(float(probs[c.token_id]), abs=1e-6 if body == "transformers" else 1e-5)
    assert pred.kept_count == int((probs > 0).sum()) and 1 <= pred.kept_count <= 50
    assert any("Paris" in c.decoded for c in pred.candidates)  # top-1 for SmolLM2; Gemma 270M says " the"
    assert pred.layers[-1].candidates[0].token_id == pred.candidates[0].token_id


def test_score_tokens_segments_rebuild_the_text(model):
    scores = explain.score_tokens(model, TEXT[:200])
    assert "".join(s.segment for s in scores) == TEXT[:200]
    assert all(s.rank >= 1 for s in scores[1:])


PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea, there", "def add(a, b):\n"]


def _transformers_lens(model, ids):
    """transformers' own logits [V] and logit-lens logits [L+1, V] (its hidden states, its final norm, its
    lm_head, its softcap) at the last position, in float64: the reference for everything the explainer shows."""
    hf = model.hf_model
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
        states = out.hidden_states
        rows = [hf.model.norm(h[:, -1:]) for h in states[:-1]] + [states[-1][:, -1:]]  # the last one is normed
        lens = hf.lm_head(torch.cat(rows, dim=1))[0].double()
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        lens = torch.tanh(lens / cap) * cap
    return out.logits[0, -1], lens


@pytest.mark.parametrize("prompt", PROMPTS)
def test_every_number_predict_shows_is_transformers_to_1e_5(model, prompt):
    """Whatever head decodes (Gemma: the compressed exact-int8 head, whose normaliser includes approximate
    tail logits), predict and its logit lens show the full-precision model's numbers: transformers' own
    probabilities to 1e-5 absolute, raw, after temperature, after the pipeline, at every layer."""
    from lmhead.sampling import SamplingConfig, probabilities

    config = SamplingConfig(temperature=0.8, top_p=0.9)  # no top-k: the normaliser spans the whole vocabulary
    pred = model.predict(prompt, top=20, config=config, layers=True, layer_top=5)
    ids = torch.tensor([model.tokenizer(prompt)["input_ids"]])
    logits, lens = _transformers_lens(model, ids)
    raw = torch.softmax(logits.double(), -1)
    scaled = torch.softmax(logits.double() / 0.8, -1)
    processed = probabilities(logits[None].float(), config, prev_tokens=ids, prompt_len=ids.shape[1])[0]
    assert pred.head == "fp32"
    worst = 0.0
    for c in pred.candidates:
        for ours, theirs in ((c.raw_probability, raw), (c.scaled_probability, scaled), (c.probability, processed)):
            worst = max(worst, abs(ours - float(theirs[c.token_id])))
    for layer in pred.layers:
        p = torch.softmax(lens[layer.layer], -1)
        for c in layer.candidates:
            worst = max(worst, abs(c.probability - float(p[c.token_id])))
    print(f"\n{model.name} ({type(model.head).__name__} decodes): max |p - p_transformers| {worst:.1e}")
    assert worst <= 1e-5
    assert pred.logsumexp == pytest.approx(float(torch.logsumexp(logits.double(), -1)), abs=1e-4)
    assert pred.entropy["raw"] == pytest.approx(float(-(raw * raw.clamp_min(1e-300).log()).sum()), abs=1e-4)
