"""The server's API through FastAPI's TestClient, on a tiny random model: shapes, agreement with the library,
bounds and error bodies, the OpenAPI schema, and the page's static files."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from lmhead.sampling import SamplingConfig
from lmhead.server import create_app
from lmhead.server import schemas as S

PROMPT = "The cat sat on the"
STATIC = Path(__file__).parents[1] / "src" / "lmhead" / "server" / "static"


def sse_events(text: str) -> list:
    """Parse a server-sent-events body: the JSON of each `data:` line, and "[DONE]" as is."""
    out = []
    for block in text.split("\n\n"):
        block = block.strip()
        if not block:
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


# --- the page ------------------------------------------------------------------------------------------------


def test_page_and_its_assets_are_served_locally(client):
    page = client.get("/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    for label in ("Prompt", "Seed"):  # the pipeline's controls are built from GET /api/samplers (test_browser.py)
        assert re.search(rf"<label for=\"[\w-]+\"[^>]*>{re.escape(label)}</label>", page.text), label
    assert client.get("/static/style.css").status_code == 200
    # the page's ES modules, from its entry: each served as JavaScript (a browser runs a module of no other type)
    modules, todo = set(), ["app.js", "swap.js"]
    while todo:
        name = todo.pop()
        js = client.get(f"/static/{name}")
        assert js.status_code == 200 and "javascript" in js.headers["content-type"], name
        modules.add(name)
        todo += [m for m in re.findall(r'^import [^;]*? from "\./([\w.]+)";', js.text, re.M) if m not in modules]
    assert modules == {p.name for p in STATIC.glob("*.js")}  # every file the folder holds is used
    remote = re.compile(r"(src|href)=\"https?://|url\(https?://|import .* from \"https?://")
    for path in STATIC.iterdir():  # no CDN, no remote fonts: nothing the page loads leaves the machine
        assert not remote.search(path.read_text()), path


def test_samplers_declares_the_parameters_with_the_pages_own_bounds(client):
    """GET /api/samplers is the declaration the page builds its controls from: every parameter the page's requests
    take as lmhead.sampling declares it, but for the page's own bounds (its temperature slider stops at 2), which
    the request's schema enforces too."""
    from lmhead.sampling.steps import describe

    got = client.get("/api/samplers").json()
    declared = describe()
    assert set(got["params"]) <= set(declared["params"]) and "top_a" in got["params"]
    assert got["params"]["temperature"] | {"high": 1e4, "allowed": "in [0, 10000] (0 = greedy)"} == \
        declared["params"]["temperature"]
    assert got["params"]["temperature"]["allowed"] == "in [0, 2] (0 = greedy)"
    for name, p in got["params"].items():
        assert name == "temperature" or p == declared["params"][name], name
    assert {k: v for k, v in got.items() if k != "params"} == {k: v for k, v in declared.items() if k != "params"}
    assert client.post("/api/predict", json={"prompt": "a", "temperature": 2.5}).status_code == 422


def test_openapi_schema_lists_every_route(client):
    paths = client.get("/openapi.json").json()["paths"]
    for route in ("/api/predict", "/api/step", "/api/generate", "/api/model", "/api/params", "/api/layers",
                  "/api/score", "/v1/completions", "/v1/chat/completions", "/v1/models"):
        assert route in paths, route


# --- /api ----------------------------------------------------------------------------------------------------


def test_model_reports_vocabulary_and_limits(client, model):
    info = client.get("/api/model").json()
    assert info["name"] == "tiny-llama"
    assert info["vocab_size"] == model.vocab_size
    assert info["layers"] == 2 and info["width"] == 32
    assert info["limits"]["max_top_logprobs"] == 20
    assert info["limits"]["max_prompt_tokens"] <= model.context_length - 1


