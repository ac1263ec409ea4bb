"""lse-server end to end: a real server process on 127.0.0.1 serving a tiny random qwen3 checkpoint,
driven by the official openai client and by raw HTTP (httpx) for LSE's own fields and bad input.

Expected values come from the spec (shapes, codes, limits) and from independent references: the
checkpoint's own tokenizer.json read by `tokenizers`, the server's options, and the OpenAPI
document's schemas checked with jsonschema."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import tokenizers

API_KEY = "test-key"
KV_LEN = 128
SLOTS = 4
# Qwen3's thinking switch in a few lines: enable_thinking=false closes an empty <think> block.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
HELLO = [{"role": "user", "content": "What is the capital of France?"}]


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text()

    def client(self, **options) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60, **options)

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(model: Path | str, port: int, *options: str) -> list[str]:
    return [sys.executable, "-m", "lse_http.server", "-m", str(model), "--port", str(port), *options]


@contextmanager
def lse_server(model: Path, *options: str, env: dict[str, str] | None = None,
               ready_timeout: float = 180) -> Iterator[Server]:
    """A running lse-server with the API key (``env`` added to the environment), stopped afterwards
    by SIGTERM, on which it drains and exits 0."""
    port = free_port()
    with tempfile.NamedTemporaryFile("w+", prefix="lse-server-", suffix=".log", delete=False) as log:
        process = subprocess.Popen(server_command(model, port, "--api-key", API_KEY, *options),
                                   stdout=log, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})})
    server = Server(f"http://127.0.0.1:{port}", process, Path(log.name))
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            assert process.poll() is None, f"lse-server exited with {process.returncode}:\n{server.log()}"
            assert time.monotonic() < deadline, f"lse-server not ready in {ready_timeout} s:\n{server.log()}"
            try:
                if httpx.get(f"{server.url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        yield server
    finally:
        process.terminate()
        code = process.wait(30)
    assert code == 0, f"lse-server exited with {code} on SIGTERM:\n{server.log()}"
    os.unlink(log.name)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> Path:
    return tiny_checkpoint("qwen3", chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Iterator[Server]:
    with lse_server(checkpoint, "--kv-len", str(KV_LEN), "--parallel", str(SLOTS), "--pool", "cpu:0") as s:
        yield s


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with server.client() as client:
        yield client


@pytest.fixture(scope="module")
def model_id(http: httpx.Client) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def vocab(checkpoint: Path) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(checkpoint / "tokenizer.json"))


def validate(instance: object, schema_name: str, document: dict) -> None:
    """Checks ``instance`` against a component schema of the server's OpenAPI document."""
    jsonschema.validate(instance, {**document, "$ref": f"#/components/schemas/{schema_name}"},
                        cls=jsonschema.Draft202012Validator)


@pytest.fixture(scope="module")
def openapi_doc(http: httpx.Client) -> dict:
    doc = http.get("/openapi.json").json()
    assert doc["openapi"].startswith("3.1")
    jsonschema.Draft202012Validator.check_schema({"$defs": doc["components"]["schemas"]})
    return doc


