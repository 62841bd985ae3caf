"""The kernels' 4-bit and four-row layouts of code rows: `pack4` / `unpack4` (two codes a byte, in the lanes the
kernels shift them into) and `block4` / `unblock4` (four rows interleaved 32-byte unit by unit); a level table's
codes as the indices its nibbles hold (`LEVEL_TABLES`, `level_indices`)."""

from __future__ import annotations

import numpy as np
import torch

from lmhead.kernels.abi import IQ4, LEVELS, MXFP4

# the level tables a packed nibble indexes (abi.LEVELS, the header's), int8 in index order, by their layouts' names
LEVEL_TABLES: dict[str, np.ndarray] = {"iq4": np.array(LEVELS[IQ4], dtype=np.int8),
                                       "mxfp4": np.array(LEVELS[MXFP4], dtype=np.int8)}


def _index_of(levels: np.ndarray) -> np.ndarray:
    """A level table's index of each int8 value (as a byte; the first of equal levels), 255 for a value that is
    not one of them."""
    index = np.full(256, 255, dtype=np.uint8)
    index[levels[::-1].view(np.uint8)] = np.arange(15, -1, -1, dtype=np.uint8)
    return index


_INDEX = {name: _index_of(levels) for name, levels in LEVEL_TABLES.items()}


def level_indices(codes: np.ndarray, four_bit: str) -> np.ndarray:
    """int8 codes (any shape) → their indices in the level table `four_bit` (uint8); ValueError for a code that is
    none of its levels (packed, it would be another number)."""
    index = _INDEX[four_bit][np.ascontiguousarray(codes).view(np.uint8)]
    if index.size and int(index.max()) == 255:
        raise ValueError(f"four_bit={four_bit!r}: the codes hold values that are not its levels")
    return index


def pack4(codes: torch.Tensor, signed: bool = False) -> torch.Tensor:
    """Unsigned 4-bit codes [N,K] (groups of 32, K a multiple of 64) → [N,K/2] int8, the kernel's packed layout:
    each 64 codes are 32 bytes read as eight little-endian uint32 lanes, nibble i of lane l holding code 8·i + l
    XOR 8 — code − 8 as a signed nibble (so that two shifts put eight consecutive codes − 8, or one shift and one
    mask after an XOR the codes, in the eight lanes of a vector). `signed`: codes in [-8, 7] (the SIGNED4 layout),
    each nibble the code itself as a signed 4-bit number — the unsigned layout of code + 8."""
    n, k = codes.shape
    if signed:
        codes = codes + 8
    c = codes.view(n, k // 64, 4, 2, 8).to(torch.uint8) ^ 8    # [.., byte b, low/high nibble, lane l]
    return (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).transpose(2, 3).reshape(n, k // 2).view(torch.int8)


def block4(rows: torch.Tensor) -> torch.Tensor:
    """Code rows [N,R] (N a multiple of 4, R of 32 bytes: int8 codes or `pack4`'s) → the kernel's ROWS4 layout,
    same shape: each block of four rows stored 32-byte unit by unit (unit u of its rows 0..3 side by side)."""
    n, r = rows.shape
    return rows.reshape(n // 4, 4, r // 32, 32).transpose(1, 2).reshape(n, r).contiguous()


def unblock4(blocked: torch.Tensor) -> torch.Tensor:
    """The inverse of `block4`."""
    n, r = blocked.shape
    return blocked.reshape(n // 4, r // 32, 4, 32).transpose(1, 2).reshape(n, r).contiguous()


def unpack4(packed: torch.Tensor, signed: bool = False) -> torch.Tensor:
    """The inverse of `pack4`: [N,K/2] → int8 codes [N,K]."""
    n, half = packed.shape
    b = packed.view(torch.uint8).view(n, half // 32, 8, 4).transpose(2, 3)   # [.., byte b, lane l]
    codes = (torch.stack([b & 15, b >> 4], dim=3).reshape(n, half * 2) ^ 8).to(torch.int8)
    return codes - 8 if signed else codes
