"""gpt-oss run from its GGUF file's own codes: the router with its bias (top k of the logits, then a softmax over
them), experts with biases and the clamped SwiGLU, attention sinks, sliding and full layers alternating, YaRN
rope, q/k/v/o biases — logits equal to transformers' float32 GptOss holding the file's dequantised weights
(gguf-py), greedy tokens equal to its generate(), rows of one batch choosing different experts equal to each
alone, the file's config, tokenizer (a "gpt-4o" pre-tokenizer) and chat template read from the file, and
`lmhead generate` on the file."""

from __future__ import annotations

import pytest
import torch

from lmhead.models.coded_linear import coded_available

pytestmark = pytest.mark.skipif(not coded_available(), reason="no C compiler for the coded kernel")

TEXT = "The cat sat on the mat. The dog ran after a ball"


def _load(tmp_path, monkeypatch, kind: str, **kw):
    from tiny_gguf import write_tiny_gpt_oss

    from lmhead import load_model

    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gpt_oss(tmp_path / "tiny_gpt_oss.gguf", kind, **kw)
    return path, load_model(str(path), progress=False)


def _reference(path):
    from tiny_gguf import gpt_oss_reference, tiny_gpt_oss

    return gpt_oss_reference(path, tiny_gpt_oss()[0])


@pytest.mark.parametrize("kind", ["F32", "Q8_0", "MXFP4"])
@pytest.mark.slow
def test_a_tiny_gpt_oss_gguf_runs_from_its_codes_with_transformers_numbers(tmp_path, monkeypatch, kind):
    from tiny_gguf import assert_matches_reference

    from lmhead.models.expert_layout import ExpertMatrices, expert_nbytes
    from lmhead.models.gguf_file import GGUFFile

    path, model = _load(tmp_path, monkeypatch, kind)
    moe = model.lean.layers[0].moe
    assert model.config.model_type == "gpt_oss" and moe is not None
    # the file's codes (no float32 copy), one object a product over every expert
    assert isinstance(moe.gate_up, ExpertMatrices) and isinstance(moe.down, ExpertMatrices)
    experts, d, f = len(moe.down), moe.down.out_features, moe.down.in_features
    # the experts take what the memory check counted for them before loading
    assert moe.gate_up.nbytes + moe.down.nbytes == expert_nbytes(kind, experts, 2 * f, d) + expert_nbytes(
        kind, experts, d, f)
    if kind == "MXFP4":  # two codes a byte and the exponent byte per 32: the file's 17 bytes
        assert moe.gate_up[0].packed and moe.gate_up.scale.dtype == torch.uint8
        tensors = GGUFFile(path).tensors
        assert moe.gate_up.nbytes + moe.down.nbytes == sum(
            int(tensors[f"blk.0.{n}.weight"].n_bytes) for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
    assert [layer.sliding for layer in model.lean.layers] == [True, False]
    ref = _reference(path)
    ids = torch.tensor([model.encode(TEXT)])
    assert ids.shape[1] > 2 * model.config.sliding_window  # the sliding layer's window cuts
    with torch.no_grad():
        want = ref(ids).logits
    assert_matches_reference(model, ref, ids, want)


def test_gpt_oss_rows_that_pick_different_experts_in_one_batch_get_what_each_gets_alone(tmp_path, monkeypatch):
    path, model = _load(tmp_path, monkeypatch, "MXFP4")
    lean = model.lean
    prompts = [model.encode("The cat sat on the mat."), model.encode("Numbers: 1 2 3"),
               model.encode("Hello world!")]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])           # left-padded
    valid = torch.tensor([[False] * (width - len(p)) + [True] * len(p) for p in prompts])
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    moe = lean.layers[0].moe
    seen = []
    moe.route = lambda h, route=moe.route: seen.append(route(h)) or seen[-1]
    try:
        cache = lean.new_cache(3, width + 1)
        last = lean(ids, positions, cache, valid)[:, -1]
    finally:
        del moe.route
    chosen = {tuple(sorted(e)) for e in seen[0].experts.reshape(3, width, -1)[:, -1].tolist()}
    assert len(chosen) > 1  # the rows' last tokens chose different experts
    for r, p in enumerate(prompts):
        alone = lean(torch.tensor([p]), torch.arange(len(p))[None], lean.new_cache(1, len(p)))[:, -1]
        torch.testing.assert_close(last[r:r + 1], alone, rtol=0, atol=1e-5 * float(alone.abs().max()))


