"""models/parts.py: where the body, the final norm and the context length of a transformers model are."""

from __future__ import annotations

import pytest
from tiny import tiny_model

from lmhead import Model
from lmhead.models import parts


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_parts_of_a_causal_lm(arch):
    hf_model, tok = tiny_model(arch)
    body = parts.body(hf_model)
    assert body is hf_model.model
    assert parts.final_norm(body) is hf_model.model.norm
    assert parts.context_length(hf_model.config) == hf_model.config.max_position_embeddings == 256
    assert Model(hf_model, tok).context_length == 256  # Model and the explainer ask the same rule


def test_other_names_for_the_context_length():
    class GPT2Like:  # GPT-2 calls it n_positions
        n_positions = 1024

    assert parts.context_length(GPT2Like()) == 1024
    assert parts.context_length(object()) is None


def test_unknown_architectures_are_named_in_the_error():
    class Weird:
        pass

    with pytest.raises(TypeError, match="body of Weird"):
        parts.body(Weird())
    with pytest.raises(TypeError, match="final norm of Weird"):
        parts.final_norm(Weird())
