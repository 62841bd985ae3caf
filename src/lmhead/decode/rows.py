"""The rows of a decode: one prompt's ids, settings and what it generated so far, and the text it streams.

    prepare / prepare_ids   checked, tokenised prompts → `Row`s (the arguments of `generate`, same errors)
    Step                    one generated token of one row, as the loop yields it
    left_pad                the rows' prompts as one left-padded batch: ids, positions, attention mask [B,T]
    advance                 a row's new token: the text it adds and whether the row finishes

Text deltas: the generated ids are decoded as a whole (after a few prompt tokens, so a leading space that a
tokenizer drops at the start of a text survives) and each step emits the new suffix; a trailing U+FFFD (an
incomplete multi-byte character) and a possible beginning of a stop string are held back until resolved.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from lmhead import checks
from lmhead.sampling import RowState, SamplingConfig, as_configs
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
    """Incremental text of one row: the generated ids' text as decoding them as a whole (after the prompt's last
    tokens) gives it, emitting the new suffix.

    The whole is not decoded at every token (its cost grew with the text, so a long answer's tokens slowed): each
    step decodes a window from the last point where the text was complete (vLLM's and transformers' streamers'
    offsets), without and with the new tokens, and appends the difference — the same characters for decoders
    whose pieces' text does not reach further back than the window (byte-level BPE, SentencePiece's metaspace,
    WordPiece); where a window's text is not an extension of its start's, the row decodes the whole from then on.

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
        # the window: context + ids from `_start` on is decoded; the text up to `_read` is settled in `_done`
        self._start, self._read, self._done = 0, len(self.context), ""
        self._whole = False  # a window failed: decode the whole from now on

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _whole_text(self) -> str:
        full = self._decode(self.context + self.ids)
        if full.startswith(self.prefix):
            return full[len(self.prefix):]
        return self._decode(self.ids)  # the prompt's tail decodes differently in context: fall back

    def _text(self) -> str:
        """The generated ids' text (`_whole_text`'s), from the window."""
        if self._whole:
            return self._whole_text()
        ids = self.context + self.ids if self._start < len(self.context) else None
        window = ids[self._start:] if ids is not None else self.ids[self._start - len(self.context):]
        cut = self._read - self._start
        before, after = self._decode(window[:cut]), self._decode(window)
        if self._start == 0 and before != self.prefix or not after.startswith(before):
            self._whole = True
            return self._whole_text()
        tail = after[len(before):]
        if tail and not tail.endswith("\ufffd"):  # complete: settled, the next window starts here
            self._done += tail
            self._start, self._read = self._read, len(self.context) + len(self.ids)
            return self._done
        return self._done + tail

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


@dataclass(eq=False)
class Row:
    """One prompt's generation as the decode loop keeps it: its ids, settings, and what it generated so far.
    `prepare` makes them; a `generate.Batch` decodes them. `owner` is the caller's (the server's request), never read
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
            ids = list(model.tokenizer.encode(p))
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


def left_pad(prompt_ids: list[list[int]], pad: int, device: torch.device):
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


def advance(detok: _Detokenizer, generated: list[int], budget: int, token: int,
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
