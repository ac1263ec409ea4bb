"""lse-server --replicas 2: two LSE replicas of a tiny qwen3 checkpoint on a local Ray instance behind Ray
Serve's proxy, driven by the official openai client and by raw HTTP.

Expected values come from the spec (shapes, codes), from an engine opened in this process on the same
checkpoint (the bodies a single lse-server returns), and from Ray's own view of its replicas' processes.
The slow tests (`python -m pytest -m slow tests/test_ray_serve.py`) measure the prefix-affinity hit rate
against random routing and kill a replica under load.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from lse_core.api import lse_close, lse_models, lse_open_or_raise, lse_request_iter

API_KEY = "ray-key"
KV_LEN = 256
PARALLEL = 4
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
READY_TIMEOUT_S = 420   # Ray, its proxy and controller, then two replicas opening the engine, on 2 shared cores


@dataclass
class RayServer:
    url: str
    process: subprocess.Popen
    log_path: Path

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)

    def status(self) -> dict[str, Any]:
        with self.client() as client:
            response = client.get("/v1/lse/status")
        assert response.status_code == 200, response.text
        return response.json()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def ray_server(model: Path, *options: str) -> Iterator[RayServer]:
    """lse-server --replicas 2 in its own session (Ray's processes with it), ready once /health answers and
    /v1/lse/status lists both replicas; stopped by SIGTERM, the session killed if it does not exit."""
    port = free_port()
    command = [sys.executable, "-m", "lse_http.server", "-m", str(model), "--pool", "cpu:0", "--replicas", "2",
               "--kv-len", str(KV_LEN), "--parallel", str(PARALLEL), "--api-key", API_KEY, "--port", str(port),
               *options]
    with tempfile.NamedTemporaryFile("w+", prefix="lse-ray-", suffix=".log", delete=False) as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = RayServer(f"http://127.0.0.1:{port}", process, Path(log.name))
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not _ready(server):
            assert process.poll() is None, f"lse-server exited {process.returncode}:\n{server.log_path.read_text()}"
            assert time.monotonic() < deadline, f"not ready:\n{server.log_path.read_text()[-4000:]}"
            time.sleep(1)
        yield server
    finally:
        stop_session(process, signal.SIGTERM)


def stop_session(process: subprocess.Popen, signum: int) -> None:
    """Stop a server started in its own session by ``signum``, then kill whatever of the session is left (a hung
    raylet, Ray's workers)."""
    process.send_signal(signum)
    try:
        process.wait(90)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _ready(server: RayServer) -> bool:
    try:
        with server.client() as client:
            if client.get("/health", timeout=5).status_code != 200:
                return False
            response = client.get("/v1/lse/status", timeout=5)
        return response.status_code == 200 and len(response.json()["replicas"]) == 2
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> Path:
    return tiny_checkpoint("qwen3", chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Iterator[RayServer]:
    # deterministic: greedy replies do not depend on the batch or the prefix cache, so they can be compared
    with ray_server(checkpoint, "--deterministic") as running:
        yield running


@pytest.fixture(scope="module")
def local_engine(checkpoint: Path):
    """The same checkpoint opened in this process: what one lse-server would answer."""
    lse = lse_open_or_raise({"model": str(checkpoint), "pool": "cpu:0", "kv_len": KV_LEN, "deterministic": True})
    yield lse
    lse_close(lse)


def test_the_ingress_serves_lse_servers_api(server: RayServer, local_engine, checkpoint: Path) -> None:
    """The openai client, whole and streamed; the bodies, errors and status of lse-server; lse status."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(model=local_engine.model_id, messages=messages, max_tokens=8,
                                           temperature=0)
    [local_end] = [e for e in lse_request_iter(local_engine, {"messages": messages, "max_tokens": 8,
                                                              "temperature": 0}) if e.kind == "end"]
    assert reply.choices[0].message.content == local_end.data["choices"][0]["message"]["content"]
    assert reply.usage.completion_tokens == 8 and reply.choices[0].finish_reason == "length"
    assert reply.model_extra["lse_context"]["context_length"] == KV_LEN

    with client.chat.completions.create(model=local_engine.model_id, messages=messages, max_tokens=8, stream=True,
                                        stream_options={"include_usage": True}, temperature=0) as stream:
        chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == reply.usage.prompt_tokens
    assert [c.choices[0].model_extra["stop_reason"] for c in chunks if c.choices and c.choices[0].finish_reason] \
        == ["max_tokens"]

    with server.client() as http:
        models = http.get("/v1/models").json()
        bad = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": "x"})
        anonymous = httpx.get(f"{server.url}/v1/models")
    assert [m["id"] for m in models["data"]] == [e["id"] for e in lse_models(local_engine)["data"]]
    assert models["data"][0]["thinking"] == lse_models(local_engine)["data"][0]["thinking"]
    assert bad.status_code == 400
    assert bad.json()["error"] | {"message": None} == {"message": None, "type": "invalid_request_error",
                                                       "code": "invalid_type", "param": "max_tokens"}
    assert anonymous.status_code == 401 and anonymous.json()["error"]["code"] == "invalid_api_key"

    status = server.status()
    assert status["object"] == "lse.status" and status["model"] == local_engine.model_id
    assert len({r["replica"] for r in status["replicas"]}) == 2
    assert len({r["pid"] for r in status["replicas"]}) == 2
    for replica in status["replicas"]:
        assert [d["name"] for d in replica["devices"]] == ["cpu:0"]
        assert replica["engine"]["slots"] == PARALLEL
        assert replica["engine"]["cpu_fallback"]["allowed"] is True
    shown = subprocess.run([sys.executable, "-m", "lse_core.cli", "status", "--url", server.url, "--api-key", API_KEY],
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "replicas (2)" in shown.stdout
    assert all(r["replica"] in shown.stdout for r in status["replicas"])


def test_typed_streams_pass_through(server: RayServer, local_engine) -> None:
    """The Messages and Responses APIs' typed events, relayed as the replica's app writes them."""
    messages = [{"role": "user", "content": "Hi"}]
    claude = anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)
    fields = {"model": local_engine.model_id, "max_tokens": 6, "messages": messages, "extra_body": {"temperature": 0}}
    whole = claude.messages.create(**fields)
    with claude.messages.stream(**fields) as stream:
        kinds = [event.type for event in stream]
        assert stream.get_final_message().content[0].text == whole.content[0].text
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    with client.responses.create(model=local_engine.model_id, input="Hi", max_output_tokens=6, temperature=0,
                                 stream=True) as stream:
        events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == ("response.incomplete" if whole.stop_reason == "max_tokens" else "response.completed")
    assert events[-1].response.output_text == whole.content[0].text


@pytest.mark.parametrize("options, reason", [
    (["-m", "/nonexistent/model.gguf"], "lse-server: model path /nonexistent/model.gguf does not exist"),
    (["--replicas", "-1"], "lse-server: --replicas must be 0 (no Ray) or more, got -1")])
def test_a_bad_start_exits_1_with_its_reason_before_ray_starts(options: list[str], reason: str) -> None:
    command = [sys.executable, "-m", "lse_http.server", "--replicas", "2", "--port", str(free_port()), *options]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [reason]


def test_a_client_that_leaves_cancels_the_replicas_sequence(server: RayServer) -> None:
    body = {"prompt": "The quick brown fox", "max_tokens": KV_LEN - 16, "ignore_eos": True, "stream": True}
    with server.client() as client, client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    deadline = time.monotonic() + 30
    while True:   # the replicas report every second
        status = server.status()
        cancelled = sum(r["count"] for replica in status["replicas"] for r in replica["stats"]["requests"]
                        if r["outcome"] == "cancelled")
        idle = all(r["engine"]["running"] == 0 and r["engine"]["free_slots"] == PARALLEL for r in status["replicas"])
        if cancelled and idle:
            break
        assert time.monotonic() < deadline, status["replicas"]
        time.sleep(0.5)


def conversation_hits(server: RayServer, salt: str, conversations: int = 4, turns: int = 5) -> tuple[float, float]:
    """Conversations taking turns: the share of prompt tokens of every turn after the first that was found
    cached, and that share over the ideal, each turn finding its previous turn's whole prompt cached."""
    histories = [[{"role": "user", "content": f"Conversation {salt}.{i}: tell me about the number {i * 7}."}]
                 for i in range(conversations)]
    last_prompt = [0] * conversations
    cached = prompt = ideal = 0
    with server.client() as client:
        for turn in range(turns):
            for i, history in enumerate(histories):
                response = client.post("/v1/chat/completions", json={"messages": history, "max_tokens": 4,
                                                                      "temperature": 0})
                assert response.status_code == 200, response.text
                usage = response.json()["usage"]
                if turn:
                    prompt += usage["prompt_tokens"]
                    cached += usage["prompt_tokens_details"]["cached_tokens"]
                    ideal += last_prompt[i]
                last_prompt[i] = usage["prompt_tokens"]
                history += [{"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]},
                            {"role": "user", "content": f"And then, turn {turn} of {i}?"}]
    return cached / prompt, cached / ideal


@pytest.mark.slow
def test_prefix_affinity_beats_random_routing(server: RayServer, checkpoint: Path) -> None:
    """Measured: each turn's cached_tokens with prefix affinity, and with --no-prefix-affinity (a replica at
    random for each turn, as the least-loaded choice among idle replicas is random)."""
    affinity = [conversation_hits(server, f"affinity{n}") for n in range(2)]
    with ray_server(checkpoint, "--no-prefix-affinity") as least_loaded:
        random_routing = [conversation_hits(least_loaded, f"random{n}") for n in range(2)]
    print("cached_tokens / prompt_tokens of turns 2-5 (and of the ideal): prefix affinity "
          + ", ".join(f"{r:.3f} ({i:.3f})" for r, i in affinity) + "; random routing "
          + ", ".join(f"{r:.3f} ({i:.3f})" for r, i in random_routing))
    assert min(of_ideal for _, of_ideal in affinity) > 0.9
    assert min(rate for rate, _ in affinity) > max(rate for rate, _ in random_routing)


@pytest.mark.slow
def test_a_replica_killed_under_load_loses_no_whole_request(server: RayServer) -> None:
    """SIGKILL one replica while 8 clients send requests: every whole reply arrives (retried on the other
    replica), a stream either completes or ends with the in-stream error and [DONE], nothing hangs, and Ray
    starts a replacement."""
    before = {r["replica"]: r["pid"] for r in server.status()["replicas"]}
    stop = threading.Event()
    whole: list[int] = []
    streams: list[str] = []   # "done" or the error code that ended it
    failures: list[str] = []

    def send_requests(streaming: bool) -> None:
        body = {"prompt": "The quick brown fox", "max_tokens": 120, "ignore_eos": True, "stream": streaming}
        with server.client() as client:
            while not stop.is_set():
                try:
                    if not streaming:
                        response = client.post("/v1/completions", json=body)
                        whole.append(response.status_code)
                        continue
                    with client.stream("POST", "/v1/completions", json=body) as response:
                        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
                    assert events[-1] == "[DONE]", events[-3:]
                    last = json.loads(events[-2])
                    streams.append(last["error"]["code"] if "error" in last else "done")
                except Exception as e:   # a hang shows as the client's timeout
                    failures.append(f"{type(e).__name__}: {e}")

    clients = [threading.Thread(target=send_requests, args=(i % 4 == 3,)) for i in range(8)]
    for thread in clients:
        thread.start()
    time.sleep(4)
    victim = sorted(before.values())[0]
    os.kill(victim, signal.SIGKILL)
    time.sleep(6)
    stop.set()
    for thread in clients:
        thread.join(180)
    assert not any(thread.is_alive() for thread in clients), "a client hung"
    print(f"whole replies by status: {Counter(whole)}; streams by their end: {Counter(streams)}")
    assert not failures, failures
    assert whole and set(whole) == {200}, sorted(set(whole))
    assert streams and set(streams) <= {"done", "replica_lost"}, streams

    after = replaced(server, victim)
    assert len(set(after) - set(before)) == 1


def replaced(server: RayServer, pid: int) -> dict[str, int]:
    """The replicas' pids by id once Ray has replaced the one whose process was ``pid``."""
    deadline = time.monotonic() + 240
    while True:
        replicas = {r["replica"]: r["pid"] for r in server.status()["replicas"]}
        if len(replicas) == 2 and pid not in replicas.values():
            return replicas
        assert time.monotonic() < deadline, replicas
        time.sleep(2)


@pytest.mark.slow
def test_a_stream_whose_replica_dies_ends_with_the_in_stream_error(server: RayServer) -> None:
    """The replica a prompt's key picks (found from which replica counted its tokens) is killed just after its
    stream's first event: the stream ends with replica_lost, then [DONE], and the next request is answered."""
    prompt = "Kill the replica that serves this prompt, please."
    before = {r["replica"]: r["stats"]["prompt_tokens"] for r in server.status()["replicas"]}
    with server.client() as client:
        assert client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}).status_code == 200
        deadline = time.monotonic() + 30
        while not (counted := [r for r in server.status()["replicas"]
                               if r["stats"]["prompt_tokens"] > before.get(r["replica"], 0)]):
            assert time.monotonic() < deadline
            time.sleep(0.5)
        [serving] = counted
        body = {"prompt": prompt, "max_tokens": KV_LEN - 32, "ignore_eos": True, "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as response:
            lines = (line[6:] for line in response.iter_lines() if line.startswith("data: "))
            assert "choices" in json.loads(next(lines))
            os.kill(serving["pid"], signal.SIGKILL)
            events = list(lines)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert (error["type"], error["code"]) == ("server_error", "replica_lost")
        assert client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}).status_code == 200
    assert serving["replica"] not in replaced(server, serving["pid"])


@pytest.mark.slow
def test_serve_run_with_a_config_file_autoscales_by_ongoing_requests(checkpoint: Path, tmp_path: Path) -> None:
    """Ray's own `serve run` on a Serve config file whose replicas autoscale (Ray Serve's autoscaling_config):
    one replica at first, two once four clients keep it busy."""
    port = free_port()
    config = {
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [{
            "name": "lse", "route_prefix": "/", "import_path": "lse_ray.app:build",
            "args": {"engine": {"model": str(checkpoint), "pool": "cpu:0", "kv_len": KV_LEN, "parallel": 2}},
            "deployments": [{"name": "LSEReplica", "autoscaling_config": {
                "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1, "upscale_delay_s": 1,
                "downscale_delay_s": 600, "look_back_period_s": 2}}]}]}
    (tmp_path / "lse.yaml").write_text(json.dumps(config))   # JSON is YAML
    command = [sys.executable, "-m", "ray.serve.scripts", "run", str(tmp_path / "lse.yaml")]
    log = (tmp_path / "serve.log").open("w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    stop = threading.Event()

    def busy() -> None:
        body = {"prompt": "The quick brown fox", "max_tokens": 200, "ignore_eos": True}
        with httpx.Client(base_url=url, timeout=120) as client:
            while not stop.is_set():
                client.post("/v1/completions", json=body)

    clients = [threading.Thread(target=busy) for _ in range(4)]
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not _replicas(url) or len(_replicas(url)) != 1:
            assert process.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-4000:]
            time.sleep(1)
        for thread in clients:
            thread.start()
        while len(_replicas(url) or []) < 2:
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-4000:]
            time.sleep(1)
    finally:
        stop.set()
        for thread in clients:
            if thread.is_alive():
                thread.join(120)
        stop_session(process, signal.SIGINT)


def _replicas(url: str) -> list[dict[str, Any]] | None:
    try:
        response = httpx.get(f"{url}/v1/lse/status", timeout=5)
        return response.json()["replicas"] if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError):
        return None
