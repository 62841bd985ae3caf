"""The decode loop: prefill once, then one token per step with the KV cache, streamed as `Step`s.

    prompts ──tokenizer, left padding──▶ ids [B,T], mask [B,T], positions [B,T]
      prefill:  body(ids, cache) ──hidden[:, -1]──▶ LMHead ──▶ logits [B,V]
      each step: sampling pipeline (per-row config) ──▶ next ids [B] ──▶ Step per row (text delta, logprobs)
                 ──▶ body(next ids [B,1], cache) ──▶ LMHead ──▶ logits [B,V]
    a row stops on: an end-of-sequence id ("stop"), a stop string ("stop"), max_new_tokens or the context
    length ("length"); finished rows leave the batch (their cache rows are dropped).

Only the last position's hidden state goes through the head: logits are [B,V], never [B,T,V].
Left padding is invisible to a row: padded keys are masked out and positions count real tokens only, so a
row in a batch produces the tokens it would produce alone. Randomness: a row whose config has a seed draws
from (seed, step) alone (see `lmhead.sampling.sample`); other rows share `generator` (or torch's global RNG).

Text deltas: the generated ids are decoded as a whole (after a few prompt tokens, so a leading space that a
tokenizer drops at the start of a text survives) and each step emits the new suffix; a trailing U+FFFD (an
incomplete multi-byte character) and a possible beginning of a stop string are held back until resolved.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from lmhead import checks
from lmhead.kernels.native import row_scores, token_scores
from lmhead.sampling import RowState, SamplingConfig, as_configs, chosen_logprobs, logprobs
from lmhead.sampling.steps.masks import withhold_stops

_PROMPT_CONTEXT = 4  # prompt tokens decoded before the generated ones, then cut off (keeps leading spaces)


@dataclass
class TopLogprob:
    """One alternative at a step: a token, its text, its processed and its raw log-probability."""

    token_id: int
    text: str
    logprob: float
    raw_logprob: float


@dataclass
class Step:
    """One generated token of one prompt.

    token_id: the chosen token. text: the text this step adds (may be "" while a character or a possible stop
    string is incomplete; a later step, at the latest the last one, carries it). logprob: log-probability of
    the token under the distribution it was drawn from (after the sampling pipeline; 0.0 for a greedy pick);
    raw_logprob: under the model's own softmax (temperature 1, nothing cut). rank: 1 + the number of tokens
    the model found more likely. finish_reason: None, "stop" (an end-of-sequence id or a stop string) or
    "length" (max_new_tokens or the context length). index: which prompt (0 for a single prompt).
    top_logprobs: with `top_logprobs=n`, the n most likely tokens, best first: the tokens the pipeline kept
    by processed log-probability, then cut ones (logprob -inf) by raw log-probability.
    A generation run with scores=False carries None in logprob, raw_logprob and rank.
    """

    token_id: int
    text: str
    logprob: float | None
    raw_logprob: float | None
    rank: int | None
    finish_reason: str | None = None
    index: int = 0
    top_logprobs: list[TopLogprob] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the fields above, alternatives as lists of dicts; a -inf logprob becomes None."""
        d = asdict(self)
        for item in [d, *d["top_logprobs"]]:
            for key in ("logprob", "raw_logprob"):
                if item[key] is not None and not math.isfinite(item[key]):
                    item[key] = None
        return d


# --- validation --------------------------------------------------------------------------------------------


def _prompts(prompt_or_prompts: str | Sequence[str]) -> tuple[list[str], bool]:
    if isinstance(prompt_or_prompts, str):
        prompts, single = [prompt_or_prompts], True
    elif isinstance(prompt_or_prompts, Sequence) and not isinstance(prompt_or_prompts, (bytes, bytearray)):
        prompts, single = list(prompt_or_prompts), False
        if not prompts:
            raise ValueError("prompt_or_prompts: the list of prompts is empty")
    else:
        raise TypeError(f"prompt_or_prompts: expected a str or a list of str, got {type(prompt_or_prompts).__name__}")
    for i, p in enumerate(prompts):
        what = "prompt" if single else f"prompt_or_prompts[{i}]"
        if not isinstance(p, str):
            raise TypeError(f"{what}: expected a str, got {type(p).__name__}")
        if not p:
            raise ValueError(f"{what}: the prompt is empty")
    return prompts, single


