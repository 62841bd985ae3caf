"""lmhead.explain_charts (the page's pictures) on tiny random models, against plain references: the head's
decomposition multiplies back to the logits, the rank curve is the sorted probabilities, the draws are
lmhead.sample's with the same seed and follow the pipeline's distribution, the step profile is a per-position
recomputation."""

from __future__ import annotations

import math

import pytest
import torch
from tiny import tiny_model

from lmhead import Model
from lmhead import explain_charts as C
from lmhead.sampling import SamplingConfig, entropy, probabilities, process_logits, sample

PROMPT = "The cat sat on the"
SETTINGS = [SamplingConfig(), SamplingConfig(temperature=0.6, top_k=40, top_p=0.8, min_p=0.05),
            SamplingConfig(temperature=1.7, top_p=0.95), SamplingConfig(temperature=0.0)]


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


@pytest.fixture(scope="module")
def llama():
    hf, tok = tiny_model("llama", seed=0)
    return Model(hf, tok, name="tiny-llama")


@pytest.fixture(scope="module")
def gemma_softcap():
    hf, tok = tiny_model("gemma3", seed=1, softcap=3.0)
    return Model(hf, tok, name="tiny-gemma")


def plain_last(model, prompt):
    """The reference forward: transformers' own model, last position's hidden state and logits."""
    ids = torch.tensor([model.tokenizer(prompt)["input_ids"]])
    out = model.hf_model(ids, output_hidden_states=True)
    return out.hidden_states[-1][0, -1], out.logits[0, -1].float()


