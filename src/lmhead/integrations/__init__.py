"""lmhead inside the tools people already train and generate with (transformers, TRL).

    transformers.py  apply_fused_loss(model): a causal LM's forward with `labels` returns lmhead's fused
                     linear_cross_entropy loss on its final hidden states (logits None); undo_fused_loss,
                     the fused_loss(model) context manager, load_fused(name_or_path)
    generation.py    SamplingLogitsProcessor: lmhead's logits pipeline (lmhead.sampling) as a transformers
                     logits processor for generate(); generate_kwargs, config_from_generation_config

Both need transformers (the `models` extra); importing this package does not import it.
"""
