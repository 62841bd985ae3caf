"""The explainer page's constraint box in a real browser (Playwright driving Debian's Chromium, headless): the
table marks the candidates the constraint cuts, and a constraint that does not compile says why."""

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


@pytest.fixture(scope="module")
def page():
    from playwright.sync_api import sync_playwright

    with ServerThread(create_app(tiny_served_model())) as server, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"])
        pg = browser.new_page(viewport={"width": 1200, "height": 1000})
        errors: list[str] = []
        pg.on("pageerror", lambda e: errors.append(str(e)))
        pg.goto(server.url + "/")
        pg.wait_for_selector("body[data-ready='1']")
        yield pg
        browser.close()
        assert not errors, errors


def _show(page, kind: str, text: str) -> None:
    page.select_option("#constraint-kind", kind)
    page.fill("#constraint-text", text)
    page.get_by_label("Prompt", exact=True).fill("The cat sat on the")
    page.get_by_role("button", name="Show candidates").click()


def test_constraint_box_marks_the_tokens_it_cuts(page):
    _show(page, "choice", "mat,log")
    page.wait_for_selector("#stage tbody tr .why:text('cut by the constraint')")
    kept = page.locator("#stage tbody tr.kept")
    assert 1 <= kept.count() <= 4  # the tokens that begin "mat" or "log"
    for i in range(kept.count()):
        token = kept.nth(i).locator("td.tok").inner_text().replace("·", " ")
        assert "mat".startswith(token) or "log".startswith(token), token
    assert page.locator("#stage tbody tr.cut").count() >= 10
    _show(page, "none", "")
    page.wait_for_function("![...document.querySelectorAll('#stage tbody .why')]"
                           ".some(e => e.textContent.includes('constraint'))")


def test_a_constraint_that_does_not_compile_says_why(page):
    _show(page, "regex", "a(b")
    page.wait_for_function("/unclosed group/.test(document.querySelector('#status').textContent)")


def test_next_token_continues_one_constrained_answer(page):
    prompt = "The cat sat on the "
    page.select_option("#constraint-kind", "choice")
    page.fill("#constraint-text", "mat,log")
    page.get_by_label("Prompt", exact=True).fill(prompt)
    page.get_by_role("button", name="Show candidates").click()
    page.wait_for_selector("#stage tbody tr .why:text('cut by the constraint')")
    # each option is at most three tokens; a click after a complete answer may only end it (EOS, no text)
    for _ in range(4):
        with page.expect_response(lambda r: "/api/step" in r.url):  # the click's step, not a state before it
            page.get_by_role("button", name="Next token").click()
        page.wait_for_function("!document.querySelector('#next-token').disabled")
        answer = page.get_by_label("Prompt", exact=True).input_value()[len(prompt):]
        assert "mat".startswith(answer) or "log".startswith(answer), answer
    assert answer in ("mat", "log")
    page.select_option("#constraint-kind", "none")
