"""lmhead.integrations.transformers: a patched causal LM gives the unpatched model's loss and every gradient
(float32: rtol 1e-5, atol 1e-6) without logits, on each supported architecture; errors are clear."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from tiny import tiny_model  # noqa: E402

from lmhead.integrations.transformers import (  # noqa: E402
    SUPPORTED_MODELS,
    apply_fused_loss,
    fused_loss,
    has_fused_loss,
    undo_fused_loss,
)

RTOL, ATOL = 1e-5, 1e-6  # float32 rounding: the fused loss sums its chunks in another order

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: thread handshakes cost more than the ops


def small_model(arch: str, tie: bool = True, softcap: float | None = None):
    """A tiny random causal LM of `arch` (float32, eval mode, vocabulary 320)."""
    if arch in ("llama", "gemma3"):
        return tiny_model(arch, tie=tie, softcap=softcap)[0]
    from transformers import AutoModelForCausalLM, GPT2Config, Qwen2Config, Qwen3Config

    common = dict(vocab_size=320, tie_word_embeddings=tie, initializer_range=0.3, pad_token_id=0)
    if arch == "gpt2":
        config = GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=64, **common)
    else:
        cls = Qwen2Config if arch == "qwen2" else Qwen3Config
        config = cls(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=16, max_position_embeddings=64, **common)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return model.eval()


ARCHS = [("llama", {}), ("llama", {"tie": False}), ("gemma3", {"softcap": 3.0}), ("gemma3", {"tie": False}),
         ("qwen2", {}), ("qwen3", {"tie": False}), ("gpt2", {})]


def batch(seed: int = 0, b: int = 3, t: int = 11):
    """Left-padded ids [B,T], attention mask and labels (-100 at padding and at a few ignored positions)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 320, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    mask[1, :4] = 0
    mask[-1, :2] = 0
    ids[mask == 0] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, 5:7] = -100
    return ids, mask, labels


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(ref_model, model, rtol: float = RTOL, atol: float = ATOL) -> None:
    g_ref, g = grads(ref_model), grads(model)
    assert g_ref.keys() == g.keys() and g
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], rtol=rtol, atol=atol, msg=name)


def pair(arch: str, **kw):
    ref = small_model(arch, **kw)
    model = apply_fused_loss(copy.deepcopy(ref))
    return ref, model


@pytest.mark.parametrize(("arch", "kw"), ARCHS, ids=[f"{a}-{'-'.join(map(str, k.items()))}" for a, k in ARCHS])
def test_loss_and_every_gradient_equal_the_unpatched_model(arch, kw):
    ref, model = pair(arch, **kw)
    ids, mask, labels = batch()
    out_ref = ref(ids, attention_mask=mask, labels=labels)
    out = model(ids, attention_mask=mask, labels=labels)
    assert out.logits is None and out_ref.logits is not None
    torch.testing.assert_close(out.loss, out_ref.loss, rtol=RTOL, atol=ATOL)
    out_ref.loss.backward()
    out.loss.backward()
    assert_same(ref, model)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_gradient_accumulation_with_num_items_in_batch(arch):
    """Trainer's fix: each micro-batch's sum is divided by the tokens of the whole accumulated batch."""
    ref, model = pair(arch, softcap=5.0) if arch == "gemma3" else pair(arch)
    micro = [batch(1, b=2, t=9), batch(2, b=3, t=7)]
    items = torch.tensor(sum(int((lab[:, 1:] != -100).sum()) for _, _, lab in micro))
    total_ref = total = 0.0
    for ids, mask, labels in micro:
        loss_ref = ref(ids, attention_mask=mask, labels=labels, num_items_in_batch=items).loss
        loss = model(ids, attention_mask=mask, labels=labels, num_items_in_batch=items).loss
        torch.testing.assert_close(loss, loss_ref, rtol=RTOL, atol=ATOL)
        loss_ref.backward()
        loss.backward()
        total_ref, total = total_ref + loss_ref.item(), total + loss.item()
    assert total == pytest.approx(total_ref, rel=RTOL)
    assert_same(ref, model)


