"""Top-p without top-k: the C pass, the windows, the histogram select (``top_p_parts``) and, in
``sample``, the rejection draw that needs no top-p set (``top_p_draw``).

The settings are one number for every row or one per row: ``temperature`` a float or a column [b,1] float32,
``top_p`` a float or a column [b,1] float64 (``Setting``). A column divides and compares as the number itself does
(the float32 division by T; p in float64, and cast to float32 where it meets float32 masses, as a number is), so a
row's cut is the same bits with its own column as with its number."""

from __future__ import annotations

import torch
from torch import Tensor

from lmhead.sampling.inputs import check_top
from lmhead.sampling.race import draw_part
from lmhead.sampling.rows import Part, block_sums, draw_in_blocks, grid_sums, sub_part
from lmhead.sampling.vocab import BLOCK, NEG_INF, Vocab, chunk_columns, tail_exp_

Setting = float | Tensor  # one number for every row, or a column [b,1] of one per row


def rows_of(value: Setting, index: Tensor) -> Setting:
    """A setting's values for the rows `index` (a number: itself)."""
    return value[index] if isinstance(value, Tensor) else value


def flat(value: Setting) -> Setting:
    """A setting as [b] (a column's values; a number: itself), to meet per-row [b] sums."""
    return value[:, 0] if isinstance(value, Tensor) else value


def number(value: Setting, row: int) -> float:
    """A row's value of a setting, as a Python number (a float32 column's value, exactly)."""
    return float(value[row, 0]) if isinstance(value, Tensor) else float(value)

# Top-p without top-k: the first partial-sort window, its growth factor, and the widest window before a full
# sort is cheaper. The margin keeps a window from being accepted on a float-rounding knife edge.
_WINDOW_START = 256
_WINDOW_GROWTH = 4
_WINDOWS = 2
_WINDOW_MAX_FRACTION = 8
_WINDOW_MARGIN = 1e-5


# Top-p on wide rows: histogram bins per row; logits more than 104 below the max have probability 0 in float32.
_BINS = 4096
NATIVE_TOP_P_ROWS = 8  # `top_p_parts`: up to this many rows are settled one by one in C
_UNDERFLOW = 104.0


# Top-p alone in `sample`: rejection rounds before the rows left draw from their exact top-p set (a round
# passes with probability ≥ p; small p takes about ln(1/p) + 1 rounds).
_DRAW_ROUNDS = 6


def top_p_sorted(vals: Tensor, top_p: Setting, probs: Tensor | None = None) -> Tensor:
    """Top-p on candidates sorted by value, descending ([b,m], ties adjacent) → vals with cut ones at -inf.

    ``probs`` are the candidates' probabilities over the full row when the candidates are only a window of it
    (the mass outside the window is then 1 − their sum); None means the candidates are the whole support.
    HF's rule: in ascending order, drop tokens whose inclusive cumulative mass ≤ 1 − p, keep the largest.
    A tie group uses the mass at its first (most probable) position, so it is kept or dropped whole."""
    if probs is None:
        probs = torch.softmax(vals, dim=-1)
        tail = 0.0
    else:
        tail = (1.0 - probs.sum(dim=-1, keepdim=True)).clamp_min(0.0)
    ascending_mass = probs.flip(-1).cumsum(-1).flip(-1) + tail  # mass of this token and all below it
    start = torch.ones_like(vals, dtype=torch.bool)
    start[:, 1:] = vals[:, 1:] != vals[:, :-1]
    if not bool(start.all()):  # ties: each position takes the mass at its tie group's first position
        pos = torch.arange(vals.shape[1], device=vals.device).expand_as(vals)
        first = torch.where(start, pos, 0).cummax(dim=-1).values
        ascending_mass = ascending_mass.gather(1, first)
    below = (1 - top_p).to(ascending_mass.dtype) if isinstance(top_p, Tensor) else 1 - top_p
    remove = ascending_mass <= below
    remove[:, 0] = False
    return vals.masked_fill(remove, NEG_INF)


