"""Ollama's API (/api/*) end to end: one lse-server serving three models (a tiny qwen3, and the scripted
checkpoints of test_tool_calls.py and test_thinking_e2e.py that reply with a tool call and with a thinking
block), driven by the official `ollama` Python client, by the `ollama` npm package (tests/ollama_client.cjs,
installed into the pytest cache) and by raw HTTP for the stream's lines, LSE's fields and bad input.

Expected values come from the core's own endpoints on the same server: /api/chat must give what
/v1/chat/completions gives for the same conversation (greedy text, token counts, stop reasons), /api/embed
what /v1/embeddings gives, and the scripted checkpoints their scripted call and reasoning."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import ollama
import pytest
from test_embeddings import busy
from test_responses import SMALL_SCHEMA, chat, prompt_tokens
from test_server import API_KEY, CHAT_TEMPLATE, HELLO, HRX, Server, lse_server, validate
from test_thinking_e2e import QWEN3, scripted_thinking, thinking_checkpoint
from test_tool_calls import CALL, TOOLS, scripted, tool_checkpoint

KV_LEN = 256
CLOSE = 1e-4    # the same vector, computed in another batch (floating-point sums in another order)
TOOL_MODEL, THINKING_MODEL = "tools", "thinking"   # the scripted models' ids
GREEDY = {"temperature": 0}
OLLAMA_JS = "0.6.4"    # the npm package's version the test installs


@pytest.fixture(scope="module")
def served(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The server, the tiny model's id (its directory's name), and the scripts of the scripted models, served as
    TOOL_MODEL and THINKING_MODEL."""
    tiny = tiny_checkpoint("qwen3", chat_template=CHAT_TEMPLATE)
    tools = scripted(tool_checkpoint(tmp_path_factory.mktemp("tools"), special_markers=False),
                     tmp_path_factory.mktemp("tool_script"), range(1))
    thinking = scripted_thinking(thinking_checkpoint(tmp_path_factory.mktemp("qwen3_thinking"), QWEN3),
                                 tmp_path_factory.mktemp("thinking_script"))
    aliases = ["--alias", f"{TOOL_MODEL}={tools['model']}", "--alias", f"{THINKING_MODEL}={thinking['model']}"]
    with lse_server(tiny, *aliases, "--kv-len", str(KV_LEN), "--parallel", "2", "--pool", "cpu:0") as server:
        yield {"server": server, "model": tiny.name, TOOL_MODEL: tools, THINKING_MODEL: thinking}


@pytest.fixture(scope="module")
def server(served: dict[str, Any]) -> Server:
    return served["server"]


@pytest.fixture(scope="module")
def model(served: dict[str, Any]) -> str:
    return served["model"]


