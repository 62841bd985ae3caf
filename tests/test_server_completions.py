"""/v1/completions' OpenAI and vLLM fields on a tiny random model: prompts as text, lists and token ids (a choice
each), n, echo and prompt logprobs (the fp32 head's own numbers, as `Model.evaluate`), stop_token_ids, min_tokens,
ignore_eos, include_stop_str_in_output, usage; the tokenizer routes; the context bound; strict booleans and deep
JSON."""

from __future__ import annotations

import json

import pytest
import torch

from lmhead.prompt_scores import prompt_scores
from lmhead.sampling import SamplingConfig

PROMPT = "The cat sat on the"
GREEDY = {"temperature": 0}


def _complete(client, **body):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _greedy(model, ids, n, **kwargs):
    from lmhead.decode.rows import prepare_ids
    from lmhead.generate import _loop

    rows = prepare_ids(model, [ids], n, SamplingConfig(temperature=0), **kwargs)
    return list(_loop(model, rows, None, None))


# --- prompts and choices ---------------------------------------------------------------------------------------


def test_every_prompt_form_gives_one_choice_per_prompt_in_order(client, model):
    ids = model.encode(PROMPT)
    other = model.encode("A dog ran")
    alone = _complete(client, prompt=PROMPT, max_tokens=5, **GREEDY)["choices"][0]["text"]
    for prompt in (PROMPT, [PROMPT], ids, [ids]):
        body = _complete(client, prompt=prompt, max_tokens=5, **GREEDY)
        assert [c["index"] for c in body["choices"]] == [0]
        assert body["choices"][0]["text"] == alone, prompt
    body = _complete(client, prompt=[ids, other, ids], max_tokens=5, **GREEDY)
    texts = [c["text"] for c in body["choices"]]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert texts[0] == texts[2] == alone
    assert texts[1] == _complete(client, prompt=other, max_tokens=5, **GREEDY)["choices"][0]["text"]
    assert body["usage"]["prompt_tokens"] == 2 * len(ids) + len(other)


def test_n_choices_are_their_own_draws_and_reproducible_with_a_seed(client):
    body = dict(prompt=[PROMPT, "A dog"], n=3, max_tokens=8, temperature=1.0, seed=5)
    first, again = _complete(client, **body), _complete(client, **body)
    texts = [c["text"] for c in first["choices"]]
    assert [c["index"] for c in first["choices"]] == list(range(6))
    assert texts == [c["text"] for c in again["choices"]]
    assert len(set(texts[:3])) > 1  # each choice its own draw
    single = _complete(client, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=5)["choices"][0]["text"]
    assert texts[0] == single  # choice 0 draws with the request's seed
    assert first["usage"]["completion_tokens"] == sum(
        len(_complete(client, prompt=[PROMPT, "A dog"][i // 3], max_tokens=8, temperature=1.0,
                      seed=5 + i % 3, logprobs=0)["choices"][0]["logprobs"]["tokens"]) for i in range(6))


def test_streamed_choices_carry_their_index_and_usage(client):
    r = client.post("/v1/completions", json={"prompt": [PROMPT, "A dog"], "n": 2, "max_tokens": 4, **GREEDY,
                                             "stream": True, "stream_options": {"include_usage": True}})
    events = [json.loads(b[6:]) for b in r.text.split("\n\n") if b.startswith("data: {")]
    texts: dict[int, str] = {}
    for e in events[:-1]:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    whole = _complete(client, prompt=[PROMPT, "A dog"], n=2, max_tokens=4, **GREEDY)
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]


# --- echo and prompt logprobs ----------------------------------------------------------------------------------


