"""/v1/messages and /v1/messages/count_tokens end to end: a real lse-server driven by the official
anthropic SDK (messages.create, messages.stream, tool_use round trips, thinking, count_tokens; it
authenticates with x-api-key) and by raw HTTP for bad input, answered in Anthropic's error shape.

Expected values come from the core's own endpoint on the same server (/v1/chat/completions and /tokenize
for the same conversation) and from the scripted checkpoints of test_tool_calls.py and test_thinking_e2e.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from test_responses import SMALL_SCHEMA, chat, prompt_tokens, scripted_server
from test_server import API_KEY, CHAT_TEMPLATE, HELLO, Server, lse_server, validate
from test_tool_calls import CALL, TOOLS

ANTHROPIC_TOOLS = [{"name": f["name"], "description": f["description"], "input_schema": f["parameters"]}
                   for f in (t["function"] for t in TOOLS)]
KV_LEN = 128
GREEDY = {"temperature": 0}   # Anthropic's earlier API field; the SDK no longer names it


def sdk(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def server(tiny_checkpoint) -> Iterator[Server]:
    model = tiny_checkpoint("qwen3", chat_template=CHAT_TEMPLATE)
    with lse_server(model, "--kv-len", str(KV_LEN), "--parallel", "2", "--pool", "cpu:0") as s:
        yield s


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def model_id(http: httpx.Client) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


def test_create_gives_the_chat_reply(server: Server, http: httpx.Client, model_id: str) -> None:
    expected = chat(http, HELLO, max_tokens=6)
    message = sdk(server).messages.create(model=model_id, max_tokens=6, messages=HELLO, extra_body=GREEDY)
    assert (message.type, message.role, message.model) == ("message", "assistant", model_id)
    [block] = message.content
    assert block.type == "text" and block.text == expected["choices"][0]["message"]["content"]
    lse_stop = expected["choices"][0]["stop_reason"]
    assert message.stop_reason == {"max_tokens": "max_tokens", "stop_token": "end_turn"}[lse_stop]
    assert message.model_extra["lse_stop_reason"] == lse_stop and message.stop_sequence is None
    usage = expected["usage"]
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == usage["prompt_tokens"]
    assert message.usage.output_tokens == usage["completion_tokens"]
    assert message.model_extra["lse_context"]["tokens_used"] == usage["total_tokens"]


def sse_types(response: httpx.Response) -> list[str]:
    """The event names of a typed stream, each checked against its data's type."""
    lines = [line for line in response.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines[::2]]
    assert [json.loads(line.removeprefix("data: "))["type"] for line in lines[1::2]] == names
    return names


def test_stream(server: Server, http: httpx.Client, model_id: str) -> None:
    client = sdk(server)
    fields = {"model": model_id, "max_tokens": 8, "messages": HELLO, "extra_body": GREEDY}
    whole = client.messages.create(**fields)
    with client.messages.stream(**fields) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    body = {"model": model_id, "max_tokens": 8, "messages": HELLO, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/messages", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = sse_types(response)
    assert raw[:3] == ["message_start", "ping", "content_block_start"]    # the SDK does not surface ping
    assert [k for k in raw if k != "ping"] == [k for k in kinds if k != "text"]
    assert final.content[0].text == whole.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    with client.messages.stream(**fields) as stream:
        assert "".join(stream.text_stream) == whole.content[0].text


def test_system_and_blocks(server: Server, http: httpx.Client, model_id: str) -> None:
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello!"}, HELLO[0]]
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                {"role": "assistant", "content": "Hello!"}, HELLO[0]]
    client = sdk(server)
    for system in ("Be brief.", [{"type": "text", "text": "Be brief."}]):
        message = client.messages.create(model=model_id, max_tokens=3, system=system, messages=messages,
                                         extra_body=GREEDY)
        expected = chat(http, conversation, max_tokens=3)
        assert message.content[0].text == expected["choices"][0]["message"]["content"]
        counted = client.messages.count_tokens(model=model_id, system=system, messages=messages)
        assert counted.input_tokens == expected["usage"]["prompt_tokens"] == prompt_tokens(http, conversation)


def test_stop_sequences(server: Server, http: httpx.Client, model_id: str) -> None:
    text = chat(http, HELLO, max_tokens=12)["choices"][0]["message"]["content"]
    stop = text[4:6]
    expected = chat(http, HELLO, max_tokens=12, stop=[stop])
    assert expected["choices"][0]["stop_reason"] == "stop_sequence"
    message = sdk(server).messages.create(model=model_id, max_tokens=12, messages=HELLO, extra_body=GREEDY,
                                          stop_sequences=[stop])
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    assert message.content[0].text == expected["choices"][0]["message"]["content"]
    # among several, the one that matched is named, whole and streamed
    several = ["\u2603never", stop, "\u2604never"]
    message = sdk(server).messages.create(model=model_id, max_tokens=12, messages=HELLO, extra_body=GREEDY,
                                          stop_sequences=several)
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    with sdk(server).messages.stream(model=model_id, max_tokens=12, messages=HELLO, extra_body=GREEDY,
                                     stop_sequences=several) as stream:
        streamed = stream.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", stop)


