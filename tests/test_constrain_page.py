"""The explainer page's constraint over several requests: predict, step and generate take the constraint and
where its answer starts (`answer_from`, in characters of the prompt); the server's matcher consumes the answer so
far, so a run of Next-token clicks follows the constraint as one `generate(constraint=...)` does."""

from __future__ import annotations

import json

import pytest

from lmhead.constrain import Choice, Regex
from lmhead.sampling import SamplingConfig

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "The cat sat on the "
BOXES = [({"kind": "choice", "text": "mat, log"}, Choice(["mat", "log"])),
         ({"kind": "regex", "text": "[0-9]{3}"}, Regex("[0-9]{3}"))]


@pytest.mark.parametrize("box,constraint", BOXES, ids=["choice", "regex"])
def test_steps_follow_the_constraint_from_where_the_answer_started(client, model, box, constraint):
    want = list(model.generate(PROMPT, 8, config=SamplingConfig(temperature=0), constraint=constraint))
    start = len(PROMPT)
    prompt, steps = PROMPT, []
    for _ in range(8):
        body = {"prompt": prompt, "temperature": 0, "constraint": box, "answer_from": start}
        pred = client.post("/api/predict", json=body).json()
        kept = {c["token_id"] for c in pred["candidates"] if c["kept"]}
        step = client.post("/api/step", json=body).json()
        assert step["token_id"] in kept  # the table's mask is the step's: the next token of the answer
        steps.append(step)
        prompt = step["prompt"]
        if step["finish_reason"] == "stop":  # one token per request: every other step ends by its length
            break
    assert steps[-1]["finish_reason"] == "stop"
    assert [s["token_id"] for s in steps] == [s.token_id for s in want]
    answer = prompt[len(PROMPT):]
    assert answer in ("mat", "log") if box["kind"] == "choice" else len(answer) == 3 and answer.isdigit()

    # Generate from the first step on: the rest of the same answer, in one stream
    body = {"prompt": PROMPT + steps[0]["text"], "temperature": 0, "constraint": box, "answer_from": start,
            "max_tokens": 8}
    events = [json.loads(line[5:]) for line in client.post("/api/generate", json=body).text.splitlines()
              if line.startswith("data:") and "[DONE]" not in line]
    assert [e["token_id"] for e in events] == [s["token_id"] for s in steps[1:]]
    assert events[-1]["finish_reason"] == "stop"


@pytest.mark.parametrize("route", ["/api/predict", "/api/step", "/api/generate"])
def test_an_answer_so_far_the_constraint_refuses_is_a_400_naming_it(client, route):
    box = {"kind": "choice", "text": "mat, log"}
    start = len(PROMPT)
    r = client.post(route, json={"prompt": PROMPT + "rug", "constraint": box, "answer_from": start})
    assert r.status_code == 400 and "constraint" in r.text and "answer so far" in r.text, r.text
    r = client.post(route, json={"prompt": PROMPT, "constraint": box, "answer_from": start + 5})
    assert r.status_code == 400 and "answer_from" in r.text, r.text