def sse_events(response: httpx.Response) -> list[dict | str]:
    """The data of each server-sent event: parsed JSON, or the literal [DONE]."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
        else:
            assert line == "", f"not an SSE data line: {line!r}"
    return events


def assert_error(response: httpx.Response, status: int, type_: str, code: str, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (type_, code, param), error
    assert isinstance(error["message"], str) and error["message"]
    return error


# ---- the openai client ----

def test_chat_with_openai_client(server: Server, model_id: str, vocab: tokenizers.Tokenizer) -> None:
    reply = server.openai().chat.completions.create(model=model_id, messages=HELLO, max_tokens=6, temperature=0)
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and reply.model == model_id
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert (choice.finish_reason, choice.model_extra["stop_reason"]) in {("length", "max_tokens"),
                                                                          ("stop", "stop_token")}
    if choice.finish_reason == "length":
        assert reply.usage.completion_tokens == 6
    prompt = f"<|im_start|>user\n{HELLO[0]['content']}<|im_end|>\n<|im_start|>assistant\n"
    assert reply.usage.prompt_tokens == len(vocab.encode(prompt, add_special_tokens=False).ids)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_completion_with_openai_client(server: Server, model_id: str) -> None:
    reply = server.openai().completions.create(model=model_id, prompt="The capital of France is", max_tokens=5,
                                               temperature=0, stop=["\n\n\n"])
    assert reply.object == "text_completion"
    assert isinstance(reply.choices[0].text, str)
    assert reply.choices[0].finish_reason in ("length", "stop")
    assert reply.usage.completion_tokens <= 5


def test_stream_matches_whole_reply(server: Server, model_id: str) -> None:
    """Greedy decoding: the streamed deltas join to the same text as the whole reply, and the
    final chunk and the usage chunk carry what the spec puts there."""
    client = server.openai()
    whole = client.chat.completions.create(model=model_id, messages=HELLO, max_tokens=12, temperature=0)
    with client.chat.completions.create(model=model_id, messages=HELLO, max_tokens=12, temperature=0, stream=True,
                                        stream_options={"include_usage": True}) as stream:
        chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    final, usage = chunks[-2], chunks[-1]
    assert final.choices[0].finish_reason == whole.choices[0].finish_reason
    assert final.choices[0].model_extra["stop_reason"] == whole.choices[0].model_extra["stop_reason"]
    assert final.model_extra["lse_context"]["tokens_used"] == whole.usage.total_tokens
    assert usage.choices == [] and usage.usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])


def test_models_with_openai_client(server: Server, model_id: str, checkpoint: Path) -> None:
    client = server.openai()
    models = client.models.list().data
    assert [m.id for m in models] == [model_id] == [checkpoint.name]
    entry = client.models.retrieve(model_id)
    assert entry.owned_by == "lse" and entry.model_extra["context_length"] == KV_LEN
    thinking = entry.model_extra["thinking"]
    assert thinking["toggle"] == "enable_thinking" and thinking["effort"] is None
    assert [level["id"] for level in thinking["levels"]] == ["none", "on"]
    assert entry.model_extra["generation_defaults"]["sources"]["temperature"] == "lse_default"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"


def test_reasoning_fields_through_extra_body(server: Server, model_id: str) -> None:
    client = server.openai()
    reply = client.chat.completions.create(model=model_id, messages=HELLO, max_tokens=4, temperature=0,
                                           extra_body={"enable_thinking": False})
    assert reply.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_id, messages=HELLO, max_tokens=4, reasoning_effort="high")
    assert e.value.body["code"] == "unsupported_reasoning_effort"
    assert e.value.body["param"] == "reasoning_effort" and e.value.body["levels"] == ["none", "on"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_id, messages=HELLO, max_tokens=4,
                                       extra_body={"enable_thinking": True, "thinking": {"type": "disabled"}})
    assert e.value.body["code"] == "conflicting_thinking"


# ---- LSE's own fields over raw HTTP ----

def test_lse_fields_of_a_reply(http: httpx.Client, model_id: str, openapi_doc: dict) -> None:
    body = {"model": model_id, "messages": HELLO, "max_tokens": 5, "temperature": 0}
    reply = http.post("/v1/chat/completions", json=body).json()
    validate(reply, "ChatCompletion", openapi_doc)
    usage, context = reply["usage"], reply["lse_context"]
    assert context == {"tokens_used": usage["total_tokens"], "context_length": KV_LEN,
                       "tokens_remaining": KV_LEN - usage["total_tokens"]}
    assert reply["timings"]["predicted_n"] == usage["completion_tokens"]
    assert reply["choices"][0]["stop_reason"] in ("max_tokens", "stop_token")

    completion = http.post("/v1/completions", json={"model": model_id, "prompt": "Paris is", "max_tokens": 3}).json()
    validate(completion, "TextCompletion", openapi_doc)
    assert completion["lse_context"]["context_length"] == KV_LEN


def test_stream_over_raw_http(http: httpx.Client, model_id: str, openapi_doc: dict) -> None:
    body = {"model": model_id, "prompt": "Paris is", "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    for chunk in chunks:
        validate(chunk, "TextCompletionChunk", openapi_doc)
    final = next(c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"])
    assert {"lse_context", "timings"} <= final.keys()
    assert chunks[-1]["usage"]["completion_tokens"] == final["timings"]["predicted_n"]


def test_reply_that_fills_the_context(http: httpx.Client, model_id: str, vocab: tokenizers.Tokenizer) -> None:
    """No max_tokens: the reply runs until it meets the context (unless the model ends it first)."""
    prompt = "Paris is the capital of France. " * 14
    prompt_tokens = len(vocab.encode(prompt).ids)
    assert KV_LEN - 30 < prompt_tokens < KV_LEN - 5, prompt_tokens
    reply = http.post("/v1/completions", json={"model": model_id, "prompt": prompt, "temperature": 0}).json()
    choice = reply["choices"][0]
    assert reply["usage"]["prompt_tokens"] == prompt_tokens
    if choice["stop_reason"] != "stop_token":
        assert (choice["finish_reason"], choice["stop_reason"]) == ("length", "context_full")
        assert reply["lse_context"] == {"tokens_used": KV_LEN, "context_length": KV_LEN, "tokens_remaining": 0}


def test_prompt_that_fills_the_context(http: httpx.Client, model_id: str, vocab: tokenizers.Tokenizer) -> None:
    prompt = "Paris is the capital of France. " * 40
    response = http.post("/v1/completions", json={"model": model_id, "prompt": prompt})
    error = assert_error(response, 400, "invalid_request_error", "context_full", "prompt")
    used = len(vocab.encode(prompt).ids)
    assert error["lse_context"] == {"tokens_used": used, "context_length": KV_LEN, "tokens_remaining": 0}
    streamed = http.post("/v1/chat/completions", json={"model": model_id, "stream": True,
                                                       "messages": [{"role": "user", "content": prompt}]})
    assert_error(streamed, 400, "invalid_request_error", "context_full", "messages")


# ---- bad input ----

def test_malformed_json(http: httpx.Client) -> None:
    for raw in (b'{"messages": [', b"\xff\xfe{}", b"[" * 100_000):
        response = http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        assert_error(response, 400, "invalid_request_error", "invalid_json")


def test_wrong_types(http: httpx.Client, model_id: str) -> None:
    cases = [
        ({"model": model_id, "messages": HELLO, "temperature": "hot"}, "invalid_type", "temperature"),
        ({"model": model_id, "messages": "hello"}, "invalid_type", "messages"),
        ({"model": model_id, "messages": HELLO, "max_tokens": 0}, "invalid_value", "max_tokens"),
        ({"model": model_id, "messages": HELLO, "stream": "yes"}, "invalid_type", "stream"),
        ({"model": model_id}, "missing_field", "messages"),
    ]
    for body, code, param in cases:
        assert_error(http.post("/v1/chat/completions", json=body), 400, "invalid_request_error", code, param)
    assert_error(http.post("/v1/completions", json=[1, 2]), 400, "invalid_request_error", "invalid_type")


def test_huge_body_is_refused_before_it_is_read(server: Server) -> None:
    huge = b'{"prompt": "' + b"x" * (9 << 20) + b'"}'
    with server.client() as client:
        response = client.post("/v1/completions", content=huge, headers={"content-type": "application/json"})
    assert_error(response, 413, "invalid_request_error", "body_too_large")

    def chunked() -> Iterator[bytes]:   # no Content-Length: the limit is counted as the body arrives
        yield b'{"prompt": "'
        for _ in range(9):
            yield b"x" * (1 << 20)
        yield b'"}'
    with server.client() as client:
        response = client.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    assert_error(response, 413, "invalid_request_error", "body_too_large")


def test_unknown_model_name(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", json={"model": "gpt-4o", "messages": HELLO})
    assert response.status_code == 404, response.text
    assert response.json()["error"]["param"] == "model"


def test_api_key(server: Server) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("GET", "/metrics"),
                             ("GET", "/v1/lse/status"), ("GET", "/no/such/route")):
            response = httpx.request(method, server.url + path, headers=headers, json={})
            assert_error(response, 401, "authentication_error", "invalid_api_key")
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_unknown_route_and_wrong_method(http: httpx.Client) -> None:
    assert_error(http.get("/v1/nothing"), 404, "invalid_request_error", "not_found")
    response = http.get("/v1/chat/completions")
    assert_error(response, 405, "invalid_request_error", "method_not_allowed")
    assert response.headers["allow"] == "POST"


# ---- the other endpoints ----

def test_tokenize_and_detokenize(http: httpx.Client, vocab: tokenizers.Tokenizer, openapi_doc: dict) -> None:
    text = "The capital of France is Paris. café 東京"
    for add_special in (False, True):
        tokens = http.post("/tokenize", json={"content": text, "add_special": add_special}).json()
        validate(tokens, "Tokenized", openapi_doc)
        assert tokens["tokens"] == vocab.encode(text, add_special_tokens=add_special).ids
        assert (tokens["count"], tokens["max_model_len"]) == (len(tokens["tokens"]), KV_LEN)
    ids = vocab.encode(text).ids
    content = http.post("/detokenize", json={"tokens": ids}).json()
    validate(content, "Content", openapi_doc)
    assert content["content"] == vocab.decode(ids, skip_special_tokens=False) == text
    assert_error(http.post("/tokenize", json={"content": 5}), 400, "invalid_request_error", "invalid_type", "content")
    assert_error(http.post("/detokenize", json={"tokens": [1, vocab.get_vocab_size()]}), 400,
                 "invalid_request_error", "invalid_value", "tokens[1]")
    assert_error(http.post("/detokenize", json={"tokens": ["a"]}), 400, "invalid_request_error", "invalid_type",
                 "tokens[0]")


def test_tokenize_a_request_as_it_would_run(http: httpx.Client, model_id: str, vocab: tokenizers.Tokenizer,
                                           openapi_doc: dict) -> None:
    """A chat or completion body tokenizes to the prompt that request runs on (its prompt_tokens),
    rendered by the model's template; llama.cpp's with_pieces gives each token's text or bytes."""
    chat = {"messages": HELLO, "model": model_id}
    tokens = http.post("/tokenize", json=chat).json()
    validate(tokens, "Tokenized", openapi_doc)
    rendered = f"<|im_start|>user\n{HELLO[0]['content']}<|im_end|>\n<|im_start|>assistant\n"
    assert tokens["tokens"] == vocab.encode(rendered, add_special_tokens=False).ids
    usage = http.post("/v1/chat/completions", json=chat | {"max_tokens": 1}).json()["usage"]
    assert tokens["count"] == usage["prompt_tokens"]
    bare = http.post("/tokenize", json=chat | {"add_generation_prompt": False}).json()["tokens"]
    assert bare == vocab.encode(rendered.removesuffix("<|im_start|>assistant\n"), add_special_tokens=False).ids
    text = "Paris is"
    completion = http.post("/tokenize", json={"prompt": text}).json()["tokens"]
    assert completion == vocab.encode(text, add_special_tokens=True).ids
    assert http.post("/v1/completions", json={"prompt": text, "max_tokens": 1}).json()["usage"]["prompt_tokens"] == \
        len(completion)

    emoji = "café 🫠 東京"
    pieces = http.post("/tokenize", json={"content": emoji, "with_pieces": True}).json()
    validate(pieces, "Tokenized", openapi_doc)
    assert [t["id"] for t in pieces["tokens"]] == vocab.encode(emoji, add_special_tokens=False).ids
    spelled = [bytes(t["piece"]) if isinstance(t["piece"], list) else t["piece"].encode() for t in pieces["tokens"]]
    assert b"".join(spelled) == emoji.encode()
    assert any(isinstance(t["piece"], list) for t in pieces["tokens"])   # single bytes of a character

    assert_error(http.post("/tokenize", json={}), 400, "invalid_request_error", "missing_field", "content")
    assert_error(http.post("/tokenize", json={"messages": []}), 400, "invalid_request_error", "invalid_value",
                 "messages")
    assert_error(http.post("/tokenize", json={"prompt": [vocab.get_vocab_size()]}), 400, "invalid_request_error",
                 "invalid_value", "prompt[0]")
    assert_error(http.post("/tokenize", json=chat | {"model": "other"}), 404, "invalid_request_error",
                 "model_not_found", "model")
    assert_error(http.post("/tokenize", json={"content": "x", "with_pieces": 1}), 400, "invalid_request_error",
                 "invalid_type", "with_pieces")


