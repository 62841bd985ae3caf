"""The logits pipeline: from a row of logits to the next token id.

For each row of logits ``[B,V]`` the pipeline runs these steps, in this order (we follow Hugging Face
transformers' order: temperature → top-k → top-p → min-p; llama.cpp applies temperature last and vLLM min-p
before top-k/top-p, which gives different candidate sets for the same settings):

1. logit bias and banned tokens   ``apply_logit_bias``  add ``logit_bias[id]`` (-inf bans); banned ids → -inf
2. penalties                      ``apply_penalties``   repetition (CTRL/HF, multiplicative: logit > 0 → /p,
                                  else ×p) over the prompt and the generated tokens, each token once; then
                                  frequency and presence (OpenAI: logit − count·frequency − (count>0)·presence)
                                  over the generated tokens only
3. temperature                    ``apply_temperature`` logits / T; T = 0 (or T < 1e-5, as vLLM) is greedy:
                                  argmax after steps 1–2, the cut-off steps 4–6 are skipped
4. top-k                          ``apply_top_k``       keep the k largest (tokens tied with the k-th are kept,
                                  as in HF); 0 = off
5. top-p                          ``apply_top_p``       keep the most probable tokens until their mass reaches
                                  p; the token that crosses p is kept (ties with it too); at least one token
6. min-p                          ``apply_min_p``       keep tokens with p ≥ min_p · p_max
7. softmax                        ``probabilities``
8. draw                           ``sample``            the exponential race argmax(p / Exp(1)) over the kept
                                  candidates; rows kept whole (no cut-off) by a two-level inverse CDF with
                                  one uniform per row; unseeded top-p alone from the set C finds at once
                                  (a few rows) or by rejection from the whole row (all exact; no
                                  ``torch.multinomial``)

Every step is also a pure function on ``[B,V]`` logits (logits in, float32 logits out, rejected tokens = -inf,
at least one token kept) that can be used on its own. ``process_logits`` (steps 1–6), ``probabilities``
(1–7), ``sample`` (1–8) and ``logprobs`` run the whole pipeline with a fast path: disabled steps cost nothing,
greedy rows only take an argmax, top-k takes ``torch.topk`` first and does top-p / min-p inside the k
survivors (exactly equivalent, no full sort), and top-p without top-k partially sorts a small window
(top 256, then 1024) until the window provably holds every kept token, with an exact histogram select (sort
only the tokens of the bin where the mass crosses p) for rows whose top-p set is wider. ``sample`` with top-p
alone, on unseeded rows that C does not settle, does not find the top-p set at all: it draws from the whole row
and keeps the draw iff the mass strictly above it is < p, else draws again above it (``top_p_draw``: exact; a
pass of exps, or a partial sort of 256, per round, and a round passes with probability ≥ p).
``sample_with_logprobs`` draws and returns each drawn token's processed log-probability from the same cut (the
decode loop's step), ``chosen_logprobs`` scores given ids without a [B,V] processed row. With the same
settings ``probabilities`` equals transformers' ``TemperatureLogitsWarper → TopKLogitsWarper →
TopPLogitsWarper → MinPLogitsWarper`` + softmax (tests/test_sampling_hf.py).

Ties: top-k keeps every token tied with the k-th largest (HF's ``scores < kth`` rule). Top-p treats tied
tokens alike: a token is kept iff the mass of the tokens strictly more probable than it is < p, so a tie that
straddles the cut is kept whole (HF's result there depends on its unstable sort's order among equal values).

Shapes: ``logits`` is ``[B,V]`` (a ``[V]`` row is accepted and treated as a batch of one; outputs then drop
the batch dimension, except ``logprobs``). Logits of any floating dtype are processed in float32.
A config may be one ``SamplingConfig`` for the whole batch or a list with one per row: one batch can mix
greedy and sampled rows with different settings. The settings are per-row parameters, as vLLM's sampler takes
temperature[B], top_k[B], top_p[B]: rows whose cuts are of one kind (``cuts.cut_kind``: greedy, inside the top k,
top-p without top-k, whole rows) take each pass over the vocabulary together, each with its own temperature, k, p and
min-p (columns [b,1]), and a cut-off some of them leave off runs on the others only; the declared steps beyond these
(``general``) run step by step, each once over the rows that run it (``Step.rows``), or each row through its chain
alone where the rows are too wide to stay in the caches. Each row's numbers are the bits it gets alone, whatever the
batch (candidates of rows of one k are cut together: a softmax over a row padded to another's width rounds
otherwise).

The vocabulary axis: the pipeline reads across the vocabulary (row max, top-k candidates with their ids, sums
of masses and counts, the few tokens of one histogram bin) only through a ``Vocab``: the whole vocabulary in
this process by default. ``lmhead.distributed.ShardedVocab`` implements the same methods over ranks that each
hold a slice of the columns, so the vocab-parallel sampler is this very pipeline (steps 1-2 on each rank's own
columns, then the same code on every rank).

Layout of this package, each floor importing only the ones before it: ``vocab`` (``Vocab``, the chunked
passes' constants) → ``config`` (``SamplingConfig``, ``as_configs``) → ``inputs`` (checks of logits, ids and
per-row settings) → ``preprocess`` (steps 1-2) → ``rows`` (whole-row passes and the inverse-CDF draw) → ``race``
(``seeded_generator``, ``race_draw``) → ``top_p`` (top-p's windows, bins, C pass and rejection draw) → ``cuts``
(steps 3-6, by kind of cut) → ``draw`` (step 8 over a batch's kinds) → ``pipeline`` (``process_logits``,
``probabilities``, ``sample``, ``sample_with_logprobs``, ``chosen_logprobs``) → ``logprobs`` (``LogProbs``,
``logprobs``, ``entropy``).

Seeds: with ``config.seed`` set, a row's draw depends only on (seed, step) and the row's own logits — a
``torch.Generator`` seeded from (seed, step) draws noise over the row's kept tokens alone, in token-id order
(a row kept whole, without a cut-off or with min-p alone: one uniform for its inverse CDF), and the row is cut
and drawn on its own — so the same seed gives the same token whatever the batch size or position, and
whichever of the cut's paths (C, a window, the histogram, a sharded vocabulary) found the kept tokens.

Settings are bounded where float32 stays finite (temperature ≤ 1e4, repetition_penalty in [1e-4, 1e4],
|presence|, |frequency|, |logit_bias| ≤ 1e4); an overflow that still happens on logits near float32's limit is
a ValueError naming the setting (repetition_penalty, temperature), not the logits.
Rows without a seed use the ``generator`` argument (or torch's default generator).
"""

