"""The `lmhead` command: argument parsing and printing only.

Every command calls the library (params.py, the Model's predict / evaluate / generate, models/, server/,
sampling.fields.sampling_config_from for the sampling options, as the server does); no logic lives here.
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


# --- shared options: the sampling pipeline (predict, generate, serve) ------------------------------------


_SHORT_FLAGS = {"temperature": ("-t",)}  # the CLI's own short spellings of declared parameters


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    """The logits pipeline's settings: one flag per declared parameter (`lmhead.sampling.steps`), the group's title
    naming lmhead's order of the steps; not given = SamplingConfig's default (everything off, T=1)."""
    from lmhead.sampling.fields import SAMPLING_FIELDS
    from lmhead.sampling.steps import ENTRY_FIELDS, ORDER, PARAMS

    order = ", ".join(n.replace("_", "-") for n in ORDER)
    _add_step_args(p.add_argument_group(
        f"sampling (lmhead.sampling.steps; in this order: {order}; --samplers llama.cpp / transformers / a;b;c)"),
        (*(PARAMS[n] for n in SAMPLING_FIELDS), *ENTRY_FIELDS))


def _id_list(text: str) -> list[int]:
    """"1,2,3" → [1, 2, 3] (token ids)."""
    try:
        return [int(v) for v in text.replace(" ", ",").split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected token ids separated by commas, got {text!r}") from None


def _add_step_args(g, params) -> None:
    """One flag per declared parameter in `params`: --temperature (also -t), --top-k, --typical-p, ...; an id list
    is "1,2,3", a sequence flag is given once per sequence (--bad-words 5,6 --bad-words 7). Not given =
    SamplingConfig's default; SamplingConfig checks the values (exit 2 naming the field and its range)."""
    for param in params:
        flag = ("--" + param.name.replace("_", "-"), *_SHORT_FLAGS.get(param.name, ()))
        text = f"{param.allowed}; {param.doc}".replace("%", "%%")
        if param.kind in ("float", "int"):
            g.add_argument(*flag, type=float if param.kind == "float" else int, default=None, help=text)
        elif param.kind == "ids":
            g.add_argument(*flag, type=_id_list, default=None, help=text)
        elif param.kind == "sequences":
            g.add_argument(*flag, type=_id_list, action="append", default=None, help=text)
        else:  # names: a preset or a;b;c
            g.add_argument(*flag, default=None, help=text)


def _add_constraint_args(p: argparse.ArgumentParser) -> None:
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


def _constraint(args: argparse.Namespace):
    """The constraint the flags ask for (None: a free answer); a malformed one is an error naming the flag."""
    from lmhead.constrain import Choice, Grammar, JSONObject, JSONSchema, Regex
    from lmhead.constrain.constraints import MAX_CONSTRAINT_CHARS

    try:
        if args.json_schema is not None:
            return JSONSchema(_read_text(args.json_schema, MAX_CONSTRAINT_CHARS))
        if args.json_object:
            return JSONObject()
        if args.regex is not None:
            return Regex(args.regex)
        if args.choice is not None:
            return Choice([c for c in args.choice.split(",") if c] or [""])
        if args.grammar is not None:
            return Grammar.from_text(_read_text(args.grammar, MAX_CONSTRAINT_CHARS))
    except (ValueError, TypeError) as exc:
        flag = next(f for f in ("json_schema", "json_object", "regex", "choice", "grammar") if getattr(args, f))
        raise ValueError(f"--{flag.replace('_', '-')}: {exc}") from None
    return None


def _sampling_config(args: argparse.Namespace):
    """The SamplingConfig of `_add_sampling_args`' options (and --seed where the command has it), made by the
    function the server uses too: the same settings give the same config or the same error."""
    from lmhead.sampling.fields import sampling_config_from

    return sampling_config_from(args, seed=getattr(args, "seed", None))


def _models_help() -> str:
    """The packaged models for --help, each with its kind (base or instruction-tuned), from the registry."""
    from lmhead.models.registry import DEFAULT_MODEL, MODELS

    names = [f"{name} ({'the default; ' if name == DEFAULT_MODEL else ''}{spec.kind}"
             f"{': use --chat' if spec.instruct else ': continues text'})" for name, spec in MODELS.items()]
    return "model: " + ", ".join(names) + ", a .gguf file or a Hugging Face model folder"


