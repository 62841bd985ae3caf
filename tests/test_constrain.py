"""Structured output in the library: constraints, the mask against brute force, the constrained distribution in
closed form, every decode path (greedy, sampled, C fast paths, n-gram drafts, mixed and joining rows), finish
reasons and bad input."""

from __future__ import annotations

import dataclasses
import json
import random

import numpy as np
import pytest
import torch
from reference import constrained_allowed, constrained_logprobs, forced_bytes
from tiny import tiny_model

from lmhead import Model
from lmhead.constrain import (
    Choice,
    ConstraintError,
    Grammar,
    JSONObject,
    JSONSchema,
    Regex,
    allowed,
    apply_bitmask_,
    compile_constraint,
)
from lmhead.decode.rows import prepare
from lmhead.generate import Batch
from lmhead.kernels.native import greedy_rows
from lmhead.models.fast_linear import int8_linear_available
from lmhead.sampling import SamplingConfig
from lmhead.speculative import SpeculativeStats

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingConfig(temperature=0.0)
OBJECT = {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"],
          "additionalProperties": False}
# finite languages: (constraint, every word it admits)
LANGUAGES = [
    (Choice(["yes", "no", "none", "cat sat"]), [b"yes", b"no", b"none", b"cat sat"]),
    (Regex(r"(ab|cd)[0-9]{2}"), [f"{a}{i:02d}".encode() for a in ("ab", "cd") for i in range(100)]),
    (JSONSchema({"enum": ["a", "bc", 7]}), [b'"a"', b'"bc"', b"7"]),
    (JSONSchema(OBJECT), [b'{"x": true}', b'{"x": false}']),
    (Grammar('start: "the " ("cat" | "dog") " sat"'), [b"the cat sat", b"the dog sat"]),
    (Grammar('root ::= "on " ("the" | "a") " mat"', syntax="gbnf"), [b"on the mat", b"on a mat"]),
]


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the character standing for each byte (printable bytes themselves, the
    others shifted above 255) → the byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _token_bytes(tokenizer) -> list[bytes]:
    back = _byte_level_alphabet()
    special = set(tokenizer.all_special_ids)
    return [b"" if t in special else bytes(back[c] for c in tokenizer.convert_ids_to_tokens(t))
            for t in range(len(tokenizer))]


def _compiled(model, constraint):
    return compile_constraint(constraint, model.tokenizer, model.exact_head.weight.shape[0],
                              tuple(model.eos_token_ids))


def _allowed_set(matcher) -> set[int]:
    return set(torch.nonzero(allowed(matcher.bits(), matcher.vocab_size)).flatten().tolist())


# --- constraints -------------------------------------------------------------------------------------------