def test_reply_that_fills_the_context(server: Server, http: httpx.Client, model_id: str) -> None:
    long = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 8}]
    expected = chat(http, long, max_tokens=1000)
    assert expected["choices"][0]["stop_reason"] == "context_full"
    message = sdk(server).messages.create(model=model_id, max_tokens=1000, messages=long, extra_body=GREEDY)
    assert message.stop_reason == "model_context_window_exceeded"
    assert message.model_extra["lse_context"] == {"tokens_used": KV_LEN, "context_length": KV_LEN,
                                                  "tokens_remaining": 0}


def anthropic_error(response: httpx.Response, status: int, kind: str, code: str, param: str | None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body) == {"type", "error"}, body
    error = body["error"]
    assert (error["type"], error["code"], error["param"]) == (kind, code, param), error
    assert error["message"]
    return error


@pytest.mark.parametrize("body, code, param", [
    ({"messages": HELLO}, "missing_field", "max_tokens"),
    ({"max_tokens": 0, "messages": HELLO}, "invalid_value", "max_tokens"),
    ({"max_tokens": 4}, "missing_field", "messages"),
    ({"max_tokens": 4, "messages": []}, "invalid_value", "messages"),
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "Hi"}]}, "invalid_value", "messages[0].role"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "invalid_value", "messages[0].content[0]"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
     "missing_field", "messages[0].content[0].tool_use_id"),
    ({"max_tokens": 4, "messages": HELLO, "temperature": "warm"}, "invalid_type", "temperature"),
    ({"max_tokens": 4, "messages": HELLO, "top_p": 3}, "invalid_value", "top_p"),     # the core's range check
    ({"max_tokens": 4, "messages": HELLO, "stop_sequences": ["a", ""]}, "invalid_value", "stop_sequences[1]"),
    ({"max_tokens": 4, "messages": HELLO, "thinking": {"type": "sometimes"}}, "invalid_value", "thinking.type"),
    ({"max_tokens": 4, "messages": HELLO, "tools": [{"name": "f"}]}, "missing_field", "tools[0].input_schema"),
])
def test_bad_input_is_an_anthropic_error(http: httpx.Client, model_id: str, body: dict, code: str, param: str) -> None:
    error = anthropic_error(http.post("/v1/messages", json={"model": model_id} | body), 400, "invalid_request_error",
                            code, param)
    assert "levels" not in error


def test_prompt_that_fills_the_context(http: httpx.Client, model_id: str) -> None:
    long = [{"role": "user", "content": "word " * 200}]
    error = anthropic_error(http.post("/v1/messages", json={"model": model_id, "max_tokens": 4, "messages": long}),
                            400, "invalid_request_error", "context_full", "messages")
    assert error["lse_context"]["context_length"] == KV_LEN


def test_errors_of_the_server_are_anthropic_shaped(server: Server, http: httpx.Client, model_id: str) -> None:
    anthropic_error(http.post("/v1/messages", json={"model": "claude-x", "max_tokens": 4, "messages": HELLO}), 404,
                    "not_found_error", "model_not_found", "model")
    anthropic_error(http.post("/v1/messages", content=b"{nope", headers={"content-type": "application/json"}), 400,
                    "invalid_request_error", "invalid_json", None)
    anthropic_error(http.get("/v1/messages"), 405, "api_error", "method_not_allowed", None)
    anthropic_error(http.post("/v1/messages/count_tokens", json={"model": model_id}), 400, "invalid_request_error",
                    "missing_field", "messages")
    for headers in ({}, {"x-api-key": "wrong"}):
        anthropic_error(httpx.post(f"{server.url}/v1/messages", headers=headers, json={}), 401,
                        "authentication_error", "invalid_api_key", None)
    with pytest.raises(anthropic.BadRequestError) as caught:
        sdk(server).messages.create(model=model_id, max_tokens=4, messages=[{"role": "user", "content": "word " * 200}])
    assert caught.value.body["error"]["code"] == "context_full"