def top_p_parts(x: Tensor, temperature: Setting, top_p: Setting, vocab: Vocab, native: bool = True) -> list[Part]:
    """Top-p without top-k, with no full sort.

    First partial sorts of a small window (top 256, then 1024): a window is enough once the mass strictly
    above its smallest value reaches p — then every token outside it, and any tie at its edge, is dropped and
    the rest of the row only enters through the normaliser. That settles language-model-like rows (their
    top-p sets hold tens of tokens). Rows with a wide top-p set go to `_top_p_bins`, which is exact too.

    A few whole CPU rows are settled in C first (`kernels.native.top_p_row`: the same rule, three passes and a
    sort of the candidates, one call per row instead of ~40 torch ops); the rows it declines take the path
    above (all of them with ``native=False``). Every path gives a row the same kept tokens and values: a seeded
    draw, which races over those alone (`race.draw_part`), gives the same id whichever path found them."""
    parts, rest = _top_p_native(x, temperature, top_p, vocab) if native else ([], list(range(x.shape[0])))
    if not parts:
        return _top_p_windows(x, temperature, top_p, vocab)
    if rest:
        check_top(vocab.amax(x)[:, 0], vocab.name, temperature)  # an error names the row of x, not of the rest
        rows = torch.tensor(rest)
        parts += [(sub_part(rows, sub) if sub is not None else rows, vals, idx) for sub, vals, idx in
                  _top_p_windows(x[rows], rows_of(temperature, rows), rows_of(top_p, rows), vocab)]
    return parts


def _top_p_native(x: Tensor, temperature: Setting, top_p: Setting, vocab: Vocab) -> tuple[list[Part], list[int]]:
    """The rows of x [b,V] whose top-p set C settles (`kernels.native.top_p_row`: a few whole float32 CPU rows,
    one call each; language-model rows, whose sets hold tens of tokens) as parts, and the rows it leaves (flat
    rows, more rows than NATIVE_TOP_P_ROWS, a sharded vocabulary, no library)."""
    if not (type(vocab) is Vocab and x.device.type == "cpu" and x.dtype == torch.float32
            and x.shape[1] == vocab.size and 0 < x.shape[0] <= NATIVE_TOP_P_ROWS):
        return [], list(range(x.shape[0]))
    from lmhead.kernels.native import top_p_row

    found = [top_p_row(x[r], number(temperature, r), number(top_p, r)) for r in range(x.shape[0])]
    if len(found) == 1:
        return ([(None, *found[0])], []) if found[0] is not None else ([], [0])
    return ([(torch.tensor([r]), *f) for r, f in enumerate(found) if f is not None],
            [r for r, f in enumerate(found) if f is None])


def _top_p_windows(x: Tensor, temperature: Setting, top_p: Setting, vocab: Vocab) -> list[Part]:
    """`top_p_parts` in torch: windows of the top 256 and 1024, then `_top_p_bins`."""
    top = vocab.amax(x)
    check_top(top[:, 0], vocab.name, temperature)
    top_t = top / temperature
    # the softmax normaliser over the full row, in cache-sized chunks (no sort, no [B,V] temporary), summed
    # in float64 so that the window's masses are as exact as float32 logits allow
    norm = vocab.sum(block_sums(x, top_t, temperature).sum(dim=-1, keepdim=True, dtype=torch.float64))
    parts: list[Part] = []
    rows: Tensor | None = None
    xs, top_t = x, top_t.double()
    window = min(_WINDOW_START, vocab.size)
    for _ in range(_WINDOWS):
        if window * _WINDOW_MAX_FRACTION > vocab.size:
            break
        v, i = vocab.topk(xs, window)
        vals = v / temperature
        probs = torch.exp(vals.double() - top_t) / norm  # [b,W] float64, over the full row
        strictly_above = (probs * (vals > vals[:, -1:])).sum(dim=-1)
        done = strictly_above >= flat(top_p) + _WINDOW_MARGIN
        hopeless = strictly_above < flat(top_p) / _WINDOW_GROWTH  # a wider window would most likely fail too
        if bool(hopeless.all()):
            break
        if bool(done.all()):
            parts.append((rows, top_p_sorted(vals, top_p, probs), i))
            return parts
        if bool(done.any()):
            d = done.nonzero().squeeze(1)
            parts.append((sub_part(rows, d), top_p_sorted(vals[d], rows_of(top_p, d), probs[d]), i[d]))
            rest = (~done).nonzero().squeeze(1)
            rows, xs, top_t, norm = sub_part(rows, rest), xs[rest], top_t[rest], norm[rest]
            temperature, top_p = rows_of(temperature, rest), rows_of(top_p, rest)
        window *= _WINDOW_GROWTH
    parts.append((rows, _top_p_bins(xs, temperature, top_t, norm, top_p, vocab), None))
    return parts


