"""Tiny random models written as GGUF files, the way llama.cpp's converter lays them out, for the file loader's tests.

    path = write_tiny_gguf(tmp_path / "m.gguf", "llama", kind="Q8_0")    # or gemma2, gemma3, phi3, qwen2, qwen3

The weights are tests/tiny.py's tiny model (width 32, 2 layers); matrices are stored as `kind` (gguf-py's own
quantiser: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1; Q2_K, Q3_K, IQ4_NL and IQ4_XS, which
it has no quantiser for, by a plain one here), norms and biases as F32. Layout as llama.cpp writes it:
Llama's q/k rows permuted for its rope, Gemma's norms as 1 + w, Phi-3's q/k/v as one matrix (attn_qkv) and gate/up
as one (ffn_up, gate first), its output matrix untied. The tokenizer is tiny.py's byte-level BPE as a
"gpt2" GGUF tokenizer (tokens, types, merges). transformers reads these files (`from_pretrained(gguf_file=)`):
it is the reference the tests hold lmhead's loader against.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "input_layernorm": "attn_norm", "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
_GEMMA_NORMS = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}




def _affine_k(g: np.ndarray, top: int, scale_top: int):
    """A K-quant's d·sc·q − dmin·m over groups g [blocks, groups, weights]: q in [0, top], the integer sub-scales
    sc and m in [0, scale_top] of the float16 d and dmin. Returns (d, dmin, sc, m, q)."""
    lo = np.minimum(g.min(2), 0)
    dl, ml = (g.max(2) - lo) / top, -lo
    d = (dl.max(1) / scale_top).astype(np.float16).astype(np.float32)
    dmin = (ml.max(1) / scale_top).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(dl / np.where(d == 0, 1, d)[:, None]), 0, scale_top).astype(np.uint8)
    m = np.clip(np.rint(ml / np.where(dmin == 0, 1, dmin)[:, None]), 0, scale_top).astype(np.uint8)
    step = d[:, None] * sc
    q = np.clip(np.rint((g + (dmin[:, None] * m)[..., None]) / np.where(step == 0, 1, step)[..., None]), 0, top)
    return d, dmin, sc, m, q

def add_tokenizer(w, tokenizer, pre: str) -> None:
    """tiny.py's byte-level BPE as a "gpt2" GGUF tokenizer with pre-tokenizer `pre`: tokens, types, merges, ids."""
    vocab = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    tokens = sorted(vocab["vocab"], key=vocab["vocab"].get)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    special = {"<pad>", "<eos>", "<bos>", "<unk>"}
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in vocab["merges"]])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_pad_token_id(0)


def assert_matches_reference(model, ref, ids, want) -> None:
    """A loaded lmhead model against its reference `ref` (transformers, `want` = ref(ids).logits): the whole prompt
    and one position at a time (the decode-sized products) within 1e-5 of the logits' scale, and 10 greedy tokens
    equal to ref.generate()'s."""
    import torch

    from lmhead import SamplingConfig

    scale = float(want.abs().max())
    torch.testing.assert_close(model.logits(ids), want, rtol=0, atol=1e-5 * scale)
    cache = model.lean.new_cache(1, ids.shape[1])
    steps = torch.cat([model.exact_head(model.lean(ids[:, t:t + 1], torch.tensor([[t]]), cache))[0]
                       for t in range(ids.shape[1])])
    torch.testing.assert_close(steps, want[0], rtol=0, atol=1e-5 * scale)
    greedy = [s.token_id for s in model.generate("The cat sat", max_new_tokens=10,
                                                 config=SamplingConfig(temperature=0))]
    start = torch.tensor([model.encode("The cat sat")])
    expect = ref.generate(start, max_new_tokens=10, do_sample=False, eos_token_id=None)[0, start.shape[1]:].tolist()
    assert greedy == expect[:len(greedy)] and len(greedy) >= 1

def prefill_then_decode(model, prompts: list[list[int]], steps: int = 3) -> list[torch.Tensor]:
    """The lean body's hidden states for `prompts` left-padded into one batch: the whole prefill [B,T,D], then
    `steps` greedy decode steps [B,1,D] — every row choosing its own experts, several tokens a row in the prefill."""
    lean = model.lean
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    positions = torch.arange(width).expand(len(prompts), width)
    cache = lean.new_cache(len(prompts), width + steps + 1)
    with torch.no_grad():
        hs = [lean(ids, positions, cache)]
        for step in range(steps):
            hs.append(lean(model.exact_head(hs[-1][:, -1:]).argmax(-1), positions[:, -1:] + step + 1, cache))
    return hs


