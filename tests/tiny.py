"""Tiny random language models and a tiny tokenizer, built in memory for unit tests (no files, no hub).

    from tiny import tiny_model, tiny_tokenizer
    hf_model, tokenizer = tiny_model("llama")          # or "gemma3" (Gemma 3 text body), seed=..., softcap=...

The tokenizer is a byte-level BPE (GPT-2 style, spaces shown as "Ġ" in its vocabulary) trained on a few
sentences, with `<pad>`=0, `<eos>`=1, `<bos>`=2 (Gemma's ids) and `<unk>`=3; it prepends `<bos>` to every
encoding, as Llama's and Gemma's tokenizers do. Any text encodes (byte-level: no unknown tokens).

The models are 2-layer transformers in float32, eval mode, with a vocabulary the size of the tokenizer's
(~300). Weights are drawn with a larger `initializer_range` than a real model's so that the next-token
distribution is peaked enough for top-k/top-p/min-p cuts to matter (a 0.02 init gives near-uniform logits).
Norm weights are random too (not the identity), so that normalising twice changes the result.
Same `seed` -> same weights.
"""

from __future__ import annotations

import functools

import torch

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>"]

CORPUS = [
    "The cat sat on the mat.",
    "The dog sat on the log.",
    "A cat and a dog are friends.",
    "The quick brown fox jumps over the lazy dog.",
    "Language models predict the next token.",
    "The head turns hidden states into logits over the vocabulary.",
    "Temperature, top-k, top-p and min-p shape the distribution.",
    "Hello world!\nThis is a new line.\n\nAnd another one.",
    "Numbers: 1 2 3 4 5 6 7 8 9 10 100 1000.",
    "Perplexity is the exponential of the mean loss.",
]


@functools.cache
def _tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    bos = tok.token_to_id("<bos>")
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", bos)]
    )
    return tok.to_str()


def tiny_tokenizer(vocab_size: int = 320):
    """A byte-level BPE tokenizer (transformers' PreTrainedTokenizerFast) that prepends `<bos>`."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json(vocab_size)),
        bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
    )
    return tok


def tiny_config(arch: str = "llama", vocab_size: int = 320, softcap: float | None = None,
                tie: bool = True, layers: int = 2, init: float = 0.3):
    """A transformers config for a 2-layer, width-32 model. arch: "llama" or "gemma3"."""
    from transformers import Gemma3TextConfig, LlamaConfig

    common = dict(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
        tie_word_embeddings=tie, initializer_range=init, pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )
    if arch == "llama":
        if softcap is not None:
            raise ValueError("softcap: only the gemma3 tiny model supports a final logit softcap")
        return LlamaConfig(**common)
    if arch == "gemma3":
        return Gemma3TextConfig(
            **common, sliding_window=8, query_pre_attn_scalar=16, final_logit_softcapping=softcap,
            layer_types=["sliding_attention", "full_attention"] * (layers // 2) + ["full_attention"] * (layers % 2),
        )
    raise ValueError(f"arch must be 'llama' or 'gemma3', got {arch!r}")


def tiny_model(arch: str = "llama", seed: int = 0, vocab_size: int = 320, softcap: float | None = None,
               tie: bool = True, layers: int = 2, init: float = 0.3):
    """(hf_model, tokenizer): a tiny random causal LM (float32, eval mode) and its tokenizer."""
    from transformers import AutoModelForCausalLM

    tokenizer = tiny_tokenizer(vocab_size)
    config = tiny_config(arch, len(tokenizer), softcap=softcap, tie=tie, layers=layers, init=init)
    with torch.random.fork_rng(devices=[]):  # same seed -> same weights, without touching the global RNG
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        # Norm weights start at the identity (1, or 0 for Gemma's 1+w): then norm(norm(h)) == norm(h) and a
        # double-normalisation bug would go unseen. Random norm weights make it visible.
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.add_(0.5 * torch.randn_like(param))
    model.eval()
    return model, tokenizer


def tiny_head(hf_model):
    """lmhead's LMHead on the model's own head weight (shared), with its final softcap if it has one."""
    from lmhead.head import LMHead

    out = hf_model.get_output_embeddings()
    softcap = getattr(hf_model.config, "final_logit_softcapping", None)
    return LMHead.from_weight(out.weight, bias=getattr(out, "bias", None), softcap=softcap or None)


def save_tiny(folder, arch: str = "llama", **kwargs):
    """Write a tiny model + tokenizer as an HF model folder (config, safetensors, tokenizer) for CLI tests."""
    model, tokenizer = tiny_model(arch, **kwargs)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
