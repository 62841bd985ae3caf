"""Plain, obviously-correct implementations: the ground truth for every fast path in lmhead.

Each function here is written for clarity, not speed — full-vocabulary sorts, full [N,V] logits, Python loops
where they make the definition plain. Tests compare lmhead's fast paths against these with
`torch.testing.assert_close` at per-dtype tolerances (see `TOLERANCES`).
"""

from __future__ import annotations

import math

import torch

# (rtol, atol) per dtype, used by tests that compare a fast path with its reference.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-6),
    torch.float64: (1e-10, 1e-12),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (5e-3, 5e-3),
}


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    rtol, atol = TOLERANCES[dtype]
    return {"rtol": rtol, "atol": atol}


# --- head -------------------------------------------------------------------------------------------------


def lm_head_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   softcap: float | None = None, logits_to_keep: int = 0) -> torch.Tensor:
    """The LM head by definition: keep the last k positions, `F.linear` in the weight's dtype, upcast to
    float32 (float64 stays float64), then softcap·tanh(logits/softcap). [..., T, D] -> [..., T', V]."""
    if logits_to_keep:
        hidden = hidden[..., -logits_to_keep:, :]
    logits = torch.nn.functional.linear(hidden, weight, bias)
    logits = logits.double() if logits.dtype == torch.float64 else logits.float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return logits


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ weight[out, in]ᵀ + bias in float64, returned in x's dtype: the ground truth for the body's
    oneDNN linears (lmhead.models.fast_linear)."""
    y = x.double() @ weight.double().T
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)


# --- sampling ---------------------------------------------------------------------------------------------
# One row at a time, full-vocabulary sorts, Python loops: the definitions of lmhead.sampling's steps.


def sampling_bias(row: torch.Tensor, logit_bias: dict | None, banned: tuple = ()) -> torch.Tensor:
    """Step 1 on one row [V]: add each bias, then ban."""
    out = row.float().clone()
    for tok, val in (logit_bias or {}).items():
        out[tok] = out[tok] + val
    for tok in banned:
        out[tok] = float("-inf")
    return out


def sampling_penalties(row: torch.Tensor, prev: list[int], prompt_len: int, repetition: float = 1.0,
                       presence: float = 0.0, frequency: float = 0.0) -> torch.Tensor:
    """Step 2 on one row [V]; `prev` is the prompt followed by the generated tokens (no padding)."""
    out = row.float().clone()
    for tok in set(prev):  # repetition (CTRL): once per token seen anywhere
        out[tok] = out[tok] / repetition if out[tok] > 0 else out[tok] * repetition
    generated = prev[prompt_len:]
    for tok in set(generated):  # OpenAI: generated tokens only
        count = generated.count(tok)
        out[tok] = out[tok] - count * frequency - presence
    return out


def sampling_top_k(row: torch.Tensor, k: int) -> torch.Tensor:
    """Keep every logit ≥ the k-th largest (ties with it kept); k = 0 or ≥ V keeps all."""
    if k <= 0 or k >= row.numel():
        return row.clone()
    kth = torch.sort(row, descending=True).values[k - 1]
    return torch.where(row >= kth, row, torch.tensor(float("-inf")))


def sampling_top_p(row: torch.Tensor, p: float) -> torch.Tensor:
    """Keep token i iff the probability mass of the tokens strictly more probable than i is < p."""
    if p >= 1.0:
        return row.clone()
    probs = torch.softmax(row.double(), dim=-1).tolist()
    values, order = torch.sort(row, descending=True)
    values, order = values.tolist(), order.tolist()
    keep = [False] * row.numel()
    mass_above = 0.0  # mass of strictly larger values
    i = 0
    while i < len(values):
        j = i
        while j < len(values) and values[j] == values[i]:
            j += 1
        group = order[i:j]
        for tok in group:
            keep[tok] = mass_above < p or i == 0
        mass_above += sum(probs[tok] for tok in group)
        i = j
    return torch.where(torch.tensor(keep), row, torch.tensor(float("-inf")))


def sampling_min_p(row: torch.Tensor, min_p: float) -> torch.Tensor:
    """Keep tokens with p ≥ min_p · p_max, in float32 as HF computes it (a min_p so small that min_p · p_max
    underflows to 0 keeps every token)."""
    if min_p <= 0:
        return row.clone()
    probs = torch.softmax(row.float(), dim=-1)
    return torch.where(probs >= min_p * probs.max(), row, torch.tensor(float("-inf")))


def sampling_process(logits: torch.Tensor, configs: list, prev: list[list[int]] | None = None,
                     prompt_len: list[int] | None = None) -> torch.Tensor:
    """The whole pipeline (steps 1-6), row by row. configs: one SamplingConfig per row."""
    rows = []
    for b, cfg in enumerate(configs):
        row = sampling_bias(logits[b], dict(cfg.logit_bias or {}), tuple(cfg.banned_tokens))
        if prev is not None:
            row = sampling_penalties(row, prev[b], (prompt_len or [0] * len(configs))[b],
                                     cfg.repetition_penalty, cfg.presence_penalty, cfg.frequency_penalty)
        if cfg.temperature < 1e-5:  # greedy: only the (first) argmax survives
            out = torch.full_like(row, float("-inf"))
            arg = int(torch.argmax(row))
            out[arg] = row[arg]
            rows.append(out)
            continue
        row = row / cfg.temperature
        row = sampling_top_k(row, cfg.top_k)
        row = sampling_top_p(row, cfg.top_p)
        row = sampling_min_p(row, cfg.min_p)
        rows.append(row)
    return torch.stack(rows)


def sampling_typical(row: torch.Tensor, mass: float) -> torch.Tensor:
    """Locally typical sampling by its definition (Meister et al.; transformers' rule for the edge): tokens in order
    of |−log p − H|, kept up to and including the first whose cumulative mass reaches `mass`, ties of that score
    kept with it."""
    if mass >= 1.0:
        return row
    probs = torch.softmax(row.double(), dim=-1).tolist()
    h = -sum(q * math.log(q) for q in probs if q > 0)
    score = [abs(-math.log(q) - h) if q > 0 else math.inf for q in probs]
    order = sorted(range(len(probs)), key=lambda i: score[i])
    total, last = 0.0, order[-1]
    for i in order:
        total += probs[i]
        if total >= mass:
            last = i
            break
    keep = {i for i in range(len(probs)) if score[i] <= score[last]} | {order[0]}
    return torch.tensor([v if i in keep else -math.inf for i, v in enumerate(row.tolist())])


def sampling_top_n_sigma(row: torch.Tensor, n: float) -> torch.Tensor:
    """llama.cpp's top-nσ: keep logits ≥ max − n·σ, σ the population standard deviation of the finite logits."""
    vals = [v for v in row.tolist() if math.isfinite(v)]
    if n <= 0 or len(vals) <= 1:
        return row
    mean = sum(vals) / len(vals)
    sigma = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals))
    floor = max(vals) - n * sigma
    return torch.tensor([v if v >= floor else -math.inf for v in row.tolist()])


