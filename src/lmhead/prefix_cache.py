"""Keys and values of prompts' blocks, reused by every prompt that begins with the same tokens (prefix caching).

    cache = PrefixCache(max_bytes=512 << 20)          # blocks of BLOCK positions
    cache.put(tokens, keys, values)   # tokens [L] a row's columns hold, keys/values [layers, H_kv, L, hd]: each
                                      # full block not yet stored is copied in (a stored one is marked used)
    found = cache.match(prompt_ids)   # (m, keys, values [layers, H_kv, m, hd]): the longest run of stored blocks
                                      # at the start of prompt_ids (m a multiple of BLOCK), or None

As vLLM's automatic prefix caching: a block is keyed by a hash of every token up to its end (`chain`), so a block
matches only where everything before it matches too, and two prompts that share a system prompt share its blocks
whatever follows. The engine stores a prompt's blocks as its prefill pieces are computed
(`decode.engine.Decoder.prefill_piece`), and a row's generated tokens' blocks when it leaves the batch (finished
or retired: a client that hung up leaves its blocks); every row that starts (lone, joining a running batch, each
row of n > 1 or of a prompt list) starts from its prompt's longest run of stored blocks and prefills the rest —
reading the stored blocks in place, shared by every row that begins with them (`models.kv_cache.SharedColumns`),
where the C attention runs, else copying them in.

A column's keys and values depend only on the tokens up to it and their positions (0, 1, ... in every row: left
padding counts no positions), so the reused columns are the ones a prefill would compute — up to float rounding
where that prefill would have run the same tokens in another split. Bounded memory: the least recently used
blocks leave first, a run's last blocks before its first (a later block is of no use without those before it).

    cache.save(path, identity)        # the blocks and what they belong to (model, file, shapes, lmhead's version)
    why = cache.load(path, identity)  # None, or why the file was refused (the store then stays empty)
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["BLOCK", "MIN_TOKENS", "PrefixCache", "copy_into"]

BLOCK = 32  # positions per block: a multiple of the kernels' row passes, a divisor of the prefill piece
MIN_TOKENS = BLOCK  # the shortest prefix reused: one block
FILE_FORMAT = "lmhead prefix cache 1"


class PrefixCache:
    """An LRU store of BLOCK-position blocks of keys and values, at most `max_bytes` in all.

    Counters: `queries` (lookups), `hits` (lookups that found a block), `query_tokens` (tokens looked up),
    `reused` (tokens found), `stored` (blocks stored), `evicted` (blocks that left for room)."""

    def __init__(self, max_bytes: int = 512 << 20, block: int = BLOCK) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an integer ≥ 0, got {max_bytes!r}")
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ValueError(f"block must be an integer ≥ 1, got {block!r}")
        self.max_bytes, self.block = max_bytes, block
        self._blocks: OrderedDict[bytes, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self.bytes = self.queries = self.hits = self.query_tokens = self.reused = self.stored = self.evicted = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def chain(self, tokens: list[int]) -> list[bytes]:
        """The key of each full block of `tokens`: a hash of every token up to the block's end."""
        ids = np.asarray(tokens, dtype=np.int64)
        keys, prev = [], b""
        for end in range(self.block, len(ids) + 1, self.block):
            prev = hashlib.blake2b(prev + ids[end - self.block:end].tobytes(), digest_size=16).digest()
            keys.append(prev)
        return keys

    def cached(self, tokens: list[int]) -> int:
        """How many of `tokens`' first tokens the stored blocks cover (no counter moves, no block is marked used)."""
        n = 0
        for key in self.chain(tokens):
            if key not in self._blocks:
                break
            n += self.block
        return n

    def put(self, tokens: list[int], keys: torch.Tensor, values: torch.Tensor, skip: int = 0) -> int:
        """Store the full blocks of `tokens` after the first `skip` blocks (their keys and values [layers, H_kv,
        ≥len(tokens) - skip·block, hd], column j holding token skip·block + j) that are not stored yet, copies; the
        run is marked used; the least recently used blocks leave while the store is over its bound. → blocks
        added."""
        chain = self.chain(tokens)
        added = 0
        for i, key in enumerate(chain[skip:]):
            if key in self._blocks:
                continue
            cols = slice(i * self.block, (i + 1) * self.block)
            k, v = _copy(keys[:, :, cols]), _copy(values[:, :, cols])
            size = _size(k, v)
            if size > self.max_bytes:
                break
            self._blocks[key] = (k, v)
            self.bytes += size
            self.stored += 1
            added += 1
        self._touch(chain)
        while self.bytes > self.max_bytes:
            _, (k, v) = self._blocks.popitem(last=False)
            self.bytes -= _size(k, v)
            self.evicted += 1
        return added

    def _touch(self, chain: list[bytes]) -> None:
        """Mark a run used: its first block becomes the most recent, so its last ones leave first."""
        for key in reversed(chain):
            if key in self._blocks:
                self._blocks.move_to_end(key)

    def match(self, ids: list[int], count: bool = True, joined: bool = True) -> tuple[int, Any, Any] | None:
        """The longest run of stored blocks at the start of `ids`: (m tokens, their keys and values [layers, H_kv,
        m, hd], a copy), the run marked used; None where the first block is not stored. count: whether the
        counters see the lookup (a request's own, not the engine's for its own work). joined=False: the keys and
        values as lists of the stored blocks' [layers, H_kv, block, hd] (read only: the engine's rows read them in
        place, or copy them into their cache once)."""
        if count:
            self.queries += 1
            self.query_tokens += len(ids)
        run = []
        for key in self.chain(ids):
            if key not in self._blocks:
                break
            run.append(key)
        if not run:
            return None
        self._touch(run)
        m = len(run) * self.block
        if count:
            self.hits += 1
            self.reused += m
        keys, values = [self._blocks[k][0] for k in run], [self._blocks[k][1] for k in run]
        return (m, torch.cat(keys, dim=2), torch.cat(values, dim=2)) if joined else (m, keys, values)


    def save(self, path: str | Path, identity: dict[str, Any]) -> None:
        """Write the blocks (least recently used first) and `identity` (what they belong to: the model, its file,
        the cache's shapes, lmhead's version) to `path`, with a digest of everything: into a temporary file
        beside it, renamed over it, so that a reader never sees half a file."""
        path = Path(path)
        keys = [k.hex() for k in self._blocks]
        ks = [kv[0] for kv in self._blocks.values()]
        vs = [kv[1] for kv in self._blocks.values()]
        data = {"format": FILE_FORMAT, "identity": identity, "block": self.block, "keys": keys, "k": ks, "v": vs,
                "digest": _digest(keys, ks, vs)}
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            torch.save(data, tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def load(self, path: str | Path, identity: dict[str, Any]) -> str | None:
        """Read the blocks `save` wrote to `path` into this (empty) store, the most recently used kept within its
        bound. → None (read, or no file yet), or why the file was refused — another model or file, another version
        of lmhead, other shapes, a damaged file —, in which case nothing of it is used."""
        try:
            data = torch.load(Path(path), weights_only=True)
        except FileNotFoundError:
            return None
        except Exception as exc:  # a damaged file is any error its reader meets: refused, never used
            return f"damaged or not a prefix cache file ({type(exc).__name__})"
        if not isinstance(data, dict) or data.get("format") != FILE_FORMAT:
            return "not a prefix cache file of this version of lmhead"
        theirs = data.get("identity")
        if theirs != identity:
            differ = sorted(k for k in {**identity, **(theirs or {})} if (theirs or {}).get(k) != identity.get(k))
            return f"written for another {', '.join(differ)}"
        keys, ks, vs = data.get("keys"), data.get("k"), data.get("v")
        if (data.get("block") != self.block or not isinstance(keys, list) or not isinstance(ks, list)
                or not isinstance(vs, list) or not len(keys) == len(ks) == len(vs)
                or data.get("digest") != _digest(keys, ks, vs)
                or any(k.shape != ks[0].shape or v.shape != ks[0].shape for k, v in zip(ks, vs, strict=True))):
            return "damaged (its digest or its blocks' shapes do not match)"
        self._blocks.clear()
        self.bytes = 0
        for key, k, v in zip(reversed(keys), reversed(ks), reversed(vs), strict=True):  # the most recent first
            if self.bytes + _size(k, v) > self.max_bytes:
                break
            self._blocks[bytes.fromhex(key)] = (k, v)
            self._blocks.move_to_end(bytes.fromhex(key), last=False)
            self.bytes += _size(k, v)
        return None


_NUMPY = (torch.float32, torch.float16, torch.float64)  # the cache types numpy copies


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[...] = src for the blocks' strided copies (many small runs): by numpy, in this thread, where torch's
    copy hands the runs to its thread pool, whose handshake on a busy machine costs more than the copy."""
    if dst.dtype in _NUMPY and dst.device.type == "cpu" and src.device.type == "cpu" and dst.dtype == src.dtype:
        dst.numpy()[...] = src.numpy()
    else:
        dst.copy_(src)


def _copy(src: torch.Tensor) -> torch.Tensor:
    out = torch.empty(src.shape, dtype=src.dtype, device=src.device)
    copy_into(out, src)
    return out


def _digest(keys: list[str], ks: list[torch.Tensor], vs: list[torch.Tensor]) -> str:
    """A hash of a saved store's keys and every block's bytes."""
    h = hashlib.blake2b(digest_size=16)
    for key, k, v in zip(keys, ks, vs, strict=True):
        h.update(key.encode())
        h.update(k.contiguous().view(torch.uint8).numpy().tobytes())
        h.update(v.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _size(keys: torch.Tensor, values: torch.Tensor) -> int:
    return keys.numel() * keys.element_size() + values.numel() * values.element_size()