def moe_paths(model, monkeypatch, prompts: list[list[int]]) -> tuple[list[list[torch.Tensor]], list[list[int]]]:
    """`prefill_then_decode` three ways: the whole C step (where it takes the layers), layer by layer with each
    layer's experts in one call, and one call per expert and product → (each way's hidden states, the activation
    codes of the experts kernel's calls from Python each way made)."""
    from lmhead.models import moe as moe_module
    from lmhead.models.lean import LeanBody

    calls: list[int] = []
    real_mlp = moe_module.experts_kernel.mlp
    monkeypatch.setattr(moe_module.experts_kernel, "mlp", lambda *a: calls.append(a[5]) or real_mlp(*a))
    states, made = [], []
    for way in ("step", "layers", "experts"):
        if way == "layers":
            monkeypatch.setattr(LeanBody, "_in_step", staticmethod(lambda layer: False))
            model.lean._descs = None
        if way == "experts":
            monkeypatch.setattr(moe_module.experts_kernel, "available", lambda: False)
        calls.clear()
        states.append(prefill_then_decode(model, prompts))
        made.append(list(calls))
    return states, made


def _hf_model(arch: str, seed: int, width: int = 32):
    from tiny import tiny_config, tiny_tokenizer
    from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig, Phi3Config, Qwen2Config, Qwen3Config

    tokenizer = tiny_tokenizer()
    if width != 32 and arch not in MOE_ARCHS:  # rows of whole 256-weight blocks (the K-quants and IQ4_XS): a wider
        if arch != "llama":                      # llama (or mixture of experts)
            raise ValueError(f"width {width}: only the llama and the MoE tiny models come wider")
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=width, intermediate_size=2 * width,
                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                             head_dim=width // 2, max_position_embeddings=256, tie_word_embeddings=True,
                             initializer_range=0.3 * (32 / width) ** 0.5, pad_token_id=0, eos_token_id=1,
                             bos_token_id=2)
    elif arch in ("llama", "gemma3"):
        config = tiny_config(arch, len(tokenizer))
    else:
        common = dict(vocab_size=len(tokenizer), hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=width // 2, max_position_embeddings=256,
                      tie_word_embeddings=True, initializer_range=0.3 * (32 / width) ** 0.5, pad_token_id=0,
                      eos_token_id=1, bos_token_id=2)
        if arch == "qwen3":  # transformers reads no head_dim from a qwen3 file: its default, 128
            common["head_dim"] = 128
        if arch == "gemma2":
            # the fields transformers' GGUF reader takes from a gemma2 file; the softcaps and the query scalar
            # are Gemma2Config's defaults (50, 30, 256) whatever the file says, as in the reference model
            config = Gemma2Config(**common, sliding_window=8)
        elif arch == "phi3":  # its head_dim is hidden_size / heads (the reader takes none from the file)
            common.pop("head_dim")
            config = Phi3Config(**{**common, "tie_word_embeddings": False})
        elif arch in ("qwen2", "qwen3"):
            config = Qwen2Config(**common) if arch == "qwen2" else Qwen3Config(**common)
        elif arch in MOE_ARCHS:
            config = _moe_config(arch, common)
        else:
            raise ValueError(f"no tiny {arch} model")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name or name.endswith(".bias"):
                    param.add_(0.5 * torch.randn_like(param))
    return model.eval(), tokenizer


MOE_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral")  # the mixtures of experts: 8 experts, 2 a token
_MOE_FILE_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}  # general.architecture


def _moe_config(arch: str, common: dict):
    """A tiny mixture of experts: 8 experts as wide as the model (Mixtral's intermediate_size), 2 chosen a token;
    Qwen2-MoE with a shared expert twice as wide; Qwen3-MoE renormalising the top 2, Qwen2-MoE not (their GGUF
    rules). Widths are whole blocks of the file's type (32, or 256 for the K-quants)."""
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    width = common["hidden_size"]
    common = {**common, "num_experts_per_tok": 2}
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(**common, moe_intermediate_size=width, num_experts=8, norm_topk_prob=True)
    if arch == "qwen2_moe":
        common.pop("head_dim")
        return Qwen2MoeConfig(**common, moe_intermediate_size=width, shared_expert_intermediate_size=2 * width,
                              num_experts=8, norm_topk_prob=False)
    common.pop("head_dim")
    return MixtralConfig(**{**common, "intermediate_size": width}, num_local_experts=8)