def test_shift_labels_and_ignore_index_keywords():
    ref, model = pair("qwen2")
    ids, mask, labels = batch(3)
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
    out_ref = ref(ids, attention_mask=mask, labels=labels, shift_labels=shifted)
    out = model(ids, attention_mask=mask, labels=labels, shift_labels=shifted)
    torch.testing.assert_close(out.loss, out_ref.loss, rtol=RTOL, atol=ATOL)
    custom = labels.masked_fill(labels == -100, -1)
    out = model(ids, attention_mask=mask, labels=custom, ignore_index=-1)
    torch.testing.assert_close(out.loss, out_ref.loss, rtol=RTOL, atol=ATOL)


def test_bfloat16_model_matches_unpatched_loss():
    ref = small_model("gemma3", softcap=5.0).to(torch.bfloat16)
    model = apply_fused_loss(copy.deepcopy(ref))
    ids, mask, labels = batch(4)
    out_ref = ref(ids, attention_mask=mask, labels=labels)
    out = model(ids, attention_mask=mask, labels=labels)
    assert out.loss.dtype == out_ref.loss.dtype == torch.float32
    torch.testing.assert_close(out.loss, out_ref.loss, rtol=1e-2, atol=1e-2)  # bf16 logits' rounding
    out.loss.backward()
    out_ref.loss.backward()
    g, g_ref = grads(model), grads(ref)
    for name in g_ref:
        torch.testing.assert_close(g[name].float(), g_ref[name].float(), rtol=0.1, atol=0.05, msg=name)


def test_without_labels_the_forward_and_generate_are_unchanged():
    ref, model = pair("gemma3", softcap=3.0)
    ids, mask, _ = batch(5)
    torch.testing.assert_close(model(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits,
                               rtol=0, atol=0)
    last = model(ids, attention_mask=mask, logits_to_keep=1).logits
    assert last.shape == (3, 1, 320)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    out_ref = ref.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(out, out_ref)


def test_return_dict_false_gives_the_loss_first():
    ref, model = pair("llama")
    ids, mask, labels = batch(6)
    loss = model(ids, attention_mask=mask, labels=labels, return_dict=False)[0]
    torch.testing.assert_close(loss, ref(ids, attention_mask=mask, labels=labels).loss, rtol=RTOL, atol=ATOL)


def test_undo_context_manager_and_other_instances():
    model, other = small_model("llama"), small_model("llama")
    ids, mask, labels = batch(7)
    assert apply_fused_loss(model) is model and has_fused_loss(model)
    assert apply_fused_loss(model) is model  # twice: a no-op
    assert model(ids, labels=labels).logits is None
    assert other(ids, labels=labels).logits is not None  # the class is untouched
    assert undo_fused_loss(model) is model and not has_fused_loss(model)
    assert model(ids, labels=labels).logits is not None
    with fused_loss(model) as m:
        assert m is model and m(ids, labels=labels).logits is None
    assert not has_fused_loss(model) and model(ids, labels=labels).logits is not None
    assert undo_fused_loss(model) is model  # unpatched: a no-op


def test_the_signature_trainer_reads_is_the_original():
    import inspect

    model = apply_fused_loss(small_model("llama"))
    params = inspect.signature(model.forward).parameters
    assert {"input_ids", "attention_mask", "labels"} <= set(params)
    assert any(p.kind == p.VAR_KEYWORD for p in params.values())  # accepts num_items_in_batch


def test_an_lmhead_model_is_patched_through_its_hf_model():
    class Wrapper:  # what lmhead.Model looks like to apply_fused_loss
        hf_model = small_model("llama")

    assert apply_fused_loss(Wrapper()) is Wrapper.hf_model and has_fused_loss(Wrapper.hf_model)


def test_unsupported_models_are_refused_naming_the_supported_ones():
    from transformers import AutoModelForCausalLM, MistralConfig

    mistral = AutoModelForCausalLM.from_config(MistralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1))
    with pytest.raises(TypeError, match="MistralForCausalLM is not supported; supported: Gemma3ForCausalLM"):
        apply_fused_loss(mistral)
    with pytest.raises(TypeError, match="transformers causal LM"):
        apply_fused_loss("llama")

    class MyLlama(type(small_model("llama"))):  # a subclass may change the forward: refused too
        pass

    with pytest.raises(TypeError, match="not supported"):
        apply_fused_loss(MyLlama(small_model("llama").config))
    assert "LlamaForCausalLM" in SUPPORTED_MODELS and "GPT2LMHeadModel" in SUPPORTED_MODELS


