"""Tiny random models written as GGUF files, the way llama.cpp's converter lays them out, for the file loader's tests.

    path = write_tiny_gguf(tmp_path / "m.gguf", "llama", kind="Q8_0")    # or "gemma3", "qwen2", "qwen3"

The weights are tests/tiny.py's tiny model (width 32, 2 layers); matrices are stored as `kind` (gguf-py's own
quantiser: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), norms and biases as F32. Layout as llama.cpp writes it:
Llama's q/k rows permuted for its rope, Gemma's norms as 1 + w. The tokenizer is tiny.py's byte-level BPE as a
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
          "input_layernorm": "attn_norm"}
_GEMMA_NORMS = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}


def _hf_model(arch: str, seed: int):
    from tiny import tiny_config, tiny_tokenizer
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config

    tokenizer = tiny_tokenizer()
    if arch in ("llama", "gemma3"):
        config = tiny_config(arch, len(tokenizer))
    else:
        common = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
                      tie_word_embeddings=True, initializer_range=0.3, pad_token_id=0, eos_token_id=1,
                      bos_token_id=2)
        if arch == "qwen3":  # transformers reads no head_dim from a qwen3 file: its default, 128
            common["head_dim"] = 128
        config = Qwen2Config(**common) if arch == "qwen2" else Qwen3Config(**common)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name or name.endswith(".bias"):
                    param.add_(0.5 * torch.randn_like(param))
    return model.eval(), tokenizer


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order (the inverse of transformers' reverse permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, arch: str = "llama", kind: str = "Q8_0", seed: int = 0, drop: str | None = None
                    ) -> Path:
    """Write tiny.py's `arch` model to `path` as a GGUF file with its matrices in `kind` (without the tensor `drop`:
    an incomplete file); returns the path."""
    import gguf
    from gguf.quants import quantize

    model, tokenizer = _hf_model(arch, seed)
    cfg = model.config
    gemma = arch == "gemma3"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    theta = (cfg.rope_parameters or {}).get("rope_theta") if not gemma else \
        cfg.rope_parameters["full_attention"]["rope_theta"]
    w.add_rope_freq_base(float(theta or 10000.0))
    if arch == "llama":
        w.add_rope_dimension_count(cfg.head_dim)
    if gemma:
        w.add_sliding_window(cfg.sliding_window)
    vocab = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    tokens = sorted(vocab["vocab"], key=vocab["vocab"].get)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    special = {"<pad>", "<eos>", "<bos>", "<unk>"}
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in vocab["merges"]])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    qtype = gguf.GGMLQuantizationType[kind]
    for name, t in model.state_dict().items():
        a = t.detach().float().numpy()
        if name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        elif name == "lm_head.weight":
            continue  # tied
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
            if arch == "llama" and gg in ("attn_q", "attn_k"):
                a = _permute(a, cfg.num_attention_heads if gg == "attn_q" else cfg.num_key_value_heads)
        if out == drop:
            continue
        if gemma and "norm" in out:
            a = a + 1
        if a.ndim == 2 and out != "output_norm.weight":
            w.add_tensor(out, quantize(np.ascontiguousarray(a), qtype), raw_dtype=qtype)
        else:
            w.add_tensor(out, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