@pytest.fixture(scope="module")
def client(server: Server) -> ollama.Client:
    return ollama.Client(host=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


def lines(response: httpx.Response) -> list[dict[str, Any]]:
    """A streamed answer's objects, one per line."""
    assert response.status_code == 200, response.read()
    assert response.headers["content-type"] == "application/x-ndjson"
    return [json.loads(line) for line in response.iter_lines() if line]


def test_chat_gives_the_chat_reply(client: ollama.Client, http: httpx.Client, model: str) -> None:
    expected = chat(http, HELLO, model=model, max_tokens=6)
    reply = client.chat(model=model, messages=HELLO, options=GREEDY | {"num_predict": 6})
    assert (reply.model, reply.done, reply.message.role) == (model, True, "assistant")
    assert reply.message.content == expected["choices"][0]["message"]["content"]
    assert reply.done_reason == {"max_tokens": "length", "stop_token": "stop"}[expected["choices"][0]["stop_reason"]]
    usage = expected["usage"]
    assert (reply.prompt_eval_count, reply.eval_count) == (usage["prompt_tokens"], usage["completion_tokens"])
    assert reply.total_duration >= reply.eval_duration > 0 and reply.prompt_eval_duration > 0
    whole = http.post("/api/chat", json={"model": model, "messages": HELLO, "stream": False,
                                         "options": GREEDY | {"num_predict": 6}}).json()
    assert whole["stop_reason"] == expected["choices"][0]["stop_reason"]
    assert whole["lse_context"] == expected["lse_context"] and set(whole["timings"]) == set(expected["timings"])
    assert datetime.fromisoformat(whole["created_at"]).tzinfo is not None


def test_chat_streams_lines(client: ollama.Client, http: httpx.Client, model: str) -> None:
    fields = {"model": model, "messages": HELLO, "options": GREEDY | {"num_predict": 8}}
    whole = client.chat(**fields)
    parts = list(client.chat(**fields, stream=True))
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert (parts[-1].eval_count, parts[-1].done_reason) == (whole.eval_count, whole.done_reason)
    with http.stream("POST", "/api/chat", json=fields) as response:    # Ollama streams by default
        objects = lines(response)
    assert "".join(o["message"]["content"] for o in objects) == whole.message.content
    last = objects[-1]
    assert last["done"] and last["message"]["content"] == "" and last["eval_count"] == whole.eval_count
    assert {"stop_reason", "lse_context", "timings", "total_duration", "load_duration"} <= set(last)


def test_generate(client: ollama.Client, http: httpx.Client, model: str) -> None:
    """A prompt is the user's turn under the model's template (system before it); raw: true sends it as is."""
    question = HELLO[0]["content"]
    options = GREEDY | {"num_predict": 6}
    expected = chat(http, [{"role": "system", "content": "Be brief."}] + HELLO, model=model, max_tokens=6)
    reply = client.generate(model=model, prompt=question, system="Be brief.", options=options)
    assert reply.response == expected["choices"][0]["message"]["content"] and reply.done
    assert reply.prompt_eval_count == expected["usage"]["prompt_tokens"]
    streamed = list(client.generate(model=model, prompt=question, system="Be brief.", options=options, stream=True))
    assert "".join(p.response for p in streamed) == reply.response and streamed[-1].done
    completion = http.post("/v1/completions", json={"model": model, "prompt": "Once upon a time", "max_tokens": 6,
                                                    "temperature": 0}).json()
    raw = client.generate(model=model, prompt="Once upon a time", raw=True, options=options)
    assert raw.response == completion["choices"][0]["text"]
    assert raw.eval_count == completion["usage"]["completion_tokens"]


def test_embed(client: ollama.Client, http: httpx.Client, model: str) -> None:
    inputs = ["Hello", "Paris is in France"]
    expected = http.post("/v1/embeddings", json={"model": model, "input": inputs}).json()
    embedded = client.embed(model=model, input=inputs)
    assert [pytest.approx(v, abs=CLOSE) for v in embedded.embeddings] == [i["embedding"] for i in expected["data"]]
    assert embedded.prompt_eval_count == expected["usage"]["prompt_tokens"]
    legacy = client.embeddings(model=model, prompt=inputs[0]).embedding
    assert legacy == pytest.approx(expected["data"][0]["embedding"], abs=CLOSE)
    assert client.embed(model=model, input=inputs[0], dimensions=8).embeddings[0] == pytest.approx(
        http.post("/v1/embeddings", json={"model": model, "input": inputs[0], "dimensions": 8}).json()
        ["data"][0]["embedding"], abs=CLOSE)


def test_a_client_that_leaves_cancels_its_embed(http: httpx.Client, server: Server, model: str) -> None:
    """Many inputs, the connection closed soon after: the engine stops computing them and its slots free."""
    status = f"/v1/lse/status?model={model}"
    assert http.post("/api/embed", json={"model": model, "input": "Hi"}).status_code == 200   # the model open
    before = http.get(status).json()["engine"]["steps"]
    with server.client() as leaving, pytest.raises(httpx.ReadTimeout):
        leaving.post("/api/embed", json={"model": model, "input": ["Hello there " * 15] * 2000}, timeout=0.5)
    deadline = time.monotonic() + 10
    # a batch can have finished and the next not yet been admitted (running 0, waiting > 0)
    while busy(engine := http.get(status).json()["engine"]) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine["running"] == engine["waiting"] == 0 and engine["free_slots"] == engine["slots"]
    time.sleep(0.3)
    assert http.get(status).json()["engine"]["steps"] == engine["steps"]   # nothing more computed
    assert engine["steps"] - before < 1000    # far from the 1000 steps the inputs need, two at a time
    metrics = http.get("/metrics").text
    assert f'lse_requests_total{{model="{model}",endpoint="embeddings",outcome="error_499"}} 1' in metrics


def test_models(client: ollama.Client, http: httpx.Client, served: dict[str, Any], model: str) -> None:
    names = [m.model for m in client.list().models]
    assert names == [model, TOOL_MODEL, THINKING_MODEL]
    [listed] = [m for m in client.list().models if m.model == model]
    assert listed.size > 0 and len(listed.digest) == 64 and listed.details.format == "safetensors"
    shown = client.show(model)
    assert (shown.details.family, shown.details.families) == ("qwen3", ["qwen3"])
    assert shown.modelinfo["qwen3.context_length"] > 0 and shown.modelinfo["general.parameter_count"] > 0
    assert shown.capabilities == ["completion", "thinking"] and shown.template == CHAT_TEMPLATE
    assert f"num_ctx {KV_LEN}" in shown.parameters.splitlines()
    assert "tools" in client.show(TOOL_MODEL).capabilities
    running = {m.model: m for m in client.ps().models}
    assert running[model].context_length == KV_LEN and running[model].details.family == "qwen3"
    assert http.get("/api/version").json()["version"].count(".") == 2


def test_tool_call_comes_back_parsed(client: ollama.Client, served: dict[str, Any], http: httpx.Client) -> None:
    script = served[TOOL_MODEL]
    fields = {"model": TOOL_MODEL, "tools": TOOLS, "options": GREEDY | {"num_predict": 16}}
    reply = client.chat(messages=script["messages"], **fields)
    [call] = reply.message.tool_calls
    assert (call.function.name, call.function.arguments) == (CALL["name"], CALL["arguments"])
    assert reply.done_reason == "stop" and reply.eval_count == script["completion_tokens"]
    streamed = [p for p in client.chat(messages=script["messages"], stream=True, **fields) if p.message.tool_calls]
    assert [c.function.arguments for p in streamed for c in p.message.tool_calls] == [CALL["arguments"]]

    follow_up = script["messages"] + [reply.message.model_dump(exclude_none=True),
                                      {"role": "tool", "content": "22 degrees", "tool_name": CALL["name"]}]
    answered = client.chat(messages=follow_up, **fields | {"options": GREEDY | {"num_predict": 2}})
    conversation = script["messages"] + [     # the Python client keeps no call id: the call is named by its place
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": CALL["name"],
                                                             "arguments": json.dumps(CALL["arguments"])}}]},
        {"role": "tool", "name": CALL["name"], "content": "22 degrees"}]
    assert answered.prompt_eval_count == prompt_tokens(http, conversation, tools=TOOLS, model=TOOL_MODEL)