def test_bad_labels_and_options_are_clear_errors():
    model = apply_fused_loss(small_model("llama"))
    ids, mask, labels = batch(8)
    with pytest.raises(TypeError, match="labels must be an integer tensor"):
        model(ids, labels=labels.float())
    with pytest.raises(ValueError, match=r"labels must have shape \[B,T\] = \[3, 11\]"):
        model(ids, labels=labels[:, :-1])
    with pytest.raises(TypeError, match="labels must be a torch.Tensor"):
        model(ids, labels=labels.tolist())
    with pytest.raises(ValueError, match="logits_to_keep must be 0"):
        model(ids, labels=labels, logits_to_keep=1)
    with pytest.raises(ValueError, match="chunk_size"):
        apply_fused_loss(small_model("llama"), chunk_size=0)


def test_a_missing_head_weight_is_a_clear_error():
    model = small_model("llama", tie=False)
    model.lm_head = torch.nn.Identity()
    with pytest.raises(ValueError, match="lm_head.*no \\[V,D\\] weight"):
        apply_fused_loss(model)
    meta = small_model("qwen2", tie=False)
    meta.lm_head.to("meta")
    with pytest.raises(ValueError, match="meta device"):
        apply_fused_loss(meta)


def test_all_labels_ignored_gives_zero_loss_and_zero_gradients():
    model = apply_fused_loss(small_model("llama"))
    ids, _, labels = batch(9)
    out = model(ids, labels=torch.full_like(labels, -100))
    out.loss.backward()
    assert out.loss.item() == 0.0
    assert all(float(g.abs().max()) == 0.0 for g in grads(model).values())


def saved_for_backward(model, ids, mask, labels) -> dict[str, int]:
    """Bytes autograd saves during one training forward, each storage once, parameters excluded: inside the
    body (`model.base_model`) and outside it (head + loss)."""
    seen = {p.untyped_storage().data_ptr() for p in model.parameters()}
    where = {"depth": 0}
    counts = {"body": 0, "outside": 0}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            counts["body" if where["depth"] else "outside"] += st.nbytes()
        return t

    handles = [model.base_model.register_forward_pre_hook(lambda *a: where.update(depth=where["depth"] + 1)),
               model.base_model.register_forward_hook(lambda *a: where.update(depth=where["depth"] - 1))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(ids, attention_mask=mask, labels=labels).loss.backward()
    finally:
        for h in handles:
            h.remove()
    return counts


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_patched_forward_saves_nothing_beyond_the_bodys_activations(arch):
    """The fused loss keeps no logits and no second copy of the hidden states for backward: outside the body
    it saves only the final hidden [B,T,D] (which the unpatched head saves too, as its input), inside the body
    the same as unpatched."""
    ref, model = pair(arch)
    ref.train()
    model.train()
    ids, mask, labels = batch(10)
    s_ref, s = saved_for_backward(ref, ids, mask, labels), saved_for_backward(model, ids, mask, labels)
    hidden = ids.numel() * model.config.hidden_size * 4
    assert s_ref["outside"] >= hidden + ids.numel() * 320 * 4  # + the log-softmax [B·T, V] float32
    assert s["outside"] == hidden
    assert s["body"] == s_ref["body"] > 0


def test_gradient_checkpointing_gives_the_same_loss_and_gradients():
    """Trainer(gradient_checkpointing=True) on both: the body recomputes its layers in the backward, and the
    patched model's loss and gradients still equal the unpatched one's."""
    ref, model = pair("llama")
    for m in (ref, model):
        # transformers 5 renamed it (the old name warns)
        (getattr(m, "activation_checkpointing_enable", None) or m.gradient_checkpointing_enable)()
        m.train()
    ids, mask, labels = batch(11)
    out_ref = ref(ids, attention_mask=mask, labels=labels)
    out = model(ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(out.loss, out_ref.loss, rtol=RTOL, atol=ATOL)
    out_ref.loss.backward()
    out.loss.backward()
    assert_same(ref, model)