def test_echo_logprobs_are_the_fp32_heads_log_softmax_of_every_prompt_token(client, model):
    ids = model.encode(PROMPT)
    body = _complete(client, prompt=ids, echo=True, logprobs=1, max_tokens=1, **GREEDY)  # lm-eval's request
    lp = body["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    with torch.no_grad():
        logits = model.exact_head(model.hidden_states(torch.tensor([ids])))[0].float()      # [T,V]
    want = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert lp["token_logprobs"][1:len(ids)] == pytest.approx(want.tolist(), abs=1e-5)
    evaluation = model.evaluate(PROMPT, tokens=True)
    assert lp["token_logprobs"][1:len(ids)] == pytest.approx([t.logprob for t in evaluation.tokens[1:]], abs=1e-4)
    for top, v in zip(lp["top_logprobs"][1:len(ids)], torch.log_softmax(logits, -1)[:-1].max(-1).values.tolist(),
                      strict=True):
        assert max(top.values()) == pytest.approx(v, abs=1e-5)
    assert body["choices"][0]["text"].startswith(model.tokenizer.decode(ids))


def test_echo_with_no_new_tokens_scores_the_prompt_only(client, model):
    body = _complete(client, prompt=PROMPT, echo=True, logprobs=0, max_tokens=0)
    choice = body["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(model.encode(PROMPT))
    assert body["usage"]["completion_tokens"] == 0


def test_vllm_prompt_logprobs_list_the_token_its_rank_and_the_top_alternatives(client, model):
    ids = model.encode(PROMPT)
    body = _complete(client, prompt=ids, prompt_logprobs=2, max_tokens=1, **GREEDY)
    got = body["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    scores = prompt_scores(model, ids, 2)
    for entry, score in zip(got[1:], scores[1:], strict=True):
        own = entry[str(score.token_id)]
        assert own["logprob"] == pytest.approx(score.logprob, abs=1e-6) and own["rank"] == score.rank
        assert len(entry) <= 3 and all(str(t) in entry for t, _ in score.top)


def test_prompt_scores_in_pieces_equal_one_forward(model, monkeypatch):
    import lmhead.prompt_scores as P

    ids = model.encode("the cat and the dog and the bird " * 6)
    whole = prompt_scores(model, ids, 3)
    monkeypatch.setattr(P, "PIECE", 7)
    monkeypatch.setattr(P, "CHUNK", 5)
    pieces = prompt_scores(model, ids, 3)
    assert [s.logprob for s in pieces[1:]] == pytest.approx([s.logprob for s in whole[1:]], abs=1e-5)
    assert [s.rank for s in pieces[1:]] == [s.rank for s in whole[1:]]


# --- vLLM's stop options ----------------------------------------------------------------------------------------


def test_stop_token_ids_end_a_choice_without_text(client, model):
    ids = model.encode(PROMPT)
    free = _greedy(model, ids, 8, ignore_eos=True)
    stop_at = free[3].token_id
    body = _complete(client, prompt=ids, max_tokens=8, stop_token_ids=[stop_at], ignore_eos=True, **GREEDY,
                     logprobs=0)
    choice = body["choices"][0]
    first = next(i for i, s in enumerate(free) if s.token_id == stop_at)
    assert choice["finish_reason"] == "stop"
    assert len(choice["logprobs"]["tokens"]) == first + 1 == body["usage"]["completion_tokens"]


def test_min_tokens_bans_the_stop_ids_until_that_many_tokens(client, model):
    ids = model.encode(PROMPT)
    free = _greedy(model, ids, 8, ignore_eos=True)
    stop_at = free[0].token_id  # greedy would stop at once
    body = _complete(client, prompt=ids, max_tokens=8, stop_token_ids=[stop_at], min_tokens=4, ignore_eos=True,
                     logprobs=0, **GREEDY)
    tokens = body["usage"]["completion_tokens"]
    assert tokens >= 4
    assert _complete(client, prompt=ids, max_tokens=8, stop_token_ids=[stop_at], ignore_eos=True,
                     **GREEDY)["usage"]["completion_tokens"] == 1


def test_ignore_eos_keeps_generating_past_the_models_end_of_sequence(model):
    from lmhead.decode.rows import prepare_ids
    from lmhead.generate import _loop

    ids = model.encode(PROMPT)
    eos = model.eos_token_ids[0]
    cfg = SamplingConfig(temperature=0, logit_bias={eos: 1e4})  # the end-of-sequence id every step
    stops = list(_loop(model, prepare_ids(model, [ids], 5, cfg), None, None))
    goes = list(_loop(model, prepare_ids(model, [ids], 5, cfg, ignore_eos=True), None, None))
    assert len(stops) == 1 and stops[0].finish_reason == "stop"
    assert len(goes) == 5 and goes[-1].finish_reason == "length"


def test_include_stop_str_keeps_the_stop_string(client, model):
    text = _complete(client, prompt=PROMPT, max_tokens=12, **GREEDY)["choices"][0]["text"]
    stop = text[3:5]
    cut = _complete(client, prompt=PROMPT, max_tokens=12, stop=stop, **GREEDY)["choices"][0]
    kept = _complete(client, prompt=PROMPT, max_tokens=12, stop=stop, include_stop_str_in_output=True,
                     **GREEDY)["choices"][0]
    assert cut["text"] == text[:text.index(stop)] and kept["text"] == cut["text"] + stop
    assert kept["finish_reason"] == "stop"


# --- bounds --------------------------------------------------------------------------------------------------


def test_prompt_and_max_tokens_past_the_context_is_400_naming_both(client, model):
    ids = model.encode(PROMPT)
    room = model.context_length - len(ids)
    assert _complete(client, prompt=ids, max_tokens=room, temperature=0, ignore_eos=True)["usage"][
        "completion_tokens"] == room  # the whole context is usable
    r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": room + 1})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert f"{model.context_length:,}" in err["message"] and f"{room + 1:,}" in err["message"]
    assert f"{len(ids) + room + 1:,}" in err["message"]
    full = (ids * model.context_length)[:model.context_length]  # no room left: a 400, not an empty answer
    r = client.post("/v1/completions", json={"prompt": full})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("body,param", [
    ({"prompt": [1, 2, 10_000]}, "prompt"),
    ({"prompt": "hi", "n": 33}, "n"),
    ({"prompt": "hi", "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
])
def test_bad_completion_fields_are_400_naming_the_field(client, body, param):
    r = client.post("/v1/completions", json=body)
    assert r.status_code in (400, 422), r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("field,value", [("stream", "yes"), ("echo", 1), ("ignore_eos", "true"),
                                         ("exact_logprobs", 0)])
def test_booleans_are_strict(client, field, value):
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, field: value})
    assert r.status_code == 422 and r.json()["error"]["param"] == field
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "stream": "yes"})
    assert r.status_code == 422


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/api/predict", "/api/step",
                                   "/api/generate", "/api/layers", "/api/score", "/tokenize", "/detokenize"])
