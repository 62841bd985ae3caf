"""The explainer page in a real browser: Playwright driving Debian's Chromium headless.

One server per module (a tiny random model, fast; its model selector also offers a second tiny model and one that
cannot load); one smoke test on the real SmolLM2 (marked `model`) that also takes docs/screenshot.png for the
README, and one on the default model (gemma-3-270m) that takes the pictures' screenshots (docs/explain_*.png).
Needs /usr/bin/chromium (`apt-get install -y chromium`).
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import httpx
import pytest
from server_harness import ServerThread, real_model, tiny_served_model
from test_server_charts import TinyLoader

from lmhead.server import create_app
from lmhead.server.registry import ModelRegistry

CHROMIUM = "/usr/bin/chromium"
DOCS = Path(__file__).parents[1] / "docs"
SCREENSHOT = DOCS / "screenshot.png"
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is missing: apt-get install -y chromium"),
]
LABELS = ("Prompt", "Temperature", "Top-k", "Top-p", "Min-p", "Seed")


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def server():
    app = create_app(tiny_served_model())
    app.state.registry = ModelRegistry(app.state.served, names=["tiny-b", "broken"], loader=TinyLoader())
    with ServerThread(app) as s:
        yield s


@pytest.fixture
def page(browser, server):
    ctx = browser.new_context(viewport={"width": 1200, "height": 1000})
    pg = ctx.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.goto(server.url + "/")
    pg.wait_for_selector("body[data-ready='1']")
    yield pg
    ctx.close()
    assert not errors, errors


def submit(page, prompt: str = "The cat sat on the") -> None:
    page.get_by_label("Prompt", exact=True).fill(prompt)
    page.get_by_role("button", name="Show candidates").click()
    page.wait_for_selector("#stage tbody tr")


def slide(page, label: str, value: float) -> None:
    page.get_by_label(label, exact=True).fill(str(value))  # sets the range input and fires input + change


def top_bar(page) -> float:
    return float(page.locator("#stage tbody tr[data-rank='1'] td.prob").get_attribute("data-p"))


def entropy(page) -> float:
    return float(page.locator("#entropy").get_attribute("data-value"))


def test_every_control_has_its_accessible_label(page):
    for label in LABELS:
        assert page.get_by_label(label, exact=True).count() == 1, label


def test_submitting_a_prompt_shows_token_chips_and_candidates(page, server):
    submit(page)
    chips = page.locator("#chips .chip")
    ids = httpx.post(server.url + "/api/predict", json={"prompt": "The cat sat on the", "top": 1}).json()
    assert chips.count() == len(ids["prompt_tokens"])
    assert chips.nth(1).get_attribute("title") == f"id {ids['prompt_tokens'][1]['token_id']}"
    assert "·" in "".join(chips.all_inner_texts())  # spaces made visible
    assert page.locator("#stage tbody tr").count() == 20
    first = page.locator("#stage tbody tr[data-rank='1']")
    assert "%" in first.locator("td.prob").inner_text()
    assert first.locator("td.tok .chip").get_attribute("data-id") == str(ids["candidates"][0]["token_id"])


def test_lower_temperature_grows_the_top_bar_and_lowers_the_entropy(page):
    submit(page)
    slide(page, "Temperature", 1.0)
    p1, h1 = top_bar(page), entropy(page)
    slide(page, "Temperature", 0.5)
    p05, h05 = top_bar(page), entropy(page)
    assert p05 > p1 and h05 < h1
    slide(page, "Temperature", 0)
    assert top_bar(page) == 1.0 and entropy(page) == 0.0
    assert page.locator("#stage tbody tr.kept").count() == 1


def test_top_k_one_leaves_one_token(page):
    submit(page)
    slide(page, "Top-k", 1)
    assert page.locator("#stage tbody tr.kept").count() == 1
    assert page.locator("#stage tbody tr.cut").count() == 19
    assert page.locator("#kept-count").inner_text() == "1"
    assert top_bar(page) == 1.0


def test_top_p_marks_the_row_where_the_mass_crosses_p(page):
    submit(page)
    slide(page, "Top-p", 0.5)
    cross = page.locator("#stage tbody tr.cross")
    assert cross.count() == 1
    rank = int(cross.get_attribute("data-rank"))
    assert page.locator("#stage tbody tr.kept").count() == rank  # kept rows end at the crossing row
    assert "p = 0.50" in cross.inner_text()
    # the column's running mass after the temperature reaches p at that row, not before it
    cums = [float(c) for c in page.locator("#stage tbody tr").evaluate_all("rs => rs.map(r => r.dataset.cum)")]
    assert cums[rank - 1] >= 0.5 > (cums[rank - 2] if rank > 1 else 0.0)


def test_the_pages_numbers_equal_the_servers(page, server):
    """The sliders recompute in the browser; the server computes over the full vocabulary: same numbers."""
    submit(page)
    settings = {"temperature": 0.7, "top_k": 12, "top_p": 0.8, "min_p": 0.05}
    slide(page, "Temperature", 0.7)
    slide(page, "Top-k", 12)
    slide(page, "Top-p", 0.8)
    slide(page, "Min-p", 0.05)
    shown = [float(x) for x in page.locator("#stage tbody td.prob").evaluate_all("els => els.map(e => e.dataset.p)")]
    want = httpx.post(server.url + "/api/predict", json={"prompt": "The cat sat on the", "top": 20, **settings}).json()
    for got, cand in zip(shown, want["candidates"], strict=True):
        assert got == pytest.approx(cand["probability"], rel=1e-4, abs=1e-7)
    assert entropy(page) == pytest.approx(want["entropy"]["processed"], rel=1e-4, abs=1e-6)
    assert "exact" in page.locator("#exactness").inner_text()


def test_next_token_grows_the_prompt_and_says_why(page):
    submit(page)
    before = page.get_by_label("Prompt", exact=True).input_value()
    chips_before = page.locator("#chips .chip").count()
    page.get_by_label("Seed", exact=True).fill("7")
    page.get_by_role("button", name="Next token").click()
    page.wait_for_selector("#chosen .pick")
    page.wait_for_function(f"document.querySelectorAll('#chips .chip').length > {chips_before}")
    after = page.get_by_label("Prompt", exact=True).input_value()
    assert after.startswith(before) and len(after) >= len(before)
    assert "rank" in page.locator("#chosen .pick").last.inner_text()


def test_generate_streams_several_tokens(page):
    submit(page)
    chips_before = page.locator("#chips .chip").count()
    page.locator("#steps").fill("4")
    page.get_by_label("Temperature", exact=True).fill("0")
    page.get_by_role("button", name="Generate").click()
    page.wait_for_function(f"document.querySelectorAll('#chips .chip').length >= {chips_before + 1}")
    page.wait_for_function("!document.querySelector('#generate').disabled")
    assert page.locator("#chosen .pick").count() >= 1


def test_keyboard_alone_submits_and_switches_tabs(page):
    page.get_by_label("Prompt", exact=True).focus()
    page.keyboard.press("Control+a")
    page.keyboard.type("Hello world")
    page.keyboard.press("Control+Enter")
    page.wait_for_selector("#stage tbody tr")
    page.get_by_role("tab", name="Next token").focus()
    page.keyboard.press("ArrowRight")
    assert page.get_by_role("tab", name="Score a text").get_attribute("aria-selected") == "true"
    assert page.locator("#panel-score").is_visible() and not page.locator("#panel-next").is_visible()


def test_arrow_keys_move_a_slider_and_the_numbers_follow(page):
    submit(page)
    h1 = entropy(page)
    temperature = page.get_by_label("Temperature", exact=True)
    temperature.focus()
    for _ in range(4):
        page.keyboard.press("ArrowLeft")
    assert temperature.input_value() == "0.8"
    assert page.locator("#p-temperature-out").inner_text() == "0.80"
    assert entropy(page) < h1


def test_layers_panel_shows_a_row_per_layer(page):
    submit(page)
    page.locator("#layers-panel summary").click()
    page.wait_for_selector("#layers table tbody tr")
    assert page.locator("#layers table tbody tr").count() == 3  # embeddings + 2 blocks


def test_score_tab_colours_tokens_by_rank_and_shows_perplexity(page):
    page.get_by_role("tab", name="Score a text").click()
    page.get_by_label("Text", exact=True).fill("The cat sat on the mat.")
    page.get_by_role("button", name="Score").click()
    page.wait_for_selector("#score-out .tok")
    tokens = page.locator("#score-out .tok")
    assert tokens.count() >= 5
    classes = tokens.evaluate_all("els => els.map(e => e.className)")
    assert all(any(k in c for k in ("r1", "r10", "r100", "rmore", "first")) for c in classes)
    assert "%" in tokens.nth(2).get_attribute("title")
    assert "Perplexity" in page.locator("#score-summary").inner_text()


def test_parameter_panel_compares_with_gpt2_small(page):
    page.get_by_role("tab", name="Parameters").click()
    page.wait_for_selector("#params-out table")
    text = page.locator("#params-out").inner_text()
    assert "124,439,808" in text and "token embedding" in text and "%" in text


def test_phone_width_has_no_sideways_scroll_and_keeps_the_controls(browser, server):
    ctx = browser.new_context(viewport={"width": 375, "height": 800}, is_mobile=True, has_touch=True)
    pg = ctx.new_page()
    pg.goto(server.url + "/")
    pg.wait_for_selector("body[data-ready='1']")
    submit(pg)
    width = pg.evaluate("document.documentElement.scrollWidth")
    assert width <= 375, f"the page is {width}px wide at a 375px viewport"
    for label in LABELS:
        box = pg.get_by_label(label, exact=True).bounding_box()
        assert box and box["x"] >= 0 and box["x"] + box["width"] <= 375, label
    assert pg.locator("#stage tbody tr").count() == 20
    pg.wait_for_selector("#dist-chart svg")
    pg.wait_for_selector("#geo-chart svg")
    pg.get_by_role("button", name="Draw N times").click()
    pg.wait_for_selector("#draw-chart svg")
    for sel in ("#dist-chart svg", "#geo-chart svg", "#draw-chart svg", "#geo-top", "#draw", "#model-select"):
        box = pg.locator(sel).bounding_box()
        assert box and box["x"] >= 0 and box["x"] + box["width"] <= 375, sel
    assert pg.evaluate("document.documentElement.scrollWidth") <= 375
    ctx.close()


@pytest.mark.model
def test_real_model_page_and_screenshot(browser):
    """SmolLM2-135M end to end in the browser; saves docs/screenshot.png (the README shows it)."""
    model = real_model("smollm2-135m")
    with ServerThread(create_app(model)) as s:
        ctx = browser.new_context(viewport={"width": 1200, "height": 1400})
        pg = ctx.new_page()
        pg.set_default_timeout(180_000)  # a forward pass of the real model on a busy 2-core machine
        pg.goto(s.url + "/")
        pg.wait_for_selector("body[data-ready='1']")
        submit(pg, "The cat sat on the")
        # a vocabulary larger than the candidates sent: the page runs the steps over all V logits it asks for
        slide(pg, "Temperature", 1.5)
        pg.wait_for_function("document.querySelector('#exactness').textContent.includes('every step run here')")
        h15 = entropy(pg)
        slide(pg, "Temperature", 1.0)
        assert entropy(pg) < h15
        pg.get_by_label("Seed", exact=True).fill("0")
        pg.get_by_role("button", name="Next token").click()
        pg.wait_for_selector("#chosen .pick")
        pg.wait_for_function("!document.querySelector('#next-token').disabled")
        slide(pg, "Temperature", 0.8)
        slide(pg, "Top-p", 0.8)
        pg.wait_for_function("document.querySelector('#exactness').textContent.startsWith('exact')")
        texts = pg.locator("#stage tbody td.tok").all_inner_texts()
        assert len(texts) == 20 and pg.locator("#stage tbody tr.cross").count() == 1
        pg.locator("#layers-panel summary").click()
        pg.wait_for_selector("#layers table tbody tr")
        assert pg.locator("#layers table tbody tr").count() == model.config.num_hidden_layers + 1
        SCREENSHOT.parent.mkdir(exist_ok=True)
        pg.locator("#layers-panel summary").click()  # closed again: the screenshot shows the output stage
        pg.evaluate("window.scrollTo(0, 0)")
        pg.screenshot(path=str(SCREENSHOT), full_page=False)
        ctx.close()
    assert SCREENSHOT.stat().st_size > 10_000


# --- the pictures ---------------------------------------------------------------------------------------------

PROMPT = "The cat sat on the"


def values(page, selector: str) -> list[list[float]]:
    """The data-value numbers of each row of a chart's table (the chart's text alternative)."""
    return page.locator(selector).evaluate_all(
        "rows => rows.map(r => Array.from(r.querySelectorAll('[data-value]')).map(c => parseFloat(c.dataset.value)))")


def wait_chart(page, fig: str, **settings) -> None:
    """Wait until the chart `fig` shows the given slider settings (it is redrawn from the server's answer)."""
    want = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, **settings}
    # a request carries the parameters off their declared defaults: the others are the defaults
    page.wait_for_function("([sel, want]) => { const f = document.querySelector(sel); if (!f || !f.dataset.settings) "
                           "return false; const s = {temperature: 1, top_k: 0, top_p: 1, min_p: 0, "
                           "...JSON.parse(f.dataset.settings)}; "
                           "return Object.keys(want).every(k => Math.abs(s[k] - want[k]) < 1e-9); }", arg=[fig, want])