def test_format_with_a_json_schema(client: ollama.Client, http: httpx.Client, model: str) -> None:
    reply = client.chat(model=model, messages=HELLO, format=SMALL_SCHEMA, think=False,
                        options=GREEDY | {"num_predict": 60})
    jsonschema.validate(json.loads(reply.message.content), SMALL_SCHEMA)
    expected = chat(http, HELLO, model=model, max_tokens=60, reasoning_effort="none", response_format={
        "type": "json_schema", "json_schema": {"name": "format", "schema": SMALL_SCHEMA}})
    assert reply.message.content == expected["choices"][0]["message"]["content"]
    as_json = client.generate(model=model, prompt=HELLO[0]["content"], format="json", think=False,
                              options=GREEDY | {"num_predict": 60})
    assert isinstance(json.loads(as_json.response), dict)


def test_think(client: ollama.Client, served: dict[str, Any]) -> None:
    script = served[THINKING_MODEL]
    fields = {"model": THINKING_MODEL, "messages": script["messages"],
              "options": GREEDY | {"num_predict": script["max_tokens"]}}
    reply = client.chat(**fields, think=True)
    assert reply.message.thinking.strip() == script["reasoning"].strip()
    assert reply.message.content.strip() == script["content"].strip()
    streamed = list(client.chat(**fields, think=True, stream=True))
    assert "".join(p.message.thinking or "" for p in streamed) == reply.message.thinking
    assert client.chat(**fields, think=False).message.thinking is None
    with pytest.raises(ollama.ResponseError) as refused:
        client.chat(**fields, think="high")
    assert refused.value.status_code == 400 and "levels: none, on" in refused.value.error