def sampling_xtc(row: torch.Tensor, threshold: float) -> torch.Tensor:
    """XTC with its coin thrown: of the tokens with p ≥ threshold, all but the least probable are removed (none
    when fewer than two reach it; among ties for least probable, the highest id stays)."""
    probs = torch.softmax(row.double(), dim=-1).tolist()
    above = [i for i, q in enumerate(probs) if q >= threshold]
    if len(above) < 2:
        return row
    stay = max(above, key=lambda i: (-probs[i], i))
    return torch.tensor([-math.inf if i in above and i != stay else v for i, v in enumerate(row.tolist())])


def sampling_top_a(row: torch.Tensor, a: float) -> torch.Tensor:
    """Drop p < a · p_max² (text-generation-webui's TopALogitsWarper), p in float64 from the row as it comes."""
    probs = torch.softmax(row.double(), dim=-1).tolist()
    bound = a * max(probs) ** 2
    return torch.tensor([v if q >= bound else -math.inf for v, q in zip(row.tolist(), probs, strict=True)])


def sampling_epsilon(row: torch.Tensor, epsilon: float) -> torch.Tensor:
    """Drop p < ε, keep the most probable token (and its ties)."""
    probs = torch.softmax(row.double(), dim=-1)
    top = float(row.max())
    return torch.tensor([v if (q >= epsilon or v >= top) else -math.inf
                         for v, q in zip(row.tolist(), probs.tolist(), strict=True)])


