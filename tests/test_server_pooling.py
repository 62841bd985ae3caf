"""/v1/embeddings, /v1/rerank, /v1/classify and /v1/score on a tiny random model: the answers equal the library's
(`Model.embed`, `Model.rerank`, a classification head's `predict`), OpenAI's shapes (the `openai` client's
`embeddings.create` unchanged, float and base64), and bad input as a 4xx naming the field."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest
import torch
from fastapi.testclient import TestClient
from server_harness import ServerThread

from lmhead.heads import reranker as reranker_mod
from lmhead.heads.classifier import ClassificationHead
from lmhead.server import create_app

TEXTS = ["The cat sat on the mat.", "A dog", "Numbers: 1 2 3 4 5"]


@pytest.fixture(scope="module")
def head(model):
    g = torch.Generator().manual_seed(0)
    return ClassificationHead(torch.randn(3, model.exact_head.d_model, generator=g), torch.randn(3, generator=g),
                              ["a", "b", "c"], template="{text} is")


@pytest.fixture(scope="module")
def client(model, head):
    with TestClient(create_app(model, classifier=head)) as c:
        yield c


def test_embeddings_equal_the_library_in_float_and_base64(client, model):
    r = client.post("/v1/embeddings", json={"input": TEXTS, "model": "tiny-llama"})
    assert r.status_code == 200, r.text
    body = r.json()
    want = model.embed(TEXTS)
    got = torch.tensor([d["embedding"] for d in body["data"]])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and body["object"] == "list"
    tokens = sum(len(model.tokenizer.encode(t)) for t in TEXTS)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    r = client.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64", "dimensions": 8})
    vec = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
    cut = torch.nn.functional.normalize(model.embed(TEXTS[:1], normalize=False)[:, :8], dim=-1)[0]
    torch.testing.assert_close(torch.from_numpy(vec.copy()), cut, rtol=1e-6, atol=1e-6)
    ids = model.tokenizer.encode(TEXTS[1])
    r = client.post("/v1/embeddings", json={"input": [ids], "pooling": "mean", "normalize": False})
    torch.testing.assert_close(torch.tensor(r.json()["data"][0]["embedding"]),
                               model.embed([ids], pooling="mean", normalize=False)[0], rtol=1e-6, atol=1e-6)


def test_the_openai_clients_embeddings_create_works_unchanged(model):
    with ServerThread(create_app(model)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        r = client.embeddings.create(model="tiny-llama", input=TEXTS)  # base64 on the wire by default
        got = torch.tensor([d.embedding for d in r.data])
        torch.testing.assert_close(got, model.embed(TEXTS), rtol=1e-6, atol=1e-6)
        assert r.usage.prompt_tokens > 0
        f = client.embeddings.create(model="tiny-llama", input="A dog", encoding_format="float", dimensions=4)
        assert len(f.data[0].embedding) == 4
        assert sum(v * v for v in f.data[0].embedding) == pytest.approx(1.0, abs=1e-5)
        with pytest.raises(openai.BadRequestError, match="dimensions: 10000 is more than the model's width"):
            client.embeddings.create(model="tiny-llama", input="A dog", dimensions=10_000)


@pytest.mark.parametrize("body,status,words", [
    ({"input": []}, 422, "input"),
    ({"input": [""]}, 400, r"input\[0\] is an empty string"),
    ({"input": "x", "encoding_format": "hex"}, 422, "encoding_format"),
    ({"input": "x", "dimensions": 0}, 422, "dimensions"),
    ({"input": [[1, 10**6]]}, 400, "token id 1000000, outside the vocabulary"),
    ({"input": "x", "pooling": "max"}, 422, "pooling"),
    ({"input": "x", "model": "other"}, 404, "other"),
])
def test_bad_embedding_requests_are_4xx_naming_the_field(client, body, status, words):
    r = client.post("/v1/embeddings", json=body)
    assert r.status_code == status, r.text
    assert "error" in r.json()
    import re
    assert re.search(words, r.text)


def test_rerank_classify_and_score_equal_the_library(client, model, head, monkeypatch):
    monkeypatch.setattr(reranker_mod, "QWEN3_TEMPLATE", "Query: {query}\nDocument: {document}\nRelevant:")
    docs = ["The cat sat on the mat.", "Numbers: 1 2 3", {"text": "The dog sat on the log."}]
    r = client.post("/v1/rerank", json={"query": "cat", "documents": docs, "top_n": 2})
    assert r.status_code == 200, r.text
    want = model.rerank("cat", [d if isinstance(d, str) else d["text"] for d in docs], top_n=2)
    got = r.json()["results"]
    assert [x["index"] for x in got] == [w["index"] for w in want]
    assert [x["relevance_score"] for x in got] == pytest.approx([w["relevance_score"] for w in want], abs=1e-6)
    assert got[0]["document"] == {"text": want[0]["document"]}
    r = client.post("/rerank", json={"query": "cat", "documents": ["a b", "c d"], "return_documents": False})
    assert "document" not in r.json()["results"][0]
    r = client.post("/v1/classify", json={"input": TEXTS})
    assert r.status_code == 200, r.text
    probs = model.classify(TEXTS, head)
    data = r.json()["data"]
    torch.testing.assert_close(torch.tensor([d["probs"] for d in data]), probs, rtol=1e-5, atol=1e-6)
    assert [d["label"] for d in data] == [head.labels[i] for i in probs.argmax(-1).tolist()]
    assert data[0]["num_classes"] == 3
    r = client.post("/v1/score", json={"text_1": "cat", "text_2": ["The cat sat on the mat.", "Numbers: 1 2 3"]})
    assert r.status_code == 200, r.text
    scores = [d["score"] for d in r.json()["data"]]
    from lmhead.heads.reranker import score_pairs

    assert scores == pytest.approx(score_pairs(model, "cat", ["The cat sat on the mat.", "Numbers: 1 2 3"]).tolist(),
                                   abs=1e-6)
    r = client.post("/v1/score", json={"text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
    assert r.status_code == 400 and "text_1 holds 2 texts and text_2 3" in r.text
    r = client.post("/v1/rerank", json={"query": "cat", "documents": []})
    assert r.status_code == 422 and "documents" in r.text
    r = client.post("/v1/rerank", json={"query": "cat", "documents": ["a"], "top_n": 0})
    assert r.status_code == 422 and "top_n" in r.text


def test_classify_without_a_head_is_a_400_that_says_how_to_give_one(model):
    with TestClient(create_app(model)) as c:
        r = c.post("/v1/classify", json={"input": "some text"})
    assert r.status_code == 400 and "--classifier" in r.json()["error"]["message"]


def test_large_requests_go_in_pieces_and_the_served_context_bounds_an_input(model, monkeypatch):
    from lmhead.server import pooling
    from lmhead.server.limits import serve_limits
    from lmhead.server.pooling import pieces

    calls = []
    real = pooling.pooled
    monkeypatch.setattr(pooling, "pooled", lambda m, ids, *a: calls.append(len(ids)) or real(m, ids, *a))
    monkeypatch.setattr(pooling, "BATCH_TOKENS", 100)

    assert pieces([3, 3, 3, 3], budget=6) == [slice(0, 2), slice(2, 4)]
    assert pieces([9, 2], budget=6) == [slice(0, 1), slice(1, 2)]  # an input over the budget is a piece alone
    many = [f"{t} {i}" for i in range(200) for t in TEXTS[:1]]
    with TestClient(create_app(model, serve=serve_limits(model, 16))) as c:
        r = c.post("/v1/embeddings", json={"input": many, "normalize": False})
        assert r.status_code == 200, r.text
        got = torch.tensor([d["embedding"] for d in r.json()["data"]])
        torch.testing.assert_close(got, model.embed(many, normalize=False), rtol=1e-5, atol=1e-5)
        assert len(calls) > 5 and sum(calls) == 200  # one call on the model's thread per piece
        r = c.post("/v1/embeddings", json={"input": ["word " * 40]})
        assert r.status_code == 400 and "input[0] has" in r.text and "served context of 16" in r.text
        r = c.post("/v1/embeddings", json={"input": ["word " * 40], "truncate_prompt_tokens": 8})
        assert r.status_code == 200


def test_the_page_api_shows_one_hidden_state_through_both_heads(client, model, head):
    from lmhead.explain_swap import swap

    r = client.post("/api/swap", json={"prompt": "The cat sat on the", "labels": ["cat", "dog"], "top": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    from lmhead.heads.classifier import verbaliser

    want = swap(model, "The cat sat on the", verbaliser(model, ["cat", "dog"], template="{text}"), top=5).to_dict()
    assert [x["index"] for x in body["lm"]["top"]] == [x["index"] for x in want["lm"]["top"]]
    assert [x["label"] for x in body["swapped"]["top"]] == [x["label"] for x in want["swapped"]["top"]]
    assert body["swapped"]["rows"] == 2 and body["lm"]["rows"] == model.vocab_size
    r = client.post("/api/swap", json={"prompt": "The cat"})  # the served head (the fixture's)
    assert r.status_code == 200 and r.json()["swapped"]["parameters"] == head.num_parameters
    assert client.post("/api/swap", json={"prompt": "x", "labels": ["one"]}).status_code == 422
    page = client.get("/").text
    assert 'id="swap-section"' in page and "/static/swap.js" in page
    assert client.get("/static/swap.js").status_code == 200


def test_ollamas_embed_route_answers_in_its_shape(model):
    from lmhead.server.limits import serve_limits

    with TestClient(create_app(model, serve=serve_limits(model, 16))) as c:
        r = c.post("/api/embed", json={"model": "tiny-llama", "input": TEXTS[:2]})
        assert r.status_code == 200, r.text
        body = r.json()
        torch.testing.assert_close(torch.tensor(body["embeddings"]), model.embed(TEXTS[:2]), rtol=1e-6, atol=1e-6)
        assert body["prompt_eval_count"] == sum(len(model.tokenizer.encode(t)) for t in TEXTS[:2])
        long = "word " * 40
        r = c.post("/api/embed", json={"input": long})  # truncate (default): the end is cut to the context
        ids = model.tokenizer.encode(long)[:16]
        torch.testing.assert_close(torch.tensor(r.json()["embeddings"]), model.embed([ids]), rtol=1e-6, atol=1e-6)
        r = c.post("/api/embed", json={"input": long, "truncate": False})
        assert r.status_code == 400 and "served context of 16" in r.text