def test_the_rank_curve_follows_the_sliders_and_equals_the_api(page, server):
    submit(page)
    wait_chart(page, "#dist-chart")
    processed = page.locator("#dist-chart path[data-curve='processed']")
    flat = processed.get_attribute("d")
    slide(page, "Temperature", 0.5)
    wait_chart(page, "#dist-chart", temperature=0.5)
    assert processed.get_attribute("d") != flat  # sharper: the picture moved with the slider
    slide(page, "Top-p", 0.6)
    wait_chart(page, "#dist-chart", temperature=0.5, top_p=0.6)
    want = httpx.post(server.url + "/api/distribution",
                      json={"prompt": PROMPT, "temperature": 0.5, "top_p": 0.6}).json()
    cut = page.locator("#dist-chart line.cutline[data-step='top_p']")
    assert cut.count() == 1 and int(cut.get_attribute("data-rank")) == want["cutoffs"][0]["rank"]
    rows = values(page, "#dist-chart .rank-table tbody tr")
    ranks = [int(r) for r in page.locator("#dist-chart .rank-table tbody th").evaluate_all(
        "els => els.map(e => e.textContent)")]
    assert len(rows) >= 5
    for rank, row in zip(ranks, rows, strict=True):
        j = want["ranks"].index(rank)
        assert row == pytest.approx([want["raw"][j], want["scaled"][j], want["processed"][j],
                                     want["scaled_cumulative"][j]], rel=1e-6, abs=1e-12)
    assert "320 tokens" in page.locator("#dist-chart svg desc").text_content()