_HEAD_HELP = ("LM head: auto (default: fp32 where the model reads its GGUF file's codes — exact, and the fastest; "
              "else exact-int8 for heads of >= 256 MiB, fp32 below), fp32, exact-int8 (int8 + exact re-scoring: the "
              "fp32 head's greedy token and top-64), int8/int4 (approximate)")


def _add_model_arg(p: argparse.ArgumentParser, head_help: str = _HEAD_HELP) -> None:
    p.add_argument("--model", "-m", default=None, help=_models_help())
    p.add_argument("--head", default=None, choices=["auto", "fp32", "exact-int8", "int8", "int4"], help=head_help)
    p.add_argument("--body", default="auto", choices=["auto", "lean", "onednn", "transformers"],
                   help="how the body runs: auto (default: lean where the architecture has it, else oneDNN), "
                   "lean (the forward written out over the same weights: static KV cache, fused products), "
                   "onednn (transformers' modules with oneDNN's linear kernel), transformers (its own modules)")


def _check_model_arg(args: argparse.Namespace) -> None:
    """--model given as an empty string is an error, not the default model (checked before anything loads)."""
    if args.model is not None and not args.model.strip():
        raise ValueError("--model: empty; give a model name (gemma-3-270m, smollm2-135m), a .gguf file or a "
                         "model folder, or leave --model out for the default")


def _load(args: argparse.Namespace, head: str | None = None):
    """The model of --model/--head/--body; `head` is the command's head when --head is not given."""
    from lmhead.models import DEFAULT_MODEL, load_model

    _check_model_arg(args)
    return load_model(args.model or DEFAULT_MODEL, head=args.head or head or "auto", body=args.body)


def _add_chat_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat", action="store_true",
                   help="chat mode: PROMPT is a user message, wrapped in the model's chat template (an "
                   "instruction-tuned model such as smollm2-135m; a base model has none: an error)")
    p.add_argument("--system", default=None, metavar="TEXT", help="a system message before PROMPT (implies --chat)")


def _chat_messages(args: argparse.Namespace):
    """The chat of --chat/--system (checked before the model loads), or None without chat mode."""
    from lmhead.models.chat import chat_messages

    if not (args.chat or args.system is not None):
        return None
    return chat_messages(args.prompt, system=args.system)


def _prompt_text(model, args: argparse.Namespace, messages) -> str:
    """PROMPT as given, or in chat mode the model's chat template applied to `messages` (error if it has none)."""
    from lmhead.models.chat import chat_prompt

    return args.prompt if messages is None else chat_prompt(model, messages, require_template=True)


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


# --- predict ----------------------------------------------------------------------------------------------