def _stops(stop: str | Sequence[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    for s in stops:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop: every stop string must be a non-empty str, got {s!r}")
    return stops


# --- text deltas -------------------------------------------------------------------------------------------


class _Detokenizer:
    """Incremental text of one row: decode the generated ids as a whole, emit the new suffix.

    `held` characters at the end are not emitted yet: an incomplete multi-byte character (U+FFFD at the end)
    or the beginning of a stop string. `stop_at` is set when a stop string appears: the text ends before it.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], stops: list[str], special: set[int],
                 include_stop: bool = False) -> None:
        self.tokenizer, self.stops, self.special = tokenizer, stops, special
        self.include_stop = include_stop  # the text ends after the stop string instead of before it
        self.context = [i for i in prompt_ids if i not in special][-_PROMPT_CONTEXT:]
        self.prefix = self._decode(self.context)
        self.ids: list[int] = []
        self.emitted = 0  # characters of the generated text already emitted
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _text(self) -> str:
        full = self._decode(self.context + self.ids)
        if full.startswith(self.prefix):
            return full[len(self.prefix):]
        return self._decode(self.ids)  # the prompt's tail decodes differently in context: fall back

    def add(self, token_id: int) -> str:
        """Append a token; return the text that is now certain (the stop string and after it excluded)."""
        if token_id in self.special:  # special tokens have no text; skipping the decode saves time
            self.ids.append(token_id)
            return ""
        self.ids.append(token_id)
        text = self._text()
        end, first = len(text), None
        for s in self.stops:  # the earliest stop string that appears (search from where it could start)
            at = text.find(s, max(0, self.emitted - len(s) + 1))
            if at != -1 and (first is None or at < first[0]):
                first = (at, s)
        if first is not None:
            end, self.stopped = first[0] + (len(first[1]) if self.include_stop else 0), True
        if not self.stopped:
            while end > self.emitted and text[end - 1] == "\ufffd":  # an incomplete character: wait
                end -= 1
            end -= self._stop_prefix(text, end)
        delta = text[self.emitted:end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return delta

    def _stop_prefix(self, text: str, end: int) -> int:
        """Length of the longest suffix of text[:end] that begins a stop string (held back until resolved)."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, end - self.emitted), best, -1):
                if text[end - k:end] == s[:k]:
                    best = k
                    break
        return best

    def flush(self) -> str:
        """All remaining text when the row finishes without a stop string (a lone U+FFFD included)."""
        if self.stopped:
            return ""
        text = self._text()
        delta = text[self.emitted:]
        self.emitted = len(text)
        return delta


# --- the loop ----------------------------------------------------------------------------------------------


def generate(model, prompt_or_prompts: str | Sequence[str], max_new_tokens: int = 32,
             config: SamplingConfig | Sequence[SamplingConfig] | None = None,
             stop: str | Sequence[str] | None = None, top_logprobs: int = 0, *,
             generator: torch.Generator | None = None, profile: dict[str, float] | None = None,
             draft: str = "auto", draft_tokens: int = 4, stats=None, exact_logprobs: bool = False,
             scores: bool = True, constraint=None, constraint_from: int | None = None) -> Iterator[Step]:
    """Generate up to `max_new_tokens` tokens per prompt, yielding one `Step` per token as it is chosen.

    model: an `lmhead.Model`. prompt_or_prompts: a str (steps have index 0) or a list of str (steps carry the
    prompt's `index`; rows interleave, each stops on its own). config: one SamplingConfig for all prompts or
    a list with one per prompt (default: temperature 1, no cuts). stop: a str or list of str; the text ends
    before the first one that appears. top_logprobs: how many alternatives each step lists (0..20).
    generator: the torch.Generator for rows without a seed. profile: a dict to which the seconds spent in
    "draft", "body", "head", "sampling" and "text" are added.
    draft: speculative decoding (`lmhead.speculative`) — "auto" (the fastest exact setting measured,
    `Model.auto_draft`: n-gram drafts where the head is the larger read, as Gemma 3's), "ngram" (drafts from the
    text's own earlier tokens), "int8" (the same model with int8 weights drafts), "none"; the full-precision
    model verifies. The output does not depend on it: greedy tokens are the full-precision model's, sampled tokens
    follow exactly the pipeline's distribution (a seeded run reproduces, but draws other tokens than
    draft="none" with the same seed). draft_tokens: tokens drafted per verification to start with (1..16;
    adapted to the acceptance rate). stats: a `speculative.SpeculativeStats` that receives the counts.

    Log-probabilities (`Step.logprob`, `raw_logprob`, `rank`, `top_logprobs`) are computed from the logits
    the token was chosen from: the decode head's (`model.head`). With the fp32 head they are exact. With the
    compressed exact-int8 head (`load_model`'s default for large heads) the top `exact_k` (64) logits are the
    fp32 head's, so a greedy or top-k ≤ 64 step's processed logprob is exact, but the softmax's normaliser
    (every raw logprob, and the processed ones without a top-k) includes the approximate tail, within the
    head's error bound (`CompressedHead.error_bound`). exact_logprobs=True computes every returned number
    with the fp32 head (`model.exact_head`, one extra product per step); the tokens are the same.
    scores=False: the steps carry no log-probabilities (None in logprob, raw_logprob and rank) and none are
    computed (the server's requests that ask for none: a pass over the vocabulary per token saved).
    constraint: structured output (`lmhead.constrain`): a JSONSchema, JSONObject, Regex, Choice or Grammar for
    every prompt, or a list with one (or None: a free row) per prompt. The constraint's mask comes first, before
    the pipeline, so the tokens, every logprob (raw ones included: the model's softmax over the allowed tokens)
    and the alternatives are the constrained distribution's; EOS only where the grammar may stop; a grammar that
    is complete ends the row with "stop", one that is not by max_new_tokens with "length" (the text so far).
    ConstraintError (a ValueError) where it does not compile or uses a feature llguidance does not support.
    constraint_from: where the constrained answer starts in each prompt, in characters (default: after the whole
    prompt); the text from there is the answer so far, tokenized on its own (`constrain.split_answer`), which
    each row's matcher consumes before the first step (ValueError naming the constraint where it does not match).

    The arguments are checked when this is called (ValueError / TypeError naming the argument); the tokens
    come as the iterator is consumed.
    """
    rows = prepare(model, prompt_or_prompts, max_new_tokens, config, stop, top_logprobs,
                   exact_logprobs=exact_logprobs, scores=scores, constraint=constraint,
                   constraint_from=constraint_from)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator: expected a torch.Generator, got {type(generator).__name__}")
    from lmhead.speculative import check_draft_mode, check_draft_tokens

    check_draft_mode(model, draft)
    check_draft_tokens(draft_tokens)
    return _loop(model, rows, generator, profile, draft, draft_tokens, stats)


@dataclass(eq=False)
class Row:
    """One prompt's generation as the decode loop keeps it: its ids, settings, and what it generated so far.
    `prepare` makes them; a `Batch` decodes them. `owner` is the caller's (the server's request), never read
    here."""

    prompt_ids: list[int]
    config: SamplingConfig
    budget: int                 # max_new_tokens, or less where the context ends first
    detok: _Detokenizer
    top_n: int = 0
    exact_logprobs: bool = False
    index: int = 0
    scores: bool = True  # False: its steps carry no logprobs (None), and none are computed
    owner: Any = None
    generated: list[int] = field(default_factory=list)
    state: RowState = field(default_factory=RowState)  # what its stateful steps keep (mirostat's μ)
    matcher: Any = None  # a `constrain.Matcher`: the row's place in its grammar (None: a free row)
    stop_ids: frozenset[int] | None = None  # ids that end the row (None: the model's end-of-sequence ids)

    @property
    def penalties(self) -> bool:
        """Whether a step of its config reads the history (penalties, DRY, n-grams, bad words, min tokens)."""
        return any(s.history for s in self.config.steps())

    @property
    def stateful(self) -> bool:
        return any(s.state for s in self.config.steps())

    def ends(self, token: int, eos: set[int]) -> bool:
        """Whether `token` ends this row (its stop ids, else the batch's end-of-sequence ids)."""
        return token in (eos if self.stop_ids is None else self.stop_ids)


def prepare(model, prompt_or_prompts: str | Sequence[str], max_new_tokens: int = 32,
            config: SamplingConfig | Sequence[SamplingConfig] | None = None,
            stop: str | Sequence[str] | None = None, top_logprobs: int = 0, *,
            exact_logprobs: bool = False, scores: bool = True, constraint=None,
            constraint_from: int | None = None) -> list[Row]:
    """The checked, tokenised rows of a `generate` call (same arguments, same errors), ready for a `Batch`."""
    prompts, _ = _prompts(prompt_or_prompts)
    configs = as_configs(config, len(prompts))  # one per prompt, checked as sampling checks it
    eos = getattr(model, "eos_token_ids", ())
    configs = [withhold_stops(c, eos) for c in configs]  # min_tokens withholds the end of sequence too
    stops = _stops(stop)
    checks.positive_int("max_new_tokens", max_new_tokens)
    encoded = []
    starts = []
    for i, p in enumerate(prompts):
        if constraint_from is None:
            ids = list(model.tokenizer(p)["input_ids"])
        else:
            from lmhead.constrain import split_answer

            ids, start = split_answer(model.tokenizer, p, constraint_from)
            starts.append(start)
        if not ids:
            raise ValueError(f"prompt_or_prompts[{i}]: the prompt encodes to no tokens")
        encoded.append(ids)
    return _rows(model, encoded, max_new_tokens, configs, stops, top_logprobs, exact_logprobs, scores,
                 constraint=constraint, answer_starts=starts if constraint_from is not None else None)


def prepare_ids(model, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int = 32,
                config: SamplingConfig | Sequence[SamplingConfig] | None = None,
                stop: str | Sequence[str] | None = None, top_logprobs: int = 0, *,
                exact_logprobs: bool = False, scores: bool = True, stop_token_ids: Sequence[int] | None = None,
                ignore_eos: bool = False, include_stop: bool = False, constraint=None) -> list[Row]:
    """`prepare` for prompts given as token ids (one list per row; row i has index i), with vLLM's options:
    stop_token_ids (ids that end a row beside the end-of-sequence ones; the token adds no text), ignore_eos
    (the end-of-sequence ids do not end a row), include_stop (the text keeps the stop string that ended it);
    constraint as `prepare`'s.
    A config's min_tokens (the sampling step) withholds every id that ends the row."""
    if isinstance(prompt_ids, (str, bytes)) or not prompt_ids:
        raise ValueError("prompt_ids: expected a non-empty list of token-id lists")
    vocab = model.vocab_size
    encoded = []
    for i, ids in enumerate(prompt_ids):
        ids = list(ids)
        if not ids:
            raise ValueError(f"prompt_ids[{i}]: the prompt is empty")
        for t in ids:
            if not checks.is_int(t) or not 0 <= t < vocab:
                raise ValueError(f"prompt_ids[{i}]: token ids must be integers in 0..{vocab - 1}, got {t!r}")
        encoded.append(ids)
    configs = as_configs(config, len(encoded))
    stops = _stops(stop)
    checks.positive_int("max_new_tokens", max_new_tokens)
    for name, flag in (("ignore_eos", ignore_eos), ("include_stop", include_stop)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}: expected a bool, got {type(flag).__name__}")
    extra = set()
    for t in stop_token_ids or ():
        if not checks.is_int(t) or not 0 <= t < vocab:
            raise ValueError(f"stop_token_ids: token ids must be integers in 0..{vocab - 1}, got {t!r}")
        extra.add(int(t))
    ends = frozenset(extra if ignore_eos else extra | set(model.eos_token_ids))
    # min_tokens withholds every id that would end the row (vLLM's rule)
    configs = [withhold_stops(c, sorted(ends)) for c in configs]
    rows = _rows(model, encoded, max_new_tokens, configs, stops, top_logprobs, exact_logprobs, scores,
                 include_stop, constraint)
    for row in rows:
        row.stop_ids = ends
    return rows


def _rows(model, encoded: list[list[int]], max_new_tokens: int, configs: list[SamplingConfig], stops: list[str],
          top_logprobs: int, exact_logprobs: bool, scores: bool, include_stop: bool = False,
          constraint=None, answer_starts: list[int] | None = None) -> list[Row]:
    """The rows of checked prompts' ids (the checks `prepare` shares with `prepare_ids`); answer_starts: where
    each row's constrained answer begins in its ids (its matcher consumes the rest)."""
    if not checks.is_int(top_logprobs) or not 0 <= top_logprobs <= 20:
        raise ValueError(f"top_logprobs: must be an integer in 0..20, got {top_logprobs!r}")
    if not isinstance(exact_logprobs, bool):
        raise TypeError(f"exact_logprobs: expected a bool, got {type(exact_logprobs).__name__}")
    if not isinstance(scores, bool):
        raise TypeError(f"scores: expected a bool, got {type(scores).__name__}")
    if not scores and top_logprobs:
        raise ValueError(f"top_logprobs: must be 0 with scores=False (no logprobs), got {top_logprobs!r}")
    special = set(getattr(model.tokenizer, "all_special_ids", []) or [])
    from lmhead.constrain import for_rows

    prompts = encoded
    matchers = for_rows(model, constraint, len(encoded))
    for ids, m, start in zip(encoded, matchers, answer_starts or [len(ids) for ids in encoded], strict=True):
        if m is not None:
            m.advance(ids[start:])
    rows = []
    for i, ids in enumerate(encoded):
        what = "prompt" if len(prompts) == 1 else f"prompt_or_prompts[{i}]"
        budget = max_new_tokens
        if model.context_length is not None:
            if len(ids) >= model.context_length:
                raise ValueError(f"{what}: {len(ids)} tokens leaves no room in the model's context of "
                                 f"{model.context_length} tokens (at most {model.context_length - 1})")
            budget = min(max_new_tokens, model.context_length - len(ids))
        rows.append(Row(ids, configs[i], budget, _Detokenizer(model.tokenizer, ids, stops, special, include_stop),
                        top_logprobs, exact_logprobs, i, scores=scores, matcher=matchers[i]))
    return rows


class _Clock:
    """Adds wall time per phase to `profile` (no-op and no syncs when profile is None)."""

    def __init__(self, profile: dict[str, float] | None) -> None:
        self.profile = profile
        self.t = time.perf_counter() if profile is not None else 0.0

    def lap(self, phase: str) -> None:
        if self.profile is not None:
            now = time.perf_counter()
            self.profile[phase] = self.profile.get(phase, 0.0) + now - self.t
            self.t = now


def _count_greater(x: torch.Tensor, values: torch.Tensor) -> list[int]:
    """Per row b: how many entries of x[b] are > values[b]."""
    if x.device.type == "cpu":
        # numpy compares on one thread. A torch elementwise op over a [V] row runs as a parallel region, and on
        # a machine whose cores are busy each region waits a scheduler tick for its second thread: far longer
        # than the count itself.
        rows = x.numpy()
        return [int(np.count_nonzero(rows[b] > v)) for b, v in enumerate(values.tolist())]
    return (x > values[:, None]).sum(dim=-1).tolist()


def _scores(logits: torch.Tensor, ids: torch.Tensor | list[int], cfg, prev, plen, top_n: int, greedy: bool,
            chosen: list[float] | None = None):
    """Per row: processed logprob, raw logprob and raw rank of `ids` ([N] or a list), and (top_n > 0) the
    alternatives.

    Equal to `sampling.logprobs` (which is used when alternatives are asked for). Without them the work is
    the normaliser and the count (`models.native.row_scores`; without the library a log_softmax, a row-wise
    kernel, and numpy's count), and for
    sampled rows `chosen_logprobs` (over a top-k row's k candidates, not a [B,V] processed row) — or nothing
    when the draw already gave them (`chosen`, from `sampling.sample_with_logprobs` on these logits).
    """
    if top_n:
        if isinstance(ids, list):
            ids = torch.tensor(ids, device=logits.device)
        lp = logprobs(logits, ids, cfg, top_n=top_n, prev_tokens=prev, prompt_len=plen)
        alts = [list(zip(*row, strict=True)) for row in zip(lp.top_ids.tolist(), lp.top_logprobs.tolist(),
                                                            lp.top_raw_logprobs.tolist(), strict=True)]
        return lp.logprob.tolist(), lp.raw_logprob.tolist(), lp.rank.tolist(), alts
    x = logits if logits.dtype == torch.float32 else logits.float()
    if isinstance(ids, list):  # the decode loop's tokens: the C passes answer with Python numbers
        found = token_scores(x, ids)
        if found is not None:
            raw, ranks = found
            if greedy:
                return [0.0] * len(raw), raw, ranks, None
            if chosen is None:
                chosen = chosen_logprobs(x, torch.tensor(ids, device=x.device), cfg, prev_tokens=prev,
                                         prompt_len=plen).tolist()
            return chosen, raw, ranks, None
        ids = torch.tensor(ids, device=x.device)
    col = ids[:, None]
    native = row_scores(x, ids)  # two passes over each row in C: the normaliser and the count
    if native is not None:
        lse, greater = native
        raw = (x.gather(1, col).squeeze(1).double() - lse).tolist()
        ranks = [1 + c for c in greater.tolist()]
    else:
        raw = torch.log_softmax(x, dim=-1).gather(1, col).squeeze(1).tolist()
        ranks = [1 + c for c in _count_greater(x, x.gather(1, col).squeeze(1))]
    if greedy:  # a greedy row keeps only its argmax: probability 1
        return [0.0] * len(raw), raw, ranks, None
    if chosen is None:
        chosen = chosen_logprobs(x, ids, cfg, prev_tokens=prev, prompt_len=plen).tolist()
    return chosen, raw, ranks, None


def _left_pad(prompt_ids: list[list[int]], pad: int, device: torch.device):
    """ids [B,T] (left-padded with `pad`), positions [B,T] (real tokens count 0, 1, 2, ... in every row) and
    the attention mask [B,T] (None when no row is padded: the plain causal mask)."""
    n, width = len(prompt_ids), max(len(p) for p in prompt_ids)
    ids = torch.full((n, width), pad, dtype=torch.long, device=device)
    mask = torch.zeros((n, width), dtype=torch.long, device=device)
    for r, p in enumerate(prompt_ids):  # left padding: every row's last token is at column -1
        ids[r, width - len(p):] = torch.tensor(p, device=device)
        mask[r, width - len(p):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    padded = n > 1 and min(len(p) for p in prompt_ids) < width
    return ids, positions, mask if padded else None


def _advance(detok: _Detokenizer, generated: list[int], budget: int, token: int,
             is_eos: bool) -> tuple[str, str | None]:
    """Append a row's new token: the text it adds and the row's finish reason (None: the row goes on)."""
    generated.append(token)
    if is_eos:
        detok.ids.append(token)
        return detok.flush(), "stop"
    text = detok.add(token)
    if detok.stopped:
        return text, "stop"
    if len(generated) >= budget:
        return text + detok.flush(), "length"
    return text, None


class _TransformersRounds:
    """The decode rounds over transformers' modules (`Model.body`, a DynamicCache), for models without a
    lean body: one token per row per round, no draft, no rows joining a running batch. Same interface as
    `speculative.Decoder` otherwise."""

    def __init__(self, model, profile: dict[str, float] | None) -> None:
        self.model, self.clock = model, _Clock(profile)

    def start(self, ids: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor | None,
              max_new_tokens: int) -> torch.Tensor:
        self.positions = positions
        self.attention = None if valid is None else valid.long()
        self.cache = self.model.new_cache()
        hidden = self.model.hidden_states(ids, attention_mask=self.attention, position_ids=positions,
                                          past_key_values=self.cache)
        self.clock.lap("body")
        self.pending = hidden[:, -1:, :]  # [B,1,D]: the last position chooses the first token
        return ids[:, -1]

    def select(self, rows: torch.Tensor) -> None:
        self.cache.batch_select_indices(rows)
        self.positions = self.positions[rows]
        if self.attention is not None:
            self.attention = self.attention[rows]
        if self.pending is not None:
            self.pending = self.pending[rows]

    def round(self, last, configs, history, prompt_len, steps, generator, scored=None, states=None, matchers=None):
        from lmhead.speculative import Round, apply_masks, decode_logits, plain_choice, settle_round, take_drafts

        if self.pending is not None:  # the prefill's last position chooses the first token
            hidden, self.pending = self.pending, None
        else:
            self.positions = self.positions[:, -1:] + 1
            if self.attention is not None:
                self.attention = torch.cat([self.attention, self.attention.new_ones((len(last), 1))], dim=1)
            hidden = self.model.hidden_states(last[:, None], attention_mask=self.attention,
                                              position_ids=self.positions, past_key_values=self.cache)
            self.clock.lap("body")
        logits = decode_logits(self.model.head, hidden, configs, scored)  # [B,1,V]
        self.clock.lap("head")
        taken = take_drafts(matchers, None, [])
        apply_masks(logits, taken)
        logits = logits.squeeze(1)  # [B,1,V] -> [B,V]
        ids, chosen = plain_choice(logits, configs, history, prompt_len, steps, generator, scored=True,
                                   states=states)
        self.clock.lap("sampling")
        rnd = Round([[t] for t in ids.tolist()], [logits[b:b + 1] for b in range(len(ids))],
                    [hidden[b] for b in range(len(ids))], [[v] for v in chosen.tolist()])
        return settle_round(rnd, matchers, taken)


def _rounds(model, draft: str, draft_tokens: int, profile: dict[str, float] | None):
    """The round source for `model`: the lean body's `Decoder` (with the draft of mode `draft`; "auto" where
    `auto_draft()` is "none" and `auto_greedy_drafts()`: n-grams for greedy rows only), else transformers'
    modules."""
    if model.lean is None:
        return _TransformersRounds(model, profile)
    from lmhead.speculative import Decoder

    greedy_only = False
    if draft == "auto" and model.auto_draft() == "none" and getattr(model, "auto_greedy_drafts", lambda: False)():
        draft, greedy_only = "ngram", True
    return Decoder(model.lean, model.head, model.draft(draft), k=draft_tokens, profile=profile,
                   greedy_only=greedy_only)


def _score_logits(model, rnd, rows: list[Row]) -> torch.Tensor:
    """The logits every token of a round is scored under, rows × their tokens flattened in order [N,V]: the
    ones it was chosen from, or the fp32 head's for rows that asked for exact logprobs."""
    parts = list(rnd.logits)
    if model.head is not model.exact_head:
        for b, row in enumerate(rows):
            if row.exact_logprobs:
                parts[b] = model.exact_head(rnd.hidden[b]).float()  # [n_b,D] -> [n_b,V]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def _flat_scores(logits: torch.Tensor, tokens: list[list[int]], history, prompt_len, rows: list[Row],
                 chosen: list[float] | None = None):
    """Scores of every token a round emitted (rows × their tokens, flattened, in order; logits [N,V]): each
    token's logprobs, rank and alternatives (the most any row asks for; each row keeps its own count), the
    earlier tokens of the round counted as generated. chosen: the processed logprobs the draw gave, when
    `logits` are the ones it drew from."""
    flat_cfg, prev, plen = [], [] if history is not None else None, []
    for b, row_tokens in enumerate(tokens):
        for j in range(len(row_tokens)):
            flat_cfg.append(rows[b].config)
            plen.append(prompt_len[b])
            if prev is not None:
                prev.append(history[b] + row_tokens[:j])
    ids = [t for row_tokens in tokens for t in row_tokens]
    cfg = flat_cfg[0] if len({id(c) for c in flat_cfg}) == 1 else flat_cfg
    return _scores(logits, ids, cfg, prev, plen if prev is not None else 0, max(r.top_n for r in rows),
                   greedy=all(c.is_greedy for c in flat_cfg), chosen=chosen)


# chunked prefill while rows decode (`PrefillBudget`): a piece costs at most this share of their decode round, so
# a round with a piece costs at most (1 + share)× one without
PIECE_SHARE = 1.0
PIECE_UNIT = 8  # positions (rows × columns) a piece is a multiple of: the coded product's passes of 8 query rows
ROUNDS_KEPT = 5  # the decode rounds whose median is "a round"


class PrefillBudget:
    """How many prompt columns the next piece of a joining prompt takes while other rows decode: chunked prefill
    under a per-round budget, as vLLM's `max_num_batched_tokens`, in time rather than tokens.

        note_round(s)            a decode round of the running rows took s seconds (`Batch.step`)
        note_piece(s, n)         a piece of n positions (rows × columns) took s seconds (`Batch.prefill`)
        columns(rows, most)      → the next piece's columns: as many as PIECE_SHARE × the median of the last
                                 ROUNDS_KEPT rounds, at the seconds per position of the last piece, allow; a
                                 multiple of PIECE_UNIT positions, at least one unit, at most `most` positions
                                 (rounded down to a unit) and at most twice the last piece

    Both rates come from this process (its machine, its load, the model, the context the piece attends over),
    and the last piece's rate is the freshest for the next one, whose context is a piece longer. A piece of
    few positions costs more per position (each reads every weight once), so sizing from a small one errs
    small; the doubling bound keeps a piece from outgrowing its measurement. The first piece of a join is one
    unit.

    Why multiples of PIECE_UNIT at most `most` (`LeanBody.CODED_MAX_ROWS`): the coded step computes each
    position's numbers the same way in every pass of 8 query rows, so pieces of any such sizes give the same
    cache, bit for bit — the joined row's tokens and logprobs do not depend on the timings that sized its
    pieces.
    """

    def __init__(self) -> None:
        self.rounds: list[float] = []
        self.rate: float | None = None  # seconds per position of the last piece
        self.last = 0  # the last piece's columns (0: none yet in this join)

    def start(self) -> None:
        """A new join: its first piece is one unit again."""
        self.last, self.rate = 0, None

    def note_round(self, seconds: float) -> None:
        self.rounds = [*self.rounds[1 - ROUNDS_KEPT:], seconds]

    def note_piece(self, seconds: float, positions: int, columns: int) -> None:
        self.rate, self.last = seconds / max(positions, 1), columns

    def columns(self, rows: int, most: int) -> int:
        """The next piece's columns for `rows` joining rows (see the class docstring)."""
        if rows < 1 or most < 1:
            raise ValueError(f"rows and most must be ≥ 1, got {rows} and {most}")
        unit = PIECE_UNIT // math.gcd(rows, PIECE_UNIT)  # columns: rows × unit is a multiple of PIECE_UNIT
        cap = max(unit, most // (rows * unit) * unit)
        if self.rate is None or not self.rounds or not self.last:
            return unit
        budget = PIECE_SHARE * sorted(self.rounds)[len(self.rounds) // 2]
        want = int(budget / max(self.rate, 1e-12) / rows) // unit * unit
        return max(unit, min(want, cap, 2 * self.last))


class Batch:
    """Rows decoding together, open to rows that join while others decode (continuous batching).

        batch = Batch(model)            # generator, profile, draft, draft_tokens, stats as in `generate`
        batch.add(prepare(model, ...))  # prefill the new rows; they join the running ones
        for row, step in batch.step():  # one round for every live row: each row's new Step(s)
            ...
        batch.remove([row])             # retire rows early (a client that went away)

    Finished rows (end of sequence, stop string, budget) leave after the step that finished them; `rows` are
    the live ones. A row's tokens do not depend on the rows it decodes beside (per-row configs, seeds keyed
    on (seed, step), left padding and merged caches invisible to attention, `speculative.decode_logits`):
    a greedy or seeded row gives the tokens it gives alone, and logprobs equal to float rounding (a compressed
    head's own: within its error bound, its kernel differs for one row and several). Rows join a
    running batch on the lean body (`speculative.Decoder.join`); with transformers' modules `can_join` is
    False while rows are live. Rows without scores (`Row.scores` False) get their tokens only.
    """

    def __init__(self, model, *, generator: torch.Generator | None = None,
                 profile: dict[str, float] | None = None, draft: str = "none", draft_tokens: int = 4,
                 stats=None, prefix_cache=None) -> None:
        self.model, self.generator, self.profile = model, generator, profile
        self.prefix_cache = prefix_cache  # a prefix_cache.PrefixCache: finished rows' columns, reused by prompts
        self.draft, self.draft_tokens, self.stats = draft, draft_tokens, stats
        self.device = model.device
        self.eos = set(model.eos_token_ids)
        tokenizer = model.tokenizer
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else max(min(self.eos, default=0), 0)
        self.rows: list[Row] = []
        self.rounds = None
        self.last: torch.Tensor | None = None  # [B] each live row's newest token (not yet in the caches)
        self.clock = _Clock(profile)
        self._joining: tuple | None = None  # (rows, their Decoder, their last, room) while `begin_join` prefills
        self.budget = PrefillBudget()  # the pieces of a joining prompt while rows decode

    @property
    def can_join(self) -> bool:
        """Whether `add` takes rows now: always on the lean body (unless a `begin_join` is under way), else only
        when no row is live."""
        return self._joining is None and (not self.rows or self.model.lean is not None)

    @torch.inference_mode()
    def add(self, rows: list[Row]) -> None:
        """Prefill `rows` (one left-padded forward) and make them live after the running ones."""
        if not rows:
            return
        if not self.can_join:
            raise RuntimeError("rows join a running batch only on the lean body; wait until `rows` is empty")
        ids, positions, attention = _left_pad([r.prompt_ids for r in rows], self.pad, self.device)
        valid = None if attention is None else attention.bool()
        if not self.rows:
            draft = self.draft
            if draft == "auto" and not hasattr(self.model, "auto_draft"):
                draft = "none"  # measured (docs/decode.md): `Model.auto_draft`, `_rounds`
            self.rounds = _rounds(self.model, draft, self.draft_tokens, self.profile)
            if self.stats is not None and hasattr(self.rounds, "stats"):
                self.rounds.stats = self.stats
            self.last = self.rounds.start(ids, positions, valid, max(r.budget for r in rows), **self._prefix(rows))
        else:
            room = max(r.budget - len(r.generated) for r in [*self.rows, *rows])
            self.last = torch.cat([self.last, self.rounds.join(ids, positions, valid, room)])
        self.rows = [*self.rows, *rows]

    @property
    def joining(self) -> list[Row]:
        """The rows whose prompts `begin_join` is prefilling (not live yet)."""
        return self._joining[0] if self._joining is not None else []

    @torch.inference_mode()
    def begin_join(self, rows: list[Row]) -> None:
        """Start `add`-ing `rows` to the running ones in pieces (chunked prefill): each `prefill()` feeds one
        piece of their prompts, so decode rounds of the live rows run between the pieces; the call after the
        last piece merges them, and they are live. On an empty batch (or transformers' modules) this is `add`.
        One join at a time."""
        if not self.rows or self.model.lean is None:
            self.add(rows)
            return
        if self._joining is not None:
            raise RuntimeError("a join is under way: call prefill() until it returns False")
        ids, positions, attention = _left_pad([r.prompt_ids for r in rows], self.pad, self.device)
        room = max(r.budget - len(r.generated) for r in [*self.rows, *rows])
        other, last = self.rounds.begin_join(ids, positions, None if attention is None else attention.bool(), room,
                                             **self._prefix(rows))
        self._joining = (rows, other, last, room)
        self.budget.start()

    @torch.inference_mode()
    def prefill(self, columns: int | None = None) -> bool:
        """One piece of the joining rows' prompts, or, once none is left, the merge: they join (become live).
        True while pieces or the merge remain. The piece: `columns` prompt columns; None: while rows decode,
        what `budget` allows (a round with a piece costs at most 1 + PIECE_SHARE rounds without), else
        `speculative.PREFILL_PIECE` (a lone prompt's time to first token as `add`'s). The merge is a call of
        its own, so that a round waits for a piece or for the merge, never both."""
        if self._joining is None:
            return False
        rows, other, last, room = self._joining
        if other.prefilling:
            if columns is not None:
                columns = checks.positive_int("columns", columns)
            elif self.rows:
                columns = self.budget.columns(len(rows), self.model.lean.CODED_MAX_ROWS)
            t = time.perf_counter()
            before = other.target.length
            other.prefill_piece(columns)
            self.budget.note_piece(time.perf_counter() - t, len(rows) * (other.target.length - before),
                                   other.target.length - before)
            return True
        self._joining = None
        if not self.rows:  # every running row left meanwhile: the joining rows are the batch
            self.rounds, self.last, self.rows = other, last, list(rows)
            return False
        self.rounds.finish_join(other, room)
        self.last = torch.cat([self.last, last])
        self.rows = [*self.rows, *rows]
        return False

    def _prefix(self, rows: list[Row]) -> dict[str, Any]:
        """The `prefix` keyword for a Decoder's start of `rows`: the prefix cache's match for a lone row's prompt
        (none for several rows, whose left padding the cached columns do not have)."""
        if self.prefix_cache is None or len(rows) != 1 or self.model.lean is None:
            return {}
        found = self.prefix_cache.match(rows[0].prompt_ids[:-1])
        return {} if found is None else {"prefix": found}

    def _keep_prefixes(self, finished: list[Row]) -> None:
        """Store the columns of finished rows (their prompt and the tokens they fed) in the prefix cache."""
        target = getattr(self.rounds, "target", None)
        if self.prefix_cache is None or target is None:
            return
        for b, row in enumerate(self.rows):
            if row in finished:
                src = target.valid[b, :target.length].nonzero().squeeze(1)
                self.prefix_cache.put(target.tokens[b, src].tolist(), target.keys[:, b, :, src],
                                      target.values[:, b, :, src])

    def drop_join(self) -> None:
        """Abandon the join under way (its prefill failed); the live rows go on."""
        self._joining = None
        if not self.rows:
            self.rounds, self.last = None, None

    @torch.inference_mode()
    def remove(self, rows: list[Row]) -> None:
        """Retire `rows` (live rows of this batch) now; their cache rows are dropped."""
        gone = {id(r) for r in rows}
        keep = [b for b, r in enumerate(self.rows) if id(r) not in gone]
        if len(keep) == len(self.rows):
            return
        if not keep:
            self.rows, self.last = [], None
            if self._joining is None:
                self.rounds = None
            return
        index = torch.tensor(keep, device=self.device)
        self.rounds.select(index)
        self.rows = [self.rows[b] for b in keep]
        self.last = self.last.index_select(0, index)

    def _round_scores(self, rnd, history, plen):
        """The scores of every token of a round (rows × their tokens, flattened, in order; see `_flat_scores`):
        None for the tokens of rows without scores, which are not computed."""
        rows = self.rows
        keep = [b for b, r in enumerate(rows) if r.scores]
        if len(keep) < len(rows):
            none = [None] * sum(len(t) for t in rnd.tokens)
            if not keep:
                return none, none, none, None
            sub = self._subset(keep, rnd, history, plen)
            scored = self._scores_for(*sub)
            return _spread(scored, [len(t) for t in rnd.tokens], keep)
        return self._scores_for(rows, rnd, history, plen)

    def _subset(self, keep: list[int], rnd, history, plen):
        """The rows `keep` of a round: (rows, their Round, history, prompt lengths)."""
        from lmhead.speculative import Round

        pick = (lambda xs: None if xs is None else [xs[b] for b in keep])
        return ([self.rows[b] for b in keep], Round(pick(rnd.tokens), pick(rnd.logits), pick(rnd.hidden),
                                                    pick(rnd.logprobs), pick(rnd.raw)), pick(history), pick(plen))

    def _scores_for(self, rows: list[Row], rnd, history, plen):
        # the draws' own, unless a row is scored under other (exact) logits
        drawn = None if rnd.logprobs is None else [v for row in rnd.logprobs for v in row]
        if drawn is not None and self.model.head is not self.model.exact_head and any(r.exact_logprobs for r in rows):
            drawn = None
        if drawn is not None and rnd.raw is not None and not any(r.top_n for r in rows):
            # plain greedy rows: the raw logprob was found with the argmax, whose rank is 1
            raw = [v for row in rnd.raw for v in row]
            return drawn, raw, [1] * len(raw), None
        return _flat_scores(_score_logits(self.model, rnd, rows), rnd.tokens, history, plen, rows, drawn)

    @torch.inference_mode()
    def step(self) -> list[tuple[Row, Step]]:
        """One round for every live row → (row, Step) for each token chosen, rows in order; rows that
        finished are retired."""
        rows, tokenizer = self.rows, self.model.tokenizer
        history = [r.prompt_ids + r.generated for r in rows] if any(r.penalties for r in rows) else None
        plen = [len(r.prompt_ids) for r in rows]
        states = {"states": [r.state for r in rows]} if any(r.stateful for r in rows) else {}
        matchers = [r.matcher for r in rows]
        # a constrained greedy row's mask enters the screened head (its candidates are the allowed tokens'); a
        # constrained sampled row reads its whole row (its forced tokens are taken without a draw)
        scored = [r.scores or r.matcher is not None and not r.config.is_greedy for r in rows]
        if any(m is not None for m in matchers):
            states["matchers"] = matchers
        began = time.perf_counter()
        rnd = self.rounds.round(self.last, [r.config for r in rows], history, plen,
                                [len(r.generated) for r in rows], self.generator, scored, **states)
        self.clock.t = time.perf_counter() if self.profile is not None else 0.0
        chosen, raw, ranks, alts = self._round_scores(rnd, history, plen)
        self.clock.lap("sampling")
        out: list[tuple[Row, Step]] = []
        finished: list[Row] = []
        i = 0
        for row, tokens in zip(rows, rnd.tokens, strict=True):
            finish = None
            for j, token in enumerate(tokens):
                if finish is None:
                    text, finish = _advance(row.detok, row.generated, row.budget, token, row.ends(token, self.eos))
                    if row.matcher is not None and j == len(tokens) - 1 and row.matcher.stopped:
                        # the grammar is complete: the row ends here, also where the budget ends with it
                        text, finish = (text + row.detok.flush(), "stop") if finish is None else (text, "stop")
                    top = [TopLogprob(t, tokenizer.decode([t]), v, rv) for t, v, rv in alts[i][:row.top_n]
                           ] if row.top_n else []
                    out.append((row, Step(token, text, chosen[i], raw[i], ranks[i], finish, row.index, top)))
                i += 1
            if finish is not None:
                finished.append(row)
        self.clock.lap("text")
        if finished:
            self._keep_prefixes(finished)
        self.remove(finished)
        if self.rows:
            self.last = torch.tensor([r.generated[-1] for r in self.rows], device=self.device)
        self.budget.note_round(time.perf_counter() - began)
        return out


def _spread(scored, counts: list[int], keep: list[int]):
    """Scores of the rows `keep` (flattened over their tokens) → the same lists over every row's `counts`
    tokens, None (alternatives: []) for the others."""
    chosen, raw, ranks, alts = scored
    out: tuple[list, list, list, list] = ([], [], [], [])
    kept, i = set(keep), 0
    for b, n in enumerate(counts):
        for _ in range(n):
            if b in kept:
                out[0].append(chosen[i])
                out[1].append(raw[i])
                out[2].append(ranks[i])
                out[3].append(alts[i] if alts is not None else [])
                i += 1
            else:
                for lst, empty in zip(out, (None, None, None, []), strict=True):
                    lst.append(empty)
    return out[0], out[1], out[2], (out[3] if alts is not None else None)


def _loop(model, rows: list[Row], generator: torch.Generator | None, profile: dict[str, float] | None,
          draft: str = "none", draft_tokens: int = 4, stats=None) -> Iterator[Step]:
    batch = Batch(model, generator=generator, profile=profile, draft=draft, draft_tokens=draft_tokens,
                  stats=stats)
    batch.add(rows)
    while batch.rows:
        for _, step in batch.step():
            yield step
