"""CPU fallback on the adapted endpoints comes from the core: Responses, Messages and embeddings carry the same
lse_warnings as a chat reply of the same request, and with --no-cpu-fallback each fails in its own error shape
while the engine goes on. The example plugin lse-hrx is the device, missing its silu kernel."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_api_contract import reply

from lse_core.api import LSE, Event, lse_api_request, lse_close, lse_embeddings, lse_open_or_raise, lse_status
from lse_core.config import LSEConfig
from lse_core.errors import LSEError

TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}" \
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def model(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama", chat_template=TEMPLATE)


def engine(model: Path, refused: bool) -> Iterator[LSE]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HRX_DEVICES", "1")
        env.setenv("HRX_MISSING", "silu")
        env.delenv("LSE_REQUIRE_DEVICE_KERNELS", raising=False)
        lse = lse_open_or_raise(LSEConfig(model=str(model), pool="hrx:0", kv_len=64, parallel=2,
                                          disable_cpu_fallback=refused))
    try:
        yield lse
    finally:
        lse_close(lse)


@pytest.fixture(scope="module")
def allowed(model: Path) -> Iterator[LSE]:
    yield from engine(model, refused=False)


@pytest.fixture(scope="module")
def refused(model: Path) -> Iterator[LSE]:
    yield from engine(model, refused=True)


def last_event(lse: LSE, body: dict[str, Any], api: str) -> Event:
    events: queue.Queue[Event] = queue.Queue()
    lse_api_request(lse, body, events.put, api)
    while (event := events.get(timeout=120)).kind == "token":
        pass
    return event


def test_warnings_are_the_chat_replys(allowed: LSE) -> None:
    chat = reply(allowed, {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4, "temperature": 0})
    warnings = chat["lse_warnings"]
    assert warnings and all(w["type"] == "cpu_fallback" and "no kernel for silu" in w["cause"] for w in warnings)
    response = last_event(allowed, {"input": QUESTION, "max_output_tokens": 4, "temperature": 0}, "responses").data
    message = last_event(allowed, {"model": allowed.model_id, "max_tokens": 4, "temperature": 0,
                                   "messages": [{"role": "user", "content": QUESTION}]}, "messages").data
    assert response["lse_warnings"] == message["lse_warnings"] == warnings
    closing = last_event(allowed, {"input": QUESTION, "max_output_tokens": 4, "temperature": 0, "stream": True},
                         "responses").data
    assert closing[-1]["response"]["lse_warnings"] == warnings
    # each layer's silu group runs once, in the prompt's one prefill step
    assert lse_embeddings(allowed, {"input": QUESTION})["lse_warnings"] == [w | {"count": 1} for w in warnings]


def test_refused_fallback_fails_each_in_its_own_shape(refused: LSE) -> None:
    openai_error = last_event(refused, {"input": QUESTION, "max_output_tokens": 2}, "responses")
    assert openai_error.status == 500 and openai_error.data["error"]["type"] == "server_error"
    assert openai_error.data["error"]["message"].startswith("CPU fallback disabled: ")
    anthropic_error = last_event(refused, {"model": refused.model_id, "max_tokens": 2,
                                           "messages": [{"role": "user", "content": QUESTION}]}, "messages")
    assert anthropic_error.status == 500
    assert anthropic_error.data["type"] == "error" and anthropic_error.data["error"]["type"] == "api_error"
    assert anthropic_error.data["error"]["message"] == openai_error.data["error"]["message"]
    with pytest.raises(LSEError, match="^CPU fallback disabled: ") as caught:
        lse_embeddings(refused, {"input": QUESTION})
    assert caught.value.status == 500
    # refused before any work: the engine holds nothing, and answers the next request the same way
    assert lse_status(refused)["engine"] | {"steps": 0, "cpu_fallback": None} == {
        "steps": 0, "running": 0, "waiting": 0, "paused": 0, "slots": 2, "free_slots": 2, "cpu_fallback": None}
    assert last_event(refused, {"input": QUESTION, "max_output_tokens": 2}, "responses").status == 500
