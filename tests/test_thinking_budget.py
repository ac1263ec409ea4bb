"""thinking_budget (LSE's field) and Anthropic's thinking.budget_tokens: past the budget the engine writes the
template's end marker itself and the answer follows.

On the synthetic Qwen3.8 template the generation prompt opens the reasoning block, and a random model never
closes it: without a budget the whole reply is reasoning. With one, the expected reply comes from transformers:
its greedy ids up to the budget are the reasoning, and its greedy continuation of the prompt, those ids and
</think> is the answer, so the marker must really have been computed into the KV cache."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest
from test_api_contract import error, hf_reference, open_engine, reply, streamed, streamed_text
from test_server import API_KEY, Server, lse_server
from test_thinking_e2e import QWEN3, QWEN38, QWEN38_LEVELS, prompt_ids, thinking_checkpoint, vocab, with_template

from lse_core.api import LSE

MESSAGES = [{"role": "user", "content": "Hello!"}]
MAX_TOKENS = 12
BUDGET = 3


@pytest.fixture(scope="module")
def qwen38(tmp_path_factory: pytest.TempPathFactory) -> Path:
    qwen3 = thinking_checkpoint(tmp_path_factory.mktemp("qwen3_thinking"), QWEN3)
    return with_template(qwen3, tmp_path_factory.mktemp("qwen38"), QWEN38)


@pytest.fixture(scope="module")
def lse(qwen38: Path) -> Iterator[LSE]:
    with open_engine(qwen38, kv_len=256) as engine:
        yield engine


@pytest.fixture(scope="module")
def expected(qwen38: Path) -> dict[str, Any]:
    """transformers' reply with the block closed after BUDGET tokens: the reasoning and the answer."""
    tokenizer = vocab(qwen38)
    prompt = prompt_ids(qwen38, QWEN38, MESSAGES, enable_thinking=True, reasoning_effort="xhigh")
    unbounded, _ = hf_reference(qwen38, tuple(prompt), MAX_TOKENS)
    close = tokenizer.token_to_id("</think>")
    assert close not in unbounded     # the model never closes the block itself
    answer, _ = hf_reference(qwen38, tuple(prompt + unbounded[:BUDGET] + [close]), MAX_TOKENS - BUDGET - 1)
    return {"unbounded": tokenizer.decode(unbounded), "reasoning": tokenizer.decode(unbounded[:BUDGET]),
            "answer": tokenizer.decode(answer)}


def body(**fields: Any) -> dict[str, Any]:
    return {"messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0} | fields


def test_without_a_budget_the_reply_is_all_reasoning(lse: LSE, expected: dict[str, Any]) -> None:
    message = reply(lse, body())["choices"][0]["message"]
    assert (message["reasoning_content"].strip(), message["content"]) == (expected["unbounded"].strip(), "")


def test_the_budget_closes_the_block_and_the_answer_follows(lse: LSE, expected: dict[str, Any]) -> None:
    data = reply(lse, body(thinking_budget=BUDGET, logprobs=True))
    message = data["choices"][0]["message"]
    assert message["reasoning_content"].strip() == expected["reasoning"].strip()
    assert message["content"].strip() == expected["answer"].strip() and message["content"]
    tokens = [entry["token"] for entry in data["choices"][0]["logprobs"]["content"]]
    assert tokens[BUDGET] == "</think>" and data["usage"]["completion_tokens"] == MAX_TOKENS
    chunks, _ = streamed(lse, body(thinking_budget=BUDGET))
    assert streamed_text(chunks, "reasoning_content") == message["reasoning_content"]
    assert streamed_text(chunks) == message["content"]


def test_a_budget_the_reasoning_never_reaches_changes_nothing(lse: LSE) -> None:
    assert reply(lse, body(thinking_budget=MAX_TOKENS))["choices"][0] == reply(lse, body())["choices"][0]


def test_a_budget_on_a_reply_that_does_not_think(lse: LSE) -> None:
    off = body(reasoning_effort="none")
    assert reply(lse, off | {"thinking_budget": 1})["choices"][0] == reply(lse, off)["choices"][0]


@pytest.mark.parametrize("value", [0, -2, "3", True, 2.5])
def test_invalid_budget(lse: LSE, value: Any) -> None:
    status, data = error(lse, body(thinking_budget=value))
    assert status == 400
    err = data["error"]
    assert (err["code"], err["param"], err["levels"]) == ("invalid_thinking", "thinking_budget", QWEN38_LEVELS)


# ---- through the server: Anthropic's budget_tokens, and the LSE field on /v1/responses ----

@pytest.fixture(scope="module")
def server(qwen38: Path) -> Iterator[Server]:
    with lse_server(qwen38, "--kv-len", "256", "--pool", "cpu:0") as s:
        yield s


def test_budget_tokens_bounds_the_thinking_block(server: Server, expected: dict[str, Any]) -> None:
    client = anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=60)
    fields = {"model": "model", "max_tokens": MAX_TOKENS, "messages": MESSAGES, "extra_body": {"temperature": 0}}
    message = client.messages.create(**fields, thinking={"type": "enabled", "budget_tokens": BUDGET})
    thinking, text = message.content
    assert thinking.thinking.strip() == expected["reasoning"].strip()
    assert text.text.strip() == expected["answer"].strip()
    with client.messages.stream(**fields, thinking={"type": "enabled", "budget_tokens": BUDGET}) as stream:
        assert [b.type for b in stream.get_final_message().content] == ["thinking", "text"]
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(**fields, thinking={"type": "enabled", "budget_tokens": 0})
    assert caught.value.body["error"]["param"] == "thinking.budget_tokens"


def test_thinking_budget_on_responses(server: Server, expected: dict[str, Any]) -> None:
    response = server.openai().responses.create(input=MESSAGES[0]["content"], max_output_tokens=MAX_TOKENS,
                                                temperature=0, extra_body={"thinking_budget": BUDGET})
    reasoning, message = response.output
    assert reasoning.content[0].text.strip() == expected["reasoning"].strip()
    assert response.output_text.strip() == expected["answer"].strip()