def test_predict_returns_what_the_library_computes(client, model):
    body = {"prompt": PROMPT, "temperature": 0.7, "top_k": 20, "top_p": 0.9, "min_p": 0.02, "top": 50}
    got = client.post("/api/predict", json=body).json()
    cfg = SamplingConfig(temperature=0.7, top_k=20, top_p=0.9, min_p=0.02)
    want = model.predict(PROMPT, top=50, config=cfg).to_dict()
    assert got == json.loads(json.dumps(want))
    cands = got["candidates"]
    assert len(cands) == 50
    logits = [c["logit"] for c in cands]
    assert logits == sorted(logits, reverse=True)
    for c in cands:  # the page's exactness rests on this: raw p = exp(logit - lse over the full vocabulary)
        assert c["raw_probability"] == pytest.approx(math.exp(c["logit"] - got["logsumexp"]), rel=1e-5)
    kept = [c["kept"] for c in cands]
    assert kept == sorted(kept, reverse=True), "kept tokens are a prefix of the candidates"
    assert got["kept_count"] == sum(kept) <= 20
    assert sum(c["probability"] for c in cands) == pytest.approx(1.0, abs=1e-5)
    assert got["entropy"]["processed"] < got["entropy"]["raw"]


def test_predict_at_temperature_zero_keeps_only_the_argmax(client):
    got = client.post("/api/predict", json={"prompt": PROMPT, "temperature": 0, "top": 5}).json()
    assert got["kept_count"] == 1
    assert [c["probability"] for c in got["candidates"]] == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert got["entropy"]["processed"] == pytest.approx(0.0, abs=1e-6)


def test_step_greedy_appends_the_argmax_with_its_probability_and_rank(client):
    pred = client.post("/api/predict", json={"prompt": PROMPT, "top": 3}).json()
    top = pred["candidates"][0]
    step = client.post("/api/step", json={"prompt": PROMPT, "temperature": 0}).json()
    assert step["token_id"] == top["token_id"]
    assert step["rank"] == 1 and step["probability"] == pytest.approx(1.0)
    assert step["raw_probability"] == pytest.approx(top["raw_probability"], rel=1e-5)
    assert step["prompt"] == PROMPT + step["text"]


def test_step_with_a_seed_repeats_and_steps_differ(client):
    def pick(seed, step):
        return client.post("/api/step", json={"prompt": PROMPT, "temperature": 1.5, "seed": seed, "step": step}).json()

    assert pick(11, 0) == pick(11, 0)
    picks = {pick(11, s)["token_id"] for s in range(8)}
    assert len(picks) > 1, "a seeded run must still draw a new number at every step"
    for s in range(3):
        p = pick(11, s)
        assert 0 < p["probability"] <= 1 and p["rank"] >= 1


def test_generate_streams_steps_then_done(client, model):
    with client.stream("POST", "/api/generate", json={"prompt": PROMPT, "temperature": 0, "max_tokens": 5}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.read().decode())
    assert events[-1] == "[DONE]"
    steps = events[:-1]
    want = [s.token_id for s in model.generate(PROMPT, 5, config=SamplingConfig(temperature=0))]
    assert [s["token_id"] for s in steps] == want
    assert all(s["rank"] == 1 and s["probability"] == pytest.approx(1.0) for s in steps)


def test_layers_give_the_logit_lens_ending_at_the_models_own_prediction(client, model):
    got = client.post("/api/layers", json={"prompt": PROMPT, "top": 3}).json()
    layers = got["layers"]
    assert [layer["layer"] for layer in layers] == list(range(3))  # embeddings + 2 blocks
    pred = client.post("/api/predict", json={"prompt": PROMPT, "top": 3}).json()
    assert [c["token_id"] for c in layers[-1]["candidates"]] == [c["token_id"] for c in pred["candidates"]]
    assert layers[-1]["candidates"][0]["probability"] == pytest.approx(pred["candidates"][0]["raw_probability"],
                                                                       rel=1e-4)


def test_score_gives_every_token_a_rank_and_the_perplexity(client, model):
    text = "The cat sat on the mat."
    got = client.post("/api/score", json={"text": text}).json()
    tokens = got["tokens"]
    assert [t["token_id"] for t in tokens] == model.encode(text)
    assert tokens[0]["rank"] is None and all(t["rank"] >= 1 for t in tokens[1:])
    mean = -sum(t["logprob"] for t in tokens[1:]) / (len(tokens) - 1)
    assert got["perplexity"] == pytest.approx(math.exp(mean), rel=1e-4)
    assert got["perplexity"] == pytest.approx(model.perplexity(text), rel=1e-6)


