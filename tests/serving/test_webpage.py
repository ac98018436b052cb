"""The chat page at ``/``: served as HTML, and end to end in headless Chromium through Playwright.

The browser is Debian's ``chromium`` (``apt-get install chromium``; ``scripts/setup.sh`` installs it
when run as root), launched by Playwright through ``executable_path``: Playwright's own browser
download needs the internet. Without chromium or playwright the browser tests skip, unless
``EYAS_REQUIRE_BROWSER=1`` (CI sets it), where they fail.
"""

from __future__ import annotations

import json
import os
import shutil

import httpx
import pytest

MODEL = "smol"
# n-gram prompt lookup drafts from the prompt: asking for a repeat makes its drafts accepted
PROMPT = "Repeat this sentence twice: the quick brown fox jumps over the lazy dog."
# Records the latest answer's text length at every DOM change, to see the text grow while streaming.
WATCH = """() => {
  window.__lengths = [];
  new MutationObserver(() => {
    const a = [...document.querySelectorAll('.msg.assistant .body')].pop();
    if (a) window.__lengths.push(a.textContent.length);
  }).observe(document.querySelector('#log'), {childList: true, subtree: true, characterData: true});
}"""


def test_page_is_served(base_url):
    r = httpx.get(base_url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert 'id="prompt"' in r.text and "/static/app.js" in r.text
    for name, kind in (("app.js", "javascript"), ("style.css", "text/css")):
        r = httpx.get(f"{base_url}/static/{name}")
        assert r.status_code == 200 and kind in r.headers["content-type"]


def _unavailable(reason: str):
    if os.environ.get("EYAS_REQUIRE_BROWSER") == "1":
        pytest.fail(f"{reason} (EYAS_REQUIRE_BROWSER=1 demands the browser test)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("playwright is not installed: pip install -e '.[test]'")
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        _unavailable("no chromium on PATH: apt-get install chromium (scripts/setup.sh does it as root)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, headless=True)
        yield browser
        browser.close()


@pytest.fixture
def page(browser, base_url):
    page = browser.new_page()
    page.set_default_timeout(60_000)
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(base_url + "/")
    page.wait_for_function(f"document.querySelector('#model').textContent === {MODEL!r}")
    yield page
    page.close()
    assert not errors, errors  # no uncaught JavaScript exception


def _send(page, text: str) -> None:
    page.fill("#prompt", text)
    page.click("#send")


def test_error_from_the_server_is_shown(page):
    page.fill("#max-tokens", "1000")  # the test server allows at most 64
    _send(page, "hi")
    error = page.locator(".msg.assistant[data-state=error] .error-box")
    error.wait_for()
    assert "400" in error.text_content() and "max_tokens" in error.text_content()
    assert page.locator("#send").is_enabled()


def test_chat_streams_marks_accepted_drafts_and_compares_plain(page, spec):
    from eyas.kv.prefix import PrefixStore

    spec.prefix_cache = PrefixStore()  # as eyas serve runs: the second turn reuses the first one's prompt
    bodies = []
    page.on("request", lambda r: bodies.append(json.loads(r.post_data)) if r.method == "POST" else None)
    page.fill("#max-tokens", "24")
    page.evaluate(WATCH)
    _send(page, PROMPT)
    first = page.locator(".msg.assistant").nth(0)
    first.locator(".tok").first.wait_for()  # streamed text appears ...
    page.wait_for_selector(".msg.assistant[data-state=done]")
    grew = sorted(set(page.evaluate("window.__lengths")) - {0})
    assert len(grew) >= 2, grew  # ... and grows chunk by chunk before the finish
    assert first.locator(".tok.acc").count() >= 1  # drafted-and-accepted tokens are marked
    assert first.locator(".step[data-accepted]:not([data-accepted='0'])").count() >= 1
    assert float(page.text_content("#stat-tau")) > 1.0
    assert bodies[-1]["speculate"] is True and bodies[-1]["max_tokens"] == 24

    page.click("label.switch")  # speculation off
    assert page.text_content("#spec-state") == "off" and not page.is_checked("#speculate")
    _send(page, PROMPT)
    second = page.locator(".msg.assistant").nth(1)
    page.wait_for_function("document.querySelectorAll('.msg.assistant[data-state=done]').length === 2")
    assert second.get_attribute("data-speculate") == "off"
    assert second.locator(".tok").count() >= 1 and second.locator(".tok.acc").count() == 0
    assert float(page.text_content("#stat-tau")) == 1.0
    assert bodies[-1]["speculate"] is False
    assert [m["role"] for m in bodies[-1]["messages"]] == ["user", "assistant", "user"]  # multi-turn
    prompt, reused = page.text_content("#stat-prompt").replace("(", "").split()[:2]
    assert int(prompt) > int(reused) >= (16 if spec.exact else 0)  # the first turn's prompt came from the cache
    spec.prefix_cache = None
    runs = page.locator("#runs tr")
    assert runs.count() == 2 and runs.nth(0).locator("td").nth(1).text_content() == "off"


def test_page_asks_for_the_api_key(browser, spec, launch):
    """With --api-key the page's first request gets 401; it asks for the key once and sends it after."""
    from eyas.serving.app import create_app
    from eyas.serving.engine import ServeLimits
    from eyas.serving.guard import HttpConfig

    url = launch(create_app(spec, MODEL, ServeLimits(max_tokens=64, spec_policy="always", calibrate=False),
                            HttpConfig(api_key="page-key")))
    page = browser.new_page()
    page.set_default_timeout(60_000)
    asked = []
    page.on("dialog", lambda d: (asked.append(d.message), d.accept("page-key")))
    sent = []
    page.on("request", lambda r: sent.append(r.headers.get("authorization")) if "/v1/" in r.url else None)
    page.goto(url + "/")
    page.wait_for_function(f"document.querySelector('#model').textContent === {MODEL!r}")
    page.fill("#max-tokens", "4")
    _send(page, "hi")
    page.wait_for_selector(".msg.assistant[data-state=done]")
    page.close()
    assert len(asked) == 1 and "API key" in asked[0]
    assert sent[0] is None and sent[1:] == ["Bearer page-key"] * (len(sent) - 1) and len(sent) == 3
