"""Speculative decoding's rules: greedy acceptance, the speculative-sampling rule (closed form and by draws), the
int8 draft, adaptive k, bad input."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from tiny import tiny_model

from lmhead.speculative import (
    AdaptiveK,
    Draft,
    NgramDraft,
    SpeculativeStats,
    accept_greedy,
    accept_sampled,
    check_draft_tokens,
    draft_for,
    frequent_tokens,
    residual,
)


def test_accept_greedy_takes_the_longest_agreeing_prefix():
    draft = torch.tensor([[5, 6, 7], [5, 6, 7], [1, 2, 3]])
    target = torch.tensor([[5, 6, 7, 8], [5, 9, 7, 8], [0, 2, 3, 4]])
    assert accept_greedy(draft, target).tolist() == [3, 1, 0]


def _dist(g: torch.Generator, v: int, zeros: int = 0) -> torch.Tensor:
    p = torch.rand(v, generator=g, dtype=torch.float64) ** 3
    p[torch.randperm(v, generator=g)[:zeros]] = 0
    return p / p.sum()


@pytest.mark.parametrize("zeros", [0, 3])
def test_one_position_emits_exactly_p_in_closed_form(zeros):
    """Σ_d q(d)·[a(d)·δ_d + (1 − a(d))·r] = p, with a = min(1, p/q) and r = residual(p, q)."""
    g = torch.Generator().manual_seed(zeros)
    for _ in range(20):
        p, q = _dist(g, 9, zeros), _dist(g, 9, zeros)
        a = torch.where(q > 0, (p / q.clamp_min(1e-300)).clamp(max=1), torch.zeros_like(p))
        emitted = q * a + (q * (1 - a)).sum() * residual(p, q)
        torch.testing.assert_close(emitted, p, atol=1e-12, rtol=0)


def test_a_point_mass_draft_emits_exactly_p_in_closed_form():
    """The n-gram draft proposes d with q = δ_d: accepted with probability p(d), else a draw from p without d
    — together exactly p, for every d."""
    g = torch.Generator().manual_seed(7)
    for zeros in (0, 3):
        p = _dist(g, 9, zeros)
        for d in range(9):
            q = torch.zeros_like(p)
            q[d] = 1
            emitted = p[d] * q + (1 - p[d]) * residual(p, q)
            torch.testing.assert_close(emitted, p, atol=1e-12, rtol=0)


def test_ngram_proposals_equal_the_reference():
    from reference import ngram_proposal

    g = torch.Generator().manual_seed(3)
    for _ in range(300):
        tokens = torch.randint(0, 4, (int(torch.randint(1, 30, (), generator=g)),), generator=g).tolist()
        k = int(torch.randint(0, 6, (), generator=g))
        for max_n, min_n in ((3, 1), (2, 2), (4, 2)):
            assert NgramDraft(max_n, min_n).propose(tokens, k) == ngram_proposal(tokens, k, max_n, min_n)
    assert NgramDraft().propose([1, 2, 3, 9, 1, 2, 3], 3) == [9, 1, 2]
    assert NgramDraft().propose([1, 2, 3], 4) == []
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramDraft(1, 2)


def test_residual_of_equal_distributions_is_p():
    p = torch.tensor([0.2, 0.3, 0.5])
    assert torch.equal(residual(p, p.clone()), p)


def test_accept_sampled_draws_match_the_target_distribution():
    """Goodness of fit: the first emitted token over 6000 seeded runs is distributed as p_0 (chi-square)."""
    g = torch.Generator().manual_seed(0)
    v, k, runs = 6, 2, 6000
    p = torch.stack([_dist(g, v) for _ in range(k + 1)]).float()
    q = torch.stack([_dist(g, v) for _ in range(k)]).float()
    counts = torch.zeros(v)
    gen = torch.Generator().manual_seed(1)
    for _ in range(runs):
        d = torch.stack([torch.multinomial(q[i], 1, generator=gen)[0] for i in range(k)])
        n, last = accept_sampled(d[None], q[None], p[None], [None], [0], generator=gen)
        first = int(d[0]) if n[0] > 0 else int(last[0])
        counts[first] += 1
    expected = p[0] * runs
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5, (chi2, counts, expected)  # 5 degrees of freedom: p ≈ 0.001


def test_seeded_rows_reproduce_and_do_not_depend_on_other_rows():
    g = torch.Generator().manual_seed(3)
    p = torch.stack([torch.stack([_dist(g, 8) for _ in range(4)]) for _ in range(2)]).float()
    q = torch.stack([torch.stack([_dist(g, 8) for _ in range(3)]) for _ in range(2)]).float()
    d = torch.tensor([[1, 2, 3], [4, 5, 6]])
    both = accept_sampled(d, q, p, [7, 8], [10, 10])
    alone = accept_sampled(d[1:], q[1:], p[1:], [8], [10])
    assert both[0][1] == alone[0][0] and both[1][1] == alone[1][0]
    again = accept_sampled(d, q, p, [7, 8], [10, 10])
    assert torch.equal(both[0], again[0]) and torch.equal(both[1], again[1])


def test_adaptive_k_grows_on_full_acceptance_and_shrinks_on_early_rejection():
    k = AdaptiveK(4)
    k.update([4], 4)
    assert k.k == 5
    k.update([1], 5)
    k.update([1], 4)
    assert k.k == 3 and k.next_k() == 3  # some of each draft accepted: no rest
    fixed = AdaptiveK(4, adaptive=False)
    fixed.update([4], 4)
    fixed.update([0], 4)
    assert fixed.k == 4 and fixed.next_k() == 4


def test_a_row_whose_drafts_keep_missing_rests_longer_each_time_until_one_is_accepted():
    k = AdaptiveK(4)
    pauses = []
    for _ in range(7):
        k.update([0], k.next_k())  # drafted, nothing accepted
        rest = 0
        while k.next_k() == 0:
            rest += 1
        pauses.append(rest)
        assert k.k == 1  # it comes back drafting one token: the cheapest verification
    assert pauses == [1, 2, 4, 8, 16, 32, 32]  # doubling, at most AdaptiveK.MAX_REST
    k.update([1], 1)  # accepted: no rest, and k grows again
    assert k.next_k() == 2 and k.misses == 0
    k.update([0], 0)  # a round that drafted nothing (no n-gram found) teaches nothing
    assert k.next_k() == 2


def test_stats_report_rates():
    s = SpeculativeStats(rounds=2, drafted=8, accepted=6, emitted=8)
    assert s.acceptance_rate == 0.75 and s.tokens_per_round == 4.0
    assert s.as_dict()["acceptance_rate"] == 0.75


@pytest.mark.parametrize("bad", [0, 17, 2.5, True, "4"])
def test_draft_tokens_out_of_range_is_a_clear_error(bad):
    with pytest.raises(ValueError, match=r"draft_tokens must be an int in \[1, 16\]"):
        check_draft_tokens(bad)


def test_int8_draft_agrees_with_the_model_mostly():
    """The draft is approximate by design; on a tiny model its argmax agrees with the fp32 model's on most
    positions (what makes acceptance high), and its logits have the full vocabulary's shape."""
    hf_model, tokenizer = tiny_model("gemma3", layers=2)
    draft = Draft(hf_model, tokenizer)
    ids = torch.randint(4, 290, (1, 24), generator=torch.Generator().manual_seed(0))
    got = draft.logits(ids, torch.arange(24)[None], draft.new_cache(1, 24))
    with torch.no_grad():
        want = hf_model(ids).logits
    assert got.shape == want.shape
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean()
    assert agree >= 0.75, agree
    cos = torch.nn.functional.cosine_similarity(got, want, dim=-1).min()
    assert cos > 0.95, cos
    assert draft.nbytes > 0


