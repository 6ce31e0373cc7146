"""The chat page at GET /, in a real browser: Debian's chromium, headless, driven by Playwright.

The browser is never downloaded: the test launches /usr/bin/chromium (`make test`
installs it when it can) and skips when it or the playwright package is missing.
"""

import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.server_fixtures import TINY_ENGINE, default_model_dir, start_server, tiny_model_dir  # noqa: F401

sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
if shutil.which(CHROMIUM) is None:  # at import, before the session's model fixtures are built for nothing
    pytest.skip(f"no chromium at {CHROMIUM} (Debian: apt-get install chromium)", allow_module_level=True)
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
API_KEY = "page-key"
WAIT_MS = 60_000

# Each text the newest reply showed, recorded by the page itself as the DOM changes (not sampled by polling).
RECORD_REPLY_TEXTS = """() => {
  window.replyTexts = [];
  new MutationObserver(() => {
    const replies = document.querySelectorAll(".msg.assistant");
    const text = replies.length ? replies[replies.length - 1].firstChild?.textContent ?? "" : "";
    if (text && text !== window.replyTexts.at(-1)) window.replyTexts.push(text);
  }).observe(document.getElementById("log"), { childList: true, subtree: true, characterData: true });
}"""


@pytest.fixture(scope="module")
def browser():
    """Headless chromium for the module, or a skip saying why it does not start."""
    with sync_api.sync_playwright() as playwright:
        try:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        except sync_api.Error as exc:
            pytest.skip(f"chromium at {CHROMIUM} does not start: {exc}")
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def chat_server(tiny_model_dir):  # noqa: F811
    live = start_server(tiny_model_dir, "tiny-chat", api_key=API_KEY, **TINY_ENGINE)
    yield live
    live.server.stop()


@pytest.fixture
def sent():
    """Every request the page makes, in order."""
    return []


@pytest.fixture
def page(browser, chat_server, sent):
    """The chat page, opened and given the API key."""
    context = browser.new_context()
    page = context.new_page()
    page.on("request", lambda request: sent.append(request))
    page.goto(f"{chat_server.url}/")
    sync_api.expect(page.locator("#model")).to_have_text("enter the API key", timeout=WAIT_MS)  # 401 without it
    page.fill("#api-key", API_KEY)
    page.press("#api-key", "Enter")
    sync_api.expect(page.locator("#model")).to_have_text(chat_server.model_name, timeout=WAIT_MS)
    page.evaluate(RECORD_REPLY_TEXTS)
    yield page
    context.close()


def pool_whole(live):
    """`live.assert_pool_whole()` from another thread: Playwright's sync API keeps an event loop in this one."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(live.assert_pool_whole).result()


def ask(page, text):
    """Send `text` from the page; its reply, streaming or already done (a short one may end at once)."""
    replies = page.locator(".msg.assistant")
    count = replies.count()
    page.fill("#prompt", text)
    page.click("#send")
    reply = replies.nth(count)
    sync_api.expect(reply).to_be_attached(timeout=WAIT_MS)
    return reply


def finished(reply):
    """Wait for the reply's stream to end (the page drops its `streaming` class in a `finally`)."""
    sync_api.expect(reply).not_to_have_class(re.compile(r"\bstreaming\b"), timeout=WAIT_MS)
    sync_api.expect(reply.page.locator("#send")).to_be_enabled(timeout=WAIT_MS)


def wait_for_texts(page, count, timeout=60.0):
    """Until the newest reply has shown `count` different texts (a poll: the page's CSP forbids eval)."""
    deadline = time.monotonic() + timeout
    while len(page.evaluate("window.replyTexts")) < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"the reply showed fewer than {count} texts in {timeout} s")
        page.wait_for_timeout(10)


def chat_bodies(sent):
    return [r.post_data_json for r in sent if r.url.endswith("/v1/chat/completions")]


def test_the_page_streams_replies_and_keeps_the_conversation(page, sent, chat_server):
    page.fill("#max-tokens", "40")
    page.fill("#temperature", "0")
    reply = ask(page, "Tell me about pagodas.")
    finished(reply)
    first = reply.text_content()
    texts = page.evaluate("window.replyTexts")
    assert first and texts[-1] == first
    assert len(texts) >= 3 and all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:]))  # grew
    reply = ask(page, "And then?")
    finished(reply)
    assert reply.text_content()
    one, two = chat_bodies(sent)
    assert one["messages"] == [{"role": "user", "content": "Tell me about pagodas."}]
    assert two["messages"] == [*one["messages"], {"role": "assistant", "content": first},
                               {"role": "user", "content": "And then?"}]
    assert two["model"] == chat_server.model_name and two["stream"] is True
    assert (two["max_tokens"], two["temperature"]) == (40, 0)
    assert all(r.url.startswith(chat_server.url) for r in sent)  # nothing from elsewhere: works offline
    page_load, keyless, *keyed = sent  # the page, /v1/models before the key was typed, then the rest
    assert keyless.url.endswith("/v1/models") and "authorization" not in keyless.headers
    assert len(keyed) == 3 and all(r.headers["authorization"] == f"Bearer {API_KEY}" for r in keyed)
    pool_whole(chat_server)


def test_the_stop_button_aborts_the_generation_in_the_engine(page, sent, chat_server):
    before = pool_whole(chat_server)
    page.fill("#max-tokens", "900")  # far more than the test waits for
    reply = ask(page, "Tell me a very long story.")
    wait_for_texts(page, 2)  # streaming has begun
    page.click("#stop")
    finished(reply)
    sync_api.expect(reply.locator(".note")).to_have_text("stopped")
    after = pool_whole(chat_server)  # idle: the engine is not still generating for nobody
    assert after["aborted_total"] == before["aborted_total"] + 1
    assert 0 < after["generated_tokens_total"] - before["generated_tokens_total"] < 900
    shown = reply.evaluate("div => div.firstChild.textContent")  # the reply's text, without its note
    page.fill("#max-tokens", "4")
    finished(ask(page, "Shorter, please."))
    _, second = chat_bodies(sent)  # the stopped reply stays in the conversation, as it was shown
    assert second["messages"][1] == {"role": "assistant", "content": shown}
    pool_whole(chat_server)