def test_a_deeply_nested_body_is_422_before_it_is_decoded(client, route):
    for body, headers in ((b"[" * 100_000 + b"]" * 100_000, {"Content-Type": "application/json"}),
                          (b'{"prompt": ' + b"[" * 100_000, {}), (b"{" * 100_000, {"Content-Type": "text/plain"})):
        r = client.post(route, content=body, headers=headers)
        assert r.status_code == 422, (route, r.status_code, r.text[:200])
        assert "nests" in r.text


# --- the tokenizer routes ---------------------------------------------------------------------------------------


def test_tokenize_and_detokenize_round_trip_as_vllm_serves_them(client, model):
    r = client.post("/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()
    assert r["tokens"] == model.encode(PROMPT) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == model.context_length and len(r["token_strs"]) == r["count"]
    bare = client.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()["tokens"]
    assert bare == model.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    assert client.post("/detokenize", json={"tokens": bare}).json()["prompt"] == model.tokenizer.decode(bare)
    r = client.post("/detokenize", json={"tokens": [model.vocab_size]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] == model.tokenizer.eos_token and info["model_max_length"] == model.context_length


def test_echo_streams_each_prompt_first_then_its_tokens(client, model):
    body = {"prompt": [PROMPT, "A dog"], "echo": True, "logprobs": 1, "max_tokens": 3, **GREEDY}
    whole = _complete(client, **body)
    r = client.post("/v1/completions", json={**body, "stream": True})
    events = [json.loads(b[6:]) for b in r.text.split("\n\n") if b.startswith("data: {")]
    texts: dict[int, str] = {}
    lps: dict[int, list] = {}
    for e in events:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            lps.setdefault(c["index"], []).extend(c["logprobs"]["token_logprobs"])
    for c in whole["choices"]:
        assert texts[c["index"]] == c["text"]
        assert lps[c["index"]] == pytest.approx(c["logprobs"]["token_logprobs"])
    r = client.post("/v1/completions", json={"prompt": PROMPT, "echo": True, "max_tokens": 0, "stream": True})
    events = [json.loads(b[6:]) for b in r.text.split("\n\n") if b.startswith("data: {")]
    assert [c["text"] for e in events for c in e["choices"]] == [PROMPT]