def _add_predict(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "predict",
        help="the next-token candidates for a prompt, before and after the sampling pipeline",
        description=(
            "Show the prompt's tokens and the top candidates for the next token: logit, logit/T, raw "
            "probability (softmax at T=1), processed probability (after penalties, temperature, top-k, "
            "top-p, min-p; 0 for cut tokens), cumulative mass, which cut removed each token, the entropy of "
            "both distributions and how many tokens survive. Computed over the full vocabulary with the "
            "model's full-precision head (fp32): the numbers are the model's own (transformers' to 1e-5), "
            "whatever head generate decodes with."
        ),
    )
    p.add_argument("prompt", help="the prompt text (with --chat: the user's message)")
    _add_model_arg(p, head_help="the head whose logits are shown: fp32 (default: the model's full-precision head, "
                   "exact), or exact-int8/int8/int4 to see what that compressed head computes (auto = the head "
                   "generate would use)")
    _add_chat_args(p)
    _add_sampling_args(p)
    _add_constraint_args(p)
    p.add_argument("--top", type=int, default=10, help="candidates to show (default 10)")
    p.add_argument("--layers", action="store_true",
                   help="logit lens: the final norm + head applied after every layer (top candidates per layer)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(run=_run_predict)


def _run_predict(args: argparse.Namespace) -> None:
    config = _sampling_config(args)  # bad settings fail before the model loads
    if args.top < 1:
        raise ValueError(f"--top must be >= 1, got {args.top}")
    constraint = _constraint(args)
    messages = _chat_messages(args)
    model = _load(args, head="fp32")  # no compressed head to build unless --head asks to see one
    prompt = _prompt_text(model, args, messages)
    head = "exact" if args.head in (None, "fp32") else "decode"
    from lmhead import explain

    pred = explain.predict(model, prompt, top=args.top, config=config, layers=args.layers, model_name=model.name,
                           head=head, constraint=constraint)
    if args.json:
        _print_json(pred.to_dict())
        return
    from lmhead._explain_display import print_prediction

    print_prediction(pred)


# --- eval -------------------------------------------------------------------------------------------------


def _add_eval(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="perplexity of a text file (and how surprising each token was)",
        description=(
            "Perplexity = exp(mean next-token loss) of the file's text, tokenized with the tokenizer's "
            "defaults (as transformers' model(ids, labels=ids).loss); the loss is lmhead's "
            "linear_cross_entropy on the body's hidden states. Long texts are read in sliding windows: each "
            "window scores only its new tokens, the rest is context."
        ),
    )
    p.add_argument("file", help=f"a UTF-8 text file of at most {MAX_EVAL_BYTES // 2**20} MiB ('-' reads stdin)")
    _add_model_arg(p, head_help="the head generate would use (eval always scores with the full-precision head; "
                   "default fp32)")
    p.add_argument("--window", type=int, default=None,
                   help="tokens per window (default min(1024, the model's context length))")
    p.add_argument("--stride", type=int, default=None, help="tokens the window moves by (default window/2)")
    p.add_argument("--tokens", action="store_true",
                   help="per-token log-probability and rank: with --json as a list, else the text coloured "
                        "by rank (top-1 green, top-10 yellow, top-100 red, beyond purple, as GLTR)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=_run_eval)


MAX_EVAL_BYTES = 16 * 2**20  # what eval reads at most: ~4M tokens, hours of CPU time already


def _read_text(name: str, limit: int | None = None) -> str:
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


def _run_eval(args: argparse.Namespace) -> None:
    _check_model_arg(args)
    text = _read_text(args.file)
    if not text.strip():
        raise ValueError(f"{args.file} is empty: nothing to evaluate")
    model = _load(args, head="fp32")  # eval scores with the full-precision head: no compressed head to build
    from lmhead import explain

    ev = explain.evaluate(model, text, window=args.window, stride=args.stride, tokens=args.tokens, progress=True)
    if args.json:
        _print_json(ev.to_dict())
        return
    from lmhead._explain_display import print_evaluation

    print_evaluation(ev)


# --- serve ------------------------------------------------------------------------------------------------


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="the explainer page and an OpenAI-compatible API on a local web server",
        description=(
            "Load a model and serve the explainer page (how the next token is chosen: candidates, "
            "temperature/top-k/top-p/min-p sliders, entropy, logit lens, scoring, parameters) and a JSON API: "
            "/api/* for the page, OpenAI-compatible /v1/completions, /v1/chat/completions and /v1/models. "
            "API docs at /docs. Binds to 127.0.0.1 unless --host says otherwise."
        ),
    )
    _add_model_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port)")
    p.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="a name the server answers to beside 127.0.0.1, localhost, [::1] and --host (repeatable; "
                        "'*' = any): other Host headers get 400, against DNS rebinding")
    p.add_argument("--classifier", default=None, metavar="FILE",
                   help="the classification head /v1/classify answers with (a .safetensors file from train-head; "
                        "default: the model file's own, if any)")
    g = p.add_argument_group("limits (as llama-server's -c / -n / -np; defaults from the model)")
    g.add_argument("--ctx-size", "-c", type=int, default=None, metavar="N",
                   help="tokens a request may use, prompt + max_tokens (default: the model's context)")
    g.add_argument("--max-tokens", "-n", type=int, default=None, metavar="N",
                   help="new tokens a request may ask for (default: the context less one)")
    g.add_argument("--parallel", "-np", type=int, default=None, metavar="N",
                   help="rows decoding at once, all requests together (default 32); more wait their turn")
    g.add_argument("--kv-memory", type=float, default=None, metavar="GIB",
                   help="GiB of KV cache the live rows may hold together (default: half the memory available); "
                        "a request that does not fit waits")
    g.add_argument("--queue", type=int, default=None, metavar="N",
                   help="requests that may wait for room (default 256); one more gets 503 with Retry-After")
    g.add_argument("--prefix-cache-memory", type=float, default=None, metavar="GIB",
                   help="GiB of prompts' keys and values kept for reuse by prompts that begin the same way "
                        "(default: 1, at most a quarter of --kv-memory; 0 = none)")
    g.add_argument("--prefix-cache-file", default=None, metavar="PATH",
                   help="keep the prefix cache in this file across restarts: read at start (a file of another "
                        "model or version, or a damaged one, is refused and rewritten), written at shutdown")
    p.set_defaults(run=_run_serve)