def ollama_error(response: httpx.Response, status: int, code: str, param: str | None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert isinstance(body["error"], str) and body["error"], body
    assert (body["code"], body["param"]) == (code, param), body
    return body


@pytest.mark.parametrize("body, code, param", [
    ({"messages": HELLO, "options": {"temperature": "warm"}}, "invalid_type", "options.temperature"),
    ({"messages": HELLO, "options": {"top_p": 3}}, "invalid_value", "options.top_p"),
    ({"messages": HELLO, "options": {"num_predict": 0}}, "invalid_value", "options.num_predict"),
    ({"messages": HELLO, "options": {"num_ctx": KV_LEN + 1}}, "invalid_value", "options.num_ctx"),
    ({"messages": HELLO, "options": {"stop": ["a", ""]}}, "invalid_value", "options.stop[1]"),
    ({"messages": [HELLO[0] | {"images": ["iVBORw0KGgo="]}]}, "invalid_value", "messages[0].images"),
    ({"messages": HELLO, "think": "sometimes"}, "unsupported_reasoning_effort", "think"),
    ({"messages": HELLO, "format": "yaml"}, "invalid_value", "format"),
    ({"messages": HELLO, "keep_alive": "soon"}, "invalid_value", "keep_alive"),
    ({"messages": [{"role": "robot", "content": "Hi"}]}, "invalid_value", "messages[0].role"),
])
def test_bad_chat_input_is_an_ollama_error(http: httpx.Client, model: str, body: dict, code: str, param: str) -> None:
    error = ollama_error(http.post("/api/chat", json={"model": model, "stream": False} | body), 400, code, param)
    assert error["error"].startswith(param) or param in ("messages[0].images", "think")


def test_other_errors_are_ollama_shaped(client: ollama.Client, http: httpx.Client, model: str) -> None:
    ollama_error(http.post("/api/generate", json={"model": model, "prompt": "Hi", "images": ["iVBORw0KGgo="]}),
                 400, "invalid_value", "images")
    ollama_error(http.post("/api/generate", json={"model": model, "prompt": "Hi", "suffix": "end"}), 400,
                 "invalid_value", "suffix")
    ollama_error(http.post("/api/chat", json={"model": "llama3:8b", "messages": HELLO}), 404, "model_not_found",
                 "model")
    ollama_error(http.post("/api/chat", content=b"{nope", headers={"content-type": "application/json"}), 400,
                 "invalid_json", None)
    ollama_error(http.get("/api/nope"), 404, "not_found", None)
    ollama_error(http.post("/api/embed", json={"model": model, "input": "Hi", "options": {"num_ctx": 10**6}}), 400,
                 "invalid_value", "options.num_ctx")
    too_deep: dict[str, Any] = {"type": "string"}
    for _ in range(200):
        too_deep = {"type": "object", "properties": {"a": too_deep}}
    refused = ollama_error(http.post("/api/chat", json={"model": model, "messages": HELLO, "format": too_deep}), 400,
                           "invalid_value", "format")    # structured output's bound, named as Ollama's body does
    assert "nests more than" in refused["error"]
    for action, call in (("pull", lambda: client.pull(model)), ("delete", lambda: client.delete(model)),
                         ("copy", lambda: client.copy(model, "other"))):
        with pytest.raises(ollama.ResponseError) as refused:
            call()
        assert refused.value.status_code == 501 and f"/api/{action} is not supported" in refused.value.error
        assert "model files given to lse-server" in refused.value.error
    with pytest.raises(ollama.ResponseError) as refused:
        client.chat(model=model, messages=HELLO, options={"num_ctx": KV_LEN * 2})
    assert refused.value.status_code == 400 and "num_ctx" in refused.value.error


def test_unknown_options_are_ignored_with_a_warning(http: httpx.Client, model: str) -> None:
    body = {"model": model, "messages": HELLO, "stream": False, "options": GREEDY | {"num_predict": 4}}
    plain = http.post("/api/chat", json=body).json()
    warned = http.post("/api/chat", json=body | {"options": body["options"] | {"mirostat": 2, "num_gpu": 99}}).json()
    assert warned["message"] == plain["message"] and "lse_warnings" not in plain
    assert warned["lse_warnings"] == [
        {"cause": f"options.{name} is not supported by LSE; it was ignored", "type": "ignored_option"}
        for name in ("mirostat", "num_gpu")]


def test_keep_alive(client: ollama.Client, model: str, served: dict[str, Any]) -> None:
    """keep_alive sets how long the model stays loaded once idle; 0 unloads it once its request ends."""
    other = TOOL_MODEL
    client.generate(model=other, prompt="Hi", keep_alive="5m", options={"num_predict": 1})
    expires = {m.model: m.expires_at for m in client.ps().models}[other]
    assert timedelta(minutes=4) < expires - datetime.now(UTC) <= timedelta(minutes=5)
    assert client.generate(model=other, keep_alive=0).done_reason == "unload"
    wait_until(lambda: other not in {m.model for m in client.ps().models})
    assert client.generate(model=other).done_reason == "load"
    assert other in {m.model for m in client.ps().models}
    client.chat(model=other, messages=HELLO, keep_alive=0, options={"num_predict": 1})
    wait_until(lambda: other not in {m.model for m in client.ps().models})
    assert client.generate(model=other, keep_alive=1e300).done_reason == "load"   # past any timestamp: forever
    assert {m.model: m.expires_at for m in client.ps().models}[other] == datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC)


