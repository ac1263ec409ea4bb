"""Backpressure (issue 23 item 4): a stream whose client stops reading is paused once a bounded number of
its events wait unsent (its sequence stops decoding and keeps its KV slot), resumes when the client reads
again, and is ended after --stall-timeout, freeing its slot.

The client is a raw socket with a small receive buffer that sends one streaming request and then reads
nothing; the server's state is read from /v1/lse/status (engine.paused, free_slots) and /metrics."""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from test_server import API_KEY, CHAT_TEMPLATE, Server, lse_server

STALL_S = 4.0
MAX_TOKENS = 6000


@pytest.fixture(scope="module")
def server(tiny_checkpoint) -> Iterator[Server]:
    checkpoint = tiny_checkpoint("qwen3", chat_template=CHAT_TEMPLATE)
    with lse_server(checkpoint, "--pool", "cpu:0", "--kv-len", "8192", "--parallel", "2",
                    "--stall-timeout", str(STALL_S)) as running:
        yield running


def silent_stream(server: Server) -> socket.socket:
    """A connection that asks for a long stream and reads none of it."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    host, port = server.url.removeprefix("http://").split(":")
    sock.connect((host, int(port)))
    body = json.dumps({"prompt": "hello", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: " + host.encode() + b"\r\nAuthorization: Bearer "
                 + API_KEY.encode() + b"\r\nContent-Type: application/json\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
    return sock


def engine_state(http: httpx.Client) -> dict:
    return http.get("/v1/lse/status").json()["engine"]


def wait_for(condition, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_client_that_stops_reading_pauses_its_sequence_then_loses_it(server: Server) -> None:
    with server.client() as http:
        sock = silent_stream(server)
        try:
            wait_for(lambda: engine_state(http)["paused"] == 1)
            state = engine_state(http)
            assert state["running"] == 1 and state["free_slots"] == state["slots"] - 1   # it keeps its slot
            time.sleep(0.5)   # a step in flight when the pause came still ends (and counts)
            steps = engine_state(http)["steps"]
            time.sleep(1.0)
            assert engine_state(http)["steps"] == steps       # no decoding while paused
            assert steps < MAX_TOKENS                         # paused long before the reply's end
            # another request runs meanwhile
            reply = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "ignore_eos": True})
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
            wait_for(lambda: engine_state(http)["running"] == 0, timeout=STALL_S + 30)
            state = engine_state(http)
            assert state["free_slots"] == state["slots"] and state["paused"] == 0
            assert "read nothing for" in server.log()
        finally:
            sock.close()


def test_a_paused_stream_resumes_and_loses_nothing(server: Server) -> None:
    with server.client() as http:
        sock = silent_stream(server)
        try:
            wait_for(lambda: engine_state(http)["paused"] == 1)
            received = bytearray()
            sock.settimeout(30)
            while b"data: [DONE]\n\n" not in received[-32:]:
                chunk = sock.recv(65536)
                assert chunk, "the server closed the stream"
                received += chunk
        finally:
            sock.close()
    # uvicorn sends each event as one chunk of the chunked body, so the chunk framing never splits one
    chunks = [json.loads(e) for e in re.findall(rb"data: (.*?)\n\n", bytes(received)) if e != b"[DONE]"]
    assert not [c for c in chunks if "error" in c]
    final = next(c for c in chunks if c["choices"] and c["choices"][0].get("finish_reason"))
    assert final["choices"][0]["stop_reason"] == "max_tokens"
    assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
