"""Parameter and memory calculators: how big the LM head is, against the rest of the model.

`count_parameters` gives an ordered breakdown — token embedding, positions, attention, MLP, norms, LM head —
for the two families the series explains:

* ``gpt2``: learned positions, LayerNorm (weight + bias), attention with a fused QKV projection, GELU MLP
  (``ffn`` = 4·width by default). ``bias=False`` removes the biases of the linear layers *and* of the
  LayerNorms, as nanoGPT's ``bias`` flag does.
* ``llama``: rotary positions (no parameters), RMSNorm (weight only), grouped-query attention with
  ``kv_heads`` key/value heads, SwiGLU MLP (gate, up, down) of width ``ffn``, no biases.

A tied head shares the token embedding's ``[V, D]`` matrix and adds no parameters; an untied one adds V·D.

`module_parameters` counts a loaded transformers model's actual parameters into the same components, by the
names of its modules.

Memory: the logits tensor is ``B·T·V`` elements (``B=8, T=2048, V=32000`` in float32 ≈ 2.1 GB), the head's
weight ``V·D``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

DTYPE_BYTES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "tf32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8": 1,
    "int8": 1,
}
_DTYPE_ALIASES = {"fp64": "float64", "fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16",
                  "float": "float32", "double": "float64", "fp8": "float8"}

COMPONENTS = ("token_embedding", "positions", "attention", "mlp", "norms", "lm_head")


@dataclass(frozen=True)
class ParameterCount:
    """An ordered breakdown of a model's parameters. Each component and ``total`` is a plain int field."""

    arch: str
    token_embedding: int
    positions: int
    attention: int
    mlp: int
    norms: int
    lm_head: int
    tied: bool

    @property
    def total(self) -> int:
        return sum(getattr(self, name) for name in COMPONENTS)

    @property
    def head_share(self) -> float:
        """Share of the parameters the head *uses* (its own, or the tied embedding it shares)."""
        used = self.token_embedding if self.tied else self.lm_head
        return used / self.total

    def components(self) -> list[tuple[str, int, float]]:
        """``[(name, count, share of total), ...]`` in the order the data flows."""
        total = self.total
        return [(name, getattr(self, name), getattr(self, name) / total) for name in COMPONENTS]

    def to_dict(self) -> dict:
        out = asdict(self)
        out["total"] = self.total
        out["shares"] = {name: share for name, _, share in self.components()}
        out["head_share"] = self.head_share
        return out


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value}")
    return value