def _moe_tensors(name: str, a: np.ndarray, moe_ffn: int, fuse: bool = False) -> list[tuple[str, np.ndarray]]:
    """A transformers MoE tensor as llama.cpp's converter writes it: the experts' [E, 2F, D] gate_up split into
    ffn_gate_exps and ffn_up_exps [E, F, D], down [E, D, F] as ffn_down_exps, the router as ffn_gate_inp, the
    shared expert's as ffn_*_shexp and its gate as ffn_gate_inp_shexp (GGUF lists the dims reversed); `fuse`:
    gate_up as one ffn_gate_up_exps [E, 2F, D] (the converter's --fuse-gate-up-exps)."""
    parts = name.split(".")
    p = f"blk.{parts[2]}."
    module = ".".join(parts[3:-1]) if parts[-1] in ("weight", "bias") else ".".join(parts[3:])
    if module == "mlp.experts.gate_up_proj":
        if fuse:
            return [(p + "ffn_gate_up_exps.weight", a)]
        return [(p + "ffn_gate_exps.weight", a[:, :moe_ffn]), (p + "ffn_up_exps.weight", a[:, moe_ffn:])]
    if module == "mlp.experts.down_proj":
        return [(p + "ffn_down_exps.weight", a)]
    shared = {"mlp.gate": "ffn_gate_inp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
              "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
              "mlp.shared_expert.down_proj": "ffn_down_shexp",
              # a dense layer of a mixture of experts (Qwen's mlp_only_layers)
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    return [(p + shared[module] + "." + parts[-1], a)]


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order (the inverse of transformers' reverse permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _f16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _nearest(x: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """The index of the level nearest each x (levels ascending, along the last axis of x's broadcast)."""
    return np.abs(x[..., None] - levels).argmin(-1)


def _pack2(q: np.ndarray) -> np.ndarray:
    """2-bit values [nb, 256] → the 64 bytes of Q2_K/Q3_K: weight 128·h + 32·j + i in bits 2·j of byte 32·h + i."""
    q = q.astype(np.uint8).reshape(-1, 2, 4, 32)
    return (q[:, :, 0] | q[:, :, 1] << 2 | q[:, :, 2] << 4 | q[:, :, 3] << 6).reshape(-1, 64)


def _pack4(q: np.ndarray) -> np.ndarray:
    """4-bit indices [nb, 32·r] → bytes [nb, 16·r]: each 32 as 16 bytes, the first 16 in the low nibbles."""
    q = q.astype(np.uint8).reshape(q.shape[0], -1, 2, 16)
    return (q[:, :, 0] | q[:, :, 1] << 4).reshape(q.shape[0], -1)


_IQ4 = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)


def _six_bit_scales(gs: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """Group scales gs [nb, g] as d [nb] (float16) · (ls − 32), ls in [0, 63]: (d as float32, ls)."""
    d = (np.abs(gs).max(1) / top).astype(np.float16).astype(np.float32)
    safe = np.where(d == 0, 1, d)
    return d, np.clip(np.rint(gs / safe[:, None]) + 32, 0, 63).astype(np.uint8)


def _blocks(a: np.ndarray, kind: str) -> np.ndarray:
    """A float32 matrix as blocks of a type gguf-py has no quantiser for (close to `a`, not llama.cpp's choice
    of codes: only the dequantisation of what is written has to be exact)."""
    n, k = a.shape
    if kind == "IQ4_NL":
        x = a.reshape(-1, 32)
        d = (np.abs(x).max(1) / 127).astype(np.float16).astype(np.float32)
        q = _nearest(x / np.where(d == 0, 1, d)[:, None], _IQ4)
        return np.concatenate([_f16(d), _pack4(q)], 1).reshape(n, -1)
    x = a.reshape(-1, 256)
    nb = x.shape[0]
    if kind == "IQ4_XS":
        g = x.reshape(nb, 8, 32)
        d, ls = _six_bit_scales(np.abs(g).max(2) / 127, 31)
        dl = d[:, None] * (ls.astype(np.float32) - 32)
        q = _nearest(g / np.where(dl == 0, 1, dl)[..., None], _IQ4)
        high = (((ls >> 4).astype(np.uint16) << (2 * np.arange(8)).astype(np.uint16)).sum(1)).astype(np.uint16)
        low = (ls[:, 0::2] & 15) | ((ls[:, 1::2] & 15) << 4)
        return np.concatenate([_f16(d), high.reshape(-1, 1).view(np.uint8), low, _pack4(q.reshape(nb, 256))],
                              1).reshape(n, -1)
    g = x.reshape(nb, 16, 16)
    if kind == "Q3_K":
        d, sc = _six_bit_scales(np.abs(g).max(2) / 4, 31)
        dl = d[:, None] * (sc.astype(np.float32) - 32)
        q = np.clip(np.rint(g / np.where(dl == 0, 1, dl)[..., None]), -4, 3).astype(np.int8).reshape(nb, 256)
        hbit = (q >= 0).astype(np.uint8).reshape(nb, 8, 32)           # set: the code is the low bits as they are
        hmask = (hbit << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1).astype(np.uint8)
        low = (sc[:, :8] & 15) | ((sc[:, 8:] & 15) << 4)            # scale j: byte j % 8, nibble j // 8
        top = (sc >> 4).reshape(nb, 4, 4)                             # scale j: byte 8 + j % 4, bits 2·(j // 4)
        high = top[:, 0] | top[:, 1] << 2 | top[:, 2] << 4 | top[:, 3] << 6
        return np.concatenate([hmask, _pack2(np.where(q >= 0, q, q + 4)), low, high, _f16(d)], 1).reshape(n, -1)
    if kind == "Q2_K":
        d, dmin, sc, m, q = _affine_k(g, 3, 15)
        return np.concatenate([sc | (m << 4), _pack2(q.reshape(nb, 256)), _f16(d), _f16(dmin)], 1).reshape(n, -1)
    if kind == "Q4_K":  # d·sc·q − dmin·m per 32, sc and m 6-bit, q 4-bit
        g = x.reshape(nb, 8, 32)
        d, dmin, sc, m, q = _affine_k(g, 15, 63)
        packed = np.zeros((nb, 12), dtype=np.uint8)  # llama.cpp's get_scale_min_k4, written
        packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
        packed[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
        packed[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
        q = q.astype(np.uint8).reshape(nb, 4, 2, 32)                  # per 64: low nibbles 32, high nibbles 32
        qs = (q[:, :, 0] | q[:, :, 1] << 4).reshape(nb, 128)
        return np.concatenate([_f16(d), _f16(dmin), packed, qs], 1).reshape(n, -1)
    raise ValueError(f"no writer for GGUF type {kind}")


_OWN_WRITER = ("Q2_K", "Q3_K", "Q4_K", "IQ4_NL", "IQ4_XS")  # types gguf-py's `quantize` does not write


def write_tiny_gguf(path: Path, arch: str = "llama", kind: str = "Q8_0", seed: int = 0, drop: str | None = None,
                    rope_factors: bool = False, moe_header: dict | None = None, fuse_gate_up: bool = False,
                    types: dict[str, str] | None = None) -> Path:
    """Write tiny.py's `arch` model to `path` as a GGUF file with its matrices in `kind` (without the tensor `drop`:
    an incomplete file; `rope_factors`: with the long/short rope factor tensors llama.cpp writes for a longrope
    Phi-3; `moe_header`: expert_count / expert_used_count written instead of the model's — a header that
    contradicts the tensors; `fuse_gate_up`: the experts' gate and up as one tensor; `types`: another type for the
    layers' matrices of these names, as llama.cpp's mixes keep some — {"attn_v": "Q8_0"}); returns the path. Types of
    256-weight blocks (Q2_K, Q3_K, Q4_K, IQ4_XS) get a wider llama or mixture of experts (width 256), whose rows
    are whole blocks. `arch` may also be a mixture of experts
    (`MOE_ARCHS`: experts stacked [E, F, D] per layer, as llama.cpp's converter writes them)."""
    import gguf
    from gguf.constants import GGML_QUANT_SIZES

    qtype = gguf.GGMLQuantizationType[kind]
    model, tokenizer = _hf_model(arch, seed, width=256 if GGML_QUANT_SIZES[qtype][0] == 256 else 32)
    write_model_gguf(path, arch, model, tokenizer, kind, drop=drop, rope_factors=rope_factors,
                     moe_header=moe_header, fuse_gate_up=fuse_gate_up, types=types)
    return Path(path)


def write_model_gguf(path: Path, arch: str, model, tokenizer, kind: str = "Q8_0", drop: str | None = None,
                     rope_factors: bool = False, moe_header: dict | None = None, fuse_gate_up: bool = False,
                     types: dict[str, str] | None = None) -> Path:
    """Write a transformers model of tiny.py's `arch` family (with `tokenizer`, tiny.py's) to `path` as
    `write_tiny_gguf` does; returns the path."""
    import gguf
    from gguf.quants import quantize

    qtype = gguf.GGMLQuantizationType[kind]
    cfg = model.config
    gemma = arch in ("gemma2", "gemma3")
    w = gguf.GGUFWriter(str(path), _MOE_FILE_ARCH.get(arch, arch))
    w.add_name(f"tiny-{arch}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    theta = (cfg.rope_parameters or {}).get("rope_theta") if arch != "gemma3" else \
        cfg.rope_parameters["full_attention"]["rope_theta"]
    w.add_rope_freq_base(float(theta or 10000.0))
    if arch in ("llama", "phi3", "mixtral"):
        w.add_rope_dimension_count(head_dim)
    moe_ffn = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    if arch in MOE_ARCHS:  # as llama.cpp's converter writes them
        header = {"expert_count": getattr(cfg, "num_experts", None) or cfg.num_local_experts,
                  "expert_used_count": cfg.num_experts_per_tok, **(moe_header or {})}
        w.add_expert_count(header["expert_count"])
        w.add_expert_used_count(header["expert_used_count"])
        if arch != "mixtral":
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if arch == "qwen2_moe":
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if gemma:
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":  # as llama.cpp's converter writes them (transformers' reader takes neither)
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    add_tokenizer(w, tokenizer, "default")
    w.add_add_bos_token(True)
    for name, t in model.state_dict().items():
        a = t.detach().float().numpy()
        if name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        elif name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            out = "output.weight"
        elif ".mlp." in name and arch in MOE_ARCHS:
            for out, part in _moe_tensors(name, a, moe_ffn, fuse_gate_up):
                if out == drop:
                    continue
                part = np.ascontiguousarray(part)
                if "gate_inp" not in out:  # the experts', the shared expert's and a dense layer's matrices
                    w.add_tensor(out, _blocks(part.reshape(-1, part.shape[-1]), kind).reshape(*part.shape[:-1], -1)
                                 if kind in _OWN_WRITER else quantize(part, qtype), raw_dtype=qtype)
                else:  # the routers: float32, as llama.cpp keeps them; the shared expert's gate [D] (as
                    part = part.astype(np.float32)  # transformers' GGUF reader expects it)
                    w.add_tensor(out, part.squeeze(0) if "shexp" in out else part)
            continue
        else:
            parts = name.split(".")  # model.layers.{i}.{module...}.{weight|bias}
            module = ".".join(parts[3:-1])
            suffix = parts[-1]
            if module == "post_attention_layernorm" and not gemma:
                gg = "ffn_norm"
            elif gemma and module in _GEMMA_NORMS:
                gg = _GEMMA_NORMS[module]
            else:
                gg = _NAMES[module]
            out = f"blk.{parts[2]}.{gg}.{suffix}"
            if arch in ("llama", "mixtral") and gg in ("attn_q", "attn_k"):
                a = _permute(a, cfg.num_attention_heads if gg == "attn_q" else cfg.num_key_value_heads)
        if out == drop:
            continue
        if gemma and "norm" in out:
            a = a + 1
        if a.ndim == 2 and out != "output_norm.weight":
            a = np.ascontiguousarray(a)
            mine = (types or {}).get(out.split(".")[-2], kind) if out.startswith("blk.") else kind
            mine_q = gguf.GGMLQuantizationType[mine]
            w.add_tensor(out, _blocks(a, mine) if mine in _OWN_WRITER else quantize(a, mine_q), raw_dtype=mine_q)
        else:
            w.add_tensor(out, np.ascontiguousarray(a, dtype=np.float32))
    if rope_factors:
        half = (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads) // 2
        for which, value in (("long", 4.0), ("short", 1.5)):
            w.add_tensor(f"rope_factors_{which}.weight", np.full(half, value, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """transformers' reverse of llama.cpp's q/k row order (`_permute`'s inverse)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def reference_from_gguf(path: Path, arch: str, seed: int = 0, model=None):
    """The transformers model of tiny `arch` (its config) holding the file's own numbers: every tensor of `path`
    dequantized by gguf-py and put back under transformers' name (the experts' gate and up stacked into
    gate_up_proj, llama's q/k rows un-permuted) — the reference for families whose files transformers' GGUF
    reader does not load whole. `model`: the transformers model to fill (default: tiny `arch`'s). Nothing of
    lmhead's is used."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    file = {t.name: np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(
        tuple(int(d) for d in reversed(t.shape))) for t in reader.tensors}
    width = next(int(t.shape[0]) for t in reader.tensors if t.name == "token_embd.weight")
    if model is None:
        model, _ = _hf_model(arch, seed, width=width)
    cfg = model.config
    moe_ffn = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    state = {}
    for name, t in model.state_dict().items():
        if name == "model.embed_tokens.weight":
            a = file["token_embd.weight"]
        elif name == "model.norm.weight":
            a = file["output_norm.weight"]
        elif name == "lm_head.weight":
            a = file.get("output.weight", file["token_embd.weight"])
        elif ".mlp." in name and arch in MOE_ARCHS:
            fused = any(n.endswith("ffn_gate_up_exps.weight") for n in file)
            got = [file[out] for out, _ in _moe_tensors(name, t.numpy(), moe_ffn, fused)]
            a = np.concatenate(got, axis=1) if len(got) == 2 else got[0]
        else:
            parts = name.split(".")
            module = ".".join(parts[3:-1])
            gg = "ffn_norm" if module == "post_attention_layernorm" else _NAMES[module]
            a = file[f"blk.{parts[2]}.{gg}.{parts[-1]}"]
            if arch in ("llama", "mixtral") and gg in ("attn_q", "attn_k"):
                a = _unpermute(a, cfg.num_attention_heads if gg == "attn_q" else cfg.num_key_value_heads)
        state[name] = torch.from_numpy(np.array(a, dtype=np.float32).reshape(t.shape))
    model.load_state_dict(state)
    return model.eval()


# --- gpt-oss ----------------------------------------------------------------------------------------------------

def tiny_gpt_oss(seed: int = 0, layers: int = 2):
    """A tiny random gpt-oss (transformers' GptOssForCausalLM, eager attention) and tiny.py's tokenizer: width 64
    (rows of whole 64-weight pairs of blocks: MXFP4's codes packed two to a byte, as a real file's), 8 experts of
    64, 2 a token, sliding (window 4) and full layers alternating, gpt-oss's YaRN rope, random
    biases, sinks and norms."""
    from tiny import tiny_tokenizer
    from transformers import AutoModelForCausalLM, GptOssConfig

    tokenizer = tiny_tokenizer()
    config = GptOssConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=64, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
                          num_experts_per_tok=2, sliding_window=4, max_position_embeddings=256,
                          rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                           "truncate": False, "original_max_position_embeddings": 8,
                                           "rope_theta": 150000.0},
                          tie_word_embeddings=False, initializer_range=0.3 * (32 / 64) ** 0.5, pad_token_id=0,
                          eos_token_id=1,
                          bos_token_id=2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name or "bias" in name or "sinks" in name:
                    param.copy_(0.5 * torch.randn_like(param) + (1.0 if "norm" in name else 0.0))
    return model.eval(), tokenizer


def _gpt_oss_tensors(name: str, a: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """A transformers GptOss tensor as llama.cpp's converter (conversion/gpt_oss.py) writes it: the experts'
    interleaved gate_up_proj [E, D, 2F] transposed and split (even columns gate, odd up) into ffn_gate_exps and
    ffn_up_exps [E, F, D] with their biases [E, F]; down_proj [E, F, D] as ffn_down_exps [E, D, F]; the router as
    ffn_gate_inp (weight and bias); sinks as attn_sinks.weight; post_attention_layernorm as post_attention_norm."""
    if name == "model.embed_tokens.weight":
        return [("token_embd.weight", a)]
    if name == "model.norm.weight":
        return [("output_norm.weight", a)]
    if name == "lm_head.weight":
        return [("output.weight", a)]
    parts = name.split(".")
    p = f"blk.{parts[2]}."
    module = ".".join(parts[3:])
    if module == "mlp.experts.gate_up_proj":
        t = a.swapaxes(1, 2)
        return [(p + "ffn_gate_exps.weight", t[:, ::2]), (p + "ffn_up_exps.weight", t[:, 1::2])]
    if module == "mlp.experts.gate_up_proj_bias":
        return [(p + "ffn_gate_exps.bias", a[:, ::2]), (p + "ffn_up_exps.bias", a[:, 1::2])]
    if module == "mlp.experts.down_proj":
        return [(p + "ffn_down_exps.weight", a.swapaxes(1, 2))]
    if module == "mlp.experts.down_proj_bias":
        return [(p + "ffn_down_exps.bias", a)]
    names = {"mlp.router.weight": "ffn_gate_inp.weight", "mlp.router.bias": "ffn_gate_inp.bias",
             "self_attn.sinks": "attn_sinks.weight", "input_layernorm.weight": "attn_norm.weight",
             "post_attention_layernorm.weight": "post_attention_norm.weight"}
    if module in names:
        return [(p + names[module], a)]
    gg, suffix = _NAMES[".".join(parts[3:-1])], parts[-1]
    return [(f"{p}{gg}.{suffix}", a)]


def write_tiny_gpt_oss(path: Path, kind: str = "MXFP4", seed: int = 0, model=None, tokenizer=None,
                       attention_kind: str = "F32", template: str | None = None, drop: str | None = None) -> Path:
    """Write a tiny gpt-oss (`tiny_gpt_oss`, or `model` with `tokenizer`) as llama.cpp's converter lays it out:
    the experts' matrices in `kind` (F32, Q8_0, MXFP4: gguf-py's quantisers), attention's and the head's in
    `attention_kind`, norms, biases, sinks and routers F32; the header's gpt-oss keys (sliding window, experts,
    YaRN rope) and a "gpt-4o" pre-tokenizer; `template`: a chat template in the file; `drop`: a tensor left out.
    Returns the path."""
    import gguf
    from gguf.quants import quantize

    if model is None:
        model, tokenizer = tiny_gpt_oss(seed)
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    w.add_name("tiny-gpt-oss")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    w.add_expert_count(cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_sliding_window(cfg.sliding_window)
    w.add_expert_feed_forward_length(cfg.intermediate_size)
    add_tokenizer(w, tokenizer, "gpt-4o")
    if template is not None:
        w.add_chat_template(template)
    for name, t in model.state_dict().items():
        for out, a in _gpt_oss_tensors(name, t.detach().float().numpy()):
            if out == drop:
                continue
            a = np.ascontiguousarray(a, dtype=np.float32)
            matrix = out.endswith(".weight") and a.ndim >= 2 and "gate_inp" not in out
            qtype = gguf.GGMLQuantizationType[kind if "_exps" in out else attention_kind]
            if matrix and qtype != gguf.GGMLQuantizationType.F32:
                w.add_tensor(out, quantize(a, qtype), raw_dtype=qtype)
            else:
                w.add_tensor(out, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def gpt_oss_reference(path: Path, model):
    """`model` (a transformers GptOss) holding `path`'s numbers: every tensor dequantized by gguf-py and put back
    under transformers' name (gate and up interleaved into gate_up_proj again) — the reference; nothing of
    lmhead's is used."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    file = {t.name: np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(
        tuple(int(d) for d in reversed(t.shape))) for t in reader.tensors}
    state = {}
    for name, t in model.state_dict().items():
        got = [file[out] for out, _ in _gpt_oss_tensors(name, t.numpy())]
        if name.endswith("gate_up_proj"):
            a = np.empty((got[0].shape[0], got[0].shape[1] * 2, got[0].shape[2]), dtype=np.float32)
            a[:, ::2], a[:, 1::2] = got
            a = a.swapaxes(1, 2)
        elif name.endswith("gate_up_proj_bias"):
            a = np.empty((got[0].shape[0], got[0].shape[1] * 2), dtype=np.float32)
            a[:, ::2], a[:, 1::2] = got
        elif name.endswith("down_proj"):
            a = got[0].swapaxes(1, 2)
        else:
            a = got[0]
        state[name] = torch.from_numpy(np.array(a, dtype=np.float32).reshape(t.shape))
    model.load_state_dict(state)
    return model.eval()
