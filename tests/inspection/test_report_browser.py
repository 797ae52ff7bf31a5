"""The HTML report in real headless Chromium (Debian's, driven by Playwright): it works offline,
clicking a head changes the heatmap, hovering a token draws lines, and texts are escaped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from headless import chromium
from multihead.cli.main import main

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
playwright = pytest.importorskip("playwright.sync_api")
CHROMIUM = chromium()


@pytest.fixture(scope="module")
def browser():
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


def _open(browser, report: Path):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors, requests, dialogs = [], [], []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: requests.append(r.url))
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.goto(report.as_uri())
    page.wait_for_selector(".cell")
    return page, errors, requests, dialogs


def _report(tmp_path, *argv) -> Path:
    assert main(["inspect", *argv, "--out", str(tmp_path), "--format", "html"]) == 0
    return tmp_path / "report.html"


def test_report_is_offline_and_interactive(browser, tmp_path, capsys):
    report = _report(tmp_path)
    page, errors, requests, _ = _open(browser, report)
    assert errors == []
    assert requests == [report.as_uri()], f"the page requested {requests[1:]}"
    assert page.locator(".cell").count() == 6 * 12
    assert page.text_content("#heatmap-title").startswith("L3H1:")      # the it -> animal head
    before = page.evaluate("document.getElementById('heatmap').toDataURL()")
    page.click(".cell[data-layer='0'][data-head='2']")
    assert page.text_content("#heatmap-title").startswith("L0H2: previous token")
    assert page.evaluate("document.getElementById('heatmap').toDataURL()") != before
    assert page.locator(".cell.selected").count() == 1
    assert page.locator("#lines line").count() == 0
    box = page.locator("#heatmap").bounding_box()                       # bottom-right cell
    page.locator("#heatmap").hover(position={"x": box["width"] - 5, "y": box["height"] - 5})
    assert page.text_content("#tip").startswith("[SEP] → [SEP]: ")
    page.hover(".tok.q[data-i='10']")                                    # "it"
    n = page.locator("#lines line").count()
    assert n > 0
    # L0H2 is a previous-token head: the thickest line from "it" goes to "because"
    weights = page.eval_on_selector_all("#lines line", "ls => ls.map(l => [+l.dataset.weight, +l.getAttribute('y2')])")
    assert max(weights)[1] == 9 * 18 + 9
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "report_hover.png"), full_page=True)
    page.mouse.move(0, 0)
    assert page.locator("#lines line").count() == 0
    assert errors == []


def test_scores_are_cut_not_rounded_up_across_a_threshold(browser, tmp_path, capsys):
    """The roles' rules are 'metric >= 0.5' (and entropy >= 0.8): a 0.4999 shows as 0.49."""
    page, errors, _, _ = _open(browser, _report(tmp_path))
    assert page.evaluate("[down(0.4999, 2), down(0.29, 2), down(0.7999, 3), down(0.5, 2)]") == [
        "0.49", "0.29", "0.799", "0.50"]
    titles = page.eval_on_selector_all(".cell", "cs => cs.map(c => c.title)")
    assert len(titles) == 72 and all(t.split()[-1][1] == "." for t in titles)
    assert errors == []


def test_text_is_escaped(browser, tmp_path, capsys):
    evil = "<script>alert(1)</script> it <img src=x onerror=alert(2)> & </script>"
    report = _report(tmp_path, evil)
    raw = report.read_text()
    assert "<script>alert(1)" not in raw and "<img src=x" not in raw
    page, errors, requests, dialogs = _open(browser, report)
    assert dialogs == [] and errors == [] and requests == [report.as_uri()]
    assert page.text_content("#text") == evil                       # shown as text, verbatim
    assert page.locator("#text script, #text img").count() == 0
    tokens = page.eval_on_selector_all(".tok.k", "ts => ts.map(t => t.textContent)")
    assert "<" in tokens and "script" in tokens
    page.screenshot(path=str(ARTIFACTS / "report_escaped.png"), full_page=True)


def test_long_report_works(browser, tmp_path, long_text, capsys):
    # 512 tokens: the weights arrive packed (one byte each, compressed) and are decoded by
    # the page; the large heatmap stays a readable size and drops its unreadable labels
    report = _report(tmp_path, long_text)
    assert report.stat().st_size < 16e6         # (inspect.json's packing: 13.6 MB at 512 tokens)
    page, errors, requests, _ = _open(browser, report)
    assert errors == [] and requests == [report.as_uri()]
    assert page.locator(".cell").count() == 6 * 12
    size = page.evaluate("[document.getElementById('heatmap').width, "
                         "document.getElementById('heatmap').height]")
    assert size == [1024, 1024]                                    # 2 px per token, no labels
    box = page.locator("#heatmap").bounding_box()
    page.locator("#heatmap").hover(position={"x": box["width"] - 3, "y": box["height"] - 3})
    assert page.text_content("#tip").startswith("[SEP] → [SEP]: ")
    before = page.evaluate("document.getElementById('heatmap').toDataURL()")
    page.click(".cell[data-layer='0'][data-head='2']")
    assert page.evaluate("document.getElementById('heatmap').toDataURL()") != before
    page.hover(".tok.q[data-i='300']")
    weights = page.eval_on_selector_all("#lines line", "ls => ls.map(l => +l.dataset.weight)")
    assert weights and all(0.01 <= w <= 1 for w in weights)
    page.screenshot(path=str(ARTIFACTS / "report_long.png"))
    assert errors == []