def count_parameters(
    vocab: int = 50257,
    context: int = 1024,
    width: int = 768,
    layers: int = 12,
    *,
    arch: str = "gpt2",
    heads: int | None = None,
    kv_heads: int | None = None,
    ffn: int | None = None,
    tied: bool = True,
    bias: bool = True,
) -> ParameterCount:
    """Count the parameters of a GPT-2- or Llama-style decoder, by component.

    GPT-2 small (``count_parameters()``) is 124,439,808; with ``bias=False`` 124,337,664. Llama 3 8B is
    ``count_parameters(128256, 8192, 4096, 32, arch="llama", heads=32, kv_heads=8, ffn=14336, tied=False)``
    = 8,030,261,248. ``context`` only matters for ``gpt2`` (learned positions).
    """
    vocab = _positive_int("vocab", vocab)
    context = _positive_int("context", context)
    width = _positive_int("width", width)
    layers = _positive_int("layers", layers)
    if arch not in ("gpt2", "llama"):
        raise ValueError(f"arch must be 'gpt2' or 'llama', got {arch!r}")
    heads = _positive_int("heads", heads) if heads is not None else max(1, width // 64)
    if width % heads:
        raise ValueError(f"width ({width}) must be divisible by heads ({heads})")
    kv_heads = _positive_int("kv_heads", kv_heads) if kv_heads is not None else heads
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    head_dim = width // heads
    kv_dim = kv_heads * head_dim
    d = width

    if arch == "gpt2":
        if kv_heads != heads:
            raise ValueError("kv_heads applies to arch='llama' only (GPT-2 has one K/V head per query head)")
        ffn = _positive_int("ffn", ffn) if ffn is not None else 4 * d
        b = 1 if bias else 0
        positions = context * d
        attention = layers * ((d * 3 * d + b * 3 * d) + (d * d + b * d))  # fused QKV + output projection
        mlp = layers * ((d * ffn + b * ffn) + (ffn * d + b * d))
        norms = (2 * layers + 1) * d * (1 + b)  # ln_1, ln_2 per block + ln_f; weight (+ bias)
    else:
        ffn = _positive_int("ffn", ffn) if ffn is not None else 256 * math.ceil(8 * d / 3 / 256)
        positions = 0  # rotary embeddings have no parameters
        attention = layers * (d * d + 2 * d * kv_dim + d * d)  # q, k, v (GQA), o
        mlp = layers * 3 * d * ffn  # gate, up, down
        norms = (2 * layers + 1) * d  # RMSNorm weight only
    token_embedding = vocab * d
    lm_head = 0 if tied else vocab * d
    return ParameterCount(arch, token_embedding, positions, attention, mlp, norms, lm_head, tied)


_COMPONENT_RULES = (  # (component, substrings of a parameter's name), first match wins
    ("norms", ("norm", "ln_")),
    ("token_embedding", ("embed_tokens", "wte", "word_embeddings")),
    ("positions", ("embed_positions", "wpe", "position_embeddings")),
    ("lm_head", ("lm_head",)),
    ("attention", ("attn", "attention")),
    ("mlp", ("mlp", "feed_forward")),
)


def module_parameters(hf_model: Any, name: str) -> dict[str, Any]:
    """A loaded transformers model's actual parameter counts by component (from its modules' names), in
    ``ParameterCount.to_dict()``'s shape plus ``name`` and ``other`` (parameters no rule matched).

    A tied head shares the embedding's Parameter (named_parameters lists it once), so ``lm_head`` is 0 and the
    head's share is the embedding's — the matrix it multiplies by at every step.
    """
    counts = dict.fromkeys((*COMPONENTS, "other"), 0)
    for pname, param in hf_model.named_parameters():
        for component, keys in _COMPONENT_RULES:
            if any(k in pname for k in keys):
                counts[component] += param.numel()
                break
        else:
            counts["other"] += param.numel()
    total = sum(counts.values())
    out_emb, in_emb = hf_model.get_output_embeddings(), hf_model.get_input_embeddings()
    tied = out_emb is not None and in_emb is not None and out_emb.weight is in_emb.weight
    used = counts["token_embedding"] if tied else counts["lm_head"]
    return {"name": name, "arch": getattr(hf_model.config, "model_type", None), **counts, "tied": tied,
            "total": total, "shares": {k: v / total for k, v in counts.items()}, "head_share": used / total}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes of one tensor: ``elements × bytes per element``."""

    what: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int

    @property
    def human(self) -> str:
        return human_bytes(self.bytes)

    def to_dict(self) -> dict:
        return {"what": self.what, "shape": list(self.shape), "dtype": self.dtype, "bytes": self.bytes,
                "human": self.human}


def _dtype_bytes(dtype: str) -> tuple[str, int]:
    name = str(dtype).removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    return name, DTYPE_BYTES[name]


def logits_memory(batch: int, seq: int, vocab: int, dtype: str = "float32") -> MemoryEstimate:
    """Memory of the logits tensor ``[B, T, V]``. B=8, T=2048, V=32000 in float32 is 2,097,152,000 B ≈ 2.1 GB.

    Training needs as much again for its gradient; this is what fused linear cross-entropy avoids.
    """
    batch, seq, vocab = (_positive_int(n, v) for n, v in (("batch", batch), ("seq", seq), ("vocab", vocab)))
    name, size = _dtype_bytes(dtype)
    return MemoryEstimate("logits", (batch, seq, vocab), name, batch * seq * vocab * size)


def head_memory(vocab: int, width: int, dtype: str = "float32") -> MemoryEstimate:
    """Memory of the LM head's weight ``[V, D]`` — read in full at every decoded token."""
    vocab, width = _positive_int("vocab", vocab), _positive_int("width", width)
    name, size = _dtype_bytes(dtype)
    return MemoryEstimate("head weight", (vocab, width), name, vocab * width * size)


def human_bytes(n: int) -> str:
    """Decimal units, as memory is usually quoted for tensors (2,097,152,000 B → '2.10 GB')."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"
