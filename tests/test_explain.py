"""explain.py: predict (candidates, both distributions, cuts, entropy), the logit lens, perplexity, scores."""

from __future__ import annotations

import json
import math

import pytest
import torch
from reference import hf_sliding_window_nll
from tiny import tiny_model

from lmhead import Model, explain
from lmhead.sampling import SamplingConfig, probabilities

PROMPT = "The cat sat on the"
TEXT = ("The quick brown fox jumps over the lazy dog. Language models predict the next token.\n"
        "Perplexity is the exponential of the mean loss. The cat sat on the mat.")


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def tiny(request):
    softcap = 5.0 if request.param == "gemma3" else None  # Gemma-2-style final softcap: the head must apply it
    model, tokenizer = tiny_model(request.param, softcap=softcap)
    return model, tokenizer, Model(model, tokenizer)  # lmhead's Model on transformers' model


@pytest.fixture(scope="module")
def llama():
    model, tokenizer = tiny_model("llama", seed=1)
    return model, tokenizer, Model(model, tokenizer)


def model_logits(model, tokenizer, text: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [1,T], transformers' own logits at the last position [1,V])."""
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    with torch.no_grad():
        return ids, model(ids).logits[:, -1].float()


CONFIGS = [
    SamplingConfig(),
    SamplingConfig(temperature=0.7, top_k=20),
    SamplingConfig(temperature=1.3, top_p=0.8),
    SamplingConfig(temperature=0.9, top_k=50, top_p=0.9, min_p=0.05),
    SamplingConfig(min_p=0.2),
    SamplingConfig(repetition_penalty=1.5, top_p=0.95),
    SamplingConfig(temperature=0.0),
]


# --- predict --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_processed_probabilities_equal_sampling_on_the_full_row(tiny, config):
    model, tokenizer, lm = tiny
    ids, logits = model_logits(model, tokenizer, PROMPT)
    expected = probabilities(logits, config, prev_tokens=ids, prompt_len=ids.shape[1])[0]
    pred = explain.predict(lm, PROMPT, top=len(tokenizer), config=config)
    assert len(pred.candidates) == len(tokenizer) == pred.vocab_size
    got = torch.zeros_like(expected)
    for c in pred.candidates:
        got[c.token_id] = c.probability
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert pred.kept_count == int((expected > 0).sum())
    assert [c.kept for c in pred.candidates] == [bool(expected[c.token_id] > 0) for c in pred.candidates]
    assert pred.candidates[-1].cumulative == pytest.approx(1.0, abs=1e-5)


def test_candidate_logits_are_the_models_own(tiny):
    model, tokenizer, lm = tiny
    _, logits = model_logits(model, tokenizer, PROMPT)
    pred = explain.predict(lm, PROMPT, top=15)
    top = torch.topk(logits[0], 15)
    assert [c.token_id for c in pred.candidates] == top.indices.tolist()
    torch.testing.assert_close(torch.tensor([c.logit for c in pred.candidates]), top.values, rtol=1e-5, atol=1e-5)
    raw = torch.softmax(logits[0], -1)
    torch.testing.assert_close(torch.tensor([c.raw_probability for c in pred.candidates]), raw[top.indices])
    # The full-vocabulary log-sum-exp lets a client recover the raw probabilities exactly.
    for c in pred.candidates:
        assert math.exp(c.logit - pred.logsumexp) == pytest.approx(c.raw_probability, rel=1e-5)


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_candidates_sorted_and_kept_tokens_form_a_prefix(tiny, config):
    model, tokenizer, lm = tiny
    pred = explain.predict(lm, PROMPT, top=60, config=config)
    scaled = [c.scaled_logit for c in pred.candidates]
    assert scaled == sorted(scaled, reverse=True)
    kept = [c.kept for c in pred.candidates]
    assert kept == sorted(kept, reverse=True)  # True... then False...
    assert [c.rank for c in pred.candidates] == list(range(1, 61))
    cum = [c.cumulative for c in pred.candidates]
    assert all(b >= a - 1e-7 for a, b in zip(cum, cum[1:], strict=False))


def test_top_k_1_keeps_exactly_one_token(tiny):
    model, tokenizer, lm = tiny
    pred = explain.predict(lm, PROMPT, top=5, config=SamplingConfig(top_k=1))
    assert pred.kept_count == 1
    assert [c.kept for c in pred.candidates] == [True, False, False, False, False]
    assert pred.candidates[0].probability == pytest.approx(1.0)
    assert [c.cut_by for c in pred.candidates] == [None] + ["top_k"] * 4
    assert pred.entropy["processed"] == pytest.approx(0.0, abs=1e-6)


def test_top_k_cut_flags(llama):
    model, tokenizer, lm = llama
    pred = explain.predict(lm, PROMPT, top=30, config=SamplingConfig(top_k=7))
    assert pred.kept_count == 7
    for c in pred.candidates:
        assert c.kept_top_k == (c.rank <= 7) == c.kept
        assert c.cut_by == (None if c.rank <= 7 else "top_k")
        assert c.kept_bias


def test_top_p_keeps_the_smallest_prefix_reaching_p(llama):
    model, tokenizer, lm = llama
    p = 0.6
    pred = explain.predict(lm, PROMPT, top=len(tokenizer),
                           config=SamplingConfig(temperature=0.8, top_p=p))
    # Reference over the full vocabulary: sort softmax(logits/T), keep tokens whose preceding mass is < p.
    _, logits = model_logits(model, tokenizer, PROMPT)
    probs, order = torch.sort(torch.softmax(logits[0] / 0.8, -1), descending=True)
    before = torch.cumsum(probs, 0) - probs
    expected_kept = set(order[before < p].tolist())
    assert {c.token_id for c in pred.candidates if c.kept} == expected_kept
    assert pred.kept_count == len(expected_kept)
    for c in pred.candidates:
        assert c.kept_top_k  # top-k is off
        assert c.kept == c.kept_top_p
        assert c.cut_by in (None, "top_p")
    last_kept = pred.candidates[pred.kept_count - 1]
    assert last_kept.scaled_cumulative >= p - 1e-6
    assert pred.candidates[pred.kept_count - 2].scaled_cumulative < p


def test_min_p_cut_flags(llama):
    model, tokenizer, lm = llama
    pred = explain.predict(lm, PROMPT, top=len(tokenizer), config=SamplingConfig(min_p=0.1))
    best = pred.candidates[0].scaled_probability
    for c in pred.candidates:
        assert c.kept == (c.scaled_probability >= 0.1 * best - 1e-9)
        assert c.cut_by in (None, "min_p")


def test_entropy_matches_a_direct_computation(tiny):
    model, tokenizer, lm = tiny
    config = SamplingConfig(temperature=0.6, top_k=40)
    ids, logits = model_logits(model, tokenizer, PROMPT)
    pred = explain.predict(lm, PROMPT, config=config)

    def h(p: torch.Tensor) -> float:
        p = p[p > 0].double()
        return float(-(p * p.log()).sum())

    assert pred.entropy["raw"] == pytest.approx(h(torch.softmax(logits[0], -1)), rel=1e-5)
    assert pred.entropy["scaled"] == pytest.approx(h(torch.softmax(logits[0] / 0.6, -1)), rel=1e-5)
    processed = probabilities(logits, config, prev_tokens=ids, prompt_len=ids.shape[1])[0]
    assert pred.entropy["processed"] == pytest.approx(h(processed), rel=1e-5)


def test_greedy_keeps_the_argmax_and_does_not_scale(llama):
    model, tokenizer, lm = llama
    _, logits = model_logits(model, tokenizer, PROMPT)
    pred = explain.predict(lm, PROMPT, top=4, config=SamplingConfig(temperature=0.0))
    assert pred.kept_count == 1
    assert pred.candidates[0].token_id == int(logits.argmax())
    assert pred.candidates[0].probability == 1.0
    assert [c.cut_by for c in pred.candidates[1:]] == ["greedy"] * 3
    for c in pred.candidates:
        assert c.scaled_logit == pytest.approx(c.logit)
        assert c.scaled_probability == pytest.approx(c.raw_probability, rel=1e-5)


def test_temperature_scales_the_logit(llama):
    model, tokenizer, lm = llama
    pred = explain.predict(lm, PROMPT, config=SamplingConfig(temperature=0.5))
    for c in pred.candidates:
        assert c.scaled_logit == pytest.approx(c.logit / 0.5, rel=1e-6)


def test_banned_token_is_cut_by_bias_and_json_has_no_infinities(llama):
    model, tokenizer, lm = llama
    _, logits = model_logits(model, tokenizer, PROMPT)
    best = int(logits.argmax())
    config = SamplingConfig(logit_bias={best: float("-inf")})
    pred = explain.predict(lm, PROMPT, top=len(tokenizer), config=config)
    assert pred.candidates[0].token_id != best
    banned = next(c for c in pred.candidates if c.token_id == best)
    assert (banned.kept, banned.kept_bias, banned.cut_by, banned.probability) == (False, False, "bias", 0.0)
    d = pred.to_dict()
    json.dumps(d, allow_nan=False)  # raises on inf/NaN
    banned_d = next(c for c in d["candidates"] if c["token_id"] == best)
    assert banned_d["scaled_logit"] is None and banned_d["logit"] == pytest.approx(banned.logit)


def test_json_shape(llama):
    model, tokenizer, lm = llama
    pred = explain.predict(lm, PROMPT, top=3, config=SamplingConfig(top_p=0.9))
    d = json.loads(json.dumps(pred.to_dict(), allow_nan=False))
    assert {"model", "prompt", "prompt_tokens", "candidates", "entropy", "kept_count", "config", "logsumexp",
            "vocab_size", "layers"} <= set(d)
    assert set(d["prompt_tokens"][0]) >= {"token_id", "text"}
    assert set(d["candidates"][0]) >= {"token_id", "text", "logit", "scaled_logit", "raw_probability",
                                       "probability", "kept", "cumulative", "kept_top_k", "kept_top_p",
                                       "kept_min_p", "cut_by"}
    assert set(d["entropy"]) == {"raw", "scaled", "processed"}
    assert d["config"]["top_p"] == 0.9
    assert len(d["candidates"]) == 3 and d["layers"] is None


def test_prompt_tokens_show_whitespace_and_specials(llama):
    model, tokenizer, lm = llama
    pred = explain.predict(lm, "Hello world!\nThe cat")
    texts = [t.text for t in pred.prompt_tokens]
    ids = tokenizer("Hello world!\nThe cat")["input_ids"]
    assert [t.token_id for t in pred.prompt_tokens] == ids
    assert texts[0] == "<bos>"  # special token by name
    assert "↵" in "".join(texts) and "·world" in "".join(texts)
    assert "".join(t.decoded for t in pred.prompt_tokens[1:]) == "Hello world!\nThe cat"


def test_visible():
    assert explain.visible(" a\tb\nc\r\x01") == "·a⇥b↵c␍\\x01"


@pytest.mark.parametrize("bad", [{"top": 0}, {"top": -3}, {"top": 2.5}, {"prompt": ""}, {"layer_top": 0}])
def test_bad_input_raises_naming_the_argument(llama, bad):
    model, tokenizer, lm = llama
    kwargs = {"prompt": PROMPT, **bad}
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        explain.predict(lm, **kwargs)


def test_prompt_not_a_string_and_config_not_a_config(llama):
    model, tokenizer, lm = llama
    with pytest.raises(TypeError, match="prompt"):
        explain.predict(lm, 42)
    with pytest.raises(TypeError, match="config"):
        explain.predict(lm, PROMPT, config={"temperature": 1})


def test_prompt_longer_than_the_context(llama):
    model, tokenizer, lm = llama
    with pytest.raises(ValueError, match="context"):
        explain.predict(lm, "cat " * 400)


# --- logit lens -----------------------------------------------------------------------------------------


def residuals_by_hooks(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """[embeddings, output of block 1, ..., block L] at the last position, captured with forward hooks —
    independent of transformers' `hidden_states` convention (Gemma's embedding module applies its sqrt(D)
    scale itself, so its output is the residual stream's start)."""
    captured: list[torch.Tensor] = []
    body = model.model
    hooks = [body.embed_tokens.register_forward_hook(lambda m, i, o: captured.append(o))]
    for layer in body.layers:
        hooks.append(layer.register_forward_hook(
            lambda m, i, o: captured.append(o[0] if isinstance(o, tuple) else o)))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return [c[:, -1:] for c in captured]


def test_logit_lens_last_layer_reproduces_the_models_logits(tiny):
    model, tokenizer, lm = tiny
    ids, logits = model_logits(model, tokenizer, PROMPT)
    lens = explain.lens_logits(lm, ids)
    assert lens.shape == (model.config.num_hidden_layers + 1, len(tokenizer))
    torch.testing.assert_close(lens[-1], logits[0], rtol=1e-5, atol=1e-5)


def test_logit_lens_applies_the_final_norm_once_per_layer(tiny):
    model, tokenizer, lm = tiny
    ids, logits = model_logits(model, tokenizer, PROMPT)
    residuals = residuals_by_hooks(model, ids)
    with torch.no_grad():
        expected = torch.cat([lm.head(model.model.norm(r)).reshape(1, -1) for r in residuals])
        twice = lm.head(model.model.norm(model.model.norm(residuals[-1]))).reshape(-1)
    lens = explain.lens_logits(lm, ids)
    torch.testing.assert_close(lens, expected, rtol=1e-5, atol=1e-5)
    # The test can fail: normalising twice gives other logits on this model (random norm weights).
    assert (twice - logits[0]).abs().max() > 1e-2


def test_predict_layers(tiny):
    model, tokenizer, lm = tiny
    ids, logits = model_logits(model, tokenizer, PROMPT)
    pred = explain.predict(lm, PROMPT, top=5, layers=True, layer_top=3)
    n = model.config.num_hidden_layers
    assert [layer.layer for layer in pred.layers] == list(range(n + 1))
    last = pred.layers[-1]
    assert [c.token_id for c in last.candidates] == [c.token_id for c in pred.candidates[:3]]
    raw = torch.softmax(logits[0], -1)
    for c in last.candidates:
        assert c.probability == pytest.approx(float(raw[c.token_id]), rel=1e-5)
    assert last.kl_to_final == pytest.approx(0.0, abs=1e-6)
    assert last.final_token_rank == 1
    assert last.entropy == pytest.approx(pred.entropy["raw"], rel=1e-5)
    lens = explain.lens_logits(lm, ids)
    for layer in pred.layers:
        lp = torch.log_softmax(lens[layer.layer], -1)
        assert layer.entropy == pytest.approx(float(-(lp.exp() * lp).sum()), rel=1e-4, abs=1e-6)
        assert [c.token_id for c in layer.candidates] == torch.topk(lens[layer.layer], 3).indices.tolist()
    d = json.loads(json.dumps(pred.to_dict(), allow_nan=False))
    assert set(d["layers"][0]) >= {"layer", "candidates", "entropy", "kl_to_final"}


def test_predict_shows_the_full_precision_head_whatever_head_decodes(llama):
    """A model decoding with the compressed exact-int8 head (its tail logits approximate) shows, by default,
    exactly the numbers of the same model with the fp32 head; head="decode" shows the compressed head's."""
    model, tokenizer, fp32 = llama
    compressed = Model(model, tokenizer, head="exact-int8")
    config = SamplingConfig(temperature=0.7, top_p=0.95)
    ours = explain.predict(compressed, PROMPT, top=5, config=config, layers=True, layer_top=3)
    assert ours.head == "fp32"
    assert ours.to_dict() == explain.predict(fp32, PROMPT, top=5, config=config, layers=True, layer_top=3).to_dict()
    ids = torch.tensor([tokenizer(PROMPT)["input_ids"]])
    torch.testing.assert_close(explain.lens_logits(compressed, ids), explain.lens_logits(fp32, ids), rtol=0, atol=0)

    decode = explain.predict(compressed, PROMPT, top=5, config=config, head="decode")
    assert decode.head == "exact-int8" and ours.to_dict()["head"] == "fp32"
    tail = torch.ones(compressed.vocab_size, dtype=torch.bool)
    tail[[c.token_id for c in decode.candidates]] = False
    with torch.no_grad():
        hidden = compressed.hidden_states(ids)[:, -1:]
        approx = compressed.head(hidden).reshape(-1)  # its top exact_k (64) exact, the rest approximate
        exact = compressed.exact_head(hidden).reshape(-1)
    assert decode.logsumexp == pytest.approx(float(torch.logsumexp(approx, -1)), abs=1e-5)
    assert [c.logit for c in decode.candidates] == pytest.approx([float(exact[c.token_id]) for c in decode.candidates],
                                                                 abs=1e-5)  # the candidates are re-scored exactly
    assert not torch.equal(approx[tail], exact[tail])  # the tail is the compressed head's own


def test_predict_rejects_an_unknown_head(llama):
    with pytest.raises(ValueError, match="head: must be one of exact, decode"):
        explain.predict(llama[2], PROMPT, head="int8")


# --- perplexity -----------------------------------------------------------------------------------------


def test_perplexity_equals_transformers(tiny):
    model, tokenizer, lm = tiny
    ids = torch.tensor([tokenizer(TEXT)["input_ids"]])
    assert ids.shape[1] < 100
    with torch.no_grad():
        expected = math.exp(float(model(ids, labels=ids).loss))
    got = explain.perplexity(lm, TEXT)
    assert got == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("window,stride", [(16, 8), (16, 5), (10, 10), (7, 1)])
@pytest.mark.slow
def test_sliding_window_equals_the_transformers_recipe(tiny, window, stride):
    model, tokenizer, lm = tiny
    ids = torch.tensor([tokenizer(TEXT)["input_ids"]])
    total, count = hf_sliding_window_nll(model, ids, window, stride)
    ev = explain.evaluate(lm, TEXT, window=window, stride=stride)
    assert ev.scored_count == count
    assert ev.perplexity == pytest.approx(math.exp(total / count), rel=1e-4)
    assert (ev.window, ev.stride) == (window, stride)
    if stride < window:
        assert count == ids.shape[1] - 1  # every token but the first, once


def test_windows_score_every_token_once():
    n, window, stride = 50, 12, 5
    scored = []
    for begin, end, first in explain.windows(n, window, stride):
        assert end - begin <= window and begin < first <= end
        scored += range(first, end)
    assert scored == list(range(1, n))


def test_score_tokens_logprob_and_rank(llama):
    model, tokenizer, lm = llama
    ids = torch.tensor([tokenizer(TEXT)["input_ids"]])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    scores = explain.score_tokens(lm, TEXT)
    assert [s.token_id for s in scores] == ids[0].tolist()
    assert scores[0].logprob is None and scores[0].rank is None
    logp = torch.log_softmax(logits, -1)
    for s in scores[1:]:
        row = logits[s.position - 1]
        assert s.logprob == pytest.approx(float(logp[s.position - 1, s.token_id]), abs=1e-4)
        assert s.rank == int((row > row[s.token_id]).sum()) + 1
    ppl = explain.perplexity(lm, TEXT)
    mean_nll = -sum(s.logprob for s in scores[1:]) / (len(scores) - 1)
    assert math.exp(mean_nll) == pytest.approx(ppl, rel=1e-4)


def test_score_tokens_in_windows_equals_one_window(llama):
    model, tokenizer, lm = llama
    whole = explain.score_tokens(lm, TEXT, window=200)
    windowed = explain.score_tokens(lm, TEXT, window=12, stride=6)
    # Different context for later tokens -> different values, but the same tokens and positions scored.
    assert [s.position for s in whole if s.rank] == [s.position for s in windowed if s.rank]
    assert whole[1].logprob == pytest.approx(windowed[1].logprob, abs=1e-5)  # same context in window 1


def test_evaluation_to_dict(llama):
    model, tokenizer, lm = llama
    ev = explain.evaluate(lm, TEXT, tokens=True)
    d = json.loads(json.dumps(ev.to_dict(), allow_nan=False))
    assert {"perplexity", "loss", "token_count", "window", "stride", "tokens"} <= set(d)
    assert set(d["tokens"][1]) >= {"token_id", "text", "logprob", "rank"}
    assert d["tokens"][0]["logprob"] is None


@pytest.mark.parametrize("kwargs,name", [
    ({"text": ""}, "text"), ({"window": 1}, "window"), ({"window": 10_000}, "window"),
    ({"window": 8, "stride": 9}, "stride"), ({"stride": 0}, "stride"),
])
def test_evaluate_bad_input(llama, kwargs, name):
    model, tokenizer, lm = llama
    kwargs = {"text": TEXT, **kwargs}
    with pytest.raises(ValueError, match=name):
        explain.evaluate(lm, **kwargs)


def test_token_segments_rebuild_the_text(llama):
    model, tokenizer, lm = llama
    text = "Héllo “world” 😀 done\n\nx"
    scores = explain.score_tokens(lm, text)
    assert "".join(s.segment for s in scores) == text
    assert scores[0].segment == ""  # <bos> covers no text
    ids = tokenizer(text)["input_ids"]
    shown = [t for t, _ in explain.token_texts(tokenizer, ids)]
    assert "<0xF0>" in shown  # the first byte of 😀 on its own: shown as a byte, not "�"
    assert "�" not in "".join(shown)


# --- the declared steps in the explainer ----------------------------------------------------------------


STEP_CONFIGS = [SamplingConfig(typical_p=0.6), SamplingConfig(temperature=0.8, top_n_sigma=0.5, top_k=40),
                SamplingConfig(epsilon_cutoff=0.02, repetition_penalty=1.3),
                SamplingConfig(top_p=0.7, temperature=1.5, samplers="llama.cpp"),
                SamplingConfig(xtc_probability=0.5, xtc_threshold=0.02), SamplingConfig(temperature=0, typical_p=0.2)]


@pytest.mark.parametrize("config", STEP_CONFIGS, ids=str)
def test_the_explainer_shows_every_step_with_its_parameters_and_cuts(llama, config):
    model, tokenizer, lm = llama
    ids, logits = model_logits(model, tokenizer, PROMPT)
    expected = probabilities(logits, config, prev_tokens=ids, prompt_len=ids.shape[1])[0]
    pred = explain.predict(lm, PROMPT, top=len(tokenizer), config=config)
    got = torch.zeros_like(expected)
    for c in pred.candidates:
        got[c.token_id] = c.probability
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    names = [s["name"] for s in pred.steps]
    assert names == [s.name for s in config.steps()]
    for s in pred.steps:
        assert set(s["params"]) == set(config.steps()[names.index(s["name"])].params)
    cut = {c.cut_by for c in pred.candidates if not c.kept}
    # each cut token names the first declared step that removed it, and the steps' counts add up to the cuts
    assert cut <= {*names, "bias", "greedy"}
    if not config.is_greedy and not config.xtc_probability:
        assert sum(s["cut"] for s in pred.steps) == len(tokenizer) - pred.kept_count
    json.dumps(pred.to_dict())


@pytest.mark.parametrize("config", [
    SamplingConfig(temperature=0.7, top_k=40), SamplingConfig(top_p=0.8), SamplingConfig(min_p=0.1, temperature=1.3),
    SamplingConfig(top_k=30, top_p=0.9, min_p=0.05, repetition_penalty=1.3, presence_penalty=0.5,
                   banned_tokens=(1, 2)),
    SamplingConfig(temperature=0.5, top_p=0.5, logit_bias={5: 10.0}), SamplingConfig(temperature=0),
], ids=["top_k", "top_p", "min_p", "all", "bias", "greedy"])
def test_the_stages_of_the_original_settings_are_the_declared_steps_rows_equal_to_the_pure_functions(config):
    from lmhead.explain import pipeline_stages
    from lmhead.sampling import apply_min_p, apply_temperature, apply_top_k, apply_top_p, process_logits

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 3000, generator=g) * 4
    prev = torch.randint(0, 3000, (1, 20), generator=g)
    stages = pipeline_stages(x, config, prev, 10)
    # the reference: the pipeline's public per-step functions, one after the other
    plain = SamplingConfig(logit_bias=config.logit_bias, banned_tokens=config.banned_tokens,
                           repetition_penalty=config.repetition_penalty, presence_penalty=config.presence_penalty)
    adjusted = process_logits(x, plain, prev_tokens=prev, prompt_len=10)
    assert torch.equal(stages["adjusted"], adjusted)
    if config.is_greedy:
        keep = process_logits(x, config, prev_tokens=prev, prompt_len=10)
        assert all(torch.equal(stages[f"after_{k}"], keep) for k in ("greedy", "top_k", "top_p", "min_p"))
        return
    scaled = apply_temperature(adjusted, config.temperature)
    k = apply_top_k(scaled, config.top_k)
    p = apply_top_p(k, config.top_p)
    m = apply_min_p(p, config.min_p)
    for key, want in (("scaled", scaled), ("after_top_k", k), ("after_top_p", p), ("after_min_p", m)):
        assert torch.equal(stages[key], want), key
    assert torch.equal(torch.isfinite(stages["after_bias"]), torch.isfinite(adjusted))