def test_params_break_the_loaded_model_down_by_component(client, model):
    got = client.get("/api/params").json()
    m, g = got["model"], got["gpt2_small"]
    unique = {id(p): p.numel() for p in model.hf_model.parameters()}
    assert m["total"] == sum(unique.values())
    assert m["token_embedding"] == model.vocab_size * 32
    assert m["tied"] and m["lm_head"] == 0 and m["other"] == 0
    assert m["head_share"] == pytest.approx(m["token_embedding"] / m["total"])
    assert g["total"] == 124_439_808


# --- bounds and errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("body", [
    {"prompt": PROMPT, "temprature": 0.5},  # unknown field
    {"prompt": PROMPT, "temperature": 2.5},
    {"prompt": PROMPT, "top_p": 0},
    {"prompt": PROMPT, "top": S.MAX_CANDIDATES + 1},
    {"prompt": ""},
    {},
])
def test_bad_predict_requests_are_422_with_a_json_body(client, body):
    r = client.post("/api/predict", json=body)
    assert r.status_code == 422
    assert isinstance(r.json()["detail"], list)


def test_invalid_json_is_422(client):
    r = client.post("/api/predict", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 422


def test_a_prompt_over_the_token_bound_is_400(client, model):
    long = "cat " * (model.context_length + 10)
    r = client.post("/api/predict", json={"prompt": long})
    assert r.status_code == 400 and "limit" in r.json()["detail"]
    r = client.post("/v1/completions", json={"prompt": long, "max_tokens": 2})
    assert r.status_code == 400
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == "prompt"
    r = client.post("/v1/completions", json={"prompt": long, "max_tokens": 2, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = client.post("/api/generate", json={"prompt": long, "max_tokens": 2})
    assert r.status_code == 400 and "limit" in r.json()["detail"]


@pytest.mark.parametrize("route,body,param", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": S.MAX_CONTEXT_TOKENS + 1}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "best_of": 2}, "best_of"),
    ("/v1/completions", {"prompt": "hi", "n": S.MAX_N + 1}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
])
def test_openai_routes_answer_bad_requests_in_openais_error_shape(client, route, body, param):
    r = client.post(route, json=body)
    assert r.status_code == 422
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_an_unknown_model_name_is_404(client):
    r = client.post("/v1/completions", json={"model": "gpt-9", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


# --- /v1 -----------------------------------------------------------------------------------------------------


def test_models_lists_the_served_model(client):
    data = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["tiny-llama"]


def test_greedy_completion_equals_the_librarys_generate(client, model):
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 3})
    body = r.json()
    steps = list(model.generate(PROMPT, 6, config=SamplingConfig(temperature=0), top_logprobs=3))
    choice = body["choices"][0]
    assert choice["text"] == "".join(s.text for s in steps)
    assert choice["finish_reason"] == steps[-1].finish_reason
    assert body["usage"] == {"prompt_tokens": len(model.encode(PROMPT)), "completion_tokens": len(steps),
                             "total_tokens": len(model.encode(PROMPT)) + len(steps)}
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(steps)
    assert lp["token_logprobs"] == pytest.approx([s.raw_logprob for s in steps])
    assert all(len(t) <= 3 for t in lp["top_logprobs"])
    assert lp["text_offset"][0] == len(PROMPT)


def test_chat_uses_a_transcript_when_the_tokenizer_has_no_template(client, model):
    assert not getattr(model.tokenizer, "chat_template", None)
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}
    got = client.post("/v1/chat/completions", json=body).json()
    steps = list(model.generate("user: Hello\nassistant:", 4, config=SamplingConfig(temperature=0)))
    msg = got["choices"][0]["message"]
    assert msg["role"] == "assistant" and msg["content"] == "".join(s.text for s in steps)
    content = got["choices"][0]["logprobs"]["content"]
    assert len(content) == len(steps) and all(len(c["top_logprobs"]) == 2 for c in content)
    assert got["object"] == "chat.completion" and got["usage"]["completion_tokens"] == len(steps)


def test_chat_uses_the_tokenizers_template_when_it_has_one(model):
    from server_harness import tiny_served_model

    templated = tiny_served_model()
    templated.tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    with TestClient(create_app(templated)) as c:
        got = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                   "max_tokens": 3, "temperature": 0}).json()
    steps = list(templated.generate("<|user|>Hi\n<|assistant|>", 3, config=SamplingConfig(temperature=0)))
    assert got["choices"][0]["message"]["content"] == "".join(s.text for s in steps)
    assert got["usage"]["prompt_tokens"] == len(templated.encode("<|user|>Hi\n<|assistant|>"))


