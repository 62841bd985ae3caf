"""The decode engine: rows, rounds, the KV cache's bookkeeping, rows joining and leaving a running batch.

    rows.py       `prepare` / `prepare_ids` → `Row`s; `Step`, one generated token; text deltas; left padding
    engine.py     `Decoder`: prefill (in pieces), rounds over the lean body, join / begin_join / finish_join, select
    hf_rounds.py  `TransformersRounds`: one token per round over transformers' modules (no lean body)
    rounds.py     `Round`, what a round gives the rows; a constrained row's masks over the positions it judges
    logits.py     the decode head's logits, each row as it would be alone (`decode_logits`, the screened head)
    choice.py     the plain loop's choice (`plain_choice`) and what a row's config declares about it
    drafting.py   what the engine asks of a draft (`LookupDraft`, `ModelDraft`), k per row, the counts
    scores.py     logprobs, ranks and alternatives of a round's tokens
    budget.py     `PrefillBudget`: a joining prompt's pieces sized to the running rows' rounds

Below `lmhead.speculative` (the drafts and their acceptance rules, handed to a `Decoder` as objects) and
`lmhead.generate` (the loop and `Batch`, which choose the draft): nothing here imports either.
"""
