"""The explainer's routes (/api/predict, /api/layers, /api/step, /api/generate) show the full-precision
model's numbers even when the model decodes with a compressed head (exact-int8: approximate tail logits)."""

from __future__ import annotations

import json
import math

import pytest
from fastapi.testclient import TestClient
from tiny import tiny_model

from lmhead import Model
from lmhead.sampling import SamplingConfig
from lmhead.server import create_app

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "The cat sat on the"


@pytest.fixture(scope="module")
def models():
    """(the model decoding with exact-int8, the same weights with the fp32 head): one transformers model."""
    hf_model, tokenizer = tiny_model("llama", seed=2)
    compressed = Model(hf_model, tokenizer, name="tiny", head="exact-int8")
    assert compressed.head is not compressed.exact_head
    return compressed, Model(hf_model, tokenizer, name="tiny")


@pytest.fixture(scope="module")
def client(models):
    with TestClient(create_app(models[0])) as c:
        yield c


def test_api_predict_and_layers_are_the_fp32_heads(client, models):
    fp32 = models[1]
    body = {"prompt": PROMPT, "top": 30, "temperature": 0.7, "top_p": 0.9}
    got = client.post("/api/predict", json=body).json()
    want = fp32.predict(PROMPT, top=30, config=SamplingConfig(temperature=0.7, top_p=0.9)).to_dict()
    assert got["head"] == "fp32"
    assert got["candidates"] == want["candidates"] and got["logsumexp"] == want["logsumexp"]
    assert got["entropy"] == want["entropy"]
    layers = client.post("/api/layers", json={"prompt": PROMPT, "top": 5}).json()["layers"]
    assert layers == fp32.predict(PROMPT, top=1, layers=True, layer_top=5).to_dict()["layers"]


@pytest.mark.parametrize("settings", [{"temperature": 0}, {"temperature": 0.8, "top_p": 0.95, "seed": 4}])
def test_api_step_and_generate_report_the_fp32_heads_probabilities(client, models, settings):
    fp32 = models[1]
    cfg = {k: v for k, v in settings.items() if k != "seed"}
    step = client.post("/api/step", json={"prompt": PROMPT, **settings}).json()
    exact = fp32.predict(PROMPT, top=fp32.vocab_size, config=SamplingConfig(**cfg))
    chosen = next(c for c in exact.candidates if c.token_id == step["token_id"])
    assert step["raw_probability"] == pytest.approx(chosen.raw_probability, rel=1e-5, abs=1e-7)
    assert step["probability"] == pytest.approx(chosen.probability, rel=1e-5, abs=1e-7)
    assert step["rank"] == 1 + sum(c.logit > chosen.logit for c in exact.candidates)

    text = client.post("/api/generate", json={"prompt": PROMPT, "max_tokens": 1, **settings}).text
    event = json.loads(next(line[5:] for line in text.splitlines() if line.startswith("data:")))
    first = next(c for c in exact.candidates if c.token_id == event["token_id"])
    assert math.exp(event["raw_logprob"]) == pytest.approx(first.raw_probability, rel=1e-5, abs=1e-7)
