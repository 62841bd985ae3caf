"""The checks every HTTP request passes before a route sees it (an ASGI middleware; `create_app` installs it).

In this order, each answered with a JSON error in the route family's shape (errors.py) and nothing echoed back:

1. Host — the `Host` header must name this server: a loopback name (127.0.0.1, localhost, [::1]), a name the
   operator allowed (`lmhead serve --allowed-host NAME`), or the very address the connection arrived on. A web
   page that rebinds its own DNS name to 127.0.0.1 (DNS rebinding) sends its own name and is refused: 400.
2. Body size — a `Content-Length` over `max_body_bytes` is refused before one byte of the body is read; a body
   sent without one (chunked) is counted as it arrives and refused as soon as it passes the bound: 413.
3. Body time — the whole body must arrive within `body_timeout` seconds of the headers: a client that sends
   half a body and stalls gets 408 and its connection is closed (uvicorn has a keep-alive timeout, none for a
   body).
4. Strict JSON — a JSON body with NaN, Infinity, -Infinity (or a number that overflows to them, 1e999) or a
   lone UTF-16 surrogate ("\\ud800", which no UTF-8 text can hold) is refused with the field that holds it:
   422. Python's json module accepts all of these; the routes could neither use them nor send them back.
   Before any of that, a body nested deeper than `MAX_JSON_DEPTH` arrays and objects is refused (422), on
   every route and whatever its content type says: Python's decoder recurses once per level, and a body of
   100,000 `[` raised RecursionError inside it (a 500). The depth is counted without recursion (`json_depth`).

The body is read once, whole (it is at most `max_body_bytes`), and handed on to the app as one message; after
it, the app's `receive()` is the server's own, so a route still hears a client that hangs up.

408 and 413 answers carry `Connection: close`: the rest of a body that was refused is never read.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lmhead.server.errors import error_response, validation_response

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
MAX_BODY_BYTES = 1 << 20  # 1 MiB: the largest valid request (20,000 characters of text) is under 130 KB
BODY_TIMEOUT = 10.0  # seconds from the headers to the body's last byte
MAX_JSON_DEPTH = 64  # arrays and objects inside each other; the deepest valid request nests 5
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)


class Refused(Exception):
    """A request the guard answers itself: status, message and, for 422, the field."""

    def __init__(self, status: int, message: str, param: str | None = None, loc: list[str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.loc = status, message, param, loc


def host_name(header: str) -> str:
    """The host part of a `Host` header, lowercased: "[::1]:8000" → "::1", "LocalHost.:80" → "localhost"."""
    host = header.strip().lower()
    if host.startswith("["):  # an IPv6 literal: [addr] or [addr]:port
        host = host[1:].split("]", 1)[0]
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


@dataclass(frozen=True)
class Limits:
    """What the guard lets through, checked once when made (a bad setting is a ValueError naming it).

    allowed_hosts: names the server answers to beside the loopback names ("*" accepts any Host).
    max_body_bytes: the largest request body, in bytes (≥ 1). body_timeout: seconds for a whole body (> 0).
    """

    allowed_hosts: Iterable[str] = ()
    max_body_bytes: int = MAX_BODY_BYTES
    body_timeout: float = BODY_TIMEOUT

    def __post_init__(self) -> None:
        if isinstance(self.allowed_hosts, str):
            raise TypeError(f"allowed_hosts must be a list of host names, got the string {self.allowed_hosts!r}")
        names = frozenset(host_name(h) for h in self.allowed_hosts)
        if "" in names:
            raise ValueError("allowed_hosts must not hold an empty name")
        size, seconds = self.max_body_bytes, self.body_timeout
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"max_body_bytes must be an integer ≥ 1, got {size!r}")
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < math.inf:
            raise ValueError(f"body_timeout must be a number of seconds > 0, got {seconds!r}")
        object.__setattr__(self, "allowed_hosts", names)

    @property
    def hosts(self) -> frozenset[str]:
        """Every name a Host header may give (lowercased), beside the connection's own address."""
        return frozenset(set(self.allowed_hosts) | set(LOOPBACK_HOSTS)) - {"*"}


