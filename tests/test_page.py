"""The chat page lse-server serves at /, driven in Debian's headless chromium through its chromedriver.

Two servers, one per module: the default model (SmolLM2) on jit:0 behind --api-key, for the chat, stop,
context meter, devices panel and key flow; and a tiny qwen3 checkpoint with a thinking switch (the
template of test_thinking_e2e that opens <think> only when asked) for the level picker and the injection
test. Its vocabulary holds one more added token, an <img onerror> tag, and its ids are renamed (as in
test_thinking_e2e) so that its greedy reply to MARKUP_REQUEST opens with that token: the model really
writes the markup, and the page must show it as text.

What the page sent is read from chromium's network log (CDP Network.requestWillBeSent); what the server
did from /v1/lse/status. Screenshots go to artifacts/page/ (gitignored)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import Select, WebDriverWait
from test_api_contract import hf_reference
from test_server import API_KEY, Server, lse_server
from test_thinking_e2e import OFF_BY_DEFAULT, prompt_ids, renamed, thinking_checkpoint, user, vocab

from lse_core.model.default import default_model_path

ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts" / "page"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"   # apt-get install chromium chromium-driver
WAIT = 300            # seconds: only a bound on a wait that would otherwise hang (the first jit reply compiles)
SMOLLM2_KV_LEN = 1024
TINY_KV_LEN = 64      # the tiny model never ends its turn: its replies fill this context
PAYLOAD = "<img src=x onerror=\"document.title='pwned'\">"
MARKUP_REQUEST = "Show me an image."
TITLE = "LSE chat"


# ---- servers and the browser ----

@pytest.fixture(scope="module")
def smollm2() -> Iterator[Server]:
    with lse_server(default_model_path(), "--pool", "jit:0", "--kv-len", str(SMOLLM2_KV_LEN), "--parallel", "2",
                    ready_timeout=WAIT) as server:
        yield server


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny thinking checkpoint whose greedy reply to MARKUP_REQUEST (thinking off) starts with PAYLOAD."""
    base = thinking_checkpoint(tmp_path_factory.mktemp("page_base"), OFF_BY_DEFAULT, extra_tokens=(PAYLOAD,))
    prompt = prompt_ids(base, OFF_BY_DEFAULT, user(MARKUP_REQUEST), enable_thinking=False)
    [first], _ = hf_reference(base, tuple(prompt), 1)
    assert first not in prompt   # renaming it would change the prompt too
    return renamed(base, tmp_path_factory.mktemp("page_markup"), {first: vocab(base).token_to_id(PAYLOAD)})


@pytest.fixture(scope="module")
def tiny_server(tiny: Path) -> Iterator[Server]:
    with lse_server(tiny, "--kv-len", str(TINY_KV_LEN), "--pool", "cpu:0", "--temperature", "0") as server:
        yield server


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    yield driver
    driver.quit()


# ---- driving the page ----

