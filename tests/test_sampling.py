"""The logits pipeline (lmhead.sampling): worked examples, the reference implementation, validation, draws."""

from __future__ import annotations

import json
import math

import pytest
import reference as ref
import torch

import lmhead
from lmhead.sampling import (
    LogProbs,
    SamplingConfig,
    apply_logit_bias,
    apply_min_p,
    apply_penalties,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    chosen_logprobs,
    entropy,
    logprobs,
    probabilities,
    process_logits,
    sample,
    sample_with_logprobs,
)

INF = float("inf")


pytestmark = pytest.mark.usefixtures("one_thread")


def peaked(batch: int, vocab: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    """Logits shaped like a language model's: a few likely tokens over a long tail."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, vocab, generator=g) * scale
    return x


def assert_same_cut(ours: torch.Tensor, expected: torch.Tensor) -> None:
    """Same kept set (finite entries) and the same values there."""
    assert torch.equal(torch.isfinite(ours), torch.isfinite(expected))
    keep = torch.isfinite(expected)
    torch.testing.assert_close(ours[keep], expected[keep].float(), **ref.tolerance(torch.float32))


# --- the worked examples of the series --------------------------------------------------------------------


@pytest.mark.parametrize(("temperature", "expected"), [
    (0.5, [0.982, 0.018, 0.0003]), (1.0, [0.867, 0.117, 0.016]), (2.0, [0.665, 0.245, 0.090])])
def test_worked_example_three_tokens_matches_printed_rounding(temperature, expected):
    probs = probabilities(torch.tensor([4.0, 2.0, 0.0]), SamplingConfig(temperature=temperature))
    digits = [3, 3, 4] if temperature == 0.5 else [3, 3, 3]
    assert [round(float(p), d) for p, d in zip(probs, digits, strict=True)] == expected


@pytest.mark.parametrize(("temperature", "expected"), [(0.5, 0.881), (1.0, 0.731), (2.0, 0.622)])
def test_worked_example_two_tokens_matches_printed_rounding(temperature, expected):
    probs = probabilities(torch.tensor([[2.0, 1.0]]), SamplingConfig(temperature=temperature))
    assert round(float(probs[0, 0]), 3) == expected


# --- config validation ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"temperature": INF}, "temperature"), ({"temperature": "1"}, "temperature"),
    ({"top_k": -1}, "top_k"), ({"top_k": 2.0}, "top_k"), ({"top_k": True}, "top_k"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_p": float("nan")}, "top_p"),
    ({"min_p": -0.1}, "min_p"), ({"min_p": 1.1}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"repetition_penalty": INF}, "repetition_penalty"),
    ({"presence_penalty": INF}, "presence_penalty"), ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"logit_bias": {1: INF}}, "logit_bias"), ({"logit_bias": {1: float("nan")}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"), ({"logit_bias": {"a": 1.0}}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"banned_tokens": (-2,)}, "banned_tokens"), ({"banned_tokens": "ab"}, "banned_tokens"),
    ({"seed": 1.5}, "seed"), ({"seed": True}, "seed"),
])
def test_config_rejects_bad_values_naming_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingConfig(**kwargs)


def test_config_is_frozen_hashable_and_normalised():
    cfg = SamplingConfig(temperature=1, logit_bias={3: -INF, 1: 2}, banned_tokens=[5])
    assert cfg.temperature == 1.0 and isinstance(cfg.temperature, float)
    assert dict(cfg.logit_bias) == {3: -INF, 1: 2.0} and cfg.banned_tokens == (5,)
    assert hash(cfg) == hash(SamplingConfig(temperature=1.0, logit_bias={1: 2.0, 3: -INF}, banned_tokens=(5,)))
    with pytest.raises(AttributeError):
        cfg.temperature = 2.0  # type: ignore[misc]


def test_temperature_below_1e_5_is_greedy_like_vllm():
    assert SamplingConfig(temperature=0).is_greedy and SamplingConfig(temperature=9e-6).is_greedy
    assert not SamplingConfig(temperature=1e-5).is_greedy


def test_public_names_are_exported():
    for name in ["SamplingConfig", "process_logits", "probabilities", "sample", "logprobs", "entropy", "LogProbs",
                 "apply_logit_bias", "apply_penalties", "apply_temperature", "apply_top_k", "apply_top_p",
                 "apply_min_p"]:
        assert getattr(lmhead, name) is not None


# --- input validation -------------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [process_logits, probabilities, sample])
def test_bad_logits_raise_naming_logits(fn):
    cfg = SamplingConfig(top_k=2)
    with pytest.raises(TypeError, match="logits"):
        fn([[1.0, 2.0]], cfg)
    with pytest.raises(TypeError, match="logits"):
        fn(torch.tensor([[1, 2]]), cfg)
    with pytest.raises(ValueError, match="logits"):
        fn(torch.zeros(2, 3, 4), cfg)
    with pytest.raises(ValueError, match="logits"):
        fn(torch.zeros(2, 0), cfg)
    for bad, what in [(float("nan"), "NaN"), (INF, "inf")]:
        x = torch.zeros(3, 5)
        x[1, 2] = bad
        for c in [cfg, SamplingConfig(), SamplingConfig(temperature=0), SamplingConfig(top_p=0.5),
                  SamplingConfig(min_p=0.1)]:
            with pytest.raises(ValueError, match=f"logits.*{what}"):
                fn(x, c)
    x = torch.zeros(3, 5)
    x[2] = -INF
    with pytest.raises(ValueError, match="all -inf"):
        fn(x, cfg)


def test_banning_every_token_is_an_error():
    with pytest.raises(ValueError, match="all -inf"):
        sample(torch.zeros(1, 3), SamplingConfig(banned_tokens=(0, 1, 2)))


def test_token_ids_outside_the_vocabulary_raise_naming_the_argument():
    x = torch.zeros(2, 10)
    with pytest.raises(ValueError, match="logit_bias"):
        process_logits(x, SamplingConfig(logit_bias={10: 1.0}))
    with pytest.raises(ValueError, match="banned_tokens"):
        process_logits(x, SamplingConfig(banned_tokens=(12,)))
    with pytest.raises(ValueError, match="prev_tokens"):
        process_logits(x, SamplingConfig(repetition_penalty=1.2), prev_tokens=[[1, 10], [2]])
    with pytest.raises(ValueError, match="prev_tokens"):
        process_logits(x, SamplingConfig(), prev_tokens=torch.tensor([[1, -2], [0, 0]]))
    with pytest.raises(ValueError, match="token_ids"):
        logprobs(x, torch.tensor([0, 10]))
    with pytest.raises(ValueError, match="token_ids"):
        logprobs(x, torch.tensor([0]))


def test_config_list_must_have_one_config_per_row():
    with pytest.raises(ValueError, match="config"):
        sample(torch.zeros(3, 4), [SamplingConfig()] * 2)
    with pytest.raises(TypeError, match="config"):
        sample(torch.zeros(1, 4), [{"temperature": 1.0}])


def test_bad_prompt_len_step_and_generator_raise():
    x = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="prompt_len"):
        process_logits(x, SamplingConfig(presence_penalty=1.0), prev_tokens=[[1], [2]], prompt_len=-1)
    with pytest.raises(ValueError, match="prompt_len"):
        process_logits(x, SamplingConfig(presence_penalty=1.0), prev_tokens=[[1], [2]], prompt_len=[0])
    with pytest.raises(ValueError, match="step"):
        sample(x, SamplingConfig(seed=1), step=-1)
    with pytest.raises(TypeError, match="generator"):
        sample(x, SamplingConfig(), generator=1234)


def test_step_functions_validate_their_setting():
    x = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="temperature"):
        apply_temperature(x, 0.0)
    with pytest.raises(ValueError, match="top_k"):
        apply_top_k(x, -1)
    with pytest.raises(ValueError, match="top_p"):
        apply_top_p(x, 0.0)
    with pytest.raises(ValueError, match="min_p"):
        apply_min_p(x, 2.0)
    with pytest.raises(ValueError, match="repetition_penalty"):
        apply_penalties(x, [[1], [2]], repetition_penalty=-1.0)


# --- the pipeline against the reference -------------------------------------------------------------------

CONFIGS = [
    SamplingConfig(),
    SamplingConfig(temperature=0.8, top_k=50, top_p=0.9),
    SamplingConfig(temperature=0.7, top_k=7),
    SamplingConfig(temperature=1.3, top_p=0.8),
    SamplingConfig(temperature=0.9, top_p=0.95, min_p=0.05),
    SamplingConfig(temperature=1.1, min_p=0.1),
    SamplingConfig(top_k=40, min_p=0.2),
    SamplingConfig(temperature=0.6, top_k=3000, top_p=0.5),
    SamplingConfig(temperature=0.0, top_k=5),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
@pytest.mark.parametrize(("batch", "vocab", "scale"), [(3, 1000, 3.0), (5, 4999, 1.0), (1, 37, 2.0)])
def test_process_logits_matches_reference(cfg, batch, vocab, scale):
    x = peaked(batch, vocab, seed=vocab, scale=scale)
    assert_same_cut(process_logits(x, cfg), ref.sampling_process(x, [cfg] * batch))


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_probabilities_are_softmax_of_processed_logits(cfg):
    x = peaked(4, 777, seed=1)
    probs = probabilities(x, cfg)
    expected = torch.softmax(ref.sampling_process(x, [cfg] * 4).double(), dim=-1).float()
    torch.testing.assert_close(probs, expected, **ref.tolerance(torch.float32))
    torch.testing.assert_close(probs.sum(-1), torch.ones(4))


def test_step_functions_compose_to_the_pipeline():
    x = peaked(4, 3001, seed=2)
    cfg = SamplingConfig(temperature=0.7, top_k=100, top_p=0.8, min_p=0.05)
    chained = apply_min_p(apply_top_p(apply_top_k(apply_temperature(x, 0.7), 100), 0.8), 0.05)
    assert_same_cut(process_logits(x, cfg), chained)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_low_and_high_precision_logits_are_processed_in_float32(dtype):
    x = peaked(3, 500, seed=3).to(dtype)
    cfg = SamplingConfig(temperature=0.8, top_k=20, top_p=0.9)
    out = probabilities(x, cfg)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.softmax(ref.sampling_process(x.float(), [cfg] * 3), -1),
                               **ref.tolerance(torch.float32))


def test_input_logits_are_never_modified():
    x = peaked(2, 100)
    before = x.clone()
    cfg = SamplingConfig(logit_bias={3: 5.0}, banned_tokens=(4,), repetition_penalty=1.3, presence_penalty=0.5)
    process_logits(x, cfg, prev_tokens=[[1, 2], [3]])
    probabilities(x, SamplingConfig(top_p=0.5))
    sample(x, SamplingConfig(top_k=3))
    assert torch.equal(x, before)


def test_one_dimensional_logits_are_a_batch_of_one():
    x = peaked(1, 64)
    cfg = SamplingConfig(top_k=5, seed=7)
    assert process_logits(x[0], cfg).shape == (64,)
    torch.testing.assert_close(probabilities(x[0], cfg), probabilities(x, cfg)[0])
    ids = sample(x[0], cfg)
    assert ids.shape == () and int(ids) == int(sample(x, cfg)[0])
    assert logprobs(x[0], int(ids), cfg).token_ids.shape == (1,)
    pen = SamplingConfig(repetition_penalty=1.5)
    torch.testing.assert_close(process_logits(x[0], pen, prev_tokens=[1, 2, 2]),
                               process_logits(x, pen, prev_tokens=[[1, 2, 2]])[0])
    torch.testing.assert_close(logprobs(x[0], 1, pen, prev_tokens=[1, 2]).logprob,
                               logprobs(x, [1], pen, prev_tokens=[[1, 2]]).logprob)


def test_empty_batch_gives_empty_results():
    assert sample(torch.zeros(0, 8), SamplingConfig(top_k=2)).shape == (0,)
    assert probabilities(torch.zeros(0, 8), SamplingConfig(top_p=0.5)).shape == (0, 8)


# --- ties -------------------------------------------------------------------------------------------------


def test_top_k_keeps_every_token_tied_with_the_kth_like_hf():
    x = torch.tensor([[5.0, 3.0, 3.0, 3.0, 1.0, 0.0], [5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    out = process_logits(x, SamplingConfig(top_k=2))
    assert torch.isfinite(out).sum(-1).tolist() == [4, 2]
    assert_same_cut(out, ref.sampling_process(x, [SamplingConfig(top_k=2)] * 2))


def test_top_k_ties_created_by_the_temperature_division_count_as_ties():
    a = 1.0
    b = math.nextafter(a, 0.0)  # distinct, but a / 3 == b / 3 in float32 may round together
    x = torch.tensor([[2.0, a, b, -1.0]])
    cfg = SamplingConfig(temperature=3.0, top_k=2)
    assert_same_cut(process_logits(x, cfg), ref.sampling_process(x, [cfg]))


def test_top_p_keeps_a_tie_straddling_the_cut_whole():
    # probs 0.4, 0.2, 0.2, 0.2: top_p 0.5 crosses inside the tie → all three tied tokens kept
    x = torch.log(torch.tensor([[0.4, 0.2, 0.2, 0.2]]))
    out = process_logits(x, SamplingConfig(top_p=0.5))
    assert torch.isfinite(out).all()
    out = process_logits(x, SamplingConfig(top_p=0.35))
    assert torch.isfinite(out).tolist() == [[True, False, False, False]]


def test_top_p_keeps_the_crossing_token():
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isfinite(process_logits(x, SamplingConfig(top_p=0.6))).tolist() == [[True, True, False, False]]
    assert torch.isfinite(process_logits(x, SamplingConfig(top_p=0.81))).sum() == 3


# --- top-p without top-k: the growing window ---------------------------------------------------------------


def window_rows(vocab: int, kept: list[int], seed: int = 0) -> torch.Tensor:
    """Rows whose top-p set has about `kept` tokens: that many high logits over a low tail."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(len(kept), vocab, generator=g)
    for r, n in enumerate(kept):
        top = torch.randperm(vocab, generator=g)[:n]
        rows[r, top] += 12.0
    return rows


@pytest.mark.parametrize("kept", [[3, 100], [600, 5], [3000, 2, 40], [20000, 1]])
def test_top_p_window_widens_and_falls_back_exactly(kept):
    x = window_rows(30000, kept)
    cfg = SamplingConfig(temperature=0.9, top_p=0.9)
    assert_same_cut(process_logits(x, cfg), ref.sampling_process(x, [cfg] * len(kept)))
    assert_same_cut(apply_top_p(x, 0.9), torch.stack([ref.sampling_top_p(r, 0.9) for r in x]))


def test_top_p_on_flat_logits_is_exact():
    x = torch.zeros(2, 5000)
    x[1, :10] = 0.5
    cfg = SamplingConfig(top_p=0.3)
    assert_same_cut(process_logits(x, cfg), ref.sampling_process(x, [cfg] * 2))


# --- mixed batches ----------------------------------------------------------------------------------------


def test_mixed_batch_equals_each_row_on_its_own():
    x = peaked(6, 2000, seed=5)
    configs = [SamplingConfig(temperature=0), SamplingConfig(top_k=10, top_p=0.8), SamplingConfig(top_p=0.7),
               SamplingConfig(top_k=10, top_p=0.8), SamplingConfig(min_p=0.3, logit_bias={1: 30.0}),
               SamplingConfig(temperature=0, banned_tokens=tuple(range(1000)))]
    out = process_logits(x, configs)
    for r, cfg in enumerate(configs):
        assert_same_cut(out[r], process_logits(x[r : r + 1], cfg)[0])
    assert_same_cut(out, ref.sampling_process(x, configs))
    ids = sample(x, configs, generator=torch.Generator().manual_seed(0))
    assert int(ids[0]) == int(x[0].argmax())
    assert int(ids[5]) == int(x[5, 1000:].argmax()) + 1000
    assert int(ids[4]) == 1
    assert torch.isfinite(out.gather(1, ids[:, None])).all()


# --- greedy -----------------------------------------------------------------------------------------------


def test_greedy_is_argmax_after_bias_and_penalties():
    x = torch.tensor([[1.0, 3.0, 2.0, 0.5], [4.0, 3.0, 2.0, 1.0]])
    cfg = SamplingConfig(temperature=0, logit_bias={2: 1.5}, repetition_penalty=2.0)
    ids = sample(x, cfg, prev_tokens=[[1], []])
    assert ids.tolist() == [2, 0]  # row 0: 3/2 = 1.5 < 2 + 1.5
    probs = probabilities(x, cfg, prev_tokens=[[1], []])
    assert probs.tolist() == [[0.0, 0.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]]


def test_greedy_picks_the_first_of_tied_maxima():
    assert sample(torch.tensor([[1.0, 3.0, 3.0]]), SamplingConfig(temperature=0)).tolist() == [1]


# --- bias and penalties -----------------------------------------------------------------------------------


def test_logit_bias_adds_and_minus_inf_bans():
    x = torch.zeros(2, 5)
    out = apply_logit_bias(x, {1: 2.0, 3: -INF}, banned_tokens=[4])
    assert out[0].tolist() == [0.0, 2.0, 0.0, -INF, -INF] and torch.equal(out[0], out[1])
    ids = sample(torch.zeros(64, 5), SamplingConfig(logit_bias={3: -INF}, banned_tokens=(0, 1)))
    assert set(ids.tolist()) <= {2, 4}


def test_penalties_match_reference_with_padding_and_per_row_prompt_len():
    x = peaked(3, 50, seed=9)
    prev = [[1, 2, 2, 7, 7, 7, 9], [3, 3], [4, 5, 4, 6]]
    plen = [2, 0, 3]
    kwargs = {"repetition_penalty": 1.3, "presence_penalty": 0.4, "frequency_penalty": 0.25}
    ours = apply_penalties(x, prev, prompt_len=plen, **kwargs)
    expected = torch.stack([ref.sampling_penalties(x[b], prev[b], plen[b], 1.3, 0.4, 0.25) for b in range(3)])
    torch.testing.assert_close(ours, expected, **ref.tolerance(torch.float32))
    padded = torch.full((3, 9), -1, dtype=torch.long)
    for b, row in enumerate(prev):
        padded[b, 2 : 2 + len(row)] = torch.tensor(row)  # left and right padding: only real tokens count
    torch.testing.assert_close(apply_penalties(x, padded, prompt_len=plen, **kwargs), expected)
    cfg = SamplingConfig(**kwargs)
    torch.testing.assert_close(process_logits(x, cfg, prev_tokens=prev, prompt_len=plen), expected)


def test_presence_and_frequency_count_generated_tokens_only():
    x = torch.zeros(1, 6)
    out = apply_penalties(x, [[1, 1, 2, 2, 2, 3]], presence_penalty=1.0, frequency_penalty=0.5, prompt_len=3)
    # prompt = [1, 1, 2]; generated = [2, 2, 3]
    assert out[0].tolist() == [0.0, 0.0, -2.0, -1.5, 0.0, 0.0]


def test_repetition_penalty_counts_the_prompt_once_per_token():
    x = torch.tensor([[2.0, -2.0, 2.0, 0.0]])
    out = apply_penalties(x, [[0, 0, 0, 1, 3]], repetition_penalty=2.0, prompt_len=5)
    assert out[0].tolist() == [1.0, -4.0, 2.0, 0.0]


def test_per_row_penalties_in_a_mixed_batch():
    x = torch.ones(2, 4)
    configs = [SamplingConfig(repetition_penalty=2.0), SamplingConfig(frequency_penalty=1.0)]
    out = process_logits(x, configs, prev_tokens=[[0], [0, 0]])
    assert out.tolist() == [[0.5, 1.0, 1.0, 1.0], [-1.0, 1.0, 1.0, 1.0]]


# --- draws ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [SamplingConfig(), SamplingConfig(top_k=3), SamplingConfig(top_p=0.9),
                                 SamplingConfig(min_p=0.1, temperature=1.5)], ids=str)
