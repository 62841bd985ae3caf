"""The web app's errors: `APIError` (a request the server refuses) and the handlers that shape every error body.

    /api/* and the page   {"detail": message, "param": ...}; a 422 carries pydantic's list of errors
    /v1/*                 OpenAI's {"error": {"message", "type", "param", "code"}} for every status

Bad input → 400 (a bound that needs the tokenizer, or a ValueError/TypeError from the library); invalid JSON
or an unknown field → 422; an unknown route → 404; anything else → 500 with the exception's type and message.
guard.py answers before the routes: a Host it does not serve → 400, a body too big → 413, too slow → 408, a
non-finite number or a lone surrogate in the JSON → 422. No error sends back more than `ECHO_CHARS` characters
of the client's own input.
"""

from __future__ import annotations

import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lmhead.server.schemas import openai_error

# pydantic's union tags in an error's location ("str", "list[str]" and the models' names): not the client's
# field names, so a /v1 `param` leaves them out
_TYPE_TAGS = {"str", "int", "float", "bool", "none", "constrained-str", "TextPart", "StreamOptions"}
ECHO_CHARS = 40  # an error sends back at most this much of the client's own text


class APIError(Exception):
    """A request the server refuses: status code, message, and the offending parameter."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers  # e.g. a 503's Retry-After


_OPENAI_ROOT = ("/tokenize", "/detokenize", "/tokenizer_info")  # vLLM's routes beside /v1, in its error shape


def _is_v1(path: str) -> bool:
    return path.startswith("/v1/") or path in _OPENAI_ROOT


def _kind(status: int) -> str:
    if status >= 500:
        return "server_error"
    return "not_found_error" if status == 404 else "invalid_request_error"


def error_response(path: str, status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """The error body for a request to `path`: OpenAI's shape under /v1, {"detail", "param"} elsewhere."""
    if _is_v1(path):
        return JSONResponse(openai_error(message, _kind(status), param, code), status_code=status, headers=headers)
    return JSONResponse({"detail": message, "param": param}, status_code=status, headers=headers)


def validation_response(path: str, errors: list[dict[str, Any]]) -> JSONResponse:
    """422 for a request body that failed validation (pydantic's errors, or the guard's strict-JSON one).

    Each error names its field and the rule it broke; the offending input is not sent back whole (a 1 MiB prompt
    would come back as 1 MiB): short scalars are kept, long text is cut to its first characters, the rest dropped.
    """
    if _is_v1(path):
        message = "; ".join(f"{_where(e)}: {_short(str(e.get('msg')), 300)}" for e in errors) or "invalid request"
        param = _where(errors[0]) if errors else None
        return JSONResponse(openai_error(message, "invalid_request_error", param or None), status_code=422)
    return JSONResponse({"detail": [_client_error(e) for e in errors]}, status_code=422)


def _client_error(error: dict[str, Any]) -> dict[str, Any]:
    """One pydantic error as the client sees it: loc, msg, type and (short) input; no ctx, no URL."""
    out = {"loc": [_short(p) if isinstance(p, str) else p for p in error.get("loc", ())],
           "msg": _short(str(error.get("msg", "")), 300), "type": error.get("type")}
    if "input" not in error:
        return out
    value = error["input"]
    if value is None or isinstance(value, (bool, int)) and abs(value) < 2**63:
        out["input"] = value
    elif isinstance(value, float) and math.isfinite(value):
        out["input"] = value
    elif isinstance(value, str):
        out["input"] = _short(value)
    return out


def _short(text: str, limit: int = ECHO_CHARS) -> str:
    """`text` cut to `limit` characters (with "…" and its length), lone surrogates replaced: safe to send back."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text):,} characters)"


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return error_response(request.url.path, exc.status, exc.message, exc.param, exc.code, exc.headers)


def _where(error: dict[str, Any]) -> str:
    """An error's location as a client names it: "messages.0.role" (no "body", no union tags)."""
    return ".".join(_short(str(p)) for p in error.get("loc", ())
                    if p != "body" and not (isinstance(p, str) and (p in _TYPE_TAGS or "[" in p)))


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return validation_response(request.url.path, list(exc.errors()))


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(request.url.path, exc.status_code, _short(str(exc.detail), 300),
                          headers=getattr(exc, "headers", None))


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    return error_response(request.url.path, 500, _short(f"internal error: {type(exc).__name__}: {exc}", 300))


def add_error_handlers(app: FastAPI) -> None:
    """Register the handlers above on `app`."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