def test_status_model_info_and_health(http: httpx.Client, openapi_doc: dict) -> None:
    status = http.get("/v1/lse/status").json()
    validate(status, "Status", openapi_doc)
    assert status["engine"]["slots"] == SLOTS
    info = http.get("/v1/lse/model_info").json()
    validate(info, "ModelInfo", openapi_doc)
    # every fused group of the plan, each on the one pool device
    assert [p["group"] for p in status["placements"]] == list(range(info["plan"]["groups"]))
    assert {(p["device"], p["cpu_fallback"]) for p in status["placements"]} == {("cpu:0", None)}
    validate(http.get("/health").json(), "Health", openapi_doc)
    models = http.get("/v1/models").json()
    validate(models, "ModelList", openapi_doc)
    assert info["thinking"] == models["data"][0]["thinking"]


def test_metrics(http: httpx.Client, model_id: str) -> None:
    http.post("/v1/completions", json={"model": model_id, "prompt": "Paris", "max_tokens": 2})
    text = http.get("/metrics").text
    samples = {}
    for line in text.splitlines():
        if line.startswith("#"):
            assert re.fullmatch(r"# (HELP \w+ .+|TYPE \w+ (counter|gauge|histogram|summary))", line), line
            continue
        name, value = line.rsplit(" ", 1)
        samples[name] = float(value)
    completions = [v for k, v in samples.items() if k.startswith("lse_requests_total{") and 'endpoint="completion"'
                   in k]
    assert sum(completions) >= 1
    assert samples["lse_completion_tokens_total"] >= 2
    assert samples["lse_kv_slots"] == SLOTS and 0 <= samples["lse_kv_slots_free"] <= SLOTS
    assert samples['lse_request_duration_seconds_bucket{le="+Inf"}'] == samples["lse_request_duration_seconds_count"]
    assert samples["lse_time_to_first_token_seconds_count"] >= 1