def test_draw_frequencies_follow_probabilities(cfg, gen):
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    n = 20_000
    ids = sample(row.expand(n, 5).contiguous(), cfg, generator=gen)
    freq = torch.bincount(ids, minlength=5).double() / n
    probs = probabilities(row, cfg).double()
    sigma = (probs * (1 - probs) / n).sqrt()
    assert bool(((freq - probs).abs() <= 5 * sigma + 1e-12).all()), (freq, probs)


def test_draw_never_picks_a_cut_token(gen):
    x = peaked(16, 3000, seed=11)
    for cfg in CONFIGS:
        ids = sample(x, cfg, generator=gen)
        assert torch.isfinite(process_logits(x, cfg).gather(1, ids[:, None])).all()


def test_same_generator_state_gives_same_ids():
    x = peaked(8, 500)
    cfg = SamplingConfig(top_k=50, top_p=0.95)
    a = sample(x, cfg, generator=torch.Generator().manual_seed(3))
    b = sample(x, cfg, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)


@pytest.mark.parametrize("cfg", [SamplingConfig(seed=42, top_k=50, top_p=0.9, temperature=0.8),
                                 SamplingConfig(seed=42, top_p=0.99), SamplingConfig(seed=42)], ids=str)
def test_seeded_row_gives_the_same_id_alone_or_at_position_5_of_8(cfg):
    x = peaked(8, 3000, seed=12, scale=1.0)
    row = x[5:6].clone()
    others = [SamplingConfig(top_k=3)] * 5 + [cfg] + [SamplingConfig(temperature=0), SamplingConfig(seed=1)]
    for step in range(8):
        alone = sample(row, cfg, step=step)
        in_batch = sample(x, others, step=step, generator=torch.Generator().manual_seed(step))
        assert int(alone[0]) == int(in_batch[5])
        homogeneous = sample(x, cfg, step=step)
        assert int(alone[0]) == int(homogeneous[5])


