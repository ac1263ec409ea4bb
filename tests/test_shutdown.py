"""Graceful shutdown (issue 23 item 3): on SIGTERM lse-server stops accepting, lets running replies finish
within --shutdown-timeout, ends the rest with the spec's in-stream error and [DONE], and exits 0."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
from test_server import CHAT_TEMPLATE, lse_server

DRAIN_S = 1.5


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("qwen3", chat_template=CHAT_TEMPLATE)


def stream(client: httpx.Client, max_tokens: int, first: threading.Event, out: list) -> None:
    body = {"prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                out.append(line[6:])
                first.set()


def test_sigterm_drains_then_ends_streams_with_an_error_and_exits_0(checkpoint) -> None:
    with lse_server(checkpoint, "--kv-len", "4096", "--pool", "cpu:0", "--shutdown-timeout", str(DRAIN_S)) as server:
        with server.client() as long_client, server.client() as short_client:
            long_events: list[str] = []
            short_events: list[str] = []
            long_started, short_started = threading.Event(), threading.Event()
            threads = [threading.Thread(target=stream, args=(long_client, 4000, long_started, long_events)),
                       threading.Thread(target=stream, args=(short_client, 40, short_started, short_events))]
            for thread in threads:
                thread.start()
            assert long_started.wait(60) and short_started.wait(60)
            signalled = time.monotonic()
            server.process.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            with pytest.raises(httpx.TransportError):   # no new connection is accepted while draining
                httpx.get(f"{server.url}/health", timeout=5)
            for thread in threads:
                thread.join(60)
            code = server.process.wait(30)
            exited = time.monotonic() - signalled
    assert code == 0, server.log()
    assert short_events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in short_events[:-1]]
    assert [c["choices"][0]["stop_reason"] for c in chunks if c["choices"] and c["choices"][0].get("stop_reason")] \
        == ["max_tokens"]
    assert chunks[-1]["usage"]["completion_tokens"] == 40
    assert long_events[-1] == "[DONE]"
    error = json.loads(long_events[-2])["error"]
    assert (error["type"], error["code"]) == ("server_error", "shutting_down"), error
    assert len(long_events) > 3   # it streamed tokens before the drain ended it
    assert DRAIN_S <= exited < DRAIN_S + 10