class Page:
    def __init__(self, driver: webdriver.Chrome, server: Server) -> None:
        self.driver = driver
        self.server = server

    def open(self, key: str | None = API_KEY) -> Page:
        """The page with nothing stored but ``key``, ready to send (with a key it accepts)."""
        # away from the page first: leaving it saves its conversations (pagehide)
        self.driver.get(f"{self.server.url}/health")
        self.driver.execute_script("localStorage.clear(); if (arguments[0]) localStorage.setItem('lse.apiKey', "
                                   "arguments[0]);", key)
        self.requests("")   # the network log so far
        self.driver.get(f"{self.server.url}/")
        if key == API_KEY:
            self.wait(lambda d: d.find_element(By.ID, "send").is_enabled())
        return self

    def wait(self, condition, timeout: float = WAIT):
        # the page draws a conversation anew when a reply ends: an element looked at then is gone
        return WebDriverWait(self.driver, timeout, poll_frequency=0.02,
                             ignored_exceptions=[StaleElementReferenceException]).until(condition)

    def find(self, selector: str) -> WebElement:
        return self.driver.find_element(By.CSS_SELECTOR, selector)

    def find_all(self, selector: str) -> list[WebElement]:
        return self.driver.find_elements(By.CSS_SELECTOR, selector)

    def send(self, *keys: str) -> None:
        self.find("#prompt").send_keys(*keys, Keys.ENTER)

    def set_sampling(self, field: str, value: str) -> WebElement:
        box = self.find(f"#sampling input[name={field}]")
        box.clear()
        box.send_keys(value)
        return box.find_element(By.XPATH, "..")

    def last_reply(self) -> WebElement:
        """The last reply, once it has ended."""
        ended = ("const reply = [...document.querySelectorAll('.message.assistant')].at(-1);"
                 "return reply?.dataset.state === 'streaming' ? null : reply")
        return self.wait(lambda d: d.execute_script(ended))

    def requests(self, path: str) -> list[dict]:
        """The requests the page sent to ``path`` since the last call (CDP's request objects)."""
        sent = []
        for entry in self.driver.get_log("performance"):
            message = json.loads(entry["message"])["message"]
            if message["method"] == "Network.requestWillBeSent":
                request = message["params"]["request"]
                if urlsplit(request["url"]).path == path:
                    sent.append(request)
        return sent

    def chat_bodies(self) -> list[dict]:
        sent = self.requests("/v1/chat/completions")
        for request in sent:
            assert request["method"] == "POST"
            assert request["headers"]["Content-Type"] == "application/json"
            assert request["headers"]["Authorization"] == f"Bearer {API_KEY}"
        return [json.loads(request["postData"]) for request in sent]

    def stored_conversations(self) -> list[dict]:
        return json.loads(self.driver.execute_script("return localStorage.getItem('lse.conversations')"))

    def clipboard(self) -> str:
        """What the page copied (the permission is granted, as a user's click on a prompt would)."""
        self.driver.execute_cdp_cmd("Browser.grantPermissions", {"origin": self.server.url,
                                                                 "permissions": ["clipboardReadWrite",
                                                                                 "clipboardSanitizedWrite"]})
        return self.driver.execute_async_script("navigator.clipboard.readText().then(arguments[0])")

    def click_copy(self, selector: str) -> str:
        """Clicks a copy button; what it says then (Copied, or Copy failed)."""
        self.find(selector).click()
        return self.wait(lambda d: (said := self.find(selector).text) != "Copy" and said, 10)

    def screenshot(self, name: str) -> None:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        self.driver.save_screenshot(str(ARTIFACTS / f"{name}.png"))


def assert_sampling_defaults(page: Page) -> None:
    """The sampling controls hold the model's generation_defaults, each with its source."""
    with page.server.client() as http:
        defaults = http.get("/v1/models").json()["data"][0]["generation_defaults"]
    for field in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty"):
        row = page.find(f"#sampling input[name={field}]").find_element(By.XPATH, "..")
        assert float(row.find_element(By.TAG_NAME, "input").get_property("value")) == defaults[field]
        assert row.find_element(By.CLASS_NAME, "source").text == f"default from {defaults['sources'][field]}"


def status(server: Server) -> dict:
    with server.client() as http:
        return http.get("/v1/lse/status").json()


def requests_with_outcome(server: Server, outcome: str) -> int:
    return sum(r["count"] for r in status(server)["stats"]["requests"]
               if (r["endpoint"], r["outcome"]) == ("chat", outcome))


# ---- the default model ----

def test_the_page_asks_for_the_api_key_and_sends_it(browser: webdriver.Chrome, smollm2: Server) -> None:
    page_response = httpx.get(f"{smollm2.url}/")
    assert page_response.status_code == 200 and page_response.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page_response.headers["content-security-policy"]
    assert httpx.get(f"{smollm2.url}/page/chat.js").status_code == 200
    assert httpx.get(f"{smollm2.url}/v1/models").status_code == 401   # the API itself still needs the key

    page = Page(browser, smollm2).open(key=None)
    dialog = page.wait(lambda d: d.find_element(By.CSS_SELECTOR, "#key-dialog[open]"))
    assert "--api-key" in page.find("#key-reason").text
    page.find("#key-input").send_keys("wrong", Keys.ENTER)
    page.wait(lambda d: "refused" in d.find_element(By.ID, "key-reason").text)
    assert dialog.get_attribute("open") is not None
    page.screenshot("api-key")
    page.find("#key-input").send_keys(API_KEY, Keys.ENTER)
    model_id = status(smollm2)["model"]
    page.wait(lambda d: model_id in d.find_element(By.ID, "model-name").text)
    assert dialog.get_attribute("open") is None
    assert browser.execute_script("return localStorage.getItem('lse.apiKey')") == API_KEY
    sent = [r["headers"].get("Authorization") for r in page.requests("/v1/models")]
    assert sent == [None, "Bearer wrong", f"Bearer {API_KEY}"]