def test_seeded_draws_vary_with_step_and_seed_and_follow_probabilities():
    row = torch.tensor([[1.0, 0.5, 0.0, -0.5]])
    n = 1500  # one batch: a seeded config with one step per row gives n independent draws
    draws = sample(row.expand(n, 4), SamplingConfig(seed=7), step=list(range(n))).tolist()
    assert draws[:50] == [int(sample(row, SamplingConfig(seed=7), step=s)) for s in range(50)]
    probs = probabilities(row, SamplingConfig())[0].double()
    freq = torch.bincount(torch.tensor(draws), minlength=4).double() / len(draws)
    assert bool(((freq - probs).abs() <= 5 * (probs * (1 - probs) / len(draws)).sqrt()).all())
    other = sample(row.expand(200, 4), SamplingConfig(seed=8), step=list(range(200))).tolist()
    assert other != draws[:200]


def test_seeded_sampling_ignores_the_generator_argument():
    x = peaked(2, 100)
    cfg = SamplingConfig(seed=5, top_k=20)
    a = sample(x, cfg, generator=torch.Generator().manual_seed(1), step=3)
    b = sample(x, cfg, generator=torch.Generator().manual_seed(2), step=3)
    assert torch.equal(a, b)


# --- logprobs and entropy ---------------------------------------------------------------------------------


