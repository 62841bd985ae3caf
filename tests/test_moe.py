"""Mixtures of experts (Qwen3-MoE, Qwen2-MoE, Mixtral-style llama files) run from their GGUF files' own codes:
logits equal to transformers' float32 forward on the file's dequantised weights, greedy tokens equal to its
generate(), the router's choice equal to transformers' on near-ties, rows picking different experts in one batch
equal to each alone, and the files lmhead cannot run refused in one line naming the tensor or architecture."""

from __future__ import annotations

import gc
import os
import sys

import numpy as np
import pytest
import torch

from lmhead.models.coded_linear import coded_available

pytestmark = pytest.mark.skipif(not coded_available(), reason="no C compiler for the coded kernel")

FILES = [("qwen3_moe", "F32"), ("qwen3_moe", "Q8_0"), ("qwen3_moe", "Q4_K"), ("qwen2_moe", "F32"),
         ("qwen2_moe", "Q8_0"), ("qwen2_moe", "Q4_K"), ("mixtral", "F32"), ("mixtral", "Q8_0"), ("mixtral", "Q4_K")]


def _load(tmp_path, monkeypatch, arch: str, kind: str, **kw):
    from tiny_gguf import write_tiny_gguf

    from lmhead import load_model

    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / f"tiny-{arch}.gguf", arch, kind=kind, **kw)
    return path, load_model(str(path), progress=False)


@pytest.mark.parametrize("arch,kind", FILES)
@pytest.mark.slow
def test_a_tiny_moe_gguf_runs_from_its_codes_with_transformers_numbers(tmp_path, monkeypatch, arch, kind):
    from tiny_gguf import assert_matches_reference, reference_from_gguf

    from lmhead.models.coded_linear import CodedLinear
    from lmhead.models.expert_layout import ExpertMatrices, expert_nbytes
    from lmhead.models.gguf_file import GGUFFile

    path, model = _load(tmp_path, monkeypatch, arch, kind)
    moe = model.lean.layers[0].moe
    assert moe is not None and model.config.model_type == arch
    # the experts are the file's codes (no float32 copy), one object a product, each expert a slice of it; the
    # router float32 as the file holds it
    assert isinstance(moe.gate_up, ExpertMatrices) and isinstance(moe.down, ExpertMatrices)
    assert isinstance(moe.gate_up[7], CodedLinear)
    assert moe.gate_up[7].codes.data_ptr() == moe.gate_up.codes[7].data_ptr()
    experts, d, f = len(moe.down), moe.down.out_features, moe.down.in_features
    held = moe.gate_up.nbytes + moe.down.nbytes
    # they take what the memory check counted for them before loading
    assert held == expert_nbytes(kind, experts, 2 * f, d) + expert_nbytes(kind, experts, d, f)
    # and about their bytes in the file: Q8_0 and F32 exactly, Q4_K's scales as its blocks hold them (152 bytes a
    # block of 256 weights, the file's 144)
    tensors = GGUFFile(path).tensors
    in_file = sum(int(tensors[f"blk.0.{n}.weight"].n_bytes) for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
    assert held == in_file if kind != "Q4_K" else held == in_file * 152 // 144
    assert "_hf_model" not in model.__dict__ or model.__dict__["_hf_model"] is None  # nothing converted
    ref = reference_from_gguf(path, arch)
    ids = torch.tensor([model.encode("The cat sat on the mat. The dog ran after a ball")])
    with torch.no_grad():
        want = ref(ids).logits
    # the whole prompt, then decode-sized calls (each expert's coded product over the rows that chose it)
    assert_matches_reference(model, ref, ids, want)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_the_lean_body_of_a_transformers_moe_model_gives_its_hidden_states(arch):
    from tiny_gguf import _hf_model

    from lmhead.models.lean import LeanBody

    model, _ = _hf_model(arch, seed=3)
    lean = LeanBody(model)
    assert all(layer.moe is not None for layer in lean.layers)
    ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model.model(ids).last_hidden_state
    got = lean(ids, torch.arange(9).expand(2, 9), lean.new_cache(2, 9))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))


