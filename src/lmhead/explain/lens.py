"""The logit lens: the final norm and the head applied to the residual stream after every layer, at the last
position (what the model would say if it stopped there)."""

from __future__ import annotations

import torch

from lmhead.explain.inputs import explain_head
from lmhead.explain.records import LensCandidate, LensLayer
from lmhead.explain.tokens import token_texts


def entropies(logits: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of the softmax of each row of `logits` [..., V] -> [...], in float64 (see `predict`);
    -inf logits are tokens of probability 0 and add nothing."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    return -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1)


def logit_lens(logits: torch.Tensor, tokenizer, top: int) -> list[LensLayer]:
    """One `LensLayer` per row of the lens logits [L+1, V] (from `lens_rows`), `top` candidates each."""
    rows = range(logits.shape[0])
    logp = torch.log_softmax(logits.double(), dim=-1)  # float64: see `predict`
    p = logp.exp()
    ent = entropies(logits)
    final_logp = logp[-1]
    kl = (final_logp.exp() * (final_logp - logp).nan_to_num(nan=0.0, neginf=0.0, posinf=0.0)).sum(-1)
    final_tok = int(logits[-1].argmax())
    out = []
    for i in range(len(rows)):
        vals, idx = torch.topk(logits[i], top)
        texts = token_texts(tokenizer, idx.tolist())
        cands = [LensCandidate(token_id=int(t), text=s, logit=float(v), probability=float(p[i, t]))
                 for t, v, (s, _) in zip(idx.tolist(), vals.tolist(), texts, strict=True)]
        rank = int((logits[i] > logits[i, final_tok]).sum()) + 1
        out.append(LensLayer(layer=i, candidates=cands, entropy=float(ent[i]), kl_to_final=float(kl[i]),
                             final_token_probability=float(p[i, final_tok]), final_token_rank=rank))
    return out


def lens_rows(norm, head, hidden_states, last_hidden) -> torch.Tensor:
    """[L+1, V] logits: final norm (where not applied yet) + head on each entry of hidden_states, last position.

    transformers' `hidden_states` holds L+1 entries: the embeddings, the residual stream after blocks
    1..L-1, and — for most decoder models (Llama, Gemma, Qwen, ...) — the *normed* output as the last entry
    (the same tensor as `last_hidden_state`). Entries that are raw residuals get the final norm; an entry
    that already is the normed output (checked by identity/equality with `last_hidden_state`, not assumed
    per architecture) is used as is, so nothing is normalised twice. The norm runs on each layer's own
    vector, so no statistics are shared between layers.
    """
    final_last = last_hidden[:, -1:]
    rows = []
    for i, h in enumerate(hidden_states):
        h = h[:, -1:]
        already_normed = i == len(hidden_states) - 1 and (h is final_last or torch.equal(h, final_last))
        rows.append(h if already_normed else norm(h))
    return head(torch.cat(rows, dim=1)).reshape(len(rows), -1).float()


@torch.inference_mode()
def lens_logits(model, input_ids: torch.Tensor, head: str = "exact") -> torch.Tensor:
    """Logit-lens logits [L+1, V] at the last position of `input_ids` [1,T]: row 0 from the embeddings,
    row i from the residual stream after block i; row L equals the model's own logits.

    model: an `lmhead.Model`: every layer's hidden state (`Model.layer_states`), its final norm, and the head
    `explain_head(model, head)` (default: the full-precision `exact_head`).
    """
    states, last = model.layer_states(input_ids)
    return lens_rows(model.final_norm, explain_head(model, head)[0], states, last)