def test_logprobs_raw_processed_rank_and_alternatives():
    x = torch.tensor([[3.0, 1.0, 2.0, 2.0, -INF], [0.0, 0.0, 0.0, 5.0, 1.0]])
    cfg = SamplingConfig(top_k=2, temperature=0.5)
    lp = logprobs(x, [2, 4], cfg, top_n=3)
    assert isinstance(lp, LogProbs)
    raw = torch.log_softmax(x, -1)
    processed = torch.log(probabilities(x, cfg))
    torch.testing.assert_close(lp.raw_logprob, raw[[0, 1], [2, 4]])
    torch.testing.assert_close(lp.logprob, processed[[0, 1], [2, 4]])
    assert lp.rank.tolist() == [2, 2]  # row 0: 2.0 is tied with another 2.0 → both rank 2
    assert lp.raw_top_ids[1].tolist()[:2] == [3, 4]
    torch.testing.assert_close(lp.raw_top_logprobs, raw.gather(1, lp.raw_top_ids))
    assert lp.top_ids[0, 0] == 0 and set(lp.top_ids[0, 1:].tolist()) == {2, 3}  # row 0 keeps 3 tied tokens
    assert lp.top_ids[1, :2].tolist() == [3, 4] and int(lp.top_ids[1, 2]) in {0, 1, 2}  # kept, then by raw
    assert lp.top_logprobs[1, 2] == -INF and torch.isfinite(lp.top_raw_logprobs).all()
    torch.testing.assert_close(lp.top_raw_logprobs, raw.gather(1, lp.top_ids))


def test_logprobs_to_list_is_json_ready():
    x = peaked(2, 30)
    lp = logprobs(x, sample(x, SamplingConfig(top_k=2)), SamplingConfig(top_k=2), top_n=4)
    rows = lp.to_list()
    text = json.dumps(rows, allow_nan=False)
    assert len(rows) == 2 and "raw_top" in text and len(rows[0]["top"]) == 4
    assert rows[0]["top"][3]["logprob"] is None


def test_greedy_logprob_is_zero_for_the_argmax():
    x = peaked(3, 40)
    lp = logprobs(x, x.argmax(-1), SamplingConfig(temperature=0))
    assert lp.logprob.tolist() == [0.0, 0.0, 0.0] and lp.rank.tolist() == [1, 1, 1]


def test_entropy_matches_reference_and_edge_cases():
    x = peaked(3, 100, seed=4)
    x[0, :50] = -INF
    ent = entropy(x)
    expected = torch.tensor([ref.sampling_entropy(r) for r in x], dtype=torch.float32)
    torch.testing.assert_close(ent, expected, **ref.tolerance(torch.float32))
    torch.testing.assert_close(entropy(torch.zeros(2, 3, 8)), torch.full((2, 3), math.log(8)))
    assert float(entropy(torch.tensor([0.0, -INF, -INF]))) == 0.0
    with pytest.raises(ValueError, match="logits"):
        entropy(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="all -inf"):
        entropy(torch.tensor([-INF, -INF]))
    with pytest.raises(TypeError, match="logits"):
        entropy(torch.tensor([1, 2]))


def test_whole_row_draw_follows_probabilities_across_blocks(gen):
    # no cut-off: the draw picks a block of 1024 tokens by mass, then a token inside it (tail block included)
    vocab, n = 2500, 8000
    row = torch.full((vocab,), -30.0)
    hot = torch.tensor([3, 1023, 1024, 2047, 2048, 2499])
    row[hot] = torch.tensor([1.0, 0.5, 0.0, 1.5, -0.5, 0.8])
    row[7] = -INF
    cfg = SamplingConfig(temperature=1.0)
    ids = sample(row.expand(n, vocab).contiguous(), cfg, generator=gen)
    assert not bool((ids == 7).any())
    probs = probabilities(row, cfg).double()[hot]
    freq = torch.bincount(ids, minlength=vocab).double()[hot] / n
    assert bool(((freq - probs).abs() <= 5 * (probs * (1 - probs) / n).sqrt()).all()), (freq, probs)