@pytest.mark.slow
def test_rows_that_pick_different_experts_in_one_batch_get_what_each_gets_alone(tmp_path, monkeypatch):
    _, model = _load(tmp_path, monkeypatch, "qwen3_moe", "Q8_0")
    lean = model.lean
    prompts = [model.encode(t) for t in ("The cat sat on the mat", "A dog", "Numbers: 1, 2, 3, 4, 5, 6")]
    width = max(len(p) for p in prompts)
    ids = torch.zeros((3, width), dtype=torch.long)
    valid = torch.zeros((3, width), dtype=torch.bool)
    positions = torch.zeros((3, width), dtype=torch.long)
    for r, p in enumerate(prompts):  # left padding, as the engine batches rows
        ids[r, width - len(p):] = torch.tensor(p)
        valid[r, width - len(p):] = True
        positions[r, width - len(p):] = torch.arange(len(p))
    from lmhead.models import moe as moe_module

    moe = lean.layers[0].moe
    chosen = []  # the first layer's routing of each call (the method read per call: an instance attribute wins)
    moe.route = lambda h, route=moe.route: chosen.append(route(h)) or chosen[-1]
    products: list[tuple[int, int, int]] = []  # (id of the experts, expert, rows) of every expert product
    real_expert = moe_module._expert
    monkeypatch.setattr(moe_module, "_expert", lambda mats, e, x, b=None: products.append((id(mats), e, x.shape[0]))
                        or real_expert(mats, e, x, b))
    real_available = moe_module.experts_kernel.available  # the per-expert path here, its products counted
    monkeypatch.setattr(moe_module.experts_kernel, "available", lambda: False)
    cache = lean.new_cache(3, width + 4)
    batched = [lean(ids, positions, cache, valid)[:, -1]]
    last = ids[:, -1:]
    for step in range(3):  # decode steps: one row each, grouped by expert across the batch
        h = lean(last, positions[:, -1:] + step + 1, cache)
        batched.append(h[:, -1])
        last = model.exact_head(h).argmax(-1)
    # in each decode step the rows chose different experts in the first layer (a batch of several experts' rows)
    assert len(chosen) == 4 and all(len({tuple(sorted(e)) for e in c.experts.tolist()}) > 1 for c in chosen[1:])
    # grouped by expert, as mul_mat_id: the first layer's gate/up products are one per chosen expert and call, each
    # over every row that chose it
    first = [(e, rows) for mats, e, rows in products if mats == id(moe.gate_up)]
    want_groups = [sorted(torch.unique(c.experts, return_counts=True)[1].tolist()) for c in chosen]
    got_groups, at = [], 0
    for c in chosen:
        n = len(torch.unique(c.experts))
        got_groups.append(sorted(rows for _, rows in first[at:at + n]))
        at += n
    assert at == len(first) and got_groups == want_groups
    del moe.route
    monkeypatch.setattr(moe_module, "_expert", real_expert)
    monkeypatch.setattr(moe_module.experts_kernel, "available", real_available)  # alone: the one C call
    for r, p in enumerate(prompts):
        alone = lean.new_cache(1, len(p) + 4)
        want = [lean(torch.tensor([p]), torch.arange(len(p))[None], alone)[:, -1]]
        tok = ids[r:r + 1, -1:]
        for step in range(3):
            h = lean(tok, torch.tensor([[len(p) + step]]), alone)
            want.append(h[:, -1])
            tok = model.exact_head(h).argmax(-1)
        for got, expect in zip(batched, want, strict=True):
            torch.testing.assert_close(got[r:r + 1], expect, rtol=0, atol=1e-5 * float(expect.abs().max()))