def _listen(host: str, port: int) -> list:
    """Sockets bound to every address of `host` at `port` (as uvicorn would bind them), made before the model
    loads, so that a busy port or a bad host is a one-line error (exit 2), not a failure after the load."""
    import errno
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"--host {host}: not an address of this machine ({exc.strerror})") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, addr in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(addr)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        why = ("it is in use (another server?); choose another --port, or 0 for any free port"
               if exc.errno == errno.EADDRINUSE else exc.strerror or str(exc))
        raise ValueError(f"--port {port}: cannot listen on {host}:{port}: {why}") from None
    return sockets


def _run_serve(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    _check_model_arg(args)
    for option, value, least in (("--ctx-size", args.ctx_size, 2), ("--max-tokens", args.max_tokens, 1),
                                 ("--parallel", args.parallel, 1), ("--queue", args.queue, 0)):
        if value is not None and value < least:  # before the model loads; the rest needs its context
            raise ValueError(f"{option} must be an integer ≥ {least}, got {value}")
    if args.kv_memory is not None and not 0 < args.kv_memory < float("inf"):
        raise ValueError(f"--kv-memory must be a positive number of GiB, got {args.kv_memory}")
    if args.prefix_cache_memory is not None and not 0 <= args.prefix_cache_memory < float("inf"):
        raise ValueError(f"--prefix-cache-memory must be a number of GiB ≥ 0, got {args.prefix_cache_memory}")
    sockets = _listen(args.host, args.port)
    try:
        import uvicorn

        from lmhead.server import create_app
        from lmhead.server.limits import serve_limits

        model = _load(args)
        kv = None if args.kv_memory is None else int(args.kv_memory * 2**30)
        limits = serve_limits(model, args.ctx_size, args.max_tokens, args.parallel, kv, args.queue)
        # /v1/classify's head, checked against the model's width before anything is served
        classifier = None if args.classifier is None else _classifier_head(args.classifier, model)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"lmhead: warning: serving on {args.host}: anyone who can reach it can use the model",
              file=sys.stderr)
    port = sockets[0].getsockname()[1]  # the port bound (--port 0: the one the system chose)
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"lmhead: serving {model.name} at http://{host}:{port}/ (Ctrl-C stops)", file=sys.stderr)
    print(f"lmhead: context {limits.context:,} tokens, max_tokens {limits.max_tokens:,}, {limits.parallel} rows "
          f"at once, {limits.kv_bytes / 2**30:.1f} GiB of KV memory", file=sys.stderr)
    prefix = None if args.prefix_cache_memory is None else int(args.prefix_cache_memory * 2**30)
    app = create_app(model, allowed_hosts=[args.host, *args.allowed_host], serve=limits, prefix_cache_bytes=prefix)
    if args.prefix_cache_file is not None:
        from lmhead.server.prefix_file import keep_prefix_cache

        why = keep_prefix_cache(app, args.prefix_cache_file)
        if why is not None:
            print(f"lmhead: --prefix-cache-file {args.prefix_cache_file}: {why}; starting with an empty prefix cache",
                  file=sys.stderr)
    app.state.classifier = classifier
    from lmhead.server.protocol import HeaderTimeoutProtocol  # uvicorn's h11, with a deadline for headers

    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=port, log_level="warning",
                                           http=HeaderTimeoutProtocol))
    server.run(sockets=sockets)
    if not server.started:  # the app failed to start (uvicorn logged why): uvicorn's own exit code
        raise SystemExit(3)


