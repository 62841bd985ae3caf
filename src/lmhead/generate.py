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

The loop and the batch sit above the engine and the drafts: `Batch` turns a draft mode into a draft
(`speculative.draft_for`) and drives `decode.engine.Decoder` (or `decode.hf_rounds.TransformersRounds`) over the
rows `decode.rows.prepare` makes; the rows' text, scores and prefill pieces are `decode.rows`, `decode.scores` and
`decode.budget`'s.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from lmhead import checks
from lmhead.decode import scores
from lmhead.decode.budget import PrefillBudget
from lmhead.decode.engine import Decoder, columns
from lmhead.decode.hf_rounds import TransformersRounds
from lmhead.decode.rounds import Round
from lmhead.decode.rows import Row, Step, TopLogprob, advance, left_pad, prepare
from lmhead.decode.scores import Clock
from lmhead.sampling import SamplingConfig
from lmhead.speculative import check_draft_mode, check_draft_tokens, draft_for

__all__ = ["Batch", "Step", "generate"]


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
    check_draft_mode(model, draft)
    check_draft_tokens(draft_tokens)
    return _loop(model, rows, generator, profile, draft, draft_tokens, stats)


class Batch:
    """Rows decoding together, open to rows that join while others decode (continuous batching).

        batch = Batch(model)            # generator, profile, draft, draft_tokens, stats as in `generate`
        batch.add(prepare(model, ...))  # prefill the new rows; they join the running ones
        for row, step in batch.step():  # one round for every live row: each row's new Step(s)
            ...
        batch.remove([row])             # retire rows early (a client that went away)

    Finished rows (end of sequence, stop string, budget) leave after the step that finished them; `rows` are
    the live ones. A row's tokens do not depend on the rows it decodes beside (per-row configs, seeds keyed
    on (seed, step), left padding and merged caches invisible to attention, `decode.logits.decode_logits`):
    a greedy or seeded row gives the tokens it gives alone, and logprobs equal to float rounding (a compressed
    head's own: within its error bound, its kernel differs for one row and several). Rows join a
    running batch on the lean body (`decode.engine.Decoder.join`); with transformers' modules `can_join` is
    False while rows are live. Rows without scores (`Row.scores` False) get their tokens only.
    """

    def __init__(self, model, *, generator: torch.Generator | None = None,
                 profile: dict[str, float] | None = None, draft: str = "none", draft_tokens: int = 4,
                 stats=None, prefix_cache=None) -> None:
        self.model, self.generator, self.profile = model, generator, profile
        # a prefix_cache.PrefixCache: prompts' blocks as they are computed and the blocks of rows that leave,
        # reused by every row whose prompt begins with them
        self.prefix_cache = prefix_cache
        self.prefilled = 0  # prompt positions computed (not found in the prefix cache)
        self.draft, self.draft_tokens, self.stats = draft, draft_tokens, stats
        self.device = model.device
        self.eos = set(model.eos_token_ids)
        tokenizer = model.tokenizer
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else max(min(self.eos, default=0), 0)
        self.rows: list[Row] = []
        self.rounds = None
        self.last: torch.Tensor | None = None  # [B] each live row's newest token (not yet in the caches)
        self.clock = Clock(profile)
        self._joining: tuple | None = None  # (rows, their Decoder, their last, room) while `begin_join` prefills
        self._leads: list[Decoder] = []  # a join's shared prompt beginnings, prefilled once before its rows (`_lead`)
        self._partials: list[tuple] = []  # the leads' columns past their last whole block (`_keep_partial`)
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
        for lead in self._lead(rows):
            while lead.prefill_piece():
                pass
            self.prefilled += lead.prefilled
            self._keep_partial(lead)
        ids, positions, attention = left_pad([r.prompt_ids for r in rows], self.pad, self.device)
        valid = None if attention is None else attention.bool()
        if not self.rows:
            draft = self.draft
            if draft == "auto" and not hasattr(self.model, "auto_draft"):
                draft = "none"  # measured (docs/decode.md): `Model.auto_draft`, `_rounds`
            self.rounds = _rounds(self.model, draft, self.draft_tokens, self.profile)
            if self.stats is not None and hasattr(self.rounds, "stats"):
                self.rounds.stats = self.stats
            self.last = self.rounds.start(ids, positions, valid, max(r.budget for r in rows), **self._prefixes(rows))
            self.prefilled += getattr(self.rounds, "prefilled", 0)
        else:
            room = max(r.budget - len(r.generated) for r in [*self.rows, *rows])
            other, last = self.rounds.begin_join(ids, positions, valid, room, **self._prefixes(rows))
            self.rounds.finish_join(other, room)
            self.prefilled += other.prefilled
            self.last = torch.cat([self.last, last])
        self.rows = [*self.rows, *rows]

    @property
    def kv_bytes(self) -> int:
        """Bytes of the KV caches the batch holds: the live rows' and the joining rows' (the server's metrics)."""
        caches = [getattr(self.rounds, "target", None), self._joining and getattr(self._joining[1], "target", None)]
        return sum(2 * c.keys.numel() * c.keys.element_size() for c in caches if c is not None)

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
        self._leads = self._lead(rows)
        self._joining = (rows, None, None, 0)
        if not self._leads:
            self._begin_rows(rows)
        self.budget.start()

    def _begin_rows(self, rows: list[Row]) -> None:
        """The joining rows' Decoder (`Decoder.begin_join`), each row starting from its prompt's stored blocks."""
        ids, positions, attention = left_pad([r.prompt_ids for r in rows], self.pad, self.device)
        room = max(r.budget - len(r.generated) for r in [*self.rows, *rows])
        other, last = self.rounds.begin_join(ids, positions, None if attention is None else attention.bool(), room,
                                             **self._prefixes(rows))
        self._joining = (rows, other, last, room)

    @torch.inference_mode()
    def prefill(self, columns: int | None = None) -> bool:
        """One piece of the joining rows' prompts, or, once none is left, the merge: they join (become live).
        True while pieces or the merge remain. The piece: `columns` prompt columns; None: while rows decode,
        what `budget` allows (a round with a piece costs at most 1 + PIECE_SHARE rounds without), else
        `decode.engine.PREFILL_PIECE` (a lone prompt's time to first token as `add`'s). The merge is a call of
        its own, so that a round waits for a piece or for the merge, never both."""
        if self._joining is None:
            return False
        rows, other, last, room = self._joining
        if columns is not None:
            columns = checks.positive_int("columns", columns)
        if self._leads:  # a shared beginning first, one row: the joining rows then find it stored
            lead = self._leads[0]
            self._piece(lead, 1, columns if columns is not None or not self.rows
                        else self.budget.columns(1, self.model.lean.CODED_MAX_ROWS))
            if not lead.prefilling:
                self._keep_partial(self._leads.pop(0))
                if not self._leads:
                    self._begin_rows(rows)
            return True
        if other.prefilling:
            if columns is None and self.rows:
                columns = self.budget.columns(len(rows), self.model.lean.CODED_MAX_ROWS)
            self._piece(other, len(rows), columns)
            return True
        self._joining = None
        if not self.rows:  # every running row left meanwhile: the joining rows are the batch
            self.rounds, self.last, self.rows = other, last, list(rows)
            return False
        self.rounds.finish_join(other, room)
        self.last = torch.cat([self.last, last])
        self.rows = [*self.rows, *rows]
        return False

    def _piece(self, decoder: Decoder, rows: int, columns: int | None) -> None:
        """One prefill piece of `decoder` (`rows` rows), timed for the budget and counted in `prefilled`."""
        t = time.perf_counter()
        before, fed = decoder.target.length, decoder.prefilled
        decoder.prefill_piece(columns)
        self.prefilled += decoder.prefilled - fed
        self.budget.note_piece(time.perf_counter() - t, rows * (decoder.target.length - before),
                               decoder.target.length - before)

    def _prefixes(self, rows: list[Row]) -> dict[str, Any]:
        """The prefix cache's keywords for a Decoder's start of `rows`: each row's longest run of stored blocks
        (`prefixes`) and the store that receives the blocks its prefill computes (`store`)."""
        if self.prefix_cache is None or self.model.lean is None:
            return {}
        prefixes = [self._with_partial(r.prompt_ids[:-1], self.prefix_cache.match(r.prompt_ids[:-1], joined=False))
                    for r in rows]
        self._partials = []
        return {"prefixes": prefixes, "store": self.prefix_cache}

    def _with_partial(self, ids: list[int], found: tuple | None) -> tuple | None:
        """A row's stored blocks (`PrefixCache.match`) and, where a lead of its join computed the columns after
        them that its prompt begins with (`_keep_partial`), those too: a block of which they are the first."""
        for tokens, keys, values in self._partials:
            full = len(tokens) // self.prefix_cache.block * self.prefix_cache.block
            if found is not None and found[0] == full and len(ids) >= len(tokens) and ids[:len(tokens)] == tokens:
                return len(tokens), [*found[1], keys], [*found[2], values]
        return found

    def _keep_partial(self, lead: Decoder) -> None:
        """A finished lead's columns past its last whole block (the store keeps whole blocks only), in a block of
        their own for the rows of its join whose prompts begin with its tokens (`_with_partial`)."""
        tokens, block = lead.common, self.prefix_cache.block
        full = len(tokens) // block * block
        if full == len(tokens):
            return
        keys, values = columns(lead.target, 0, torch.arange(full, len(tokens), device=lead.target.keys.device))
        layers, kv, _, hd = keys.shape
        pk, pv = (keys.new_zeros((layers, kv, block, hd)) for _ in range(2))
        pk[:, :, :len(tokens) - full], pv[:, :, :len(tokens) - full] = keys, values
        self._partials.append((tokens, pk, pv))

    def _lead(self, rows: list[Row]) -> list[Decoder]:
        """One-row Decoders (not started rounds: prefill only) for the beginnings that several of `rows` share and
        the prefix cache lacks, longest first: prefilled before the rows start, they store those blocks once, and
        every row then starts from them — concurrent requests with a common prefix compute it once (and n > 1
        rows their prompt). A beginning is the rows' whole common start, its part past the last whole block
        included (handed to the rows as a block of its own: `_keep_partial`)."""
        cache = self.prefix_cache
        if cache is None or cache.max_bytes == 0 or self.model.lean is None or len(rows) < 2:
            return []  # (a store that keeps nothing: a lead would compute its blocks for no one)
        chains = [cache.chain(r.prompt_ids[:-1]) for r in rows]
        count = Counter(key for chain in chains for key in chain)
        shared: dict[bytes, list[int]] = {}
        groups: dict[bytes, tuple[int, list[list[int]]]] = {}  # by the last block shared: its rows' prompts
        for row, chain in zip(rows, chains, strict=True):
            n = 0
            while n < len(chain) and count[chain[n]] > 1:
                n += 1
            if n:
                groups.setdefault(chain[n - 1], (n, []))[1].append(row.prompt_ids)
        for key, (n, prompts) in groups.items():  # the group's whole common start (at least its n blocks)
            common = len(os.path.commonprefix([p[:-1] for p in prompts])) if len(prompts) > 1 else 0
            shared[key] = prompts[0][:max(common, n * cache.block) + 1]  # + the token after: `begin`'s last
        inner = {key for ids in shared.values() for key in cache.chain(ids[:-1])[:-1]}
        leads = []
        for key, ids in sorted(shared.items(), key=lambda kv: -len(kv[1])):
            if key in inner or cache.cached(ids[:-1]) == len(ids) - 1:
                continue  # another lead computes it on its way, or it is stored already
            lead = Decoder(self.model.lean, self.model.head)
            t = torch.tensor([ids], device=self.device)
            lead.begin(t, torch.arange(len(ids), device=self.device)[None], None, 0,
                       [cache.match(ids[:-1], count=False, joined=False)], cache)
            lead.common = ids[:-1]
            leads.append(lead)
        return leads

    def _keep_blocks(self, indices: list[int]) -> None:
        """Store the blocks of the live rows `indices` (their prompt and the tokens they fed) in the prefix cache:
        rows that leave, finished or retired (a client that hung up), leave their blocks."""
        target = getattr(self.rounds, "target", None)
        if self.prefix_cache is None or target is None or self.model.lean is None:
            return
        block = self.prefix_cache.block
        for b in indices:
            src = target.valid[b, :target.length].nonzero().squeeze(1)
            tokens = target.tokens[b, src].tolist()
            skip = self.prefix_cache.cached(tokens) // block  # copy only the columns of blocks not stored
            if skip < len(tokens) // block:
                self.prefix_cache.put(tokens, *columns(target, b, src[skip * block:]), skip=skip)

    def drop_join(self) -> None:
        """Abandon the join under way (its prefill failed); the live rows go on."""
        self._joining = None
        self._leads, self._partials = [], []
        if not self.rows:
            self.rounds, self.last = None, None

    @torch.inference_mode()
    def remove(self, rows: list[Row]) -> None:
        """Retire `rows` (live rows of this batch) now; their cache rows are dropped."""
        gone = {id(r) for r in rows}
        keep = [b for b, r in enumerate(self.rows) if id(r) not in gone]
        if len(keep) == len(self.rows):
            return
        self._keep_blocks([b for b, r in enumerate(self.rows) if id(r) in gone])
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
        """The scores of every token of a round (rows × their tokens, flattened, in order; see `scores.flat_scores`):
        None for the tokens of rows without scores, which are not computed."""
        rows = self.rows
        # each row scored as it is alone: what a call computes for every row depends on what any of its rows asks
        # (alternatives take torch's log-softmax over the row, an exact-logprobs row the exact head's logits
        # instead of the draw's), so the rows are scored in groups that ask alike
        exact = self.model.head is not self.model.exact_head
        groups: dict[tuple[bool, bool], list[int]] = {}
        for b, r in enumerate(rows):
            if r.scores:
                groups.setdefault((r.top_n > 0, exact and r.exact_logprobs), []).append(b)
        if len(groups) == 1 and len(next(iter(groups.values()))) == len(rows):
            return self._scores_for(rows, rnd, history, plen)
        parts = [(keep, self._scores_for(*self._subset(keep, rnd, history, plen))) for keep in groups.values()]
        return _spread(parts, [len(t) for t in rnd.tokens])

    def _subset(self, keep: list[int], rnd, history, plen):
        """The rows `keep` of a round: (rows, their Round, history, prompt lengths)."""
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
        return scores.flat_scores(scores.score_logits(self.model, rnd, rows), rnd.tokens, history, plen, rows, drawn)

    @torch.inference_mode()
    def step(self) -> list[tuple[Row, Step]]:
        """One round for every live row → (row, Step) for each token chosen, rows in order; rows that
        finished are retired."""
        rows, tokenizer = self.rows, self.model.tokenizer
        history = [r.prompt_ids + r.generated for r in rows] if any(r.penalties for r in rows) else None
        plen = [len(r.prompt_ids) for r in rows]
        # a row's state: mirostat's μ, and the records its penalties and DRY keep of its tokens (moved by each token)
        states = {"states": [r.state for r in rows]} if any(r.stateful or r.penalties for r in rows) else {}
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
                    text, finish = advance(row.detok, row.generated, row.budget, token, row.ends(token, self.eos))
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
        self.remove(finished)
        if self.rows:
            self.last = torch.tensor([r.generated[-1] for r in self.rows], device=self.device)
        self.budget.note_round(time.perf_counter() - began)
        return out