def wait_until(condition: Any, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the model was not unloaded"
        time.sleep(0.05)


def test_openapi_describes_the_replies(http: httpx.Client, model: str) -> None:
    """/openapi.json declares each /api/ route, and its answers are valid against the schemas it names."""
    doc = http.get("/openapi.json").json()
    assert {f"/api/{name}" for name in ("chat", "generate", "embed", "embeddings", "show", "tags", "ps", "version",
                                        "pull", "delete")} <= set(doc["paths"])
    body = {"model": model, "messages": HELLO, "options": {"num_predict": 3}}
    validate(body, "ChatRequest", doc)
    validate(http.post("/api/chat", json=body | {"stream": False}).json(), "ChatResponse", doc)
    with http.stream("POST", "/api/chat", json=body) as response:
        *parts, last = lines(response)
    for part in parts:
        validate(part, "ChatPart", doc)
    validate(last, "ChatResponse", doc)
    validate(http.post("/api/generate", json={"model": model}).json(), "LoadResponse", doc)
    validate(http.post("/api/embed", json={"model": model, "input": ["Hi"]}).json(), "EmbedResponse", doc)
    validate(http.post("/api/embeddings", json={"model": model, "prompt": "Hi"}).json(), "EmbeddingResponse", doc)
    validate(http.post("/api/show", json={"model": model}).json(), "ShowResponse", doc)
    for path, schema in (("tags", "OllamaModelList"), ("ps", "RunningList"), ("version", "Version")):
        validate(http.get(f"/api/{path}").json(), schema, doc)
    validate(http.post("/api/chat", json={"model": model, "messages": "Hi"}).json(), "OllamaError", doc)
    validate(http.post("/api/pull", json={"model": model}).json(), "OllamaError", doc)


def test_the_server_still_serves_after_bad_input(client: ollama.Client, model: str) -> None:
    assert client.chat(model=model, messages=HELLO, options={"num_predict": 2}).eval_count >= 1


def test_a_failed_stream_ends_with_an_error_line(tiny_checkpoint) -> None:
    """A streamed request that fails (CPU fallback refused) is a 200 stream whose one line is the Ollama error
    object, which the client raises; unstreamed, it is a 500 with that object."""
    model = tiny_checkpoint("qwen3", chat_template=CHAT_TEMPLATE)
    options = ("--kv-len", str(KV_LEN), "--pool", "hrx:0", "--no-cpu-fallback")
    with lse_server(model, *options, env=HRX) as server, server.client() as http:
        for path, body in (("/api/chat", {"messages": HELLO}), ("/api/generate", {"prompt": "Hi"})):
            with http.stream("POST", path, json=body | {"options": {"num_predict": 3}}) as response:
                [error] = lines(response)
            assert error == ollama_error(http.post(path, json=body | {"stream": False}), 500, None, None)
            assert error["type"] == "server_error" and error["error"].startswith("CPU fallback disabled: ")
        with pytest.raises(ollama.ResponseError, match="CPU fallback disabled: "):
            list(ollama.Client(host=server.url, headers={"Authorization": f"Bearer {API_KEY}"}).chat(
                model=model.name, messages=HELLO, stream=True))
        assert http.get("/health").json() == {"status": "ok"}


# ---- the npm package ----

@pytest.fixture(scope="module")
def ollama_js(request: pytest.FixtureRequest) -> Path:
    """node_modules holding the ollama npm package, installed once into the pytest cache."""
    directory = request.config.cache.mkdir(f"ollama-npm-{OLLAMA_JS}")
    if not (directory / "node_modules" / "ollama").is_dir():
        subprocess.run([shutil.which("npm") or "npm", "install", "--no-save", "--no-audit", "--no-fund", "--prefix",
                        str(directory), f"ollama@{OLLAMA_JS}"], check=True, capture_output=True, timeout=300)
    return directory / "node_modules"


def test_the_npm_client(ollama_js: Path, served: dict[str, Any], client: ollama.Client, http: httpx.Client,
                        model: str) -> None:
    script = served[TOOL_MODEL]
    config = {"host": served["server"].url, "key": API_KEY, "model": model, "messages": HELLO,
              "tool_model": TOOL_MODEL, "tool_messages": script["messages"], "tools": TOOLS,
              "schema": SMALL_SCHEMA}
    run = subprocess.run(["node", str(Path(__file__).parent / "ollama_client.cjs"), json.dumps(config)],
                         capture_output=True, text=True, timeout=300, env=os.environ | {"NODE_PATH": str(ollama_js)})
    assert run.returncode == 0, run.stderr
    results = json.loads(run.stdout)
    options = GREEDY | {"num_predict": 6}
    expected = client.chat(model=model, messages=HELLO, options=options).message.content
    assert results["chat"]["content"] == results["chat_stream"]["content"] == expected
    assert results["chat_stream"]["last"]["done"] and results["chat_stream"]["last"]["eval_count"] > 0
    assert results["generate"] == client.generate(model=model, prompt=HELLO[0]["content"], options=options).response
    embedded = client.embed(model=model, input=["Hello", "Paris"]).embeddings
    assert [pytest.approx(v, abs=CLOSE) for v in results["embed"]] == embedded
    assert model in results["list"]
    assert results["show"] == {"family": "qwen3", "capabilities": ["completion", "thinking"]}
    [call] = results["tool_calls"]
    assert (call["function"]["name"], call["function"]["arguments"]) == (CALL["name"], CALL["arguments"])
    jsonschema.validate(json.loads(results["format"]), SMALL_SCHEMA)
    assert results["pull"]["status"] == 501 and "model files" in results["pull"]["error"]
