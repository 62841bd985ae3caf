"""`lmhead serve`: the options, the sockets it listens on, and the server run over them."""

from __future__ import annotations

import argparse
import sys

from lmhead.cli.args import add_model_arg, check_model_arg, load_model_of
from lmhead.cli.heads import classifier_head

# --- serve ------------------------------------------------------------------------------------------------


def add_serve(sub: argparse._SubParsersAction) -> None:
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
    add_model_arg(p)
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
    check_model_arg(args)
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

        model = load_model_of(args)
        kv = None if args.kv_memory is None else int(args.kv_memory * 2**30)
        limits = serve_limits(model, args.ctx_size, args.max_tokens, args.parallel, kv, args.queue)
        # /v1/classify's head, checked against the model's width before anything is served
        classifier = None if args.classifier is None else classifier_head(args.classifier, model)
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
