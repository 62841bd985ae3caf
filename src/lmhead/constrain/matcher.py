"""One row's place in its grammar: the mask of the next token, tokens consumed, drafts tried and rolled back.

    mask ──bits()──▶ [⌈V/32⌉] int32         the tokens the grammar allows next (EOS only where it may stop)
    consume(t)                               the row emitted t
    draft(d_1..d_k) ──▶ bits [m+1, W], m     drafts taken in order while each is allowed (and the grammar has not
                                             stopped): the masks before each of them and after the last
    settle(emitted, m)                       the round emitted accepted drafts + one token: roll back the drafts
                                             it rejected, consume that token → how many emitted tokens count
                                             (the ones up to where the grammar stopped)

`stopped`: the grammar is complete and takes nothing more (the row ends with finish_reason "stop"); `accepting`:
it may end here (EOS is allowed). A token the mask forbade reaching `consume` is an error of the caller
(RuntimeError): the decode loop only chooses allowed tokens.
"""

from __future__ import annotations

import time

import numpy as np

from lmhead.constrain.mask import words

__all__ = ["Matcher"]


class Matcher:
    """A row's llguidance matcher over `vocab_size` logits (made by `Compiled.matcher()`). `seconds`: set it to a
    list and each mask computed appends its wall time (benchmarks/bench_structured.py); None costs nothing."""

    def __init__(self, llm, vocab_size: int, eos: tuple[int, ...]) -> None:
        self._m, self.vocab_size, self.eos = llm, vocab_size, eos
        self.width = words(vocab_size)
        self.seconds: list[float] | None = None

    @property
    def stopped(self) -> bool:
        """The grammar is complete: no token but EOS may follow (the row stops)."""
        return self._m.is_stopped()

    @property
    def accepting(self) -> bool:
        """The text so far is a complete match (the grammar may stop here)."""
        return self._m.is_accepting()

    def _fill(self, out: np.ndarray) -> None:
        t0 = time.perf_counter() if self.seconds is not None else 0.0
        self._m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        if self.seconds is not None:
            self.seconds.append(time.perf_counter() - t0)
        if self._m.is_error():
            raise RuntimeError(f"constraint: the matcher failed: {self._m.get_error()}")

    def bits(self) -> np.ndarray:
        """The next token's mask [W] int32 (a new array)."""
        out = np.zeros(self.width, dtype=np.int32)
        self._fill(out)
        return out

    def allows(self, bits: np.ndarray, token: int) -> bool:
        return 0 <= token < self.vocab_size and bool((int(bits[token >> 5]) >> (token & 31)) & 1)

    def consume(self, token: int) -> None:
        """The row emitted `token` (allowed by the current mask)."""
        if not self._m.consume_token(int(token)):
            raise RuntimeError(f"constraint: token {token} is not allowed here ({self._m.get_error()})")

    def advance(self, ids) -> None:
        """Consume `ids`, an answer begun before this matcher was made (the explainer's steps, one request each):
        ValueError naming the constraint where one of them is not allowed there."""
        for i, t in enumerate(ids):
            if self.stopped or not self.allows(self.bits(), int(t)):
                raise ValueError(f"constraint: the answer so far does not match it (token {i}, id {int(t)}, is not "
                                 f"allowed there)")
            self.consume(int(t))

    def forced(self) -> list[int]:
        """The tokens the grammar allows as the only continuation from here (may be [])."""
        return list(self._m.compute_ff_tokens())

    def rollback(self, n: int) -> None:
        if n > 0 and not self._m.rollback(n):
            raise RuntimeError(f"constraint: cannot roll back {n} tokens ({self._m.get_error()})")

    def draft(self, drafts: list[int]) -> tuple[np.ndarray, int]:
        """Take `drafts` in order while each is allowed and the grammar goes on → (bits [m+1, W]: the mask before
        each taken draft and after the last, m: the drafts taken — consumed; `settle` rolls back the rejected)."""
        out = np.zeros((len(drafts) + 1, self.width), dtype=np.int32)
        self._fill(out[0])
        m = 0
        for d in drafts:
            if self.stopped or not self.allows(out[m], d):
                break
            self.consume(d)
            m += 1
            self._fill(out[m])
        return out[:m + 1], m

    def settle(self, emitted: list[int], taken: int) -> int:
        """After a round: `emitted` = the accepted drafts + one token, `taken` = the drafts `draft` consumed. Roll
        back the rejected ones, consume the last token unless the grammar stopped before it → how many of
        `emitted` the row keeps."""
        accepted = len(emitted) - 1
        self.rollback(taken - accepted)
        if accepted and self.stopped:  # complete after the accepted drafts: the token after them is not text
            return accepted
        self.consume(emitted[-1])
        return len(emitted)