def test_the_head_picture_decomposes_each_logit_and_follows_its_slider(page, server):
    submit(page)
    page.wait_for_selector("#geo-chart svg g.word")
    assert page.locator("#geo-chart svg g.word").count() == 8
    want = httpx.post(server.url + "/api/geometry", json={"prompt": PROMPT, "top": 8}).json()
    rows = values(page, "#geo-chart .geo-table tbody tr")
    for row, c in zip(rows, want["candidates"], strict=True):
        assert row[:6] == pytest.approx([c["row_norm"], c["norm_rank"], c["cos"], c["cos_rank"], c["dot"], c["logit"]],
                                        rel=1e-6)
        assert c["dot"] == pytest.approx(want["hidden_norm"] * c["row_norm"] * c["cos"], rel=1e-5)
    assert "2-D slice of a 32-dimensional space" in page.locator("#geo-chart .lost").inner_text()
    dot = page.locator("#geo-chart svg g.word circle.dot").last  # the top candidate, drawn last
    p1 = float(dot.get_attribute("data-p"))
    slide(page, "Temperature", 0.4)
    assert float(page.locator("#geo-chart svg g.word circle.dot").last.get_attribute("data-p")) > p1
    words = page.get_by_label("Words", exact=True)
    words.focus()
    for _ in range(3):
        page.keyboard.press("ArrowLeft")
    page.wait_for_selector("#geo-chart[data-top='5']")
    assert page.locator("#geo-chart svg g.word").count() == 5 and page.locator("#geo-top-out").inner_text() == "5"


