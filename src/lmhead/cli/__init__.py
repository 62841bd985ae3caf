"""The `lmhead` command: argument parsing and printing only.

Every command calls the library (params.py, the Model's predict / evaluate / generate, models/, server/,
sampling.fields.sampling_config_from for the sampling options, as the server does); no logic lives here.
Bad input exits with code 2 and one line on stderr (`lmhead: error: ...`), never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lmhead.cli.args import CLIError, Parser
from lmhead.cli.generation import add_chat, add_generate
from lmhead.cli.heads import add_classify, add_embed, add_rerank, add_train_head
from lmhead.cli.inspect_commands import add_eval, add_info, add_params, add_predict
from lmhead.cli.serve import add_serve

__all__ = ["CLIError", "build_parser", "entry", "main"]

_COMMANDS = [add_params, add_predict, add_eval, add_serve, add_generate, add_chat, add_embed, add_rerank,
             add_classify, add_train_head, add_info]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="lmhead",
        description=(
            "lmhead — the output layer of a language model: the LM head, the sampling pipeline "
            "(temperature, top-k, top-p, min-p, penalties), generation, the training loss, and an explainer."
        ),
    )
    from lmhead import __version__

    parser.add_argument("--version", action="version", version=f"lmhead {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    for add in _COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        args.run(args)
    except CLIError as exc:
        print(exc, file=sys.stderr)
        return 2
    except (ValueError, TypeError) as exc:
        print(f"lmhead: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    return 0


def entry() -> None:
    """The `lmhead` command: `main`, then the process ends without the interpreter's teardown, which frees the
    loaded model object by object after the answer is out. The atexit handlers run first, and where a thread
    other than daemons is still working the interpreter ends as usual (joining it)."""
    import atexit
    import os
    import threading

    code = main()
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
            pass
    os._exit(code)

