"""`lmhead generate` and `lmhead chat`: tokens as they come, as text or one JSON object a token."""

from __future__ import annotations

import argparse
import sys

from lmhead.cli.args import (
    add_chat_args,
    add_constraint_args,
    add_model_arg,
    add_sampling_args,
    chat_messages_of,
    constraint_of,
    load_model_of,
    print_json,
    prompt_text_of,
    sampling_config_of,
)

# --- generate ---------------------------------------------------------------------------------------------


def add_generate(sub: argparse._SubParsersAction) -> None:
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
    add_model_arg(p)
    add_chat_args(p)
    p.add_argument("--max-new-tokens", "-n", type=int, default=64, help="tokens to generate at most (default 64)")
    add_sampling_args(p)
    add_constraint_args(p)
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
    config = sampling_config_of(args)  # bad settings fail before the model loads
    constraint = constraint_of(args)
    messages = chat_messages_of(args)
    model = load_model_of(args)
    prompt = prompt_text_of(model, args, messages)
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
                print_json(step.to_dict())
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


def add_chat(sub: argparse._SubParsersAction) -> None:
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
    add_model_arg(p)
    p.add_argument("--system", default=None, metavar="TEXT", help="a system message before the conversation")
    p.add_argument("--max-new-tokens", "-n", type=int, default=512,
                   help="tokens an answer may have at most (default 512; less where the context ends first)")
    add_sampling_args(p)
    p.add_argument("--seed", type=int, default=None,
                   help="seed for the draws: the same conversation and settings give the same answers")
    p.set_defaults(run=_run_chat)


def _run_chat(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.system is not None and not args.system:
        raise ValueError("--system: must be a non-empty string")
    config = sampling_config_of(args)  # bad settings fail before the model loads
    from lmhead.conversation import Conversation

    model = load_model_of(args)
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