def test_gpt_oss_router_takes_the_top_k_of_its_biased_logits_then_a_softmax_over_them():
    from tiny_gguf import tiny_gpt_oss

    from lmhead.models.moe import route

    router = tiny_gpt_oss()[0].model.layers[0].mlp.router
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    x[1] = x[0]  # a row twice
    with torch.no_grad():  # transformers' router on each row alone: a row's bits whatever the batch (moe.route)
        alone = [router(x[i:i + 1]) for i in range(x.shape[0])]
    logits, weights, experts = (torch.cat([a[j] for a in alone]) for j in range(3))
    got = route(x, router.weight.detach(), router.top_k, False, router.bias.detach(), softmax_after_topk=True)
    assert torch.equal(got.experts, experts) and torch.equal(got.weights, weights) and torch.equal(got.logits, logits)
    with torch.no_grad():
        assert torch.equal(router(x)[2], experts)  # its batched call chooses the same experts here


def test_gpt_oss_config_tokenizer_and_chat_template_are_read_from_the_file(tmp_path, monkeypatch):
    from tiny import tiny_tokenizer
    from tiny_gguf import tiny_gpt_oss

    template = "{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
    model, tokenizer = tiny_gpt_oss()
    path, lm = _load(tmp_path, monkeypatch, "Q8_0", model=model, tokenizer=tokenizer, template=template)
    cfg = lm.config
    # what transformers' GGUF reader leaves out or misreads, read from the header
    assert (cfg.head_dim, cfg.sliding_window) == (16, 4)
    assert cfg.rope_parameters == {**model.config.rope_parameters}
    # the file's "gpt-4o" pre-tokenizer (o200k's split: a number apart from the space before it), as transformers'
    # GGUF tokenizer builds it from the file
    from transformers import AutoTokenizer

    from lmhead.models.gguf_meta import header_reader

    with header_reader():
        theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = TEXT + " 1234"
    assert "Split" in str(theirs.backend_tokenizer.pre_tokenizer)
    assert lm.encode(text) == theirs(text)["input_ids"]
    assert lm.encode(text)[-5:] != tiny_tokenizer()(text)["input_ids"][-5:]  # not tiny.py's byte-level split
    assert "<|start|>user<|message|>hi<|end|>" in lm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False)


