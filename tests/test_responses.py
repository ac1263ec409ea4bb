"""/v1/responses end to end: a real lse-server driven by the official openai SDK (responses.create, whole
and streamed, function tools, previous_response_id) and by raw HTTP for bad input.

Expected values come from the core's own endpoint on the same server: the Responses adapter must give
what /v1/chat/completions gives for the same conversation (greedy text, prompt tokens, stop reasons),
and, for tools and reasoning, the scripted checkpoints of test_tool_calls.py and test_thinking_e2e.py. Every
response object, stream event and compaction is also checked against the Open Responses OpenAPI document
(../shared/spec/openresponses/openapi.json beside the repository, read where it is)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from referencing import Registry
from referencing.jsonschema import DRAFT202012
from test_server import CHAT_TEMPLATE, HELLO, HRX, Server, lse_server, typed_sse_events, validate
from test_thinking_e2e import QWEN3, scripted_thinking, thinking_checkpoint
from test_tool_calls import CALL, TOOLS, scripted, tool_checkpoint

from lse_core.adapters.common import CoreDelta
from lse_core.adapters.responses import COMPACT_INSTRUCTION, ResponseStore, start

QUESTION = HELLO[0]["content"]
FUNCTION_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]   # Responses' flat function tool
MAX_TOKENS = 64   # the server's --max-tokens: the operator's cap
KV_LEN = 256      # room for a compaction's instruction after a conversation
OPEN_RESPONSES = Path(__file__).resolve().parents[2] / "shared" / "spec" / "openresponses" / "openapi.json"
STREAM_EVENT = "#/paths/~1responses/post/responses/200/content/text~1event-stream/schema"   # the events' union
# Open Responses' prose names a content part's events response.<part type>.delta and .done, which for a
# reasoning_text part are the names OpenAI and LSE send; its document names them response.reasoning.delta and
# .done, with the same fields. An event of one is checked against the document's schema of the other.
DOCUMENT_EVENT_TYPES = {"response.reasoning_text.delta": "response.reasoning.delta",
                        "response.reasoning_text.done": "response.reasoning.done"}


@cache
def open_responses() -> Registry:
    assert OPEN_RESPONSES.is_file(), f"the Open Responses document is read from {OPEN_RESPONSES}"
    document = DRAFT202012.create_resource(json.loads(OPEN_RESPONSES.read_text()))
    return Registry().with_resource("urn:openresponses", document)


def open_responses_validate(instance: Any, pointer: str) -> None:
    """Checks ``instance`` against the Open Responses document's schema at ``pointer`` ("#/components/...")."""
    jsonschema.Draft202012Validator({"$ref": f"urn:openresponses{pointer}"},
                                    registry=open_responses()).validate(instance)


def schema(name: str) -> str:
    return f"#/components/schemas/{name}"


def validate_stream(events: list[dict[str, Any]]) -> None:
    """Each event against the document's union of stream events, each response it carries as a response."""
    for event in events:
        open_responses_validate(event | {"type": DOCUMENT_EVENT_TYPES.get(event["type"], event["type"])},
                                STREAM_EVENT)
    assert [event["sequence_number"] for event in events] == list(range(len(events)))


