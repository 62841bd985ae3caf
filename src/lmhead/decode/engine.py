"""The decode engine: rounds over the lean body for B rows, rows joining and leaving a running batch.

    start / begin + prefill_piece   the prompts into the target's cache, in pieces of PREFILL_PIECE columns
    round                           each row's next token(s): the draft's proposals (if any) verified in one forward
                                    of the target, judged by the plain sampler's draws or the draft's own rule
    join / begin_join + finish_join rows added to the running batch (continuous batching, chunked prefill)
    select                          finished rows dropped

A round without a draft is exactly the plain sampler's step. A draft is an object the engine asks only what
`drafting.LookupDraft` or `drafting.ModelDraft` declares (`lmhead.speculative` makes them, with their acceptance
rules); the engine itself holds the plain path, the verification forward, the draws that judge point-mass drafts
and the caches' bookkeeping.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from lmhead.decode.choice import is_plain_greedy, is_stateful, plain_choice, plain_round
from lmhead.decode.drafting import MAX_DRAFT_TOKENS, AdaptiveK, LookupDraft, ModelDraft, SpeculativeStats
from lmhead.decode.logits import decode_head
from lmhead.decode.rounds import Round, apply_masks, settle_round, take_drafts
from lmhead.kernels.native import greedy_rows
from lmhead.models.lean import LeanBody, StaticCache, gather_row
from lmhead.prefix_cache import copy_into

__all__ = ["PREFILL_PIECE", "Decoder", "columns", "merge_caches", "prefix_layout"]

PREFILL_PIECE = 512  # prompt columns per prefill forward (`Decoder.prefill_piece`)


class Decoder:
    """Decoding rounds over the lean body for B rows; `lmhead.generate.Batch` drives it.

        start(prompt)  the target takes every prompt token but the last, which becomes each row's `last`
        round(last)    the draft feeds its pending columns and `last`, then proposes d_1..d_k (k forwards;
                       no draft: k = 0); the target feeds [last, d_1..d_k] in one forward (k+1 columns)
                       → head → logits [B,k+1,V] → the pipeline's choice (greedy rows) or distribution
                       (sampled rows) at each position → the exact acceptance rules → each row emits
                       d_1..d_n and one token more
        select(rows)   drop finished rows

    The target's cache keeps, per row, the columns of the tokens that row emitted; a row that accepted fewer
    drafts than another leaves its extra columns invalid (`StaticCache.invalidate`) and `compact` gives the
    holes back when the cache fills. The draft's cache mirrors the target's columns: the columns the target
    took that the draft has not seen (its pending columns: the prompt, a fully accepted draft's last token)
    go first into the draft's next forward. Without a draft a round is exactly the plain sampler's step.
    """

    def __init__(self, lean: LeanBody, head, draft: LookupDraft | ModelDraft | None = None, k: int = 4,
                 adaptive: bool = True, stats: SpeculativeStats | None = None,
                 profile: dict[str, float] | None = None, greedy_only: bool = False) -> None:
        self.lean, self.head, self.draft = lean, head, draft
        self.greedy_only = greedy_only  # only greedy rows draft (the others verify nothing: plain steps)
        self._none_accepted: dict[int, Tensor] = {}  # `_plain`'s counts of accepted drafts (none), per batch size
        self.k0, self.adaptive = k, adaptive
        self.k: list[AdaptiveK] = []  # one per row: a row's k follows its own acceptance only
        self.stats = stats if stats is not None else SpeculativeStats()
        self.profile = profile
        self._t = time.perf_counter()
        self._prefill: tuple | None = None  # prompt columns not yet fed: (ids, positions, valid, next column)
        self._store: tuple | None = None  # (prefix cache, rows' prompt tokens, their columns, blocks stored)
        self.prefilled = 0  # prompt positions fed (padding not counted): what the prefix cache did not give
        self._merged: tuple[StaticCache, int] | None = None  # `begin_join`'s merged cache and its first new row

    def _lap(self, phase: str) -> None:
        """Add the time since the last lap to `profile[phase]` (nothing when there is no profile)."""
        if self.profile is not None:
            now = time.perf_counter()
            self.profile[phase] = self.profile.get(phase, 0.0) + now - self._t
            self._t = now

    @torch.inference_mode()
    def start(self, ids: Tensor, positions: Tensor, valid: Tensor | None, max_new_tokens: int,
              prefixes: list | None = None, store=None) -> Tensor:
        """ids, positions [B,W] (left-padded; valid [B,W] marks real tokens) → last [B] (the prompts' last
        tokens). The caches hold the prompt, the new tokens and one full draft. The prompt is prefilled in
        pieces of PREFILL_PIECE columns (`begin`, then `prefill_piece` until none is left)."""
        last = self.begin(ids, positions, valid, max_new_tokens, prefixes, store)
        while self.prefill_piece():
            pass
        return last

    def begin(self, ids: Tensor, positions: Tensor, valid: Tensor | None, max_new_tokens: int,
              prefixes: list | None = None, store=None, *, cache: StaticCache | None = None,
              offset: int = 0) -> Tensor:
        """`start` without its prefill: the caches made, the prompt columns (all but `last`) left to
        `prefill_piece`. prefixes [B]: per row None or (m, keys, values [layers, H_kv, ≥m, hd], or lists of blocks
        of them) — the keys and values of the row's first m prompt tokens (`prefix_cache.PrefixCache.match`), read
        in place (blocks: `_copy_prefixes`) or copied in, instead of fed (the prompts laid out by `prefix_layout`:
        those columns first, its other tokens fed after them). store: a `prefix_cache.PrefixCache` that receives
        each row's full blocks as the pieces compute them. cache: the target's cache, B rows of capacity ≥ offset +
        W + max_new_tokens + MAX_DRAFT_TOKENS + 2 (W: the laid-out width; `begin_join`: rows of the merged cache),
        its prompt columns from column `offset` on (the ones before it left empty); None: a new one, from column
        0."""
        b = ids.shape[0]
        if prefixes is not None and len(prefixes) != b:
            raise ValueError(f"prefixes: one per row ({b}), got {len(prefixes)}")
        last = ids[:, -1].clone()
        self.next_pos = positions[:, -1].clone()  # the position of `last`
        ids, positions, valid, heads = prefix_layout(ids, positions, valid, prefixes)
        w = ids.shape[1]
        self.capacity = offset + w + max_new_tokens + MAX_DRAFT_TOKENS + 2
        if cache is None:
            self.target = self.lean.new_cache(b, self.capacity)
        elif cache.batch != b or cache.capacity < self.capacity or cache.length > offset:
            raise ValueError(f"cache: {b} rows of at least {self.capacity} columns, none used before column {offset}; "
                             f"got {cache.batch} rows of {cache.capacity}, {cache.length} used")
        else:
            self.target, self.capacity = cache, cache.capacity
            cache.length = offset
        model_draft = self.draft is not None and not self.draft.point_mass  # a point-mass draft has no cache
        self.draft_cache = self.draft.new_cache(b, self.capacity) if model_draft else None
        self.k = [AdaptiveK(self.k0, self.adaptive) for _ in range(b)] if self.draft is not None else []
        at = max(heads, default=0)
        real = torch.ones_like(ids, dtype=torch.bool) if valid is None else valid  # the prompt tokens' columns
        if at:
            self._copy_prefixes(ids, positions, valid, prefixes, heads, offset)
            if bool(valid[:, at:].all()):
                valid = None  # the fed part has no padding
        self._prefill = (ids[:, :-1], positions[:, :-1], None if valid is None else valid[:, :-1], at) \
            if at < w - 1 else None
        self._store = None
        if store is not None:  # each row's prompt tokens (but `last`), their columns, its blocks stored so far
            where = [real[r, :-1].nonzero().squeeze(1) for r in range(b)]
            self._store = (store, [ids[r, c].tolist() for r, c in enumerate(where)], [c + offset for c in where],
                           [m // store.block for m in heads])
        return last

    def _copy_prefixes(self, ids: Tensor, positions: Tensor, valid: Tensor, prefixes: list, heads: list[int],
                       offset: int) -> None:
        """Each row's prefix (`begin`) as its first `heads[r]` columns (from `offset`): the store's blocks shared
        (`StaticCache.share`: read in place by every row that begins with them, never copied) where the lean body's
        C attention reads every layer (`shares_columns`), else copied in; the columns up to the fed part's start
        are marked as `valid` (laid out by `prefix_layout`) says; the target's length is where the prefill
        starts."""
        at, target = max(heads), self.target
        share = getattr(self.lean, "shares_columns", None)
        share = share is not None and share()
        cols = slice(offset, offset + at)
        target.valid[:, cols] = valid[:, :at]
        target.positions[:, cols] = positions[:, :at]
        target.tokens[:, cols] = ids[:, :at]
        for r, (m, found) in enumerate(zip(heads, prefixes, strict=True)):
            if not m:
                continue
            if isinstance(found[1], Tensor):
                copy_into(target.keys[:, r, :, offset:offset + m], found[1][:, :, :m])
                copy_into(target.values[:, r, :, offset:offset + m], found[2][:, :, :m])
                continue
            need = -(-m // found[1][0].shape[2])  # blocks holding the first m columns
            if share and all(t.is_contiguous() for t in (*found[1][:need], *found[2][:need])):
                target.share(r, (offset, m, list(found[1][:need]), list(found[2][:need])))
                continue
            at_col = offset  # the store's blocks, each copied once into place (`PrefixCache.match(joined=False)`)
            for k, v in zip(found[1], found[2], strict=True):
                n = min(k.shape[2], offset + m - at_col)
                if n <= 0:
                    break
                copy_into(target.keys[:, r, :, at_col:at_col + n], k[:, :, :n])
                copy_into(target.values[:, r, :, at_col:at_col + n], v[:, :, :n])
                at_col += n
        target.length = offset + at

    @property
    def prefilling(self) -> bool:
        """Whether prompt columns are left for `prefill_piece`."""
        return self._prefill is not None

    @torch.inference_mode()
    def prefill_piece(self, size: int | None = None) -> bool:
        """Feed the next `size` (default PREFILL_PIECE) prompt columns to the target; True while columns are
        left. Attention's scores for a piece are [B, heads, size, columns so far], so a long prompt never needs
        [heads, W, W] at once, and the scheduler can run decode rounds between the pieces of a joining prompt."""
        if self._prefill is None:
            return False
        ids, positions, valid, at = self._prefill
        end = min(at + (size or PREFILL_PIECE), ids.shape[1])
        self.lean(ids[:, at:end], positions[:, at:end], self.target, None if valid is None else valid[:, at:end])
        self.prefilled += ids.shape[0] * (end - at) if valid is None else int(valid[:, at:end].sum())
        self._prefill = None if end == ids.shape[1] else (ids, positions, valid, end)
        self._keep_blocks(self.target.length)
        return self._prefill is not None

    def _keep_blocks(self, end: int) -> None:
        """Store each row's full blocks of prompt columns computed so far (before column `end`) in the prefix
        cache (`begin`'s store): a block a later request needs is there as soon as a piece has computed it."""
        if self._store is None:
            return
        store, prompts, cols, done = self._store
        for r, (tokens, where) in enumerate(zip(prompts, cols, strict=True)):
            n = int((where < end).sum()) // store.block  # full blocks computed (or copied in)
            if n > done[r]:
                new = where[done[r] * store.block:n * store.block]
                store.put(tokens[:n * store.block], *columns(self.target, r, new), skip=done[r])
                done[r] = n

    def select(self, rows: Tensor) -> None:
        self.target.select(rows)
        if self.draft_cache is not None:
            self.draft_cache.select(rows)
        self.next_pos = self.next_pos.index_select(0, rows)
        self.k = [self.k[i] for i in rows.tolist()] if self.k else []

    @torch.inference_mode()
    def round(self, last: Tensor, configs: list, history: list[list[int]] | None, prompt_len: list[int],
              steps: list[int], generator: torch.Generator | None, scored: list[bool] | None = None,
              states: list | None = None, matchers: list | None = None) -> Round:
        """One round. `last` [B] each row's newest token (not yet in the caches); `history` each row's tokens
        so far, `last` included (None when no row uses penalties); `prompt_len` [B]; `steps` [B] each row's
        count of generated tokens (the step of its next token); `scored` [B] whether a row's scores will be
        read from the round's logits (None: all; rows without may get screened logits, `decode_logits`); `states`
        each row's `sampling.RowState` (None: no row keeps state). A round with a stateful row (`is_stateful`) drafts
        nothing: every row takes one plain step, and the row's state moves once, as in the plain loop.

        `matchers` [B] (`constrain.Matcher` or None): a constrained row's mask is applied to its logits at every
        position it judges, before the pipeline (`apply_masks`). Its n-gram drafts are taken by its matcher
        while allowed (a forbidden draft ends the row's draft: the target could never choose it), so each
        position's mask is the one the plain loop would compute there and the tokens are the plain loop's; the
        rejected drafts are rolled back (`settle_round`). The int8 draft proposes from unmasked logits, so a
        constrained row judges none of its drafts (its round is a plain step)."""
        ks = [a.next_k() for a in self.k]
        if self.greedy_only and ks:
            ks = [kr if c.is_greedy else 0 for kr, c in zip(ks, configs, strict=True)]
        if states is not None and any(is_stateful(c) for c in configs):
            ks = [0] * len(ks)
        if matchers is not None and ks and not self.draft.point_mass:
            ks = [0 if m is not None else kr for kr, m in zip(ks, matchers, strict=True)]
        k = max(ks, default=0)  # the round drafts for the most hopeful row; each row verifies its own k
        self._t = time.perf_counter()
        self._room(k + 1)
        drafts, q, taken = None, None, None
        if k and self.draft.point_mass:
            # the coded products cost ~linearly in rows beyond ~8 (compute, not memory): a verification of
            # B·(k+1) > 8 positions costs more than the drafts save, so a wide batch drafts less, or not at all
            cap = self.draft.max_positions // len(ks) - 1
            ks = [min(kr, max(cap, 0)) for kr in ks]
            forced = None if matchers is None else [None if m is None else m.forced() for m in matchers]
            drafts, ks = self._lookup(last, ks, forced)
            taken = take_drafts(matchers, drafts, ks)  # constrained rows: ks cut where a draft is forbidden
            if drafts is not None and max(ks) == 0:
                drafts = None
            k = 0 if drafts is None else drafts.shape[1]
            self._lap("draft")
        elif k:
            drafts, q = self._propose(last, k, configs, history, prompt_len, steps, generator)
            self._lap("draft")
        if matchers is not None and taken is None:  # no n-gram lookup: each constrained row judges position 0 only
            taken = take_drafts(matchers, None, ks)
        ids = last[:, None] if drafts is None else torch.cat([last[:, None], drafts], dim=1)     # [B,k+1]
        start = self.target.length
        positions = self.next_pos[:, None] if k == 0 else self.next_pos[:, None] + torch.arange(k + 1)   # [B,k+1]
        hidden = self.lean(ids, positions, self.target)
        self._lap("body")
        logits, cands = decode_head(self.head, hidden, configs, scored, taken)              # [B,k+1,V]
        self._lap("head")
        if matchers is not None and cands is None:  # a screened call forbade the masks' tokens already
            apply_masks(logits, taken)
        chosen = raw = None
        if k == 0 and cands is not None:  # screened: every row's choice reads its candidates only
            tokens, n = self._candidates(cands[0][:, 0], cands[1][:, 0], configs, prompt_len, steps, generator)
        elif k == 0:
            tokens, n, chosen, raw = self._plain_or_forced(logits[:, 0], configs, history, prompt_len, steps,
                                                           generator, taken, states)
        elif q is None:  # point-mass drafts, or greedy and seeded rows only
            tokens, n, chosen, raw = self._draws(logits, drafts, ks, configs, history, prompt_len, steps,
                                                 generator, cands)
            self._count(n, ks)
        else:
            tokens, n = self.draft.accept(logits, drafts, q, ks, configs, history, prompt_len, steps, generator)
            self._count(n, ks)
        accepted = n.tolist()
        self._keep(start, accepted)
        self.next_pos += n + 1 if any(accepted) else 1
        self._lap("sampling")
        keep = [a + 1 for a in accepted]
        rnd = Round(tokens, [logits[r, :m] for r, m in enumerate(keep)], [hidden[r, :m] for r, m in enumerate(keep)],
                    chosen, raw)
        return rnd if matchers is None else settle_round(rnd, matchers, taken)

    @torch.inference_mode()
    def join(self, ids: Tensor, positions: Tensor, valid: Tensor | None, max_new_tokens: int) -> Tensor:
        """Add rows to the running batch (continuous batching): ids, positions [B',W] as for `start` → their
        `last` [B']; the new rows come after the running ones. max_new_tokens: the most tokens any row, old or
        new, still generates (the merged caches hold every row's columns, that many more and one full draft).
        The new rows' prompts are prefilled apart, then every row's columns are merged right-aligned
        (`merge_caches`): masks use validity, order and positions only, so no row's attention changes."""
        other, last = self.begin_join(ids, positions, valid, max_new_tokens)
        self.finish_join(other, max_new_tokens)
        return last

    def begin_join(self, ids: Tensor, positions: Tensor, valid: Tensor | None,
                   max_new_tokens: int, prefixes: list | None = None, store=None) -> tuple[Decoder, Tensor]:
        """`join` in steps (chunked prefill): a Decoder for the new rows, its prompt not yet fed (→ it and the
        rows' `last` [B']); `other.prefill_piece()` feeds it a piece at a time, between this decoder's rounds;
        `finish_join(other, ...)` feeds what is left and merges it.

        The merged cache is made here, B + B' rows, and the new rows prefill straight into its last B'
        (`StaticCache.view`), their columns ending where the running rows' do now: the merge then copies only the
        running rows' columns, never the prompt's (a long prompt's cache is its size; a copy of it, and of the
        whole merged cache's zeros, had been most of a merge). Its columns past what the rows write are
        `lean.cache_zeros`' untouched pages: they cost no time and no memory."""
        other = Decoder(self.lean, self.head, self.draft, self.k0, self.adaptive, self.stats, self.profile,
                        self.greedy_only)
        live, b_new = self.target, ids.shape[0]
        w = prefix_layout(ids, positions, valid, prefixes)[0].shape[1]  # the width `begin` lays the prompts out in
        held = int(live.valid[:, :live.length].sum(dim=1).max()) if live.batch else 0
        offset = max(0, held - (w - 1))
        # the running rows' new columns while the prompt is prefilled: a round adds 1 to MAX_DRAFT_TOKENS + 1, a
        # piece feeds at least a few prompt columns (more would still merge, by a copy of both: `finish_join`)
        slack = 2 * w + MAX_DRAFT_TOKENS + 2
        merged = self.lean.new_cache(live.batch + b_new, offset + w + slack + max_new_tokens + MAX_DRAFT_TOKENS + 2)
        last = other.begin(ids, positions, valid, max_new_tokens, prefixes, store,
                           cache=merged.view(live.batch, live.batch + b_new), offset=offset)
        other._merged = (merged, live.batch)
        return other, last

    @torch.inference_mode()
    def finish_join(self, other: Decoder, max_new_tokens: int) -> None:
        """Merge `other` (from `begin_join`, its prefill finished here if it is not) after the running rows: each
        running row's valid columns are copied, right-aligned, into the rows before `other`'s in the cache
        `begin_join` made (`merge_caches`' layout: holes dropped); `other`'s stay where they were written."""
        while other.prefill_piece():
            pass
        room = max_new_tokens + MAX_DRAFT_TOKENS + 2
        live, new = self.target, other.target
        counts = live.valid[:, :live.length].sum(dim=1)
        m = max(new.length, int(counts.max()) if counts.numel() else 0)
        merged, first_new = other._merged if other._merged is not None else (None, 0)
        if (merged is not None and live.batch <= first_new and m + room <= merged.capacity
                and new.keys.data_ptr() == merged.keys[:, first_new].data_ptr()):
            top = first_new - live.batch  # fewer running rows than at `begin_join`: some left meanwhile
            for r in range(live.batch):
                gather_row(merged, top + r, live, r, m)
            for r in range(new.batch if new.shared is not None else 0):  # the new rows' shared runs, in place
                merged.share(first_new + r, new.shared.rows[r])
            self.target = merged.view(top, first_new + new.batch)
            self.target.length = m
        else:  # the running rows outgrew the room `begin_join` left: both copied into a new cache
            self.target = merge_caches([live, new], room)
        other._merged = None
        self.capacity = self.target.capacity
        if self.draft_cache is not None:  # empty: the draft re-reads every column in its next forward
            self.draft_cache = self.draft.new_cache(self.target.batch, self.capacity)
        self.next_pos = torch.cat([self.next_pos, other.next_pos])
        self.k = self.k + other.k

    def _room(self, t: int) -> None:
        """Compact the target's cache when the next `t` columns would not fit; the draft then re-reads every
        column in its next forward (compaction is rare: one row per batch never leaves holes)."""
        if self.target.length + t <= self.capacity:
            return
        self.target.compact()
        if self.draft_cache is not None:
            self.draft_cache.truncate(0)

    def _propose(self, last: Tensor, k: int, configs: list, history, prompt_len, steps,
                 generator) -> tuple[Tensor, Tensor | None]:
        """The model draft's k tokens [B,k] and, when a row samples, the processed distributions q [B,k,V]: it
        feeds its pending columns (the target's columns it has not seen) and `last` first."""
        cache, target = self.draft_cache, self.target
        pending = slice(cache.length, target.length)
        ids = torch.cat([target.tokens[:, pending], last[:, None]], dim=1)
        positions = torch.cat([target.positions[:, pending], self.next_pos[:, None]], dim=1)
        valid = torch.cat([target.valid[:, pending], torch.ones_like(last, dtype=torch.bool)[:, None]], dim=1)
        return self.draft.propose_batch(ids, positions, valid, cache, self.next_pos, k, configs, history, prompt_len,
                                        steps, generator)

    def _lookup(self, last: Tensor, ks: list[int], forced: list | None = None) -> tuple[Tensor | None, list[int]]:
        """The n-gram draft per row from the row's tokens in the target's cache and `last`: drafts [B,w]
        (rows with fewer proposals padded with their last token, never judged) and each row's count of
        proposals (its k this round). (None, zeros) when no row has a proposal: the round is a plain step.
        forced [B]: a constrained row's forced continuation (`Matcher.forced`: the tokens its grammar allows as
        the only way on) drafts in place of the n-grams — jump-forward through the verification's one forward:
        the target's choice under a one-token mask is that token, so they are accepted, and judged as any draft."""
        length = self.target.length
        tokens, valid = self.target.tokens[:, :length], self.target.valid[:, :length]
        rows = [forced[r][:kr] if forced is not None and forced[r] else
                self.draft.propose(tokens[r][valid[r]].tolist() + [int(last[r])], kr) for r, kr in enumerate(ks)]
        counts = [len(p) for p in rows]
        width = max(counts, default=0)
        if width == 0:
            return None, counts
        drafts = torch.tensor([p + [int(last[r])] * (width - len(p)) for r, p in enumerate(rows)], dtype=torch.long)
        return drafts, counts

    def _plain(self, logits: Tensor, configs, history, prompt_len, steps, generator, states=None,
               unmasked: bool = True):
        """No draft: one token per row (`choice.plain_round`) → (tokens [[t]], the accepted drafts' counts [B]
        (none), processed logprobs [[lp]], raw logprobs [[v]] or None); a round the pipeline's torch path took
        is booked in the profile under "sampling, torch path (<steps>)"."""
        n = self._none_accepted.get(len(configs))
        if n is None:  # read only: one per batch size, not a new tensor every round
            n = self._none_accepted[len(configs)] = torch.zeros(len(configs), dtype=torch.long)
        tokens, chosen, raw, slow = plain_round(logits, configs, history, prompt_len, steps, generator, states,
                                                unmasked)
        if slow:
            self._lap(f"sampling, torch path ({slow})")
        return tokens, n, chosen, raw

    def _plain_or_forced(self, logits: Tensor, configs, history, prompt_len, steps, generator, taken, states=None):
        """`_plain`, but a constrained row whose mask allows one token only (a forced token: a schema's fixed keys)
        takes it without a draw — no pipeline, no random number from the shared generator — scored as what it is,
        probability 1 (processed and raw logprob 0, rank 1 under the masked logits)."""
        from lmhead.constrain import forced_token

        forced = [None] * len(configs) if taken is None else [
            None if got is None else forced_token(got[0][0]) for got in taken]
        if all(f is None for f in forced):
            return self._plain(logits, configs, history, prompt_len, steps, generator, states, taken is None)
        free = [r for r, f in enumerate(forced) if f is None]
        tokens = [[f] for f in forced]
        chosen, raw = [[0.0] for _ in forced], [[0.0] for _ in forced]
        if free:
            pick = (lambda xs: [xs[r] for r in free])
            sub_tokens, _, sub_chosen, sub_raw = self._plain(
                logits[torch.tensor(free)], pick(configs), None if history is None else pick(history),
                pick(prompt_len), pick(steps), generator, None if states is None else pick(states), False)
            for j, r in enumerate(free):
                tokens[r], chosen[r] = sub_tokens[j], sub_chosen[j]
                if sub_raw is not None:
                    raw[r] = sub_raw[j]
            if sub_raw is None:
                raw = None  # the free rows' raw logprobs come from the logits (`decode.scores.flat_scores`)
        return tokens, torch.zeros(len(configs), dtype=torch.long), chosen, raw

    def _candidates(self, vals: Tensor, ids: Tensor, configs, prompt_len, steps, generator):
        """No draft, a screened round (scoreless rows without bias, bans or penalties): one token per row, the plain
        sampler's choice from the row's candidates vals, ids [B,c] (`decode_head`) — every token its greedy or
        top-k choice can read, so the same token as from the whole row (seeded draws race in id order) at the
        cost of c columns instead of V."""
        local = plain_choice(vals, configs, None, prompt_len, steps, generator)
        return [[t] for t in ids.gather(1, local[:, None]).squeeze(1).tolist()], torch.zeros(len(configs),
                                                                                             dtype=torch.long)

    def _draws(self, logits: Tensor, drafts: Tensor, ks: list[int], configs, history, prompt_len, steps,
               generator, cands: tuple[Tensor, Tensor] | None = None
               ) -> tuple[list[list[int]], Tensor, list[list[float]], list[list[float]] | None]:
        """Drafts judged by the plain sampler's draws (every row of a point-mass draft, or rows that are all
        greedy or seeded): position by position, each row still accepting draws its token there
        (`plain_choice`, scored) and goes on while it equals its next draft, up to its ks[r]. → (per row the
        emitted tokens, the count n [B] of accepted drafts, per row each emitted token's processed logprob,
        and — plain greedy rows, chosen at every position in one C pass — their raw logprobs, else None).
        Only the positions a row reaches are drawn: a rejection at the first draft costs one draw. A screened
        round (`cands`: each position's candidates, `decode_head`) draws from them: the same tokens and processed
        logprobs, c columns instead of V."""
        b = logits.shape[0]
        rows = drafts.tolist()
        tokens: list[list[int]] = [[] for _ in range(b)]
        scores: list[list[float]] = [[] for _ in range(b)]
        if all(is_plain_greedy(c) for c in configs):
            found = greedy_rows(logits.reshape(-1, logits.shape[-1]))  # every position's argmax: one call
            if found is not None:
                width = logits.shape[1]
                ids = [found[0][r * width:(r + 1) * width] for r in range(b)]
                raw = [found[1][r * width:(r + 1) * width] for r in range(b)]
                for r in range(b):
                    m = 0  # accepted drafts: the argmax equals the draft, up to the row's own k
                    while m < ks[r] and ids[r][m] == rows[r][m]:
                        m += 1
                    tokens[r], scores[r] = ids[r][:m + 1], [0.0] * (m + 1)
                    raw[r] = raw[r][:m + 1]
                return tokens, torch.tensor([len(t) - 1 for t in tokens], dtype=torch.long), scores, raw
        live, i = list(range(b)), 0
        source = logits if cands is None else cands[0]
        while live:
            pick = slice(None) if len(live) == b else torch.tensor(live)
            x = source[pick, i]                                                         # [b',V] or [b',c]
            prev = None if history is None else [history[r] + rows[r][:i] for r in live]
            ids, lp = plain_choice(x, [configs[r] for r in live], prev, [prompt_len[r] for r in live],
                                   [steps[r] + i for r in live], generator, scored=True)
            if cands is not None:
                ids = cands[1][pick, i].gather(1, ids[:, None]).squeeze(1)
            going = []
            for r, t, v in zip(live, ids.tolist(), lp.tolist(), strict=True):
                tokens[r].append(t)
                scores[r].append(v)
                if i < ks[r] and t == rows[r][i]:
                    going.append(r)
            live, i = going, i + 1
        return tokens, torch.tensor([len(t) - 1 for t in tokens], dtype=torch.long), scores, None

    def _count(self, n: Tensor, ks: list[int]) -> None:
        self.stats.rounds += 1
        self.stats.drafted += sum(ks)
        self.stats.accepted += int(n.sum())
        self.stats.emitted += int(n.sum()) + len(n)
        for adaptive, nr, kr in zip(self.k, n.tolist(), ks, strict=True):
            adaptive.update([nr], kr)

    def _keep(self, start: int, n: list[int]) -> None:
        """After a round wrote columns start..: row r keeps start..start+n[r]; the draft's cache follows."""
        keep = max(n) + 1
        self.target.truncate(start + keep)
        for r, nr in enumerate(n):
            if nr + 1 < keep:
                self.target.invalidate(r, start + nr + 1)
        cache = self.draft_cache
        if cache is None:
            return
        if cache.length > self.target.length:
            cache.truncate(self.target.length)
        for r, nr in enumerate(n):
            if start + nr + 1 < cache.length:
                cache.invalidate(r, start + nr + 1)


def columns(cache: StaticCache, row: int, cols: Tensor) -> tuple[Tensor, Tensor]:
    """The keys and values [layers, H_kv, len(cols), hd] of `row`'s columns `cols` (ascending): a view where they
    are one run of its own (a lone row's prompt), else a copy (`StaticCache.read_columns`)."""
    return cache.read_columns(row, cols)


def prefix_layout(ids: Tensor, positions: Tensor, valid: Tensor | None, prefixes: list | None
                  ) -> tuple[Tensor, Tensor, Tensor | None, list[int]]:
    """Left-padded prompts ids, positions [B,W] (valid [B,W] or None) and each row's prefix (None or (m, keys,
    values): `Decoder.begin`) → the prompts laid out for a prefill from the first column no row has copied:
    row r's first heads[r] tokens (its prefix, at most all but `last`) in columns 0..heads[r], then holes up to
    A = max(heads), then its other tokens right-aligned after A (left-padded, as `left_pad` pads). → (ids,
    positions, valid [B, A + W'] (W' the longest rest), heads). Masks use validity, order and positions only:
    the holes are invisible to attention, so each row's columns are the ones it would have alone, and no row
    feeds a column it copied. Unchanged (heads all 0) where no row has a prefix."""
    b, w = ids.shape
    lens = [w] * b if valid is None else valid.sum(dim=1).tolist()
    heads = [0 if prefixes is None or found is None else min(found[0], n - 1) for n, found in
             zip(lens, prefixes or [None] * b, strict=True)]
    at = max(heads, default=0)
    if at == 0:
        return ids, positions, valid, heads
    rest = max(n - m for n, m in zip(lens, heads, strict=True))
    width = at + rest
    out_ids = ids.new_zeros((b, width))
    out_pos = positions.new_zeros((b, width))
    out_valid = torch.zeros((b, width), dtype=torch.bool, device=ids.device)
    for r, (n, m) in enumerate(zip(lens, heads, strict=True)):
        first = w - n  # the row's left padding
        out_ids[r, :m], out_pos[r, :m] = ids[r, first:first + m], positions[r, first:first + m]
        out_ids[r, width - (n - m):], out_pos[r, width - (n - m):] = ids[r, first + m:], positions[r, first + m:]
        out_valid[r, :m] = True
        out_valid[r, width - (n - m):] = True
    return out_ids, out_pos, out_valid, heads


def merge_caches(caches: list[StaticCache], room: int) -> StaticCache:
    """The rows of `caches`, in order, in one new cache: each row's valid columns (keys, values, positions,
    tokens) moved, in order, to the right end of the first m columns (m = the most any row holds; `length`
    = m) and `room` free columns after them. Holes (padding, rejected drafts, columns of rows that finished
    earlier) are dropped, as `StaticCache.compact` drops them."""
    first = caches[0]
    counts = torch.cat([c.valid[:, :c.length].sum(dim=1) for c in caches])
    m = int(counts.max()) if counts.numel() else 0
    layers, _, kv_heads, _, head_dim = first.keys.shape
    out = StaticCache(layers, len(counts), kv_heads, head_dim, m + room, first.keys.dtype, first.keys.device)
    row = 0
    for cache in caches:
        for r in range(cache.batch):
            gather_row(out, row, cache, r, m)
            row += 1
    out.length = m
    return out
