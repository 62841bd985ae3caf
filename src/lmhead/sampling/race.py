"""The seeded generator of a row (seed, step) and the exponential race over candidates [b,m]."""

from __future__ import annotations

import torch
from torch import Tensor

from lmhead.sampling.rows import draw_whole_rows
from lmhead.sampling.vocab import NEG_INF, Vocab

_MASK64 = (1 << 64) - 1
_AFTER = 1 << 48  # added to a dropped candidate's id: it sorts after every kept one


def _mix_seed(seed: int, step: int) -> int:
    """(seed, step) → a 64-bit generator seed (splitmix64 finaliser, twice): nearby seeds and steps give
    unrelated streams."""
    def splitmix(z: int) -> int:
        z = (z + 0x9E3779B97F4A7C15) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)

    return splitmix(splitmix(seed & _MASK64) ^ (step & _MASK64))


def seeded_generator(seed: int, step: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator a seeded row draws from at position ``step``: seeded from (seed, step) by splitmix64, so
    nearby seeds and steps give unrelated streams and the draw depends on nothing else."""
    return torch.Generator(device=device).manual_seed(_mix_seed(seed, step))


def race_draw(probs: Tensor, generator: torch.Generator | list[torch.Generator] | None = None,
              counts: list[int] | None = None) -> Tensor:
    """The exponential race on [b,m] probabilities → [b] positions: argmax(p / Exp(1)) picks i with probability
    p_i (exact, no multinomial). Noise is drawn for the m columns in order, from ``generator`` — or, given one
    generator per row, each row's from its own (the noise a row gets alone), for its first ``counts[r]`` columns
    only where counts are given (the rest have probability 0)."""
    noise = torch.empty_like(probs)
    if isinstance(generator, list):
        if counts is not None:
            noise.fill_(1.0)
        for r, (row, gen) in enumerate(zip(noise, generator, strict=True)):
            (row if counts is None else row[:counts[r]]).exponential_(generator=gen)
    else:
        noise.exponential_(generator=generator)
    return (probs / noise.clamp_min_(torch.finfo(probs.dtype).tiny)).argmax(dim=-1)


def draw_part(vals: Tensor, idx: Tensor | None, seeded: bool, generator: torch.Generator | list | None,
               vocab: Vocab) -> Tensor:
    """A sampled part of the cut ([b,V_r] whole rows when idx is None, else [b,m] candidates and their ids) → [b]
    ids. A seeded row's kept candidates (its finite values) race in token-id order, noise drawn for them alone, so
    that its id depends on its kept tokens and their values only — not on the order the cut produced them in nor
    on the dropped ones (-inf) it carried, which differ between the cut's paths (``generator``: a row's own, or one
    per row for seeded rows drawn together); on float32 CPU rows the race runs in C (`race_in_c`), elsewhere in
    torch (`race_draw`)."""
    if idx is None:
        return draw_whole_rows(vals, generator, vocab)
    counts = None
    if seeded:
        generator = generator if isinstance(generator, list) else [generator] * vals.shape[0]
        won = race_in_c(vals, idx, generator)
        if won is not None:
            return won
        kept = torch.isfinite(vals)
        order = torch.where(kept, idx, idx + _AFTER).argsort(dim=-1)  # kept in id order, then the dropped
        vals, idx = vals.gather(1, order), idx.gather(1, order)
        counts = kept.sum(dim=-1).tolist()
    return idx.gather(1, race_draw(torch.softmax(vals, dim=-1), generator, counts).unsqueeze(1)).squeeze(1)


def race_in_c(vals: Tensor, idx: Tensor, generators: list) -> Tensor | None:
    """`draw_part`'s seeded race over float32 CPU candidates [b,m] in C: each row by `race_row_in_c` with its own
    generator — one C call a row where the torch race takes a sort, two gathers, a softmax and four passes over the
    noise. None (no noise drawn) where C does not serve: other dtypes or devices, no library, a row with nothing
    kept."""
    from lmhead.kernels.native import library

    if vals.device.type != "cpu" or vals.dtype != torch.float32 or library() is None:
        return None
    counts = torch.isfinite(vals).sum(dim=-1).tolist()
    if min(counts) < 1:
        return None
    won = [race_row_in_c(vals[r].contiguous(), idx[r].contiguous(), n, gen)
           for r, (n, gen) in enumerate(zip(counts, generators, strict=True))]
    return idx.gather(1, torch.tensor(won, device=idx.device)[:, None]).squeeze(1)


def race_row_in_c(vals: Tensor, ids: Tensor, kept: int, generator: torch.Generator | None) -> int:
    """One seeded row's race (`native.race_row`) over its candidates vals [m] (float32, CPU, -inf = dropped) and
    ids [m], `kept` of them finite: their noise drawn from `generator` in id order, as the torch race draws it, and
    the first largest e^(v − max) / E among them in id order, in double → the winner's place in vals."""
    from lmhead.kernels.native import race_row

    noise = torch.empty(kept, dtype=torch.float32).exponential_(generator=generator)
    at = race_row(vals, ids, noise)
    if at is None:  # the generator has moved: the torch race would draw other noise
        raise MemoryError("the seeded race could not allocate its candidates")
    return at


def kept_candidates(vals: Tensor, vocab: Vocab) -> tuple[Tensor, Tensor]:
    """One whole row of a cut [1,V_r] (-inf = dropped) → its kept tokens as candidates (vals [1,c], global ids
    [1,c] ascending), gathered over the shards of the vocabulary."""
    local = torch.isfinite(vals[0]).nonzero().squeeze(1)
    ids, kept = vocab.cat(local + vocab.start, vals[0, local])
    return kept.unsqueeze(0), ids.unsqueeze(0)


def part_logprobs(vals: Tensor, idx: Tensor | None, ids: Tensor, vocab: Vocab) -> Tensor:
    """The processed log-probability of ids [b] (global) in a part of the cut: candidates [b,m] normalised over
    themselves (the -inf elsewhere in the row add nothing), whole rows [b,V] by a log-softmax over the row
    (whole vocabulary only). -inf for an id the cut dropped."""
    if idx is None:
        return torch.log_softmax(vals, dim=-1).gather(1, (ids - vocab.start)[:, None]).squeeze(1)
    lse = torch.logsumexp(vals, dim=-1, keepdim=True)
    return torch.where(idx == ids[:, None], vals - lse, NEG_INF).amax(dim=-1)