def test_draws_converge_replay_with_the_keyboard_and_equal_the_api(page, server):
    submit(page)
    wait_chart(page, "#dist-chart")
    page.get_by_label("Seed", exact=True).fill("5")
    page.get_by_label("Draws", exact=True).fill("2000")
    page.get_by_role("button", name="Draw N times").focus()
    page.keyboard.press("Enter")
    page.wait_for_selector("#draw-chart[data-n='2000']")
    want = httpx.post(server.url + "/api/draws", json={"prompt": PROMPT, "n": 2000, "seed": 5}).json()
    rows = values(page, "#draw-chart .draw-table tbody tr")
    for row, t in zip(rows, want["tokens"][:12], strict=False):
        assert row[0] == want["token_ids"].count(t["token_id"])
        assert row[2] == pytest.approx(t["probability"], rel=1e-6)
    tv_all = float(page.locator("#draw-chart").get_attribute("data-tv"))
    replay = page.get_by_label("After n draws", exact=True)
    replay.focus()
    page.keyboard.press("Home")
    page.wait_for_selector("#draw-chart[data-n='1']")
    counts = page.locator("#draw-chart g.drawrow").evaluate_all("els => els.map(e => [e.dataset.id, +e.dataset.count])")
    first = str(want["token_ids"][0])
    shown = {i for i, _ in counts}
    assert [c for _, c in counts if c] == [1] and dict(counts)[first if first in shown else "other"] == 1
    assert float(page.locator("#draw-chart").get_attribute("data-tv")) > tv_all  # 1 draw is far from converged
    page.keyboard.press("End")
    page.wait_for_selector("#draw-chart[data-n='2000']")
    slide(page, "Top-k", 3)  # new settings: the histogram is redrawn from the new distribution
    wait_chart(page, "#draw-chart", top_k=3)
    assert page.locator("#draw-chart g.drawrow").count() == 3


