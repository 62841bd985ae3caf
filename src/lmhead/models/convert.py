"""GGUF -> a cached Hugging Face folder (config + safetensors + tokenizer), done once per model.

transformers dequantizes the GGUF into an fp32 model and rebuilds the tokenizer from the GGUF's vocabulary
(for Gemma's 262,144 tokens this takes minutes). It refuses `save_pretrained` on a GGUF-loaded model, so the
state dict is written here with safetensors, each shared (tied) tensor once; loading the folder back with
`from_pretrained` re-ties the head to the embedding from `config.tie_word_embeddings`.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from lmhead.models.errors import ModelError


def check_gguf(path: Path) -> dict[str, object]:
    """Parse a GGUF file's header and tensor table; a truncated or corrupt file raises ModelError.

    Returns {"architecture", "tensors", "size"}. Every tensor's data must lie inside the file.
    """
    from lmhead.models.gguf_file import read_header

    try:
        arch, tensors, size = read_header(Path(path))
    except OSError as exc:
        raise ModelError(f"cannot read GGUF file {path}: {exc}") from exc
    return {"architecture": arch, "tensors": len(tensors), "size": size}


class Steps:
    """A coarse progress display on stderr: `[i/n] label ... 12.3 s` (transformers adds its own tqdm bar)."""

    def __init__(self, total: int, title: str, stream=None) -> None:
        self.total, self.i, self.stream = total, 0, stream or sys.stderr
        self.t0 = self.t = time.perf_counter()
        self._print(title)

    def _print(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()

    def step(self, label: str) -> None:
        self._done()
        self.i += 1
        self.t = time.perf_counter()
        self._print(f"  [{self.i}/{self.total}] {label} ...")

    def _done(self) -> None:
        if self.i:
            self._print(f"        done in {time.perf_counter() - self.t:.1f} s")

    def finish(self) -> float:
        self._done()
        elapsed = time.perf_counter() - self.t0
        self._print(f"  converted in {elapsed:.1f} s")
        return elapsed


# Chat models end a turn with these tokens; their own HF generation configs list them as end-of-sequence ids
# (Gemma 3: [1, 106]), but a GGUF file records only one eos id.
END_OF_TURN_TOKENS = ("<end_of_turn>", "<|eot_id|>", "<|im_end|>")


def eos_ids(value: int | list[int] | None, tokenizer) -> list[int] | int | None:
    """A generation config's eos_token_id (`value`) with the tokenizer's end-of-turn tokens added."""
    ids = [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]
    vocab = tokenizer.get_vocab()
    ids += [vocab[t] for t in END_OF_TURN_TOKENS if t in vocab and vocab[t] not in ids]
    return ids[0] if len(ids) == 1 else ids or None


def save_state_dict(model, path: Path) -> None:
    """Write the model's state dict as safetensors, each shared storage (a tied head) only once."""
    from safetensors.torch import save_file

    seen: dict[tuple[int, int, tuple[int, ...]], str] = {}
    tensors = {}
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in seen:  # tied: transformers re-ties it on load from config.tie_word_embeddings
            continue
        seen[key] = name
        tensors[name] = tensor.detach().contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})


def convert_gguf(gguf: Path, out: Path, steps: Steps, config=None) -> dict[str, object]:
    """Convert `gguf` into an HF folder at `out` (which exists and is empty). Returns facts for the manifest.
    `config`: the model's config where transformers' reading of the file's header leaves something out (a
    mixture of experts' widths: `loading.moe_hf_config`); None: transformers' own."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    steps.step("reading the tokenizer from the GGUF")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as exc:
        raise ModelError(f"transformers could not read the tokenizer of {gguf}: {type(exc).__name__}: {exc}") \
            from exc
    steps.step("de-quantizing the weights to float32")
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                                                     **({} if config is None else {"config": config}))
    except Exception as exc:
        raise ModelError(f"transformers could not load the weights of {gguf}: {type(exc).__name__}: {exc}") \
            from exc
    steps.step("writing safetensors, config and tokenizer")
    # The weights are plain float32 now: without this, loading the folder would attach a GGUF quantizer.
    if getattr(model.config, "quantization_config", None) is not None:
        delattr(model.config, "quantization_config")
    model.config.save_pretrained(out)
    if model.generation_config is not None:
        model.generation_config.eos_token_id = eos_ids(model.generation_config.eos_token_id, tokenizer)
        model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    save_state_dict(model, out / "model.safetensors")
    return {"model_class": type(model).__name__, "parameters": sum(p.numel() for p in model.parameters())}
