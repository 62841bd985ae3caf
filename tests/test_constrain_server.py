"""Structured output on /v1 with the official `openai` client against a real uvicorn server on a tiny random model:
response_format (json_object, json_schema), vLLM's structured_outputs, llama.cpp's json_schema / grammar, tools and
tool_choice, streaming, the continuous batch with mixed rows, and bad constraints as 400s."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import openai
import pytest
from server_harness import ServerThread

from lmhead.constrain import JSONSchema
from lmhead.sampling import SamplingConfig
from lmhead.server import create_app

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                                                           "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "now"}}  # no parameters: the arguments are an empty object
USER = [{"role": "user", "content": "The cat sat on the"}]
SHORT = [{"role": "user", "content": "Hi"}]  # tool listings fill most of the tiny model's 256-token context


@pytest.fixture(scope="module")
def model():
    # the tiny Llama with a 1,024-token context (rotary positions: any length works), so that a chat listing two
    # tools in a system turn (~240 of the tiny tokenizer's mostly one-character tokens) has room for the call
    from tiny import tiny_model

    from lmhead import Model

    hf_model, tokenizer = tiny_model("llama")
    hf_model.config.max_position_embeddings = 1024
    return Model(hf_model, tokenizer, name="tiny-llama")


@pytest.fixture(scope="module")
def client(model):
    with ServerThread(create_app(model)) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client, **kw):
    return client.chat.completions.create(model="tiny-llama", messages=USER, max_tokens=64, **{"temperature": 0, **kw})


def test_response_format_json_schema_answers_a_valid_object_equal_to_the_library(client, model):
    r = _chat(client, response_format={"type": "json_schema",
                                       "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    from lmhead.models.chat import chat_prompt

    steps = model.generate(chat_prompt(model, USER), 64, config=SamplingConfig(temperature=0),
                           constraint=JSONSchema(PERSON))
    assert choice.message.content == "".join(s.text for s in steps)


def test_response_format_json_object_on_completions_and_chat(client):
    r = client.completions.create(model="tiny-llama", prompt="Hello", max_tokens=64, temperature=0.9, seed=3,
                                  extra_body={"response_format": {"type": "json_object"}})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].text), dict)
    else:  # the budget ended it first: the text so far, never "stop"
        assert r.choices[0].finish_reason == "length" and r.choices[0].text.startswith("{")
    c = _chat(client, response_format={"type": "json_object"})
    assert c.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("field,value,check", [
    ("structured_outputs", {"regex": "[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
    ("structured_outputs", {"choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
    ("structured_outputs", {"json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ("structured_outputs", {"grammar": 'start: "the " ("cat" | "dog")'}, lambda t: t in ("the cat", "the dog")),
    ("json_schema", PERSON, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ("grammar", 'root ::= "on " ("a" | "the") " mat"', lambda t: t in ("on a mat", "on the mat")),
])
def test_vllm_and_llama_cpp_fields_constrain_completions(client, field, value, check):
    r = client.completions.create(model="tiny-llama", prompt="The cat", max_tokens=64, temperature=0,
                                  extra_body={field: value})
    assert r.choices[0].finish_reason == "stop"
    assert check(r.choices[0].text), r.choices[0].text


def test_constrained_logprobs_are_the_constrained_distributions(client):
    r = client.completions.create(model="tiny-llama", prompt="The cat", max_tokens=4, temperature=0, logprobs=5,
                                  extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    lp, prefix = r.choices[0].logprobs, ""
    assert r.choices[0].text in ("yes", "no")
    for token, top in zip(lp.tokens, lp.top_logprobs, strict=True):
        finite = {t for t, v in top.items() if v > -9999.0}  # the alternatives the constraint allows
        assert finite and all(any(c.startswith(prefix + t) for c in ("yes", "no")) for t in finite), (prefix, top)
        assert token in finite
        prefix += token


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_choice_required_or_named_answers_with_tool_calls(client, choice):
    r = client.chat.completions.create(model="tiny-llama", messages=SHORT, temperature=0, tool_choice=choice,
                                       tools=[WEATHER, TIME] if choice == "required" else [TIME, WEATHER])
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    if choice != "required":
        assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        jsonschema.validate(args, WEATHER["function"]["parameters"])
    else:
        assert call.function.name == "now" and args == {}


def test_tool_choice_auto_answers_with_a_call_or_with_text(client):
    for seed in range(4):
        r = client.chat.completions.create(model="tiny-llama", messages=SHORT, max_tokens=48, temperature=1.0,
                                           seed=seed, tools=[WEATHER], tool_choice="auto")
        c = r.choices[0]
        if c.message.tool_calls:
            assert c.finish_reason == "tool_calls" and c.message.tool_calls[0].function.name == "get_weather"
        else:
            assert not (c.message.content or "").startswith("{")


def test_tool_calls_stream_as_one_delta_then_the_finish(client):
    chunks = list(client.chat.completions.create(model="tiny-llama", messages=SHORT, max_tokens=64, temperature=0,
                                                 tools=[WEATHER], tool_choice="required", stream=True))
    calls = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(calls) == 1 and calls[0].choices[0].delta.tool_calls[0].function.name == "get_weather"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_streamed_structured_answer_equals_the_whole_one(client):
    body = {"structured_outputs": {"json": PERSON}}
    whole = client.completions.create(model="tiny-llama", prompt="Hi", max_tokens=64, temperature=0, extra_body=body)
    parts = client.completions.create(model="tiny-llama", prompt="Hi", max_tokens=64, temperature=0, stream=True,
                                      extra_body=body)
    assert "".join(p.choices[0].text for p in parts if p.choices) == whole.choices[0].text


def test_concurrent_constrained_and_free_requests_each_get_their_own_answer(client):
    asks = [("free", None), ("regex", {"structured_outputs": {"regex": "[a-z]{4}"}}),
            ("json", {"json_schema": PERSON}), ("choice", {"structured_outputs": {"choice": ["left", "right"]}})]
    alone = {name: client.completions.create(model="tiny-llama", prompt="The dog", max_tokens=40, temperature=0,
                                             extra_body=body).choices[0].text for name, body in asks}
    got: dict[str, str] = {}

    def ask(name, body):
        got[name] = client.completions.create(model="tiny-llama", prompt="The dog", max_tokens=40, temperature=0,
                                              extra_body=body).choices[0].text

    threads = [threading.Thread(target=ask, args=a) for a in asks * 1]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == alone


@pytest.mark.parametrize("body,match", [
    ({"json_schema": {"type": "object", "dependentSchemas": {"a": {}}}}, "does not support.*dependentSchemas"),
    ({"structured_outputs": {"regex": "(?<=a)b"}}, "does not support.*look-around"),
    ({"grammar": "start: nothing_here"}, "unknown name"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one of"),
    ({"json_schema": PERSON, "grammar": 'start: "x"'}, "one structured-output option"),
    ({"response_format": {"type": "json_schema"}}, "needs a json_schema"),
])
def test_constraints_that_cannot_be_served_are_400s_naming_the_reason(client, body, match):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="tiny-llama", prompt="x", max_tokens=4, extra_body=body)
    assert re.search(match, exc.value.body["message"]), exc.value.body
    with pytest.raises(openai.BadRequestError):  # streamed: refused before the stream opens
        list(client.completions.create(model="tiny-llama", prompt="x", max_tokens=4, stream=True, extra_body=body))


def test_tool_choice_naming_an_unknown_function_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as exc:
        _chat(client, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    assert exc.value.body["param"] == "tool_choice"


def test_a_tool_loop_sends_the_call_and_its_result_back(client):
    first = client.chat.completions.create(model="tiny-llama", messages=SHORT, temperature=0, max_tokens=64,
                                           tools=[WEATHER], tool_choice="required")
    call = first.choices[0].message.tool_calls[0]
    history = [*SHORT, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "12 C, rain"}]
    second = client.chat.completions.create(model="tiny-llama", messages=history, temperature=0, max_tokens=8,
                                            tools=[WEATHER], tool_choice="none")
    assert second.choices[0].message.tool_calls is None and second.choices[0].finish_reason in ("stop", "length")


def test_chat_turns_render_calls_and_results_for_any_template():
    from lmhead.server import schemas as S
    from lmhead.server.structured import chat_turns

    msgs = [S.ChatMessage(role="user", content="Weather?"),
            S.ChatMessage(role="assistant", tool_calls=[S.ToolCall(id="c1", function=S.CalledFunction(
                name="get_weather", arguments='{"city": "Oslo"}'))]),
            S.ChatMessage(role="tool", tool_call_id="c1", content="12 C")]
    assert chat_turns(msgs) == [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": '{"name": "get_weather", "arguments": {"city": "Oslo"}}'},
        {"role": "user", "content": "Result of get_weather: 12 C"}]


def test_n_constrained_choices_each_match_the_schema_and_equal_their_own_seeded_request(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    many = _chat(client, n=3, seed=5, temperature=1.0, response_format=fmt)
    assert [c.index for c in many.choices] == [0, 1, 2]
    for j, c in enumerate(many.choices):
        one = _chat(client, seed=5 + j, temperature=1.0, response_format=fmt).choices[0]
        assert c.message.content == one.message.content and c.finish_reason == one.finish_reason
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.message.content), PERSON)


def test_token_id_prompts_take_the_constraint_each(client, model):
    ids = [model.encode("Hi"), model.encode("The cat")]
    r = client.completions.create(model="tiny-llama", prompt=ids, max_tokens=8, temperature=0,
                                  extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.text in ("yes", "no") and c.finish_reason == "stop" for c in r.choices)


def test_n_streamed_tool_calls_come_one_per_choice(client):
    chunks = list(client.chat.completions.create(model="tiny-llama", messages=SHORT, max_tokens=64, temperature=1.0,
                                                 seed=3, n=2, tools=[WEATHER], tool_choice="required", stream=True))
    finishes = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices
                and c.choices[0].finish_reason}
    assert finishes == {0: "tool_calls", 1: "tool_calls"}
    calls = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert sorted(c.choices[0].index for c in calls) == [0, 1]