def _spread(parts: list[tuple[list[int], tuple]], counts: list[int]):
    """Scores of groups of rows, each (its rows `keep`, their scores flattened over their tokens) → the same lists
    over every row's `counts` tokens, None (alternatives: []) for rows in no group; alternatives None where no
    group has them."""
    where = {b: (scored, sum(counts[c] for c in keep[:j])) for keep, scored in parts for j, b in enumerate(keep)}
    out: tuple[list, list, list, list] = ([], [], [], [])
    for b, n in enumerate(counts):
        scored, first = where.get(b, (None, 0))
        for k in range(first, first + n):
            if scored is None:
                for lst, empty in zip(out, (None, None, None, []), strict=True):
                    lst.append(empty)
                continue
            chosen, raw, ranks, alts = scored
            out[0].append(chosen[k])
            out[1].append(raw[k])
            out[2].append(ranks[k])
            out[3].append(alts[k] if alts is not None else [])
    return out[0], out[1], out[2], (out[3] if any(s[3] is not None for _, s in parts) else None)


def _loop(model, rows: list[Row], generator: torch.Generator | None, profile: dict[str, float] | None,
          draft: str = "none", draft_tokens: int = 4, stats=None) -> Iterator[Step]:
    batch = Batch(model, generator=generator, profile=profile, draft=draft, draft_tokens=draft_tokens,
                  stats=stats)
    batch.add(rows)
    while batch.rows:
        for _, step in batch.step():
            yield step


def _rounds(model, draft: str, draft_tokens: int, profile: dict[str, float] | None):
    """The round source for `model`: the lean body's `Decoder` (with the draft of mode `draft`; "auto" where
    `auto_draft()` is "none" and `auto_greedy_drafts()`: n-grams for greedy rows only), else transformers'
    modules."""
    if model.lean is None:
        return TransformersRounds(model, profile)
    greedy_only = False
    if draft == "auto" and model.auto_draft() == "none" and getattr(model, "auto_greedy_drafts", lambda: False)():
        draft, greedy_only = "ngram", True
    return Decoder(model.lean, model.head, draft_for(model, draft), k=draft_tokens, profile=profile,
                   greedy_only=greedy_only)
