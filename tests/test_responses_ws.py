"""The Responses API's WebSocket mode end to end: a real lse-server driven by the openai SDK's
client.responses.connect() (a websockets connection to /v1/responses), streaming a reply and chaining a second
turn with previous_response_id on the same connection, against the same requests over HTTP; a refused message is
an error message and the connection goes on; the handshake needs the API key, a served Host, and a page of the
server's own origin (or --cors-origins'), as browsers let any page open a WebSocket.

Every message is checked against the Open Responses document: stream events as its streaming events, errors as
its WebSocketErrorEvent."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import websockets.sync.client
from test_responses import QUESTION, open_responses_validate, schema, validate_stream
from test_server import API_KEY, CHAT_TEMPLATE, Server, lse_server
from websockets.exceptions import InvalidStatus

ALLOWED_ORIGIN = "http://notebook.example"   # --cors-origins
ENDINGS = ("response.completed", "response.incomplete", "error")


@pytest.fixture(scope="module")
def server(tiny_checkpoint) -> Iterator[Server]:
    model = tiny_checkpoint("qwen3", chat_template=CHAT_TEMPLATE)
    with lse_server(model, "--kv-len", "128", "--pool", "cpu:0", "--cors-origins", ALLOWED_ORIGIN) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return server.openai()


def received(connection: Any) -> list[dict[str, Any]]:
    """The messages of one response, as JSON, up to its last event (or an error)."""
    messages = [json.loads(connection.recv_bytes())]
    while messages[-1]["type"] not in ENDINGS:
        messages.append(json.loads(connection.recv_bytes()))
    return messages


def test_stream_and_chain_a_second_turn(client: openai.OpenAI) -> None:
    """Two turns on one connection give what the same two requests give over HTTP, in the events SSE carries;
    the openai SDK reads them as its typed events."""
    fields = {"max_output_tokens": 6, "temperature": 0}
    first_http = client.responses.create(input=QUESTION, **fields)
    second_http = client.responses.create(input="And of Germany?", previous_response_id=first_http.id, **fields)
    with client.responses.connect() as connection:
        connection.response.create(input=QUESTION, **fields)
        first = received(connection)
        validate_stream(first)
        typed = [connection.parse_event(json.dumps(message)) for message in first]
        assert [event.type for event in typed] == [message["type"] for message in first]
        text = "".join(e["delta"] for e in first if e["type"] == "response.output_text.delta")
        assert text == first_http.output_text and first[-1]["response"]["status"] == first_http.status
        first_id = first[-1]["response"]["id"]

        connection.response.create(input="And of Germany?", previous_response_id=first_id, **fields)
        second = received(connection)
        validate_stream(second)
        final = second[-1]["response"]
        assert final["previous_response_id"] == first_id
        assert final["usage"]["input_tokens"] == second_http.usage.input_tokens
        assert "".join(e["delta"] for e in second if e["type"] == "response.output_text.delta") == \
            second_http.output_text
    assert client.responses.retrieve(final["id"]).output_text == second_http.output_text   # stored, as over HTTP


@pytest.mark.parametrize("message, status, code, param", [
    ("not json", 400, "invalid_json", None),
    ('["response.create"]', 400, "invalid_type", None),
    ('{"type": "response.cancel"}', 400, "invalid_value", "type"),
    ('{"type": "response.create", "input": "Hi", "stream": true}', 400, "invalid_value", "stream"),
    ('{"type": "response.create", "input": "Hi", "background": false}', 400, "invalid_value", "background"),
    ('{"type": "response.create", "input": "Hi", "generate": false}', 400, "invalid_value", "generate"),
    ('{"type": "response.create", "input": 3}', 400, "invalid_type", "input"),
    ('{"type": "response.create", "input": "Hi", "previous_response_id": "resp_gone"}', 400,
     "previous_response_not_found", "previous_response_id"),
    ('{"type": "response.create", "input": "Hi", "model": "gpt-5"}', 404, "model_not_found", "model"),
    ('{"type": "response.create", "input": "' + "word " * 200 + '"}', 400, "context_full", "input"),
])
def test_a_refused_message_is_an_error_message(client: openai.OpenAI, message: str, status: int, code: str,
                                               param: str | None) -> None:
    """The error carries the status HTTP would give; the connection stays open for the next message."""
    with client.responses.connect() as connection:
        connection.send_raw(message)
        [error] = received(connection)
        open_responses_validate(error, schema("WebSocketErrorEvent"))
        assert (error["status"], error["error"]["code"], error["error"]["param"]) == (status, code, param)
        assert error["error"]["message"]
        connection.response.create(input=QUESTION, max_output_tokens=1)
        assert received(connection)[-1]["type"] in ENDINGS[:2]


def handshake_status(server: Server, **headers: str) -> int | None:
    """The HTTP status that refuses a WebSocket handshake to /v1/responses, or None when it is accepted."""
    url = server.url.replace("http://", "ws://") + "/v1/responses"
    try:
        with websockets.sync.client.connect(url, additional_headers=headers, open_timeout=30):
            return None
    except InvalidStatus as e:
        assert e.response.headers["content-type"] == "application/json"
        assert json.loads(e.response.body)["error"]["message"]
        return e.response.status_code


def test_handshake_checks(server: Server) -> None:
    key = {"Authorization": f"Bearer {API_KEY}"}
    assert handshake_status(server) == 401
    assert handshake_status(server, Authorization="Bearer wrong") == 401
    assert handshake_status(server, **key) is None
    assert handshake_status(server, **key, Origin="http://evil.example") == 403
    assert handshake_status(server, **key, Origin=ALLOWED_ORIGIN) is None
    host = server.url.removeprefix("http://")
    assert handshake_status(server, **key, Origin=f"http://{host}") is None   # the server's own page
    assert "Traceback" not in server.log()
