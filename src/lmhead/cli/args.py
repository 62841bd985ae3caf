"""What the commands share: the one-line error, the sampling and constraint options from the declarations, the
model option and its loading, chat messages, and reading a text file within bounds."""

from __future__ import annotations

import argparse
import json
import sys


class CLIError(Exception):
    """A user error: printed as one line on stderr, exit code 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse prints usage + message; we print one line
        raise CLIError(f"{self.prog}: error: {message}")


def print_json(obj: object) -> None:
    sys.stdout.write(json.dumps(obj, ensure_ascii=False) + "\n")
    sys.stdout.flush()


# --- shared options: the sampling pipeline (predict, generate, serve) ------------------------------------


SHORT_FLAGS = {"temperature": ("-t",)}  # the CLI's own short spellings of declared parameters


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """The logits pipeline's settings: one flag per declared parameter (`lmhead.sampling.steps`), the group's title
    naming lmhead's order of the steps; not given = SamplingConfig's default (everything off, T=1)."""
    from lmhead.sampling.fields import SAMPLING_FIELDS
    from lmhead.sampling.steps import ENTRY_FIELDS, ORDER, PARAMS

    order = ", ".join(n.replace("_", "-") for n in ORDER)
    add_step_args(p.add_argument_group(
        f"sampling (lmhead.sampling.steps; in this order: {order}; --samplers llama.cpp / transformers / a;b;c)"),
        (*(PARAMS[n] for n in SAMPLING_FIELDS), *ENTRY_FIELDS))


def id_list(text: str) -> list[int]:
    """"1,2,3" → [1, 2, 3] (token ids)."""
    try:
        return [int(v) for v in text.replace(" ", ",").split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected token ids separated by commas, got {text!r}") from None


def add_step_args(g, params) -> None:
    """One flag per declared parameter in `params`: --temperature (also -t), --top-k, --typical-p, ...; an id list
    is "1,2,3", a sequence flag is given once per sequence (--bad-words 5,6 --bad-words 7). Not given =
    SamplingConfig's default; SamplingConfig checks the values (exit 2 naming the field and its range)."""
    for param in params:
        flag = ("--" + param.name.replace("_", "-"), *SHORT_FLAGS.get(param.name, ()))
        text = f"{param.allowed}; {param.doc}".replace("%", "%%")
        if param.kind in ("float", "int"):
            g.add_argument(*flag, type=float if param.kind == "float" else int, default=None, help=text)
        elif param.kind == "ids":
            g.add_argument(*flag, type=id_list, default=None, help=text)
        elif param.kind == "sequences":
            g.add_argument(*flag, type=id_list, action="append", default=None, help=text)
        else:  # names: a preset or a;b;c
            g.add_argument(*flag, default=None, help=text)


def add_constraint_args(p: argparse.ArgumentParser) -> None:
    """Structured output (lmhead.constrain): at most one; the answer is constrained from its first token."""
    g = p.add_argument_group("structured output (one of them; applied before every sampling step)")
    x = g.add_mutually_exclusive_group()
    x.add_argument("--json-schema", metavar="FILE", default=None,
                   help="the answer is JSON matching the JSON schema in FILE ('-' reads stdin)")
    x.add_argument("--json-object", action="store_true", help="the answer is a JSON object")
    x.add_argument("--regex", metavar="R", default=None, help="the answer matches the regular expression R")
    x.add_argument("--choice", metavar="A,B,C", default=None, help="the answer is one of the comma-separated strings")
    x.add_argument("--grammar", metavar="FILE", default=None,
                   help="the answer follows the grammar in FILE: Lark (llguidance's), or GBNF where rules use ::=")


def constraint_of(args: argparse.Namespace):
    """The constraint the flags ask for (None: a free answer); a malformed one is an error naming the flag."""
    from lmhead.constrain import Choice, Grammar, JSONObject, JSONSchema, Regex
    from lmhead.constrain.constraints import MAX_CONSTRAINT_CHARS

    try:
        if args.json_schema is not None:
            return JSONSchema(read_text(args.json_schema, MAX_CONSTRAINT_CHARS))
        if args.json_object:
            return JSONObject()
        if args.regex is not None:
            return Regex(args.regex)
        if args.choice is not None:
            return Choice([c for c in args.choice.split(",") if c] or [""])
        if args.grammar is not None:
            return Grammar.from_text(read_text(args.grammar, MAX_CONSTRAINT_CHARS))
    except (ValueError, TypeError) as exc:
        flag = next(f for f in ("json_schema", "json_object", "regex", "choice", "grammar") if getattr(args, f))
        raise ValueError(f"--{flag.replace('_', '-')}: {exc}") from None
    return None