def sampling_eta(row: torch.Tensor, eta: float) -> torch.Tensor:
    """Drop p < min(η, √η·e^−H), H the entropy; keep the most probable token."""
    h = sampling_entropy(row)
    return sampling_epsilon(row, min(eta, math.sqrt(eta) * math.exp(-h)))


def sampling_dry(row: torch.Tensor, history: list[int], multiplier: float, base: float, allowed: int,
                 last_n: int, breakers: tuple = ()) -> torch.Tensor:
    """DRY by brute force: for each earlier end position j of the (last_n) history, the longest n such that the n
    tokens ending at j equal the n tokens ending the history (none of them a breaker); the token after j is then
    penalised by multiplier · base^(n − allowed) when n ≥ allowed (the longest n per token)."""
    tail = history if last_n < 0 else history[len(history) - min(last_n, len(history)):]
    out = row.clone()
    best: dict[int, int] = {}
    for j in range(len(tail) - 1):  # the earlier sequence ends at j, followed by tail[j + 1]
        n = 0
        while n <= j and tail[j - n] == tail[len(tail) - 1 - n] and tail[len(tail) - 1 - n] not in breakers:
            n += 1
        if n >= allowed:
            best[tail[j + 1]] = max(best.get(tail[j + 1], 0), n)
    for tok, n in best.items():
        out[tok] = out[tok] - multiplier * base ** (n - allowed)
    return out


def sampling_no_repeat_ngram(row: torch.Tensor, history: list[int], size: int) -> torch.Tensor:
    """Ban every token that would make the last `size` tokens an n-gram already seen in the history."""
    out = row.clone()
    if size <= 0 or len(history) < size - 1:
        return out
    tail = history[len(history) - (size - 1):] if size > 1 else []
    for i in range(len(history) - size + 1):
        if history[i:i + size - 1] == tail:
            out[history[i + size - 1]] = -math.inf
    return out


def sampling_dynatemp(row: torch.Tensor, temperature: float, spread: float, exponent: float) -> torch.Tensor:
    """llama.cpp's dynamic temperature: T' = max(0, T − spread) + (T + spread − max(0, T − spread))·(H / ln n)^e
    over the n finite logits; row / T'."""
    n = sum(1 for v in row.tolist() if math.isfinite(v))
    if n <= 1:
        return row / temperature
    low, high = max(0.0, temperature - spread), temperature + spread
    return row / (low + (high - low) * (sampling_entropy(row) / math.log(n)) ** exponent)


def sampling_mirostat(row: torch.Tensor, version: int, mu: float) -> torch.Tensor:
    """One mirostat cut at bound μ (llama.cpp). v2: keep tokens with −log2 p ≤ μ (at least the top one). v1: fit
    the Zipf exponent s on the top 100 probabilities (least squares through the origin of log(p_i / p_i+1) on
    log((i + 2) / (i + 1))), k = ((s − 1)·2^μ / (1 − V^(1 − s)))^(1/s), keep the top k."""
    probs = sorted(torch.softmax(row.double(), dim=-1).tolist(), reverse=True)
    if version == 2:
        full = torch.softmax(row.double(), dim=-1).tolist()
        top = max(row.tolist())
        return torch.tensor([v if (q > 0 and -math.log2(q) <= mu) or v == top else -math.inf
                             for v, q in zip(row.tolist(), full, strict=True)])
    m = min(99, len(probs) - 1)
    ts = [math.log((i + 2) / (i + 1)) for i in range(m)]
    bs = [math.log(probs[i] / probs[i + 1]) for i in range(m)]
    s = sum(a * b for a, b in zip(ts, bs, strict=True)) / sum(a * a for a in ts)
    k = max(int(((s - 1) * 2 ** mu / (1 - len(probs) ** (1 - s))) ** (1 / s)), 1)
    return sampling_top_k(row, k) if k < len(probs) else row


