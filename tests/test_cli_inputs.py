"""The CLI's answers to bad input before any model loads (exit 2, one line on stderr), and its chat mode."""

from __future__ import annotations

import json
import socket

import pytest
from tiny import save_tiny

from lmhead.cli import main
from lmhead.cli.args import read_text

pytestmark = pytest.mark.usefixtures("one_thread")

CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<eos>\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(save_tiny(tmp_path_factory.mktemp("tiny-base"), "llama", seed=3))


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    from tiny import tiny_model

    path = tmp_path_factory.mktemp("tiny-chat")
    hf_model, tok = tiny_model("llama", seed=4)
    tok.chat_template = CHAT_TEMPLATE
    hf_model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture
def no_load(monkeypatch):
    """Any model load fails the test: these errors must come before it."""
    def load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("lmhead.models.load_model", load)


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code, err, *words):
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("lmhead")
    assert "Traceback" not in err
    for word in words:
        assert word in err, err


@pytest.mark.parametrize("argv", [["predict", "Hi"], ["generate", "Hi"], ["eval", "-"], ["serve", "--port", "0"]])
def test_an_empty_model_name_is_an_error_not_the_default(capsys, no_load, argv):
    code, _, err = run(capsys, *argv, "--model", "")
    one_line_error(code, err, "--model", "empty")


def test_an_empty_model_name_is_an_error_in_the_library():
    from lmhead.models import ModelError, resolve

    with pytest.raises(ModelError, match="empty"):
        resolve("")


def test_eval_of_an_endless_device_reads_a_bounded_amount(capsys, no_load):
    code, _, err = run(capsys, "eval", "/dev/zero")
    one_line_error(code, err, "/dev/zero", "larger than", "MiB")


def test_eval_of_a_binary_file_is_an_error(capsys, no_load, tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(b"text\x00\x01\x02 more")
    code, _, err = run(capsys, "eval", str(path))
    one_line_error(code, err, str(path), "binary")


def test_eval_of_a_folder_or_a_missing_file_is_an_error(capsys, no_load, tmp_path):
    code, _, err = run(capsys, "eval", str(tmp_path))
    one_line_error(code, err, "cannot read", str(tmp_path))
    code, _, err = run(capsys, "eval", str(tmp_path / "missing.txt"))
    one_line_error(code, err, "cannot read", "missing.txt")


def test_read_text_keeps_what_fits_and_reads_newlines_as_text_mode_does(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes("naïve\r\nline".encode())
    assert read_text(str(path)) == "naïve\nline"
    assert read_text(str(path), limit=len(path.read_bytes())) == "naïve\nline"
    with pytest.raises(ValueError, match="larger than 11 bytes"):
        read_text(str(path), limit=11)
    path.write_bytes(b"\xff\xfe bad")
    with pytest.raises(ValueError, match="not UTF-8"):
        read_text(str(path))


def test_serve_on_a_busy_port_fails_before_loading_the_model(capsys, no_load):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, out, err = run(capsys, "serve", "--port", str(port))
    one_line_error(code, err, f"--port {port}", "in use")
    assert out == ""


def test_serve_binds_before_loading_and_releases_the_port_when_the_load_fails(capsys, monkeypatch):
    seen = []

    def load(*args, **kwargs):  # the port is held while the model loads
        seen.append(socket.socket().connect_ex(("127.0.0.1", port)))
        raise ValueError("no such model")

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setattr("lmhead.models.load_model", load)
    code, _, err = run(capsys, "serve", "--port", str(port))
    one_line_error(code, err, "no such model")
    assert len(seen) == 1
    with socket.socket() as again:  # released: the port can be bound again
        again.bind(("127.0.0.1", port))


def test_serve_rejects_a_host_that_is_not_an_address(capsys, no_load):
    code, _, err = run(capsys, "serve", "--host", "no-such-host.invalid", "--port", "0")
    one_line_error(code, err, "--host no-such-host.invalid")


# --- chat mode --------------------------------------------------------------------------------------------


def test_generate_chat_applies_the_chat_template(capsys, chat_folder):
    from lmhead import load_model

    argv = ["--model", chat_folder, "-n", "5", "--temperature", "0", "--json"]
    code, out, err = run(capsys, "generate", "Write a haiku", "--chat", "--system", "Be brief.", *argv)
    assert code == 0, err
    chat = [json.loads(line)["token_id"] for line in out.splitlines()]
    templated = "<system>Be brief.<eos>\n<user>Write a haiku<eos>\n<assistant>"
    code, out, err = run(capsys, "generate", templated, *argv)
    assert code == 0, err
    assert chat == [json.loads(line)["token_id"] for line in out.splitlines()]
    model = load_model(chat_folder)
    assert model.tokenizer.chat_template == CHAT_TEMPLATE


def test_generate_chat_prints_the_answer_without_the_template(capsys, chat_folder):
    argv = ["generate", "Hi", "--chat", "--model", chat_folder, "-n", "3", "--temperature", "0"]
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    answer = "".join(json.loads(line)["text"] for line in out.splitlines())
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    assert out == answer + "\n"


def test_system_implies_chat_and_predict_has_a_chat_mode(capsys, chat_folder):
    code, out, err = run(capsys, "predict", "Hi", "--system", "Be brief.", "--model", chat_folder, "--json")
    assert code == 0, err
    assert json.loads(out)["prompt"] == "<system>Be brief.<eos>\n<user>Hi<eos>\n<assistant>"


def test_chat_mode_on_a_base_model_is_a_clear_error(capsys, folder):
    for command in ("generate", "predict"):
        code, _, err = run(capsys, command, "Hi", "--chat", "--model", folder)
        one_line_error(code, err, "no chat template", "base model", "smollm2-135m")


def test_an_empty_system_message_is_an_error(capsys, no_load):
    code, _, err = run(capsys, "generate", "Hi", "--system", "")
    one_line_error(code, err, "system")


def test_help_says_which_packaged_model_is_base_and_which_instruction_tuned(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "gemma-3-270m (the default; base" in out and "smollm2-135m (instruction-tuned" in out
    assert "--chat" in out and "exact" in out and "error bound" in out


@pytest.mark.parametrize("argv,option", [(["--parallel", "0"], "--parallel"), (["--ctx-size", "1"], "--ctx-size"),
                                         (["--max-tokens", "0"], "--max-tokens"), (["--queue", "-1"], "--queue"),
                                         (["--kv-memory", "0"], "--kv-memory"),
                                         (["--prefix-cache-memory", "-1"], "--prefix-cache-memory")])
def test_serve_rejects_a_bad_limit_before_loading_the_model(capsys, no_load, argv, option):
    code, _, err = run(capsys, "serve", "--port", "0", *argv)
    one_line_error(code, err, option)


def test_serve_rejects_a_ctx_size_over_the_models_context_in_one_line(capsys, folder, monkeypatch):
    import uvicorn

    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: pytest.fail("the server started"))
    code, _, err = run(capsys, "serve", "--model", folder, "--port", "0", "--ctx-size", "100000")
    one_line_error(code, err, "--ctx-size", "context")