def test_lmhead_generate_runs_a_gpt_oss_file_from_the_command_line(tmp_path, monkeypatch, capsys):
    from tiny_gguf import write_tiny_gpt_oss

    from lmhead.cli import main

    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gpt_oss(tmp_path / "tiny_gpt_oss.gguf", "MXFP4")
    assert main(["generate", "The cat sat", "-m", str(path), "-n", "6", "--temperature", "0", "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) >= 1 and all(line.startswith("{") for line in out)


def test_a_gpt_oss_file_without_its_experts_biases_is_refused_naming_them(tmp_path, monkeypatch):
    from lmhead.models import ModelError

    with pytest.raises(ModelError, match=r"blk\.1\.ffn_up_exps\.bias"):
        _load(tmp_path, monkeypatch, "Q8_0", drop="blk.1.ffn_up_exps.bias")


def test_transformers_model_of_a_gpt_oss_file_is_refused_in_one_line(tmp_path, monkeypatch):
    from lmhead.models import ModelError

    _, model = _load(tmp_path, monkeypatch, "Q8_0")
    with pytest.raises(ModelError, match="does not read a gpt-oss file's sinks, biases and experts"):
        _ = model.hf_model


def test_the_router_view_of_a_gpt_oss_token_is_transformers_routing(tmp_path, monkeypatch):
    from lmhead.models.routing import router_choices

    path, model = _load(tmp_path, monkeypatch, "MXFP4")
    ids = model.encode(TEXT)
    choices = router_choices(model.lean, ids)
    assert [c.layer for c in choices] == [0, 1]
    with torch.no_grad():
        logits = _reference(path)(torch.tensor([ids]), output_router_logits=True).router_logits
    for choice, layer in zip(choices, logits, strict=True):
        top, experts = torch.topk(layer[-1].float(), 2)  # gpt-oss's rule: the top k logits, then their softmax
        assert choice.experts == experts.tolist()
        torch.testing.assert_close(torch.tensor(choice.weights), torch.softmax(top, -1), rtol=0, atol=1e-5)
        torch.testing.assert_close(torch.tensor(choice.probabilities), torch.softmax(layer[-1].float(), -1),
                                   rtol=0, atol=1e-5)


def test_a_gpt_oss_prompt_prefilled_in_chunks_gives_the_whole_prompts_states(tmp_path, monkeypatch):
    _, model = _load(tmp_path, monkeypatch, "MXFP4")
    lean = model.lean
    ids = torch.tensor([model.encode(TEXT)])
    t = ids.shape[1]
    whole = lean(ids, torch.arange(t)[None], lean.new_cache(1, t))
    cache = lean.new_cache(1, t)
    cut = [0, 3, 9, t]  # chunks longer and shorter than the sliding window (4)
    chunks = torch.cat([lean(ids[:, a:b], torch.arange(a, b)[None], cache)
                        for a, b in zip(cut, cut[1:], strict=False)], dim=1)
    torch.testing.assert_close(chunks, whole, rtol=0, atol=1e-5 * float(whole.abs().max()))


def test_the_lean_body_of_a_transformers_gpt_oss_model_gives_its_hidden_states():
    from tiny_gguf import tiny_gpt_oss

    from lmhead.models.lean import LeanBody

    model, _ = tiny_gpt_oss(seed=3)
    lean = LeanBody(model)
    assert all(layer.moe is not None and layer.sinks is not None for layer in lean.layers)
    ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(0))  # past the window (4)
    with torch.no_grad():
        want = model.model(ids).last_hidden_state
    got = lean(ids, torch.arange(9).expand(2, 9), lean.new_cache(2, 9))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))


def test_lmhead_chat_runs_a_gpt_oss_file_with_the_files_chat_template(tmp_path, monkeypatch, capsys):
    import io
    import sys

    from lmhead.cli import main
    from lmhead.conversation import Conversation
    from lmhead.sampling import SamplingConfig

    template = ("{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
                "{% if add_generation_prompt %}<|start|>assistant<|message|>{% endif %}")
    path, model = _load(tmp_path, monkeypatch, "MXFP4", template=template)
    want = "".join(s.text for s in Conversation(model, config=SamplingConfig(temperature=0),
                                                max_new_tokens=6).reply("Hi there"))
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi there\n/exit\n"))
    assert main(["chat", "--model", str(path), "-t", "0", "-n", "6"]) == 0
    assert capsys.readouterr().out.split("\n")[0] == want


def test_gpt_oss_prompts_decoded_together_with_drafts_verified_get_transformers_greedy_tokens(tmp_path,
                                                                                                  monkeypatch):
    from lmhead import SamplingConfig

    path, model = _load(tmp_path, monkeypatch, "MXFP4")
    ref = _reference(path)
    prompts = ["The cat sat on the mat. The cat sat", "Numbers: 1 2 3", "Hello world!"]
    greedy = SamplingConfig(temperature=0)
    for draft in ("none", "ngram"):  # rows of one batch; n-gram drafts verified several positions a call
        got: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
        for step in model.generate(prompts, max_new_tokens=8, config=greedy, draft=draft):
            got[step.index].append(step.token_id)
        for i, prompt in enumerate(prompts):
            start = torch.tensor([model.encode(prompt)])
            want = ref.generate(start, max_new_tokens=8, do_sample=False, eos_token_id=None)[0, start.shape[1]:]
            assert got[i] == want.tolist()[:len(got[i])] and got[i], (draft, i)


