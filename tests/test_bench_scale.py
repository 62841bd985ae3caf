"""benchmarks/bench_scale.py's MoE shapes: the Q4_K_M mix is llama.cpp's (its use_more_bits layers), the gpt-oss
shape's experts MXFP4 beside Q8_0, a side that crashes is a row of '-' cells, not the end of the run, and lmhead's
decode rate is the one-token steps after the prompt's prefill (llama-bench's tg's measure)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_scale  # noqa: E402


def test_the_q4_k_m_mix_keeps_q6_k_where_llama_cpp_does():
    table = bench_scale._moe_table("qwen3-30b-a3b", "Q4_K_M", 48)
    kinds = {name: how for name, _, how in table}
    more = [i for i in range(48) if kinds[f"blk.{i}.ffn_down_exps.weight"] == "Q6_K"]
    # llama-quant.cpp's use_more_bits over 48 layers: the first and last 6, and every third from layer 8
    assert more == [*range(6), *range(8, 42, 3), *range(42, 48)]
    assert all(kinds[f"blk.{i}.attn_v.weight"] == ("Q6_K" if i in more else "Q4_K") for i in range(48))
    assert all(kinds[f"blk.{i}.ffn_{p}_exps.weight"] == "Q4_K" for i in range(48) for p in ("gate", "up"))
    assert kinds["output.weight"] == "Q6_K" and kinds["token_embd.weight"] == "Q4_K"
    assert kinds["blk.0.ffn_gate_inp.weight"] == "normal"  # the router float32


def test_the_gpt_oss_shape_has_mxfp4_experts_and_q8_0_elsewhere():
    kinds = {name: how for name, _, how in bench_scale._moe_table("gpt-oss-20b", "MXFP4", 2)}
    assert {kinds[f"blk.1.ffn_{p}_exps.weight"] for p in ("gate", "up", "down")} == {"MXFP4"}
    assert kinds["blk.1.attn_q.weight"] == kinds["output.weight"] == "Q8_0"
    assert kinds["blk.1.attn_sinks.weight"] == kinds["blk.1.ffn_down_exps.bias"] == "normal"


def test_a_crashing_side_gives_no_figure_and_the_run_goes_on(tmp_path, monkeypatch):
    bins = tmp_path / "bin"
    bins.mkdir()
    (bins / "llama-bench").write_text("#!/bin/sh\nkill -SEGV $$\n")
    (bins / "llama-bench").chmod(0o755)
    monkeypatch.setattr(bench_scale, "BIN", bins)
    rate, rss = bench_scale.llama_bench(tmp_path / "any.gguf", 4)
    assert rate is None and rss == rss  # a peak measured (not NaN) even so
    out, _ = bench_scale._child("import sys; sys.exit(3)")
    assert out is None


@pytest.mark.parametrize("argv", [["--shape", "qwen3-30b-a3b", "--type", "Q5_K"],
                                  ["--shape", "gpt-oss-20b", "--type", "Q4_K"]])
def test_a_type_a_moe_shape_is_not_written_in_is_refused(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_scale.main([*argv, "--prepare", "--work", "/nonexistent"])
    assert exc.value.code == 2 and "--type" in capsys.readouterr().err


def test_the_decode_rate_times_the_steps_after_the_prompts_prefill(tmp_path):
    # llama-bench's tg times one-token steps from an empty context: lmhead's rate leaves out the prefill that gives
    # the first token, and reports the prefill and the rate with it beside
    from tiny_gguf import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "m.gguf", "llama", kind="Q8_0")
    out, rss = bench_scale._child(bench_scale._CHILD, str(path), "6", bench_scale.PROMPT, cache=tmp_path / "cache")
    assert out is not None and rss > 0
    assert out["steps"] == len(out["ids"]) - 1 >= 1
    assert out["prompt"] > 0 and out["rate"] > 0 and out["with_prompt"] > 0
    assert out["with_prompt"] * (out["prompt"] + out["steps"] / out["rate"]) == pytest.approx(len(out["ids"]), rel=0.05)


def test_rounds_alternate_the_sides_and_the_ratio_is_the_median_of_the_rounds_ratios(tmp_path, monkeypatch):
    # on a shared host a slow spell lands on both sides: each side goes first in turn, and the row holds the
    # rounds' medians, the median of their ratios and the ratios' range
    import argparse

    order, ours, theirs = [], iter([1.0, 1.0, 10.0, 12.0, 11.0]), iter([10.0, 10.0, 20.0])

    def child(code, *args, cache=None):
        order.append("lmhead")
        return {"rate": next(ours), "with_prompt": 1.0, "prompt": 0.1, "first": 0.2, "load": 0.3, "ids": [1]}, 100.0

    def bench(path, n):
        order.append("llama-bench")
        return next(theirs), 50.0

    class Table:
        def row(self, cells, figures):
            self.cells, self.figures = cells, figures

    monkeypatch.setattr(bench_scale, "_child", child)
    monkeypatch.setattr(bench_scale, "llama_bench", bench)
    path = tmp_path / "m.gguf"
    path.write_bytes(b"0" * 1024)
    table = Table()
    bench_scale._measure("llama-3.2-3b", "Q8_0", path, argparse.Namespace(new_tokens=4, rounds=3, layers=None), table)
    assert order == ["lmhead", "lmhead", "lmhead", "llama-bench", "llama-bench", "lmhead", "lmhead", "llama-bench"]
    assert table.cells[3:7] == ["11.00", "10.00", "1.00", "0.55-1.20"]  # ratios 1.0, 1.2, 0.55: not 11 / 10
    assert table.figures[0].ratio == pytest.approx(1.0)