def test_a_message_gets_a_streamed_reply(browser: webdriver.Chrome, smollm2: Server) -> None:
    page = Page(browser, smollm2).open()
    assert not page.find("#thinking-picker").is_displayed()   # SmolLM2's template has no thinking levels
    assert_sampling_defaults(page)
    assert page.set_sampling("temperature", "0").find_element(By.CLASS_NAME, "source").text == "set here"
    page.set_sampling("max_tokens", "24")

    prompt = page.find("#prompt")
    prompt.send_keys("What is 2 + 2?", Keys.SHIFT, Keys.ENTER, Keys.NULL, "Answer in one line.")
    assert prompt.get_property("value") == "What is 2 + 2?\nAnswer in one line."   # Shift+Enter: a new line
    assert not page.find_all(".message.user")
    before = status(smollm2)["stats"]
    prompt.send_keys(Keys.ENTER)

    partial = set()   # the reply's text each time it is looked at while it streams
    streaming = "return document.querySelector('.message.assistant[data-state=streaming] .content')?.innerText"
    while (text := browser.execute_script(streaming)) is not None:
        partial.add(text)
    reply = page.last_reply()
    page.screenshot("chat")
    final = browser.execute_script("return document.querySelector('.message.assistant .content').innerText")
    assert reply.get_attribute("data-state") == "done" and final
    assert len(partial - {"", final}) >= 1, "no part of the reply was shown before it ended"

    [body] = page.chat_bodies()
    assert body == {"model": status(smollm2)["model"], "stream": True, "stream_options": {"include_usage": True},
                    "temperature": 0, "max_tokens": 24,
                    "messages": [{"role": "user", "content": "What is 2 + 2?\nAnswer in one line."}]}
    after = status(smollm2)["stats"]
    completion = after["completion_tokens"] - before["completion_tokens"]
    prompt_tokens = after["prompt_tokens"] - before["prompt_tokens"]
    meta = reply.find_element(By.CLASS_NAME, "meta").text
    assert f"{completion} tokens" in meta and "tok/s" in meta and "ran on jit:0" in meta
    assert "first token after" in meta and f"prompt {prompt_tokens} tokens" in meta
    stop_reason = reply.get_attribute("data-stop-reason")
    assert stop_reason == ("max_tokens" if completion == 24 else "stop_token")
    [conversation] = page.stored_conversations()
    content = conversation["messages"][1]["content"]
    assert content.strip() and conversation["messages"][1]["stop_reason"] == stop_reason
    page.clipboard()   # granted before the click
    assert page.click_copy(".message.assistant .copy-message") == "Copied"
    assert page.clipboard() == content   # the reply as the model wrote it


def test_context_meter_edit_regenerate_and_conversations(browser: webdriver.Chrome, smollm2: Server) -> None:
    page = Page(browser, smollm2).open()
    page.set_sampling("temperature", "0")
    page.set_sampling("max_tokens", "8")
    meter = page.find("#context-meter")
    assert meter.get_attribute("value") == "0" and meter.get_attribute("max") == str(SMOLLM2_KV_LEN)

    def used() -> int:
        return int(meter.get_attribute("data-used"))

    before = status(smollm2)["stats"]
    page.send("Name a color.")
    page.last_reply()
    after = status(smollm2)["stats"]
    first = used()
    # one turn: the context holds its prompt and its reply
    assert first == (after["prompt_tokens"] - before["prompt_tokens"]) + (after["completion_tokens"]
                                                                        - before["completion_tokens"])
    assert page.find("#context-text").text == f"{first} of {SMOLLM2_KV_LEN} tokens used · " \
                                                f"{SMOLLM2_KV_LEN - first} left"
    page.send("Name another one.")
    page.last_reply()
    second = used()
    assert second > first
    page.screenshot("context-meter")

    page.find(".message.assistant:last-child .regenerate").click()
    page.last_reply()
    assert len(page.find_all(".message")) == 4
    bodies = page.chat_bodies()
    assert bodies[-1]["messages"] == bodies[-2]["messages"]   # the same conversation, asked again

    page.find(".message.user .edit").click()
    editor = page.find(".message.user .editor")
    editor.clear()
    editor.send_keys("Name a fruit.", Keys.ENTER)
    page.last_reply()
    assert len(page.find_all(".message")) == 2
    assert page.find(".message.user .content").text == "Name a fruit."
    assert page.chat_bodies()[-1]["messages"] == [{"role": "user", "content": "Name a fruit."}]
    assert used() < second

    page.find("#new-conversation").click()
    assert not page.find_all(".message") and meter.get_attribute("value") == "0"
    browser.refresh()   # conversations are kept in the browser
    titles = page.wait(lambda d: [b.text for b in page.find_all(".conversation-title")] or None)
    assert titles == ["New chat", "Name a fruit."]
    page.find_all(".conversation-title")[1].click()
    assert page.find(".message.user .content").text == "Name a fruit."


