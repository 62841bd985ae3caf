"""Structured output: constraints compiled with llguidance, a matcher per row, the bitmask applied first.

    constraint (JSONSchema | JSONObject | Regex | Choice | Grammar)   what the caller asks for (immutable, hashable)
      ──compile_constraint(constraint, tokenizer, V, eos)──▶ Compiled  once per (constraint, tokenizer), bounded
      ──.matcher()──▶ Matcher                                         one per row: its place in the grammar
    each decode position: Matcher.bits() [⌈V/32⌉] ──apply_bitmask_──▶ logits [N,V] with -inf where forbidden,
      before the sampling pipeline (bias, penalties, temperature, cuts), so every processed distribution, draw and
      logprob is the constrained one; EOS is allowed only where the grammar may stop, and a grammar that is
      complete stops the row (finish_reason "stop").

`for_rows` turns a `generate` call's `constraint` argument (one constraint, None, or one per prompt) into the
rows' matchers. Errors: `ConstraintError` (a ValueError) names what cannot be compiled or is not supported.
"""

from __future__ import annotations

from lmhead.constrain.compiled import Compiled, compile_constraint, guidance_tokenizer
from lmhead.constrain.constraints import (
    Choice,
    Constraint,
    ConstraintError,
    Grammar,
    JSONObject,
    JSONSchema,
    Regex,
)
from lmhead.constrain.mask import allowed, apply_bitmask_, forced_token
from lmhead.constrain.matcher import Matcher

__all__ = ["Choice", "Compiled", "Constraint", "ConstraintError", "Grammar", "JSONObject", "JSONSchema", "Matcher",
           "Regex", "allowed", "apply_bitmask_", "compile_constraint", "for_rows", "forced_token",
           "guidance_tokenizer", "split_answer"]


def split_answer(tokenizer, prompt: str, start: int) -> tuple[list[int], int]:
    """`prompt`'s ids with its constrained answer (the text from character `start` on) tokenized on its own, and
    where in them the answer begins. Apart because tokenizing the whole text would merge the answer's first
    characters with the prompt's last (" " + "m" → " m"): the answer's tokens would not be the ones a decode
    emitted after the prompt, and the boundary would fall inside a token."""
    if not isinstance(start, int) or isinstance(start, bool) or not 0 <= start <= len(prompt):
        raise ValueError(f"constraint_from: must be a character offset in 0..{len(prompt)}, got {start!r}")
    head = [int(i) for i in tokenizer(prompt[:start])["input_ids"]]
    tail = [int(i) for i in tokenizer(prompt[start:], add_special_tokens=False)["input_ids"]] if start < len(prompt) \
        else []
    return head + tail, len(head)


def for_rows(model, constraint, count: int) -> list[Matcher | None]:
    """The matchers of `count` rows of `model`: `constraint` is None (free rows), one Constraint (every row) or a
    list with one Constraint or None per row. Compiled once per distinct constraint."""
    if constraint is None:
        return [None] * count
    items = list(constraint) if isinstance(constraint, (list, tuple)) else [constraint] * count
    if len(items) != count:
        raise ValueError(f"constraint: expected one per prompt ({count}), got {len(items)}")
    vocab = int(model.exact_head.weight.shape[0])
    eos = tuple(model.eos_token_ids)
    out: list[Matcher | None] = []
    for i, c in enumerate(items):
        if c is None:
            out.append(None)
            continue
        if not isinstance(c, Constraint):
            what = "constraint" if len(items) == 1 or not isinstance(constraint, (list, tuple)) else f"constraint[{i}]"
            raise TypeError(f"{what}: expected an lmhead constraint (JSONSchema, JSONObject, Regex, Choice, Grammar) "
                            f"or None, got {type(c).__name__}")
        out.append(compile_constraint(c, model.tokenizer, vocab, eos).matcher())
    return out