def test_constraints_are_immutable_hashable_and_equal_by_content():
    a = JSONSchema({"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}})
    b = JSONSchema('{"type": "object",\n "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}')
    assert a == b and hash(a) == hash(b) and len({a, b, JSONObject()}) == 2
    # the properties' order is the answer's order: another order is another constraint
    assert a != JSONSchema({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}})
    assert Choice(["x", "y"]) == Choice(("x", "y")) and Regex("a+") != Regex("a*")
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.schema = "{}"
    assert a.value == json.loads(a.schema)


def test_compile_is_cached_per_constraint_and_tokenizer(model):
    first = _compiled(model, JSONSchema(OBJECT))
    assert _compiled(model, JSONSchema(json.dumps(OBJECT))) is first
    assert first.seconds >= 0 and first.matcher() is not first.matcher()


# --- the mask ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("constraint,language", LANGUAGES, ids=lambda x: getattr(x, "kind", ""))
def test_mask_against_brute_force_on_every_prefix_of_random_walks(model, constraint, language):
    # Where the words branch at the next byte the mask is exactly the brute-force set. Where the grammar forces
    # bytes, llguidance keeps to tokenizations it deems canonical: then the mask is within the brute-force set
    # and holds the next token of the tokenizer's own encoding of every word still possible.
    token_bytes = _token_bytes(model.tokenizer)
    eos = set(model.eos_token_ids)
    rng = random.Random(0)
    compiled = _compiled(model, constraint)
    encodings = {w: model.tokenizer(w.decode(), add_special_tokens=False)["input_ids"] for w in language}
    exact = 0
    for _ in range(12):
        matcher, prefix, path = compiled.matcher(), b"", []
        while True:
            want = constrained_allowed(token_bytes, prefix, language, eos)
            got = _allowed_set(matcher)
            assert got & eos == want & eos, prefix  # EOS exactly where the text may end
            if not forced_bytes(prefix, language):
                assert got == want, prefix
                exact += 1
            else:
                assert got <= want, prefix
                nxt = {ids[len(path)] for ids in encodings.values() if ids[:len(path)] == path and len(ids) > len(path)}
                assert nxt <= got, prefix
            if matcher.stopped:  # complete: only EOS may follow
                assert got == eos
                break
            t = rng.choice(sorted(got))
            if t in eos:
                assert matcher.accepting
                break
            matcher.consume(t)
            prefix += token_bytes[t]
            path.append(t)
    assert exact > 0


def test_apply_bitmask_sets_minus_inf_exactly_where_forbidden_and_refuses_an_empty_row():
    g = torch.Generator().manual_seed(0)
    v = 77  # not a multiple of 32
    keep = torch.rand(3, v, generator=g) < 0.3
    keep[:, 5] = True
    packed = torch.zeros(3, 3, dtype=torch.int64)
    for r in range(3):
        for t in keep[r].nonzero().flatten().tolist():
            packed[r, t // 32] |= 1 << (t % 32)
    bits = packed.to(torch.int32).numpy()  # wraps bit 31 to the sign bit, as llguidance's words do
    x = torch.randn(3, v, generator=g)
    out = apply_bitmask_(x.clone(), bits)
    torch.testing.assert_close(out, x.masked_fill(~keep, float("-inf")))
    with pytest.raises(RuntimeError, match="allows no token"):
        apply_bitmask_(x.clone(), bits * 0)


def test_c_greedy_path_takes_the_mask_against_the_closed_form():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3000, generator=g) * 3
    keep = [set(torch.randperm(3000, generator=g)[:n].tolist()) for n in (1, 2, 40, 2500)]
    masked = x.clone()
    for r, k in enumerate(keep):
        masked[r, [t for t in range(3000) if t not in k]] = float("-inf")
    found = greedy_rows(masked)
    assert found is not None
    for r, k in enumerate(keep):
        ref = constrained_logprobs(x[r], k)
        assert found[0][r] == int(ref.argmax()) and found[1][r] == pytest.approx(float(ref.max()), abs=1e-5)


# --- the constrained distribution ----------------------------------------------------------------------------


def _first_logits(model, prompt: str) -> torch.Tensor:
    ids = model.tokenizer(prompt, return_tensors="pt")
    with torch.inference_mode():
        return model.hf_model(**ids).logits[0, -1].float()


@pytest.mark.parametrize("seed", [5, None], ids=["seeded", "unseeded"])
@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
def test_processed_distribution_is_softmax_over_the_allowed_tokens(model, temperature, seed):
    constraint, language = LANGUAGES[0]
    want_allowed = constrained_allowed(_token_bytes(model.tokenizer), b"", language, set(model.eos_token_ids))
    cfg = SamplingConfig(temperature=temperature, seed=seed)
    step = next(iter(model.generate("The dog", 4, config=cfg, constraint=constraint, top_logprobs=20,
                                    generator=torch.Generator().manual_seed(0))))
    ref = constrained_logprobs(_first_logits(model, "The dog"), want_allowed, temperature)
    kept = {a.token_id: a.logprob for a in step.top_logprobs if a.logprob != float("-inf")}
    assert set(kept) == want_allowed  # every allowed token, and nothing else, has a finite processed logprob
    for t, lp in kept.items():
        assert lp == pytest.approx(float(ref[t]), abs=1e-4)
    assert step.logprob == pytest.approx(float(ref[step.token_id]), abs=1e-4)


def test_greedy_constrained_token_is_the_argmax_over_the_allowed_tokens(model):
    constraint, language = LANGUAGES[1]
    token_bytes = _token_bytes(model.tokenizer)
    steps = list(model.generate("Numbers:", 8, config=GREEDY, constraint=constraint, draft="none"))
    prefix, ids = b"", model.tokenizer("Numbers:")["input_ids"]
    for s in steps:
        ok = constrained_allowed(token_bytes, prefix, language, set(model.eos_token_ids))
        with torch.inference_mode():
            x = model.hf_model(torch.tensor([ids])).logits[0, -1].float()
        assert s.token_id == int(constrained_logprobs(x, ok).argmax())
        prefix += token_bytes[s.token_id]
        ids.append(s.token_id)
    assert prefix in language and steps[-1].finish_reason == "stop"


# --- every decode path ---------------------------------------------------------------------------------------

SPEC_CONSTRAINTS = [Regex(r"(the|cat|sat|on|mat|dog)( (the|cat|sat|on|mat|dog)){20,40}\."),
                    JSONSchema({"type": "array", "items": {"enum": ["cat", "dog", "mat"]}, "minItems": 12,
                                "maxItems": 30})]


@pytest.mark.parametrize("constraint", SPEC_CONSTRAINTS, ids=["regex", "array"])
@pytest.mark.parametrize("cfg", [GREEDY, SamplingConfig(temperature=0.9, seed=11),
                                 SamplingConfig(temperature=0.8, top_k=5, seed=3)], ids=["greedy", "seeded", "top-k"])
def test_ngram_drafts_give_the_tokens_of_decoding_without_drafts(model, constraint, cfg):
    plain = list(model.generate("The cat sat on the mat. The cat", 60, config=cfg, constraint=constraint, draft="none"))
    stats = SpeculativeStats()
    drafted = list(model.generate("The cat sat on the mat. The cat", 60, config=cfg, constraint=constraint,
                                  draft="ngram", stats=stats))
    assert [s.token_id for s in drafted] == [s.token_id for s in plain]
    assert [s.finish_reason for s in drafted] == [s.finish_reason for s in plain]
    assert [s.logprob for s in drafted] == pytest.approx([s.logprob for s in plain], abs=1e-4)
    assert stats.drafted > 0  # the drafts ran (and were judged under the masks)


@pytest.mark.skipif(not int8_linear_available(), reason="this torch build has no oneDNN int8 inner product")
def test_int8_drafts_leave_constrained_rows_their_plain_tokens(model):
    # constrained rows judge none of the int8 draft's tokens (it proposes from unmasked logits); free rows beside
    # them still draft
    prompts, cs = ["The cat sat on the mat. The cat", "The dog"], [SPEC_CONSTRAINTS[1], None]
    stats = SpeculativeStats()
    got = {}
    for s in model.generate(prompts, 30, config=GREEDY, constraint=cs, draft="int8", stats=stats):
        got.setdefault(s.index, []).append(s.token_id)
    for i, p in enumerate(prompts):
        assert got[i] == [s.token_id for s in model.generate(p, 30, config=GREEDY, constraint=cs[i], draft="none")]
    assert stats.drafted > 0


def test_rejected_drafts_are_rolled_back_in_the_matcher(model):
    compiled = _compiled(model, Choice(["cat sat", "cat mat"]))
    m = compiled.matcher()
    ids = model.tokenizer("cat sat", add_special_tokens=False)["input_ids"]
    bits, taken = m.draft(ids)
    assert taken == len(ids) and m.stopped and bits.shape[0] == len(ids) + 1
    assert m.settle(ids[:1] + [ids[1] if len(ids) > 1 else ids[0]], taken) >= 1  # one accepted, one more token
    fresh = compiled.matcher()
    fresh.consume(ids[0])
    if len(ids) > 1:
        fresh.consume(ids[1])
    assert _allowed_set(m) == _allowed_set(fresh)


@pytest.mark.parametrize("scores", [True, False])
def test_unseeded_sampled_constrained_rows_draw_allowed_tokens_only(model, scores):
    # such rows decline native.sample_row (its inverse CDF may land on a masked token at u = 0): the pipeline draws
    constraint, language = LANGUAGES[1]
    g = torch.Generator().manual_seed(0)
    cfg = SamplingConfig(temperature=1.3, top_p=0.95)
    for _ in range(6):
        steps = list(model.generate("Numbers:", 8, config=cfg, constraint=constraint, generator=g, scores=scores))
        assert "".join(s.text for s in steps).encode() in language


def test_a_batch_mixing_constrained_and_free_rows_gives_each_row_its_tokens_alone(model):
    prompts = ["The cat", "Hello", "A dog and", "The quick"]
    constraints = [SPEC_CONSTRAINTS[0], None, LANGUAGES[3][0], Choice(["yes", "no"])]
    configs = [GREEDY, SamplingConfig(temperature=1.0, seed=2), SamplingConfig(temperature=0.7, seed=9), GREEDY]
    together: dict[int, list] = {}
    for s in model.generate(prompts, 30, config=configs, constraint=constraints, draft="ngram"):
        together.setdefault(s.index, []).append((s.token_id, s.finish_reason))
    for i, p in enumerate(prompts):
        alone = [(s.token_id, s.finish_reason) for s in
                 model.generate(p, 30, config=configs[i], constraint=constraints[i], draft="none")]
        assert together[i] == alone, i


def test_rows_joining_a_running_batch_keep_their_constraints(model):
    first = prepare(model, ["The cat"], 24, GREEDY, constraint=SPEC_CONSTRAINTS[1])
    late = prepare(model, ["Hello", "A dog"], 24, GREEDY, constraint=[JSONSchema(OBJECT), None])
    batch = Batch(model, draft="ngram")
    batch.add(first)
    got: dict[int, list[int]] = {}
    for _ in range(3):
        for row, step in batch.step():
            got.setdefault(id(row), []).append(step.token_id)
    batch.add(late)
    while batch.rows:
        for row, step in batch.step():
            got.setdefault(id(row), []).append(step.token_id)
    for row, (p, c) in zip([*first, *late], [("The cat", SPEC_CONSTRAINTS[1]), ("Hello", JSONSchema(OBJECT)),
                                             ("A dog", None)], strict=True):
        alone = [s.token_id for s in model.generate(p, 24, config=GREEDY, constraint=c, draft="none")]
        assert got[id(row)] == alone


def test_transformers_body_gives_the_lean_bodys_constrained_tokens():
    hf, tok = tiny_model("llama")
    lean, slow = Model(hf, tok, name="a"), Model(hf, tok, name="b", body="transformers")
    for cfg in (GREEDY, SamplingConfig(temperature=0.9, seed=4)):
        a = [s.token_id for s in lean.generate("The cat", 20, config=cfg, constraint=JSONSchema(OBJECT))]
        b = [s.token_id for s in slow.generate("The cat", 20, config=cfg, constraint=JSONSchema(OBJECT))]
        assert a == b


def test_forced_tokens_are_scored_with_probability_one(model):
    steps = list(model.generate("The cat", 12, config=SamplingConfig(temperature=1.0, seed=1),
                                constraint=JSONSchema(OBJECT)))
    text = "".join(s.text for s in steps)
    assert text.startswith('{"x": ')
    forced = [s for s in steps if "".join(x.text for x in steps[:steps.index(s) + 1]) in '{"x": ']
    assert forced and all(s.logprob == 0.0 and s.raw_logprob == 0.0 and s.rank is not None for s in forced)


# --- finish reasons ---------------------------------------------------------------------------------------


def test_properties_come_out_in_the_schemas_order(model):
    schema = {"type": "object", "properties": {"zeta": {"type": "boolean"}, "alpha": {"type": "boolean"}},
              "required": ["zeta", "alpha"], "additionalProperties": False}
    text = "".join(s.text for s in model.generate("Hi", 30, config=GREEDY, constraint=JSONSchema(schema)))
    assert text.startswith('{"zeta": ') and list(json.loads(text)) == ["zeta", "alpha"]


def test_complete_grammar_stops_and_the_budget_before_completion_is_length(model):
    done = list(model.generate("Hi", 40, config=GREEDY, constraint=JSONSchema(OBJECT)))
    assert done[-1].finish_reason == "stop"
    json.loads("".join(s.text for s in done))
    cut = list(model.generate("Hi", 3, config=GREEDY, constraint=JSONSchema(OBJECT)))
    assert len(cut) == 3 and cut[-1].finish_reason == "length"


def test_eos_is_chosen_only_where_the_grammar_may_stop(model):
    # the tiny model is asked for 1-3 letters; EOS is banned by nothing but the grammar
    for seed in range(8):
        steps = list(model.generate("The", 6, config=SamplingConfig(temperature=1.5, seed=seed),
                                    constraint=Regex("[a-z]{1,3}")))
        body = "".join(s.text for s in steps)
        assert 1 <= len(body) <= 3 and body.isalpha() and steps[-1].finish_reason == "stop"


# --- bad input ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make,match", [
    (lambda: JSONSchema({"type": "object", "dependentSchemas": {"a": {}}}), "does not support.*dependentSchemas"),
    (lambda: JSONSchema({"type": "string", "pattern": "(?<=x)a"}), "does not support.*look-around"),
    (lambda: JSONSchema({"type": "string", "format": "weird"}), "does not support.*weird"),
    (lambda: Regex("a(b"), "unclosed group"),
    (lambda: Grammar("start: foo"), "unknown name"),
])
def test_constraints_that_do_not_compile_are_errors_naming_the_reason(model, make, match):
    with pytest.raises(ConstraintError, match=match):
        _compiled(model, make())