# ---- CPU fallback: the lse-hrx example plugin simulates HRX_DEVICES devices without a silu kernel ----

HRX = {"HRX_DEVICES": "1"}


def test_cpu_fallback_is_reported(checkpoint: Path) -> None:
    with lse_server(checkpoint, "--kv-len", str(KV_LEN), "--pool", "hrx:0", env=HRX) as server, \
            server.client() as http:
        reply = http.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 3}).json()
        warnings = reply["lse_warnings"]
        assert warnings and all(w["type"] == "cpu_fallback" and "no kernel for silu" in w["cause"]
                                for w in warnings)
        # one forward pass per token: a prompt step, then one step for each token after the first
        assert {w["count"] for w in warnings} == {reply["usage"]["completion_tokens"]}
        body = {"messages": HELLO, "max_tokens": 3, "stream": True}
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            chunks = sse_events(response)[:-1]
        assert "lse_warnings" in chunks[-1] and all("lse_warnings" not in c for c in chunks[:-1])
        fallback = http.get("/v1/lse/status").json()["engine"]["cpu_fallback"]
        assert fallback["allowed"] and fallback["total"] == sum(e["count"] for e in fallback["events"]) > 0
        metrics = http.get("/metrics").text
        for event in fallback["events"]:
            assert f'lse_cpu_fallback_total{{cause="{event["cause"]}"}} {event["count"]}' in metrics
        log = server.log()
    assert re.search(r"^lse: CPU FALLBACK \(1 so far for this cause\): fused group \d+ \(2 nodes: silu, mul\)",
                     log, re.MULTILINE), log