class RequestGuard:
    """ASGI middleware: Host, body size, body time and strict JSON under `limits` (see the module docstring)."""

    def __init__(self, app: ASGIApp, limits: Limits = Limits()) -> None:
        self.app, self.limits = app, limits
        self.any_host, self.hosts = "*" in limits.allowed_hosts, limits.hosts
        self.max_body_bytes, self.body_timeout = limits.max_body_bytes, float(limits.body_timeout)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            self.check_host(scope)
            body = await self.read_body(scope, receive)
            if body is None:  # the client hung up before its body was complete: no one to answer
                return
            check_json(scope, body)
        except Refused as exc:
            await self.refuse(scope, receive, send, exc)
            return
        await self.app(scope, _replay(body, receive), send)

    def check_host(self, scope: Scope) -> None:
        header = _header(scope, b"host")
        if header is None or self.any_host:  # no Host: not a browser (browsers always send one)
            return
        name = host_name(header)
        server = scope.get("server") or (None, None)
        if name in self.hosts or name == str(server[0]).lower():
            return
        shown = header[:64] + ("…" if len(header) > 64 else "")
        raise Refused(400, f"Host header {shown!r} is not allowed: this server answers to "
                           f"{', '.join(sorted(self.hosts))} (start it with --allowed-host NAME to add a name)",
                      "host")

    async def read_body(self, scope: Scope, receive: Receive) -> bytes | None:
        """The whole body (None if the client hung up first); 413 past the size bound, 408 past the time."""
        length = _header(scope, b"content-length")
        if length is not None and length.strip().isdigit() and int(length) > self.max_body_bytes:
            raise Refused(413, f"request body is {int(length):,} bytes; the limit is {self.max_body_bytes:,}")
        chunks: list[bytes] = []
        size = 0
        with anyio.move_on_after(self.body_timeout):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return None
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > self.max_body_bytes:
                    raise Refused(413, f"request body is over the limit of {self.max_body_bytes:,} bytes")
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)
        raise Refused(408, f"request body not received within {self.body_timeout:g} s ({size:,} bytes came)")

    async def refuse(self, scope: Scope, receive: Receive, send: Send, exc: Refused) -> None:
        path = scope.get("path", "")
        if exc.status == 422:
            response = validation_response(path, [{"loc": ["body", *(exc.loc or [])], "msg": exc.message,
                                                   "type": "json_invalid"}])
        else:
            # the unread rest of a refused body is never read: the connection closes after the answer
            headers = {"Connection": "close"} if exc.status in (408, 413) else None
            response = error_response(path, exc.status, exc.message, exc.param, headers=headers)
        await response(scope, receive, send)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that gives the app the body read already, then the server's own messages (disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay


# --- strict JSON ------------------------------------------------------------------------------------------------


class _Constant(str):
    """NaN, Infinity or -Infinity as json.loads met them (kept apart from strings so the walk can find them)."""


def check_json(scope: Scope, body: bytes) -> None:
    """422 for a JSON body holding a non-finite number or a lone surrogate, naming the field ("messages.0.content").

    Bodies that are not JSON (or not valid JSON) pass unchanged: FastAPI answers those itself.
    """
    depth = json_depth(body)
    if depth > MAX_JSON_DEPTH:  # checked for every body: FastAPI decodes some without a JSON content type
        raise Refused(422, f"the JSON nests {depth:,} levels of arrays and objects; the limit is {MAX_JSON_DEPTH}",
                      None, [])
    content_type = (_header(scope, b"content-type") or "").lower()
    if not body or (content_type and "json" not in content_type):
        return
    try:
        value = json.loads(body, parse_constant=_Constant)
    except ValueError:  # not JSON: FastAPI's own 422 (or 400) says so
        return
    found = _first_bad(value, [])
    if found is not None:
        path, rule = found
        raise Refused(422, rule, ".".join(path) or None, path)


def json_depth(body: bytes) -> int:
    """How deep `body`'s arrays and objects nest (0 for a scalar), counted on the bytes without recursion or
    decoding: strings (escapes included) are blanked first, so brackets inside them do not count. On a body that
    is not JSON the count is a bound of what a decoder would recurse into."""
    bare = _JSON_STRING.sub(b'""', body)
    if not bare:
        return 0
    raw = np.frombuffer(bare, dtype=np.uint8)
    step = np.isin(raw, (ord("["), ord("{"))).astype(np.int32) - np.isin(raw, (ord("]"), ord("}")))
    return int(max(0, np.cumsum(step).max()))


def _first_bad(value: Any, path: list[str]) -> tuple[list[str], str] | None:
    """(path, rule) of the first value a strict JSON parser would refuse, depth first; None if there is none."""
    if isinstance(value, _Constant):
        return path, f"{value} is not a JSON number: numbers must be finite"
    if isinstance(value, float) and not math.isfinite(value):
        return path, "the number overflows a 64-bit float: numbers must be finite"
    if isinstance(value, str):
        return (path, "the text holds a lone UTF-16 surrogate (\\ud800-\\udfff), which no UTF-8 text can hold") \
            if _has_lone_surrogate(value) else None
    items: Iterable[tuple[str, Any]]
    if isinstance(value, dict):
        for key in value:
            if _has_lone_surrogate(key):
                return [*path, _short(key)], "the field name holds a lone UTF-16 surrogate"
        items = value.items()
    elif isinstance(value, list):
        items = ((str(i), v) for i, v in enumerate(value))
    else:
        return None
    for key, item in items:
        found = _first_bad(item, [*path, _short(key)])
        if found is not None:
            return found
    return None


def _has_lone_surrogate(text: str) -> bool:
    # json.loads pairs a valid \ud83d\ude00 into one character, so any surrogate left alone is unpaired
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _short(key: str, limit: int = 40) -> str:
    """A field name as an error names it: at most `limit` characters, surrogates replaced."""
    key = key.encode("utf-8", "backslashreplace").decode("utf-8")
    return key if len(key) <= limit else key[:limit] + "…"
