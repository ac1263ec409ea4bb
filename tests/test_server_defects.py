"""lse-server's small defects of issue 49, each against a real server: loading a model named by its path answers,
the Authorization scheme is case-insensitive, a client that disconnects is an info line (no traceback), and a
connection that sends no request is closed (--header-timeout, --timeout-keep-alive)."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets.sync.client
from test_responses_ws import ENDINGS
from test_server import API_KEY, CHAT_TEMPLATE, HELLO, Server, free_port, lse_server, server_command
from websockets.exceptions import ConnectionClosedOK

IDLE_S = 1   # --header-timeout and --timeout-keep-alive of the module's server
WEBSOCKET_IDLE_S = 3   # its --websocket-idle-timeout: past IDLE_S, so a WebSocket in use outlives the header timeout
PATIENCE_S = 60   # how long a test waits for what it expects, on a loaded machine


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> Path:
    return tiny_checkpoint("qwen3", chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Iterator[Server]:
    with lse_server(checkpoint, "--kv-len", "128", "--pool", "cpu:0", "--log-level", "info",
                    "--header-timeout", str(IDLE_S), "--timeout-keep-alive", str(IDLE_S),
                    "--websocket-idle-timeout", str(WEBSOCKET_IDLE_S)) as s:
        yield s


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with server.client() as client:
        yield client


def connect(server: Server) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    connection = socket.create_connection((host, int(port)))
    connection.settimeout(PATIENCE_S)
    return connection


def post_head(path: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode()


def closed_by_server(connection: socket.socket) -> bool:
    """Whether the server closes the connection (the read ends) before PATIENCE_S, reading what it sends."""
    try:
        while connection.recv(65536):
            pass
    except TimeoutError:
        return False
    return True


def wait_until(done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while not done() and time.monotonic() < deadline:
        time.sleep(0.1)


def test_loading_a_model_named_by_its_path_answers(http: httpx.Client, checkpoint: Path) -> None:
    model_id = http.get("/v1/models").json()["data"][0]["id"]
    unloaded = http.post(f"/v1/lse/models/{checkpoint}/unload", json={})
    assert unloaded.status_code == 200 and (unloaded.json()["id"], unloaded.json()["state"]) == (model_id, "unloaded")
    loaded = http.post(f"/v1/lse/models/{checkpoint}/load", json={})
    assert loaded.status_code == 200 and (loaded.json()["id"], loaded.json()["state"]) == (model_id, "loaded")
    assert http.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("header, status", [
    (f"Bearer {API_KEY}", 200), (f"bearer {API_KEY}", 200), (f"BEARER   {API_KEY}", 200), (f"BeArEr {API_KEY}", 200),
    ("bearer wrong-key", 401), (f"Basic {API_KEY}", 401), (API_KEY, 401)])
def test_the_authorization_scheme_is_case_insensitive(server: Server, header: str, status: int) -> None:
    """RFC 7235: the scheme is a case-insensitive token, and spaces may follow it."""
    response = httpx.get(f"{server.url}/v1/models", headers={"Authorization": header}, timeout=PATIENCE_S)
    assert response.status_code == status, response.text
    if status == 401:
        assert response.json()["error"]["code"] == "invalid_api_key"


def test_a_client_that_disconnects_is_one_info_line(server: Server) -> None:
    """Closing mid-body, before a plain reply, and mid-stream: the log says so in one line at most, no traceback."""
    gone = "lse: the client of POST /v1/chat/completions closed the connection before its answer"
    body = {"messages": HELLO, "max_tokens": 100, "ignore_eos": True}
    with connect(server) as mid_body:          # the body never arrives whole
        mid_body.sendall(post_head("/v1/chat/completions", 1000) + b'{"messages"')
    for stream in (False, True):
        data = json.dumps({**body, "stream": stream}).encode()
        with connect(server) as client:
            client.sendall(post_head("/v1/chat/completions", len(data)) + data)
            if stream:
                assert client.recv(100).startswith(b"HTTP/1.1 200")   # the stream has begun
    wait_until(lambda: server.log().count(gone) == 2)   # the first two; the stream's end is no news
    status = f"{server.url}/v1/lse/status"
    wait_until(lambda: httpx.get(status, headers={"Authorization": f"Bearer {API_KEY}"}).json()["engine"]["running"]
               == 0)
    log = server.log()
    assert log.count(gone) == 2 and "Traceback" not in log and "ClientDisconnect" not in log, log


def test_a_connection_that_sends_nothing_is_closed(server: Server) -> None:
    with connect(server) as silent:
        assert closed_by_server(silent)


def test_a_request_sent_a_byte_at_a_time_is_cut_off(server: Server) -> None:
    """Slowloris: every byte restarts uvicorn's keep-alive timer, but not the time the headers may take."""
    head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Padding: " + b"x" * 200 + b"\r\n\r\n"
    with connect(server) as slow:
        assert sent_before_closed(slow, head) < len(head), "the server waited for every byte"


def sent_before_closed(connection: socket.socket, data: bytes) -> int:
    """Sends ``data`` a byte each 0.05 s; the bytes sent when the server closed the connection (all, if never)."""
    connection.settimeout(0.05)
    for sent in range(len(data)):
        try:
            connection.sendall(data[sent:sent + 1])
            if connection.recv(1) == b"":
                return sent
        except TimeoutError:
            continue
        except OSError:   # reset by the server
            return sent
    return len(data)


def test_an_idle_connection_between_requests_is_closed(server: Server) -> None:
    with connect(server) as client:
        client.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert client.recv(100).startswith(b"HTTP/1.1 200")
        assert closed_by_server(client)


@pytest.mark.parametrize("option", ["--header-timeout", "--timeout-keep-alive", "--websocket-idle-timeout"])
def test_the_timeouts_must_be_positive(option: str) -> None:
    done = subprocess.run(server_command("/no/such/model", free_port(), option, "0"), capture_output=True, text=True,
                          timeout=PATIENCE_S)
    assert done.returncode == 1 and done.stderr.strip() == f"lse-server: {option} must be more than 0 seconds, got 0.0"


def websocket(server: Server) -> websockets.sync.client.ClientConnection:
    """A Responses WebSocket to the server."""
    return websockets.sync.client.connect(server.url.replace("http://", "ws://") + "/v1/responses",
                                          additional_headers={"Authorization": f"Bearer {API_KEY}"},
                                          open_timeout=PATIENCE_S)


def respond(connection: websockets.sync.client.ClientConnection) -> dict[str, Any]:
    """Run a short response on the connection; its last message."""
    connection.send(json.dumps({"type": "response.create", "input": "Hi", "max_output_tokens": 2}))
    while (message := json.loads(connection.recv(timeout=PATIENCE_S)))["type"] not in ENDINGS:
        pass
    return message


def test_a_websocket_in_use_outlives_the_header_timeout(server: Server) -> None:
    """An upgraded connection is the WebSocket's: the header timeout (armed when it opened) no longer closes it."""
    with websocket(server) as connection:
        time.sleep(IDLE_S * 2)   # past --header-timeout, within --websocket-idle-timeout
        assert respond(connection)["type"] in ("response.completed", "response.incomplete")


def test_a_websocket_that_sends_nothing_is_closed(server: Server) -> None:
    for used in (False, True):   # from its opening, and from its last response's end
        with websocket(server) as connection:
            if used:
                respond(connection)
            with pytest.raises(ConnectionClosedOK) as closed:
                connection.recv(timeout=PATIENCE_S)
        assert closed.value.rcvd.code == 1000
        assert closed.value.rcvd.reason == f"no message for {WEBSOCKET_IDLE_S} s"