def typed_sse_events(response: httpx.Response) -> list[tuple[str, dict | str]]:
    """Each ``event:`` name and its ``data:`` of a Responses or Messages stream (the Responses API's closing
    ``data: [DONE]`` has no name: ("", "[DONE]"))."""
    events = []
    for block in response.read().decode().split("\n\n"):
        if block:
            name, _, data = block.rpartition("\n")
            data = data.removeprefix("data: ")
            events.append((name.removeprefix("event: "), data if data == "[DONE]" else json.loads(data)))
    return events


def test_cpu_fallback_refused(checkpoint: Path) -> None:
    """A request that fails (CPU fallback refused) is HTTP 500; streamed, the spec sends its error in the stream."""
    options = ("--kv-len", str(KV_LEN), "--pool", "hrx:0", "--no-cpu-fallback")
    refused = "CPU fallback disabled: fused group"
    with lse_server(checkpoint, *options, env=HRX) as server, server.client() as http:
        response = http.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 3})
        error = assert_error(response, 500, "server_error", None)
        assert error["message"].startswith(refused), error
        with http.stream("POST", "/v1/chat/completions", json={"messages": HELLO, "max_tokens": 3,
                                                               "stream": True}) as response:
            assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
            error_event, done = sse_events(response)
        assert done == "[DONE]" and error_event["error"]["type"] == "server_error", error_event
        assert error_event["error"]["message"].startswith(refused)
        for path, body in [("/v1/responses", {"input": "Hi", "max_output_tokens": 3, "stream": True}),
                           ("/v1/messages", {"model": http.get("/v1/models").json()["data"][0]["id"],
                                             "messages": HELLO, "max_tokens": 3, "stream": True})]:
            with http.stream("POST", path, json=body) as response:
                assert response.status_code == 200, response.read()
                (name, data), *closing = typed_sse_events(response)
            message = data["message"] if path == "/v1/responses" else data["error"]["message"]
            assert name == data["type"] == "error" and message.startswith(refused), data
            # Open Responses: response.failed follows the error, and [DONE] ends the stream
            assert [name for name, _ in closing] == (["response.failed", ""] if path == "/v1/responses" else [])
        assert http.get("/health").json() == {"status": "ok"}
        assert http.get("/v1/lse/status").json()["engine"]["cpu_fallback"]["allowed"] is False