def test_streamed_completion_has_the_same_text_as_the_plain_one(client):
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0.9, "seed": 5, "top_k": 20}
    plain = client.post("/v1/completions", json=body).json()["choices"][0]
    with client.stream("POST", "/v1/completions",
                       json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        events = sse_events(r.read().decode())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[-1]["usage"]["completion_tokens"] == len(chunks) - 1 and chunks[-1]["choices"] == []
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == plain["text"]
    assert chunks[-2]["choices"][0]["finish_reason"] == plain["finish_reason"]


def test_streamed_chat_opens_with_the_role_and_ends_with_done(client):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        events = sse_events(r.read().decode())
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])


def test_a_stop_string_ends_the_text_before_it(client):
    free = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0}).json()
    text = free["choices"][0]["text"]
    stop = text[3:5] if len(text) >= 5 else text[-1:]
    got = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                                                "stop": [stop]}).json()["choices"][0]
    assert got["finish_reason"] == "stop" and stop not in got["text"]
    assert text.startswith(got["text"])


# --- the real model ------------------------------------------------------------------------------------------


@pytest.mark.model
def test_real_model_predicts_and_chats_with_its_template():
    from server_harness import real_model

    model = real_model("smollm2-135m")
    assert model.tokenizer.chat_template
    with TestClient(create_app(model)) as c:
        pred = c.post("/api/predict", json={"prompt": "The capital of France is", "top": 256,
                                            "temperature": 0.8, "top_p": 0.9}).json()
        assert len(pred["candidates"]) == 256 and pred["vocab_size"] == 49152
        assert pred["candidates"][0]["text"] == "·Paris"
        chat = c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 12, "temperature": 0}).json()
        assert "Paris" in chat["choices"][0]["message"]["content"]
        prompt = model.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                                     tokenize=False, add_generation_prompt=True)
        assert chat["usage"]["prompt_tokens"] == len(model.encode(prompt))


# --- the CLI -------------------------------------------------------------------------------------------------


def fake_serve(monkeypatch, request, model) -> tuple[list, list]:
    """`lmhead serve` with the model given and nothing listening: ([(host, port) asked for], [apps served])."""
    import socket

    import uvicorn

    from lmhead.cli import serve as cli_serve

    bound, apps = [], []

    def listen(host, port):
        bound.append((host, port))
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        request.addfinalizer(sock.close)
        return [sock]

    def run(self, *args, **kwargs):
        self.started = True
        apps.append(self.config.app)

    monkeypatch.setattr(cli_serve, "load_model_of", lambda args: model)
    monkeypatch.setattr(cli_serve, "_listen", listen)
    monkeypatch.setattr(uvicorn.Server, "run", run)
    return bound, apps


def test_serve_binds_to_loopback_by_default(monkeypatch, request, model):
    from lmhead import cli

    bound, apps = fake_serve(monkeypatch, request, model)
    assert cli.main(["serve"]) == 0
    assert bound[0] == ("127.0.0.1", 8000)
    assert TestClient(apps[0]).get("/api/model").json()["name"] == "tiny-llama"
    assert cli.main(["serve", "--port", "8123", "--host", "::1"]) == 0
    assert bound[1] == ("::1", 8123)


def test_serve_rejects_a_port_out_of_range(capsys):
    from lmhead.cli import main

    assert main(["serve", "--port", "70000"]) == 2
    assert "--port" in capsys.readouterr().err