def test_stop_cancels_the_reply_on_the_server(browser: webdriver.Chrome, smollm2: Server) -> None:
    page = Page(browser, smollm2).open()
    cancelled = requests_with_outcome(smollm2, "cancelled")
    page.send("Write a long story about a dragon who learns to fly.")
    page.wait(lambda d: page.find(".message.assistant .content").text.strip())
    stop = page.find("#stop")
    assert page.find(".message.assistant").get_attribute("data-state") == "streaming"
    stop.click()
    reply = page.last_reply()
    page.screenshot("stopped")
    assert reply.get_attribute("data-stop-reason") == "cancelled"
    assert "ended: stopped cancelled" in reply.find_element(By.CLASS_NAME, "meta").text
    assert page.find("#send").is_displayed() and not stop.is_displayed()
    # the server saw the connection close: the sequence ended as cancelled and its slot is free
    page.wait(lambda d: requests_with_outcome(smollm2, "cancelled") == cancelled + 1)
    page.wait(lambda d: status(smollm2)["engine"]["running"] == 0)

    # leaving the page mid-reply cancels it too, and the reply is kept as stopped
    page.send("Tell me another long story.")
    page.wait(lambda d: page.find(".message.assistant:last-child .content").text.strip())
    browser.refresh()
    page.wait(lambda d: requests_with_outcome(smollm2, "cancelled") == cancelled + 2)
    reply = page.last_reply()
    assert len(page.find_all(".message")) == 4 and reply.get_attribute("data-stop-reason") == "cancelled"
    [conversation] = page.stored_conversations()
    assert conversation["messages"][3]["content"].strip()   # the text it had shown is kept


def test_the_devices_panel_shows_what_runs_where(browser: webdriver.Chrome, smollm2: Server) -> None:
    page = Page(browser, smollm2).open()
    expected = status(smollm2)
    assert [d["name"] for d in expected["devices"]] == ["jit:0"]
    names = [item.get_attribute("data-device") for item in page.find_all("#devices .device")]
    assert names == ["jit:0"]
    rows = browser.execute_script("return [...document.querySelectorAll('#devices .placements tr[data-device]')]"
                                  ".map((row) => [...row.cells].map((cell) => cell.textContent))")
    assert len(rows) == len(expected["placements"]) > 0
    for (group, _, ops, device), placement in zip(rows, expected["placements"]):
        assert (int(group), ops, device) == (placement["group"], ", ".join(placement["ops"]), "jit:0")
    page.find("#devices .plan summary").click()   # the table unfolds
    assert page.find("#devices .placements").is_displayed()
    assert f"{len(rows)} on jit:0" in page.find("#devices .plan summary").text
    fallback = expected["engine"]["cpu_fallback"]
    assert page.find("#devices .cpu-fallback").text == f"CPU fallback: allowed, {fallback['total']} so far"
    page.screenshot("devices")


def test_the_page_is_readable_at_phone_width(browser: webdriver.Chrome, smollm2: Server) -> None:
    browser.set_window_size(390, 844)
    try:
        page = Page(browser, smollm2).open()
        overflow = "return document.documentElement.scrollWidth - document.documentElement.clientWidth"
        assert browser.execute_script(overflow) <= 0
        panel = page.find("#panel")
        assert not panel.is_displayed() and page.find("#prompt").is_displayed()
        page.find("#toggle-panel").click()
        assert panel.is_displayed() and page.find("#devices .device").is_displayed()
        page.screenshot("phone-panel")
        page.find("#prompt").send_keys(Keys.ESCAPE)
        assert not panel.is_displayed()
        assert browser.execute_script(overflow) <= 0
        page.screenshot("phone")
    finally:
        browser.set_window_size(1280, 900)