from __future__ import annotations

from lmhead.sampling.config import GREEDY_TEMPERATURE, SamplingConfig, as_configs
from lmhead.sampling.cuts import apply_min_p, apply_temperature, apply_top_k, apply_top_p
from lmhead.sampling.fields import sampling_config_from
from lmhead.sampling.inputs import as_prev_tokens, as_row_ints
from lmhead.sampling.logprobs import LogProbs, entropy, logprobs
from lmhead.sampling.pipeline import chosen_logprobs, probabilities, process_logits, sample, sample_with_logprobs
from lmhead.sampling.preprocess import apply_logit_bias, apply_penalties
from lmhead.sampling.race import race_draw, seeded_generator
from lmhead.sampling.steps import RowState
from lmhead.sampling.vocab import Vocab

__all__ = [
    "GREEDY_TEMPERATURE",
    "LogProbs",
    "RowState",
    "SamplingConfig",
    "Vocab",
    "apply_logit_bias",
    "apply_min_p",
    "apply_penalties",
    "apply_temperature",
    "apply_top_k",
    "apply_top_p",
    "as_configs",
    "as_prev_tokens",
    "as_row_ints",
    "chosen_logprobs",
    "entropy",
    "logprobs",
    "probabilities",
    "process_logits",
    "race_draw",
    "sample",
    "sample_with_logprobs",
    "sampling_config_from",
    "seeded_generator",
]
