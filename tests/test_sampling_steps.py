"""The declared steps (lmhead.sampling.steps): each new sampler against its plain reference (tests/reference.py) and,
where transformers has it, against transformers' processor; the orders; mirostat's state; XTC's coin; the checks
derived from the declarations; today's settings keep the batch path."""

from __future__ import annotations

import functools
import math

import pytest
import reference as ref
import torch

from lmhead.sampling import SamplingConfig, probabilities, process_logits, sample, sample_with_logprobs
from lmhead.sampling.steps import ORDER, PARAMS, PRESETS, STEPS, RowState, canonical

pytestmark = pytest.mark.usefixtures("one_thread")

HISTORY = [[3, 7, 9, 3, 7, 9, 3, 7], [1, 2, 1, 2, 1], [4, 4, 4, 4], [], [5, 6, 7, 5, 6]]


def rows(vocab: int = 300, seed: int = 0) -> torch.Tensor:
    """Language-model-like rows [5, vocab]: a few high logits over a Gaussian tail, one flat row, a tie."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, vocab, generator=g) * 3
    x[1] *= 0.3  # flat
    x[2, :6] += 8.0
    x[3, 10] = x[3, 11] = float(x[3].max()) + 1.0  # a tie at the top
    return x


def reference_probs(x, cfg, history=HISTORY, prompt_len=(2, 1, 0, 0, 2)):
    return torch.stack([ref.sampling_chain_probabilities(x[r], cfg, history[r], prompt_len[r])
                        for r in range(x.shape[0])]).float()


NEW_SETTINGS = [
    dict(typical_p=0.9), dict(typical_p=0.2, temperature=0.7), dict(top_n_sigma=1.0), dict(top_n_sigma=0.5, top_k=40),
    dict(xtc_probability=1.0, xtc_threshold=0.05), dict(xtc_probability=0.4, xtc_threshold=0.02),
    dict(dry_multiplier=0.8), dict(dry_multiplier=1.5, dry_base=2.0, dry_allowed_length=1, dry_penalty_last_n=5),
    dict(dry_multiplier=0.8, dry_allowed_length=1, dry_sequence_breakers=(9,)),
    dict(mirostat=1, mirostat_tau=4.0), dict(mirostat=2, mirostat_tau=3.0, temperature=0.8),
    dict(dynatemp_range=0.5), dict(dynatemp_range=1.5, dynatemp_exponent=2.0, temperature=1.0),
    dict(epsilon_cutoff=3e-3), dict(eta_cutoff=3e-3), dict(no_repeat_ngram_size=2), dict(no_repeat_ngram_size=3),
    dict(bad_words=((3, 7, 9), (1, 2), (0,))), dict(allowed_token_ids=(0, 4, 9, 11)),
    dict(min_tokens=5, stop_token_ids=(10, 2)), dict(typical_p=0.9, min_p=0.05, repetition_penalty=1.3),
    dict(samplers="llama.cpp", top_k=40, top_p=0.9, min_p=0.05, temperature=0.7, dry_multiplier=0.8),
    dict(samplers="transformers", top_k=40, typical_p=0.9, epsilon_cutoff=1e-3, temperature=1.3),
    dict(samplers=["top_k", "temp", "typ_p"], top_k=20, typical_p=0.5, temperature=0.5),
    dict(temperature=0, dry_multiplier=3.0, typical_p=0.1),
    dict(top_a=0.2), dict(top_a=0.9, temperature=0.6, min_p=0.02), dict(samplers=["top_a", "temp"], top_a=0.5),
]


@pytest.mark.parametrize("settings", NEW_SETTINGS, ids=lambda s: ",".join(s))
def test_probabilities_equal_the_plain_chain(settings):
    cfg = SamplingConfig(**settings)
    x = rows()
    got = probabilities(x, cfg, prev_tokens=HISTORY, prompt_len=[2, 1, 0, 0, 2])
    want = reference_probs(x, cfg)
    assert torch.equal(got > 0, want > 0), settings
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("settings", [dict(typical_p=0.8), dict(top_n_sigma=1.0), dict(xtc_probability=0.5,
                                      xtc_threshold=0.02), dict(mirostat=2), dict(dry_multiplier=0.8)],
                         ids=lambda s: ",".join(s))
def test_draws_follow_the_processed_distribution(settings, gen):
    cfg = SamplingConfig(temperature=0.9, **settings)
    x = rows(200, seed=3)[2:3]
    want = reference_probs(x, cfg, [HISTORY[0]], [0])[0]
    n = 4000
    ids = sample(x.expand(n, -1), cfg, generator=gen, prev_tokens=[HISTORY[0]] * n)
    assert ref.draws_fit(ids, want.double(), groups=10) == ""




def _hf():
    return pytest.importorskip("transformers.generation.logits_process")


@pytest.mark.parametrize("which", ["typical", "epsilon", "eta", "ngram", "bad_words", "min_new_tokens"])
@pytest.mark.parametrize("vocab", [300, 49152])
def test_steps_equal_transformers_processors(which, vocab):
    lp = _hf()
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(3, vocab, generator=g) * 4
    history = [[3, 7, 9, 3, 7, 9, 3, 7], [1, 2, 1, 2, 1, 2, 1, 2], [5, 6, 7, 5, 6, 7, 5, 6]]
    ids = torch.tensor(history)
    cfg, proc = {
        "typical": (SamplingConfig(typical_p=0.7), lp.TypicalLogitsWarper(0.7)),
        "epsilon": (SamplingConfig(epsilon_cutoff=2e-4), lp.EpsilonLogitsWarper(2e-4)),
        "eta": (SamplingConfig(eta_cutoff=2e-4), lp.EtaLogitsWarper(2e-4)),
        "ngram": (SamplingConfig(no_repeat_ngram_size=2), lp.NoRepeatNGramLogitsProcessor(2)),
        "bad_words": (SamplingConfig(bad_words=((9, 3), (2, 1), (6,))),
                      lp.NoBadWordsLogitsProcessor([[9, 3], [2, 1], [6]], eos_token_id=0)),
        "min_new_tokens": (SamplingConfig(min_tokens=5, stop_token_ids=(0,)),
                           lp.MinNewTokensLengthLogitsProcessor(4, 5, 0)),
    }[which]
    prompt = 4 if which == "min_new_tokens" else 0
    want = torch.softmax(proc(ids, x.clone()), dim=-1)
    got = probabilities(x, cfg, prev_tokens=history, prompt_len=prompt)
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def _awkward_rows() -> dict[str, torch.Tensor]:
    """Rows the float64 passes must cut exactly as the plain rules: wide, tied (bfloat16), masked, flat, and of
    widths that leave a tail after the vector lanes."""
    g = torch.Generator().manual_seed(29)
    masked = torch.randn(1003, generator=g) * 3
    masked[torch.randint(0, 1003, (300,), generator=g)] = float("-inf")
    return {"wide": torch.randn(49_152, generator=g) * 4,
            "ties": (torch.randn(4099, generator=g) * 4).bfloat16().float(), "masked": masked,
            "flat": torch.randn(5001, generator=g) * 0.05, "peaked": torch.randn(777, generator=g) * 12}


_CUTS_AGAINST_REFERENCE = {
    "typical_p": (dict(typical_p=0.9), lambda r: ref.sampling_typical(r, 0.9)),
    "typical_p low": (dict(typical_p=0.2), lambda r: ref.sampling_typical(r, 0.2)),
    "top_n_sigma": (dict(top_n_sigma=1.0), lambda r: ref.sampling_top_n_sigma(r, 1.0)),
    "xtc": (dict(xtc_probability=1.0, xtc_threshold=0.01), lambda r: ref.sampling_xtc(r, 0.01)),
    "epsilon": (dict(epsilon_cutoff=3e-4), lambda r: ref.sampling_epsilon(r, 3e-4)),
    "top_a": (dict(top_a=0.3), lambda r: ref.sampling_top_a(r, 0.3)),
    "eta": (dict(eta_cutoff=3e-4), lambda r: ref.sampling_eta(r, 3e-4)),
    "mirostat v1": (dict(mirostat=1, mirostat_tau=4.0), lambda r: ref.sampling_mirostat(r, 1, 8.0)),
    "mirostat v2": (dict(mirostat=2, mirostat_tau=3.0), lambda r: ref.sampling_mirostat(r, 2, 6.0)),
    "dynatemp": (dict(dynatemp_range=0.5, temperature=0.9), lambda r: ref.sampling_dynatemp(r, 0.9, 0.5, 1.0)),
}


@pytest.mark.parametrize("native", [True, False], ids=["c", "torch"])
@pytest.mark.parametrize("which", list(_CUTS_AGAINST_REFERENCE))
def test_each_cut_keeps_the_plain_rules_set_on_wide_tied_masked_and_flat_rows(which, native, monkeypatch):
    # the steps decide in float64 from the row's moments (C passes, or torch's float64 without the library)
    from lmhead.kernels import native as lib
    from lmhead.sampling.steps import Context

    if native and lib.library() is None:
        pytest.skip("no C compiler")
    if not native:
        monkeypatch.setattr(lib, "library", lambda: None)
    settings, plain = _CUTS_AGAINST_REFERENCE[which]
    cfg = SamplingConfig(**settings)
    name = which.split()[0]
    for kind, row in _awkward_rows().items():
        got = STEPS[name].apply(row[None], cfg, Context(xtc=True))[0]
        want = plain(row)
        assert torch.equal(torch.isfinite(got), torch.isfinite(want)), (which, kind)
        torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0), (which, kind)


@pytest.mark.parametrize("which", ["epsilon", "eta", "mirostat v2", "xtc"])
def test_a_logit_at_the_threshold_is_cut_as_the_float64_rule_cuts_it(which):
    # the float32 log-normaliser (and entropy) decide only where their error bounds do: logits one float32 step
    # either side of the exact threshold send the cut to the float64 moments
    from lmhead.sampling.steps import Context
    from lmhead.sampling.steps.moments import ceil32, floor32

    settings, plain = _CUTS_AGAINST_REFERENCE[which]
    log_q = {"epsilon": lambda h: math.log(3e-4), "eta": lambda h: min(math.log(3e-4), 0.5 * math.log(3e-4) - h),
             "mirostat v2": lambda h: -6.0 * math.log(2.0), "xtc": lambda h: math.log(0.01)}[which]
    row = torch.randn(50_000, generator=torch.Generator().manual_seed(11)) * 3
    for _ in range(12):  # the two logits move the normaliser a little: settle them
        d = row.double()
        logp = torch.log_softmax(d, 0)
        t = float(d.max()) + log_q(float(-(logp.exp() * logp).sum())) + math.log(float(torch.exp(d - d.max()).sum()))
        row[5], row[6] = ceil32(t), floor32(t)
    got = STEPS[which.split()[0]].apply(row[None], SamplingConfig(**settings), Context(xtc=True))[0]
    want = plain(row)
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    assert bool(torch.isfinite(want[5]) != torch.isfinite(want[6])) or which == "xtc"


def test_the_c_passes_cut_alike_on_one_thread_or_several():
    from lmhead.kernels import native as lib
    from lmhead.sampling.steps import Context

    if lib.library() is None:
        pytest.skip("no C compiler")
    row = (torch.randn(1, 100_003, generator=torch.Generator().manual_seed(7)) * 3).bfloat16().float()
    before = torch.get_num_threads()
    try:
        for which, (settings, _) in _CUTS_AGAINST_REFERENCE.items():
            cfg, step = SamplingConfig(**settings), STEPS[which.split()[0]]
            torch.set_num_threads(1)
            one = step.apply(row, cfg, Context(xtc=True))
            torch.set_num_threads(4)
            several = step.apply(row, cfg, Context(xtc=True))
            assert torch.equal(torch.isfinite(one), torch.isfinite(several)), which
            torch.testing.assert_close(one, several, rtol=1e-6, atol=0)
    finally:
        torch.set_num_threads(before)


def test_dry_penalises_the_token_that_would_extend_a_repeat():
    # history "a b c a b": c would extend the repeat "a b" (length 2) → multiplier · base^0; with allowed 1, the
    # repeat of length 2 costs multiplier · base^1
    x = torch.zeros(1, 10)
    history = [[1, 2, 3, 1, 2]]
    got = process_logits(x, SamplingConfig(dry_multiplier=0.5, dry_base=2.0, dry_allowed_length=2), history)
    assert got[0, 3].item() == pytest.approx(-0.5) and int((got[0] != 0).sum()) == 1
    got = process_logits(x, SamplingConfig(dry_multiplier=0.5, dry_base=2.0, dry_allowed_length=1), history)
    assert got[0, 3].item() == pytest.approx(-1.0)
    breaker = SamplingConfig(dry_multiplier=0.5, dry_base=2.0, dry_allowed_length=2, dry_sequence_breakers=(1,))
    assert torch.equal(process_logits(x, breaker, history), x)  # the suffix may not reach back past a breaker


def test_mirostat_moves_its_state_as_llama_cpp_and_ignores_the_other_cuts(gen):
    x = rows(400, seed=5)[0:1]
    cfg = SamplingConfig(mirostat=2, mirostat_tau=3.0, mirostat_eta=0.2, seed=11)
    state = RowState()
    for step in range(4):
        cut = ref.sampling_mirostat(x[0], 2, 2 * 3.0 if state.mu is None else state.mu)
        tok, lp = sample_with_logprobs(x, cfg, step=step, state=[state])
        p = torch.softmax(cut.double(), dim=-1)[int(tok[0])]
        assert float(lp[0]) == pytest.approx(math.log(p), abs=1e-5)  # the draw's cut is the one at this μ
    # llama.cpp's rule: with mirostat on, top-k / top-p / penalties do not run
    with_cuts = SamplingConfig(mirostat=2, mirostat_tau=3.0, top_k=1, top_p=0.1, repetition_penalty=2.0)
    torch.testing.assert_close(probabilities(x, with_cuts, prev_tokens=[[1, 2]]),
                               probabilities(x, SamplingConfig(mirostat=2, mirostat_tau=3.0)))


def test_mirostat_update_is_minus_eta_times_the_surprise_error():
    x = rows(400, seed=6)[0:1]
    cfg = SamplingConfig(mirostat=1, mirostat_tau=4.0, mirostat_eta=0.1, seed=3)
    state = RowState()
    _, lp = sample_with_logprobs(x, cfg, step=0, state=[state])
    assert state.mu == pytest.approx(8.0 - 0.1 * (-float(lp[0]) / math.log(2) - 4.0), rel=1e-6)


def test_a_rows_state_is_moved_by_accept_and_can_be_reset_and_cloned_as_llama_cpp_samplers_are():
    from lmhead.sampling.steps import accept

    x = rows(400, seed=6)[0:1]
    cfg = SamplingConfig(mirostat=2, mirostat_tau=4.0, mirostat_eta=0.1, seed=3)
    state = RowState()
    tok, lp = sample_with_logprobs(x, cfg, step=0, state=[state])
    by_hand = RowState()
    accept(cfg, by_hand, int(tok[0]), float(lp[0]))  # what the draw did: the stateful steps' accept
    assert by_hand == state and state.mu is not None
    fork = state.clone()
    sample_with_logprobs(x, cfg, step=1, state=[fork])
    assert fork.mu != state.mu and state == by_hand  # the fork moves on its own
    again = RowState()
    sample_with_logprobs(x, cfg, step=1, state=[again])
    state.reset()
    assert state == RowState()
    sample_with_logprobs(x, cfg, step=1, state=[state])
    assert state == again  # a reset state is a first token's
    plain = RowState()
    accept(SamplingConfig(top_k=5), plain, 3, -1.0)  # no stateful step: nothing moves
    assert plain == RowState()


@pytest.mark.parametrize("settings", [dict(typical_p=0.5), dict(xtc_probability=0.5, xtc_threshold=0.02),
                                      dict(dry_multiplier=1.0), dict(mirostat=2)], ids=lambda s: ",".join(s))
def test_a_seeded_row_draws_the_same_token_alone_or_in_any_batch(settings):
    x = rows(300, seed=8)
    cfg = SamplingConfig(seed=5, temperature=0.9, **settings)
    others = [SamplingConfig(), SamplingConfig(top_k=5), SamplingConfig(typical_p=0.3), SamplingConfig(temperature=0)]
    for step in range(3):
        alone = [int(sample(x[r:r + 1], cfg, prev_tokens=[HISTORY[r]], step=step)[0]) for r in range(5)]
        batch = sample(x, cfg, prev_tokens=HISTORY, step=step).tolist()
        mixed = sample(torch.cat([x, x[:4]]), [cfg] * 5 + others, prev_tokens=HISTORY + HISTORY[:4],
                       step=step).tolist()[:5]
        assert alone == batch == mixed


def test_xtc_with_probability_one_removes_the_top_choices():
    x = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.06, 0.04]]))
    got = probabilities(x, SamplingConfig(xtc_probability=1.0, xtc_threshold=0.1))
    torch.testing.assert_close(got, torch.tensor([[0.0, 0.0, 0.2, 0.06, 0.04]]) / 0.3)
    half = probabilities(x, SamplingConfig(xtc_probability=0.5, xtc_threshold=0.1))
    torch.testing.assert_close(half, 0.5 * torch.softmax(x, dim=-1) + 0.5 * got)
    off = SamplingConfig(xtc_probability=1.0, xtc_threshold=0.6)  # llama.cpp: a threshold above 0.5 is off
    assert off.runs_on("batch")


def test_the_order_is_a_preset_or_names_with_llama_cpps_spellings():
    assert SamplingConfig(samplers="lmhead").samplers is None
    assert SamplingConfig(samplers="llama.cpp").samplers == PRESETS["llama.cpp"]
    assert SamplingConfig(samplers="top_k;typ_p;top-p;temp").samplers == ("top_k", "typical_p", "top_p",
                                                                          "temperature")
    assert canonical("Top-N-Sigma") == "top_n_sigma" and canonical("nucleus") == "top_p"
    with pytest.raises(ValueError, match="samplers: 'beam' is not a step"):
        SamplingConfig(samplers=["beam"])
    with pytest.raises(ValueError, match="samplers must name each step once"):
        SamplingConfig(samplers=["top_k", "top-k"])
    # temperature first or last gives other candidate sets for the same settings (llama.cpp#4091)
    x = rows()
    first = probabilities(x, SamplingConfig(temperature=2.0, min_p=0.2))
    last = probabilities(x, SamplingConfig(temperature=2.0, min_p=0.2, samplers="llama.cpp"))
    assert not torch.equal(first > 0, last > 0)
    torch.testing.assert_close(last, reference_probs(x, SamplingConfig(temperature=2.0, min_p=0.2,
                                                                       samplers="llama.cpp")))


def test_todays_settings_keep_the_batch_path_and_the_transformers_preset_gives_their_numbers():
    for cfg in [SamplingConfig(), SamplingConfig(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05,
                                                 repetition_penalty=1.2, logit_bias={3: -1.0}, seed=3)]:
        assert cfg.runs_on("batch")
    cfg = SamplingConfig(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05)
    x = rows()
    preset = probabilities(x, SamplingConfig(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05,
                                             samplers="transformers"))
    torch.testing.assert_close(preset, probabilities(x, cfg), rtol=1e-5, atol=1e-7)
    assert not SamplingConfig(typical_p=0.9).runs_on("batch") and not SamplingConfig(typical_p=0.9).runs_on("c")
    assert SamplingConfig(top_k=40, top_p=0.9).runs_on("c") and not SamplingConfig(presence_penalty=1).runs_on("c")


def _outside(p):
    """A value outside each numeric param's range, and the words its message must hold."""
    if p.kind == "float":
        return [p.low - 1.0 if p.low is not None else None, p.high * 2 + 1 if p.high else None, float("nan")]
    if p.kind == "int":
        return [p.low - 2, (p.high + 1) if p.high is not None else None, 1.5, True]
    return []