def sampling_bad_words(row: torch.Tensor, history: list[int], bad_words) -> torch.Tensor:
    """Ban the last token of each sequence whose other tokens end the history (one-token sequences always)."""
    out = row.clone()
    for seq in bad_words:
        seq = list(seq)
        if len(seq) == 1 or history[len(history) - len(seq) + 1:] == seq[:-1]:
            out[seq[-1]] = -math.inf
    return out


def sampling_chain(row: torch.Tensor, cfg, history: list[int] | None = None, prompt_len: int = 0,
                   mu: float | None = None, xtc: bool = True) -> torch.Tensor:
    """One row through cfg's chain by these plain steps, in lmhead's order or cfg.samplers (mirostat: masks,
    temperature, mirostat at μ, default 2·τ; XTC with its coin `xtc`). The masks: bias and bans, allowed ids, bad
    words, min tokens."""
    history = list(history or [])
    row = sampling_bias(row.float(), dict(cfg.logit_bias or {}), tuple(cfg.banned_tokens))
    if cfg.allowed_token_ids is not None:
        row = torch.tensor([v if i in cfg.allowed_token_ids else -math.inf for i, v in enumerate(row.tolist())])
    row = sampling_bad_words(row, history, cfg.bad_words)
    if len(history) - prompt_len < cfg.min_tokens:
        row = row.clone()
        row[list(cfg.stop_token_ids)] = -math.inf
    plain = {
        "penalties": lambda r: sampling_penalties(r, history, prompt_len, cfg.repetition_penalty,
                                                  cfg.presence_penalty, cfg.frequency_penalty),
        "dry": lambda r: sampling_dry(r, history, cfg.dry_multiplier, cfg.dry_base, cfg.dry_allowed_length,
                                      cfg.dry_penalty_last_n, cfg.dry_sequence_breakers)
        if cfg.dry_multiplier > 0 and cfg.dry_penalty_last_n != 0 else r,
        "no_repeat_ngram": lambda r: sampling_no_repeat_ngram(r, history, cfg.no_repeat_ngram_size),
        "temperature": lambda r: (sampling_dynatemp(r, cfg.temperature, cfg.dynatemp_range, cfg.dynatemp_exponent)
                                  if cfg.dynatemp_range > 0 else r / cfg.temperature),
        "top_k": lambda r: sampling_top_k(r, cfg.top_k),
        "typical_p": lambda r: sampling_typical(r, cfg.typical_p),
        "top_p": lambda r: sampling_top_p(r, cfg.top_p),
        "min_p": lambda r: sampling_min_p(r, cfg.min_p),
        "top_a": lambda r: sampling_top_a(r, cfg.top_a) if cfg.top_a > 0 else r,
        "top_n_sigma": lambda r: sampling_top_n_sigma(r, cfg.top_n_sigma),
        "xtc": lambda r: sampling_xtc(r, cfg.xtc_threshold)
        if xtc and cfg.xtc_probability > 0 and cfg.xtc_threshold <= 0.5 else r,
        "epsilon": lambda r: sampling_epsilon(r, cfg.epsilon_cutoff) if cfg.epsilon_cutoff > 0 else r,
        "eta": lambda r: sampling_eta(r, cfg.eta_cutoff) if cfg.eta_cutoff > 0 else r,
    }
    if cfg.mirostat:
        row = plain["temperature"](row)
        return sampling_mirostat(row, cfg.mirostat, 2 * cfg.mirostat_tau if mu is None else mu)
    order = cfg.samplers or ("penalties", "dry", "no_repeat_ngram", "temperature", "top_k", "typical_p", "top_p",
                             "min_p", "top_a", "top_n_sigma", "xtc", "epsilon", "eta")
    if cfg.temperature < 1e-5:
        for name in order:
            if name in ("penalties", "dry", "no_repeat_ngram"):
                row = plain[name](row)
        out = torch.full_like(row, -math.inf)
        out[int(torch.argmax(row))] = row[int(torch.argmax(row))]
        return out
    for name in order:
        row = plain[name](row)
    return row


