"""`lmhead generate`: streaming, JSON lines, stop strings, errors (exit 2) and Ctrl-C (exit 130)."""

from __future__ import annotations

import json

import pytest
from tiny import tiny_model

from lmhead.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    hf_model, tok = tiny_model("llama")
    hf_model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def test_json_lines_one_object_per_token(folder, capsys):
    code = main(["generate", "The cat sat", "--model", folder, "-n", "6", "--temperature", "0.9",
                 "--seed", "3", "--json", "--top-logprobs", "2"])
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    steps = [json.loads(line) for line in lines]
    assert 1 <= len(steps) <= 6
    for s in steps:
        assert {"token_id", "text", "logprob", "raw_logprob", "rank", "finish_reason", "index",
                "top_logprobs"} <= set(s)
        assert len(s["top_logprobs"]) == 2
    assert steps[-1]["finish_reason"] in ("stop", "length")


def test_text_output_is_the_prompt_then_the_generated_text(folder, capsys):
    assert main(["generate", "The cat sat", "--model", folder, "-n", "8", "--seed", "5", "--json"]) == 0
    text = "".join(json.loads(line)["text"] for line in capsys.readouterr().out.splitlines())
    assert main(["generate", "The cat sat", "--model", folder, "-n", "8", "--seed", "5"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "The cat sat" + text + "\n"
    assert "tokens/s" in captured.err


def test_text_output_computes_no_logprobs(folder, capsys, monkeypatch):
    import lmhead.decode.scores as S

    def scored(*args, **kwargs):
        raise AssertionError("text output scored its tokens")

    monkeypatch.setattr(S, "flat_scores", scored)
    assert main(["generate", "The cat sat", "--model", folder, "-n", "8", "--temperature", "0.9", "--seed", "5"]) == 0
    assert capsys.readouterr().out.startswith("The cat sat")
    with pytest.raises(AssertionError, match="scored"):  # JSON lines carry logprobs: they are computed
        main(["generate", "The cat sat", "--model", folder, "-n", "8", "--temperature", "0.9", "--seed", "5",
              "--json"])


def test_a_seed_reproduces_the_cli_output(folder, capsys):
    outs = []
    for _ in range(2):
        main(["generate", "Hello", "--model", folder, "-n", "10", "--temperature", "1.2", "--seed", "9"])
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]


def test_stop_strings_end_the_output(folder, capsys):
    main(["generate", "The cat", "--model", folder, "-n", "20", "--seed", "1", "--json"])
    text = "".join(json.loads(line)["text"] for line in capsys.readouterr().out.splitlines())
    stop = text[4:6]
    main(["generate", "The cat", "--model", folder, "-n", "20", "--seed", "1", "--stop", stop, "\x01", "--json"])
    steps = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert "".join(s["text"] for s in steps) == text[: text.index(stop)]
    assert steps[-1]["finish_reason"] == "stop"


@pytest.mark.parametrize(("args", "match"), [
    (["", ], "prompt"),
    (["hi", "-n", "0"], "max-new-tokens"),
    (["hi", "--temperature", "-1"], "temperature"),
    (["hi", "--top-p", "1.5"], "top_p"),
    (["hi", "--top-logprobs", "99"], "top-logprobs"),
])
def test_bad_input_exits_2_with_one_line(folder, capsys, args, match):
    code = main(["generate", *args, "--model", folder])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("lmhead: error:") and match in err and err.count("\n") == 1


def test_unknown_model_exits_2_and_lists_the_known_ones(capsys):
    assert main(["generate", "hi", "--model", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "gemma-3-270m" in err and "smollm2-135m" in err and "Traceback" not in err


def test_ctrl_c_keeps_the_output_and_exits_130(folder, capsys, monkeypatch):
    import lmhead.generate as gen

    real = gen.generate

    def interrupted(*args, **kwargs):
        steps = real(*args, **kwargs)

        def run():
            for i, step in enumerate(steps):
                if i == 3:
                    raise KeyboardInterrupt
                yield step
        return run()

    monkeypatch.setattr(gen, "generate", interrupted)
    code = main(["generate", "The cat", "--model", folder, "-n", "10", "--seed", "2"])
    captured = capsys.readouterr()
    assert code == 130
    assert captured.out.startswith("The cat") and captured.out.endswith("\n")
    assert "interrupted after 3 tokens" in captured.err and "Traceback" not in captured.err


def test_head_and_body_options_give_the_same_greedy_tokens(folder, capsys):
    outs = []
    for extra in ([], ["--head", "exact-int8", "--body", "transformers"], ["--head", "fp32", "--body", "onednn"]):
        assert main(["generate", "The cat sat", "--model", folder, "-n", "8", "--temperature", "0",
                     "--json", *extra]) == 0
        outs.append([json.loads(line)["token_id"] for line in capsys.readouterr().out.splitlines()])
    assert outs[0] == outs[1] == outs[2]


def test_an_unknown_head_mode_is_one_line_and_exit_2(folder, capsys):
    assert main(["generate", "The cat sat", "--model", folder, "--head", "int3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--head" in err[0] and "exact-int8" in err[0]


def _command(args, env_extra=None, code=""):
    """`lmhead <args>` as the console script runs it (`entry`), in a child process; `code` runs first."""
    import os
    import subprocess
    import sys

    script = f"import sys; {code}\nfrom lmhead.cli import entry\nsys.argv = ['lmhead', *{list(args)!r}]\nentry()"
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.slow
def test_the_command_ends_with_its_output_whole_and_its_exit_code(folder, capsys):
    assert main(["generate", "The cat sat", "--model", folder, "-n", "8", "--seed", "5", "--json"]) == 0
    want = capsys.readouterr().out
    done = _command(["generate", "The cat sat", "--model", folder, "-n", "8", "--seed", "5", "--json"],
                    code="import atexit; atexit.register(lambda: print('atexit ran', file=sys.stderr))")
    assert done.returncode == 0 and done.stdout == want  # every line out before the process ends
    assert "atexit ran" in done.stderr
    bad = _command(["generate", "The cat sat", "--model", folder, "--temperature", "-1"])
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "temperature" in bad.stderr


@pytest.mark.slow
def test_the_command_waits_for_a_thread_still_working(folder):
    code = ("import threading, time\n"
            "def late():\n    time.sleep(1.0)\n    print('thread done', file=sys.stderr, flush=True)\n"
            "threading.Thread(target=late).start()")
    done = _command(["generate", "The cat sat", "--model", folder, "-n", "2", "--seed", "5"], code=code)
    assert done.returncode == 0 and "thread done" in done.stderr