def test_replies_render_formatting_as_nodes_not_markup(browser: webdriver.Chrome, smollm2: Server) -> None:
    """The page's renderer on a fixed text, in the browser: its formatting becomes elements, and
    markup anywhere in it (paragraph, bold, code) stays text."""
    page = Page(browser, smollm2).open()
    text = ("# Title\n\nSome **bold <b>x</b>** and *soft* with `code <i>` and snake_case_name.\n\n"
            "- one\n- two <script>document.title='pwned'</script>\n\n2. second\n3. third\n\n"
            "```python\nprint('<img src=x onerror=alert(1)>')\n```\n> quoted")
    shape = browser.execute_async_script("""
        const [text, done] = arguments;
        import('./page/render.js').then(({renderMarkdown}) => {
          const box = document.createElement('div');
          box.className = 'rendered';
          box.append(renderMarkdown(text));
          document.querySelector('#messages').append(box);
          const all = (s) => [...box.querySelectorAll(s)].map((e) => e.textContent);
          done({tags: [...box.children].map((e) => e.tagName), strong: all('strong'), em: all('em'),
                code: all(':not(pre) > code'), items: all('li'), pre: all('pre code'), lang: all('.code-language'),
                start: box.querySelector('ol').start, markup: box.querySelectorAll('b, i, img, script').length,
                quote: all('blockquote')});
        });""", text)
    assert shape == {"tags": ["H3", "P", "UL", "OL", "DIV", "BLOCKQUOTE"], "strong": ["bold <b>x</b>"],
                     "em": ["soft"], "code": ["code <i>"],
                     "items": ["one", "two <script>document.title='pwned'</script>", "second", "third"],
                     "pre": ["print('<img src=x onerror=alert(1)>')"], "lang": ["python"], "start": 2,
                     "markup": 0, "quote": ["quoted"]}
    assert browser.title == TITLE
    page.clipboard()
    assert page.click_copy(".rendered .copy-code") == "Copied"   # a code block's own copy button
    assert page.clipboard() == "print('<img src=x onerror=alert(1)>')"


# ---- the tiny thinking checkpoint ----

def test_the_thinking_level_picker_sends_the_level(browser: webdriver.Chrome, tiny_server: Server, tiny: Path) -> None:
    page = Page(browser, tiny_server).open()
    with tiny_server.client() as http:
        thinking = http.get("/v1/models").json()["data"][0]["thinking"]
    assert thinking["supported"] and thinking["default_level"] == "none"
    picker = Select(page.find("#thinking-level"))
    assert page.find("#thinking-picker").is_displayed()
    assert [o.get_attribute("value") for o in picker.options] == [level["id"] for level in thinking["levels"]]
    assert picker.first_selected_option.get_attribute("value") == "none"

    for level, thinks in (("on", True), ("none", False)):
        picker.select_by_value(level)
        page.send("Hello!")
        reply = page.last_reply()
        [body] = page.chat_bodies()
        assert body["reasoning_effort"] == level
        # the server rendered the template with that level: its prompt is the template's for it
        prompt = prompt_ids(tiny, OFF_BY_DEFAULT, user("Hello!"), enable_thinking=thinks)
        meta = reply.find_element(By.CLASS_NAME, "meta").text
        assert f"prompt {len(prompt)} tokens" in meta and f"thinking: {level}" in meta
        page.find("#new-conversation").click()
    page.find_all(".conversation-title")[-1].click()   # the oldest: the reply that thought
    reasoning = page.find(".message.assistant .reasoning")
    assert reasoning.is_displayed() and reasoning.get_attribute("open") is None   # folded
    assert reasoning.find_element(By.TAG_NAME, "summary").text.startswith("Reasoning (")
    page.screenshot("thinking-on")
    reasoning.find_element(By.TAG_NAME, "summary").click()
    assert reasoning.find_element(By.CLASS_NAME, "reasoning-text").text.strip()


def test_markup_in_a_reply_renders_as_text(browser: webdriver.Chrome, tiny_server: Server) -> None:
    page = Page(browser, tiny_server).open()
    assert_sampling_defaults(page)   # greedy, from the server's --temperature 0
    assert page.find("#sampling input[name=temperature]").get_property("value") == "0"
    page.send(MARKUP_REQUEST)
    reply = page.last_reply()
    page.screenshot("markup-as-text")
    assert reply.find_element(By.CLASS_NAME, "content").text.startswith(PAYLOAD)
    assert browser.execute_script("return document.querySelectorAll('img').length") == 0
    assert browser.title == TITLE   # the onerror handler never ran
    # the reply ran until the context was full, and the page says so
    assert reply.get_attribute("data-stop-reason") == "context_full"
    assert "context_full" in page.find("#context-warning").text
    assert page.find("#context-meter").get_attribute("data-used") == str(TINY_KV_LEN)