def test_each_top_p_path_is_exercised_and_exact(monkeypatch):
    import lmhead.sampling.top_p as sampling  # the module that holds the top-p paths and their constants

    calls = {"bins": 0, "windows": []}
    real_bins, real_topk = sampling._top_p_bins, torch.topk

    def bins(*args):
        calls["bins"] += 1
        return real_bins(*args)

    def topk(x, k, *args, **kwargs):
        calls["windows"].append(k)
        return real_topk(x, k, *args, **kwargs)

    x = window_rows(30000, [3, 600, 5000])
    x[2, :5] = -INF  # -inf tokens and a wide range in the histogram path
    x[2, 5:9] = -200.0
    cfg = SamplingConfig(temperature=0.9, top_p=0.9)
    # the C pass settles these CPU rows first (top-p sets of 3, 359 and 2,817 tokens)
    assert_same_cut(process_logits(x, cfg), ref.sampling_process(x, [cfg] * 3))
    monkeypatch.setattr(sampling, "NATIVE_TOP_P_ROWS", 0)  # the torch paths, each of them
    monkeypatch.setattr(sampling, "_top_p_bins", bins)
    monkeypatch.setattr(sampling.torch, "topk", topk)
    out = process_logits(x, cfg)
    monkeypatch.undo()
    assert calls["windows"][:2] == [256, 1024] and calls["bins"] == 1
    assert_same_cut(out, ref.sampling_process(x, [cfg] * 3))


def test_histogram_top_p_with_ties_in_the_crossing_bin():
    x = torch.randn(3, 4000, generator=torch.Generator().manual_seed(8)).round(decimals=1)  # many ties
    for p in [0.3, 0.6, 0.9, 0.999]:
        cfg = SamplingConfig(top_p=p)
        assert_same_cut(process_logits(x, cfg), ref.sampling_process(x, [cfg] * 3))


# --- the public seams: config coercion, the seeded draw, the vocabulary axis ----------------------------------


def test_as_configs_gives_one_config_per_row():
    from lmhead.sampling import as_configs

    cfg = SamplingConfig(top_k=3)
    assert as_configs(None, 2) == [SamplingConfig()] * 2
    assert as_configs(cfg, 3) == [cfg] * 3
    assert as_configs({"top_k": 3}, 2) == [cfg] * 2
    assert as_configs((cfg, SamplingConfig()), 2) == [cfg, SamplingConfig()]
    with pytest.raises(ValueError, match="config"):
        as_configs([cfg], 2)
    with pytest.raises(TypeError, match="config"):
        as_configs([{"top_k": 3}], 1)
    with pytest.raises(TypeError, match="config"):
        as_configs("greedy", 1)
    with pytest.raises(ValueError, match="top_k"):
        as_configs({"top_k": -1}, 1)


def test_a_seeded_row_is_the_race_over_its_kept_tokens_in_id_order():
    from lmhead.sampling import race_draw, seeded_generator

    x = peaked(1, 500, seed=2)
    cfg = SamplingConfig(temperature=0.7, top_k=20, seed=42)
    for step in range(5):
        kept = torch.topk(x[0], 20).indices.sort().values  # id order
        pick = race_draw(torch.softmax(x[0, kept] / 0.7, dim=-1)[None], seeded_generator(42, step))
        assert int(sample(x, cfg, step=step)[0]) == int(kept[pick[0]])
    a, b = seeded_generator(1, 2), seeded_generator(1, 2)
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))
    assert not torch.equal(torch.rand(4, generator=seeded_generator(1, 3)), torch.rand(4, generator=b))


def test_the_seeded_race_in_c_and_in_torch_draw_the_same_ids(monkeypatch):
    # float32 CPU rows race in C (double keys), other rows in torch (float32 p / E): the same noise, the same
    # candidates in id order, so the same ids wherever no two keys lie within float32's rounding of each other
    from lmhead.sampling import race

    x = peaked(6, 3000, seed=5)
    cfgs = [SamplingConfig(temperature=0.7, top_k=50, seed=3), SamplingConfig(temperature=1.0, top_p=0.9, seed=4),
            SamplingConfig(temperature=0.9, min_p=0.05, seed=5)]
    for cfg in cfgs:
        in_c = [sample_with_logprobs(x, cfg, step=s) for s in range(6)]
        with monkeypatch.context() as m:
            m.setattr(race, "race_in_c", lambda *a: None)
            in_torch = [sample_with_logprobs(x, cfg, step=s) for s in range(6)]
        for (a, la), (b, lb) in zip(in_c, in_torch, strict=True):
            assert torch.equal(a, b) and torch.equal(la, lb), cfg


def test_the_pipeline_reduces_across_the_vocabulary_with_the_vocab_it_is_given(monkeypatch):
    import lmhead.sampling.top_p as sampling  # the module that holds the top-p paths and their constants
    from lmhead.sampling import Vocab

    calls: list[str] = []

    class Recording(Vocab):
        def __getattribute__(self, name):
            if name in ("amax", "amin", "argmax", "topk", "sum", "cat", "softmax", "columns"):
                calls.append(name)
            return super().__getattribute__(name)

    x = window_rows(30000, [3, 600, 5000])  # top-p: window 256, window 1024, histogram select
    cfgs = [SamplingConfig(temperature=0), SamplingConfig(top_k=40, min_p=0.1), SamplingConfig(top_p=0.9),
            SamplingConfig(min_p=0.05), SamplingConfig(temperature=1.2)]
    xs = torch.cat([x, x[:2]])
    for cfg in cfgs:
        with monkeypatch.context() as m:
            # the plain whole vocabulary settles a few unseeded top-p rows in C (a subclass keeps its own
            # reductions): without it both draw the same ids by the same torch passes
            m.setattr(sampling, "NATIVE_TOP_P_ROWS", 0)
            torch.manual_seed(0)
            want = sample(xs, cfg)
        torch.manual_seed(0)
        assert torch.equal(sample(xs, cfg, vocab=Recording(xs.shape[1])), want), cfg
        got, plain = probabilities(xs, cfg, vocab=Recording(xs.shape[1])), probabilities(xs, cfg)
        if cfg.top_p < 1.0 and not cfg.top_k:
            # the plain whole vocabulary settles these rows in C (a subclass keeps its own reductions): the same
            # kept sets, the same probabilities up to float32 rounding
            assert torch.equal(got > 0, plain > 0), cfg
            torch.testing.assert_close(got, plain, **ref.tolerance(torch.float32))
        else:
            assert torch.equal(got, plain), cfg
    assert {"amax", "amin", "argmax", "topk", "sum", "cat", "softmax", "columns"} <= set(calls)


# --- top-p alone in `sample`: a rejection draw, no top-p set ---------------------------------------------------


def _top_p_rows() -> torch.Tensor:
    """Rows [6, 1000] for the draw: flat, Gaussian (std 3 and 5), a tie straddling the cut, -inf tokens, and a
    row whose top-p set is a few tokens over a long tail."""
    g = torch.Generator().manual_seed(21)
    x = torch.randn(6, 1000, generator=g)
    x[1] *= 3.0
    x[2] *= 5.0
    x[3] = torch.randn(1000, generator=g).round(decimals=1)  # many ties, one of them at the cut
    x[4, ::3] = -INF
    x[5] = window_rows(1000, [4], seed=3)[0]
    return x


