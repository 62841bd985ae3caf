"""Keys and values of recent rows' tokens, reused by a prompt that begins with the same tokens (prefix caching).

    cache = PrefixCache(max_bytes=512 << 20)
    cache.put(tokens, keys, values)        # tokens [L] a row fed, keys/values [layers, H_kv, L, hd] (copies kept)
    found = cache.match(prompt_ids)        # (m, keys, values): the m first columns of the entry sharing the
                                           # longest common prefix with prompt_ids (m ≥ MIN_TOKENS), or None

A chat's next turn begins with the previous turn's prompt and (mostly) its answer, so its prefill feeds only
the tokens after the common prefix: `decode.engine.Decoder.begin(..., prefix=...)` copies the m columns in first.
A column's keys and values depend only on the tokens up to it and their positions (0, 1, ... in every row:
left padding counts no positions), so the reused columns are the ones a prefill would compute — up to float
rounding where that prefill would have run the same tokens in another split. Bounded memory: the least recently
used entries leave first.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

MIN_TOKENS = 16  # a shorter common prefix is not worth the copy


class PrefixCache:
    """An LRU store of token prefixes' keys and values, at most `max_bytes` in all. Counters: `hits`,
    `reused` (columns reused in all), `stored`."""

    def __init__(self, max_bytes: int = 512 << 20, max_entries: int = 64) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an integer ≥ 0, got {max_bytes!r}")
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self._entries: OrderedDict[tuple[int, ...], tuple[np.ndarray, torch.Tensor, torch.Tensor]] = OrderedDict()
        self.bytes = self.hits = self.reused = self.stored = self.query_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def _size(keys: torch.Tensor, values: torch.Tensor) -> int:
        return keys.numel() * keys.element_size() + values.numel() * values.element_size()

    def put(self, tokens: list[int], keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store the columns of `tokens` (keys, values [layers, H_kv, L, hd]); an entry another one begins with
        is replaced by the longer one; the least recently used leave while the store is over its bounds."""
        key = tuple(tokens)
        if len(key) < MIN_TOKENS or self._size(keys, values) > self.max_bytes:
            return
        for old in [k for k in self._entries if len(k) <= len(key) and key[:len(k)] == k]:
            self._drop(old)
        self._entries[key] = (np.asarray(key, dtype=np.int64), keys.clone(), values.clone())
        self.bytes += self._size(keys, values)
        self.stored += 1
        while self._entries and (self.bytes > self.max_bytes or len(self._entries) > self.max_entries):
            self._drop(next(iter(self._entries)))

    def _drop(self, key: tuple[int, ...]) -> None:
        _, k, v = self._entries.pop(key)
        self.bytes -= self._size(k, v)

    def match(self, ids: list[int]) -> tuple[int, torch.Tensor, torch.Tensor] | None:
        """The entry sharing the longest common prefix with `ids` (at least MIN_TOKENS): (m, its keys and values,
        all its columns — the first m are the ones to reuse), marked recently used; None if there is none."""
        want = np.asarray(ids, dtype=np.int64)
        self.query_tokens += len(want)
        best, best_m = None, MIN_TOKENS - 1
        for key, (arr, _, _) in self._entries.items():
            n = min(len(arr), len(want))
            differ = np.flatnonzero(arr[:n] != want[:n])
            m = int(differ[0]) if differ.size else n
            if m > best_m:
                best, best_m = key, m
        if best is None:
            return None
        self._entries.move_to_end(best)
        _, keys, values = self._entries[best]
        self.hits += 1
        self.reused += best_m
        return best_m, keys, values