# --- generate ---------------------------------------------------------------------------------------------


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text from a prompt, token by token, streamed as it comes",
        description=(
            "Generate up to --max-new-tokens tokens after PROMPT with lmhead's decode loop (KV cache, lmhead's "
            "head and sampling pipeline), printing each piece of text as soon as it is chosen. Stops at the "
            "model's end-of-sequence tokens, a --stop string (not printed), --max-new-tokens or the context "
            "length. --json prints one JSON object per token (JSON lines): token_id, text, logprob, "
            "raw_logprob, rank, finish_reason, index and top_logprobs (the --top-logprobs alternatives, each "
            "with token_id, text, logprob and raw_logprob; a log-probability of -inf is null). Ctrl-C stops "
            "and keeps what was printed. "
            "The log-probabilities are the decode head's. With --head fp32 (auto's choice for smollm2-135m) they "
            "are exact. With exact-int8 (auto's choice for gemma-3-270m) the chosen token and the top 64 logits "
            "are the fp32 head's, so logprob is exact for greedy and top-k <= 64 steps, but the softmax's "
            "normaliser includes the int8 tail: raw_logprob (and logprob without such a top-k) is within "
            "log(1 + P_tail*(e^eps - 1)) <= eps of the exact value, eps being the head's per-row error bound "
            "(docs/compressed.md). lmhead predict always shows the exact numbers. "
            "Models: gemma-3-270m is a base model (it continues PROMPT); smollm2-135m is instruction-tuned "
            "(give it an instruction with --chat, which applies its chat template)."
        ),
    )
    p.add_argument("prompt", help="the prompt text (with --chat: the user's message)")
    _add_model_arg(p)
    _add_chat_args(p)
    p.add_argument("--max-new-tokens", "-n", type=int, default=64, help="tokens to generate at most (default 64)")
    _add_sampling_args(p)
    _add_constraint_args(p)
    p.add_argument("--seed", type=int, default=None,
                   help="seed for the draws: the same seed and settings give the same text")
    p.add_argument("--stop", action="extend", nargs="+", default=None, metavar="S",
                   help="stop strings: the text ends before the first one that appears")
    p.add_argument("--top-logprobs", type=int, default=0, metavar="N",
                   help="with --json: the N most likely alternatives at each step (0..20)")
    p.add_argument("--json", action="store_true", help="print one JSON object per generated token")
    p.add_argument("--exact-logprobs", action="store_true",
                   help="with --json: compute every log-probability with the fp32 head (exact; one more head "
                   "product per token); the tokens do not change")
    p.add_argument("--draft", default="auto", choices=["auto", "ngram", "int8", "none"],
                   help="speculative decoding: auto (default: the fastest exact setting measured: ngram where "
                   "the head is the larger read, as gemma-3-270m's; none for smollm2-135m), ngram (drafts from "
                   "the text's own earlier tokens), "
                   "int8 (the same model with int8 weights drafts), none; the full-precision model verifies. The "
                   "text does not change: greedy is the full-precision model's; a --seed gives the same tokens "
                   "where the head's kept logits are exact (fp32 head, or top-k <= 64), else the same distribution")
    p.add_argument("--draft-tokens", type=int, default=4, metavar="K",
                   help="tokens drafted per verification to start with (1..16; adapts to the acceptance rate)")
    p.add_argument("--stats", action="store_true",
                   help="also print the speculative statistics (acceptance rate, tokens per verification)")
    p.set_defaults(run=_run_generate)


def _run_generate(args: argparse.Namespace) -> None:
    import time

    if not args.prompt:
        raise ValueError("prompt: the prompt is empty")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not 0 <= args.top_logprobs <= 20:
        raise ValueError(f"--top-logprobs must be in 0..20, got {args.top_logprobs}")
    from lmhead import generate
    from lmhead.speculative import SpeculativeStats, check_draft_tokens

    check_draft_tokens(args.draft_tokens)
    config = _sampling_config(args)  # bad settings fail before the model loads
    constraint = _constraint(args)
    messages = _chat_messages(args)
    model = _load(args)
    prompt = _prompt_text(model, args, messages)
    stats = SpeculativeStats()
    steps = generate.generate(model, prompt, args.max_new_tokens, config=config, stop=args.stop,
                              top_logprobs=args.top_logprobs, draft=args.draft, draft_tokens=args.draft_tokens,
                              stats=stats, exact_logprobs=args.exact_logprobs, constraint=constraint,
                              scores=args.json)  # text shows no logprobs: none computed (nor the normaliser's pass)
    out, count, finish, t0 = sys.stdout, 0, None, time.perf_counter()
    if not args.json and messages is None:  # a chat prints the answer only, not the template around the prompt
        out.write(args.prompt)
        out.flush()
    try:
        for step in steps:
            count, finish = count + 1, step.finish_reason
            if args.json:
                _print_json(step.to_dict())
            else:
                out.write(step.text)
                out.flush()
    except KeyboardInterrupt:  # keep what was printed, end the line, exit 130 (main)
        if not args.json:
            out.write("\n")
            out.flush()
        print(f"[interrupted after {count} tokens]", file=sys.stderr)
        raise
    if not args.json:
        out.write("\n")
        out.flush()
        rate = count / max(time.perf_counter() - t0, 1e-9)
        print(f"[{count} tokens, {rate:.1f} tokens/s, finish: {finish}]", file=sys.stderr)
    if args.stats:
        print(f"[draft: {stats.rounds} verifications, acceptance {stats.acceptance_rate:.2f}, "
              f"{stats.tokens_per_round:.2f} tokens per verification]", file=sys.stderr)