@pytest.mark.parametrize("p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_draw_accepts_exactly_the_reference_set(p):
    # the test each proposal faces: the mass strictly above the drawn value < p · the row's mass. Asked of every
    # distinct value of each row, it must give the reference's kept set, ties and the argmax included.
    import lmhead.sampling.top_p as sampling  # the module that holds the top-p paths and their constants

    x, temperature = _top_p_rows(), 0.8
    want = torch.isfinite(ref.sampling_process(x, [SamplingConfig(temperature=temperature, top_p=p)] * 6))
    vocab = sampling.Vocab(x.shape[1])
    top = x.amax(dim=-1, keepdim=True) / temperature
    limit = p * sampling.grid_sums(x, top, temperature, None, vocab).sum(dim=-1, dtype=torch.float64)
    for r in range(x.shape[0]):
        values = torch.unique(x[r][torch.isfinite(x[r])] / temperature)
        rows = x[r : r + 1].expand(values.numel(), -1)
        above = sampling.grid_sums(rows, top[r : r + 1].expand(values.numel(), 1), temperature, values[:, None],
                                    vocab).sum(dim=-1, dtype=torch.float64)
        kept_values = values[above < limit[r]]
        got = torch.isin(x[r] / temperature, kept_values)
        assert torch.equal(got, want[r]), (r, int(got.sum()), int(want[r].sum()))
        # the same test from the top 256 (used for a draw above the 256th largest value)
        window = torch.topk(x[r], 256).values / temperature
        few = values > window[-1]
        in_window = sampling._mass_above(window.expand(int(few.sum()), -1), top[r : r + 1], values[few, None])
        assert torch.equal(in_window < limit[r], above[few] < limit[r]), r


@pytest.mark.parametrize("p", [0.05, 0.9])
def test_top_p_draws_follow_the_reference_distribution(p, gen):
    x, n = _top_p_rows(), 2000
    cfg = SamplingConfig(temperature=0.8, top_p=p)
    probs = ref.sampling_draw_probabilities(x, [cfg] * x.shape[0])
    ids = sample(x.repeat_interleave(n, dim=0), cfg, generator=gen).view(x.shape[0], n)
    for r in range(x.shape[0]):
        assert ref.draws_fit(ids[r], probs[r], groups=12) == "", r


def test_top_p_draw_is_exact_when_rows_run_out_of_rounds(monkeypatch, gen):
    # after _DRAW_ROUNDS rejections a row draws from its exact top-p set: the mixture is still the top-p law
    import lmhead.sampling.top_p as sampling  # the module that holds the top-p paths and their constants

    monkeypatch.setattr(sampling, "_DRAW_ROUNDS", 1)
    row = torch.log(torch.tensor([0.3, 0.25, 0.2, 0.1, 0.1, 0.05]))
    row = torch.cat([row, torch.full((300,), -9.0)])[None]  # a tail: the fallback's whole-row path too
    for p in (0.4, 0.7, 0.96):
        cfg = SamplingConfig(top_p=p)
        ids = sample(row.expand(6000, -1), cfg, generator=gen)
        assert ref.draws_fit(ids, ref.sampling_draw_probabilities(row, [cfg])[0], groups=8) == "", p


def test_top_p_draw_per_token_frequencies_with_a_straddling_tie(gen):
    # probs 0.4, 0.2, 0.2, 0.2 at top_p 0.5: the tie is kept whole → 0.4, 0.2, 0.2, 0.2; at 0.35 only the first
    x = torch.log(torch.tensor([[0.4, 0.2, 0.2, 0.2]]))
    for p, want in ((0.5, [0.4, 0.2, 0.2, 0.2]), (0.35, [1.0, 0.0, 0.0, 0.0])):
        ids = sample(x.expand(20_000, -1), SamplingConfig(top_p=p), generator=gen)
        assert ref.draws_fit(ids, torch.tensor(want, dtype=torch.float64), groups=4) == "", p


def test_seeded_top_p_draws_depend_on_seed_and_step_only_and_follow_the_distribution():
    x = _top_p_rows()[1:2]
    cfg = SamplingConfig(temperature=0.8, top_p=0.9, seed=5)
    n = 600
    alone = [int(sample(x, cfg, step=s)) for s in range(n)]
    batch = sample(x.expand(n, -1), cfg, step=list(range(n))).tolist()
    assert alone == batch
    probs = ref.sampling_draw_probabilities(x, [cfg])[0]
    assert ref.draws_fit(torch.tensor(alone), probs, groups=6) == ""


# --- settings bounded where the float32 arithmetic stays finite ------------------------------------------------


@pytest.mark.parametrize(("kwargs", "name", "bounds"), [
    ({"repetition_penalty": 1e308}, "repetition_penalty", "[0.0001, 10000]"),
    ({"repetition_penalty": 1e-300}, "repetition_penalty", "[0.0001, 10000]"),
    ({"repetition_penalty": 2e4}, "repetition_penalty", "[0.0001, 10000]"),
    ({"presence_penalty": -1e308}, "presence_penalty", "[-10000, 10000]"),
    ({"frequency_penalty": 1e5}, "frequency_penalty", "[-10000, 10000]"),
    ({"logit_bias": {1: 1e308}}, "logit_bias", "[-10000, 10000]"),
    ({"logit_bias": {1: -1e5}}, "logit_bias", "[-10000, 10000]"),
    ({"temperature": 1e308}, "temperature", "[0, 10000]"),
])
def test_settings_beyond_their_finite_range_are_rejected_with_the_range(kwargs, name, bounds):
    with pytest.raises(ValueError, match=name) as err:
        SamplingConfig(**kwargs)
    assert bounds in str(err.value)


def test_settings_at_their_bounds_are_accepted_and_stay_finite():
    x = peaked(2, 50)
    cfgs = [SamplingConfig(repetition_penalty=1e4, presence_penalty=-1e4, frequency_penalty=1e4,
                           logit_bias={3: 1e4, 4: -1e4, 5: -INF}, temperature=1e4, top_p=0.5),
            SamplingConfig(repetition_penalty=1e-4, logit_bias={3: -1e4}, temperature=1e-5)]
    probs = probabilities(x, cfgs, prev_tokens=[[1, 2, 3], [1, 2, 3]], prompt_len=1)
    assert torch.isfinite(probs).all() and float(probs[0, 5]) == 0.0
    torch.testing.assert_close(probs.sum(-1), torch.ones(2))


def test_per_row_penalties_out_of_range_name_the_setting():
    x = torch.zeros(2, 4)
    for kwargs, name in (({"repetition_penalty": [1.0, 1e308]}, "repetition_penalty"),
                         ({"repetition_penalty": [1.0, 1e-300]}, "repetition_penalty"),
                         ({"presence_penalty": 1e308}, "presence_penalty"),
                         ({"frequency_penalty": [0.0, float("nan")]}, "frequency_penalty"),
                         ({"repetition_penalty": "big"}, "repetition_penalty")):
        with pytest.raises(ValueError, match=name):
            apply_penalties(x, [[0], [1]], **kwargs)


def test_an_overflow_in_processing_names_the_setting_not_the_logits():
    # bounded settings still overflow float32 on logits near its limit: the error says which setting did it
    x = torch.tensor([[3.5e34, 1.0, -3.5e34, 0.0]])
    for r, name in ((1e-4, "repetition_penalty"), (1e4, "repetition_penalty")):
        cfg = SamplingConfig(repetition_penalty=r)
        with pytest.raises(ValueError, match=name):
            sample(x, cfg, prev_tokens=[[0, 2]])
        with pytest.raises(ValueError, match=name):
            apply_penalties(x, [[0, 2]], repetition_penalty=r)
    for cfg in (SamplingConfig(temperature=1e-5), SamplingConfig(temperature=1e-5, top_k=2),
                SamplingConfig(temperature=1e-5, top_p=0.9), SamplingConfig(temperature=1e-5, min_p=0.1)):
        for fn in (sample, probabilities, process_logits):
            with pytest.raises(ValueError, match="temperature"):
                fn(x, cfg)
    with pytest.raises(ValueError, match="temperature"):
        apply_temperature(x, 1e-5)
    with pytest.raises(ValueError, match=r"logits must not contain \+inf"):  # the caller's own +inf
        sample(torch.tensor([[INF, 0.0]]), SamplingConfig(repetition_penalty=1e-4), prev_tokens=[[0]])


def test_top_p_draws_on_language_model_like_rows_settle_in_the_window(monkeypatch, gen):
    # rows whose top-p set is a few tokens: draws are tested from the top 256, and a rejected draw gives way to
    # the exact cut of that window; the draws still follow the reference distribution
    import lmhead.sampling.top_p as sampling  # the module that holds the top-p paths and their constants

    cuts = []
    real = sampling.top_p_sorted
    monkeypatch.setattr(sampling, "top_p_sorted", lambda *a: cuts.append(a[0].shape[0]) or real(*a))
    x = torch.cat([peaked(1, 3000, seed=9, scale=5.0), window_rows(3000, [6], seed=4)])
    cfg = SamplingConfig(temperature=0.8, top_p=0.6)  # about half the first draws are rejected
    probs = ref.sampling_draw_probabilities(x, [cfg] * 2)
    for r in range(2):
        ids = sample(x[r : r + 1].expand(4000, -1), cfg, generator=gen)
        assert ref.draws_fit(ids, probs[r], groups=12) == "", r
    assert sum(cuts) > 0


# every kind of cut in one batch: greedy, top-k (+ top-p, + min-p), top-p alone, min-p alone, none, seeded,
# penalties and a bias
MIXED = [SamplingConfig(temperature=0), SamplingConfig(top_k=20, temperature=0.7),
         SamplingConfig(top_k=50, top_p=0.8, seed=3), SamplingConfig(top_p=0.9, temperature=0.8),
         SamplingConfig(min_p=0.05), SamplingConfig(), SamplingConfig(top_k=20, temperature=0.7, seed=11),
         SamplingConfig(top_k=10, min_p=0.1, repetition_penalty=1.3, logit_bias={5: 4.0})]


def _reference_chosen(x, ids, configs, prev=None, plen=None):
    processed = ref.sampling_process(x, configs, prev, plen)
    return torch.log_softmax(processed.double(), dim=-1).gather(1, ids[:, None]).squeeze(1).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chosen_logprobs_equal_the_log_of_the_processed_distribution(dtype):
    x = peaked(len(MIXED), 3000, seed=21).to(dtype)
    prev = [[1, 2, 5, 9]] * len(MIXED)
    plen = [2] * len(MIXED)
    g = torch.Generator().manual_seed(0)
    ids = sample(x, MIXED, generator=g, prev_tokens=prev, prompt_len=plen, step=4)
    # the drawn ids and ids the pipeline cut (-inf), e.g. the least likely token of each row
    for tok in (ids, x.float().argmin(dim=-1)):
        got = chosen_logprobs(x, tok, MIXED, prev_tokens=prev, prompt_len=plen)
        want = _reference_chosen(x.float(), tok, MIXED, prev, plen)
        torch.testing.assert_close(got, want, **ref.tolerance(torch.float32))
        torch.testing.assert_close(got, logprobs(x, tok, MIXED, prev_tokens=prev, prompt_len=plen).logprob)


def test_sample_with_logprobs_draws_what_sample_draws_and_scores_it():
    x = peaked(len(MIXED), 5000, seed=22, scale=2.0)
    # the unseeded top-p-alone row (3) draws from its top-p set, not by `sample`'s rejection: other ids — and
    # the unseeded rows drawn after it from the same generator (4, 5, 7) see the generator after another use
    same = [0, 1, 2, 6]
    for step in range(6):
        a = sample(x, MIXED, generator=torch.Generator().manual_seed(step), step=step)
        b, lp = sample_with_logprobs(x, MIXED, generator=torch.Generator().manual_seed(step), step=step)
        assert torch.equal(a[same], b[same])
        torch.testing.assert_close(lp, _reference_chosen(x, b, MIXED), **ref.tolerance(torch.float32))
    one, one_lp = sample_with_logprobs(x[1], MIXED[1], generator=torch.Generator().manual_seed(0))
    assert one.dim() == 0 and one_lp.dim() == 0
    empty, empty_lp = sample_with_logprobs(x[:0], SamplingConfig())
    assert empty.shape == (0,) and empty_lp.shape == (0,)


def test_seeded_rows_sharing_a_top_k_cut_draw_what_they_draw_alone_even_with_ties_at_k():
    x = peaked(6, 4000, seed=23, scale=1.0)
    # rows 1 and 4: their 5th and 6th largest logits tie (the cut keeps both), beside rows without a tie
    for r in (1, 4):
        top = torch.topk(x[r], 6).indices
        x[r, top[5]] = x[r, top[4]]
    configs = [SamplingConfig(top_k=5, seed=s) for s in range(6)]
    for step in range(10):
        together = sample(x, configs, step=step)
        alone = [int(sample(x[r], configs[r], step=step)) for r in range(6)]
        assert together.tolist() == alone
        assert all(int(together[r]) in torch.topk(x[r], 6).indices.tolist() for r in (1, 4))


def test_greedy_and_seeded_rows_apart_draw_what_they_draw_alone():
    """A server's batch: greedy and seeded top-k rows interleaved (each read in place, not gathered), on a
    vocabulary wide enough for the threshold top-k."""
    x = peaked(8, 32768, seed=31, scale=1.0)
    configs = [SamplingConfig(temperature=0) if r % 3 == 0 else SamplingConfig(temperature=0.8, top_k=40, seed=r)
               for r in range(8)]
    for step in range(4):
        ids, lp = sample_with_logprobs(x, configs, step=step)
        assert ids.tolist() == sample(x, configs, step=step).tolist()
        for r, cfg in enumerate(configs):
            one, one_lp = sample_with_logprobs(x[r], cfg, step=step)
            assert int(ids[r]) == int(one)
            torch.testing.assert_close(lp[r], one_lp, rtol=0, atol=1e-6)


@pytest.mark.parametrize("cfg", [SamplingConfig(top_p=0.9, temperature=0.8), SamplingConfig(top_p=0.5)], ids=str)
def test_sample_with_logprobs_on_top_p_alone_follows_the_top_p_distribution(cfg):
    x = peaked(1, 3000, seed=24, scale=1.5)
    n = 3000
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([sample_with_logprobs(x, cfg, generator=g)[0][0] for _ in range(n)])
    probs = ref.sampling_draw_probabilities(x, [cfg])[0]
    assert ref.draws_fit(ids, probs) == "", ref.draws_fit(ids, probs)


def test_sample_with_logprobs_scores_a_seeded_top_p_row_with_bias_and_penalties_once():
    x = peaked(2, 4000, seed=25, scale=1.5)
    configs = [SamplingConfig(top_p=0.8, seed=5, logit_bias={5: 4.0, 9: -2.0}, repetition_penalty=1.3,
                              presence_penalty=0.5), SamplingConfig(temperature=0)]
    prev, plen = [[5, 7, 9, 11], [1, 2]], [2, 1]
    for step in range(5):
        ids, lp = sample_with_logprobs(x, configs, prev_tokens=prev, prompt_len=plen, step=step)
        assert torch.equal(ids, sample(x, configs, prev_tokens=prev, prompt_len=plen, step=step))
        torch.testing.assert_close(lp, _reference_chosen(x, ids, configs, prev, plen), **ref.tolerance(torch.float32))


@pytest.mark.parametrize("width", [48, 3000])
def test_narrow_rows_apart_drawn_together_draw_what_they_draw_alone(width):
    """A screened round's candidates: rows narrow enough to be copied together, greedy and seeded rows interleaved,
    top-p and min-p inside the top k, ties at the k-th value on some rows, a -inf padding on others."""
    x = peaked(9, width, seed=37, scale=1.0)
    for r in (2, 7):  # the 8th and 9th largest tie: the cut keeps both (a width of its own)
        top = torch.topk(x[r], 9).indices
        x[r, top[8]] = x[r, top[7]]
    x[4, width // 2:] = float("-inf")
    kinds = [SamplingConfig(temperature=0), SamplingConfig(temperature=0.8, top_k=8, seed=3),
             SamplingConfig(temperature=0.7, top_k=8, top_p=0.8, seed=5),
             SamplingConfig(temperature=1.2, top_k=8, min_p=0.05, seed=9)]
    configs = [kinds[r % 4] if r % 4 != 1 else SamplingConfig(temperature=0.8, top_k=8, seed=r) for r in range(9)]
    for step in range(6):
        ids, lp = sample_with_logprobs(x, configs, step=step)
        assert ids.tolist() == sample(x, configs, step=step).tolist()
        for r, cfg in enumerate(configs):
            one, one_lp = sample_with_logprobs(x[r], cfg, step=step)
            assert int(ids[r]) == int(one), (step, r)
            torch.testing.assert_close(lp[r], one_lp, rtol=0, atol=1e-6)


def test_a_seeded_top_p_row_draws_one_token_whichever_path_of_the_cut_finds_its_set(monkeypatch):
    """A seeded row races over its kept tokens alone, in id order: C's set, a window's (which carries dropped
    candidates) and the histogram's whole row (a set wider than the windows) give the same id for a (seed, step),
    with and without logprobs (those from the cut, finite), and the draws follow the reference distribution."""
    from lmhead.kernels import native

    if native.library() is None:
        pytest.skip("the C pass needs the native library")
    g = torch.Generator().manual_seed(31)
    rows = [window_rows(10_000, [6], seed=2)[0],       # a few tokens: C's set, or the first window's
            torch.randn(10_000, generator=g) * 2.0]    # a set of thousands: C's, or the histogram's whole row
    cfgs = [SamplingConfig(temperature=0.8, top_p=0.9, seed=3),
            SamplingConfig(temperature=0.8, top_p=0.9, min_p=0.01, seed=4)]  # top-p then min-p: the same cut path
    steps = range(300)
    for x in rows:
        for cfg in cfgs:
            with_c = [int(sample(x, cfg, step=s)) for s in steps]
            scored = [sample_with_logprobs(x, cfg, step=s) for s in steps[:40]]
            assert [int(i) for i, _ in scored] == with_c[:40]
            assert all(bool(torch.isfinite(lp)) for _, lp in scored)
            for i, lp in scored[:5]:
                torch.testing.assert_close(lp, chosen_logprobs(x, i, cfg).reshape(()), rtol=0, atol=1e-6)
            with monkeypatch.context() as m:
                m.setattr(native, "top_p_row", lambda *a: None)
                without = [int(sample(x, cfg, step=s)) for s in steps]
            assert with_c == without, cfg
            probs = ref.sampling_draw_probabilities(x[None], [cfg])[0]
            assert ref.draws_fit(torch.tensor(with_c), probs, groups=6) == ""


def test_unseeded_top_p_rows_draw_from_the_set_c_finds_and_the_rest_by_rejection(monkeypatch, gen):
    """`sample` (no logprobs) on a few unseeded top-p-alone rows: a language-model-like row's set is found in C and
    raced over, a flat row (a set wider than C takes) is drawn by rejection; both follow the reference."""
    import lmhead.sampling.top_p as sampling  # the module that holds the top-p paths and their constants
    from lmhead.kernels import native

    if native.library() is None:
        pytest.skip("the C pass needs the native library")
    settled, rejected = [], []
    top_p_row, draw = native.top_p_row, sampling.top_p_draw
    monkeypatch.setattr(native, "top_p_row", lambda *a: settled.append(top_p_row(*a) is not None) or top_p_row(*a))
    monkeypatch.setattr(sampling, "top_p_draw", lambda x, *a: rejected.append(x.shape[0]) or draw(x, *a))
    x = torch.cat([window_rows(10_000, [7], seed=5), torch.randn(1, 10_000, generator=gen) * 0.3])
    cfg = SamplingConfig(temperature=0.8, top_p=0.9)
    probs = ref.sampling_draw_probabilities(x, [cfg] * 2)
    ids = torch.stack([sample(x, cfg, generator=gen) for _ in range(1500)], dim=1)
    assert settled[:2] == [True, False] and set(rejected) == {1}
    for r in range(2):
        assert ref.draws_fit(ids[r], probs[r], groups=12) == "", r