def test_a_rows_shared_expert_gate_is_the_same_bits_alone_and_anywhere_in_a_batch():
    # torch's sigmoid over a column computes most elements in vector lanes and the last few one by one, whose last
    # bits differ for some numbers: the gate of a row must not depend on how many rows come with it
    from lmhead.models.moe import shared_gates

    g = torch.Generator().manual_seed(3)
    gate = torch.randn(1, 64, generator=g) * 0.1
    x = torch.randn(69, 64, generator=g)
    alone = torch.cat([shared_gates(x[i:i + 1], gate) for i in range(69)])
    torch.testing.assert_close(alone, torch.sigmoid(x @ gate.T), rtol=1e-6, atol=0)  # σ(x·g), transformers' op
    for n in range(2, 70):
        assert torch.equal(shared_gates(x[:n], gate), alone[:n]), n


@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_routing_is_the_same_bits_alone_and_anywhere_in_a_batch_from_one_kernel_call(threads):
    # the router's logits of a prefill's rows come from one call of the kernel's float32 product (each row summed
    # in one order whatever the rows and threads), not one F.linear a row; the shared expert's gate too
    from reference import float32_dot_bound

    from lmhead.models.coded_linear import CodedLinear
    from lmhead.models.moe import MoE

    g = torch.Generator().manual_seed(5)
    experts, d = 16, 200
    moe = MoE(router=torch.randn(experts, d, generator=g), gate_up=[torch.zeros(8, d)] * experts,
              down=[torch.zeros(d, 4)] * experts, top_k=3, renormalise=True,
              shared_gate=torch.randn(1, d, generator=g) * 0.1)
    x = torch.randn(70, d, generator=g)
    x[5] = x[4]
    calls = []
    real = CodedLinear.__call__
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = [moe.route(x[i:i + 1]) for i in range(70)]
        gates = torch.cat([moe.shared_weight(x[i:i + 1]) for i in range(70)])
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(CodedLinear, "__call__", lambda self, rows: calls.append(rows.shape[0]) or real(self, rows))
            for n in (2, 3, 17, 70):
                got = moe.route(x[:n])
                for field in ("logits", "experts", "weights"):
                    want = torch.cat([getattr(a, field) for a in alone[:n]])
                    assert torch.equal(getattr(got, field), want), (n, field)
                assert torch.equal(moe.shared_weight(x[:n]), gates[:n]), n
    finally:
        torch.set_num_threads(before)
    assert calls == [n for n in (2, 3, 17, 70) for _ in range(2)]  # one call for a batch's router, one for its gate
    want = x.double() @ moe.router.double().T
    bound = float32_dot_bound(x, moe.router)
    assert bool(((torch.cat([a.logits for a in alone]).double() - want).abs() <= bound).all())


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_the_router_chooses_as_transformers_router_on_near_ties(arch):
    from tiny_gguf import _hf_model

    from lmhead.models.lean import LeanBody

    model, _ = _hf_model(arch, seed=1)
    router = model.model.layers[0].mlp.gate
    lean = LeanBody(model)
    d = model.config.hidden_size
    # logits x·Rᵀ with x = e₀ are column 0 of R: exact ties and neighbours one float32 step apart
    col = np.full(8, 0.25, dtype=np.float32)
    col[[1, 6]] = 0.5                                    # an exact tie for first place
    col[4] = np.nextafter(np.float32(0.5), np.float32(0))  # one step below it
    col[2] = np.nextafter(np.float32(0.25), np.float32(1))
    cases = [col, col[::-1].copy(), np.where(np.arange(8) % 2 == 0, np.float32(0.125), np.nextafter(
        np.float32(0.125), np.float32(1))).astype(np.float32)]
    for c in cases:
        with torch.no_grad():
            router.weight.zero_()
            router.weight[:, 0] = torch.from_numpy(c)
        lean_moe = lean.layers[0].moe  # shares the router's weight
        x = torch.zeros(3, d)
        x[:, 0] = torch.tensor([1.0, 3.0, -2.0])
        with torch.no_grad():
            _, want_w, want_e = router(x)
        got = lean_moe.route(x)
        assert torch.equal(got.experts, want_e), (c, got.experts, want_e)
        assert torch.equal(got.weights, want_w)


