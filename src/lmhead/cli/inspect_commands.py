"""`lmhead params`, `predict` and `eval`: the parameter count, one prediction explained, a text's perplexity."""

from __future__ import annotations

import argparse

from lmhead.cli.args import (
    MAX_EVAL_BYTES,
    add_chat_args,
    add_constraint_args,
    add_model_arg,
    add_sampling_args,
    chat_messages_of,
    check_model_arg,
    constraint_of,
    load_model_of,
    print_json,
    prompt_text_of,
    read_text,
    sampling_config_of,
)

# --- params -----------------------------------------------------------------------------------------------


def add_params(sub: argparse._SubParsersAction) -> None:
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
        print_json({**counts.to_dict(), "memory": {"logits": logits.to_dict(), "head_weight": weight.to_dict()}})
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


# --- info -------------------------------------------------------------------------------------------------


def add_info(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "info",
        help="this machine and what lmhead does on it: the CPU, the kernels' paths, the cache, the models",
        description=(
            "Report the CPU (its kind and the vector units the kernels use: AVX2, AVX-512, VNNI, AMX), Python "
            "and torch, whether the C kernels run here (they are compiled once per machine; without them every "
            "product takes torch's float32 path) and which path each kind of coded product takes — the float32 "
            "product or the integer units' sliced one, as measured once for this build —, the cache folder and "
            "what it holds, and the packaged models."
        ),
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    p.set_defaults(run=_run_info)


def _run_info(args: argparse.Namespace) -> None:
    from lmhead.machine import info
    from lmhead.params import human_bytes

    facts = info()
    if args.json:
        print_json(facts)
        return
    c, k, cache = facts["cpu"], facts["kernels"], facts["cache"]
    kind = f"{c['vendor']} family {c['family']} model {c['model']}" if c["vendor"] else "kind not reported"
    l3 = f", L3 {human_bytes(c['l3_bytes'])}" if c["l3_bytes"] else ""
    lines = [f"lmhead {facts['lmhead']} · Python {facts['python']} · torch {facts['torch']}, "
             f"{facts['threads']} threads",
             f"CPU       {c['name']} ({kind}), {c['cores']} cores{l3}",
             "          " + " · ".join(f"{name} {'yes' if on else 'no'}" for name, on in c["features"].items()),
             f"kernels   {k['library']}" + ("" if k["available"] else f": not running — {k['why']}")]
    if k["available"]:
        lines.append(f"products  {k['products']}")
    lines.append(f"weights   {facts['weights']}")
    used = ", ".join(f"{name} {human_bytes(n)}" for name, n in cache["bytes"].items() if n)
    free = f"; {human_bytes(cache['free_bytes'])} free" if cache["free_bytes"] is not None else ""
    lines.append(f"cache     {cache['folder']}" + (f": {used}" if used else ": empty") + free)
    for i, (name, m) in enumerate(facts["models"].items()):
        state = "installed" if m["installed"] else f"not installed ({m['install']})"
        lines.append(f"{'models' if i == 0 else '':10s}{name}: {state} — {m['description']}")
    print("\n".join(lines))


# --- predict ----------------------------------------------------------------------------------------------


def add_predict(sub: argparse._SubParsersAction) -> None:
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
    add_model_arg(p, head_help="the head whose logits are shown: fp32 (default: the model's full-precision head, "
                   "exact), or exact-int8/int8/int4 to see what that compressed head computes (auto = the head "
                   "generate would use)")
    add_chat_args(p)
    add_sampling_args(p)
    add_constraint_args(p)
    p.add_argument("--top", type=int, default=10, help="candidates to show (default 10)")
    p.add_argument("--layers", action="store_true",
                   help="logit lens: the final norm + head applied after every layer (top candidates per layer)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(run=_run_predict)


def _run_predict(args: argparse.Namespace) -> None:
    config = sampling_config_of(args)  # bad settings fail before the model loads
    if args.top < 1:
        raise ValueError(f"--top must be >= 1, got {args.top}")
    constraint = constraint_of(args)
    messages = chat_messages_of(args)
    model = load_model_of(args, head="fp32")  # no compressed head to build unless --head asks to see one
    prompt = prompt_text_of(model, args, messages)
    head = "exact" if args.head in (None, "fp32") else "decode"
    from lmhead import explain

    pred = explain.predict(model, prompt, top=args.top, config=config, layers=args.layers, model_name=model.name,
                           head=head, constraint=constraint)
    if args.json:
        print_json(pred.to_dict())
        return
    from lmhead._explain_display import print_prediction

    print_prediction(pred)


# --- eval -------------------------------------------------------------------------------------------------


def add_eval(sub: argparse._SubParsersAction) -> None:
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
    add_model_arg(p, head_help="the head generate would use (eval always scores with the full-precision head; "
                   "default fp32)")
    p.add_argument("--window", type=int, default=None,
                   help="tokens per window (default min(1024, the model's context length))")
    p.add_argument("--stride", type=int, default=None, help="tokens the window moves by (default window/2)")
    p.add_argument("--tokens", action="store_true",
                   help="per-token log-probability and rank: with --json as a list, else the text coloured "
                        "by rank (top-1 green, top-10 yellow, top-100 red, beyond purple, as GLTR)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=_run_eval)


def _run_eval(args: argparse.Namespace) -> None:
    check_model_arg(args)
    text = read_text(args.file)
    if not text.strip():
        raise ValueError(f"{args.file} is empty: nothing to evaluate")
    model = load_model_of(args, head="fp32")  # eval scores with the full-precision head: no compressed head to build
    from lmhead import explain

    ev = explain.evaluate(model, text, window=args.window, stride=args.stride, tokens=args.tokens, progress=True)
    if args.json:
        print_json(ev.to_dict())
        return
    from lmhead._explain_display import print_evaluation

    print_evaluation(ev)
