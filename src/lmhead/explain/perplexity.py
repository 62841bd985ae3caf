"""Scoring a text: `evaluate` / `perplexity` / `score_tokens` (exp of the mean next-token loss in sliding windows,
per token its log-probability and rank) and the text's segments per token."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch

from lmhead import checks
from lmhead.explain.inputs import accepts_parts, encode_prompt, model_device, model_name_of
from lmhead.explain.records import Evaluation, TokenScore
from lmhead.explain.tokens import special_ids, token_texts

DEFAULT_WINDOW = 1024  # tokens per window at most (capped by the model's context length)


def windows(n: int, window: int, stride: int) -> Iterator[tuple[int, int, int]]:
    """(begin, end, first_scored) for each window over n tokens — HF's perplexity recipe.

    Windows start at 0, stride, 2·stride, ... and end at min(begin + window, n); the last one reaches n.
    Each window scores only the tokens not scored before (positions ≥ the previous window's end, and never
    its own first position, which nothing in the window predicts); the rest of the window is context.
    With stride < window every token but the first is scored exactly once.
    """
    prev_end = 0
    for begin in range(0, n, stride):
        end = min(begin + window, n)
        yield begin, end, max(prev_end, begin + 1)
        prev_end = end
        if end == n:
            break


def _window_defaults(model, window: int | None, stride: int | None) -> tuple[int, int]:
    ctx = model.context_length
    if window is None:
        window = min(DEFAULT_WINDOW, ctx) if ctx else DEFAULT_WINDOW
    if not checks.is_int(window) or window < 2:
        raise ValueError(f"window: must be an integer >= 2, got {window!r}")
    if ctx is not None and window > ctx:
        raise ValueError(f"window: must be <= the model's context length {ctx}, got {window}")
    if stride is None:
        stride = max(1, window // 2)
    if not checks.is_int(stride) or not 1 <= stride <= window:
        raise ValueError(f"stride: must be an integer in [1, window={window}], got {stride!r}")
    return window, stride


def _progress(total: int, enabled: bool, description: str):
    if not enabled or total <= 1:
        return None
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeRemainingColumn(), console=Console(stderr=True), transient=True)
    progress.start()
    progress.add_task(description, total=total)
    return progress


@torch.inference_mode()
@accepts_parts
def evaluate(model, text: str, window: int | None = None, stride: int | None = None, tokens: bool = False,
             progress: bool = False, model_name: str | None = None, chunk: int = 256) -> Evaluation:
    """Perplexity of `text` (and, with tokens=True, each token's log-probability and rank).

    model: an `lmhead.Model`; its `body` gives the hidden states [1,t,D] of each window and its
    `exact_head` (the full-precision head, whatever head `generate` uses) scores them.
    The text is tokenized with the tokenizer's defaults (BOS included if the tokenizer adds it), as
    transformers' `model(ids, labels=ids).loss` does; perplexity = exp(mean over predicted tokens of
    -log p(token | tokens before it)). The loss is `head.loss` (= linear_cross_entropy, chunked, never the
    [T,V] logits) on the body's hidden states, summed in float64 across windows.

    Long texts: sliding windows of `window` tokens (default min(1024, context length)) moved by `stride`
    (default window // 2); each window scores only its new tokens, the rest is context (see `windows`).
    tokens=True also computes, per predicted token, log p and rank = 1 + #tokens with a larger logit,
    from the head's logits in chunks of `chunk` positions.
    """
    tokenizer, head = model.tokenizer, model.exact_head
    ids = encode_prompt(tokenizer, text, "text")
    window, stride = _window_defaults(model, window, stride)
    if len(ids) < 2:
        raise ValueError("text: needs at least 2 tokens to predict one (got 1)")
    all_ids = torch.tensor([ids], device=model_device(model))
    spans = list(windows(len(ids), window, stride))
    logprob: list[float | None] = [None] * len(ids)
    rank: list[int | None] = [None] * len(ids)
    nll = 0.0
    count = 0
    bar = _progress(len(spans), progress, "perplexity")
    try:
        for begin, end, first in spans:
            chunk_ids = all_ids[:, begin:end]
            hidden = model.hidden_states(chunk_ids)  # [1,t,D], after the final norm
            targets = chunk_ids.clone()
            targets[:, : first - begin] = -100  # context only: not scored here
            n = int((targets[:, 1:] != -100).sum())
            if n:
                loss = head.loss(hidden, targets, shift=True, reduction="sum")
                nll += float(loss.double())
                count += n
                if tokens:
                    _score_window(head, hidden[0], chunk_ids[0], first - begin, begin, logprob, rank, chunk)
            if bar is not None:
                bar.advance(bar.task_ids[0])
    finally:
        if bar is not None:
            bar.stop()
    if count == 0:
        raise ValueError("text: no token could be scored")
    mean = nll / count
    scores = None
    if tokens:
        texts = token_texts(tokenizer, ids)
        segments = text_segments(tokenizer, text, ids)
        scores = [TokenScore(position=i, token_id=t, text=s, decoded=d, segment=g, logprob=logprob[i], rank=rank[i])
                  for i, (t, (s, d), g) in enumerate(zip(ids, texts, segments, strict=True))]
    return Evaluation(model=model_name_of(model, model_name), perplexity=math.exp(mean), loss=mean,
                      token_count=len(ids), scored_count=count, window=window, stride=stride,
                      windows=len(spans), tokens=scores)


def text_segments(tokenizer, text: str, ids: Sequence[int]) -> list[str]:
    """Split `text` into one (possibly empty) piece per token of `ids`, so that "".join(pieces) == text.

    From the fast tokenizer's character offsets: each token takes the characters from where the previous
    token ended up to its own end (a character split over several byte tokens goes to the first of them;
    special tokens such as <bos> take none; characters the tokenizer dropped go to the next token, the tail
    to the last). Without offsets: the text each token adds when decoded after the ones before it.
    """
    offsets = None
    try:
        enc = tokenizer(text, return_offsets_mapping=True)
        if list(enc["input_ids"]) == list(ids):
            offsets = enc["offset_mapping"]
    except (NotImplementedError, ValueError, TypeError, KeyError):
        offsets = None
    pieces: list[str] = []
    if offsets is not None:
        cursor = 0
        for start, end in offsets:
            if end > cursor and end > start:
                pieces.append(text[cursor:end])
                cursor = end
            else:
                pieces.append("")
        if pieces:
            pieces[-1] += text[cursor:]
        return pieces
    specials = special_ids(tokenizer)
    kept = [t for t in ids if t not in specials]
    prev = ""
    for i in range(len(ids)):  # quadratic, but only for tokenizers without offsets
        now = tokenizer.decode(kept[: sum(1 for t in ids[: i + 1] if t not in specials)],
                               clean_up_tokenization_spaces=False)
        if now.startswith(prev) and not now.endswith("\ufffd"):  # a partial character waits for the next token
            pieces.append(now[len(prev):])
            prev = now
        else:
            pieces.append("")
    return pieces


def _score_window(head, hidden: torch.Tensor, ids: torch.Tensor, first: int, offset: int,
                  logprob: list, rank: list, chunk: int) -> None:
    """Fill logprob/rank for window positions first..t-1 (predicted from the position before each)."""
    t = ids.shape[0]
    for s in range(first, t, chunk):
        e = min(s + chunk, t)
        logits = head(hidden[None, s - 1 : e - 1]).reshape(e - s, -1).float()  # [c,V]
        target = ids[s:e]
        tl = logits.gather(-1, target[:, None])  # [c,1]
        lp = tl[:, 0] - torch.logsumexp(logits, dim=-1)
        rk = (logits > tl).sum(-1) + 1
        for j in range(e - s):
            logprob[offset + s + j] = float(lp[j])
            rank[offset + s + j] = int(rk[j])


@accepts_parts
def perplexity(model, text: str, window: int | None = None, stride: int | None = None,
               progress: bool = False) -> float:
    """exp(mean next-token loss) of `text` under `model` (an `lmhead.Model`); see `evaluate` for
    tokenization, windows and the loss."""
    return evaluate(model, text, window=window, stride=stride, progress=progress).perplexity


@accepts_parts
def score_tokens(model, text: str, window: int | None = None, stride: int | None = None,
                 progress: bool = False) -> list[TokenScore]:
    """Per token {position, token_id, text, logprob, rank} (the GLTR view); the first token has None."""
    ev = evaluate(model, text, window=window, stride=stride, tokens=True, progress=progress)
    assert ev.tokens is not None
    return ev.tokens
