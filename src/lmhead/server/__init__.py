"""The explainer's local web app and OpenAI-compatible API: `create_app(model)` (FastAPI); see app.py."""

from __future__ import annotations

from lmhead.server.app import create_app

__all__ = ["create_app"]