# --- chat -------------------------------------------------------------------------------------------------


def _add_chat(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "chat",
        help="an interactive multi-turn chat in the terminal (an instruction-tuned model)",
        description=(
            "Chat with an instruction-tuned model (smollm2-135m): each line you type is a user turn, the answer "
            "streams as it is chosen, and the conversation is kept (the model's chat template over the whole "
            "history). /reset starts a new conversation, /exit (or Ctrl-D) ends the chat; Ctrl-C stops an "
            "answer, not the chat (the answer so far stays in the history). From a pipe every line is a turn "
            "and only the answers are printed, one a line. A base model (no chat template) is an error."
        ),
    )
    _add_model_arg(p)
    p.add_argument("--system", default=None, metavar="TEXT", help="a system message before the conversation")
    p.add_argument("--max-new-tokens", "-n", type=int, default=512,
                   help="tokens an answer may have at most (default 512; less where the context ends first)")
    _add_sampling_args(p)
    p.add_argument("--seed", type=int, default=None,
                   help="seed for the draws: the same conversation and settings give the same answers")
    p.set_defaults(run=_run_chat)


def _run_chat(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.system is not None and not args.system:
        raise ValueError("--system: must be a non-empty string")
    config = _sampling_config(args)  # bad settings fail before the model loads
    from lmhead.conversation import Conversation

    model = _load(args)
    chat = Conversation(model, system=args.system, config=config, max_new_tokens=args.max_new_tokens)
    tty = sys.stdin.isatty()
    if tty:
        print(f"lmhead: chatting with {model.name}; /reset starts again, /exit ends (Ctrl-C stops an answer)",
              file=sys.stderr)
    while True:
        try:
            line = input(">>> ") if tty else sys.stdin.readline()
        except EOFError:
            break
        if not tty and not line:  # the pipe's end
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit", "/bye"):
            break
        if text == "/reset":
            chat.reset()
            if tty:
                print("[a new conversation]", file=sys.stderr)
            continue
        _chat_turn(chat, text)


def _chat_turn(chat, text: str) -> None:
    """One answer, streamed to stdout; Ctrl-C stops it (the chat goes on); a conversation past the context is
    one line on stderr (the chat goes on)."""
    out = sys.stdout
    try:
        steps = chat.reply(text)
    except ValueError as exc:
        print(f"lmhead: {exc}", file=sys.stderr)
        return
    try:
        for step in steps:
            out.write(step.text)
            out.flush()
    except KeyboardInterrupt:
        steps.close()
        out.write("\n")
        out.flush()
        print("[answer stopped]", file=sys.stderr)
        return
    out.write("\n")
    out.flush()


# --- the body alone and the heads on it: embed, rerank, classify, train-head ---------------------------------


def _texts_of(args: argparse.Namespace, what: str = "TEXT") -> list[str]:
    """The texts of the positional arguments, or of --input FILE ('-': stdin): a .jsonl file's "text" fields,
    else one text a line (blank lines skipped); a line that is not what it should be names the file and line."""
    if args.input is None:
        if not args.texts:
            raise ValueError(f"give {what} arguments or --input FILE")
        return list(args.texts)
    if args.texts:
        raise ValueError(f"give {what} arguments or --input FILE, not both")
    texts = []
    for n, line in enumerate(_read_text(args.input).splitlines(), 1):
        if not line.strip():
            continue
        if args.input.endswith(".jsonl"):
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{args.input} line {n}: not JSON ({exc.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get("text"), str) or not row["text"]:
                raise ValueError(f"{args.input} line {n}: \"text\" is missing or not a non-empty string")
            line = row["text"]
        texts.append(line)
    if not texts:
        raise ValueError(f"{args.input} holds no text")
    return texts


def _add_texts_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("texts", nargs="*", metavar="TEXT", help="the texts (or --input)")
    p.add_argument("--input", "-i", default=None, metavar="FILE",
                   help="read the texts from FILE ('-': stdin): one a line, or a .jsonl file's \"text\" fields")
    p.add_argument("--truncate", type=int, default=None, metavar="N",
                   help="keep each input's last N tokens (default: an input past the context is an error)")


def _add_embed(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("embed", help="embeddings: the body alone, its final hidden state pooled",
                       description="Embed texts with the model's body alone: the final hidden state (after the "
                                   "final norm), pooled and L2-normalised. Writes JSON lines {index, embedding} "
                                   "to stdout, or --out FILE (.npy: one [N, D] float32 array; .jsonl).")
    _add_model_arg(p)
    _add_texts_args(p)
    p.add_argument("--pooling", default=None, choices=["last", "mean", "cls"],
                   help="default: the file's pooling_type, else last (a decoder's last token sees the whole text)")
    p.add_argument("--no-normalize", action="store_true", help="leave the vectors as they are (no L2 norm)")
    p.add_argument("--out", "-o", default=None, metavar="FILE", help="write to FILE (.npy or .jsonl)")
    p.set_defaults(run=_run_embed)


def _run_embed(args: argparse.Namespace) -> None:
    if args.out is not None and not args.out.endswith((".npy", ".jsonl")):
        raise ValueError(f"--out {args.out}: the name must end in .npy or .jsonl")
    texts = _texts_of(args)
    from lmhead.heads.pooling import embed

    model = _load(args)
    vectors = embed(model, texts, pooling=args.pooling, normalize=not args.no_normalize,
                    truncate_prompt_tokens=args.truncate)
    if args.out is not None and args.out.endswith(".npy"):
        import numpy as np

        np.save(args.out, vectors.numpy().astype(np.float32))
    else:
        lines = [json.dumps({"index": i, "embedding": v.tolist()}) for i, v in enumerate(vectors)]
        if args.out is None:
            sys.stdout.write("".join(x + "\n" for x in lines))
            return
        with open(args.out, "w", encoding="utf-8") as f:
            f.write("".join(x + "\n" for x in lines))
    print(f"lmhead: {len(texts)} embeddings of {vectors.shape[1]} values written to {args.out}", file=sys.stderr)


def _add_rerank(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rerank", help="rank documents by relevance to a query",
                       description="Score each document against QUERY at the last position of a reranker "
                                   "prompt: the LM head's logit of 'yes' against 'no' (Qwen3-Reranker's rule), or "
                                   "the file's classification head (pooling rank). Prints JSON lines {index, "
                                   "relevance_score, document}, best first.")
    _add_model_arg(p)
    p.add_argument("query", metavar="QUERY")
    _add_texts_args(p)
    p.add_argument("--top-n", type=int, default=None, metavar="N", help="print the best N only")
    p.set_defaults(run=_run_rerank)


def _run_rerank(args: argparse.Namespace) -> None:
    docs = _texts_of(args, "DOCUMENT")
    from lmhead.heads.reranker import rerank

    model = _load(args)
    for r in rerank(model, args.query, docs, top_n=args.top_n, truncate_prompt_tokens=args.truncate):
        _print_json(r)


def _add_classify(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("classify", help="classify texts with a classification head on the body",
                       description="Classify texts with a head saved by `lmhead train-head` (--head FILE), or "
                                   "the model file's own classification head. Prints JSON lines {index, label, "
                                   "probs}.")
    _add_model_arg(p)
    _add_texts_args(p)
    p.add_argument("--classifier", default=None, metavar="FILE",
                   help="the head (.safetensors from train-head); default: the model file's cls.output head")
    p.add_argument("--explain", action="store_true",
                   help="show the swap instead: each text's final hidden state through the LM head (its top "
                        "tokens of the whole vocabulary) and through the classification head, with each head's "
                        "size and share of the model")
    p.set_defaults(run=_run_classify)


def _classifier_head(path: str | None, model):
    from lmhead.heads.classifier import ClassificationHead, from_file

    if path is not None:
        try:
            head = ClassificationHead.load(path)
        except FileNotFoundError:
            raise ValueError(f"--classifier {path}: no such file") from None
        head.check_model(model)
        return head
    head = from_file(model)
    if head is None:
        raise ValueError("--classifier: the model's file holds no classification head; train one with "
                         "`lmhead train-head` and give its file")
    return head


def _run_classify(args: argparse.Namespace) -> None:
    texts = _texts_of(args)
    model = _load(args)
    from lmhead.heads.classifier import classify

    head = _classifier_head(args.classifier, model)
    if args.explain:
        from lmhead.explain_swap import render_swap, swap

        print("\n\n".join(render_swap(swap(model, t, head)) for t in texts))
        return
    for i, p in enumerate(classify(model, texts, head)):
        _print_json({"index": i, "label": head.labels[int(p.argmax())],
                     "probs": dict(zip(head.labels, [round(v, 6) for v in p.tolist()], strict=True))})


def _add_train_head(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-head", help="fit a classification head on the frozen body (seconds on a CPU)",
                       description="Fit a [K, D] classification head on the frozen body's pooled features of a "
                                   "JSONL file of {\"text\", \"label\"} lines, with lmhead's fused linear "
                                   "cross-entropy; save it with its label names. Reports held-out accuracy "
                                   "against the zero-shot verbaliser (the LM head's rows of the label words) and "
                                   "scikit-learn's LogisticRegression on the same features.")
    _add_model_arg(p)
    p.add_argument("data", metavar="DATA.jsonl", help="one {\"text\": ..., \"label\": ...} a line")
    p.add_argument("--out", "-o", required=True, metavar="FILE", help="where to save the head (.safetensors)")
    p.add_argument("--start", default="verbaliser", choices=["verbaliser", "random"],
                   help="the head's start: the LM head's rows of the label words (default), or random")
    p.add_argument("--template", default=None, metavar="TEXT",
                   help="the prompt around each text, with {text} (default: 'Text: {text}\\nTopic:')")
    p.add_argument("--pooling", default="last", choices=["last", "mean", "cls"], help="default: last")
    p.add_argument("--label-smoothing", type=float, default=0.0, metavar="E", help="in [0, 1) (default 0)")
    p.add_argument("--class-weights", default=None, choices=["balanced"], help="weigh rare classes up")
    p.add_argument("--max-steps", type=int, default=500, metavar="N", help="full-batch steps at most (500)")
    p.add_argument("--patience", type=int, default=50, metavar="N",
                   help="stop after N steps without a better held-out loss (50)")
    p.add_argument("--val-fraction", type=float, default=0.2, metavar="F", help="held out (default 0.2)")
    p.add_argument("--lr", type=float, default=1e-3, metavar="R", help="Adam's rate (default 0.001)")
    p.add_argument("--seed", type=int, default=0, help="the split's and the random start's seed (0)")
    p.set_defaults(run=_run_train_head)


def _run_train_head(args: argparse.Namespace) -> None:
    from lmhead.heads.classifier import DEFAULT_TEMPLATE
    from lmhead.heads.train import baselines, cached_features, read_labelled, train_head

    if not args.out.endswith(".safetensors"):
        raise ValueError(f"--out {args.out}: the name must end in .safetensors")
    try:
        texts, labels = read_labelled(args.data)
    except FileNotFoundError:
        raise ValueError(f"{args.data}: no such file") from None
    template = args.template or DEFAULT_TEMPLATE
    if "{text}" not in template:
        raise ValueError(f"--template must contain {{text}}; got {template!r}")
    model = _load(args)
    x = cached_features(model, texts, args.pooling, template)
    head = train_head(model, texts, labels, start=args.start, template=template, pooling=args.pooling,
                      label_smoothing=args.label_smoothing, class_weights=args.class_weights, lr=args.lr,
                      max_steps=args.max_steps, patience=args.patience, val_fraction=args.val_fraction,
                      seed=args.seed, x=x, progress=sys.stderr.isatty())
    head.save(args.out)
    acc = baselines(model, head, x, labels, args.val_fraction, args.seed)
    r = head.report
    lr = acc["logistic_regression"]
    _print_json({"out": args.out, "classes": head.labels, "train": r.train_size, "held_out": r.val_size,
                 "steps": r.steps, "best_step": r.best_step, "accuracy": round(acc["head"], 4),
                 "zero_shot_accuracy": round(acc["zero_shot"], 4),
                 "logistic_regression_accuracy": None if lr is None else round(lr, 4),
                 "parameters": head.num_parameters})


# --- commands added by later issues register here ----------------------------------------------------------

_COMMANDS = [_add_params, _add_predict, _add_eval, _add_serve, _add_generate, _add_chat, _add_embed, _add_rerank,
             _add_classify, _add_train_head]


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


if __name__ == "__main__":
    entry()
