"""/docs in a real browser (Debian's Chromium through Playwright): Swagger UI renders every route from the
server's own files, and the page asks nothing of any other host (no CDN, no fonts, no validator)."""

from __future__ import annotations

import os
from urllib.parse import urlsplit

import pytest
from server_harness import ServerThread, tiny_served_model

from lmhead.server import create_app

CHROMIUM = "/usr/bin/chromium"
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is missing: apt-get install -y chromium"),
]


def test_the_api_docs_render_from_this_server_alone():
    from playwright.sync_api import sync_playwright

    with ServerThread(create_app(tiny_served_model())) as server, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"])
        try:
            tab = browser.new_page()
            asked: list[str] = []
            tab.on("request", lambda r: asked.append(r.url))
            tab.route("**/*", lambda route: route.abort() if urlsplit(route.request.url).port != server.port
                      else route.continue_())
            tab.goto(server.url + "/docs")
            tab.wait_for_selector(".opblock-summary-path", timeout=30_000)
            text = tab.content()
        finally:
            browser.close()
    for route in ("/v1/chat/completions", "/api/predict"):
        assert route in text, route
    foreign = [u for u in asked if urlsplit(u).scheme in ("http", "https") and urlsplit(u).port != server.port]
    assert not foreign, foreign
    assert any(u.endswith(".js") for u in asked) and any("/openapi.json" in u for u in asked)