def sampling_chain_probabilities(row: torch.Tensor, cfg, history: list[int] | None = None,
                                 prompt_len: int = 0) -> torch.Tensor:
    """The distribution a draw of `sampling_chain` follows: with XTC, (1 − P)·p(coin off) + P·p(coin on)."""
    on = torch.softmax(sampling_chain(row, cfg, history, prompt_len, xtc=True).double(), dim=-1)
    if cfg.xtc_probability <= 0 or cfg.xtc_threshold > 0.5:
        return on
    off = torch.softmax(sampling_chain(row, cfg, history, prompt_len, xtc=False).double(), dim=-1)
    return (1 - cfg.xtc_probability) * off + cfg.xtc_probability * on


def sampling_entropy(row: torch.Tensor) -> float:
    """-Σ p log p in nats, skipping p = 0."""
    probs = torch.softmax(row.double(), dim=-1)
    return -sum(float(q) * float(torch.log(q)) for q in probs if q > 0)


# --- loss -------------------------------------------------------------------------------------------------


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         bias: torch.Tensor | None = None, ignore_index: int = -100, reduction: str = "mean",
                         label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: float | None = None,
                         shift: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, lse) by definition, on the full logits: `lm_head_logits`, then `F.cross_entropy` per token
    (torch's label smoothing), + z_loss·logsumexp² per non-ignored token. shift=True scores position t against
    targets[..., t+1]. "mean" divides by the number of non-ignored tokens; with none of them the loss is 0
    (F.cross_entropy would give NaN). lse is 0 at ignored positions."""
    if shift:
        hidden, targets = hidden[..., :-1, :], targets[..., 1:]
    logits = lm_head_logits(hidden, weight, bias, softcap)
    x = logits.reshape(-1, logits.shape[-1])
    t = targets.reshape(-1)
    per_token = torch.nn.functional.cross_entropy(x, t, ignore_index=ignore_index, reduction="none",
                                                  label_smoothing=label_smoothing)
    keep = t != ignore_index
    lse = torch.logsumexp(x, dim=-1) * keep
    per_token = per_token + z_loss * lse**2
    if reduction == "none":
        loss = per_token.reshape(targets.shape)
    elif reduction == "sum":
        loss = per_token.sum()
    else:
        loss = per_token.sum() / keep.sum().clamp(min=1)
    return loss, lse.reshape(targets.shape)


# --- distributed ------------------------------------------------------------------------------------------

def vocab_shards(tensor: torch.Tensor, world_size: int, dim: int = 0) -> list[torch.Tensor]:
    """The vocabulary split of lmhead.distributed: rank r holds `torch.tensor_split(x, world_size)[r]`."""
    return list(torch.tensor_split(tensor, world_size, dim=dim))


def full_vocab_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                             reduction: str = "mean", label_smoothing: float = 0.0, z_loss: float = 0.0,
                             softcap: float | None = None) -> torch.Tensor:
    """The single-process definition the vocab-parallel losses must equal: softcap, then `F.cross_entropy` on
    the full [N,V] logits (computed in float32, float64 kept), plus z_loss·logsumexp² per non-ignored row.
    `mean` over zero non-ignored rows is 0 (F.cross_entropy would give NaN)."""
    x = logits.reshape(-1, logits.shape[-1])
    x = x.double() if x.dtype == torch.float64 else x.float()
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    t = targets.reshape(-1)
    per_row = torch.nn.functional.cross_entropy(x, t, ignore_index=ignore_index, reduction="none",
                                                label_smoothing=label_smoothing)
    keep = t != ignore_index
    if z_loss:
        per_row = per_row + z_loss * torch.logsumexp(x, dim=-1) ** 2 * keep
    per_row = per_row * keep  # ignored rows: exactly 0
    if reduction == "none":
        return per_row.reshape(targets.shape)
    if reduction == "sum":
        return per_row.sum()
    return per_row.sum() / keep.sum().clamp(min=1)


# --- compressed head --------------------------------------------------------------------------------------


def head_topk(hidden: torch.Tensor, weight: torch.Tensor, k: int, bias: torch.Tensor | None = None,
              softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of the plain fp32 head, one row at a time (the decode shape): hidden [N,D] -> ([N,k], [N,k])."""
    rows = [lm_head_logits(h[None].float(), weight.float(), bias, softcap)[0] for h in hidden]
    values, ids = zip(*(torch.topk(r, k) for r in rows), strict=True)
    return torch.stack(values), torch.stack(ids)


def int8_rowwise_dequant(weight: torch.Tensor) -> torch.Tensor:
    """Symmetric absmax int8 per row with a bf16 scale, dequantised: what the int8 kernel multiplies by."""
    w = weight.double()
    scale = (w.abs().amax(1) / 127).to(torch.bfloat16).double()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(w / scale[:, None]).clamp(-127, 127) * scale[:, None]


def approx_logits_exact_arithmetic(hidden: torch.Tensor, dequant_weight: torch.Tensor) -> torch.Tensor:
    """Σ_j ŵ_ij·bf16(h)_j in float64: the kernel's result before its fp32 accumulation and bf16 output."""
    return hidden.to(torch.bfloat16).double() @ dequant_weight.double().T

# --- explain ----------------------------------------------------------------------------------------------


def hf_sliding_window_nll(hf_model, input_ids: torch.Tensor, window: int, stride: int) -> tuple[float, int]:
    """(sum of next-token NLL, tokens scored) by transformers' perplexity recipe, on full logits.

    The recipe of HF's "Perplexity of fixed-length models" guide: windows [begin, begin+window) for
    begin = 0, stride, ...; labels = ids with the already-scored prefix set to -100; `model(ids, labels=...)`.
    Unlike the guide (which weights each window's mean loss by `trg_len - 1`), the number of tokens the loss
    actually averaged is counted, so the result is the exact mean over scored tokens.
    """
    n = input_ids.shape[1]
    total, count, prev_end = 0.0, 0, 0
    for begin in range(0, n, stride):
        end = min(begin + window, n)
        trg_len = end - prev_end
        ids = input_ids[:, begin:end]
        labels = ids.clone()
        labels[:, :-trg_len] = -100
        scored = int((labels[:, 1:] != -100).sum())
        if scored:
            with torch.no_grad():
                loss = hf_model(input_ids=ids, labels=labels).loss
            total += float(loss.double()) * scored
            count += scored
        prev_end = end
        if end == n:
            break
    return total, count


# --- generate ---------------------------------------------------------------------------------------------


def generate_plain(hf_model, tokenizer, prompt: str, max_new_tokens: int, config, eos_ids) -> list[int]:
    """The decode loop without a KV cache: each step runs transformers on the whole sequence so far, takes the
    last position's logits and hands them to `lmhead.sampling.sample` (step = tokens generated so far; one
    RowState carried from step to step for stateful steps). Stops after an end-of-sequence id or `max_new_tokens`
    tokens."""
    from lmhead.sampling import RowState, sample

    prompt_ids = list(tokenizer(prompt)["input_ids"])
    seq = list(prompt_ids)
    out: list[int] = []
    state = [RowState()]
    for step in range(max_new_tokens):
        with torch.no_grad():
            logits = hf_model(torch.tensor([seq])).logits[:, -1, :].float()
        token = int(sample(logits, config, prev_tokens=[seq], prompt_len=len(prompt_ids), step=step, state=state)[0])
        out.append(token)
        seq.append(token)
        if token in eos_ids:
            break
    return out


def sampling_draw_probabilities(logits: torch.Tensor, configs: list, prev: list[list[int]] | None = None,
                                prompt_len: list[int] | None = None) -> torch.Tensor:
    """The distribution each row's draw must follow ([B,V] float64): softmax over the tokens that
    `sampling_process` keeps, in float64 (cut tokens 0)."""
    return torch.softmax(sampling_process(logits, configs, prev, prompt_len).double(), dim=-1)


def draws_fit(ids: torch.Tensor, probs: torch.Tensor, groups: int = 20, sigmas: float = 5.0) -> str:
    """Goodness of fit of draws `ids` [n] to `probs` [V]: tokens are grouped, in id order, into about `groups`
    groups of similar expected count; every group's frequency must lie within `sigmas` standard deviations of
    its probability, and a token of probability 0 is never drawn. Returns '' when they fit, else why not."""
    n = ids.numel()
    if bool((probs[ids] == 0).any()):
        return f"drew a token of probability 0: {ids[probs[ids] == 0][:5].tolist()}"
    counts = torch.bincount(ids, minlength=probs.numel()).double()
    group = (probs.cumsum(0) * groups).floor().clamp(max=groups - 1).long()  # id-ordered groups of mass ≈ 1/g
    expected = torch.zeros(groups, dtype=torch.float64).index_add_(0, group, probs)
    seen = torch.zeros(groups, dtype=torch.float64).index_add_(0, group, counts) / n
    sigma = (expected * (1 - expected) / n).sqrt()
    bad = (seen - expected).abs() > sigmas * sigma + 1e-12
    return f"group frequencies {seen[bad].tolist()} against {expected[bad].tolist()}" if bool(bad.any()) else ""


# --- GGUF codes ---------------------------------------------------------------------------------------------


def coded_weight(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None = None) -> torch.Tensor:
    """The matrix the codes stand for, in float64: W[n, k] = scale[n, k // G] · codes[n, k] + offset[n, k // G]."""
    group = codes.shape[1] // scale.shape[1]
    w = codes.double() * scale.double().repeat_interleave(group, dim=1)
    if offset is not None:
        w = w + offset.double().repeat_interleave(group, dim=1)
    return w


def subscale_numbers(d: torch.Tensor, sub: torch.Tensor) -> torch.Tensor:
    """A K-quant's group scales (or offsets) [N, K/G] from its blocks' d [N, K/256] and int8 sub [N, K/G]: the
    float32 product d·sub per group, as gguf's dequantiser makes them."""
    return d.float().repeat_interleave(sub.shape[1] // d.shape[1], dim=1) * sub.float()


def group_sliced(x: torch.Tensor) -> torch.Tensor:
    """A row x [K]'s activations as the integer path by groups holds them (float64): per group of 32, d₀ the smallest
    power of two with max|x|/d₀ ≤ 127, d₂ = d₀·2⁻¹⁶, and x̂ = d₂·⌊x/d₂ + ½⌋ (a half step rounds up)."""
    x = x.double().view(-1, 32)
    mx = x.abs().amax(1)
    d0 = torch.ones_like(mx)
    nz = mx > 0
    d0[nz] = torch.exp2(torch.ceil(torch.log2(mx[nz] / 127)))
    d2 = (d0 * 2.0 ** -16)[:, None]
    return (torch.floor(x / d2 + 0.5) * d2).flatten()


def float32_dot_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[M, N]: how far a float32 dot product of x [M, K] and w [N, K] may be from the exact one, in any order of its
    sums — γ_K·Σ|x|·|w| with γ_K = K·u / (1 − K·u), u = 2⁻²⁴ (Higham's bound), in float64."""
    k = x.shape[-1]
    return (k * 2.0 ** -24 / (1 - k * 2.0 ** -24)) * (x.double().abs() @ w.double().abs().T)


def seeded_race(vals: torch.Tensor, ids: torch.Tensor, noise: torch.Tensor) -> int:
    """A seeded row's exponential race, in float64: candidates vals [m] (-inf = dropped) with their ids [m] in any
    order, noise [n] the Exp(1) draws of the n kept ones in id order → the place in vals of the first largest
    e^(v − max) / max(E, float32's tiny) over the kept in id order."""
    kept = torch.isfinite(vals)
    order = [j for _, j in sorted((int(ids[j]), j) for j in range(vals.shape[0]) if kept[j])]
    top = vals[kept].double().max()
    keys = [float((vals[j].double() - top).exp() / max(float(e), torch.finfo(torch.float32).tiny))
            for j, e in zip(order, noise.tolist(), strict=True)]
    return order[keys.index(max(keys))]


def ngram_proposal(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Prompt lookup by definition: for n = max_n … min_n, every earlier start s of the last n tokens (s + n <
    len), the latest one wins; the k tokens after it. [] when no suffix occurred before."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        tail = tokens[-n:]
        starts = [s for s in range(len(tokens) - n) if tokens[s:s + n] == tail]
        if starts:
            s = max(starts)
            return tokens[s + n:s + n + k]
    return []


def attention_step(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
                   values: torch.Tensor, mask: torch.Tensor | None, start: int, scaling: float,
                   softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's attention for T new tokens, plainly: rope on the q and k heads of `qk` [B,T,H+Hkv,hd] (x·cos +
    rotate_half(x)·sin, the signed sin given: (x₂, x₁)·sin), k and v [B,T,Hkv,hd] written at the cache's columns
    start..start+T of keys, values [B,Hkv,cap,hd], then per query head (key head h // (H/Hkv)) softmax(q·k·scaling
    (softcap·tanh(·/softcap) when softcap > 0) + mask [B,T,L]) · v over the L = start+T columns.
    → (out [B,T,H·hd], keys, values) — new tensors, the inputs unchanged."""
    b, t, heads, hd = qk.shape
    hkv = v.shape[2]
    h = heads - hkv
    keys, values = keys.clone(), values.clone()
    roped = qk * cos[:, :, None] + qk.unflatten(-1, (2, -1)).flip(-2).flatten(-2) * sin[:, :, None]
    keys[:, :, start:start + t] = roped[:, :, h:].transpose(1, 2)
    values[:, :, start:start + t] = v.transpose(1, 2)
    q = roped[:, :, :h].transpose(1, 2).double()                                    # [B,H,T,hd]
    kk = keys[:, :, :start + t].repeat_interleave(h // hkv, dim=1).double()
    vv = values[:, :, :start + t].repeat_interleave(h // hkv, dim=1).double()
    scores = q @ kk.transpose(-1, -2) * scaling
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores + mask[:, None].double()
    out = (torch.softmax(scores, -1) @ vv).transpose(1, 2).reshape(b, t, h * hd)
    return out.float(), keys, values


# --- structured output ------------------------------------------------------------------------------------


def constrained_allowed(token_bytes: list[bytes], prefix: bytes, language: list[bytes], eos: set[int]) -> set[int]:
    """The tokens a grammar over the finite `language` allows after the text `prefix`, by brute force: token t
    (its bytes token_bytes[t]; b"" for special tokens, never allowed) iff prefix + its bytes begins a word of
    the language; an end-of-sequence id iff prefix is a word."""
    out = {t for t, b in enumerate(token_bytes) if b and any(w.startswith(prefix + b) for w in language)}
    if prefix in language:
        out |= eos
    return out


def forced_bytes(prefix: bytes, language: list[bytes]) -> bytes:
    """The bytes every word of `language` that begins with `prefix` continues with (their longest common prefix
    after it); b"" where the words branch at once or `prefix` is itself a word (then the text may end)."""
    rest = [w[len(prefix):] for w in language if w.startswith(prefix)]
    if not rest or b"" in rest:
        return b""
    n = 0
    while all(len(r) > n and r[n] == rest[0][n] for r in rest):
        n += 1
    return rest[0][:n]


def constrained_logprobs(logits: torch.Tensor, allowed: set[int], temperature: float = 1.0) -> torch.Tensor:
    """The constrained distribution in closed form: log softmax(logits / T) over the allowed tokens, -inf
    elsewhere. logits [V] → [V] float64."""
    x = logits.double() / temperature
    keep = torch.zeros_like(x, dtype=torch.bool)
    keep[sorted(allowed)] = True
    x = x.masked_fill(~keep, float("-inf"))
    return x - torch.logsumexp(x, dim=0)
