"""`lmhead chat`: turns from a pipe (answers streamed, history kept, /reset, /exit), Ctrl-C stopping an answer
but not the chat, a base model refused in one line, and the interactive prompt on a terminal (a pty)."""

from __future__ import annotations

import io
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny import save_tiny, tiny_model

from lmhead import load_model
from lmhead.cli import main
from lmhead.conversation import Conversation
from lmhead.sampling import SamplingConfig

pytestmark = pytest.mark.usefixtures("one_thread")

CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<eos>\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")
GREEDY = ["-t", "0", "-n", "6"]


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-chat")
    hf_model, tok = tiny_model("llama", seed=4)
    tok.chat_template = CHAT_TEMPLATE
    hf_model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def chat_model(chat_folder):
    return load_model(chat_folder, head="fp32")


def _chat(monkeypatch, capsys, folder, lines, *argv):
    monkeypatch.setattr(sys, "stdin", io.StringIO(lines))
    code = main(["chat", "--model", folder, *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _answers(model, turns, system=None):
    """The library's answers to `turns`, one conversation (what the CLI must print)."""
    chat = Conversation(model, system=system, config=SamplingConfig(temperature=0), max_new_tokens=6)
    return ["".join(s.text for s in chat.reply(t)) for t in turns]


def test_chat_from_a_pipe_answers_every_line_with_the_history_kept(monkeypatch, capsys, chat_folder, chat_model):
    code, out, err = _chat(monkeypatch, capsys, chat_folder, "Hi\n\nHow are you\n/reset\nHi\n/exit\nnot read\n",
                           *GREEDY, "--system", "Be brief.")
    assert code == 0, err
    first, second = _answers(chat_model, ["Hi", "How are you"], system="Be brief.")
    assert out.split("\n")[:-1] == [first, second, first]  # /reset: the same first turn again
    alone = _answers(chat_model, ["How are you"], system="Be brief.")[0]
    assert second != alone or first == ""  # the second turn read the first (its prompt holds it)


def test_ctrl_c_stops_the_answer_not_the_chat(monkeypatch, capsys, chat_folder, chat_model):
    original, calls = Conversation._steps, []

    def interrupted(self, *args, **kwargs):
        steps = original(self, *args, **kwargs)
        calls.append(1)
        if len(calls) > 1:
            return steps

        def two_then_ctrl_c():
            for i, step in enumerate(steps):
                if i == 2:
                    raise KeyboardInterrupt
                yield step
        return two_then_ctrl_c()

    monkeypatch.setattr(Conversation, "_steps", interrupted)
    code, out, err = _chat(monkeypatch, capsys, chat_folder, "Hi\nAgain\n", *GREEDY)
    assert code == 0 and "[answer stopped]" in err
    partial, rest = out.split("\n")[0], out.split("\n")[1]
    monkeypatch.setattr(Conversation, "_steps", original)
    chat = Conversation(chat_model, config=SamplingConfig(temperature=0), max_new_tokens=6)
    whole = "".join(s.text for s in chat.reply("Hi"))
    assert whole.startswith(partial) and len(partial) < len(whole) or whole == partial == ""
    chat.messages[-1]["content"] = partial  # the history keeps the answer as far as it came
    assert rest == "".join(s.text for s in chat.reply("Again"))


def test_chat_with_a_base_model_is_one_line_exit_2(monkeypatch, capsys, tmp_path):
    folder = str(save_tiny(tmp_path / "base", "llama", seed=3))
    capsys.readouterr()  # the save's progress bar
    code, out, err = _chat(monkeypatch, capsys, folder, "Hi\n", *GREEDY)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "no chat template" in err


def test_chat_rejects_bad_settings_before_loading(monkeypatch, capsys):
    monkeypatch.setattr("lmhead.models.load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    for argv, word in ((["-n", "0"], "--max-new-tokens"), (["--top-p", "2"], "top_p"), (["--system", ""], "--system")):
        code, _, err = _chat(monkeypatch, capsys, "x", "", *argv)
        assert code == 2 and word in err and err.count("\n") == 1


def _read_until(fd: int, marker: bytes, seen: bytes, timeout: float = 120.0) -> bytes:
    end = time.monotonic() + timeout
    while marker not in seen:
        left = end - time.monotonic()
        assert left > 0, seen[-500:]
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                seen += os.read(fd, 4096)
            except OSError:
                break
    return seen


@pytest.mark.slow
def test_chat_on_a_terminal_prompts_and_exits_on_slash_exit(chat_folder):
    leader, follower = pty.openpty()
    src = str(Path(__file__).parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "lmhead.cli", "chat", "--model", chat_folder, *GREEDY],
                            stdin=follower, stdout=follower, stderr=follower, env=env, close_fds=True)
    os.close(follower)
    try:
        seen = _read_until(leader, b">>> ", b"")
        assert b"/reset" in seen  # the greeting says how to use it
        os.write(leader, b"Hi\r")
        seen = _read_until(leader, b">>> ", seen.split(b">>> ", 1)[1])
        os.write(leader, b"/exit\r")
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(leader)


def test_a_chats_turns_reuse_the_history_through_the_prefix_cache(chat_model):
    chat = Conversation(chat_model, config=SamplingConfig(temperature=0), max_new_tokens=6)
    first = "".join(s.text for s in chat.reply("tell me about the cat and the dog please"))
    second = "".join(s.text for s in chat.reply("and the bird?"))
    assert chat.prefix_cache.hits >= 1 and chat.prefix_cache.reused >= 16
    fresh = Conversation(chat_model, config=SamplingConfig(temperature=0), max_new_tokens=6)
    fresh.messages = [{"role": "user", "content": "tell me about the cat and the dog please"},
                      {"role": "assistant", "content": first}]
    assert "".join(s.text for s in fresh.reply("and the bird?")) == second
    assert fresh.prefix_cache.hits == 0
