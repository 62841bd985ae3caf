"""The API's documentation page, served with no CDN: /docs (Swagger UI).

FastAPI's own pages load their scripts, styles and favicon from jsDelivr and fastapi.tiangolo.com. Here the
same page loads them from this server: the asset files come from the `fastapi-offline` package (MIT; it ships
Swagger UI's release bundle), mounted at /docs-assets. Swagger UI's validator badge, which would send the schema
to validator.swagger.io, is turned off. There is no /redoc: ReDoc's page fetches its logo from Redocly's CDN.
"""

from __future__ import annotations

from pathlib import Path

import fastapi_offline
from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

ASSETS = Path(fastapi_offline.__file__).parent / "static"
ASSETS_URL = "/docs-assets"


def add_docs(app: FastAPI) -> None:
    """Serve /docs over `app.openapi_url` from local assets (create the app with docs_url=None and redoc_url=None,
    so FastAPI's CDN pages are not added)."""
    app.mount(ASSETS_URL, StaticFiles(directory=ASSETS), name="docs-assets")
    title = app.title

    async def swagger(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(
            openapi_url=f"{root}{app.openapi_url}", title=f"{title} — API",
            swagger_js_url=f"{root}{ASSETS_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{ASSETS_URL}/swagger-ui.css",
            swagger_favicon_url=f"{root}{ASSETS_URL}/favicon.png",
            swagger_ui_parameters={"validatorUrl": None})

    app.add_api_route("/docs", swagger, methods=["GET"], include_in_schema=False)
