"""The official `openai` client against a real uvicorn server (loopback, free port) on a tiny random model:
completions, chat, streaming, logprobs, seeds, the top_k / min_p extensions and errors."""

from __future__ import annotations

import openai
import pytest
from server_harness import ServerThread

from lmhead.sampling import SamplingConfig
from lmhead.server import create_app

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def client(model):
    with ServerThread(create_app(model)) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_list_has_the_served_model(client):
    assert [m.id for m in client.models.list().data] == ["tiny-llama"]


def test_greedy_completion_matches_the_library_with_logprobs(client, model):
    r = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=5)
    steps = list(model.generate(PROMPT, 8, config=SamplingConfig(temperature=0), top_logprobs=5))
    choice = r.choices[0]
    assert choice.text == "".join(s.text for s in steps)
    assert choice.finish_reason in ("stop", "length")
    assert choice.logprobs.token_logprobs == pytest.approx([s.raw_logprob for s in steps])
    # a dict keyed by token text (OpenAI's legacy shape): tokens that decode alike (byte pieces) share a key
    assert all(1 <= len(top) <= 5 for top in choice.logprobs.top_logprobs)
    for step, top in zip(steps, choice.logprobs.top_logprobs, strict=True):
        assert max(top.values()) == pytest.approx(step.top_logprobs[0].raw_logprob)
    assert r.usage.completion_tokens == len(steps)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_a_seed_reproduces_a_sampled_completion(client):
    def run(seed):
        return client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=10, temperature=1.3,
                                         seed=seed).choices[0].text

    assert run(123) == run(123)
    assert len({run(s) for s in range(5)}) > 1


def test_top_k_and_min_p_extensions_are_accepted(client, model):
    kw = dict(model="tiny-llama", prompt=PROMPT, max_tokens=6, temperature=1.0, seed=3)
    r = client.completions.create(**kw, extra_body={"top_k": 1})
    greedy = client.completions.create(**{**kw, "temperature": 0})
    assert r.choices[0].text == greedy.choices[0].text  # top-k 1 leaves only the argmax
    r = client.completions.create(**kw, extra_body={"min_p": 1.0})
    assert r.choices[0].text == greedy.choices[0].text  # min-p 1 keeps only tokens as likely as the top one


def test_streamed_completion_concatenates_to_the_plain_text(client):
    kw = dict(model="tiny-llama", prompt=PROMPT, max_tokens=8, temperature=0.8, seed=9, top_p=0.9)
    plain = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == plain
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_chat_completion_with_logprobs(client):
    r = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "Say hi"}],
                                       max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert len(choice.logprobs.content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 for t in choice.logprobs.content)
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob for t in choice.logprobs.content)


def test_streamed_chat_matches_the_plain_chat(client):
    kw = dict(model="tiny-llama", messages=[{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "Hello"}],
              max_tokens=6, temperature=0.7, seed=4)
    plain = client.chat.completions.create(**kw).choices[0].message.content
    stream = client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1


def test_errors_come_back_as_openai_exceptions(client):
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "x"}],
                                       logprobs=True, top_logprobs=21)
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="tiny-llama", prompt="word " * 600, max_tokens=2)
    assert "maximum context length is 256 tokens" in exc.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="not-this-one", prompt="hi", max_tokens=2)
