"""Many clients on one lse-server: 16 concurrent streams over 4 KV slots while 4 clients hang up
midway. The others must finish with the right finish_reason, the server must stay up, and every KV
slot must come back. Prints the aggregate throughput and how fast a disconnect frees its slot."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from test_server import API_KEY, CHAT_TEMPLATE, Server, lse_server

SLOTS = 4
CLIENTS = 16
LEAVERS = 4           # clients that disconnect after LEAVE_AFTER chunks
LEAVE_AFTER = 3
MAX_TOKENS = 40
KV_LEN = 2048          # a leaver's reply runs to the context's end: long enough that its hang-up comes first


@pytest.fixture(scope="module")
def server(tiny_checkpoint) -> Iterator[Server]:
    checkpoint: Path = tiny_checkpoint("qwen3", chat_template=CHAT_TEMPLATE)
    with lse_server(checkpoint, "--kv-len", str(KV_LEN), "--parallel", str(SLOTS), "--pool", "cpu:0") as s:
        yield s


def stream_body(i: int, max_tokens: int = MAX_TOKENS) -> dict:
    return {"messages": [{"role": "user", "content": f"Client {i}: tell me about Paris and the capital of France."}],
            "max_tokens": max_tokens, "temperature": 0.7, "seed": i, "stream": True,
            "stream_options": {"include_usage": True}}


def leaver_body(i: int) -> dict:
    """A leaver's request cannot end before its hang-up reaches the server, or the hang-up would not
    be counted as a cancellation: the engine runs far ahead of a busy client, so a limit or a sampled
    end token could come first. So: greedy and no limit; test_leavers_cannot_end_early checks that
    this model's greedy reply to it runs until the context is full."""
    return stream_body(i) | {"max_tokens": None, "temperature": 0}


async def run_client(client: httpx.AsyncClient, i: int, leave: bool) -> dict:
    """One streaming client: its final chunk and usage, or how many chunks it read before leaving."""
    chunks: list[dict] = []
    body = leaver_body(i) if leave else stream_body(i)
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            chunks.append(json.loads(line[len("data: "):]))
            if leave and len(chunks) == LEAVE_AFTER:
                return {"left": True, "chunks": len(chunks)}   # leaving the block closes the connection
    final = next(c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"] is not None)
    return {"left": False, "final": final, "usage": chunks[-1]["usage"],
            "text": "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])}


async def free_slots(client: httpx.AsyncClient) -> int:
    return (await client.get("/v1/lse/status")).json()["engine"]["free_slots"]


async def wait_all_free(client: httpx.AsyncClient, timeout: float = 30) -> float:
    """Seconds until every KV slot is free again."""
    start = time.perf_counter()
    while (await free_slots(client)) != SLOTS:
        assert time.perf_counter() - start < timeout, (await client.get("/v1/lse/status")).json()
        await asyncio.sleep(0.002)
    return time.perf_counter() - start


async def cancellation_latency(server: Server, streamed: bool) -> float:
    """One request alone on the server: seconds from the client closing to its slot being free."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=60) as status_client:
        assert await free_slots(status_client) == SLOTS
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=60) as client:
            body = stream_body(0, max_tokens=KV_LEN // 2) | {"stream": streamed}
            if streamed:
                async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                    lines = response.aiter_lines()
                    while not (await anext(lines)).startswith("data: "):
                        pass
            else:
                request = asyncio.ensure_future(client.post("/v1/chat/completions", json=body))
                while await free_slots(status_client) == SLOTS:   # wait until it holds a slot
                    await asyncio.sleep(0.002)
                request.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await request
        return await wait_all_free(status_client)


def test_leavers_cannot_end_early(server: Server) -> None:
    with server.client() as http:
        for i in range(LEAVERS):
            reply = http.post("/v1/chat/completions", json=leaver_body(i) | {"stream": False}, timeout=120).json()
            assert reply["choices"][0]["stop_reason"] == "context_full", (i, reply["choices"][0])


def test_sixteen_streams_with_four_disconnects(server: Server) -> None:
    async def main() -> tuple[list[dict], float]:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        limits = httpx.Limits(max_connections=CLIENTS + 2)
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=300, limits=limits) as client:
            start = time.perf_counter()
            results = await asyncio.gather(*(run_client(client, i, leave=i < LEAVERS) for i in range(CLIENTS)))
            elapsed = time.perf_counter() - start
            await wait_all_free(client)
            return list(results), elapsed

    results, elapsed = asyncio.run(main())
    left, finished = results[:LEAVERS], results[LEAVERS:]
    assert all(r["left"] and r["chunks"] == LEAVE_AFTER for r in left)
    for r in finished:
        choice, usage = r["final"]["choices"][0], r["usage"]
        assert (choice["finish_reason"], choice["stop_reason"]) in {("length", "max_tokens"), ("stop", "stop_token")}
        if choice["finish_reason"] == "length":
            assert usage["completion_tokens"] == MAX_TOKENS
        assert r["final"]["lse_context"]["tokens_used"] == usage["total_tokens"]
    tokens = sum(r["usage"]["completion_tokens"] for r in finished)

    with server.client() as http:
        status = http.get("/v1/lse/status").json()
        assert http.get("/health").json() == {"status": "ok"}
        assert (status["engine"]["free_slots"], status["engine"]["running"], status["engine"]["waiting"]) == \
            (SLOTS, 0, 0)
        later = http.post("/v1/completions", json={"prompt": "Paris is", "max_tokens": 3}).json()
        assert later["choices"][0]["finish_reason"] in ("length", "stop")
        cancelled = [line for line in http.get("/metrics").text.splitlines()
                     if line.startswith("lse_requests_total{") and 'outcome="cancelled"' in line]
        assert sum(float(line.rsplit(" ", 1)[1]) for line in cancelled) == LEAVERS

    streamed = [asyncio.run(cancellation_latency(server, streamed=True)) for _ in range(5)]
    whole = [asyncio.run(cancellation_latency(server, streamed=False)) for _ in range(5)]
    print(f"\nlse-server, {CLIENTS} streaming clients ({LEAVERS} leaving after {LEAVE_AFTER} chunks), "
          f"{SLOTS} KV slots, --pool cpu:0: {tokens} tokens in {elapsed:.2f} s = {tokens / elapsed:.1f} tokens/s")
    for name, samples in (("streamed", streamed), ("non-streamed", whole)):
        print(f"slot freed after a {name} client disconnects: median {statistics.median(samples) * 1000:.1f} ms, "
              f"max {max(samples) * 1000:.1f} ms (5 tries)")
