"""The pictures' routes (/api/geometry, /distribution, /draws, /steps) and the model selector (/api/models,
?model=NAME) through FastAPI's TestClient on tiny random models: answers equal lmhead.explain_charts', bounds are
4xx with a JSON body, a second model loads once on first use, one load at a time, and a load failure is a 503."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from fastapi.testclient import TestClient

from lmhead import explain_charts as C
from lmhead.models import ModelError
from lmhead.sampling import SamplingConfig
from lmhead.server import create_app
from lmhead.server.registry import ModelRegistry

PROMPT = "The cat sat on the"
SETTINGS = {"temperature": 0.7, "top_k": 40, "top_p": 0.85, "min_p": 0.02}


class TinyLoader:
    """Loads "tiny-b" (another tiny model, a smaller vocabulary) slowly; "broken" fails as a missing package does.
    Counts loads and the most that ran at once."""

    def __init__(self) -> None:
        self.loads: list[str] = []
        self.running = 0
        self.most = 0
        self.lock = threading.Lock()

    def __call__(self, name: str):
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            time.sleep(0.2)
            self.loads.append(name)
            if name == "broken":
                raise ModelError("model 'broken' needs the package broken-gguf, which is not installed")
            from tiny import tiny_model

            from lmhead import Model

            hf, tok = tiny_model("llama", seed=5, vocab_size=280)
            return Model(hf, tok, name=name)
        finally:
            with self.lock:
                self.running -= 1


@pytest.fixture
def multi(model):
    app = create_app(model)
    loader = TinyLoader()
    app.state.registry = ModelRegistry(app.state.served, names=["tiny-b", "other", "broken"], loader=loader)
    with TestClient(app) as c:
        yield c, loader


def test_geometry_route_equals_the_library(client, model):
    r = client.post("/api/geometry", json={"prompt": PROMPT, "top": 6})
    assert r.status_code == 200
    assert r.json() == C.head_geometry(model, PROMPT, top=6).to_dict()


def test_distribution_route_equals_the_library_at_every_setting(client, model):
    for settings in ({}, SETTINGS, {"temperature": 0}):
        r = client.post("/api/distribution", json={"prompt": PROMPT, "points": 40, **settings})
        assert r.status_code == 200
        want = C.rank_curve(model, PROMPT, SamplingConfig(**settings), points=40).to_dict()
        assert r.json() == want


def test_draws_route_equals_the_library_and_repeats_with_its_seed(client, model):
    body = {"prompt": PROMPT, "n": 300, "seed": 4, "top": 5, **SETTINGS}
    a, b = client.post("/api/draws", json=body).json(), client.post("/api/draws", json=body).json()
    assert a == b == C.draw_tokens(model, PROMPT, 300, seed=4, config=SamplingConfig(**SETTINGS), top=5).to_dict()
    other = client.post("/api/draws", json={**body, "seed": 5}).json()
    assert other["token_ids"] != a["token_ids"]


def test_steps_route_equals_the_library_with_each_tokens_settings(client, model):
    tokens = [{"token_id": 17}, {"token_id": 40, **SETTINGS}, {"token_id": 5, "temperature": 0}]
    r = client.post("/api/steps", json={"prompt": PROMPT, "tokens": tokens})
    assert r.status_code == 200
    cfgs = [SamplingConfig(), SamplingConfig(**SETTINGS), SamplingConfig(temperature=0)]
    assert r.json()["steps"] == [s.to_dict() for s in C.step_profile(model, PROMPT, [17, 40, 5], cfgs)]


@pytest.mark.parametrize(("path", "body", "status", "words"), [
    ("/api/draws", {"prompt": PROMPT, "n": 10_001}, 422, "n"),
    ("/api/draws", {"prompt": PROMPT, "n": 10, "seed": -1}, 422, "seed"),
    ("/api/draws", {"prompt": PROMPT, "n": 10, "colour": 1}, 422, "colour"),
    ("/api/geometry", {"prompt": PROMPT, "top": 1}, 422, "top"),
    ("/api/geometry", {"prompt": ""}, 422, "prompt"),
    ("/api/distribution", {"prompt": PROMPT, "top_p": 0}, 422, "top_p"),
    ("/api/steps", {"prompt": PROMPT, "tokens": []}, 422, "tokens"),
    ("/api/steps", {"prompt": PROMPT, "tokens": [{"token_id": 10**6}]}, 400, "token_ids"),
    ("/api/geometry", {"prompt": "word " * 2000}, 400, "prompt"),
])
def test_bad_requests_get_a_json_error_naming_the_field(client, path, body, status, words):
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    assert words in r.text


def test_models_lists_the_startup_model_first_then_the_packaged_ones(client):
    m = client.get("/api/models").json()
    names = [x["name"] for x in m["models"]]
    assert names[0] == "tiny-llama" and m["default"] == "tiny-llama"
    assert {"gemma-3-270m", "smollm2-135m"} <= set(names)
    assert [x["loaded"] for x in m["models"]] == [True] + [False] * (len(names) - 1)


def test_a_second_model_loads_once_on_first_use(multi):
    client, loader = multi
    a = client.post("/api/predict?model=tiny-b", json={"prompt": PROMPT, "top": 3}).json()
    assert a["vocab_size"] == 280 and a["model"] == "tiny-b"
    assert client.get("/api/model?model=tiny-b").json()["vocab_size"] == 280
    assert client.post("/api/distribution?model=tiny-b", json={"prompt": PROMPT}).json()["vocab_size"] == 280
    assert client.get("/api/model").json()["name"] == "tiny-llama"  # no parameter: the startup model
    assert client.get("/api/model?model=tiny-llama").json()["vocab_size"] != 280
    assert loader.loads == ["tiny-b"]
    listed = {x["name"]: x["loaded"] for x in client.get("/api/models").json()["models"]}
    assert listed == {"tiny-llama": True, "tiny-b": True, "other": False, "broken": False}


def test_loads_run_one_at_a_time_and_a_waiting_request_reuses_the_load(model):
    app = create_app(model)
    loader = TinyLoader()
    registry = ModelRegistry(app.state.served, names=["tiny-b", "other"], loader=loader)

    async def both():
        return await asyncio.gather(registry.get("tiny-b"), registry.get("other"), registry.get("tiny-b"))

    a, b, c = asyncio.run(both())
    assert a is c and a is not b
    assert sorted(loader.loads) == ["other", "tiny-b"] and loader.most == 1


def test_a_model_that_cannot_load_is_a_503_and_an_unknown_name_a_404(multi):
    client, loader = multi
    r = client.post("/api/predict?model=broken", json={"prompt": PROMPT})
    assert r.status_code == 503
    detail = r.json()["detail"]
    assert detail.startswith("model 'broken' could not be loaded: ") and "not installed" in detail
    assert r.json()["param"] == "model"
    listed = {x["name"]: x for x in client.get("/api/models").json()["models"]}
    assert listed["broken"]["loaded"] is False and "not installed" in listed["broken"]["error"]
    r = client.get("/api/model?model=nope")
    assert r.status_code == 404 and "tiny-llama, tiny-b, other, broken" in r.json()["detail"]
    assert client.post("/api/predict", json={"prompt": PROMPT, "top": 1}).status_code == 200  # the server goes on


# --- what the page runs its own pipeline from ---------------------------------------------------------------------


def test_samplers_route_is_the_declaration_of_every_step_the_pages_requests_take(client):
    from lmhead.sampling.steps import ORDER, PARAMS, PRESETS, STEPS
    from lmhead.server.schemas import PredictRequest, SamplingFields

    d = client.get("/api/samplers").json()
    assert {s["name"] for s in d["steps"]} == set(STEPS) and d["order"] == list(ORDER)
    assert d["presets"] == {k: None if v is None else list(v) for k, v in PRESETS.items()}
    assert set(d["params"]) == set(SamplingFields.model_fields) <= set(PredictRequest.model_fields)
    assert set(d["params"]) == set(PARAMS) - {"seed"}  # every declared parameter: the page sets its own seed
    for name, p in d["params"].items():  # the page's own bound of the temperature: test_server.py
        assert p["kind"] == PARAMS[name].kind and (p["allowed"] == PARAMS[name].allowed or name == "temperature"), name
    step = next(s for s in d["steps"] if s.get("name") == "xtc")
    assert step["params"] == ["xtc_probability", "xtc_threshold"] and step["explain"] == STEPS["xtc"].explain


def test_logits_route_sends_the_last_positions_logits_as_float32_bytes(client, model):
    import numpy as np

    r = client.post("/api/logits", json={"prompt": PROMPT})
    assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
    got = np.frombuffer(r.content, dtype="<f4")
    assert got.tolist() == C.last_position(model, PROMPT).logits.tolist()
    shown = client.post("/api/predict", json={"prompt": PROMPT, "top": 10}).json()["candidates"]
    assert [got[c["token_id"]] for c in shown] == pytest.approx([c["logit"] for c in shown], rel=1e-6)
    assert client.post("/api/logits", json={"prompt": ""}).status_code == 422


def test_the_pages_requests_take_the_penalties_bias_and_bans_the_library_runs(client, model):
    body = {"prompt": PROMPT, "top": 5, "repetition_penalty": 1.5, "logit_bias": {"7": 3.0}, "banned_tokens": [11]}
    got = client.post("/api/predict", json=body).json()
    want = model.predict(PROMPT, top=5, config=SamplingConfig(repetition_penalty=1.5, logit_bias={7: 3.0},
                                                              banned_tokens=(11,))).to_dict()
    assert got == want and [s["name"] for s in got["steps"]] == ["logit_bias", "penalties"]
    assert client.post("/api/predict", json={**body, "repetition_penalty": 0}).status_code == 422


def test_min_tokens_withholds_the_end_of_sequence_in_the_explainer_as_in_generate(client, model):
    eos = model.eos_token_ids[0]
    got = client.post("/api/predict", json={"prompt": PROMPT, "top": model.vocab_size, "min_tokens": 2}).json()
    assert got["config"]["stop_token_ids"] == list(model.eos_token_ids)
    cand = next(c for c in got["candidates"] if c["token_id"] == eos)
    assert cand["probability"] == 0 and cand["cut_by"] == "min_tokens"
    curve = client.post("/api/distribution", json={"prompt": PROMPT, "min_tokens": 2}).json()
    assert curve["kept_count"] == model.vocab_size - 1
