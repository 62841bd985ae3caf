"""The web app's errors: `APIError` (a request the server refuses) and the handlers that shape every error body.

    /api/* and the page   {"detail": message, "param": ...}; a 422 carries pydantic's list of errors
    /v1/*                 OpenAI's {"error": {"message", "type", "param", "code"}} for every status

Bad input → 400 (a bound that needs the tokenizer, or a ValueError/TypeError from the library); invalid JSON
or an unknown field → 422; an unknown route → 404; anything else → 500 with the exception's type and message.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lmhead.server.schemas import openai_error

# pydantic's union tags in an error's location ("str", "list[str]" and the models' names): not the client's
# field names, so a /v1 `param` leaves them out
_TYPE_TAGS = {"str", "int", "float", "bool", "none", "TextPart", "StreamOptions"}


class APIError(Exception):
    """A request the server refuses: status code, message, and the offending parameter."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def _is_v1(request: Request) -> bool:
    return request.url.path.startswith("/v1/")


def _kind(status: int) -> str:
    return "not_found_error" if status == 404 else "invalid_request_error"


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    if _is_v1(request):
        return JSONResponse(openai_error(exc.message, _kind(exc.status), exc.param, exc.code), status_code=exc.status)
    return JSONResponse({"detail": exc.message, "param": exc.param}, status_code=exc.status)


def _where(error: dict[str, Any]) -> str:
    """An error's location as a client names it: "messages.0.role" (no "body", no union tags)."""
    return ".".join(str(p) for p in error.get("loc", ())
                    if p != "body" and not (isinstance(p, str) and (p in _TYPE_TAGS or "[" in p)))


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    if _is_v1(request):
        message = "; ".join(f"{_where(e)}: {e.get('msg')}" for e in errors) or "invalid request"
        param = _where(errors[0]) if errors else None
        return JSONResponse(openai_error(message, "invalid_request_error", param or None), status_code=422)
    return JSONResponse({"detail": json.loads(json.dumps(errors, default=str))}, status_code=422)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if _is_v1(request):
        return JSONResponse(openai_error(str(exc.detail), _kind(exc.status_code)), status_code=exc.status_code)
    return JSONResponse({"detail": exc.detail}, status_code=exc.status_code)


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    message = f"internal error: {type(exc).__name__}: {exc}"
    if _is_v1(request):
        return JSONResponse(openai_error(message, "server_error"), status_code=500)
    return JSONResponse({"detail": message}, status_code=500)


def add_error_handlers(app: FastAPI) -> None:
    """Register the handlers above on `app`."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
