"""The drafts: what proposes the tokens a round verifies (`lmhead.decode.engine.Decoder` takes them as objects).

    NgramDraft   prompt lookup: the tokens that followed the latest earlier occurrence of the row's last n tokens;
                 a point mass, judged by the plain sampler's draws (`decode.drafting.LookupDraft`)
    Draft        the same model with int8 weights and a head over its most frequent tokens; proposes from its own
                 forward and judges by the exact acceptance rules (`accept`; `decode.drafting.ModelDraft`)
    draft_for    a model's draft of a mode (DRAFT_MODES), the int8 one built once per model
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from lmhead.decode.choice import is_deterministic
from lmhead.models.fast_linear import Int8Linear, int8_linear_available
from lmhead.models.lean import SUPPORTED_MODEL_TYPES, LeanBody, StaticCache
from lmhead.speculative.accept import choices, draw, judge

DRAFT_MODES: tuple[str, ...] = ("auto", "ngram", "int8", "none")
NGRAM_MAX_POSITIONS = 8  # positions one n-gram verification may score (all rows): measured, docs/decode.md
_INT8_DRAFTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its Draft, built on first use


def check_draft_mode(model, mode: object) -> str:
    """`mode` in DRAFT_MODES, and one the model can have (a draft needs the lean body and oneDNN's int8
    kernel)."""
    if mode not in DRAFT_MODES:
        raise ValueError(f"draft must be one of {', '.join(DRAFT_MODES)}; got {mode!r}")
    if mode in ("int8", "ngram") and getattr(model, "lean", None) is None:
        raise ValueError(f"draft={mode!r} needs the lean body (model types "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}, body='auto' or 'lean'); use draft='none'")
    if mode == "int8" and not int8_linear_available():
        raise ValueError("draft='int8' needs oneDNN's int8 inner product, which this torch build lacks; "
                         "use draft='none'")
    return mode


def frequent_tokens(tokenizer, vocab_size: int, count: int) -> Tensor | None:
    """Up to `count` ids a BPE tokenizer built first (its merge order: early merges are frequent pairs), plus
    every single-character and special token; None when the tokenizer has no merges to rank by. The draft's
    head scores only these: a target token outside them is a rejection, never a wrong output."""
    import json

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    model = json.loads(backend.to_str()).get("model", {})
    vocab, merges = model.get("vocab") or {}, model.get("merges") or []
    if not merges or not vocab:
        return None
    rank = torch.full((vocab_size,), len(merges) + 1, dtype=torch.long)
    for i, merge in enumerate(merges):
        a, b = merge if isinstance(merge, list) else merge.split(" ", 1)
        j = vocab.get(a + b)
        if j is not None and j < vocab_size and rank[j] > i:
            rank[j] = i
    for token, j in vocab.items():
        if len(token) == 1 and j < vocab_size:
            rank[j] = -1
    for j in list(getattr(tokenizer, "all_special_ids", []) or []):
        if 0 <= j < vocab_size:
            rank[j] = -2
    chosen = torch.argsort(rank, stable=True)[:count]
    return chosen.sort().values


class Draft:
    """The draft model: the same body with int8 weights (`LeanBody(int8=True)`) and an int8 head over a
    subset of the vocabulary (all of it when V ≤ `max_vocab`, else the tokenizer's `max_vocab` most frequent
    ids). `logits(ids, positions, cache)` → [B,T,V] float32 with -inf outside the subset.

    Memory: int8 copies of the body's matrices and of the subset's head rows (a quarter of their fp32 bytes).
    A `decode.drafting.ModelDraft`: it proposes with its own forward and judges with the exact acceptance rules.
    """

    point_mass = False

    def __init__(self, hf_model, tokenizer=None, head_weight: Tensor | None = None, softcap: float | None = None,
                 max_vocab: int = 32768) -> None:
        if not int8_linear_available():
            raise ValueError("draft='int8' needs oneDNN's int8 inner product, which this torch build lacks; "
                             "use draft='none'")
        self.body = LeanBody(hf_model, int8=True)
        weight = hf_model.get_output_embeddings().weight if head_weight is None else head_weight
        self.vocab_size = int(weight.shape[0])
        subset = None
        if self.vocab_size > max_vocab and tokenizer is not None:
            subset = frequent_tokens(tokenizer, self.vocab_size, max_vocab)
        self.subset = subset
        rows = weight.detach() if subset is None else weight.detach().index_select(0, subset)
        self.head = Int8Linear(rows)
        self.softcap = softcap

    @property
    def nbytes(self) -> int:
        return self.body.nbytes + self.head.nbytes

    def new_cache(self, batch: int, capacity: int) -> StaticCache:
        return self.body.new_cache(batch, capacity)

    def logits(self, ids: Tensor, positions: Tensor, cache: StaticCache, valid: Tensor | None = None) -> Tensor:
        hidden = self.body(ids, positions, cache, valid)
        y = self.head(hidden)
        if self.softcap is not None:
            y = torch.tanh(y / self.softcap) * self.softcap
        if self.subset is None:
            return y
        out = y.new_full((*y.shape[:-1], self.vocab_size), float("-inf"))
        out[..., self.subset] = y
        return out

    def propose_batch(self, ids: Tensor, positions: Tensor, valid: Tensor, cache: StaticCache, next_pos: Tensor,
                      k: int, configs: list, history, prompt_len: list[int], steps: list[int],
                      generator: torch.Generator | None) -> tuple[Tensor, Tensor | None]:
        """Feed ids, positions, valid [B,T] (the pending columns and each row's `last`, at next_pos [B]) to `cache`,
        then draft k tokens → drafts [B,k] and, when a row samples, the processed distributions q [B,k,V]
        (`decode.drafting.ModelDraft`)."""
        x = self.logits(ids, positions, cache, valid)[:, -1]                          # [B,V]
        drafted: list[list[int]] = [[] for _ in configs]
        dists = []
        for i in range(k):
            prev = None if history is None else [h + d for h, d in zip(history, drafted, strict=True)]
            d, p = _choose(x, configs, prev, prompt_len, [s + i for s in steps], generator)
            if p is not None:
                dists.append(p)
            for row, t in zip(drafted, d.tolist(), strict=True):
                row.append(t)
            if i + 1 < k:
                x = self.logits(d[:, None], next_pos[:, None] + 1 + i, cache)[:, -1]
        q = torch.stack(dists, dim=1) if dists else None
        return torch.tensor(drafted, dtype=torch.long), q

    def accept(self, logits: Tensor, drafts: Tensor, q: Tensor, ks: list[int], configs: list, history,
               prompt_len: list[int], steps: list[int], generator: torch.Generator | None
               ) -> tuple[list[list[int]], Tensor]:
        """The exact acceptance rules over a round of these drafts (`accept.judge`)."""
        return judge(logits, drafts, q, ks, configs, history, prompt_len, steps, generator)


class NgramDraft:
    """Drafts from the row's own text (prompt lookup): the tokens that followed the most recent earlier
    occurrence of the row's last n tokens (n from `max_n` down to `min_n`, the longest that occurs wins).

    No model, no memory, no time: a draft is a few list comparisons. Text repeats — names, code, lists, the
    loops small models fall into, a chat answer quoting its prompt — and where it does, the full-precision
    model accepts several tokens per verification; where nothing matches the round is a plain step. The draft
    is a point mass (q = 1 on the proposed token), so the speculative-sampling rule accepts a drafted token
    with probability p(d) and on rejection draws from p without d — which is what drawing t from p and
    comparing it with d does: t = d accepts d, t ≠ d is the replacement (t given t ≠ d is p without d,
    renormalised). So every row, seeded or not, is judged as a greedy row is (`Decoder._draws`): the plain
    sampler's draw at each position, the longest prefix of drafts equal to it — no p(d), no [B,k,V] q, and
    no draw at the positions after the first mismatch. A `decode.drafting.LookupDraft`.
    """

    point_mass = True

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.nbytes = 0

    @property
    def max_positions(self) -> int:
        """The most positions one verification may score, all rows together (NGRAM_MAX_POSITIONS)."""
        return NGRAM_MAX_POSITIONS

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k ids to follow `tokens` (a row's prompt and generated ids, newest last); [] when no suffix of
        length ≥ min_n occurred before."""
        if k <= 0:
            return []
        size = len(tokens)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            tail = tokens[size - n:]
            first = tail[0]
            # the most recent earlier start s (s + n < size) with tokens[s:s+n] == tail
            for s in range(size - n - 1, -1, -1):
                if tokens[s] == first and tokens[s:s + n] == tail:
                    return tokens[s + n:s + n + k]
        return []


def _choose(x: Tensor, configs: list, prev, plen, steps: list[int], generator) -> tuple[Tensor, Tensor | None]:
    """The draft's token per row of x [B,V]: what the plain sampler would choose from the draft's logits
    (greedy and seeded rows: the same (seed, step) noise as the target's check) or, for other sampled rows, a
    draw from the processed distribution, returned as q [B,V] for the acceptance rule."""
    ids, probs = choices(x, configs, prev, plen, steps)
    if ids is None:
        ids = torch.zeros(len(configs), dtype=torch.long)
    for r, c in enumerate(configs):
        if not is_deterministic(c):
            ids[r] = draw(probs[r], generator)
    return ids, probs


def draft_for(model, mode: str = "auto") -> Draft | NgramDraft | None:
    """The speculative draft of mode `mode` (DRAFT_MODES) for `model`, the int8 one built on first use and kept
    for the model's life: "ngram" — drafts from the row's own text (prompt lookup; no model, no memory); "int8" —
    the model's body with int8 weights and an int8 head over its most frequent tokens; "none" — None; "auto" — the
    fastest exact setting measured (benchmarks/bench_decode.py, tables in docs/decode.md): `model.auto_draft()`
    (a decode loop also drafts n-grams for greedy rows where `model.auto_greedy_drafts()`)."""
    check_draft_mode(model, mode)
    if mode == "auto":
        mode = model.auto_draft()
    if mode == "none":
        return None
    if mode == "ngram":
        return NgramDraft()
    draft = _INT8_DRAFTS.get(model)
    if draft is None:
        draft = _INT8_DRAFTS[model] = Draft(model.hf_model, model.tokenizer, head_weight=model.exact_head.weight,
                                            softcap=model.exact_head.softcap)
    return draft
