"""The explainer's local web app and OpenAI-compatible API: `create_app(model)` (FastAPI).

app.py wires the /api router (api.py, for the page) and the /v1 router (v1.py, OpenAI-compatible); see app.py
for the modules.
"""

from __future__ import annotations

from lmhead.server.app import create_app

__all__ = ["create_app"]