def test_the_generation_strip_shows_probability_rank_and_entropy(page, server):
    submit(page)
    page.get_by_label("Seed", exact=True).fill("2")
    page.locator("#steps").fill("3")
    page.get_by_role("button", name="Generate").click()
    page.wait_for_selector("#steps-chart .steps-table tbody tr", state="attached")
    page.get_by_role("button", name="Next token").click()
    page.wait_for_function("document.querySelectorAll('#steps-chart .steps-table tbody tr').length === 4")
    gen = page.evaluate("window.lmhead.state.gen")
    assert gen["prompt"] == PROMPT and len(gen["tokens"]) == 4
    want = httpx.post(server.url + "/api/steps", json={"prompt": PROMPT, "tokens": [
        {"token_id": t["token_id"], **t["settings"]} for t in gen["tokens"]]}).json()["steps"]
    rows = values(page, "#steps-chart .steps-table tbody tr")
    for row, st in zip(rows, want, strict=True):
        assert row == pytest.approx([st["probability"], st["raw_probability"], st["rank"], st["entropy"],
                                     st["raw_entropy"]], rel=1e-6)
    classes = page.locator("#steps-chart .strip .tok").evaluate_all("els => els.map(e => e.className)")
    colour = lambda r: "r1" if r == 1 else "r10" if r <= 10 else "r100" if r <= 100 else "rmore"  # noqa: E731
    assert classes == [f"tok {colour(st['rank'])}" for st in want]
    assert page.locator("#steps-chart svg .stepbar").count() == 4 and page.locator("#steps-chart svg .entline").count()


def test_the_model_selector_switches_vocabularies_and_reports_a_failed_load(page):
    options = page.locator("#model-select option").all_inner_texts()
    assert options[0] == "tiny-llama" and any(o.startswith("tiny-b") for o in options)
    submit(page)
    select = page.get_by_label("Model", exact=True)
    select.select_option("tiny-b")
    page.wait_for_function("document.querySelector('#model-facts').textContent.includes('vocabulary 280')")
    page.wait_for_selector("body[data-ready='1']")
    page.wait_for_function("document.querySelector('#dist-chart svg desc')?.textContent.includes('280 tokens')")
    assert page.locator("#stage tbody tr").count() == 20
    select.select_option("broken")
    page.wait_for_function("document.querySelector('#status').classList.contains('error')")
    assert "could not be loaded" in page.locator("#status").inner_text()
    assert select.input_value() == "tiny-b"  # still the model that works
    assert "vocabulary 280" in page.locator("#model-facts").inner_text()


@pytest.mark.model
def test_real_default_model_pictures_and_screenshots(browser):
    """gemma-3-270m (the default model) in the browser: every picture equals the API's numbers on the real
    262,144-token vocabulary; saves docs/explain_{distribution,head,draws,steps}.png (README and docs/explain.md)."""
    model = real_model("gemma-3-270m")
    with ServerThread(create_app(model)) as s:
        ctx = browser.new_context(viewport={"width": 1000, "height": 1200})
        pg = ctx.new_page()
        pg.set_default_timeout(180_000)
        pg.goto(s.url + "/")
        pg.wait_for_selector("body[data-ready='1']")
        submit(pg, "The capital of France is")
        slide(pg, "Temperature", 0.8)
        slide(pg, "Top-p", 0.9)
        wait_chart(pg, "#dist-chart", temperature=0.8, top_p=0.9)
        want = httpx.post(s.url + "/api/distribution", json={"prompt": "The capital of France is",
                                                                  "temperature": 0.8, "top_p": 0.9}).json()
        assert want["vocab_size"] == 262_144
        cut = pg.locator("#dist-chart line.cutline[data-step='top_p']")
        assert int(cut.get_attribute("data-rank")) == want["cutoffs"][0]["rank"] == want["kept_count"]
        pg.wait_for_selector("#geo-chart svg g.word")
        geo = httpx.post(s.url + "/api/geometry", json={"prompt": "The capital of France is", "top": 8}).json()
        rows = values(pg, "#geo-chart .geo-table tbody tr")
        assert [r[5] for r in rows] == pytest.approx([c["logit"] for c in geo["candidates"]], rel=1e-6)
        assert "640-dimensional" in pg.locator("#geo-chart .lost").inner_text()
        pg.get_by_label("Seed", exact=True).fill("0")
        pg.get_by_label("Draws", exact=True).fill("2000")
        pg.get_by_role("button", name="Draw N times").click()
        pg.wait_for_selector("#draw-chart[data-n='2000']")
        DOCS.mkdir(exist_ok=True)
        for section, name in (("#dist-section", "distribution"), ("#geo-section", "head"), ("#draw-section", "draws")):
            pg.locator(section).screenshot(path=str(DOCS / f"explain_{name}.png"))
        pg.locator("#steps").fill("12")
        pg.get_by_role("button", name="Generate").click()
        pg.wait_for_selector("#steps-chart .steps-table tbody tr", state="attached")
        pg.wait_for_function("!document.querySelector('#generate').disabled")
        pg.locator("#steps-section").screenshot(path=str(DOCS / "explain_steps.png"))
        # the same prompt in the other packaged model's vocabulary, loaded on first use from the page
        pg.get_by_label("Model", exact=True).select_option("smollm2-135m")
        pg.wait_for_function("document.querySelector('#model-facts').textContent.includes('vocabulary 49,152')")
        pg.wait_for_function("document.querySelector('#dist-chart svg desc')?.textContent.includes('49,152 tokens')")
        assert pg.locator("#stage tbody tr").count() == 20
        ctx.close()
    for name in ("distribution", "head", "draws", "steps"):
        assert (DOCS / f"explain_{name}.png").stat().st_size > 10_000