def test_frequent_tokens_keeps_specials_and_single_characters():
    _, tokenizer = tiny_model("llama")
    ids = frequent_tokens(tokenizer, len(tokenizer), 280)
    assert ids is not None and len(ids) == 280
    assert set(tokenizer.all_special_ids) <= set(ids.tolist())
    assert ids.tolist() == sorted(ids.tolist())
    assert not math.isnan(float(ids.float().mean()))


# --- the decoder: rounds over the lean body ---------------------------------------------------------------


@functools.cache
def _parts(arch: str, init: float = 0.3):
    """(hf_model, tokenizer, lean body, head, int8 draft) of a tiny model, built once per test run."""
    from tiny import tiny_head

    from lmhead.models.lean import LeanBody

    hf_model, tokenizer = tiny_model(arch, layers=2, init=init)
    return hf_model, tokenizer, LeanBody(hf_model), tiny_head(hf_model), Draft(hf_model, tokenizer)


def _decode(arch: str, prompts: list[list[int]], n: int, configs, draft: bool, k: int = 3,
            generator: torch.Generator | None = None, init: float = 0.3):
    """Drive `Decoder` like generate does (no stop conditions): n tokens per row."""
    from lmhead.decode.engine import Decoder

    _, _, lean, head, int8 = _parts(arch, init)
    dec = Decoder(lean, head, NgramDraft() if draft == "ngram" else (int8 if draft else None), k=k)
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    # rows run on until the slowest has n tokens (generate drops a row at its budget): room for the fastest
    last = dec.start(ids, positions, mask.bool(), 4 * n + 16)
    out: list[list[int]] = [[] for _ in prompts]
    while min(len(o) for o in out) < n:
        history = [p + o for p, o in zip(prompts, out, strict=True)]
        rnd = dec.round(last, configs, history, [len(p) for p in prompts], [len(o) for o in out], generator)
        for o, toks in zip(out, rnd.tokens, strict=True):
            o.extend(toks)
        last = torch.tensor([o[-1] for o in out])
    return [o[:n] for o in out], dec