# ---- startup ----

def test_startup_failure_exits_1_with_one_line(checkpoint: Path) -> None:
    cases = [(checkpoint, ["--pool", "nosuch:0"]), ("/no/such/model", [])]
    for model, options in cases:
        done = subprocess.run(server_command(model, free_port(), *options), capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 1, done.stderr
        reasons = [line for line in done.stderr.splitlines() if line.startswith("lse-server: ")]
        assert len(reasons) == 1, done.stderr


def test_health_is_503_while_the_model_loads(tmp_path: Path) -> None:
    """The model file is a FIFO: loading blocks on it until the test writes, so the server is
    caught loading for certain; the junk written then fails the load and the server exits 1."""
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    port = free_port()
    process = subprocess.Popen(server_command(fifo, port, "--api-key", API_KEY), stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline and process.poll() is None
            try:
                health = httpx.get(f"{url}/health", timeout=5)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        assert (health.status_code, health.json()) == (503, {"status": "loading"})
        headers = {"Authorization": f"Bearer {API_KEY}"}
        response = httpx.post(f"{url}/v1/chat/completions", json={"messages": HELLO}, headers=headers)
        assert_error(response, 503, "server_error", "loading")
        with open(fifo, "wb") as f:
            f.write(b"not a gguf file")
        assert process.wait(60) == 1
        assert process.stderr.read().count("lse-server: ") == 1
    finally:
        process.kill()
        process.wait()
