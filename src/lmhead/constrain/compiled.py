"""A constraint compiled for one tokenizer: llguidance's tokenizer view, the checked grammar, a ready matcher.

    constraint ──grammar()──▶ llguidance grammar (str) ──LLMatcher(tokenizer, grammar, limits)──▶ template
    each row: template.deep_copy()  (no recompile: a row's matcher starts where the template stands, at the start)

Compilation is bounded: the grammar's text by `MAX_CONSTRAINT_CHARS`, its size and the lexer's work by
llguidance's parser limits (`LIMITS`: the grammar's symbols, the regex analysis' fuel, the lexer's states and the
work of one mask), so a request cannot hold the process; an error, or a feature llguidance does not support, is a
`ConstraintError` naming it. Compiled constraints are cached per (constraint, tokenizer): constraints are
hashable and immutable, the cache is bounded (`CACHE_SIZE`).
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from dataclasses import dataclass, field

from lmhead.constrain.constraints import Constraint, ConstraintError
from lmhead.models.start_tokenizer import transformers_tokenizer

__all__ = ["CACHE_SIZE", "Compiled", "compile_constraint", "guidance_tokenizer", "limits"]

CACHE_SIZE = 256


@functools.cache
def limits():
    """llguidance's parser limits for every compile and mask (its defaults, but for the grammar size and the
    lexer states, lowered so that one schema's compile stays within a fraction of a second)."""
    from llguidance import LLParserLimits

    return LLParserLimits(max_grammar_size=200_000, max_lexer_states=100_000, initial_lexer_fuel=1_000_000,
                          step_lexer_fuel=200_000, step_max_items=50_000, verbose_errors=False)


_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.Lock()


@dataclass(frozen=True, eq=False)
class _Tokenizer:
    """llguidance's view of one transformers tokenizer at vocabulary size `vocab_size`, with `eos` (the
    model's end-of-sequence ids: the grammar allows them only where it may stop)."""

    llg: object
    vocab_size: int
    eos: tuple[int, ...]
    key: int = field(default=0)


def guidance_tokenizer(tokenizer, vocab_size: int, eos: tuple[int, ...]) -> _Tokenizer:
    """llguidance's tokenizer for a transformers fast tokenizer (built once per tokenizer object, vocabulary
    size and eos ids: ~1 s for a 262k vocabulary)."""
    import llguidance.hf

    tokenizer = transformers_tokenizer(tokenizer)  # llguidance reads transformers' own
    with _lock:
        per = _tokenizers.setdefault(tokenizer, {})
        got = per.get((vocab_size, eos))
        if got is None:
            try:
                llg = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos) or None)
            except ValueError as exc:  # a slow (Python) tokenizer: llguidance reads fast ones only
                raise ConstraintError(f"constraint: this model's tokenizer cannot be read by llguidance ({exc})"
                                      ) from None
            got = per[(vocab_size, eos)] = _Tokenizer(llg, vocab_size, eos, key=id(llg))
        return got


@dataclass(frozen=True, eq=False)
class Compiled:
    """A constraint compiled for a tokenizer: `matcher()` gives a row its own `Matcher`. seconds: the compile's
    wall time; warnings: llguidance's (features it accepted loosely)."""

    constraint: Constraint
    tokenizer: _Tokenizer
    template: object
    seconds: float
    warnings: tuple[str, ...] = ()

    def matcher(self):
        from lmhead.constrain.matcher import Matcher

        return Matcher(self.template.deep_copy(), self.tokenizer.vocab_size, self.tokenizer.eos)


def compile_constraint(constraint: Constraint, tokenizer, vocab_size: int, eos: tuple[int, ...] = ()) -> Compiled:
    """`constraint` compiled for `tokenizer` (a transformers fast tokenizer) over `vocab_size` logits, `eos` the
    model's end-of-sequence ids. ConstraintError (naming what fails) for a grammar that does not compile or uses
    a feature llguidance does not support, TypeError for something that is not a Constraint. Cached."""
    if not isinstance(constraint, Constraint):
        raise TypeError(f"constraint: expected an lmhead constraint (JSONSchema, JSONObject, Regex, Choice, "
                        f"Grammar), got {type(constraint).__name__}")
    tok = guidance_tokenizer(tokenizer, int(vocab_size), tuple(int(e) for e in eos))
    return _compile(constraint, tok)


@functools.lru_cache(maxsize=CACHE_SIZE)
def _compile(constraint: Constraint, tok: _Tokenizer) -> Compiled:
    from llguidance import LLMatcher

    t0 = time.perf_counter()
    try:
        grammar = constraint.grammar()
    except ValueError as exc:  # llguidance refuses text that is not JSON (schemas are checked before)
        raise ConstraintError(f"{constraint.kind}: {exc}") from None
    matcher = LLMatcher(tok.llg, grammar, log_level=0, limits=limits())
    if matcher.is_error():
        raise ConstraintError(f"{constraint.kind}: {_reason(matcher.get_error())}")
    return Compiled(constraint, tok, matcher, time.perf_counter() - t0, tuple(matcher.get_grammar_warnings()))


def _reason(message: str) -> str:
    """llguidance's error, on one line, said as what the caller can change."""
    text = " ".join(message.split())
    if "Unimplemented keys" in text or "not supported" in text or "Unknown format" in text:
        return f"uses a feature llguidance does not support: {text}"
    if "limit" in text.lower() or "fuel" in text.lower():
        return f"too large or too complex to compile within the limits: {text}"
    return f"does not compile: {text}"