def _hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                                eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("draft", [True, "ngram"])
@pytest.mark.slow
def test_greedy_with_and_without_draft_equals_transformers(arch, draft):
    from lmhead.sampling import SamplingConfig

    hf_model, tokenizer = _parts(arch)[:2]
    prompts = [tokenizer("The cat sat on the mat. The cat sat on the")["input_ids"], tokenizer("A dog")["input_ids"]]
    greedy = [SamplingConfig(temperature=0)] * 2
    want = [_hf_greedy(hf_model, p, 20) for p in prompts]
    plain, _ = _decode(arch, prompts, 20, greedy, draft=False)
    spec, dec = _decode(arch, prompts, 20, greedy, draft=draft)
    assert plain == want
    assert spec == want
    assert dec.stats.rounds > 0 and dec.stats.accepted > 0


def test_greedy_penalties_and_bias_are_applied_at_every_verified_position():
    from lmhead.sampling import SamplingConfig

    tokenizer = _parts("gemma3")[1]
    prompt = [tokenizer("The cat sat on the")["input_ids"]]
    cfg = [SamplingConfig(temperature=0, repetition_penalty=1.3, logit_bias={5: 2.0})]
    plain, _ = _decode("gemma3", prompt, 16, cfg, draft=False)
    spec, _ = _decode("gemma3", prompt, 16, cfg, draft=True, k=4)
    assert spec == plain