def sse_stream(http: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A streamed response's events, each named by its type; the stream ends with data: [DONE], as Open Responses
    requires."""
    with http.stream("POST", "/v1/responses", json=body | {"stream": True}) as response:
        assert response.status_code == 200, response.read()
        *events, done = typed_sse_events(response)
    assert done == ("", "[DONE]") and all(name == data["type"] for name, data in events)
    return [data for _, data in events]


@pytest.fixture(scope="module")
def server(tiny_checkpoint) -> Iterator[Server]:
    model = tiny_checkpoint("qwen3", chat_template=CHAT_TEMPLATE)
    with lse_server(model, "--kv-len", str(KV_LEN), "--parallel", "2", "--pool", "cpu:0",
                    "--max-tokens", str(MAX_TOKENS)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return server.openai()


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


def chat(http: httpx.Client, messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    response = http.post("/v1/chat/completions", json={"messages": messages, "temperature": 0} | fields)
    assert response.status_code == 200, response.text
    return response.json()


def prompt_tokens(http: httpx.Client, messages: list[dict[str, Any]], **fields: Any) -> int:
    response = http.post("/tokenize", json={"messages": messages} | fields)
    assert response.status_code == 200, response.text
    return response.json()["count"]


def test_create_gives_the_chat_reply(client: openai.OpenAI, http: httpx.Client) -> None:
    expected = chat(http, HELLO, max_tokens=6)
    response = client.responses.create(input=QUESTION, max_output_tokens=6, temperature=0)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == expected["choices"][0]["message"]["content"]
    [message] = response.output
    assert (message.type, message.role, message.status) == ("message", "assistant", "completed")
    stop_reason = expected["choices"][0]["stop_reason"]
    assert response.model_extra["stop_reason"] == stop_reason
    assert response.status == ("incomplete" if stop_reason == "max_tokens" else "completed")
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
    usage = expected["usage"]
    assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == \
        (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"])
    assert response.model_extra["lse_context"] == expected["lse_context"] | {"tokens_used": usage["total_tokens"]}
    assert set(response.model_extra["timings"]) == set(expected["timings"])


def test_stream_events(client: openai.OpenAI) -> None:
    whole = client.responses.create(input=QUESTION, max_output_tokens=8, temperature=0)
    with client.responses.create(input=QUESTION, max_output_tokens=8, temperature=0, stream=True) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == whole.usage.output_tokens
    assert final.model_extra["stop_reason"] == whole.model_extra["stop_reason"]
    assert final.model_extra["lse_context"] == whole.model_extra["lse_context"]


def test_the_sdks_stream_helper(client: openai.OpenAI, http: httpx.Client) -> None:
    """responses.stream() folds the events into the final response (it needs response.completed: a stop
    string ends the reply here)."""
    text = chat(http, HELLO, max_tokens=12)["choices"][0]["message"]["content"]
    model = http.get("/v1/models").json()["data"][0]["id"]
    fields = {"model": model, "input": QUESTION, "max_output_tokens": 12, "temperature": 0,
              "extra_body": {"stop": [text[4:6]]}}
    whole = client.responses.create(**fields)
    assert whole.status == "completed" and whole.model_extra["stop_reason"] == "stop_sequence"
    with client.responses.stream(**fields) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.output_text == "".join(deltas) == whole.output_text == text[:text.index(text[4:6])]
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_instructions_and_message_items(client: openai.OpenAI, http: httpx.Client) -> None:
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                    {"role": "user", "content": QUESTION}]
    items = [conversation[0], {"type": "message", "role": "assistant",
                               "content": [{"type": "output_text", "text": "Hello!"}]},
             {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
    response = client.responses.create(input=items, instructions="Be brief.", max_output_tokens=3, temperature=0)
    expected = chat(http, [{"role": "system", "content": "Be brief."}] + conversation, max_tokens=3)
    assert response.usage.input_tokens == expected["usage"]["prompt_tokens"]
    assert response.output_text == expected["choices"][0]["message"]["content"]


def test_previous_response_id_continues_the_conversation(client: openai.OpenAI, http: httpx.Client) -> None:
    first = client.responses.create(input=QUESTION, instructions="Be brief.", max_output_tokens=4, temperature=0)
    second = client.responses.create(input="And of Germany?", previous_response_id=first.id, max_output_tokens=4,
                                     temperature=0)
    # instructions are not carried over, as OpenAI documents
    conversation = [HELLO[0], {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "And of Germany?"}]
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == prompt_tokens(http, conversation)
    assert second.output_text == chat(http, conversation, max_tokens=4)["choices"][0]["message"]["content"]
    third = client.responses.create(input="Thanks.", previous_response_id=second.id, max_output_tokens=1)
    longer = conversation + [{"role": "assistant", "content": second.output_text},
                             {"role": "user", "content": "Thanks."}]
    assert third.usage.input_tokens == prompt_tokens(http, longer)


def test_unknown_or_unstored_previous_response(client: openai.OpenAI) -> None:
    unstored = client.responses.create(input=QUESTION, max_output_tokens=1, store=False)
    for response_id in ("resp_nothing", unstored.id):
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(input="Again?", previous_response_id=response_id, max_output_tokens=1)
        error = caught.value.body
        assert (error["code"], error["param"]) == ("previous_response_not_found", "previous_response_id")
        assert response_id in error["message"]


def test_store_evicts_the_oldest() -> None:
    store = ResponseStore(size=2)
    for n in range(3):
        store.put(f"resp_{n}", [{"role": "user", "content": str(n)}], {"id": f"resp_{n}"})
    assert store.conversation("resp_2") == [{"role": "user", "content": "2"}]
    assert store.response("resp_1") == {"id": "resp_1"}
    with pytest.raises(Exception, match="older than the last 2 responses") as caught:
        store.conversation("resp_0")
    assert caught.value.body()["error"]["code"] == "previous_response_not_found"


def test_metrics_count_responses_under_their_own_api(client: openai.OpenAI, http: httpx.Client) -> None:
    def count(outcome: str) -> float:
        found = re.search(rf'^lse_requests_total{{endpoint="responses",outcome="{outcome}"}} (\S+)$',
                          http.get("/metrics").text, re.M)
        return float(found.group(1)) if found else 0.0

    ok, bad = count("max_tokens"), count("error_400")
    client.responses.create(input=QUESTION, max_output_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(input=QUESTION, max_output_tokens=1, temperature="hot")
    assert (count("max_tokens"), count("error_400")) == (ok + 1, bad + 1)


def test_retrieve_and_delete_a_stored_response(client: openai.OpenAI) -> None:
    made = client.responses.create(input=QUESTION, max_output_tokens=3)
    got = client.responses.retrieve(made.id)
    assert got.model_dump() == made.model_dump()
    client.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.retrieve(made.id)
    assert (caught.value.body["code"], caught.value.body["param"]) == ("response_not_found", "response_id")
    with pytest.raises(openai.BadRequestError):    # a deleted response no longer continues a conversation
        client.responses.create(input="Again?", previous_response_id=made.id, max_output_tokens=1)
    unstored = client.responses.create(input=QUESTION, max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_open_responses_object_and_events(http: httpx.Client) -> None:
    """The response object, whole and in every stream event, has each field the Open Responses document
    requires, of the types it gives; the settings are those the reply was made with."""
    entry = http.get("/v1/models").json()["data"][0]
    defaults = entry["generation_defaults"]
    body = {"input": QUESTION, "max_output_tokens": 4, "instructions": "Be brief.", "max_tool_calls": 2,
            "safety_identifier": "user-1", "prompt_cache_key": "greeting", "service_tier": "auto",
            "metadata": {"topic": "capitals"}}
    whole = http.post("/v1/responses", json=body).json()
    open_responses_validate(whole, schema("ResponseResource"))
    assert (whole["temperature"], whole["top_p"]) == (defaults["temperature"], defaults["top_p"])
    assert (whole["presence_penalty"], whole["frequency_penalty"]) == (defaults["presence_penalty"], 0.0)
    assert (whole["background"], whole["service_tier"], whole["top_logprobs"]) == (False, "default", 0)
    assert (whole["max_tool_calls"], whole["safety_identifier"], whole["prompt_cache_key"]) == (2, "user-1",
                                                                                                   "greeting")
    events = sse_stream(http, body | {"temperature": 0, "top_p": 0.5, "presence_penalty": 0.25,
                                      "frequency_penalty": 0.5})
    validate_stream(events)
    created, final = events[0]["response"], events[-1]["response"]
    assert created["status"] == "in_progress" and created["completed_at"] is None and created["usage"] is None
    for response in (created, final):
        assert (response["temperature"], response["top_p"], response["presence_penalty"],
                response["frequency_penalty"]) == (0.0, 0.5, 0.25, 0.5)
    completed = http.post("/v1/responses", json=body | {"max_output_tokens": MAX_TOKENS, "stop": ["a", "e", "o"]})
    completed = completed.json()
    assert completed["status"] == "completed" and completed["created_at"] <= completed["completed_at"]
    open_responses_validate(completed, schema("ResponseResource"))


def test_a_failed_stream_ends_with_response_failed(tiny_checkpoint) -> None:
    """A streamed request that fails (CPU fallback refused) sends its error event, then response.failed with the
    response failed and the error, then [DONE], each event valid against Open Responses; the SDK raises the error."""
    model = tiny_checkpoint("qwen3", chat_template=CHAT_TEMPLATE)
    options = ("--kv-len", str(KV_LEN), "--pool", "hrx:0", "--no-cpu-fallback")
    with lse_server(model, *options, env=HRX) as server, server.client() as http:
        error, failed = sse_stream(http, {"input": QUESTION, "max_output_tokens": 3})
        validate_stream([error, failed])
        assert error["type"] == "error" and error["message"].startswith("CPU fallback disabled: ")
        assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
        assert failed["response"]["error"] == error["error"] | {"code": "server_error"}   # Open Responses: a code
        validate(failed, "ResponseStreamEvent", http.get("/openapi.json").json())
        with pytest.raises(openai.APIError, match="^CPU fallback disabled: "):
            list(server.openai().responses.create(input=QUESTION, max_output_tokens=3, stream=True))


def test_operator_cap_names_max_tokens(http: httpx.Client) -> None:
    """The spec: a request above lse-server --max-tokens gets 400 with param max_tokens, whatever the API."""
    response = http.post("/v1/responses", json={"input": QUESTION, "max_output_tokens": MAX_TOKENS + 1})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_value", "max_tokens") and str(MAX_TOKENS) in error["message"]
    assert http.post("/v1/responses", json={"input": QUESTION, "max_output_tokens": MAX_TOKENS}).status_code == 200


@pytest.mark.parametrize("body, code, param", [
    ({}, "missing_field", "input"),
    ({"input": 3}, "invalid_type", "input"),
    ({"input": [{"role": "user", "content": 3}]}, "invalid_type", "input[0].content"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "invalid_value", "input[0].role"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "missing_field", "input[0].call_id"),
    ({"input": [{"type": "image", "url": "x"}]}, "invalid_value", "input[0]"),
    ({"input": "Hi", "max_output_tokens": 0}, "invalid_value", "max_output_tokens"),
    ({"input": "Hi", "temperature": "hot"}, "invalid_type", "temperature"),
    ({"input": "Hi", "top_p": 2}, "invalid_value", "top_p"),                       # the core's range check
    ({"input": "Hi", "reasoning": {"effort": "high"}}, "unsupported_reasoning_effort", "reasoning.effort"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "invalid_value", "tools[0].type"),
    ({"input": "word " * 200}, "context_full", "input"),
    ({"input": "Hi", "model": "gpt-5"}, "model_not_found", "model"),
    ({"input": "Hi", "background": True}, "invalid_value", "background"),
    ({"input": "Hi", "top_logprobs": 3}, "invalid_value", "top_logprobs"),
    ({"input": "Hi", "top_logprobs": 21}, "invalid_value", "top_logprobs"),
    ({"input": "Hi", "service_tier": "fastest"}, "invalid_value", "service_tier"),
    ({"input": "Hi", "max_tool_calls": 0}, "invalid_value", "max_tool_calls"),
    ({"input": "Hi", "presence_penalty": "high"}, "invalid_type", "presence_penalty"),
    ({"input": [{"type": "compaction"}]}, "missing_field", "input[0].encrypted_content"),
])
def test_bad_input_is_an_openai_error(http: httpx.Client, body: dict, code: str, param: str) -> None:
    response = http.post("/v1/responses", json=body)
    assert response.status_code in (400, 404), response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == (code, param), error
    assert error["type"] == "invalid_request_error" and error["message"]
    if code == "context_full":
        assert error["lse_context"]["context_length"] == KV_LEN


def test_openapi_describes_the_replies(http: httpx.Client) -> None:
    doc = http.get("/openapi.json").json()
    body = {"input": [{"role": "user", "content": QUESTION}], "instructions": "Be brief.", "max_output_tokens": 3,
            "tools": FUNCTION_TOOLS, "reasoning": {"effort": "none"}}
    validate(body, "ResponsesRequest", doc)
    validate(http.post("/v1/responses", json=body).json(), "Response", doc)
    events = sse_stream(http, body)
    for event in events:
        validate(event, "ResponseStreamEvent", doc)
    validate(events[-1]["response"], "Response", doc)
    validate(http.post("/v1/responses", json={}).json(), "Error", doc)


SMALL_SCHEMA = {"type": "object", "required": ["city", "sunny"], "additionalProperties": False,
                "properties": {"city": {"type": "string", "maxLength": 8}, "sunny": {"type": "boolean"}}}


def test_text_format_json_schema(client: openai.OpenAI, http: httpx.Client) -> None:
    """text.format is the chat's response_format: the same constrained reply, valid against the schema
    (thinking off: the grammar would let the reply reason first)."""
    response = client.responses.create(input=QUESTION, max_output_tokens=60, temperature=0,
                                       reasoning={"effort": "none"}, text={"format": {
                                           "type": "json_schema", "name": "weather", "schema": SMALL_SCHEMA,
                                           "strict": True}})
    expected = chat(http, HELLO, max_tokens=60, reasoning_effort="none", response_format={
        "type": "json_schema", "json_schema": {"name": "weather", "schema": SMALL_SCHEMA, "strict": True}})
    assert response.output_text == expected["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(response.output_text), SMALL_SCHEMA)
    assert response.text.format.type == "json_schema" and response.status == "completed"


# ---- compaction ----

def test_compact_summarises_the_conversation(client: openai.OpenAI, http: httpx.Client) -> None:
    """/v1/responses/compact: the model's answer to the compaction instruction after the conversation is the
    compaction item, after the conversation's user messages; the next turn reads it as the model's own turn."""
    first = client.responses.create(input=QUESTION, max_output_tokens=4, temperature=0)
    model = http.get("/v1/models").json()["data"][0]["id"]
    raw = client.responses.with_raw_response.compact(model=model, previous_response_id=first.id,
                                                     input="And of Germany?", extra_body={"top_k": 1})   # greedy
    compacted, compacted_json = raw.parse(), json.loads(raw.text)
    open_responses_validate(compacted_json, schema("CompactResource"))
    validate(compacted_json, "Compaction", http.get("/openapi.json").json())
    conversation = [HELLO[0], {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "And of Germany?"}]
    expected = chat(http, conversation + [{"role": "user", "content": COMPACT_INSTRUCTION}], top_k=1)
    *kept, summary = compacted.output
    assert [(m.type, m.role, m.content[0].text) for m in kept] == [
        ("message", "user", QUESTION), ("message", "user", "And of Germany?")]
    assert summary.type == "compaction" and summary.id.startswith("cmp_")
    assert summary.encrypted_content == expected["choices"][0]["message"]["content"].strip()
    assert compacted.usage.input_tokens == expected["usage"]["prompt_tokens"]
    assert compacted.model_extra["stop_reason"] == expected["choices"][0]["stop_reason"]

    follow_up = client.responses.create(input=compacted_json["output"] + [{"role": "user", "content": "Thanks."}],
                                        max_output_tokens=1)
    assert follow_up.usage.input_tokens == prompt_tokens(http, [
        HELLO[0], {"role": "user", "content": "And of Germany?"},
        {"role": "assistant", "content": summary.encrypted_content}, {"role": "user", "content": "Thanks."}])


@pytest.mark.parametrize("body, code, param", [
    ({}, "missing_field", "input"),
    ({"input": []}, "missing_field", "input"),
    ({"input": "Hi", "stream": True}, "invalid_value", "stream"),
    ({"previous_response_id": "resp_nothing"}, "previous_response_not_found", "previous_response_id"),
    ({"input": [{"role": "user", "content": 3}]}, "invalid_type", "input[0].content"),
])
def test_compact_bad_input(http: httpx.Client, body: dict, code: str, param: str) -> None:
    response = http.post("/v1/responses/compact", json=body)
    assert response.status_code == 400, response.text
    assert (response.json()["error"]["code"], response.json()["error"]["param"]) == (code, param)


def test_the_server_still_serves_after_bad_input(client: openai.OpenAI) -> None:
    assert client.responses.create(input="Hi", max_output_tokens=2).usage.output_tokens >= 1


def test_api_key_is_required(server: Server) -> None:
    response = httpx.post(f"{server.url}/v1/responses", json={"input": "Hi"})
    assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"


# ---- function tools ----

@contextmanager
def scripted_server(kind: str, directories: pytest.TempPathFactory) -> Iterator[tuple[Server, dict[str, Any]]]:
    """A server on test_tool_calls.py's checkpoint scripted into a call ("tools"), or test_thinking_e2e.py's
    scripted into reasoning then content ("thinking"), with that script (its model's id is the directory's
    name)."""
    if kind == "tools":
        base = tool_checkpoint(directories.mktemp("tools"), special_markers=False)
        script, kv_len = scripted(base, directories.mktemp("scripted"), range(1)), 256
    else:
        qwen3 = thinking_checkpoint(directories.mktemp("qwen3_thinking"), QWEN3)
        script, kv_len = scripted_thinking(qwen3, directories.mktemp("scripted")), 96
    with lse_server(script["model"], "--kv-len", str(kv_len), "--pool", "cpu:0") as s:
        yield s, script


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, dict[str, Any]]]:
    with scripted_server("tools", tmp_path_factory) as served:
        yield served


def test_function_tool_round_trip(tool_server: tuple[Server, dict[str, Any]]) -> None:
    server, script = tool_server
    client = server.openai()
    question = script["messages"][0]["content"]
    response = client.responses.create(input=question, tools=FUNCTION_TOOLS, temperature=0, max_output_tokens=16)
    [call] = response.output
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", CALL["name"], CALL["arguments"])
    assert response.status == "completed" and response.model_extra["stop_reason"] == "stop_token"
    assert response.usage.output_tokens == script["completion_tokens"]

    result = {"type": "function_call_output", "call_id": call.call_id, "output": "22 degrees"}
    follow_up = client.responses.create(input=[{"role": "user", "content": question}, call.model_dump(), result],
                                        tools=FUNCTION_TOOLS, temperature=0, max_output_tokens=3)
    conversation = [{"role": "user", "content": question},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"id": call.call_id, "type": "function",
                         "function": {"name": call.name, "arguments": call.arguments}}]},
                    {"role": "tool", "tool_call_id": call.call_id, "content": "22 degrees"}]
    with server.client() as http:
        assert follow_up.usage.input_tokens == prompt_tokens(http, conversation, tools=TOOLS)
    stored = client.responses.create(input=[result], previous_response_id=response.id, tools=FUNCTION_TOOLS,
                                     temperature=0, max_output_tokens=3)
    assert stored.usage.input_tokens == follow_up.usage.input_tokens
    assert stored.output_text == follow_up.output_text


def test_function_call_streamed(tool_server: tuple[Server, dict[str, Any]]) -> None:
    server, script = tool_server
    with server.openai().responses.create(input=script["messages"][0]["content"], tools=FUNCTION_TOOLS,
                                          temperature=0, max_output_tokens=16, stream=True) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    assert json.loads(events[3].delta) == CALL["arguments"] and events[4].name == CALL["name"]
    assert events[5].item.status == "completed" and events[-1].response.output[0].call_id == events[5].item.call_id
    validate_stream([event.model_dump(mode="json", exclude_unset=True) for event in events])
    open_responses_validate(events[-1].response.model_dump(mode="json", exclude_unset=True),
                            schema("ResponseResource"))


def test_max_tool_calls_leaves_out_later_calls() -> None:
    """The adapter alone (no model makes two calls on cue): a reply's calls past max_tool_calls are left out."""
    calls = [{"id": f"call_{n}", "type": "function", "function": {"name": CALL["name"], "arguments": "{}"}}
             for n in range(3)]
    for limit, kept in ((None, 3), (2, 2), (1, 1)):
        _, translation = start({"input": QUESTION, "tools": FUNCTION_TOOLS, "max_tool_calls": limit},
                               ResponseStore(), "model")
        translation.feed(CoreDelta(tool_calls=calls))
        assert [item["call_id"] for item in translation.output] == [call["id"] for call in calls[:kept]]


# ---- reasoning ----

@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, dict[str, Any]]]:
    with scripted_server("thinking", tmp_path_factory) as served:
        yield served


def test_reasoning_is_a_reasoning_item(thinking_server: tuple[Server, dict[str, Any]]) -> None:
    server, script = thinking_server
    fields = {"input": script["messages"][0]["content"], "temperature": 0, "max_output_tokens": script["max_tokens"]}
    client = server.openai()
    response = client.responses.create(**fields)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text.strip() == script["reasoning"].strip()
    assert message.type == "message" and response.output_text.strip() == script["content"].strip()
    assert 0 < response.usage.output_tokens_details.reasoning_tokens < response.usage.output_tokens
    with client.responses.create(**fields, stream=True) as stream:
        events = list(stream)
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning.content[0].text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == response.output_text
    validate_stream([event.model_dump(mode="json", exclude_unset=True) for event in events])
    off = client.responses.create(**fields, reasoning={"effort": "none"})
    assert [item.type for item in off.output] == ["message"]
    assert off.usage.input_tokens > response.usage.input_tokens    # the template closed an empty block
