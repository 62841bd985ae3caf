"""The constraint's bitmask applied to logits: the pipeline's step 0, before bias, penalties, temperature and cuts.

    bits [N, ⌈V/32⌉] int32 (llguidance's layout: token t allowed iff bit t % 32 of word t // 32 is set)
    logits [N, V] ──apply_bitmask_──▶ the same logits, -inf where a row's mask forbids the token

Our own code (numpy's unpackbits, one thread, then a torch masked fill), not llguidance's torch helper, which
is `torch.compile`d. A row whose mask allows nothing is an error (RuntimeError): the matcher has failed, and
decoding on would give an unconstrained answer.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["allowed", "apply_bitmask_", "forced_token", "words"]


def words(vocab_size: int) -> int:
    """⌈V/32⌉: the int32 words of one row's bitmask."""
    return (vocab_size + 31) // 32


def forced_token(bits: np.ndarray) -> int | None:
    """The one token a row's mask bits [W] allow, or None where it allows more (or none): read from the words
    alone (the set words, then the one set bit), no pass over the vocabulary."""
    nz = np.flatnonzero(bits)
    if len(nz) != 1:
        return None
    word = int(bits[nz[0]]) & 0xFFFFFFFF
    if word & (word - 1):
        return None
    return int(nz[0]) * 32 + word.bit_length() - 1


def allowed(bits: np.ndarray, vocab_size: int) -> torch.Tensor:
    """bits [N,W] or [W] int32 → allowed [N,V] (or [V]) bool: token t of a row allowed iff its bit is set."""
    b = np.ascontiguousarray(bits, dtype=np.int32)
    flat = np.unpackbits(b.view(np.uint8), axis=-1, bitorder="little")[..., :vocab_size]
    return torch.from_numpy(flat.astype(bool, copy=False))


def apply_bitmask_(logits: torch.Tensor, bits: np.ndarray) -> torch.Tensor:
    """logits [N,V] float, bits [N,W] int32 → logits, modified in place: -inf where a token is not allowed.
    RuntimeError where a row allows no token (kept: at least one token)."""
    if logits.dim() != 2:
        raise ValueError(f"logits: expected [N,V], got shape {tuple(logits.shape)}")
    n, v = logits.shape
    if bits.shape != (n, words(v)):
        raise ValueError(f"bits: expected shape ({n}, {words(v)}) for logits of shape ({n}, {v}), got {bits.shape}")
    keep = allowed(bits, v)
    if not bool(keep.any(dim=1).all()):
        raise RuntimeError("constraint: a row's mask allows no token (the matcher failed)")
    logits.masked_fill_(~keep.to(logits.device), float("-inf"))
    return logits