def test_lmhead_generate_runs_a_moe_file_from_the_command_line(tmp_path, monkeypatch, capsys):
    from tiny_gguf import write_tiny_gguf

    from lmhead.cli import main

    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "tiny_moe.gguf", "qwen3_moe", kind="Q8_0")
    assert main(["generate", "The cat sat", "--model", str(path), "-n", "6", "--temperature", "0", "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) >= 1 and all(line.startswith("{") for line in out)


@pytest.mark.parametrize("drop,match", [
    ("blk.1.ffn_up_exps.weight", r"layer 1 has experts but no tensor blk\.1\.ffn_up_exps\.weight"),
    ("blk.0.ffn_gate_inp.weight", r"layer 0 has experts but no tensor blk\.0\.ffn_gate_inp\.weight"),
])
def test_a_moe_file_without_an_expert_tensor_is_refused_naming_it(tmp_path, monkeypatch, drop, match):
    from lmhead.models import ModelError

    with pytest.raises(ModelError, match=match):
        _load(tmp_path, monkeypatch, "qwen3_moe", "Q8_0", drop=drop)


@pytest.mark.parametrize("header,match", [
    ({"expert_count": 6}, r"tensor blk\.0\.ffn_gate_inp\.weight is 8x32; the header's qwen3moe\.expert_count \(6\)"),
    ({"expert_used_count": 9}, r"the header's qwen3moe\.expert_used_count is 9; it must be in \[1, 8\]"),
    ({"expert_used_count": 0}, r"the header's qwen3moe\.expert_used_count is 0"),
])
def test_a_moe_header_that_contradicts_its_tensors_is_refused_naming_them(tmp_path, monkeypatch, header, match):
    from lmhead.models import ModelError

    with pytest.raises(ModelError, match=match):
        _load(tmp_path, monkeypatch, "qwen3_moe", "Q8_0", moe_header=header)


def test_an_architecture_neither_lmhead_nor_transformers_runs_is_one_line_naming_it(tmp_path, monkeypatch, capsys):
    import gguf

    from lmhead.cli import main

    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(str(path), "rwkv7")
    w.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert main(["generate", "hi", "--model", str(path), "-n", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the architecture 'rwkv7' is not one lmhead runs" in err[0] and "qwen3moe" in err[0]


def test_a_moe_file_larger_than_the_memory_available_is_refused_before_it_loads(tmp_path, monkeypatch):
    from lmhead.models import ModelError, file_model

    monkeypatch.delenv("LMHEAD_IGNORE_MEMORY", raising=False)
    monkeypatch.setattr(file_model, "available_memory", lambda: 1024)
    with pytest.raises(ModelError, match=r"loading it needs about .* GiB of memory and 0\.0 GiB is available"):
        _load(tmp_path, monkeypatch, "mixtral", "Q8_0")


def test_transformers_model_of_a_qwen_moe_file_is_built_with_the_experts_widths_from_its_tensors(tmp_path,
                                                                                                 monkeypatch):
    from tiny_gguf import reference_from_gguf

    path, model = _load(tmp_path, monkeypatch, "qwen2_moe", "Q8_0")
    ids = torch.tensor([model.encode("The cat sat on the mat")])
    with torch.no_grad():  # transformers' GGUF reader left moe_intermediate_size at its default (1408)
        got, want = model.hf_model(ids).logits, reference_from_gguf(path, "qwen2_moe")(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))


def test_transformers_model_of_a_mixtral_style_llama_file_is_refused_in_one_line(tmp_path, monkeypatch):
    from lmhead.models import ModelError

    _, model = _load(tmp_path, monkeypatch, "mixtral", "Q8_0")
    with pytest.raises(ModelError, match=r"does not read a Mixtral-style llama file's experts"):
        model.hf_model  # noqa: B018


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_the_router_view_of_the_last_token_is_transformers_routing(tmp_path, monkeypatch, arch):
    from tiny_gguf import reference_from_gguf

    from lmhead.models.routing import router_choices

    path, model = _load(tmp_path, monkeypatch, arch, "Q8_0")
    ids = model.encode("The cat sat on the mat")
    choices = router_choices(model.lean, ids)
    assert [c.layer for c in choices] == [0, 1]
    ref = reference_from_gguf(path, arch)
    with torch.no_grad():
        logits = ref(torch.tensor([ids]), output_router_logits=True).router_logits
    for choice, layer in zip(choices, logits, strict=True):
        probs = torch.softmax(layer[-1].float(), dim=-1)
        weights, experts = torch.topk(probs, 2)
        if arch == "qwen3_moe":  # renormalised; Qwen2-MoE's are the probabilities themselves
            weights = weights / weights.sum()
        assert choice.experts == experts.tolist()
        torch.testing.assert_close(torch.tensor(choice.weights), weights, rtol=0, atol=1e-5)
        torch.testing.assert_close(torch.tensor(choice.probabilities), probs, rtol=0, atol=1e-5)
    assert router_choices(model.lean, ids) == choices  # nothing of the model changed by looking
    with pytest.raises(ValueError, match="ids must be a non-empty"):
        router_choices(model.lean, [])


def test_a_dense_layer_of_a_qwen3_moe_file_runs_its_own_mlp(tmp_path, monkeypatch):
    from tiny import tiny_tokenizer
    from tiny_gguf import reference_from_gguf, write_model_gguf
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from lmhead import load_model

    tokenizer = tiny_tokenizer()
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                            max_position_embeddings=256, tie_word_embeddings=True, initializer_range=0.3,
                            pad_token_id=0, eos_token_id=1, bos_token_id=2)
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path / "cache"))
    path = write_model_gguf(tmp_path / "mixed.gguf", "qwen3_moe", model, tokenizer, kind="Q8_0")
    loaded = load_model(str(path), progress=False)
    assert loaded.lean.layers[0].moe is not None and loaded.lean.layers[1].moe is None
    assert set(loaded.lean.layers[1].coded) == {"qkv", "o", "gate_up", "down"}
    ref = reference_from_gguf(path, "qwen3_moe", model=model)
    ids = torch.tensor([loaded.encode("The cat sat on the mat")])
    with torch.no_grad():
        want = ref(ids).logits
    torch.testing.assert_close(loaded.logits(ids), want, rtol=0, atol=1e-5 * float(want.abs().max()))


def test_a_file_with_the_experts_gate_and_up_fused_in_one_tensor_runs_as_the_split_one(tmp_path, monkeypatch):
    from tiny_gguf import reference_from_gguf

    path, model = _load(tmp_path, monkeypatch, "qwen3_moe", "Q8_0", fuse_gate_up=True)
    from lmhead.models.gguf_file import GGUFFile

    names = set(GGUFFile(path).tensors)
    assert "blk.0.ffn_gate_up_exps.weight" in names and "blk.0.ffn_gate_exps.weight" not in names
    ids = torch.tensor([model.encode("The cat sat on the mat")])
    with torch.no_grad():
        want = reference_from_gguf(path, "qwen3_moe")(ids).logits
    torch.testing.assert_close(model.logits(ids), want, rtol=0, atol=1e-5 * float(want.abs().max()))


def test_the_memory_check_counts_every_layers_experts_as_they_are_held(tmp_path, monkeypatch):
    from lmhead.models import ModelError, file_model
    from lmhead.models.expert_layout import expert_nbytes
    from lmhead.models.gguf_file import GGUFFile

    path, model = _load(tmp_path, monkeypatch, "qwen3_moe", "Q4_K")
    f = GGUFFile(path)
    counted = sum(expert_nbytes(f.type_of(n), *f.shape(n)) for n in f.tensors if "_exps." in n)
    held = sum(layer.moe.gate_up.nbytes + layer.moe.down.nbytes for layer in model.lean.layers)
    assert counted == held
    need = file_model.memory_needed(f)
    assert need >= held + int(f.tensors["token_embd.weight"].n_bytes)
    # a machine with one byte less than the estimate is refused before the load, one with the estimate is not
    monkeypatch.delenv("LMHEAD_IGNORE_MEMORY", raising=False)
    monkeypatch.setattr(file_model, "available_memory", lambda: need - 1)
    with pytest.raises(ModelError, match="loading it needs about"):
        file_model.check_fits(f)
    monkeypatch.setattr(file_model, "available_memory", lambda: need)
    file_model.check_fits(f)


def test_a_second_load_maps_the_experts_the_first_laid_out(tmp_path, monkeypatch):
    from lmhead import load_model
    from lmhead.models import file_experts

    path, first = _load(tmp_path, monkeypatch, "qwen3_moe", "Q4_K")
    sources = [(layer.moe.gate_up.source, layer.moe.down.source) for layer in first.lean.layers]
    assert all(s is not None and s.is_file() for pair in sources for s in pair)  # written, and mapped back
    ids = torch.tensor([first.encode("The cat sat on the mat")])
    want = first.logits(ids)
    monkeypatch.setattr(file_experts, "build_experts", lambda *a, **k: pytest.fail("the experts laid out again"))
    again = load_model(str(path), progress=False)
    assert [(layer.moe.gate_up.source, layer.moe.down.source) for layer in again.lean.layers] == sources
    assert torch.equal(again.logits(ids), want)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_a_warm_load_maps_every_page_of_the_laid_out_experts_before_the_first_token(tmp_path, monkeypatch):
    from lmhead import load_model
    from lmhead.models import layout_cache

    path, first = _load(tmp_path, monkeypatch, "qwen3_moe", "Q8_0")
    sources = {str(m.source) for layer in first.lean.layers for m in (layer.moe.gate_up, layer.moe.down)}
    del first
    gc.collect()

    def mapped() -> dict[str, tuple[int, int]]:
        """Each laid-out file this process maps: (its map's size, the part of it mapped in the page tables), kB."""
        out, name = {}, None
        for line in open("/proc/self/smaps"):
            head = line.split()
            if head and not head[0].endswith(":"):  # a map's first line: its range, ..., its file
                name = head[5] if len(head) >= 6 and head[5] in sources else None
            elif name and head[0] in ("Size:", "Rss:"):
                size, rss = out.get(name, (0, 0))
                out[name] = (size + int(head[1]), rss) if head[0] == "Size:" else (size, rss + int(head[1]))
        return out

    again = load_model(str(path), progress=False)  # the files just written: in the page cache
    maps = mapped()
    assert set(maps) == sources and all(rss == size for size, rss in maps.values())
    del again
    gc.collect()
    monkeypatch.setattr(layout_cache, "_RESIDENT", 2.0)  # as if mostly on disk: left to fault in as read
    cold = load_model(str(path), progress=False)
    assert all(rss < size for size, rss in mapped().values())
    del cold


def test_a_damaged_file_of_laid_out_experts_is_laid_out_again(tmp_path, monkeypatch):
    from tiny_gguf import reference_from_gguf

    from lmhead import load_model
    from lmhead.models.cache import fast_checksum_file

    path, first = _load(tmp_path, monkeypatch, "qwen3_moe", "Q8_0")
    damaged = first.lean.layers[0].moe.gate_up.source
    ids = torch.tensor([first.encode("The cat sat on the mat")])
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 1  # same size, one bit other
    damaged.write_bytes(bytes(data))
    again = load_model(str(path), progress=False)
    with torch.no_grad():
        want = reference_from_gguf(path, "qwen3_moe")(ids).logits
    torch.testing.assert_close(again.logits(ids), want, rtol=0, atol=1e-5 * float(want.abs().max()))
    meta = damaged.with_suffix(".json").read_text()
    assert fast_checksum_file(damaged) in meta  # rewritten


def test_a_warm_load_checks_the_laid_out_experts_by_stamp_and_samples_not_every_byte(tmp_path, monkeypatch):
    from lmhead import load_model
    from lmhead.models import layout_cache

    path, first = _load(tmp_path, monkeypatch, "qwen3_moe", "Q8_0")
    ids = torch.tensor([first.encode("The cat sat on the mat")])
    want = first.logits(ids)
    monkeypatch.setattr(layout_cache, "fast_checksum_file", lambda p: pytest.fail(f"{p} read whole"))
    again = load_model(str(path), progress=False)
    assert again.lean.layers[0].moe.gate_up.source is not None
    assert torch.equal(again.logits(ids), want)


def test_a_touched_file_of_laid_out_experts_is_checked_whole_once_then_by_its_new_stamp(tmp_path, monkeypatch):
    import json

    from lmhead import load_model
    from lmhead.models import layout_cache

    path, first = _load(tmp_path, monkeypatch, "qwen3_moe", "Q8_0")
    touched = first.lean.layers[0].moe.gate_up.source
    st = touched.stat()
    os.utime(touched, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # as a copy or a touch leaves it
    whole = []
    real = layout_cache.fast_checksum_file
    monkeypatch.setattr(layout_cache, "fast_checksum_file", lambda p: whole.append(p) or real(p))
    load_model(str(path), progress=False)
    assert whole == [touched]  # read whole once, found intact (mapped, not laid out again)
    meta = json.loads(touched.with_suffix(".json").read_text())
    assert meta["stamp"][1] == st.st_mtime_ns + 10**9
    load_model(str(path), progress=False)
    assert whole == [touched]  # the new stamp recorded: not read whole again


def test_a_damaged_window_of_laid_out_experts_with_its_stamp_kept_is_laid_out_again(tmp_path, monkeypatch):
    from lmhead import load_model
    from lmhead.models import file_experts

    path, first = _load(tmp_path, monkeypatch, "qwen3_moe", "Q8_0")
    damaged = first.lean.layers[0].moe.down.source
    ids = torch.tensor([first.encode("The cat sat on the mat")])
    want = first.logits(ids)
    st = damaged.stat()
    with open(damaged, "r+b") as f:  # the first byte, which every sample reads, changed in place
        byte = f.read(1)
        f.seek(0)
        f.write(bytes([byte[0] ^ 1]))
    os.utime(damaged, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert damaged.stat().st_ino == st.st_ino
    built = []
    real = file_experts.build_experts
    monkeypatch.setattr(file_experts, "build_experts", lambda *a, **k: built.append(1) or real(*a, **k))
    again = load_model(str(path), progress=False)
    assert built  # laid out again, not mapped as it was
    assert torch.equal(again.logits(ids), want)


def test_the_expert_cache_turned_off_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("LMHEAD_EXPERT_CACHE", "0")
    _, model = _load(tmp_path, monkeypatch, "qwen3_moe", "Q8_0")
    assert model.lean.layers[0].moe.gate_up.source is None
    assert not (tmp_path / "cache" / "layouts").exists()


def test_experts_the_disk_has_no_room_for_stay_in_memory_and_stderr_says_so_once(tmp_path, monkeypatch, capsys):
    from lmhead.models import layout_cache

    monkeypatch.setattr(layout_cache, "MARGIN", 1 << 62)  # more free disk than any disk has
    _, model = _load(tmp_path, monkeypatch, "qwen3_moe", "Q8_0")
    assert all(layer.moe.gate_up.source is None and layer.moe.down.source is None for layer in model.lean.layers)
    assert not list((tmp_path / "cache" / "layouts").rglob("*.bin*"))
    said = [line for line in capsys.readouterr().err.splitlines() if "layouts left are kept in memory" in line]
    assert len(said) == 1 and "GiB free under" in said[0]


_GREEDY = """
import sys, torch
from lmhead import load_model
model = load_model(sys.argv[1], progress=False)
lean, ids = model.lean, model.encode("The cat sat on the mat")
with torch.no_grad():
    cache = lean.new_cache(1, len(ids) + 8)
    tok = model.exact_head(lean(torch.tensor([ids]), torch.arange(len(ids))[None], cache)[:, -1:]).argmax(-1)
    out = [int(tok)]
    for step in range(7):
        tok = model.exact_head(lean(tok, torch.tensor([[len(ids) + step]]), cache)).argmax(-1)
        out.append(int(tok))
print(out)
"""


@pytest.mark.parametrize("arch,kind", [("qwen3_moe", "Q4_K"), ("qwen2_moe", "Q8_0"), ("mixtral", "Q8_0")])
def test_a_decode_step_of_the_chosen_experts_in_one_call_is_the_per_expert_calls_bits(tmp_path, monkeypatch, arch,
                                                                                       kind):
    from tiny_gguf import moe_paths

    from lmhead.kernels import experts as experts_kernel

    if not experts_kernel.available():
        pytest.skip("the experts kernel is not built")
    _, model = _load(tmp_path, monkeypatch, arch, kind)
    moe_layers = [layer for layer in model.lean.layers if layer.moe is not None]
    assert (arch == "qwen2_moe") == any(layer.moe.shared_gate_up is not None for layer in moe_layers)
    # every layer in the C step, its router (and a shared expert's gate) called back from it
    assert model.lean._step_descs() is not None
    prompts = [model.encode("The cat sat on the mat"), model.encode("Numbers: 1, 2, 3")]
    (step, layers, experts), calls = moe_paths(model, monkeypatch, prompts)
    assert [len(c) for c in calls] == [0, 4 * len(moe_layers), 0]
    for a, b, c in zip(step, layers, experts, strict=True):
        assert torch.equal(a, b) and torch.equal(b, c)


@pytest.mark.slow
def test_a_moe_file_gives_the_same_greedy_tokens_without_the_native_kernels(tmp_path):
    import os
    import subprocess
    import sys

    from tiny_gguf import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny-qwen3_moe.gguf", "qwen3_moe", kind="Q8_0")
    tokens = []
    for flag in ("1", "0"):  # the experts in one C call, and torch's ops alone
        env = {**os.environ, "LMHEAD_NATIVE": flag, "LMHEAD_EXPERT_CACHE": "0"}
        run = subprocess.run([sys.executable, "-c", _GREEDY, str(path)], env=env, capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 0, run.stderr
        tokens.append(run.stdout.strip().splitlines()[-1])
    assert tokens[0] == tokens[1] and len(eval(tokens[0])) == 8


def test_an_error_in_a_router_called_back_from_the_c_step_is_raised_as_itself(tmp_path, monkeypatch):
    from lmhead.kernels import experts as experts_kernel

    if not experts_kernel.available():
        pytest.skip("the experts kernel is not built")
    _, model = _load(tmp_path, monkeypatch, "qwen3_moe", "Q8_0")
    lean = model.lean
    assert lean._step_descs() is not None
    ids = torch.tensor([model.encode("The cat sat on the mat")])
    positions = torch.arange(ids.shape[1])[None]
    moe = lean.layers[-1].moe

    def broken(h):
        raise RuntimeError("the router broke")

    monkeypatch.setattr(moe, "route", broken)
    cache = lean.new_cache(1, ids.shape[1])
    with pytest.raises(RuntimeError, match="the router broke"):
        lean(ids, positions, cache)
    assert cache.length == 0  # the step did not count its columns
    monkeypatch.undo()
    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path / "cache"))
    want = lean(ids, positions, lean.new_cache(1, ids.shape[1]))
    assert torch.equal(lean(ids, positions, cache), want)  # the same cache, the step run again
