"""GET /health: whether the server can answer (for a process manager, an orchestrator or a load balancer).

    200 {"status": "ok"}                    the model is loaded and its scheduler thread alive (or idle: it
                                            starts with the next request)
    503 {"status": "error", "error": ...}   no model, or the scheduler's loop ended on an error

As vLLM's /health and llama-server's: no body to parse for the happy path, a status code to act on.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

__all__ = ["router"]

router = APIRouter(tags=["monitoring"])


@router.get("/health", include_in_schema=False)
async def health(request: Request) -> JSONResponse:
    """200 when the model can answer, 503 with the reason otherwise."""
    problem = request.app.state.runner.problem() if getattr(request.app.state, "model", None) is not None \
        else "no model is loaded"
    if problem is not None:
        return JSONResponse({"status": "error", "error": problem}, status_code=503,
                            headers={"Cache-Control": "no-store"})
    return JSONResponse({"status": "ok"}, headers={"Cache-Control": "no-store"})