def _top_p_bins(xs: Tensor, temperature: Setting, top_t: Tensor, norm: Tensor, top_p: Setting,
                vocab: Vocab) -> Tensor:
    """Exact top-p on whole rows [b,V_r] by a histogram select instead of a sort (two chunked passes over V).

    top_t = max(x)/T (float64) and norm = Σ exp(x/T − top_t) (float64) per row. The logit range is cut into
    equal bins; the bin index is monotone in the logit, so tied tokens share a bin and a higher bin only holds
    larger logits. Per-bin masses give the crossing bin, where the mass of the top tokens reaches p: tokens
    above it are kept, below it dropped, and only the (few) tokens of that bin are sorted to place the cut
    exactly (kept iff the mass strictly above < p, i.e. the mass at or below > 1 − p, summed from the bottom as
    HF does). Returns x/T with the dropped tokens at -inf. Over shards, the bin masses are summed and the
    crossing bin's tokens gathered: both small."""
    batch, width = xs.shape
    nbins = max(1, min(_BINS, vocab.size // 16))
    hi = top_t.float()
    # min(x)/T is min(x/T) (division by T > 0 is monotone); below hi − 104, exp(·) is 0 in float32 anyway
    lo = torch.maximum(vocab.amin(xs) / temperature, hi - _UNDERFLOW)
    scale = nbins / (hi - lo).clamp_min(1e-30)  # a flat row: every finite token in one bin
    chunk = chunk_columns(batch, width)
    xt_buf = torch.empty(batch, chunk, dtype=torch.float32, device=xs.device)
    bin_buf = torch.empty_like(xt_buf)
    idx_buf = torch.empty(batch, chunk, dtype=torch.long, device=xs.device)

    def chunks():  # (x/T, bin index as float) per chunk, in reused buffers; -inf → bin 0
        for start in range(0, width, chunk):
            part = xs[:, start : start + chunk]
            xt, bins = xt_buf[:, : part.shape[1]], bin_buf[:, : part.shape[1]]
            torch.div(part, temperature, out=xt)
            torch.sub(xt, lo, out=bins).mul_(scale).floor_().clamp_(0, nbins - 1)
            yield xt, bins

    mass = torch.zeros(batch, nbins, dtype=torch.float32, device=xs.device)
    for xt, bins in chunks():
        index = idx_buf[:, : xt.shape[1]]
        index.copy_(bins)
        mass.scatter_add_(1, index, xt.sub_(hi).exp_())
    mass = vocab.sum(mass)
    # HF's form of the rule, summed from the bottom so that small tails keep their precision: a token is kept
    # iff the mass of itself, its ties and everything below it is > 1 − p
    from_bottom = mass.double().cumsum(-1) / norm  # mass of bins 0..b
    crossing = (from_bottom <= 1 - top_p).sum(dim=-1, keepdim=True).clamp_(max=nbins - 1)
    below = torch.where(crossing > 0, from_bottom.gather(1, (crossing - 1).clamp_min(0)), torch.zeros_like(norm))
    row_ids, values = [], []  # the crossing bin's tokens
    for xt, bins in chunks():
        hit = (bins == crossing.float()).nonzero()
        row_ids.append(hit[:, 0])
        values.append(xt[hit[:, 0], hit[:, 1]])
    row_ids, values = vocab.cat(torch.cat(row_ids), torch.cat(values))
    cut = _cut_in_bin(row_ids, values, batch, top_t, norm, below, top_p)
    out = xs / temperature
    for start_col in range(0, width, chunk):
        o = out[:, start_col : start_col + chunk]
        o.masked_fill_(o < cut, NEG_INF)
    return out


def _cut_in_bin(row_ids: Tensor, values: Tensor, batch: int, top_t: Tensor, norm: Tensor, below: Tensor,
                top_p: Setting) -> Tensor:
    """The crossing bin's tokens (their rows [n], their x/T [n]) → [b,1] the smallest x/T that top-p keeps.

    ``below`` [b,1] is the mass of the bins under the crossing one; top_t and norm as in `_top_p_bins`."""
    values, order = torch.sort(values, stable=True)
    row_ids, order = torch.sort(row_ids[order], stable=True)  # by row, each row's values ascending
    values = values[order]
    count = torch.bincount(row_ids, minlength=batch)
    first = torch.cumsum(count, 0) - count
    v = torch.full((batch, max(1, int(count.max()))), float("inf"), device=values.device)  # +inf pads the end
    v[row_ids, torch.arange(row_ids.numel(), device=values.device) - first[row_ids]] = values
    probs = torch.where(torch.isfinite(v), torch.exp(v.double() - top_t) / norm, torch.zeros_like(v.double()))
    ascending = probs.cumsum(-1)
    last = torch.ones_like(v, dtype=torch.bool)  # a tie group takes the mass at its last (largest) position
    last[:, :-1] = v[:, :-1] != v[:, 1:]
    pos = torch.arange(v.shape[1], device=v.device).expand_as(v)
    group_end = torch.where(last, pos, v.shape[1] - 1).flip(-1).cummin(dim=-1).values.flip(-1)
    keep = (below + ascending.gather(1, group_end) > 1 - top_p) & torch.isfinite(v)
    # the bin's largest token is kept by the choice of the bin (its mass with all below is > 1 − p); say so
    # explicitly, so that a rounding difference between bin and token sums cannot drop the whole bin
    keep.scatter_(1, (count - 1).clamp_min(0).unsqueeze(1), True)
    return torch.where(keep, v, torch.full_like(v, float("inf"))).amin(dim=-1, keepdim=True)


def _mass_above(vals: Tensor, top: Tensor, value: Tensor) -> Tensor:
    """Σ exp(v − top) over the candidates vals [n,m] (x/T) strictly above value [n,1] → [n] float64, counted as
    the block masses count them (`tail_exp_`)."""
    return tail_exp_(torch.where(vals > value, vals - top, NEG_INF)).sum(dim=-1, dtype=torch.float64)


def _settle(x: Tensor, temperature: Setting, top_p: Setting, top: Tensor, norm: Tensor, chosen: Tensor, value: Tensor,
            generator: torch.Generator | None, vocab: Vocab) -> tuple[Tensor, Tensor, Tensor]:
    """One rejection round's test for rows [n,V_r] whose draws `chosen` [n] have x/T `value` [n,1] (top = the
    row max x/T [n,1], norm = the row's mass [n] float64) → (done [n] bool, ids [n] where done, the block
    masses above each value [n, ⌈V/1024⌉] for the rows not done: the next round's proposal).

    A draw is kept iff the mass strictly above its value is < p · norm. That mass is a pass of exps over the
    row — or, for a draw above the row's 256th largest value, the top 256 (one partial sort for the batch,
    when at least half of the rows can have their draw there: fewer than norm / e(draw) tokens lie above it).
    A row whose top 256 hold its whole top-p set and whose draw is not kept then draws from that set's exact
    cut instead of another round (language-model rows)."""
    n, n_blocks = x.shape[0], -(-vocab.size // min(BLOCK, vocab.size))
    limit = flat(top_p) * norm
    if 2 * int((norm / torch.exp((value - top)[:, 0].double()) >= _WINDOW_START).sum()) > n:
        sums = grid_sums(x, top, temperature, value, vocab)  # mostly wide rows: one pass over all of them
        return sums.sum(dim=-1, dtype=torch.float64) < limit, chosen, sums
    vals, idx = vocab.topk(x, min(_WINDOW_START, vocab.size))
    vals = vals / temperature
    in_window = value[:, 0] > vals[:, -1]  # every token above the draw is in the window
    above = _mass_above(vals, top, value)
    done = in_window & (above < limit)
    if bool(done.all()):  # the usual case: every draw kept
        return done, chosen, torch.empty(n, n_blocks, device=x.device)
    probs = torch.exp(vals.double() - top.double()) / norm[:, None]  # [n,256], over the full row
    covered = ~done & ((probs * (vals > vals[:, -1:])).sum(dim=-1) >= flat(top_p) + _WINDOW_MARGIN)
    ids = chosen.clone()
    if bool(covered.any()):
        c = covered.nonzero().squeeze(1)
        ids[c] = draw_part(top_p_sorted(vals[c], rows_of(top_p, c), probs[c]), idx[c], False, generator, vocab)
        done |= covered
    sums = torch.zeros(n, n_blocks, dtype=torch.float32, device=x.device)
    rest = (~done).nonzero().squeeze(1)
    if rest.numel():  # the mass above a draw outside the window, and the next proposal, from a pass over the row
        sums[rest] = grid_sums(x[rest], top[rest], rows_of(temperature, rest), value[rest], vocab)
        done[rest] = ~in_window[rest] & (sums[rest].sum(dim=-1, dtype=torch.float64) < limit[rest])
    return done, ids, sums


def top_p_draw(x: Tensor, temperature: Setting, top_p: Setting, generator: torch.Generator | None,
               vocab: Vocab) -> Tensor:
    """Draw from the top-p distribution of rows [b,V_r] (top-p alone: no top-k, no min-p) → [b] global ids,
    without finding the top-p set: by rejection.

    The top-p set K is the tokens whose mass strictly above them is < p; it is an upper set (every token at
    least as probable as a kept one is kept). A round draws a token from the row restricted to x/T > floor (at
    first the whole row) by `draw_in_blocks`, then `_settle` sums the mass strictly above the drawn value:
    < p · (the row's mass) → the token is in K and is the row's draw; otherwise the token and everything at or
    below it are outside K, its value becomes the floor, and the block masses above it are the next round's
    proposal. A draw from p restricted to any S ⊇ K, kept only when it lands in K, is exactly p restricted to
    K (ties are kept or dropped together; the row's maximum, whose mass above is 0, always passes), so the ids
    follow the top-p distribution exactly; a row that stops the rounds and draws from its exact top-p set
    instead (`_settle`'s window; after _DRAW_ROUNDS rounds `top_p_parts`) keeps the mixture exact. A round
    passes with probability ≥ p. Cost: the row max, a pass of exps, and per round one pass (or a partial sort
    of 256) over the rows it concerns."""
    top = vocab.amax(x)
    check_top(top[:, 0], vocab.name, temperature)
    top_t = top / temperature
    sums = grid_sums(x, top_t, temperature, None, vocab)
    norm = sums.sum(dim=-1, dtype=torch.float64)  # the row's mass, in float64 as the reference sums it
    ids = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    rows = torch.arange(x.shape[0], device=x.device)
    floor = None
    for _ in range(_DRAW_ROUNDS):
        u = torch.rand(rows.numel(), 1, dtype=torch.float64, device=x.device, generator=generator)
        chosen, value = draw_in_blocks(x, temperature, top_t, floor, sums, u, vocab)
        done, chosen, sums = _settle(x, temperature, top_p, top_t, norm, chosen, value, generator, vocab)
        ids[rows[done]] = chosen[done]
        if bool(done.all()):
            return ids
        rest = (~done).nonzero().squeeze(1)
        rows, x, top_t, norm, sums, floor = rows[rest], x[rest], top_t[rest], norm[rest], sums[rest], value[rest]
        temperature, top_p = rows_of(temperature, rest), rows_of(top_p, rest)
    for sub, vals, idx in top_p_parts(x, temperature, top_p, vocab, native=False):  # `sample`'s ids as they were
        ids[sub_part(rows, sub)] = draw_part(vals, idx, False, generator, vocab)
    return ids


def top_p_draw_unseeded(x: Tensor, temperature: Setting, top_p: Setting, generator: torch.Generator | None,
                         vocab: Vocab) -> Tensor:
    """Unseeded rows [b,V_r] with top-p alone → [b] ids from the top-p distribution: rows whose set C settles at
    once (`_top_p_native`; a language model's row of 49,152: ~0.4 ms against ~1.5 for the rejection's torch
    passes) race over it, the others draw by rejection (`top_p_draw`: flat rows, wide batches)."""
    parts, rest = _top_p_native(x, temperature, top_p, vocab)
    if not parts:
        return top_p_draw(x, temperature, top_p, generator, vocab)
    ids = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    if rest:
        check_top(vocab.amax(x)[:, 0], vocab.name, temperature)  # an error names the row of x, not of the rest
        index = torch.tensor(rest, device=x.device)
        ids[index] = top_p_draw(x[index], rows_of(temperature, index), rows_of(top_p, index), generator, vocab)
    for rows, vals, idx in parts:
        ids[slice(None) if rows is None else rows] = draw_part(vals, idx, False, generator, vocab)
    return ids