def sampling_config_of(args: argparse.Namespace):
    """The SamplingConfig of `add_sampling_args`' options (and --seed where the command has it), made by the
    function the server uses too: the same settings give the same config or the same error."""
    from lmhead.sampling.fields import sampling_config_from

    return sampling_config_from(args, seed=getattr(args, "seed", None))


def models_help() -> str:
    """The packaged models for --help, each with its kind (base or instruction-tuned), from the registry."""
    from lmhead.models.registry import DEFAULT_MODEL, MODELS

    names = [f"{name} ({'the default; ' if name == DEFAULT_MODEL else ''}{spec.kind}"
             f"{': use --chat' if spec.instruct else ': continues text'})" for name, spec in MODELS.items()]
    return "model: " + ", ".join(names) + ", a .gguf file or a Hugging Face model folder"


HEAD_HELP = ("LM head: auto (default: fp32 where the model reads its GGUF file's codes — exact, and the fastest; "
              "else exact-int8 for heads of >= 256 MiB, fp32 below), fp32, exact-int8 (int8 + exact re-scoring: the "
              "fp32 head's greedy token and top-64), int8/int4 (approximate)")


def add_model_arg(p: argparse.ArgumentParser, head_help: str = HEAD_HELP) -> None:
    p.add_argument("--model", "-m", default=None, help=models_help())
    p.add_argument("--head", default=None, choices=["auto", "fp32", "exact-int8", "int8", "int4"], help=head_help)
    p.add_argument("--body", default="auto", choices=["auto", "lean", "onednn", "transformers"],
                   help="how the body runs: auto (default: lean where the architecture has it, else oneDNN), "
                   "lean (the forward written out over the same weights: static KV cache, fused products), "
                   "onednn (transformers' modules with oneDNN's linear kernel), transformers (its own modules)")


def check_model_arg(args: argparse.Namespace) -> None:
    """--model given as an empty string is an error, not the default model (checked before anything loads)."""
    if args.model is not None and not args.model.strip():
        raise ValueError("--model: empty; give a model name (gemma-3-270m, smollm2-135m), a .gguf file or a "
                         "model folder, or leave --model out for the default")


def load_model_of(args: argparse.Namespace, head: str | None = None):
    """The model of --model/--head/--body; `head` is the command's head when --head is not given."""
    from lmhead.models import DEFAULT_MODEL, load_model

    check_model_arg(args)
    return load_model(args.model or DEFAULT_MODEL, head=args.head or head or "auto", body=args.body)


def add_chat_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat", action="store_true",
                   help="chat mode: PROMPT is a user message, wrapped in the model's chat template (an "
                   "instruction-tuned model such as smollm2-135m; a base model has none: an error)")
    p.add_argument("--system", default=None, metavar="TEXT", help="a system message before PROMPT (implies --chat)")


def chat_messages_of(args: argparse.Namespace):
    """The chat of --chat/--system (checked before the model loads), or None without chat mode."""
    from lmhead.models.chat import chat_messages

    if not (args.chat or args.system is not None):
        return None
    return chat_messages(args.prompt, system=args.system)


def prompt_text_of(model, args: argparse.Namespace, messages) -> str:
    """PROMPT as given, or in chat mode the model's chat template applied to `messages` (error if it has none)."""
    from lmhead.models.chat import chat_prompt

    return args.prompt if messages is None else chat_prompt(model, messages, require_template=True)


MAX_EVAL_BYTES = 16 * 2**20  # what eval reads at most: ~4M tokens, hours of CPU time already


def read_text(name: str, limit: int | None = None) -> str:
    """The text of file `name` ('-': stdin), reading at most `limit` + 1 bytes whatever the file is (a device
    such as /dev/zero, a pipe): over `limit`, NUL bytes (binary) or not UTF-8 is a ValueError naming it.
    Newlines are read as open(..., encoding="utf-8") reads them (universal newlines)."""
    import io

    limit = MAX_EVAL_BYTES if limit is None else limit
    what = "stdin" if name == "-" else name
    try:
        if name == "-":
            data = sys.stdin.buffer.read(limit + 1)
        else:
            with open(name, "rb") as f:
                data = f.read(limit + 1)
    except OSError as exc:
        raise ValueError(f"cannot read {name}: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise ValueError(f"{what}: larger than {limit:,} bytes ({limit / 2**20:g} MiB), the most eval reads; "
                         "split the text")
    if b"\x00" in data:
        raise ValueError(f"{what} is binary (it contains NUL bytes), not text")
    try:
        return io.TextIOWrapper(io.BytesIO(data), encoding="utf-8").read()
    except UnicodeDecodeError:
        raise ValueError(f"{what} is not UTF-8 text") from None
