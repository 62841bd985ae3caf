"""Continuous batching (`lmhead.generate.Batch`): rows that join a running batch, or leave it early, give what
they give alone; exact logprobs come from the fp32 head; a reproducible row's head call does not depend on
the rows beside it (`decode.logits.decode_logits`)."""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch
from tiny import tiny_model

from lmhead import Model
from lmhead.decode.logits import decode_logits
from lmhead.decode.rows import prepare
from lmhead.generate import Batch, generate
from lmhead.models.fast_linear import int8_linear_available
from lmhead.models.heads import use_head
from lmhead.sampling import SamplingConfig

GREEDY = SamplingConfig(temperature=0)
SEEDED = SamplingConfig(temperature=0.9, top_p=0.9, seed=11)
PENALISED = SamplingConfig(temperature=0.8, top_k=40, repetition_penalty=1.3, presence_penalty=0.2, seed=5)
WHOLE_ROW = SamplingConfig(temperature=1.0, seed=7)

# (prompt, config, max_new_tokens, extra prepare() arguments): prompts of several lengths, so that a row joins
# both a batch whose columns are longer than its prompt and one whose columns are shorter
REQUESTS = [
    ("The cat sat on the mat and looked around", GREEDY, 10, {"top_logprobs": 3}),
    ("A", SEEDED, 9, {}),
    ("Hello there, how are you doing today my friend", PENALISED, 8, {"stop": "zz"}),
    ("Numbers 1 2", WHOLE_ROW, 10, {"exact_logprobs": True}),
    ("Dog", GREEDY, 4, {}),
]


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request):
    hf_model, tokenizer = tiny_model(request.param, seed=3)
    return Model(hf_model, tokenizer, name=f"tiny-{request.param}")


def alone(model, prompt, config, n, kw, draft="none"):
    return list(generate(model, prompt, n, config=config, draft=draft, **kw))


def assert_same_steps(got, want, atol=1e-5):
    assert [s.token_id for s in got] == [s.token_id for s in want]
    assert "".join(s.text for s in got) == "".join(s.text for s in want)
    assert [s.finish_reason for s in got] == [s.finish_reason for s in want]
    assert [s.rank for s in got] == [s.rank for s in want]
    for a, b in zip(got, want, strict=True):
        for x, y in ((a.logprob, b.logprob), (a.raw_logprob, b.raw_logprob)):
            assert math.isclose(x, y, rel_tol=0, abs_tol=atol) or x == y == -math.inf
        assert [t.token_id for t in a.top_logprobs] == [t.token_id for t in b.top_logprobs]


def run_staggered(model, requests, joins, draft="none", drop=None):
    """Requests admitted at the rounds `joins` (one per request) into one Batch; → steps per request. `drop`:
    (request, round) retired at that round."""
    batch = Batch(model, draft=draft)
    rows = [prepare(model, p, n, cfg, **kw) for p, cfg, n, kw in requests]
    out = defaultdict(list)
    owner = {id(r): i for i, rs in enumerate(rows) for r in rs}
    round_ = 0
    while round_ <= max(joins) or batch.rows:
        batch.add([r for i, rs in enumerate(rows) if joins[i] == round_ for r in rs])
        if drop is not None and drop[1] == round_:
            batch.remove([r for r in rows[drop[0]] if r in batch.rows])
        if batch.rows:
            for row, step in batch.step():
                out[owner[id(row)]].append(step)
        round_ += 1
    return [out[i] for i in range(len(requests))]


@pytest.mark.slow
def test_rows_joining_a_running_batch_give_what_they_give_alone(model):
    got = run_staggered(model, REQUESTS, joins=[0, 2, 2, 4, 6])
    for (prompt, cfg, n, kw), steps in zip(REQUESTS, got, strict=True):
        assert_same_steps(steps, alone(model, prompt, cfg, n, kw))


def test_a_long_prompt_joining_short_rows_gives_what_it_gives_alone(model):
    requests = [REQUESTS[4], REQUESTS[1], REQUESTS[2], REQUESTS[0]]
    got = run_staggered(model, requests, joins=[0, 1, 2, 2])
    for (prompt, cfg, n, kw), steps in zip(requests, got, strict=True):
        assert_same_steps(steps, alone(model, prompt, cfg, n, kw))


def test_a_retired_row_stops_and_the_others_are_unchanged(model):
    got = run_staggered(model, REQUESTS[:3], joins=[0, 0, 2], drop=(0, 3))
    assert len(got[0]) == 3 and got[0][-1].finish_reason is None  # stopped after the 4 rounds it ran
    for (prompt, cfg, n, kw), steps in zip(REQUESTS[1:3], got[1:], strict=True):
        assert_same_steps(steps, alone(model, prompt, cfg, n, kw))


@pytest.mark.skipif(not int8_linear_available(), reason="the int8 draft needs oneDNN's int8 inner product")
def test_rows_join_a_batch_that_drafts(model):
    requests = [REQUESTS[0], REQUESTS[4], ("The quick brown fox", GREEDY, 8, {})]
    got = run_staggered(model, requests, joins=[0, 2, 3], draft="int8")
    for (prompt, cfg, n, kw), steps in zip(requests, got, strict=True):
        assert [s.token_id for s in steps] == [s.token_id for s in alone(model, prompt, cfg, n, kw)]