def _capture_rows(text: str, q: int) -> torch.Tensor:
    """The query token's rows of every head, as the model computes them ``(L, H, S)``."""
    from multihead.inspect.capture import capture
    from multihead.models import load
    return capture(load(), text).weights[:, :, q].double()


def test_the_pages_weights_are_the_jsons_and_the_page_works_from_the_keyboard(browser, tmp_path,
                                                                                capsys):
    """The page decoded its own linear packing (64% of its three-decimal weights differed
    from inspect.json's, up to 0.005); no cell or token could be reached from the keyboard;
    a right-to-left override in the text reversed what the page showed. The query token's
    rows are exact, as the summary's weights are (the page said 'it → an 0.50' in its
    summary and 'it attends to an 0.49' on the token, from the packed byte)."""
    import json
    from multihead.inspect.packing import unpack_weights
    text = "The animal didn't cross \u202ethe street because it was too tired.\x1b[2J"
    assert main(["inspect", text, "--out", str(tmp_path), "--format", "html,json"]) == 0
    data = json.loads((tmp_path / "inspect.json").read_text())
    stored = unpack_weights(data["weights"])
    q, rows = data["query"]["position"], torch.tensor(data["query"]["rows"], dtype=torch.float64)
    stored[:, :, q] = rows                    # the query token's rows: exact (4 decimals, cut)
    torch.testing.assert_close(rows, _capture_rows(text, q), atol=1e-4, rtol=0)
    page, errors, _, _ = _open(browser, tmp_path / "report.html")
    S = stored.shape[-1]
    for l, h in ((0, 2), (3, 1), (5, 11)):
        shown = page.evaluate(f"Array.from({{length: {S * S}}}, (_, n) => "
                              f"head({l}, {h}).at(Math.floor(n / {S}), n % {S}))")
        torch.testing.assert_close(torch.tensor(shown, dtype=torch.float64).view(S, S),
                                   stored[l, h].double(),
                                   atol=1e-6, rtol=0)
    for look in data["query"]["heads"]:       # the summary's weights are the page's
        row = page.evaluate(f"head({look['layer']}, {look['head']}).row({q})")
        assert page.evaluate(f"down({row[look['target']]}, 2)") == f"{look['weight']:.4f}"[:4]
    assert page.text_content("#text").endswith("\\u202ethe street because it was too tired.\\x1b[2J")
    assert "\u202e" not in page.inner_text("body")                # (the data keeps it, as the JSON)
    page.keyboard.press("Tab")                                   # the first head's cell
    assert page.evaluate("document.activeElement.dataset.layer + document.activeElement.dataset.head") == "00"
    page.focus(".cell[data-layer='0'][data-head='2']")
    page.keyboard.press("Enter")
    assert page.text_content("#heatmap-title").startswith("L0H2: previous token")
    assert page.get_attribute(".cell[data-layer='0'][data-head='2']", "aria-pressed") == "true"
    it = page.locator(".tok.q", has_text="it").first
    it.focus()                                                   # a focused token draws as a hovered one
    assert page.locator("#lines line").count() > 0
    assert it.get_attribute("aria-label").startswith("it attends to because ")
    page.focus(".cell[data-layer='3'][data-head='1']")          # the token loses focus
    assert page.locator("#lines line").count() == 0
    assert it.get_attribute("aria-label") == "it"               # no stale description
    it.focus()
    page.evaluate("document.querySelector(\".cell[data-layer='3'][data-head='1']\").click()")
    assert it.get_attribute("aria-label").startswith("it attends to animal ")   # this head's
    assert page.evaluate("shown('a\\rb\\u202ec\\x85')") == r"a\rb\u202ec\x85"   # as plain()
    assert errors == []


def test_the_page_fits_a_phone(browser, tmp_path, capsys):
    page = browser.new_page(viewport={"width": 375, "height": 800})
    page.goto(_report(tmp_path).as_uri())
    page.wait_for_selector(".cell")
    assert page.evaluate("document.documentElement.scrollWidth") <= 375   # (parts scroll inside)
