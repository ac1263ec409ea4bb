"""A bounded soak (issue 23 item 9): rounds of mixed traffic against one lse-server — whole streams,
streams the client drops after two chunks, plain replies, prompts that fill the context, bad bodies — from
several clients at once. After the first round (which warms caches and allocators) the server's resident
memory, its open file descriptors and its KV slots must stay flat round after round: nothing a request
holds may outlive it."""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from test_server import CHAT_TEMPLATE, HELLO, Server, lse_server

ROUNDS = 5
CLIENTS = 6
REPEATS = 4                    # each client's traffic per round: 24 requests
KV_LEN = 256
RSS_GROWTH_LIMIT = 24 << 20    # bytes over the rounds after the first: allocator noise, not a leak per request
FD_SLACK = 4                   # sockets still closing when the round is read


def resident_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        kb = next(line.split()[1] for line in status if line.startswith("VmRSS:"))
    return int(kb) * 1024


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def whole_stream(http: httpx.Client) -> None:
    body = {"messages": HELLO, "max_tokens": 24, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert response.status_code == 200 and lines[-1] == "data: [DONE]"
    assert not [line for line in lines[:-1] if "error" in json.loads(line[6:])]


def dropped_stream(http: httpx.Client) -> None:
    body = {"prompt": "once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i >= 2:
                break   # leaving the block closes the connection: the server cancels the sequence


def plain_reply(http: httpx.Client) -> None:
    reply = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 8, "ignore_eos": True})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 8


def context_full(http: httpx.Client) -> None:
    reply = http.post("/v1/completions", json={"prompt": "word " * (KV_LEN * 2), "max_tokens": 4})
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "context_full"


def bad_body(http: httpx.Client) -> None:
    reply = http.post("/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"})
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_json"


TRAFFIC = (whole_stream, dropped_stream, plain_reply, context_full, bad_body, whole_stream)


def one_round(server: Server) -> None:
    def client(i: int) -> None:
        with server.client() as http:
            for request in (TRAFFIC[i % len(TRAFFIC):] + TRAFFIC[:i % len(TRAFFIC)]) * REPEATS:
                request(http)

    with ThreadPoolExecutor(CLIENTS) as pool:
        list(pool.map(client, range(CLIENTS)))


def settled(server: Server) -> dict:
    """The engine once every cancelled sequence has ended (a dropped stream ends at its next step)."""
    with server.client() as http:
        for _ in range(200):
            engine = http.get("/v1/lse/status").json()["engine"]
            if engine["running"] == engine["waiting"] == 0:
                return engine
            time.sleep(0.05)
    raise AssertionError(f"sequences still running after the round: {engine}")


def test_memory_descriptors_and_slots_stay_flat(tiny_checkpoint) -> None:
    checkpoint = tiny_checkpoint("qwen3", chat_template=CHAT_TEMPLATE)
    with lse_server(checkpoint, "--pool", "cpu:0", "--kv-len", str(KV_LEN)) as server:
        pid = server.process.pid
        one_round(server)
        settled(server)
        rss, fds = [resident_bytes(pid)], [open_fds(pid)]
        for _ in range(ROUNDS - 1):
            one_round(server)
            engine = settled(server)
            assert engine["free_slots"] == engine["slots"] and engine["paused"] == 0, engine
            rss.append(resident_bytes(pid))
            fds.append(open_fds(pid))
        assert max(fds) <= fds[0] + FD_SLACK, fds
        assert max(rss) - rss[0] <= RSS_GROWTH_LIMIT, [f"{r / 2**20:.1f} MiB" for r in rss]
        with server.client() as http:   # and it still serves
            plain_reply(http)
        assert "Traceback" not in server.log(), server.log()[-5000:]
