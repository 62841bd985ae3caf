"""The page's 'Swap the head' section in a real browser (Playwright driving Debian's Chromium headless): the
prompt's hidden state through the LM head and a head of class words, drawn as two tables with their sizes."""

from __future__ import annotations

import os

import pytest
from server_harness import ServerThread, tiny_served_model

from lmhead.server import create_app

CHROMIUM = "/usr/bin/chromium"
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is missing: apt-get install -y chromium"),
]


def test_the_swap_section_draws_both_heads(one_thread):
    from playwright.sync_api import sync_playwright

    model = tiny_served_model()
    with ServerThread(create_app(model)) as server, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1200, "height": 1000})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(server.url + "/")
        page.wait_for_selector("body[data-ready='1']")
        page.get_by_label("Classes").fill("cat, dog, fox")
        page.get_by_role("button", name="Swap the head").click()
        page.wait_for_selector("#swap-out .swap-head")
        heads = page.locator("#swap-out .swap-head h3").all_inner_texts()
        assert heads[0].startswith(f"LM head: {model.vocab_size} × {model.exact_head.d_model}")
        assert heads[1].startswith(f"classification head: 3 × {model.exact_head.d_model}")
        assert page.locator("#swap-out .swap-head").nth(0).locator("tbody tr").count() == 10
        classes = page.locator("#swap-out .swap-head").nth(1).locator("tbody tr td:first-child").all_inner_texts()
        assert sorted(classes) == ["cat", "dog", "fox"]
        page.get_by_label("Classes").fill("cat")  # one class: the server's 422, shown in the section
        page.get_by_role("button", name="Swap the head").click()
        page.wait_for_function("document.querySelector('#swap-out').textContent.startsWith('Could not')")
        browser.close()
        assert not errors, errors
