"""Decode rounds over transformers' modules, for models without a lean body (`TransformersRounds`)."""

from __future__ import annotations

import torch

from lmhead.decode.choice import plain_choice
from lmhead.decode.logits import decode_logits
from lmhead.decode.rounds import Round, apply_masks, settle_round, take_drafts
from lmhead.decode.scores import Clock


class TransformersRounds:
    """The decode rounds over transformers' modules (`Model.body`, a DynamicCache), for models without a
    lean body: one token per row per round, no draft, no rows joining a running batch. Same interface as
    `engine.Decoder` otherwise."""

    def __init__(self, model, profile: dict[str, float] | None) -> None:
        self.model, self.clock = model, Clock(profile)

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