NUMERIC = [p for p in PARAMS.values() if p.kind in ("float", "int")]


@pytest.mark.parametrize("param", NUMERIC, ids=lambda p: p.name)
def test_every_numeric_setting_out_of_range_is_a_value_error_naming_it_and_its_range(param):
    for value in _outside(param):
        if value is None or value in getattr(param, "_also", ()):
            continue
        if param.name == "top_n_sigma" and value == -1.0:
            continue
        with pytest.raises(ValueError, match=rf"^{param.name} must be") as err:
            SamplingConfig(**{param.name: value})
        assert param.allowed in str(err.value)


@pytest.mark.parametrize("name, value", [("bad_words", [[]]), ("bad_words", [[1, -2]]), ("bad_words", "ab"),
                                         ("allowed_token_ids", [-1]), ("stop_token_ids", ["a"]),
                                         ("dry_sequence_breakers", [1.5]), ("samplers", 3)])
def test_every_sequence_setting_malformed_is_a_value_error_naming_it(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingConfig(**{name: value})


def test_ids_beyond_the_vocabulary_are_value_errors_naming_the_setting():
    x = torch.zeros(1, 10)
    for name, value in [("allowed_token_ids", (3, 10)), ("stop_token_ids", (12,)), ("bad_words", ((1, 11),))]:
        cfg = SamplingConfig(min_tokens=1, **{name: value})
        with pytest.raises(ValueError, match=rf"{name}: token id \d+ is outside the vocabulary"):
            probabilities(x, cfg)


def test_the_sharded_vocabulary_refuses_a_step_it_cannot_run():
    from lmhead.sampling import Vocab

    class Shard(Vocab):  # any vocabulary other than the whole one in this process
        pass

    with pytest.raises(ValueError, match="typical_p: not run over a sharded vocabulary"):
        sample(torch.zeros(1, 10), SamplingConfig(typical_p=0.5), vocab=Shard(10))


def test_every_step_declares_what_the_pipeline_derives_from_it():
    assert set(ORDER) <= set(STEPS)
    for s in STEPS.values():
        assert s.origin and "torch" in s.backends and set(s.params) <= set(PARAMS), s.name
        if "batch" not in s.backends:  # the benchmark's setting for it turns it on
            assert s in SamplingConfig(temperature=0.8, **dict(s.example)).steps(), s.name
        assert s.stage in (1, 2, 3, 4)
        if s.stage == 4 and s.name != "mirostat":
            assert s.explain, s.name  # the explainer's reason for a token the cut dropped
    fields = {f for f in SamplingConfig.__dataclass_fields__}
    assert fields == set(PARAMS)
    assert hash(SamplingConfig(bad_words=[[1, 2]])) == hash(SamplingConfig(bad_words=((1, 2),)))


@pytest.mark.parametrize("settings", [dict(mirostat=2, mirostat_tau=3.0), dict(mirostat=1),
                                      dict(dry_multiplier=2.0, dry_allowed_length=1), dict(no_repeat_ngram_size=2),
                                      dict(typical_p=0.7, xtc_probability=0.5, xtc_threshold=0.05)],
                         ids=lambda s: ",".join(s))
def test_generate_gives_the_plain_loops_tokens_with_state_and_history(settings):
    from tiny import tiny_model

    from lmhead import Model
    from lmhead.generate import generate

    hf_model, tokenizer = tiny_model("llama")
    model = Model(hf_model, tokenizer, name="tiny-llama")
    cfg = SamplingConfig(temperature=1.2, seed=17, **settings)
    want = ref.generate_plain(hf_model, tokenizer, "The cat sat on the", 12, cfg, set(model.eos_token_ids))
    got = [s.token_id for s in generate(model, "The cat sat on the", 12, config=cfg)]
    assert got == want


# --- the entry points: the same fields, the same checks, the same config ---------------------------------------


BAD = [("typical_p", 0.0), ("top_n_sigma", -0.5), ("xtc_threshold", 1.5), ("dry_base", 0.5), ("mirostat", 3),
       ("dry_penalty_last_n", -2), ("eta_cutoff", 1.0), ("samplers", ["beam"])]


@pytest.mark.parametrize("name, value", BAD)
def test_the_cli_exits_2_naming_a_bad_step_setting(capsys, name, value):
    from lmhead.cli import main

    flag = "--" + name.replace("_", "-")
    arg = ";".join(value) if isinstance(value, list) else str(value)
    code = main(["generate", "x", "--model", "/nonexistent", flag, arg])
    err = capsys.readouterr().err
    assert code == 2 and name in err and "Traceback" not in err


@pytest.mark.parametrize("name, value", BAD)
@pytest.mark.parametrize("route", ["/api/predict", "/v1/completions"])
def test_the_server_answers_4xx_naming_a_bad_step_setting(client, route, name, value):
    body = {"prompt": "The cat", name: value, **({"max_tokens": 1} if route.startswith("/v1") else {})}
    r = client.post(route, json=body)
    assert r.status_code in (400, 422) and name in r.text, r.text


def test_the_server_and_the_cli_build_the_config_the_library_builds():
    from lmhead.cli import build_parser
    from lmhead.sampling.fields import sampling_config_from
    from lmhead.server.schemas import CompletionRequest

    want = SamplingConfig(typical_p=0.5, dry_multiplier=0.8, bad_words=((1, 2), (3,)), samplers="llama.cpp",
                          mirostat=2, allowed_token_ids=(1, 2, 3))
    body = CompletionRequest(prompt="x", typical_p=0.5, dry_multiplier=0.8, bad_words=[[1, 2], [3]],
                             samplers="llama.cpp", mirostat=2, allowed_token_ids=[1, 2, 3])
    args = build_parser().parse_args(["generate", "x", "--typical-p", "0.5", "--dry-multiplier", "0.8",
                                      "--bad-words", "1,2", "--bad-words", "3", "--samplers", "llama.cpp",
                                      "--mirostat", "2", "--allowed-token-ids", "1,2,3"])
    assert sampling_config_from(body) == sampling_config_from(args) == want


def test_every_cli_flag_of_the_sampler_comes_from_a_declared_parameter_and_the_help_names_the_whole_order(
        capsys):
    from lmhead.cli import build_parser
    from lmhead.sampling.fields import SAMPLING_FIELDS
    from lmhead.sampling.steps import ENTRY_FIELDS, ORDER

    parser = build_parser()
    sub = next(a for a in parser._actions if a.choices and "generate" in a.choices).choices["generate"]
    group = next(g for g in sub._action_groups if g.title.startswith("sampling"))
    flags = {a.dest for a in group._group_actions}
    assert flags == {*SAMPLING_FIELDS, *(p.name for p in ENTRY_FIELDS)}
    for name in ORDER:  # top-a too: the title is made from the order, never written by hand
        assert name.replace("_", "-") in group.title
    args = parser.parse_args(["generate", "x", "-t", "0", "--top-k", "5", "--min-p", "0.1", "--top-a", "0.2"])
    assert sampling_config_from_args(args) == SamplingConfig(temperature=0, top_k=5, min_p=0.1, top_a=0.2)
    assert sampling_config_from_args(parser.parse_args(["generate", "x"])) == SamplingConfig()
    from lmhead.cli import main

    for flag, value in (("--top-k", "1.5"), ("--top-p", "0"), ("-t", "-1")):  # exit 2 naming the setting
        code = main(["generate", "x", "--model", "/nonexistent", flag, value])
        err = capsys.readouterr().err
        assert code == 2 and ("top" in err or "temperature" in err) and "Traceback" not in err, err


def test_the_servers_fields_of_the_original_settings_are_the_declarations_with_each_interfaces_bounds():
    from lmhead.sampling.steps import PARAMS
    from lmhead.server import schemas

    def bounds(model, name):
        meta = {type(m).__name__: m for m in model.model_fields[name].metadata}
        low = meta.get("Ge", meta.get("Gt"))
        high = meta.get("Le", meta.get("Lt"))
        return (None if low is None else getattr(low, "ge", getattr(low, "gt", None)),
                None if high is None else getattr(high, "le", getattr(high, "lt", None)))

    for model, overrides in ((schemas.SamplingFields, schemas.PAGE_OVERRIDES),
                             (schemas.CompletionRequest, schemas.OPENAI_OVERRIDES)):
        for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            p = PARAMS[name]
            want = overrides.get(name, {})
            assert bounds(model, name) == (want.get("low", p.low), want.get("high", p.high)), (model, name)
            assert model.model_fields[name].default == p.default
    assert schemas.CompletionRequest(prompt="x", top_k=-1).top_k == 0  # vLLM's "off"
    with pytest.raises(ValueError):
        schemas.CompletionRequest(prompt="x", presence_penalty=2.5)  # OpenAI's bound, inside the declared one
    with pytest.raises(ValueError):
        schemas.PredictRequest(prompt="x", temperature=2.5)  # the page's slider


def sampling_config_from_args(args):
    from lmhead.sampling.fields import sampling_config_from

    return sampling_config_from(args)


def test_the_server_serves_the_new_steps(client):
    r = client.post("/api/predict", json={"prompt": "The cat", "typical_p": 0.5, "samplers": "llama.cpp"})
    assert r.status_code == 200, r.text
    assert [s["name"] for s in r.json()["steps"]] == [s.name for s in SamplingConfig(typical_p=0.5,
                                                                                      samplers="llama.cpp").steps()]
    r = client.post("/v1/completions", json={"prompt": "The cat", "max_tokens": 4, "mirostat": 2, "seed": 3,
                                              "dry_multiplier": 0.8})
    assert r.status_code == 200, r.text


# --- speculative decoding: the plain loop's tokens, with the new steps ---------------------------------------


@functools.cache
def _lean_parts():
    """(lean body, head, int8 draft) of a tiny llama, built once."""
    from tiny import tiny_head, tiny_model

    from lmhead.models.lean import LeanBody
    from lmhead.speculative import Draft

    hf_model, tokenizer = tiny_model("llama", layers=2, init=0.3)
    return LeanBody(hf_model), tiny_head(hf_model), Draft(hf_model, tokenizer)


def _decode(prompts, n, configs, draft, profile=None, stateful=False):
    """Drive decode.engine.Decoder over a tiny lean body as generate does: n tokens per row (states: one RowState
    per row when `stateful`)."""
    from lmhead.decode.engine import Decoder
    from lmhead.speculative import NgramDraft

    lean, head, int8 = _lean_parts()
    dec = Decoder(lean, head, NgramDraft() if draft == "ngram" else (int8 if draft else None), k=3, profile=profile)
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    last = dec.start(ids, positions, mask.bool(), 4 * n + 16)
    out = [[] for _ in prompts]
    states = [RowState() for _ in prompts] if stateful else None
    while min(len(o) for o in out) < n:
        history = [p + o for p, o in zip(prompts, out, strict=True)]
        rnd = dec.round(last, configs, history, [len(p) for p in prompts], [len(o) for o in out], None,
                        states=states)
        for o, toks in zip(out, rnd.tokens, strict=True):
            o.extend(toks)
        last = torch.tensor([o[-1] for o in out])
    return [o[:n] for o in out], dec


PROMPTS = [[5, 9, 11, 5, 9, 11, 5, 9, 11, 5], [7, 8, 7, 8, 7]]


@pytest.mark.parametrize("settings", [dict(temperature=0, dry_multiplier=2.0, dry_allowed_length=1),
                                      dict(temperature=0, no_repeat_ngram_size=2, bad_words=((9, 11),)),
                                      dict(temperature=0.9, typical_p=0.8, seed=4),
                                      dict(temperature=1.1, xtc_probability=0.5, xtc_threshold=0.01, seed=2),
                                      dict(temperature=1.0, dry_multiplier=1.0, top_n_sigma=1.5, seed=9)],
                         ids=lambda s: ",".join(s))
@pytest.mark.parametrize("draft", [True, "ngram"])
def test_speculative_rounds_give_the_plain_loops_tokens_with_the_new_steps(settings, draft):
    cfg = [SamplingConfig(**settings)] * 2
    plain, _ = _decode(PROMPTS, 10, cfg, draft=False)
    spec, dec = _decode(PROMPTS, 10, cfg, draft=draft)
    assert spec == plain and dec.stats.drafted > 0


def test_a_mirostat_row_takes_plain_steps_and_its_state_moves_once_a_token():
    cfg = [SamplingConfig(mirostat=2, mirostat_tau=3.0, seed=1), SamplingConfig(temperature=0)]
    plain, _ = _decode(PROMPTS, 8, cfg, draft=False, stateful=True)
    spec, dec = _decode(PROMPTS, 8, cfg, draft=True, stateful=True)
    assert spec == plain and dec.stats.drafted == 0


def test_a_step_without_a_c_path_is_booked_in_the_profile():
    profile: dict[str, float] = {}
    _decode(PROMPTS, 3, [SamplingConfig(typical_p=0.8)] * 2, draft=False, profile=profile)
    assert "sampling, torch path (typical_p)" in profile
    plain: dict[str, float] = {}
    _decode(PROMPTS, 3, [SamplingConfig(top_k=20)] * 2, draft=False, profile=plain)
    assert not any("torch path" in k for k in plain)
