"""The chat page with several models behind the server: a picker lists them, choosing one loads it and its
thinking levels, and each chat request names the chosen model. Headless chromium, as tests/test_page.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from selenium import webdriver
from selenium.webdriver.support.ui import Select
from test_page import Page, browser  # noqa: F401  (the browser fixture)
from test_server import CHAT_TEMPLATE, Server, lse_server

PLAIN_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")   # no thinking levels


@pytest.fixture(scope="module")
def two_models(tiny_checkpoint) -> Iterator[Server]:
    qwen3 = tiny_checkpoint("qwen3", chat_template=CHAT_TEMPLATE)   # a thinking switch: levels none, on
    llama = tiny_checkpoint("llama", chat_template=PLAIN_TEMPLATE)
    with lse_server(qwen3, "-m", str(llama), "--alias", f"qwen3={qwen3}", "--alias", f"llama={llama}",
                    "--pool", "cpu:0", "--kv-len", "64") as server:
        yield server


def test_the_page_picks_a_model_and_names_it(browser: webdriver.Chrome, two_models: Server) -> None:  # noqa: F811
    page = Page(browser, two_models).open()
    picker = Select(page.find("#model-choice"))
    assert [o.text for o in picker.options] == ["qwen3", "llama"] and picker.first_selected_option.text == "qwen3"
    assert page.find("#thinking-picker").is_displayed()
    page.send("Hello")
    page.last_reply()
    assert [body["model"] for body in page.chat_bodies()] == ["qwen3"]
    picker.select_by_visible_text("llama")
    page.wait(lambda d: "llama" in page.find("#model-name").text)
    assert [r["method"] for r in page.requests("/v1/lse/models/llama/load")] == ["POST"]   # loaded when chosen
    assert not page.find("#thinking-picker").is_displayed()   # llama's template has no levels
    page.send("Hello")
    page.last_reply()
    statuses = [r["url"] for r in page.requests("/v1/lse/status")]   # the devices panel shows llama's plan
    assert statuses and statuses[-1].endswith("?model=llama")
    with two_models.client() as http:
        metrics = http.get("/metrics").text
    assert 'lse_requests_total{model="llama",endpoint="chat",' in metrics