@pytest.mark.parametrize("draft", [True, "ngram"])
def test_sampled_first_token_follows_the_target_distribution(draft, monkeypatch):
    """Goodness of fit on a tiny model, rows without a seed (the min(1, p/q) rule): the first emitted token
    over 1200 runs is distributed as the plain pipeline's probabilities (a drafted token or a residual draw).
    The prompt repeats itself, so the n-gram draft proposes a token every time."""
    from lmhead.sampling import SamplingConfig, probabilities
    from lmhead.speculative import drafts

    monkeypatch.setattr(drafts, "NGRAM_MAX_POSITIONS", 10_000)  # 200 rows still draft (a speed limit only)
    hf_model, tokenizer = _parts("gemma3", 0.15)[:2]
    prompt = tokenizer("The cat The cat The")["input_ids"]
    assert NgramDraft().propose(prompt, 2)
    cfg = SamplingConfig(temperature=1.3, top_k=8)
    with torch.no_grad():
        p = probabilities(hf_model(torch.tensor([prompt])).logits[:, -1], cfg)[0]
    runs, rows = 1200, 200  # 200 independent rows per batch (no seed: each row its own draws)
    counts = torch.zeros_like(p)
    gen = torch.Generator().manual_seed(0)
    for _ in range(runs // rows):
        out, dec = _decode("gemma3", [prompt] * rows, 1, [cfg] * rows, draft=draft, k=2, generator=gen, init=0.15)
        assert dec.stats.drafted > 0
        for o in out:
            counts[o[0]] += 1
    kept = p > 0
    expected = p[kept] * runs
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    assert counts[~kept].sum() == 0
    assert chi2 < 26.1, (chi2, int(kept.sum()))  # 7 degrees of freedom: p ≈ 0.0005


def test_sampled_token_after_an_accepted_ngram_draft_follows_the_target_distribution(monkeypatch):
    """The n-gram draft is judged by drawing from p and comparing (`NgramDraft`): when the first token equals the
    draft, the second one is the target's next draw given it — checked by goodness of fit against p_1 computed
    from the prompt followed by the drafted token (rows without a seed, top-p and min-p on the top-k survivors)."""
    from lmhead.sampling import SamplingConfig, probabilities
    from lmhead.speculative import drafts

    monkeypatch.setattr(drafts, "NGRAM_MAX_POSITIONS", 10_000)  # 400 rows still draft (a speed limit only)
    hf_model, tokenizer = _parts("gemma3", 0.15)[:2]
    prompt = tokenizer("The cat The cat The")["input_ids"]
    d = NgramDraft().propose(prompt, 2)
    assert len(d) == 2
    # a random tiny model barely proposes what the draft does: a logit bias (part of the pipeline) makes
    # p_0(d) ≈ 0.26, so about 620 of the 2,400 rows accept it
    cfg = SamplingConfig(temperature=1.5, top_k=6, top_p=0.95, logit_bias={d[0]: 4.0})
    with torch.no_grad():
        p0 = probabilities(hf_model(torch.tensor([prompt])).logits[:, -1], cfg)[0]
        p1 = probabilities(hf_model(torch.tensor([prompt + d[:1]])).logits[:, -1], cfg)[0]
    counts, firsts = torch.zeros_like(p1), 0
    gen = torch.Generator().manual_seed(1)
    for _ in range(6):
        out, dec = _decode("gemma3", [prompt] * 400, 2, [cfg] * 400, draft="ngram", k=2, generator=gen, init=0.15)
        assert dec.stats.accepted > 0
        for o in out:
            firsts += o[0] == d[0]
            if o[0] == d[0]:
                counts[o[1]] += 1
    n = int(counts.sum())
    assert abs(firsts / 2400 - float(p0[d[0]])) < 4 * (float(p0[d[0]]) / 2400) ** 0.5  # accepted at rate p_0(d)
    kept = p1 > 0
    expected = p1[kept] * n
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    assert counts[~kept].sum() == 0 and float(expected.min()) > 5
    assert chi2 < 20.5, (chi2, int(kept.sum()))  # ≤ 5 degrees of freedom: p ≈ 0.001


@pytest.mark.parametrize("cfg", [dict(temperature=0.9, top_p=0.9, seed=11), dict(temperature=1.2, seed=3),
                                 dict(temperature=0.8, top_k=20, repetition_penalty=1.2, seed=5)])
@pytest.mark.parametrize("draft", [True, "ngram"])
def test_a_seeded_row_gives_the_plain_samplers_tokens(cfg, draft):
    """Seeded rows are verified against the plain sampler's own (seed, step) draw: the tokens are the ones
    the loop gives without a draft, in a batch or alone."""
    from lmhead.sampling import SamplingConfig

    tokenizer = _parts("llama")[1]
    prompts = [tokenizer("The dog and the dog")["input_ids"], tokenizer("Hello world")["input_ids"]]
    config = SamplingConfig(**cfg)
    plain, _ = _decode("llama", prompts[:1], 12, [config], draft=False)
    spec, dec = _decode("llama", prompts[:1], 12, [config], draft=draft)
    batch, _ = _decode("llama", prompts, 12, [config, SamplingConfig(temperature=0)], draft=draft)
    assert spec == plain and batch[0] == plain[0]
    assert dec.stats.rounds > 0


def test_generate_rejects_a_draft_the_model_cannot_have():
    from lmhead import Model
    from lmhead.generate import generate

    hf_model, tokenizer = tiny_model("llama")
    plain = Model(hf_model, tokenizer, body="transformers")
    with pytest.raises(ValueError, match="draft='int8' needs the lean body"):
        generate(plain, "The cat", 4, draft="int8")
    lean = Model(hf_model, tokenizer)
    with pytest.raises(ValueError, match="draft must be one of auto, ngram, int8, none"):
        generate(lean, "The cat", 4, draft="int4")
    with pytest.raises(ValueError, match=r"draft_tokens must be an int in \[1, 16\]"):
        generate(lean, "The cat", 4, draft="int8", draft_tokens=0)


def test_generate_with_a_draft_streams_the_plain_tokens_and_counts():
    from lmhead import Model
    from lmhead.generate import generate
    from lmhead.sampling import SamplingConfig

    hf_model, tokenizer = tiny_model("gemma3")
    model = Model(hf_model, tokenizer)
    stats = SpeculativeStats()
    for cfg in (SamplingConfig(temperature=0), SamplingConfig(temperature=0.9, top_k=30, seed=2)):
        plain = [(s.token_id, s.logprob, s.rank) for s in generate(model, "The cat", 12, config=cfg, draft="none")]
        for draft in ("int8", "ngram", "auto"):
            spec = [(s.token_id, s.logprob, s.rank) for s in generate(model, "The cat", 12, config=cfg, draft=draft,
                                                                       stats=stats)]
            assert [t for t, _, _ in spec] == [t for t, _, _ in plain]
            for (_, a, ra), (_, b, rb) in zip(spec, plain, strict=True):
                assert a == pytest.approx(b, abs=1e-4) and ra == rb
    assert stats.rounds > 0 and 0 <= stats.acceptance_rate <= 1


def test_auto_draft_is_none_without_codes():
    from lmhead import Model

    hf_model, tokenizer = tiny_model("llama")
    model = Model(hf_model, tokenizer)  # built in memory: no GGUF file, no codes
    assert model.auto_draft() == "none" and draft_for(model, "auto") is None
    assert not model.auto_greedy_drafts()  # nor n-grams for greedy rows: measured on the coded body only


def test_auto_drafts_for_greedy_rows_only_where_the_body_reads_codes(monkeypatch):
    # SmolLM2's case: auto_draft() "none", but n-gram drafts pay for greedy rows (and cost sampled ones)
    from lmhead import Model
    from lmhead.generate import generate
    from lmhead.sampling import SamplingConfig

    hf_model, tokenizer = tiny_model("llama")
    model = Model(hf_model, tokenizer)
    monkeypatch.setattr(model, "auto_greedy_drafts", lambda: True)
    prompt = "a b c a b c a b c a b"
    greedy, sampled = SamplingConfig(temperature=0), SamplingConfig(temperature=0.9, top_k=30, seed=4)
    for cfg, drafts in ((greedy, True), (sampled, False)):
        stats = SpeculativeStats()
        auto = [s.token_id for s in generate(model, prompt, 16, config=cfg, draft="auto", stats=stats)]
        assert auto == [s.token_id for s in generate(model, prompt, 16, config=cfg, draft="none")]
        assert (stats.drafted > 0) == drafts
    stats = SpeculativeStats()  # both in one batch: the greedy row drafts, the sampled one takes plain steps
    steps = list(generate(model, [prompt, prompt], 16, config=[greedy, sampled], draft="auto", stats=stats))
    alone = [[s.token_id for s in generate(model, prompt, 16, config=c, draft="none")] for c in (greedy, sampled)]
    assert [[s.token_id for s in steps if s.index == b] for b in range(2)] == alone
    assert stats.drafted > 0