@pytest.mark.parametrize("make,error,match", [
    (lambda: JSONSchema("{bad"), ConstraintError, "schema: not valid JSON"),
    (lambda: JSONSchema([1, 2]), ConstraintError, "a JSON schema is an object"),
    (lambda: JSONSchema(False), ConstraintError, "admits no value"),
    (lambda: JSONSchema({}, whitespace="any"), ValueError, "whitespace: must be one of compact, flexible"),
    (lambda: Choice([]), ConstraintError, "empty"),
    (lambda: Choice("abc"), TypeError, "list of str"),
    (lambda: Regex(""), ConstraintError, "pattern: must not be empty"),
    (lambda: Grammar("x", syntax="ebnf"), ValueError, "syntax: must be one of lark, gbnf"),
    (lambda: Regex("a" * (1 << 20 + 1)), ConstraintError, "more than"),
])
def test_malformed_constraints_are_refused_when_made(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_generate_refuses_what_is_not_a_constraint_and_a_wrong_count(model):
    with pytest.raises(TypeError, match="constraint: expected an lmhead constraint"):
        model.generate("Hi", 4, constraint={"type": "object"})
    with pytest.raises(ValueError, match="one per prompt"):
        model.generate(["a", "b"], 4, constraint=[None])


# --- the packaged models -----------------------------------------------------------------------------------------


@pytest.mark.model
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma-3-270m"])
def test_packaged_model_answers_valid_json_with_and_without_drafts(name):
    # the real tokenizers (49,152 and 262,144 ids), the coded heads and, on scoreless greedy rows, the screened
    # head's round, whose candidates are chosen under each position's mask
    import jsonschema
    from server_harness import real_model

    from lmhead.models.chat import chat_prompt

    real = real_model(name)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "country": {"type": "string", "maxLength": 20}},
              "required": ["city", "country"], "additionalProperties": False}
    prompt = chat_prompt(real, [{"role": "user", "content": "Name a large city and its country, as JSON."}])
    runs = {draft: list(real.generate(prompt, 48, config=GREEDY, constraint=JSONSchema(schema), draft=draft,
                                      scores=False)) for draft in ("none", "ngram")}
    assert [s.token_id for s in runs["ngram"]] == [s.token_id for s in runs["none"]]
    steps = runs["none"]
    assert steps[-1].finish_reason == "stop"
    jsonschema.validate(json.loads("".join(s.text for s in steps)), schema)