# --- every declared step: its controls, its cuts, and the page's numbers against the server's --------------------

REPEATS = "The cat sat on the mat. The cat sat on the"  # a prompt that repeats itself: DRY and the n-grams cut


def open_steps(page) -> None:
    page.locator("#more-steps summary").click()
    page.wait_for_selector("#step-controls fieldset.step")


def set_params(page, values: dict) -> None:
    """Each control by its label (the parameter's name), then the order (a preset, or names typed)."""
    for name, value in values.items():
        if name == "samplers":
            preset = "custom" if isinstance(value, list) else value
            page.get_by_label("Order", exact=True).select_option(preset)
            if preset == "custom":
                page.get_by_label("samplers", exact=True).fill(";".join(value))
        elif name in ("Temperature", "Top-k", "Top-p", "Min-p"):
            slide(page, name, value)
        else:
            page.get_by_label(name, exact=True).fill(str(value))
    # the table shows these settings (renders while a control moves wait for the next frame)
    page.wait_for_function("document.querySelector('#stage').dataset.settings === "
                           "window.lmhead.settingsKey(window.lmhead.settings())")


def shown_rows(page) -> list[dict]:
    return page.locator("#stage tbody tr").evaluate_all(
        "rows => rows.map(r => ({id: +r.dataset.id, p: +r.querySelector('td.prob').dataset.p, cum: +r.dataset.cum, "
        "kept: r.classList.contains('kept'), cut: r.dataset.cut || null, xtc: r.classList.contains('xtc')}))")


def assert_page_equals_server(page, server, prompt: str) -> dict:
    """The table, the summary and the chain strip the page computed against /api/predict at the page's settings over
    the whole vocabulary: each shown token's probability, whether it is kept, the step that cut it; the entropy,
    the kept count, and every step that ran with its count of tokens cut."""
    settings = page.evaluate("window.lmhead.settings()")
    vocab = page.evaluate("window.lmhead.state.data.V")
    want = httpx.post(server.url + "/api/predict", json={"prompt": prompt, "top": vocab, **settings}).json()
    by_id = {c["token_id"]: c for c in want["candidates"]}
    rows = shown_rows(page)
    assert len(rows) == 20
    for r in rows:
        c = by_id[r["id"]]
        assert r["p"] == pytest.approx(c["probability"], rel=1e-4, abs=1e-7), (settings, r, c)
        assert r["kept"] == c["kept"] and r["cut"] == c["cut_by"], (settings, r, c)
        # the running mass after the temperature, before the cuts (a greedy row's: of its probabilities)
        cum = c["cumulative"] if settings.get("temperature") == 0 else c["scaled_cumulative"]
        assert r["cum"] == pytest.approx(cum, rel=1e-4, abs=1e-6), (settings, r, c)
    assert [r["id"] for r in rows if r["kept"]] == [c["token_id"] for c in want["candidates"][:20] if c["kept"]]
    assert entropy(page) == pytest.approx(want["entropy"]["processed"], rel=1e-4, abs=1e-6)
    assert page.locator("#kept-count").inner_text() == f"{want['kept_count']:,}"
    chain = page.locator("#chain li").evaluate_all("els => els.map(e => [e.dataset.step, +e.dataset.cut])")
    assert chain == [[s["name"], s["cut"]] for s in want["steps"]], settings
    assert "every step run here" in page.locator("#exactness").inner_text()
    return want


def test_every_declared_parameter_has_a_control_built_from_the_declaration(page, server):
    """Each declared parameter once, under the first step that declares it: the labelled ones of the steps' table
    (temperature, top-k, top-p, min-p) first as sliders in the declared order, every other step a group of its own
    in the declared order, then the order's own control; each with its declared range in its help."""
    decl = httpx.get(server.url + "/api/samplers").json()
    open_steps(page)
    for name, p in decl["params"].items():
        if name == "samplers":
            continue
        assert page.locator(f"#p-{name}").count() == 1, name
        assert p["allowed"] in page.locator(f"#p-{name}-help").inner_text(), name
    first = page.locator("#main-controls input[data-param]").evaluate_all("els => els.map(e => e.dataset.param)")
    assert first == ["temperature", "top_k", "top_p", "min_p"]
    assert page.locator("#main-controls input[type=range]").count() == 4
    for label in ("Temperature", "Top-k", "Top-p", "Min-p"):
        assert page.get_by_label(label, exact=True).get_attribute("data-param") in first
    seen, groups = set(first), []
    for s in decl["steps"]:
        if set(s["params"]) - seen:
            groups.append(s["name"])
            seen |= set(s["params"])
    shown = page.locator("#step-controls fieldset.step").evaluate_all("els => els.map(e => e.dataset.step)")
    assert shown == groups + ["samplers"]
    stage = {s["name"]: s["stage"] for s in decl["steps"]}
    words = []
    for st, group in itertools.groupby([*decl["masks"], *decl["order"]], key=stage.get):
        name, names = ("masks", "penalties", "temperature", "cuts")[st - 1], list(group)
        words.append(name if names == [name] else f"{name} ({', '.join(names)})")
    assert page.locator("#pipeline-order").inner_text() == " → ".join([*words, "softmax"])
    options = page.get_by_label("Order", exact=True).locator("option").evaluate_all("os => os.map(o => o.value)")
    assert options == [*decl["presets"], "custom"]
    page.get_by_label("dry_base", exact=True).fill("0.5")  # outside its range: said, not sent
    page.wait_for_function("document.querySelector('#status').textContent.includes('dry_base must be in [1, 10000]')")
    assert page.get_by_label("dry_base", exact=True).get_attribute("aria-invalid") == "true"
    page.get_by_label("dry_base", exact=True).fill("2")
    page.wait_for_function("document.querySelector('#status').textContent === ''")


