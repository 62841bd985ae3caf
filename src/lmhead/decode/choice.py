"""The plain loop's choice of a row's next token, and what a row's config declares about it.

    plain_choice        `sampling.sample` (or `sample_with_logprobs`) over each row's logits with its history,
                        prompt length and step: the token the plain loop gives, whatever the batch
    is_plain            every step the row runs has the C backend (temperature, top-k, top-p, min-p)
    is_plain_greedy     ... and greedy: its token is the argmax of the raw logits
    is_plain_unseeded   ... and sampled without a seed: `native.sample_row` draws it
    is_plain_seeded     ... and sampled with a seed: `sampling.draw.seeded_top_p_row` draws its top-p rows
    is_deterministic    greedy or seeded: the choice is a function of the logits and (seed, step)
    is_stateful         a step keeps state between tokens (mirostat's μ): one plain step a round
"""

from __future__ import annotations

from torch import Tensor


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


def is_plain_greedy(config) -> bool:
    """A greedy row without bias, bans or penalties: its token is the argmax of the raw logits."""
    return config.is_greedy and is_plain(config)


def is_plain_unseeded(config) -> bool:
    """A sampled row without a seed, bias, bans or penalties: `native.sample_row` draws it."""
    return not config.is_greedy and config.seed is None and is_plain(config)


def is_plain_seeded(config) -> bool:
    """A sampled row with a seed and no bias, bans or penalties (`sampling.draw.seeded_top_p_row` draws its top-p
    rows)."""
    return not config.is_greedy and config.seed is not None and is_plain(config)


def is_deterministic(config) -> bool:
    """Greedy and seeded rows: the plain sampler's choice is a function of the logits and (seed, step)."""
    return config.is_greedy or config.seed is not None