def test_without_the_lean_body_rows_join_only_an_empty_batch():
    hf_model, tokenizer = tiny_model("llama", seed=3)
    model = Model(hf_model, tokenizer, body="transformers")
    batch = Batch(model)
    batch.add(prepare(model, "The cat", 4, GREEDY))
    assert not batch.can_join
    with pytest.raises(RuntimeError, match="lean body"):
        batch.add(prepare(model, "A dog", 4, GREEDY))
    steps = []
    while batch.rows:
        steps += [s for _, s in batch.step()]
    assert batch.can_join
    assert_same_steps(steps, alone(model, "The cat", GREEDY, 4, {}))


# --- the compressed head -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compressed():
    hf_model, tokenizer = tiny_model("llama", seed=3)
    return use_head(Model(hf_model, tokenizer), "exact-int8", cache=False)


def test_a_reproducible_row_reading_the_tail_gets_its_logits_alone(compressed):
    head = compressed.head
    hidden = torch.randn(4, 1, head.d_model, generator=torch.Generator().manual_seed(0))
    configs = [GREEDY, WHOLE_ROW, SamplingConfig(temperature=1.0), SamplingConfig(top_k=10, seed=1)]
    got = decode_logits(head, hidden, configs)
    assert torch.equal(got[1], head(hidden[1:2]).float()[0])  # seeded, no top-k: a call of its own
    shared = head(hidden[[0, 2, 3]]).float()
    assert torch.equal(got[[0, 2, 3]], shared)


def test_a_seeded_whole_row_draw_does_not_depend_on_the_batch(compressed):
    steps = run_staggered(compressed, [REQUESTS[0], REQUESTS[3], REQUESTS[1]], joins=[0, 0, 1])
    assert_same_steps(steps[1], alone(compressed, *REQUESTS[3]))


def test_exact_logprobs_are_the_fp32_heads(compressed):
    prompt, n = "The cat sat on", 8
    steps = list(generate(compressed, prompt, n, config=WHOLE_ROW, top_logprobs=3, exact_logprobs=True))
    default = list(generate(compressed, prompt, n, config=WHOLE_ROW, top_logprobs=3))
    assert [s.token_id for s in steps] == [s.token_id for s in default]  # the tokens do not change
    ids = compressed.encode(prompt) + [s.token_id for s in steps]
    full = compressed.logits(torch.tensor([ids]))[0].log_softmax(-1)  # the fp32 head, no cache: the reference
    start = len(ids) - len(steps) - 1
    want = torch.tensor([float(full[start + i, s.token_id]) for i, s in enumerate(steps)])
    torch.testing.assert_close(torch.tensor([s.raw_logprob for s in steps]), want, rtol=0, atol=1e-5)
    for i, s in enumerate(steps):
        torch.testing.assert_close(torch.tensor([t.raw_logprob for t in s.top_logprobs]),
                                   full[start + i].topk(3).values, rtol=0, atol=1e-5)
    off = max(abs(a.raw_logprob - b) for a, b in zip(default, want.tolist(), strict=True))
    assert off > 1e-5  # the decode head's own logprobs are within its bound, not exact: the option matters


def test_exact_logprobs_must_be_a_bool(compressed):
    with pytest.raises(TypeError, match="exact_logprobs"):
        generate(compressed, "Hi", 2, exact_logprobs="yes")


@pytest.mark.model
@pytest.mark.parametrize("name", ["gemma-3-270m", "smollm2-135m"])
def test_real_model_rows_joining_a_batch_give_what_they_give_alone(name):
    from server_harness import real_model

    model = real_model(name)
    requests = [("The capital of France is", GREEDY, 8, {}),
                ("Once upon a time, in a small village by the sea,", WHOLE_ROW, 8, {"exact_logprobs": True}),
                ("def add(a, b):", SamplingConfig(temperature=0.8, top_k=40, seed=3), 8, {"top_logprobs": 2})]
    got = run_staggered(model, requests, joins=[0, 2, 3])
    for (prompt, cfg, n, kw), steps in zip(requests, got, strict=True):
        # float rounding on real logits (|z| ~ 20-40), and the exact-int8 head's own logprobs within its bound
        # (measured: 1e-5 on smollm2-135m's fp32 head, 9e-5 on gemma-3-270m's int8 one)
        assert_same_steps(steps, alone(model, prompt, cfg, n, kw), atol=2e-4)
    prompt, _, n, _ = requests[1]
    ids = model.encode(prompt) + [s.token_id for s in got[1]]
    full = model.logits(torch.tensor([ids]))[0].log_softmax(-1)  # the fp32 head, no cache
    start = len(ids) - n - 1
    want = [float(full[start + i, s.token_id]) for i, s in enumerate(got[1])]
    assert [s.raw_logprob for s in got[1]] == pytest.approx(want, abs=1e-4)