STEP_SETTINGS = [
    pytest.param({"typical_p": 0.6}, id="typical_p"),
    pytest.param({"top_n_sigma": 1.0, "Temperature": 1.3}, id="top_n_sigma"),
    pytest.param({"xtc_probability": 0.5, "xtc_threshold": 0.05}, id="xtc"),
    pytest.param({"dry_multiplier": 0.8, "dry_base": 2.0}, id="dry"),
    pytest.param({"mirostat": 1, "mirostat_tau": 3.0}, id="mirostat_v1"),
    pytest.param({"mirostat": 2, "mirostat_tau": 2.0, "Top-k": 5}, id="mirostat_v2"),  # llama.cpp: top-k ignored
    pytest.param({"dynatemp_range": 0.5, "Temperature": 0.8}, id="dynatemp"),
    pytest.param({"epsilon_cutoff": 0.01}, id="epsilon"),
    pytest.param({"eta_cutoff": 0.02}, id="eta"),
    pytest.param({"top_a": 0.3, "Temperature": 1.5}, id="top_a"),
    pytest.param({"no_repeat_ngram_size": 2}, id="no_repeat_ngram"),
    pytest.param({"repetition_penalty": 1.5, "presence_penalty": 0.3}, id="penalties"),
    pytest.param({"logit_bias": "12: 4, 40: -3", "banned_tokens": "5"}, id="logit_bias"),
    pytest.param({"allowed_token_ids": "5, 12, 40, 100, 153, 196"}, id="allowed_token_ids"),
    pytest.param({"min_tokens": 3, "stop_token_ids": "105"}, id="min_tokens"),
    pytest.param({"samplers": "llama.cpp", "Temperature": 0.7, "Top-k": 20, "Min-p": 0.05}, id="preset_llama.cpp"),
    pytest.param({"samplers": ["top-k", "temp", "typ_p", "xtc"], "Top-k": 10, "Temperature": 1.5, "typical_p": 0.8,
                  "xtc_probability": 1.0, "xtc_threshold": 0.05}, id="user_order"),
    pytest.param({"dry_multiplier": 1.0, "Temperature": 0}, id="greedy_after_dry"),
]


@pytest.mark.parametrize("values", STEP_SETTINGS)
def test_each_steps_numbers_and_cuts_on_the_page_equal_the_servers(page, server, values):
    submit(page, REPEATS)
    open_steps(page)
    set_params(page, values)
    want = assert_page_equals_server(page, server, REPEATS)
    names = {s["name"] for s in want["steps"]}
    assert not {"mirostat", "typical_p"} & names or page.locator("#stage tbody tr.cut").count()
    if "xtc" in names:  # the rows XTC removes when its coin lands are marked: the top choices but the last
        xtc = next(s for s in want["steps"] if s["name"] == "xtc")
        assert xtc["cut"] >= 1 and page.locator("#stage tbody tr.xtc").count() == xtc["cut"]


def test_bad_words_are_cut_where_the_prompt_ends_with_their_head(page, server):
    submit(page, REPEATS)
    ids = [t["token_id"] for t in page.evaluate("window.lmhead.state.data.raw.prompt_tokens")]
    first = page.locator("#stage tbody tr[data-rank='1']").get_attribute("data-id")
    second = page.locator("#stage tbody tr[data-rank='2']").get_attribute("data-id")
    open_steps(page)
    set_params(page, {"bad_words": f"{ids[-2]} {ids[-1]} {first}; {second}; 7 {first}"})
    want = assert_page_equals_server(page, server, REPEATS)
    # masked tokens sort last (the explainer orders by the logit after the masks): the chain strip counts them
    assert page.locator("#chain li[data-step='bad_words']").get_attribute("data-cut") == "2"
    shown = page.locator("#stage tbody tr").evaluate_all("rs => rs.map(r => r.dataset.id)")
    assert first not in shown and second not in shown
    assert {c["token_id"] for c in want["candidates"] if c["cut_by"] == "bad_words"} == {int(first), int(second)}


