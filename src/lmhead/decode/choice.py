"""The plain loop's choice of a row's next token, and what a row's config declares about it.

    plain_choice        `sampling.sample` (or `sample_with_logprobs`) over each row's logits with its history,
                        prompt length and step: the token the plain loop gives, whatever the batch
    plain_round         a decode round's choice and scores: the C passes where they serve, else `plain_choice`
    is_plain            every step the row runs has the C backend (temperature, top-k, top-p, min-p)
    is_plain_greedy     ... and greedy: its token is the argmax of the raw logits
    is_plain_unseeded   ... and sampled without a seed: `native.sample_row` draws it
    is_plain_seeded     ... and sampled with a seed: `sampling.draw.seeded_row` draws its top-p and top-k rows
    is_deterministic    greedy or seeded: the choice is a function of the logits and (seed, step)
    is_stateful         a step keeps state between tokens (mirostat's μ): one plain step a round
"""

from __future__ import annotations

import torch
from torch import Tensor

from lmhead.kernels.native import greedy_rows, sample_row
from lmhead.sampling.draw import seeded_row
from lmhead.sampling.pipeline import sample_plain_rows


def is_plain(config) -> bool:
    """Every step the row runs declares the C backend (``SamplingConfig.runs_on("c")``: temperature, top-k, top-p,
    min-p, in lmhead's order; no masks, penalties or other steps): the row's logits reach its cut-offs as the head
    gave them, and its choice reads only what those cut-offs read."""
    return config.runs_on("c")


def is_stateful(config) -> bool:
    """A row with a step that keeps state between tokens (mirostat's μ): it takes plain steps only, one token a
    round, so that its state moves once per token as in the plain loop."""
    return any(s.state for s in config.steps())


def torch_steps(configs) -> str:
    """The names of the steps that keep rows off the C path (for the profile's phase), "" when none."""
    names = sorted({s.name for c in configs if not c.runs_on("c") for s in c.steps() if "c" not in s.backends})
    return ", ".join(names)


def plain_choice(logits: Tensor, configs: list, history, prompt_len, steps: list[int], generator,
                 scored: bool = False, states: list | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """The plain loop's next token per row of logits [B,V] → ids [B]: `sampling.sample` with each row's
    history (penalties), its prompt length and the step of its token (rows that joined the batch at other times
    are at other steps). One config for all rows when they share one object, so the pipeline takes its
    whole-batch path. scored: (ids, each id's processed logprob [B]) from `sampling.sample_with_logprobs`
    (`sample`'s ids, but for unseeded top-p-alone rows, drawn from the same distribution another way). states: one
    `sampling.RowState` per row, moved by its stateful steps (None where no row has one)."""
    from lmhead.sampling import sample, sample_with_logprobs

    cfg = configs[0] if len({id(c) for c in configs}) == 1 else configs
    draw = sample_with_logprobs if scored else sample
    return draw(logits, cfg, generator=generator, prev_tokens=history,
                prompt_len=prompt_len if history is not None else 0,
                step=steps[0] if len(set(steps)) == 1 else list(steps), state=states)


def plain_round(logits: Tensor, configs: list, history, prompt_len, steps: list[int], generator, states=None,
                unmasked: bool = True) -> tuple[list[list[int]], list[list[float]], list[list[float]] | None, str]:
    """One token per row of logits [B,V] from the plain sampler's distribution (`plain_choice`, scored: seeded and
    greedy rows exactly `sampling.sample`'s ids) → (tokens [[t]], processed logprobs [[lp]], raw logprobs [[v]] or
    None, the steps that kept the round off the C passes: `torch_steps`, "" when none).

    Plain greedy rows, whose argmax and normaliser one C pass finds (`native.greedy_rows`), come with their raw
    logprobs. Plain unseeded sampled rows are drawn by `native.sample_row`, one C call each: the same
    distribution, other ids for the same generator state than `plain_choice`'s — but not in a round with a
    constrained row (`unmasked` False): its inverse CDF may stop on a token of zero mass (u = 0 before the first
    allowed token), so such rounds draw in the pipeline. Plain seeded top-p and top-k rows take
    `sampling.draw.seeded_row`, other rounds of plain rows `sampling.pipeline.sample_plain_rows` (its passes
    without its checks of a history they never read): both `plain_choice`'s own ids and logprobs. The greedy C
    pass takes masked rows (the argmax of the allowed tokens). Rows with a step C does not run (`is_plain` false)
    take the pipeline."""
    if all(is_plain_greedy(c) for c in configs):
        # the argmax of the unprocessed row is `sample`'s choice; one call instead of the pipeline's ~30 torch
        # ops, which after a step that streamed the weights through the caches cost ~1 ms per token
        found = greedy_rows(logits)
        if found is not None:
            ids, raw = found
            return [[t] for t in ids], [[0.0] for _ in configs], [[v] for v in raw], ""
    if unmasked and all(is_plain_unseeded(c) for c in configs):
        # the same distribution from one C call per row (`native.sample_row`: the top-k / top-p cut or the whole
        # row, drawn by inverse CDF with one uniform): the pipeline's ~20 torch ops around its cut cost ~1 ms
        # per token after a step that streamed the weights through the caches
        u = torch.rand(len(configs), dtype=torch.float64, generator=generator).tolist()
        width = logits.shape[1]
        picked = [sample_row(logits[r], c.temperature, c.cut_key(width).top_k, c.top_p, c.min_p, u[r])
                  for r, c in enumerate(configs)]
        if all(p is not None for p in picked):
            return [[t] for t, _ in picked], [[lp] for _, lp in picked], None, ""
    if unmasked and all(is_plain_seeded(c) for c in configs):
        # seeded top-p and top-k rows: the pipeline's own ids and logprobs (C's top-p set or top k, the race over
        # the kept tokens with the row's (seed, step) noise) without its generic passes around them
        picked = [seeded_row(logits[r], c, steps[r]) for r, c in enumerate(configs)]
        if all(p is not None for p in picked):
            return [[t] for t, _ in picked], [[lp] for _, lp in picked], None, ""
    if all(is_plain(c) for c in configs):
        ids, chosen = sample_plain_rows(logits, configs, generator, steps)
    else:
        ids, chosen = plain_choice(logits, configs, history, prompt_len, steps, generator, scored=True,
                                   states=states)
    return [[int(t)] for t in ids.tolist()], [[v] for v in chosen.tolist()], None, torch_steps(configs)


def is_plain_greedy(config) -> bool:
    """A greedy row without bias, bans or penalties: its token is the argmax of the raw logits."""
    return config.is_greedy and is_plain(config)


def is_plain_unseeded(config) -> bool:
    """A sampled row without a seed, bias, bans or penalties: `native.sample_row` draws it."""
    return not config.is_greedy and config.seed is None and is_plain(config)


def is_plain_seeded(config) -> bool:
    """A sampled row with a seed and no bias, bans or penalties (`sampling.draw.seeded_row` draws its top-p and
    top-k rows)."""
    return not config.is_greedy and config.seed is not None and is_plain(config)


def is_deterministic(config) -> bool:
    """Greedy and seeded rows: the plain sampler's choice is a function of the logits and (seed, step)."""
    return config.is_greedy or config.seed is not None