def test_forced_token_is_read_from_the_mask_words():
    from lmhead.constrain import forced_token

    for t in (0, 5, 31, 32, 63, 300):
        bits = np.zeros(10, dtype=np.int64)
        bits[t // 32] = 1 << (t % 32)
        assert forced_token(bits.astype(np.uint32).view(np.int32)) == t
    two = np.zeros(10, dtype=np.int32)
    two[0], two[3] = 1, 4
    assert forced_token(two) is None and forced_token(np.zeros(10, dtype=np.int32)) is None
    assert forced_token(np.array([3, 0], dtype=np.int32)) is None


@pytest.mark.parametrize("seed", [None, 7])
def test_forced_tokens_are_taken_without_a_draw(model, seed):
    # one option: every token is forced; the shared generator is never drawn from, each step is scored prob. 1
    g = torch.Generator().manual_seed(0)
    before = g.get_state().clone()
    steps = list(model.generate("The", 20, config=SamplingConfig(temperature=1.0, seed=seed), generator=g,
                                constraint=Choice(["the cat sat on the mat"]), draft="none"))
    assert "".join(s.text for s in steps) == "the cat sat on the mat" and steps[-1].finish_reason == "stop"
    assert torch.equal(g.get_state(), before)
    assert all(s.logprob == 0.0 and s.raw_logprob == 0.0 and s.rank == 1 for s in steps)


def test_forced_continuations_draft_and_are_accepted_in_one_forward(model):
    # a schema whose keys are fixed: its forced tokens are the drafts (jump-forward); the tokens stay the plain ones
    schema = {"type": "object", "properties": {"service_name": {"const": "the quick brown fox"},
                                               "status": {"enum": ["up", "down"]}},
              "required": ["service_name", "status"], "additionalProperties": False}
    plain = [s.token_id for s in model.generate("Hi", 60, config=GREEDY, constraint=JSONSchema(schema), draft="none")]
    stats = SpeculativeStats()
    fast = [s.token_id for s in model.generate("Hi", 60, config=GREEDY, constraint=JSONSchema(schema), draft="ngram",
                                               stats=stats)]
    assert fast == plain
    assert stats.accepted >= len(plain) // 2 and stats.rounds < len(plain) / 2