def test_with_fewer_candidates_the_page_fetches_all_logits_and_stays_exact(page, server):
    """A vocabulary larger than the candidates sent: the page asks /api/logits once and runs the steps over it."""
    page.evaluate("window.lmhead.state.candidates = 40")
    submit(page, REPEATS)
    assert page.evaluate("window.lmhead.state.data.raw.candidates.length") == 40
    open_steps(page)
    set_params(page, {"typical_p": 0.9, "dry_multiplier": 0.8, "Temperature": 1.4})
    page.wait_for_function("document.querySelector('#exactness').textContent.includes('every step run here')")
    assert_page_equals_server(page, server, REPEATS)
    set_params(page, {"samplers": "transformers"})
    assert_page_equals_server(page, server, REPEATS)


def test_reset_turns_every_step_off(page):
    submit(page)
    open_steps(page)
    set_params(page, {"typical_p": 0.5, "samplers": "llama.cpp", "dry_multiplier": 1.0})
    assert page.locator("#chain li[data-step='typical_p']").count() == 1
    page.get_by_role("button", name="Reset settings").click()
    assert page.evaluate("window.lmhead.settings()") == {}  # every parameter at its declared default
    assert page.locator("#chain li").count() == 0
    assert page.get_by_label("Order", exact=True).input_value() == "lmhead"


def test_the_rank_curve_draws_a_line_where_each_declared_step_cuts(page, server):
    submit(page, REPEATS)
    open_steps(page)
    set_params(page, {"typical_p": 0.6, "top_n_sigma": 1.5})
    wait_chart(page, "#dist-chart", typical_p=0.6, top_n_sigma=1.5)
    want = httpx.post(server.url + "/api/distribution",
                      json={"prompt": REPEATS, "typical_p": 0.6, "top_n_sigma": 1.5}).json()
    lines = page.locator("#dist-chart line.cutline").evaluate_all(
        "ls => ls.map(l => [l.dataset.step, +l.dataset.rank])")
    assert lines == [[c["step"], c["rank"]] for c in want["cutoffs"]] == [["typical_p", lines[0][1]],
                                                                         ["top_n_sigma", want["kept_count"]]]
    assert "typical-p 0.6 leaves" in page.locator("#dist-chart svg desc").text_content()


def test_a_declared_step_moved_on_the_page_is_previewed_without_the_server(page, server):
    """Top-a, one entry of the steps' table: its control recomputes the table in the page (no /api/predict while it
    moves), and the numbers equal the server's."""
    submit(page, REPEATS)
    kept = int(page.locator("#kept-count").inner_text().replace(",", ""))
    asked: list[str] = []
    page.on("request", lambda r: asked.append(r.url) if "/api/predict" in r.url else None)
    open_steps(page)
    control = page.get_by_label("top_a", exact=True)
    control.evaluate("e => { e.value = '0.5'; e.dispatchEvent(new Event('input')); }")  # moved, not released
    page.wait_for_function("document.querySelector('#stage').dataset.settings.includes('top_a')")
    assert not asked
    assert int(page.locator("#kept-count").inner_text().replace(",", "")) < kept
    assert page.locator("#chain li[data-step='top_a']").count() == 1
    assert "every step run here" in page.locator("#exactness").inner_text()
    assert_page_equals_server(page, server, REPEATS)


def test_a_declared_step_without_a_preview_shows_the_servers_numbers(page, server):
    """A step the server declares and the page's table does not hold (top-a's entry taken out): its control is
    still built from the declaration, and the table shows the server's numbers for a config that runs it."""
    submit(page, REPEATS)
    page.evaluate("delete window.lmhead.steps.top_a")
    open_steps(page)
    set_params(page, {"top_a": 0.5, "Temperature": 1.5})
    page.wait_for_function("document.querySelector('#exactness').textContent.includes('computed by the server') && "
                           "document.querySelector('#stage').dataset.settings.includes('top_a')")
    settings = page.evaluate("window.lmhead.settings()")
    assert settings == {"top_a": 0.5, "temperature": 1.5}
    want = httpx.post(server.url + "/api/predict", json={"prompt": REPEATS, "top": 20, **settings}).json()
    rows = shown_rows(page)
    assert [r["id"] for r in rows] == [c["token_id"] for c in want["candidates"]]
    for r, c in zip(rows, want["candidates"], strict=True):
        assert r["p"] == pytest.approx(c["probability"], rel=1e-6) and r["kept"] == c["kept"]
    chain = page.locator("#chain li").evaluate_all("els => els.map(e => [e.dataset.step, +e.dataset.cut])")
    assert chain == [[s["name"], s["cut"]] for s in want["steps"]]
