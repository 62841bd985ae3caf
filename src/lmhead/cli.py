"""The `lmhead` command: argument parsing and printing only.

Every command calls the library (params.py, explain.py, generate.py, models/, server/); no logic lives here.
Bad input exits with code 2 and one line on stderr (`lmhead: error: ...`), never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence


class CLIError(Exception):
    """A user error: printed as one line on stderr, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse prints usage + message; we print one line
        raise CLIError(f"{self.prog}: error: {message}")


def _print_json(obj: object) -> None:
    sys.stdout.write(json.dumps(obj, ensure_ascii=False) + "\n")
    sys.stdout.flush()


# --- params -----------------------------------------------------------------------------------------------


def _add_params(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "params",
        help="parameter breakdown of a GPT-2- or Llama-style model, with the LM head's share",
        description=(
            "Count a transformer's parameters by component (token embedding, positions, attention, MLP, "
            "norms, LM head) and estimate the memory of the head's weight and of the logits tensor "
            "[batch, context, vocab]. Defaults describe GPT-2 small."
        ),
    )
    p.add_argument("--vocab", type=int, default=50257, help="vocabulary size V (default 50257)")
    p.add_argument("--context", type=int, default=1024, help="context length T (default 1024)")
    p.add_argument("--width", type=int, default=768, help="model width D (default 768)")
    p.add_argument("--layers", type=int, default=12, help="number of transformer blocks (default 12)")
    p.add_argument("--arch", choices=["gpt2", "llama"], default="gpt2",
                   help="gpt2: learned positions, LayerNorm, GELU MLP 4x; llama: RoPE, RMSNorm, SwiGLU, GQA")
    p.add_argument("--heads", type=int, default=None, help="attention heads (default width/64)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads for grouped-query attention "
                   "(llama; default = --heads)")
    p.add_argument("--ffn", type=int, default=None, help="MLP hidden width (default 4*width for gpt2; "
                   "llama: 8/3*width rounded up to a multiple of 256)")
    p.add_argument("--untied", action="store_true", help="the LM head has its own [V,D] weight")
    p.add_argument("--no-bias", action="store_true",
                   help="no biases in linear layers and LayerNorms (gpt2; as nanoGPT's bias=False)")
    p.add_argument("--batch", type=int, default=8, help="batch size for the logits memory estimate (default 8)")
    p.add_argument("--dtype", default="float32", help="dtype for the memory estimates (default float32)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(run=_run_params)


def _run_params(args: argparse.Namespace) -> None:
    from lmhead.params import count_parameters, head_memory, logits_memory

    counts = count_parameters(
        vocab=args.vocab, context=args.context, width=args.width, layers=args.layers, arch=args.arch,
        heads=args.heads, kv_heads=args.kv_heads, ffn=args.ffn, tied=not args.untied, bias=not args.no_bias,
    )
    logits = logits_memory(args.batch, args.context, args.vocab, args.dtype)
    weight = head_memory(args.vocab, args.width, args.dtype)
    if args.json:
        _print_json({**counts.to_dict(), "memory": {"logits": logits.to_dict(), "head_weight": weight.to_dict()}})
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{args.arch} parameters ({'tied' if counts.tied else 'untied'} head)")
    table.add_column("component")
    table.add_column("parameters", justify="right")
    table.add_column("share", justify="right")
    for name, count, share in counts.components():
        table.add_row(name.replace("_", " "), f"{count:,}", f"{share:.1%}")
    table.add_row("[bold]total[/bold]", f"[bold]{counts.total:,}[/bold]", "100.0%")
    console = Console()
    console.print(table)
    console.print(f"The head uses {counts.head_share:.1%} of the parameters"
                  + (" (its weight is the token embedding)." if counts.tied else "."))
    console.print(f"LM head weight {list(weight.shape)} {weight.dtype}: {weight.human}")
    console.print(f"Logits {list(logits.shape)} {logits.dtype}: {logits.human}"
                  " (and as much again for their gradient in training)")


# --- commands added by later issues register here ----------------------------------------------------------

_COMMANDS = [_add_params]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="lmhead",
        description=(
            "lmhead — the output layer of a language model: the LM head, the sampling pipeline "
            "(temperature, top-k, top-p, min-p, penalties), generation, the training loss, and an explainer."
        ),
    )
    from lmhead import __version__

    parser.add_argument("--version", action="version", version=f"lmhead {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
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


if __name__ == "__main__":
    sys.exit(main())
