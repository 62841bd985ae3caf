"""Parameter and memory calculators against the published counts."""

from __future__ import annotations

import json

import pytest

from lmhead.cli import main
from lmhead.params import count_parameters, head_memory, logits_memory


def test_gpt2_small_with_biases_matches_published_count():
    counts = count_parameters(vocab=50257, context=1024, width=768, layers=12)
    assert counts.total == 124_439_808
    assert counts.token_embedding == 38_597_376
    assert counts.positions == 786_432
    assert counts.attention + counts.mlp + counts.norms - 1_536 == 12 * 7_087_872  # blocks + final LayerNorm
    assert counts.lm_head == 0


def test_gpt2_without_bias_matches_nanogpt():
    assert count_parameters(vocab=50257, context=1024, width=768, layers=12, bias=False).total == 124_337_664


def test_llama3_8b_matches_published_count():
    counts = count_parameters(vocab=128256, context=8192, width=4096, layers=32, arch="llama", heads=32,
                              kv_heads=8, ffn=14336, tied=False)
    assert counts.total == 8_030_261_248
    assert counts.lm_head == counts.token_embedding == 128256 * 4096
    assert counts.positions == 0


def test_untied_head_adds_vocab_times_width():
    tied = count_parameters()
    untied = count_parameters(tied=False)
    assert untied.total - tied.total == 50257 * 768
    assert untied.lm_head == 50257 * 768


def test_breakdown_is_ordered_and_shares_sum_to_one():
    comps = count_parameters().components()
    assert [name for name, _, _ in comps] == ["token_embedding", "positions", "attention", "mlp", "norms",
                                              "lm_head"]
    assert sum(share for _, _, share in comps) == pytest.approx(1.0)


def test_to_dict_has_total_and_components_as_plain_fields():
    d = count_parameters().to_dict()
    assert d["total"] == 124_439_808
    assert isinstance(d["mlp"], int)
    json.dumps(d)


def test_logits_memory_of_the_series_example_is_about_2_gb():
    est = logits_memory(8, 2048, 32000, "float32")
    assert est.bytes == 8 * 2048 * 32000 * 4
    assert est.human == "2.10 GB"
    assert logits_memory(8, 2048, 32000, "bf16").bytes == est.bytes // 2


def test_head_memory_of_gemma_head_in_fp32():
    assert head_memory(262144, 640, "float32").bytes == 262144 * 640 * 4


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"vocab": 0}, "vocab must be a positive integer"),
        ({"width": -1}, "width must be a positive integer"),
        ({"layers": 2.5}, "layers must be an int"),
        ({"arch": "rnn"}, "arch must be"),
        ({"width": 100, "heads": 3}, "divisible by heads"),
        ({"arch": "llama", "heads": 12, "kv_heads": 5}, "multiple of kv_heads"),
        ({"kv_heads": 4}, "llama"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        count_parameters(**kwargs)


def test_bad_dtype_names_the_allowed_ones():
    with pytest.raises(ValueError, match="dtype must be one of"):
        logits_memory(1, 1, 1, "int3")


def test_cli_params_json_prints_one_object(capsys):
    assert main(["params", "--json", "--no-bias"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["total"] == 124_337_664
    assert out["memory"]["logits"]["bytes"] == 8 * 1024 * 50257 * 4


def test_cli_params_table_shows_total(capsys):
    assert main(["params", "--arch", "llama", "--vocab", "128256", "--context", "8192", "--width", "4096",
                 "--layers", "32", "--heads", "32", "--kv-heads", "8", "--ffn", "14336", "--untied"]) == 0
    assert "8,030,261,248" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["params", "--vocab", "-3"], ["params", "--vocab", "x"], ["nope"],
                                  ["params", "--dtype", "int3"]])
def test_cli_bad_input_exits_2_with_one_line(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error" in err