def test_last_position_equals_transformers_forward(llama):
    last = C.last_position(llama, PROMPT)
    h, logits = plain_last(llama, PROMPT)
    torch.testing.assert_close(last.hidden, h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(last.logits, logits, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("which", ["llama", "gemma_softcap"])
def test_norm_times_norm_times_cosine_gives_back_each_logit(which, request):
    model = request.getfixturevalue(which)
    g = C.head_geometry(model, PROMPT, top=12)
    head = model.exact_head
    _, logits = plain_last(model, PROMPT)
    assert g.softcap == head.softcap and len(g.candidates) == 12
    want_ids = torch.topk(logits, 12).indices.tolist()
    assert [c.token_id for c in g.candidates] == want_ids
    dots = torch.tensor([g.hidden_norm * c.row_norm * c.cos for c in g.candidates], dtype=torch.float64)
    pre = dots + torch.tensor([c.bias for c in g.candidates], dtype=torch.float64)
    rebuilt = pre if g.softcap is None else g.softcap * torch.tanh(pre / g.softcap)
    torch.testing.assert_close(rebuilt.float(), logits[want_ids], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(torch.tensor([c.logit for c in g.candidates]), logits[want_ids], rtol=1e-5, atol=1e-4)
    if which == "gemma_softcap":  # the cap is visible: the dot products lie beyond ±3 while the logits do not
        assert max(abs(c.dot) for c in g.candidates) > 3 > max(abs(c.logit) for c in g.candidates)


def test_the_planes_x_axis_is_the_projection_onto_h(llama):
    g = C.head_geometry(llama, PROMPT, top=8)
    w = llama.exact_head.weight
    h, _ = plain_last(llama, PROMPT)
    for c in g.candidates:
        assert c.x * g.hidden_norm == pytest.approx(c.dot, rel=1e-5, abs=1e-5)  # the logit is the projection
        assert 0 <= c.plane_share <= 1 + 1e-6
        assert c.plane_share * c.row_norm**2 == pytest.approx(c.x**2 + c.y**2, rel=1e-5)
        assert c.row_norm == pytest.approx(float(w[c.token_id].norm()), rel=1e-6)
        assert c.norm_rank == int((w.norm(dim=1) > w[c.token_id].norm()).sum()) + 1
        cos_all = torch.nn.functional.cosine_similarity(w, h[None], dim=1)
        assert abs(c.cos_rank - (int((cos_all > cos_all[c.token_id]).sum()) + 1)) <= 1  # rounding at ties
    assert g.candidates[0].y >= 0
    rows = w[[c.token_id for c in g.candidates]]
    share = float(sum(c.x**2 + c.y**2 for c in g.candidates) / (rows * rows).sum())
    assert g.plane_share == pytest.approx(share, rel=1e-5) and g.plane_share < 1  # 2 of 32 dimensions


def test_second_direction_is_the_top_principal_direction_orthogonal_to_h(llama):
    g = C.head_geometry(llama, PROMPT, top=10)
    w = llama.exact_head.weight.double()
    h, _ = plain_last(llama, PROMPT)
    u1 = (h / h.norm()).double()
    rows = w[[c.token_id for c in g.candidates]]
    resid = rows - (rows @ u1)[:, None] * u1
    centred = resid - resid.mean(0)
    ys = torch.tensor([c.y for c in g.candidates], dtype=torch.float64)
    # the spread along the chosen direction is the largest singular value's (PCA's first component)
    top = torch.linalg.svdvals(centred)[0]
    assert float((ys - ys.mean()).norm()) == pytest.approx(float(top), rel=1e-4)


def test_geometry_rejects_a_bad_top(llama):
    with pytest.raises(ValueError, match="top"):
        C.head_geometry(llama, PROMPT, top=0)


@pytest.mark.parametrize("cfg", SETTINGS)
def test_rank_curve_values_are_the_sorted_probabilities(llama, cfg):
    curve = C.rank_curve(llama, PROMPT, cfg, points=30)
    _, logits = plain_last(llama, PROMPT)
    ids = torch.tensor([llama.tokenizer(PROMPT)["input_ids"]])
    probs = probabilities(logits[None], cfg, prev_tokens=ids, prompt_len=ids.shape[1])[0]
    at = torch.tensor(curve.ranks) - 1
    assert curve.ranks == sorted(set(curve.ranks)) and curve.ranks[0] == 1 and curve.ranks[-1] == curve.vocab_size
    torch.testing.assert_close(torch.tensor(curve.processed), probs.sort(descending=True).values[at],
                               rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(torch.tensor(curve.raw), torch.softmax(logits, -1).sort(descending=True).values[at],
                               rtol=1e-5, atol=1e-7)
    t = cfg.temperature if cfg.temperature > 0 else 1.0
    scaled = torch.softmax(logits / t, -1).sort(descending=True).values
    torch.testing.assert_close(torch.tensor(curve.scaled), scaled[at], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(torch.tensor(curve.scaled_cumulative, dtype=torch.float64),
                               scaled.double().cumsum(0).clamp(max=1)[at], rtol=1e-5, atol=1e-6)
    assert curve.kept_count == int((probs > 0).sum())
    assert curve.entropy["processed"] == pytest.approx(float(entropy(torch.log(probs))), abs=1e-5)


def test_rank_curve_cutoffs_fall_where_each_step_leaves_its_tokens(llama):
    cfg = SamplingConfig(temperature=0.8, top_k=50, top_p=0.7, min_p=0.1)
    curve = C.rank_curve(llama, PROMPT, cfg)
    _, logits = plain_last(llama, PROMPT)
    x = logits / 0.8
    k = x.masked_fill(x < torch.topk(x, 50).values[-1], -math.inf)
    sp, order = torch.softmax(k, -1).sort(descending=True)
    before = sp.cumsum(0) - sp  # mass strictly above each token (ties are none in random logits)
    p_kept = int((before < 0.7).sum())
    m = torch.softmax(k, -1)
    kept_top_p = torch.zeros_like(m, dtype=torch.bool)
    kept_top_p[order[:p_kept]] = True
    min_kept = int((kept_top_p & (m >= 0.1 * m.max())).sum())
    assert curve.cutoffs == [{"step": "top_k", "setting": 50, "rank": 50},
                             {"step": "top_p", "setting": 0.7, "rank": p_kept},
                             {"step": "min_p", "setting": 0.1, "rank": min_kept}]
    assert curve.kept_count == min_kept
    for c in curve.cutoffs:  # the curve is evaluated exactly at each cut and just after it
        assert c["rank"] in curve.ranks and (c["rank"] + 1 > curve.vocab_size or c["rank"] + 1 in curve.ranks)
    j = curve.ranks.index(min_kept)
    assert curve.processed[j] > 0 and curve.processed[j + 1] == 0


@pytest.mark.parametrize("cfg", [
    SamplingConfig(typical_p=0.6, temperature=0.8, repetition_penalty=1.4),
    SamplingConfig(samplers="llama.cpp", top_k=30, top_n_sigma=1.0, temperature=0.7),
    SamplingConfig(mirostat=2, mirostat_tau=2.0), SamplingConfig(dynatemp_range=0.5, epsilon_cutoff=0.01),
    SamplingConfig(temperature=0.0, no_repeat_ngram_size=1)])
def test_rank_curve_of_declared_steps_cuts_where_each_leaves_its_tokens(llama, cfg):
    """A config the batch path does not run: the curve after temperature is the row after the masks, penalties and
    (dynamic) temperature, and every cut-off step has a line where it leaves its tokens."""
    from lmhead.sampling.steps import Context

    curve = C.rank_curve(llama, PROMPT, cfg, points=30)
    _, logits = plain_last(llama, PROMPT)
    ids = llama.tokenizer(PROMPT)["input_ids"]
    ctx = Context(history=ids, prompt_len=len(ids), xtc=True)
    x, scaled, want, before = logits[None], logits[None], [], logits.numel()
    for s in cfg.steps():
        x = s.apply(x, cfg, ctx)
        if s.stage <= 3:
            scaled = x
        left = int(torch.isfinite(x).sum())
        if s.stage == 4 or left < before:
            want.append({"step": s.name, "setting": getattr(cfg, s.params[0]), "rank": left})
        before = left
    if cfg.is_greedy:
        want.append({"step": "greedy", "setting": 0.0, "rank": 1})
    assert [c["step"] for c in curve.cutoffs] == [c["step"] for c in want] and curve.cutoffs
    assert [c["rank"] for c in curve.cutoffs] == [c["rank"] for c in want]
    at = torch.tensor(curve.ranks) - 1
    sorted_scaled = torch.softmax(scaled[0], -1).sort(descending=True).values
    torch.testing.assert_close(torch.tensor(curve.scaled), sorted_scaled[at], rtol=1e-5, atol=1e-7)
    assert curve.kept_count == want[-1]["rank"] or cfg.is_greedy


def test_rank_points_are_log_spaced_and_include_the_extras():
    r = C.rank_points(262_144, 100, [5000])
    assert r[:10] == list(range(1, 11)) and r[-1] == 262_144 and {5000, 5001} <= set(r)
    assert len(r) < 130
    ratios = [b / a for a, b in zip(r[10:], r[11:], strict=False)]
    assert max(ratios) < 1.2


@pytest.mark.parametrize("cfg", SETTINGS[:3])
def test_draw_counts_are_lmhead_sample_draws_with_the_same_seed(llama, cfg):
    d = C.draw_tokens(llama, PROMPT, 500, seed=7, config=cfg, top=5)
    last = C.last_position(llama, PROMPT)
    prev = torch.tensor([last.ids])
    processed = process_logits(last.logits[None], cfg, prev_tokens=prev, prompt_len=len(last.ids))[0]
    kept = torch.isfinite(processed).nonzero()[:, 0]
    want = kept[sample(processed[kept].expand(500, -1), SamplingConfig(), generator=torch.Generator().manual_seed(7))]
    assert d.token_ids == want.tolist()
    counts = torch.bincount(want, minlength=processed.shape[0])
    probs = probabilities(last.logits[None], cfg, prev_tokens=prev, prompt_len=len(last.ids))[0]
    assert {t.token_id for t in d.tokens} >= set(want.tolist())
    for t in d.tokens:
        assert t.count == int(counts[t.token_id])
        assert t.probability == pytest.approx(float(probs[t.token_id]), rel=1e-5, abs=1e-8)
    assert [t.token_id for t in d.tokens[:5]] == probs.topk(5).indices.tolist()
    assert d.kept_count == int((probs > 0).sum())


def test_draws_in_chunks_continue_one_seeded_stream(llama):
    cfg = SamplingConfig(top_k=20)
    d = C.draw_tokens(llama, PROMPT, 50, seed=3, config=cfg, chunk_elements=20 * 7)  # 7 rows per call
    last = C.last_position(llama, PROMPT)
    processed = process_logits(last.logits[None], cfg)[0]
    kept = torch.isfinite(processed).nonzero()[:, 0]
    g = torch.Generator().manual_seed(3)
    want = torch.cat([sample(processed[kept].expand(min(7, 50 - s), -1), SamplingConfig(), generator=g)
                      for s in range(0, 50, 7)])
    assert d.token_ids == kept[want].tolist()


def test_draw_frequencies_converge_to_the_processed_probabilities(llama):
    cfg = SamplingConfig(temperature=0.7, top_p=0.9)
    d = C.draw_tokens(llama, PROMPT, 10_000, seed=11, config=cfg, top=0)
    for t in d.tokens:  # every token: within 5 binomial standard deviations (a fixed seed: never flaky)
        sd = math.sqrt(t.probability * (1 - t.probability) / d.n)
        assert abs(t.count / d.n - t.probability) <= 5 * sd + 1e-9, t
    tv = 0.5 * sum(abs(t.count / d.n - t.probability) for t in d.tokens)
    assert tv < 0.05


def test_greedy_draws_are_all_the_argmax(llama):
    d = C.draw_tokens(llama, PROMPT, 20, config=SamplingConfig(temperature=0))
    _, logits = plain_last(llama, PROMPT)
    assert set(d.token_ids) == {int(logits.argmax())} and d.kept_count == 1


def test_draws_are_bounded_by_the_work_they_take(llama):
    with pytest.raises(ValueError, match=r"n: must be an integer in \[1, 10000\]"):
        C.draw_tokens(llama, PROMPT, 10_001)
    with pytest.raises(ValueError, match="n: must be an integer in"):
        C.draw_tokens(llama, PROMPT, 0)
    assert C.check_draws(256, 262_144) == 256
    with pytest.raises(ValueError, match=r"\[1, 256\] with 262,144 tokens kept"):
        C.check_draws(257, 262_144)
    with pytest.raises(ValueError, match="seed"):
        C.draw_tokens(llama, PROMPT, 5, seed=-1)


def test_step_profile_equals_each_position_run_alone(llama):
    ids = llama.tokenizer(PROMPT)["input_ids"]
    new = [17, 40, 17, 5]
    cfgs = [SamplingConfig(), SamplingConfig(temperature=0.5, top_k=8), SamplingConfig(repetition_penalty=1.5),
            SamplingConfig(temperature=0)]
    steps = C.step_profile(llama, PROMPT, new, cfgs)
    for j, s in enumerate(steps):
        seq = ids + new[:j]
        out = llama.hf_model(torch.tensor([seq])).logits[0, -1].float()
        probs = probabilities(out[None], cfgs[j], prev_tokens=torch.tensor([seq]), prompt_len=len(ids))[0]
        assert s.token_id == new[j] and s.index == j
        assert s.probability == pytest.approx(float(probs[new[j]]), rel=1e-4, abs=1e-7)
        assert s.raw_probability == pytest.approx(float(torch.softmax(out, -1)[new[j]]), rel=1e-4)
        assert s.rank == int((out > out[new[j]]).sum()) + 1
        assert s.entropy == pytest.approx(float(entropy(torch.log(probs))), abs=1e-4)
        assert s.raw_entropy == pytest.approx(float(entropy(out)), abs=1e-4)
        assert s.kept_count == int((probs > 0).sum())
    assert steps[2].probability != pytest.approx(float(torch.softmax(
        llama.hf_model(torch.tensor([ids + new[:2]])).logits[0, -1], -1)[17]), rel=1e-3)  # the penalty counted
    assert steps[3].entropy == 0.0


def test_step_profile_checks_its_tokens(llama):
    with pytest.raises(ValueError, match="token_ids"):
        C.step_profile(llama, PROMPT, [])
    with pytest.raises(ValueError, match="token_ids"):
        C.step_profile(llama, PROMPT, [llama.vocab_size])
    with pytest.raises(ValueError, match="configs"):
        C.step_profile(llama, PROMPT, [1, 2], [SamplingConfig()])


def test_results_are_json_ready(llama):
    import json

    for obj in (C.head_geometry(llama, PROMPT, 3), C.rank_curve(llama, PROMPT, SamplingConfig(top_k=3)),
                C.draw_tokens(llama, PROMPT, 3)):
        json.dumps(obj.to_dict(), allow_nan=False)