@pytest.mark.parametrize("kind", ["MXFP4", "Q8_0"])
def test_gpt_oss_layers_in_the_c_step_are_the_per_primitive_and_per_expert_paths_bits(tmp_path, monkeypatch, kind):
    from tiny_gguf import moe_paths

    from lmhead.kernels import experts as experts_kernel

    if not experts_kernel.available():
        pytest.skip("the experts kernel is not built")
    _, model = _load(tmp_path, monkeypatch, kind)
    lean = model.lean
    moe_layers = [layer.moe for layer in lean.layers if layer.moe is not None]
    assert all(m.gate_up_bias is not None and m.down_bias is not None for m in moe_layers)
    assert lean._step_descs() is not None  # attention with sinks and o's bias, the router called back
    prompts = [model.encode("The cat sat on the mat."), model.encode("Numbers: 1 2 3")]
    (step, layers, experts), calls = moe_paths(model, monkeypatch, prompts)
    assert calls == [[], [experts_kernel.SWIGLU_OAI] * 4 * len(moe_layers), []]
    for a, b, c in zip(step, layers, experts, strict=True):
        assert torch.equal(a, b) and torch.equal(b, c)


def test_the_c_clamped_swiglu_is_torchs_within_float32_rounding_nan_and_clamps_included():
    from lmhead.kernels import native
    from lmhead.models.moe import SwigluOAI

    if native.library() is None:
        pytest.skip("the native kernels are not built")
    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn(5, 2 * 45, generator=g) * 8  # 45: the vector loop and its scalar tail; clamps reached
    gate_up[0, 3] = gate_up[1, 50] = float("nan")
    gate_up[2, 7], gate_up[2, 52] = -200.0, 300.0
    act = SwigluOAI(alpha=1.702, limit=7.0)
    got, want = act.native(gate_up), act(gate_up)
    assert torch.equal(got.isnan(), want.isnan()) and bool(got.isnan().any())
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, equal_nan=True)


def test_gpt_oss_attention_with_its_sinks_runs_in_c_with_the_torch_attentions_numbers(tmp_path, monkeypatch):
    from lmhead.models.lean import LeanBody

    _, model = _load(tmp_path, monkeypatch, "F32")
    lean = model.lean
    if lean.native is None:
        pytest.skip("the native kernels are not built")
    ids = torch.tensor([model.encode(TEXT)])
    positions = torch.arange(ids.shape[1])[None]
    monkeypatch.setattr(LeanBody, "_in_step", staticmethod(lambda layer: False))  # layer by layer, not the C step
    lean._descs = None
    taken = []
    real = LeanBody._attention_native
    monkeypatch.setattr(LeanBody, "_attention_native",
                        lambda self, *a: taken.append(a[-1] is not None) or real(self, *a))

    def run() -> list[torch.Tensor]:
        """The prompt in one piece, then three decode steps (sliding and full layers, the window cut)."""
        cache = lean.new_cache(1, ids.shape[1] + 3)
        hs = [lean(ids, positions, cache)]
        for step in range(3):
            hs.append(lean(model.exact_head(hs[-1][:, -1:]).argmax(-1), positions[:, -1:] + step + 1, cache))
        return hs

    in_c = run()
    assert taken and all(taken)  # every layer's call carried its sinks
    monkeypatch.setattr(LeanBody, "_attention_native", lambda self, *a: None)  # torch's `_attend`
    in_torch = run()
    for got, want in zip(in_c, in_torch, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