def test_openapi_describes_the_replies(server: Server, http: httpx.Client, model_id: str) -> None:
    doc = http.get("/openapi.json").json()
    body = {"model": model_id, "max_tokens": 4, "messages": HELLO, "system": "Be brief.", "temperature": 0}
    validate(body, "MessagesRequest", doc)
    validate(http.post("/v1/messages", json=body).json(), "Message", doc)
    with http.stream("POST", "/v1/messages", json=body | {"stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                validate(json.loads(line[len("data: "):]), "MessageStreamEvent", doc)
    validate(http.post("/v1/messages/count_tokens", json={"model": model_id, "messages": HELLO}).json(),
             "TokenCount", doc)
    validate(http.post("/v1/messages", json={"model": model_id}).json(), "AnthropicError", doc)
    assert doc["paths"]["/v1/messages"]["post"]["responses"]["400"]["content"]["application/json"]["schema"] == \
        {"$ref": "#/components/schemas/AnthropicError"}


def test_models_in_anthropics_shape(server: Server, http: httpx.Client, model_id: str) -> None:
    [model] = sdk(server).models.list().data
    assert (model.type, model.id, model.display_name) == ("model", model_id, model_id)
    assert model.created_at.year >= 2024 and model.model_extra["context_length"] == KV_LEN
    assert sdk(server).models.retrieve(model_id).id == model_id
    assert http.get("/v1/models").json()["object"] == "list"    # OpenAI's shape without anthropic-version


def test_output_config_format(server: Server, http: httpx.Client, model_id: str) -> None:
    message = sdk(server).messages.create(model=model_id, max_tokens=60, messages=HELLO, extra_body=GREEDY,
                                          thinking={"type": "disabled"},
                                          output_config={"format": {"type": "json_schema", "schema": SMALL_SCHEMA}})
    expected = chat(http, HELLO, max_tokens=60, reasoning_effort="none", response_format={
        "type": "json_schema", "json_schema": {"name": "output", "schema": SMALL_SCHEMA}})
    assert message.content[0].text == expected["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(message.content[0].text), SMALL_SCHEMA)
    assert message.stop_reason == "end_turn"


def test_the_server_still_serves_after_bad_input(server: Server, model_id: str) -> None:
    message = sdk(server).messages.create(model=model_id, max_tokens=2, messages=HELLO)
    assert message.usage.output_tokens >= 1


# ---- tool use ----

@pytest.fixture(scope="module")
def tool_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, dict[str, Any], str]]:
    with scripted_server("tools", tmp_path_factory) as (server, script):
        yield server, script, script["model"].name


def test_tool_use_round_trip(tool_server: tuple[Server, dict[str, Any], str]) -> None:
    server, script, model_id = tool_server
    client = sdk(server)
    fields = {"model": model_id, "tools": ANTHROPIC_TOOLS, "extra_body": GREEDY}
    message = client.messages.create(**fields, max_tokens=16, messages=script["messages"])
    [call] = message.content
    assert (call.type, call.name, call.input) == ("tool_use", CALL["name"], CALL["arguments"])
    assert message.stop_reason == "tool_use" and message.usage.output_tokens == script["completion_tokens"]

    follow_up = script["messages"] + [
        {"role": "assistant", "content": [block.model_dump() for block in message.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "22 degrees"}]}]
    reply = client.messages.create(**fields, max_tokens=3, messages=follow_up)
    conversation = script["messages"] + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "22 degrees"}]
    with server.client() as http:
        expected = prompt_tokens(http, conversation, tools=TOOLS)
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == expected
    assert client.messages.count_tokens(model=model_id, tools=ANTHROPIC_TOOLS, messages=follow_up).input_tokens \
        == expected


def test_tool_use_streamed(tool_server: tuple[Server, dict[str, Any], str]) -> None:
    server, script, model_id = tool_server
    with sdk(server).messages.stream(model=model_id, tools=ANTHROPIC_TOOLS, extra_body=GREEDY, max_tokens=16,
                                     messages=script["messages"]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert [(b.type, b.name) for b in starts] == [("tool_use", CALL["name"])]
    deltas = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert json.loads("".join(deltas)) == CALL["arguments"]
    assert final.stop_reason == "tool_use" and final.content[0].input == CALL["arguments"]


# ---- thinking ----

@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, dict[str, Any], str]]:
    with scripted_server("thinking", tmp_path_factory) as (server, script):
        yield server, script, script["model"].name


def test_thinking_blocks(thinking_server: tuple[Server, dict[str, Any], str]) -> None:
    server, script, model_id = thinking_server
    client = sdk(server)
    fields = {"model": model_id, "messages": script["messages"], "extra_body": GREEDY,
              "max_tokens": script["max_tokens"]}
    message = client.messages.create(**fields, thinking={"type": "enabled", "budget_tokens": 1024})
    thinking, text = message.content
    assert thinking.type == "thinking" and thinking.thinking.strip() == script["reasoning"].strip()
    assert text.type == "text" and text.text.strip() == script["content"].strip()
    with client.messages.stream(**fields, thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert "".join(e.delta.thinking for e in events
                   if e.type == "content_block_delta" and e.delta.type == "thinking_delta") == thinking.thinking
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[1].text == text.text
    off = client.messages.create(**fields, thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["text"]
    counted = [client.messages.count_tokens(model=model_id, messages=script["messages"], thinking=t).input_tokens
               for t in ({"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"})]
    assert counted == [message.usage.input_tokens + message.usage.cache_read_input_tokens,
                       off.usage.input_tokens + off.usage.cache_read_input_tokens]
    assert counted[1] > counted[0]    # Qwen3's template closes an empty block when thinking is off
