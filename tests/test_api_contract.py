"""The spec's request contract end to end over the in-process API (lse_request on a tiny llama
checkpoint, CPU interpreter): every row of the Output limits, Context full and Sampling defaults
tables, stop strings, end-of-turn tokens, cancellation, timings, logprobs, seeds and penalties.

Expected JSON is written from the spec; expected tokens and log-probabilities come from Hugging Face
transformers running the same checkpoint (tests/checkpoints.py hf_greedy), never from LSE itself."""

from __future__ import annotations

import json
import queue
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

import jinja2.sandbox
import numpy as np
import pytest
import tokenizers
from checkpoints import hf_greedy

from lse_core.api import (
    LSE,
    Event,
    lse_close,
    lse_model_info,
    lse_open_or_raise,
    lse_request,
    lse_request_iter,
    lse_status,
)
from lse_core.config import LSEConfig

TEMPLATES = Path("/work/shared/fixtures/chat_templates")
KV_LEN = 64
# SmolLM2's template adds a long default system prompt unless the conversation brings its own.
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
TEXT_PROMPT = "The quick brown fox"
TIMINGS_KEYS = {"prompt_n", "prompt_ms", "prompt_per_second", "predicted_n", "predicted_ms",
                "predicted_per_second"}


# ---- helpers shared with test_api_properties.py and test_thinking_e2e.py ----

@contextmanager
def open_engine(model: Path, **options: Any) -> Iterator[LSE]:
    """An engine on the CPU interpreter with a small context, closed afterwards."""
    settings = {"kv_len": KV_LEN, "parallel": 2, "pool": "cpu:0"} | options
    lse = lse_open_or_raise(LSEConfig(model=str(model), **settings))
    try:
        yield lse
    finally:
        lse_close(lse)


def events_of(lse: LSE, body: Any, endpoint: str = "chat", timeout: float = 120.0) -> list[Event]:
    """Every event of one request; the last is its end or error event. Fails rather than hangs."""
    events: queue.Queue[Event] = queue.Queue()
    lse_request(lse, body, events.put, endpoint)
    received = []
    while not received or received[-1].kind == "token":
        received.append(events.get(timeout=timeout))
    return received


def reply(lse: LSE, body: dict[str, Any], endpoint: str = "chat") -> dict[str, Any]:
    """The whole (non-streamed) reply; every one carries lse_context and timings. Token events
    come before it as the reply grows, streamed or not."""
    events = events_of(lse, body, endpoint)
    assert events[-1].kind == "end", events[-1].data
    data = events[-1].data
    json.dumps(data, allow_nan=False)
    assert set(data["timings"]) >= TIMINGS_KEYS and data["timings"]["predicted_n"] == \
        data["usage"]["completion_tokens"]
    assert data["lse_context"]["tokens_used"] == data["usage"]["total_tokens"]
    return data


def streamed(lse: LSE, body: dict[str, Any], endpoint: str = "chat") -> tuple[list[dict], list[dict]]:
    """A streamed reply: (delta chunks, closing chunks)."""
    events = events_of(lse, body | {"stream": True}, endpoint)
    assert events[-1].kind == "end", events[-1].data
    assert all(e.kind == "token" for e in events[:-1])
    return [e.data for e in events[:-1]], events[-1].data


def error(lse: LSE, body: Any, endpoint: str = "chat") -> tuple[int, dict[str, Any]]:
    events = events_of(lse, body, endpoint)
    assert [e.kind for e in events] == ["error"], events[-1].data
    return events[0].status, events[0].data


def text_of(data: dict[str, Any]) -> str:
    choice = data["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def streamed_text(chunks: list[dict], key: str = "content") -> str:
    """The streamed deltas joined: chat's delta[key]; for completions, text (key "content") or key."""
    parts = []
    for chunk in chunks:
        choice = chunk["choices"][0]
        if "delta" in choice:
            parts.append(choice["delta"].get(key) or "")
        else:
            parts.append(choice.get("text" if key == "content" else key) or "")
    return "".join(parts)


def render_reference(template: str, messages: list[dict], **variables: Any) -> str:
    """The prompt as transformers' apply_chat_template renders it (its sandbox and whitespace settings)."""
    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda value, **kw: json.dumps(value, **kw)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=True, **variables)


def vocab(model: Path) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(model / "tokenizer.json"))


@cache
def hf_reference(model: Path, prompt: tuple[int, ...], n: int) -> tuple[list[int], np.ndarray]:
    """transformers' greedy ids and the logits behind each, for this checkpoint and prompt."""
    return hf_greedy(model, list(prompt), n)


def variant(base: Path, directory: Path, generation_config: dict[str, Any] | None = None,
            config: dict[str, Any] | None = None) -> Path:
    """A copy of ``base`` with its own generation_config.json and extra config.json fields (the
    weights are unchanged, so the copy is cheap and behaves the same)."""
    model = directory / "model"
    shutil.copytree(base, model)
    if generation_config is not None:
        (model / "generation_config.json").write_text(json.dumps(generation_config))
    if config:
        written = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps(written | config))
    return model


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max()
    return shifted - np.log(np.exp(shifted).sum())


# ---- fixtures ----

@pytest.fixture(scope="module")
def base(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama", chat_template=(TEMPLATES / "HuggingFaceTB-SmolLM2-135M-Instruct.jinja").read_text())


@pytest.fixture(scope="module")
def lse(base: Path) -> Iterator[LSE]:
    # a float32 KV cache: the logprobs are held to transformers' fp32 ones within 1e-4
    with open_engine(base, cache_type_k="f32", cache_type_v="f32") as engine:
        yield engine


@pytest.fixture(scope="module")
def chat_prompt(base: Path) -> tuple[int, ...]:
    template = (base / "chat_template.jinja").read_text()
    return tuple(vocab(base).encode(render_reference(template, MESSAGES), add_special_tokens=False).ids)


@pytest.fixture(scope="module")
def text_prompt(base: Path) -> tuple[int, ...]:
    return tuple(vocab(base).encode(TEXT_PROMPT).ids)


def chat(**fields: Any) -> dict[str, Any]:
    """A chat body, greedy unless the test says otherwise (a random model may sample its end token)."""
    return {"messages": MESSAGES, "temperature": 0} | fields


def completion(**fields: Any) -> dict[str, Any]:
    return {"prompt": TEXT_PROMPT, "temperature": 0} | fields


# ---- Output limits: how a reply ends ----

@pytest.mark.parametrize("endpoint", ["chat", "completion"])
def test_end_of_turn_token_is_stop_token(base: Path, tmp_path: Path, text_prompt, chat_prompt, endpoint: str) -> None:
    """Make a token the model really emits at step k an end-of-turn token (generation_config.json
    eos_token_id): the reply is the k tokens before it, finish_reason stop, stop_reason stop_token."""
    decode = vocab(base).decode
    ids, _ = hf_reference(base, chat_prompt if endpoint == "chat" else text_prompt, 12)
    k = next(k for k in range(1, len(ids)) if ids[k] not in ids[:k] and "\ufffd" not in decode(ids[:k]))
    with open_engine(variant(base, tmp_path, generation_config={"eos_token_id": ids[k]})) as lse:
        data = reply(lse, (chat() if endpoint == "chat" else completion()) | {"temperature": 0}, endpoint)
    choice = data["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", "stop_token")
    assert text_of(data) == decode(ids[:k])
    assert data["usage"]["completion_tokens"] == k + 1    # the end-of-turn token counts


def stop_straddling_tokens(model: Path, ids: list[int]) -> tuple[str, str]:
    """A stop string that begins inside one generated token and ends in the next, first seen there;
    returns (stop, the text before it)."""
    decode = vocab(model).decode
    for i in range(len(ids) - 1):
        before, token, after = decode(ids[:i]), decode([ids[i]]), decode([ids[i + 1]])
        if "\ufffd" in before + token + after or len(token) < 2 or not after:
            continue
        stop = token[-2:] + after[0]
        if stop not in before + token[:-2]:
            return stop, before + token[:-2]
    raise AssertionError(f"no clean stop string in {decode(ids)!r}")


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
def test_stop_string_ends_the_reply_and_never_appears(lse: LSE, base: Path, text_prompt, chat_prompt,
                                                      endpoint: str) -> None:
    prompt = chat_prompt if endpoint == "chat" else text_prompt
    stop, expected = stop_straddling_tokens(base, hf_reference(base, prompt, 24)[0])
    body = (chat() if endpoint == "chat" else completion()) | {"temperature": 0, "stop": ["never here", stop]}
    data = reply(lse, body, endpoint)
    assert text_of(data) == expected
    assert (data["choices"][0]["finish_reason"], data["choices"][0]["stop_reason"]) == ("stop", "stop_sequence")
    chunks, closing = streamed(lse, body, endpoint)
    assert streamed_text(chunks) == expected
    assert not any(stop in streamed_text([c]) for c in chunks)
    assert closing[-1]["choices"][0]["stop_reason"] == "stop_sequence"


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
def test_request_max_tokens_ends_at_length(lse: LSE, endpoint: str) -> None:
    body = (chat() if endpoint == "chat" else completion()) | {"max_tokens": 3, "temperature": 0}
    data = reply(lse, body, endpoint)
    assert (data["choices"][0]["finish_reason"], data["choices"][0]["stop_reason"]) == ("length", "max_tokens")
    assert data["usage"]["completion_tokens"] == 3


def test_cancel_ends_with_cancelled_and_no_finish_reason(lse: LSE) -> None:
    """Request.cancel() at the first token: the engine thread waits in the callback until the
    Request exists, so the reply cannot run on before the cancel lands."""
    events: queue.Queue[Event] = queue.Queue()
    requests: queue.Queue = queue.Queue()

    def on_event(event: Event) -> None:
        if event.kind == "token" and not received_first.is_set():
            received_first.set()
            requests.get(timeout=60).cancel()
        events.put(event)

    received_first = threading.Event()
    requests.put(lse_request(lse, chat(), on_event))
    received = [events.get(timeout=60)]
    while received[-1].kind == "token":
        received.append(events.get(timeout=60))
    end = received[-1]
    assert end.kind == "end"
    choice = end.data["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == (None, "cancelled")
    assert end.data["usage"]["completion_tokens"] == len(received) - 1 == 1
    assert set(end.data["timings"]) >= TIMINGS_KEYS and "lse_context" in end.data


def cancelled_and_idle(status: dict[str, Any]) -> bool:
    return status["engine"]["free_slots"] == 2 and any(
        r["outcome"] == "cancelled" for r in status["stats"]["requests"])


def test_leaving_the_iterator_cancels_and_frees_the_slot(lse: LSE) -> None:
    for event in lse_request_iter(lse, chat(stream=True, temperature=0)):
        assert event.kind == "token"
        break
    deadline = time.monotonic() + 30
    while not cancelled_and_idle(lse_status(lse)):
        assert time.monotonic() < deadline, lse_status(lse)
        time.sleep(0.01)
    assert reply(lse, chat(max_tokens=2))["usage"]["completion_tokens"] == 2


# ---- Output limits: which token limit applies ----

def test_max_tokens_wins_over_max_completion_tokens(lse: LSE) -> None:
    data = reply(lse, completion(max_tokens=2, max_completion_tokens=5), "completion")
    assert data["usage"]["completion_tokens"] == 2
    data = reply(lse, completion(max_completion_tokens=4), "completion")
    assert (data["usage"]["completion_tokens"], data["choices"][0]["stop_reason"]) == (4, "max_tokens")


def test_null_token_limits_mean_not_sent(lse: LSE) -> None:
    data = reply(lse, completion(max_tokens=None, max_completion_tokens=None), "completion")
    assert data["choices"][0]["stop_reason"] == "context_full"
    assert data["usage"]["total_tokens"] == KV_LEN


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("value", [0, -1, 2.5, "3", True, [3]])
def test_token_limits_must_be_positive_integers(lse: LSE, field: str, value: Any) -> None:
    status, body = error(lse, chat(**{field: value}))
    assert status == 400
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == field


def test_operator_cap(base: Path) -> None:
    with open_engine(base, max_tokens=5) as lse:
        data = reply(lse, chat())                                    # the cap is the limit
        assert (data["usage"]["completion_tokens"], data["choices"][0]["stop_reason"]) == (5, "max_tokens")
        assert reply(lse, chat(max_tokens=2))["usage"]["completion_tokens"] == 2
        assert reply(lse, chat(max_tokens=5))["usage"]["completion_tokens"] == 5
        for field in ("max_tokens", "max_completion_tokens"):
            status, body = error(lse, chat(**{field: 6}))
            assert status == 400
            assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == "max_tokens"


def test_generation_config_max_new_tokens(base: Path, tmp_path: Path) -> None:
    with open_engine(variant(base, tmp_path, generation_config={"max_new_tokens": 4})) as lse:
        data = reply(lse, chat())
        assert (data["usage"]["completion_tokens"], data["choices"][0]["stop_reason"]) == (4, "max_tokens")
        assert reply(lse, chat(max_tokens=6))["usage"]["completion_tokens"] == 6    # the request wins
    with open_engine(variant(base, tmp_path / "capped", generation_config={"max_new_tokens": 4}),
                     max_tokens=7) as lse:
        assert reply(lse, chat())["usage"]["completion_tokens"] == 7                # the cap wins


def test_no_limit_runs_to_the_context(lse: LSE) -> None:
    data = reply(lse, chat())
    assert (data["choices"][0]["finish_reason"], data["choices"][0]["stop_reason"]) == ("length", "context_full")
    assert data["usage"]["total_tokens"] == KV_LEN


def test_max_length_bounds_prompt_plus_reply_except_for_the_request(base: Path, tmp_path: Path,
                                                                    chat_prompt) -> None:
    max_length = len(chat_prompt) + 3
    model = variant(base, tmp_path, generation_config={"max_length": max_length, "max_new_tokens": 10})
    with open_engine(model) as lse:                                          # bounds max_new_tokens
        data = reply(lse, chat())
        assert data["usage"]["total_tokens"] == max_length
        assert data["choices"][0]["stop_reason"] == "max_tokens"
        assert reply(lse, chat(max_tokens=6))["usage"]["completion_tokens"] == 6   # item 1 is not bounded
    with open_engine(model, max_tokens=8) as lse:                            # bounds the operator cap
        assert reply(lse, chat())["usage"]["total_tokens"] == max_length
    with open_engine(variant(base, tmp_path / "short", generation_config={"max_length": 10})) as lse:
        data = reply(lse, chat())                             # the prompt alone is past max_length
        assert data["usage"]["completion_tokens"] == 0 and text_of(data) == ""
        assert data["choices"][0]["finish_reason"] == "length"
        assert streamed(lse, chat())[1][-1]["choices"][0]["finish_reason"] == "length"
    no_limit = variant(base, tmp_path / "alone", generation_config={"max_length": max_length})
    with open_engine(no_limit) as lse:                                       # bounds "no limit"
        data = reply(lse, chat())
        assert data["usage"]["total_tokens"] == max_length
        assert data["choices"][0]["finish_reason"] == "length"


def test_context_bounds_every_limit(base: Path, tmp_path: Path) -> None:
    model = variant(base, tmp_path, generation_config={"max_new_tokens": 500, "max_length": 1000})
    with open_engine(model, max_tokens=400) as lse:
        for body in (chat(), chat(max_tokens=300)):
            data = reply(lse, body)
            assert data["usage"]["total_tokens"] == KV_LEN
            assert data["choices"][0]["stop_reason"] == "context_full"


def test_model_max_length_and_config_json_max_length_are_not_output_limits(base: Path, tmp_path: Path) -> None:
    model = variant(base, tmp_path, config={"max_length": 20})     # transformers' old serialized default
    tokenizer_config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps(tokenizer_config | {"model_max_length": 30}))
    with open_engine(model) as lse:
        data = reply(lse, chat())
        assert data["choices"][0]["stop_reason"] == "context_full" and data["usage"]["total_tokens"] == KV_LEN
        defaults = lse_model_info(lse)["generation_defaults"]
        assert (defaults["max_new_tokens"], defaults["max_length"]) == (None, None)


# ---- Context full ----

def test_reply_that_fills_the_context_is_the_specs_response(lse: LSE, chat_prompt) -> None:
    data = reply(lse, chat())
    prompt_tokens = len(chat_prompt)
    assert data["object"] == "chat.completion"
    choice = data["choices"][0]
    assert choice["index"] == 0 and choice["logprobs"] is None
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert (choice["finish_reason"], choice["stop_reason"]) == ("length", "context_full")
    usage = data["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert usage == {"prompt_tokens": prompt_tokens, "completion_tokens": KV_LEN - prompt_tokens,
                     "total_tokens": KV_LEN, "prompt_tokens_details": {"cached_tokens": cached},
                     "completion_tokens_details": {"reasoning_tokens": 0}}
    assert data["lse_context"] == {"tokens_used": KV_LEN, "context_length": KV_LEN, "tokens_remaining": 0}
    assert lse_model_info(lse)["served"]["context_length"] == KV_LEN       # the same as /v1/models
    assert data["timings"]["prompt_n"] == prompt_tokens - cached


def test_reply_that_fills_the_context_streamed(lse: LSE, chat_prompt) -> None:
    chunks, closing = streamed(lse, chat())
    assert all(c["object"] == "chat.completion.chunk" for c in chunks + closing)
    assert all("lse_context" not in c for c in chunks)
    final = closing[-1]
    assert final["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length",
                                 "stop_reason": "context_full"}]
    assert final["lse_context"] == {"tokens_used": KV_LEN, "context_length": KV_LEN, "tokens_remaining": 0}
    assert set(final["timings"]) >= TIMINGS_KEYS
    assert final["timings"]["predicted_n"] == KV_LEN - len(chat_prompt)


def test_completion_that_fills_the_context(lse: LSE, text_prompt) -> None:
    data = reply(lse, completion(), "completion")
    assert data["object"] == "text_completion"
    choice = data["choices"][0]
    assert "message" not in choice and isinstance(choice["text"], str)
    assert (choice["finish_reason"], choice["stop_reason"]) == ("length", "context_full")
    assert data["usage"]["prompt_tokens"] == len(text_prompt)
    assert data["lse_context"] == {"tokens_used": KV_LEN, "context_length": KV_LEN, "tokens_remaining": 0}
    chunks, closing = streamed(lse, completion(), "completion")
    assert closing[-1]["choices"][0]["stop_reason"] == "context_full"
    assert closing[-1]["lse_context"] == data["lse_context"]


def test_lse_context_with_room_left_and_cached_tokens(base: Path, chat_prompt) -> None:
    with open_engine(base) as lse:
        first = reply(lse, chat(max_tokens=2))
        again = reply(lse, chat(max_tokens=2))
    prompt_tokens = len(chat_prompt)
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < prompt_tokens                          # the same prompt reuses the slot's prefix
    for data in (first, again):                               # cached tokens still count as used
        assert data["usage"]["prompt_tokens"] == prompt_tokens
        assert data["lse_context"] == {"tokens_used": prompt_tokens + 2, "context_length": KV_LEN,
                                       "tokens_remaining": KV_LEN - prompt_tokens - 2}
    assert again["timings"]["prompt_n"] == prompt_tokens - cached


@pytest.mark.parametrize("extra", [0, 9])
def test_prompt_that_fills_the_context_is_the_specs_400(lse: LSE, base: Path, extra: int) -> None:
    """A prompt of exactly context_length tokens, or more, is refused before any work starts."""
    tokenizer = vocab(base)
    words = " ".join(["Paris"] * (KV_LEN + extra))
    ids = tokenizer.encode(words).ids
    ids = ids[: KV_LEN + extra]
    assert len(ids) == KV_LEN + extra
    steps = lse_status(lse)["engine"]["steps"]
    status, body = error(lse, {"prompt": ids}, "completion")
    assert status == 400
    assert body == {"error": {
        "message": f"the prompt is {KV_LEN + extra} tokens and the context holds {KV_LEN}; "
                   "compact or shorten the conversation",
        "type": "invalid_request_error", "code": "context_full", "param": "prompt",
        "lse_context": {"tokens_used": KV_LEN + extra, "context_length": KV_LEN, "tokens_remaining": 0}}}
    long_chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": words}]
    template = (base / "chat_template.jinja").read_text()
    chat_tokens = len(tokenizer.encode(render_reference(template, long_chat), add_special_tokens=False).ids)
    status, body = error(lse, {"messages": long_chat, "stream": True})
    assert status == 400
    assert body == {"error": {
        "message": f"the prompt is {chat_tokens} tokens and the context holds {KV_LEN}; "
                   "compact or shorten the conversation",
        "type": "invalid_request_error", "code": "context_full", "param": "messages",
        "lse_context": {"tokens_used": chat_tokens, "context_length": KV_LEN, "tokens_remaining": 0}}}
    assert lse_status(lse)["engine"]["steps"] == steps


def test_one_token_of_room(lse: LSE, text_prompt) -> None:
    prompt = list(text_prompt) * (KV_LEN // len(text_prompt) + 1)
    data = reply(lse, {"prompt": prompt[: KV_LEN - 1]}, "completion")
    assert data["usage"]["completion_tokens"] == 1
    assert data["choices"][0]["stop_reason"] == "context_full"
    assert data["lse_context"]["tokens_remaining"] == 0


# ---- Sampling defaults ----

NEUTRAL = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0,
           "presence_penalty": 0.0, "max_new_tokens": None, "max_length": None}
FIELDS = list(NEUTRAL)


def test_neutral_defaults(lse: LSE) -> None:
    info = lse_model_info(lse)
    expected = NEUTRAL | {"sources": dict.fromkeys(FIELDS, "lse_default")}
    assert info["generation_defaults"] == expected
    assert info["served"]["generation_defaults"] == expected


def test_specs_generation_defaults_example(base: Path, tmp_path: Path) -> None:
    model = variant(base, tmp_path, generation_config={"temperature": 1.0, "top_k": 20, "top_p": 0.95})
    with open_engine(model) as lse:
        assert lse_model_info(lse)["generation_defaults"] == {
            "temperature": 1.0, "top_k": 20, "top_p": 0.95, "min_p": 0.0,
            "repetition_penalty": 1.0, "presence_penalty": 0.0,
            "max_new_tokens": None, "max_length": None,
            "sources": {
                "temperature": "generation_config.json", "top_k": "generation_config.json",
                "top_p": "generation_config.json", "min_p": "lse_default",
                "repetition_penalty": "lse_default", "presence_penalty": "lse_default",
                "max_new_tokens": "lse_default", "max_length": "lse_default"}}


def test_sources_from_each_file_in_order(base: Path, tmp_path: Path) -> None:
    model = variant(base, tmp_path, generation_config={"top_k": 40, "max_new_tokens": 100, "max_length": 300},
                    config={"generation_config": {"top_k": 5, "top_p": 0.8, "min_p": 0.05},
                            "top_p": 0.5, "repetition_penalty": 1.1, "presence_penalty": 0.3})
    with open_engine(model) as lse:
        defaults = lse_model_info(lse)["generation_defaults"]
    assert defaults == {
        "temperature": 1.0, "top_k": 40, "top_p": 0.8, "min_p": 0.05,
        "repetition_penalty": 1.1, "presence_penalty": 0.3, "max_new_tokens": 100, "max_length": 300,
        "sources": {"temperature": "lse_default", "top_k": "generation_config.json", "top_p": "config.json",
                    "min_p": "config.json", "repetition_penalty": "config.json",
                    "presence_penalty": "config.json", "max_new_tokens": "generation_config.json",
                    "max_length": "generation_config.json"}}


def greedy_text(lse: LSE) -> str:
    return text_of(reply(lse, completion(max_tokens=8), "completion"))


def test_do_sample_false_makes_the_default_greedy(base: Path, tmp_path: Path) -> None:
    with open_engine(base) as lse:
        greedy = greedy_text(lse)
    model = variant(base, tmp_path, generation_config={"do_sample": False, "temperature": 0.7})
    with open_engine(model) as lse:
        defaults = lse_model_info(lse)["generation_defaults"]
        assert (defaults["temperature"], defaults["sources"]["temperature"]) == (0.0, "generation_config.json")
        for seed in (1, 2, 3):
            assert text_of(reply(lse, completion(max_tokens=8, seed=seed, temperature=None), "completion")) == greedy


def test_do_sample_false_in_config_json(base: Path, tmp_path: Path) -> None:
    with open_engine(variant(base, tmp_path, config={"do_sample": False})) as lse:
        defaults = lse_model_info(lse)["generation_defaults"]
    assert (defaults["temperature"], defaults["sources"]["temperature"]) == (0.0, "config.json")


def test_server_temperature_is_a_server_option(base: Path, tmp_path: Path) -> None:
    model = variant(base, tmp_path, generation_config={"temperature": 0.7, "top_k": 20})
    with open_engine(model, temperature=0.0) as lse:
        defaults = lse_model_info(lse)["generation_defaults"]
        assert (defaults["temperature"], defaults["sources"]["temperature"]) == (0.0, "server_option")
        assert defaults["sources"]["top_k"] == "generation_config.json"
        greedy = greedy_text(lse)
        assert all(text_of(reply(lse, completion(max_tokens=8, seed=s, temperature=None), "completion")) == greedy
                   for s in (4, 5))


def test_model_defaults_reach_sampling(base: Path, tmp_path: Path) -> None:
    """top_k 1 from generation_config.json leaves only the best token: sampling at temperature 1
    gives the greedy reply whatever the seed, until the request turns top_k off."""
    with open_engine(base) as lse:
        greedy = greedy_text(lse)
    with open_engine(variant(base, tmp_path, generation_config={"top_k": 1})) as lse:
        sampled = completion(max_tokens=8, temperature=None)
        for seed in (1, 2, 3):
            assert text_of(reply(lse, sampled | {"seed": seed, "top_k": None}, "completion")) == greedy
        for off in (0, -1):                                                       # 0 and -1 turn it off
            replies = {text_of(reply(lse, sampled | {"seed": seed, "top_k": off}, "completion")) for seed in (1, 2, 3)}
            assert replies != {greedy}


@pytest.mark.parametrize("fields", [{"temperature": -1.0}, {"top_k": 1}, {"top_p": 0.0}, {"min_p": 1.0}])
def test_request_fields_that_leave_only_the_best_token(lse: LSE, fields: dict) -> None:
    """Temperature 0 or less is greedy; top_k 1, top_p 0 and min_p 1 each keep only the top token."""
    greedy = greedy_text(lse)
    for seed in (1, 2, 3):
        assert text_of(reply(lse, completion(max_tokens=8, temperature=1.0, seed=seed) | fields,
                             "completion")) == greedy


# ---- timings, logprobs, seeds ----

def test_timings_in_every_response(lse: LSE) -> None:
    for endpoint, body in (("chat", chat(max_tokens=3)), ("completion", completion(max_tokens=3))):
        data = reply(lse, body, endpoint)
        timings = data["timings"]
        assert timings["predicted_n"] == 3 and timings["prompt_n"] >= 1
        assert all(timings[k] >= 0 for k in TIMINGS_KEYS)
        _, closing = streamed(lse, body, endpoint)
        assert closing[-1]["timings"]["predicted_n"] == 3


def test_chat_logprobs_in_openais_shape(lse: LSE, base: Path, chat_prompt) -> None:
    body = chat(max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    data = reply(lse, body)
    logprobs = data["choices"][0]["logprobs"]
    assert set(logprobs) == {"content", "refusal"} and logprobs["refusal"] is None
    entries = logprobs["content"]
    assert len(entries) == 4
    for entry in entries:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["token"] in (bytes(entry["bytes"]).decode("utf-8", errors="ignore"),
                                  "bytes:" + bytes(entry["bytes"]).decode("utf-8", errors="backslashreplace"))
        top = entry["top_logprobs"]
        assert len(top) == 3 and all(set(t) == {"token", "logprob", "bytes"} for t in top)
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert (entry["token"], entry["logprob"]) == (top[0]["token"], top[0]["logprob"])  # greedy: the best
    ids, logits = hf_reference(base, chat_prompt, 4)
    expected = log_softmax(logits[0])
    assert [e["bytes"] for e in entries] == [list(byte_level_bytes(base, i)) for i in ids]
    assert entries[0]["logprob"] == pytest.approx(expected[ids[0]], abs=1e-4)
    best = np.argsort(-expected)[:3]
    assert [t["logprob"] for t in entries[0]["top_logprobs"]] == pytest.approx(expected[best].tolist(), abs=1e-4)
    chunks, _ = streamed(lse, body)
    # the same tokens; the logprobs to rounding, as the stream may reuse the cached prompt
    streamed_entries = [e for c in chunks for e in (c["choices"][0]["logprobs"] or {"content": []})["content"]]
    assert flat_logprobs(streamed_entries) == pytest.approx(flat_logprobs(entries), abs=1e-6)
    assert [(e["bytes"], [t["bytes"] for t in e["top_logprobs"]]) for e in streamed_entries] == \
        [(e["bytes"], [t["bytes"] for t in e["top_logprobs"]]) for e in entries]


def flat_logprobs(entries: list[dict[str, Any]]) -> list[float]:
    return [lp for e in entries for lp in (e["logprob"], *(t["logprob"] for t in e["top_logprobs"]))]


def byte_level_bytes(model: Path, token: int) -> bytes:
    """A byte-level vocabulary's token as bytes, through transformers' own byte alphabet."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = {c: b for b, c in bytes_to_unicode().items()}
    return bytes(alphabet[c] for c in vocab(model).id_to_token(token))


def test_completion_logprobs_in_openais_shape(lse: LSE, base: Path, text_prompt) -> None:
    # This prompt's third and fourth greedy tokens are single bytes of one UTF-8 character.
    data = reply(lse, completion(max_tokens=4, logprobs=2), "completion")
    logprobs = data["choices"][0]["logprobs"]
    assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    ids, logits = hf_reference(base, text_prompt, 4)
    spelled = [byte_level_bytes(base, i) for i in ids]
    assert b"".join(spelled).decode("utf-8", errors="replace") == data["choices"][0]["text"]
    assert len(spelled[2]) == 1 and spelled[2][0] >= 0x80       # the case the check is for
    tokens = logprobs["tokens"]
    assert tokens[:2] == [t.decode("utf-8") for t in spelled[:2]]
    assert tokens[2] == f"bytes:\\x{spelled[2][0]:02x}"
    text, offsets = data["choices"][0]["text"], logprobs["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    for k, token in enumerate(spelled):
        if not 0x80 <= token[0] < 0xC0:     # it starts a character: the text from there is its bytes on
            assert text[offsets[k]:] == b"".join(spelled[k:]).decode("utf-8", errors="replace"), k
    for top, token, logprob in zip(logprobs["top_logprobs"], tokens, logprobs["token_logprobs"]):
        assert len(top) == 2 and top[token] == logprob == max(top.values())     # greedy: the best
    assert logprobs["token_logprobs"][0] == pytest.approx(log_softmax(logits[0])[ids[0]], abs=1e-4)
    assert reply(lse, completion(max_tokens=1), "completion")["choices"][0]["logprobs"] is None


def test_same_seed_and_body_give_the_same_reply(lse: LSE) -> None:
    body = completion(max_tokens=12, temperature=1.0, seed=1234)
    first = text_of(reply(lse, body, "completion"))
    assert text_of(reply(lse, body, "completion")) == first
    assert streamed_text(streamed(lse, body, "completion")[0]) == first
    others = {text_of(reply(lse, body | {"seed": s}, "completion")) for s in (1, 2, 3)}
    assert others != {first}


def test_a_seeded_reply_does_not_depend_on_its_batch(lse: LSE) -> None:
    """The same seeded request, decoded beside another sampled request, gives the same reply."""
    body = completion(max_tokens=12, temperature=1.0, seed=99)
    alone = text_of(reply(lse, body, "completion"))
    events: dict[str, queue.Queue[Event]] = {"other": queue.Queue(), "seeded": queue.Queue()}
    lse_request(lse, chat(temperature=1.0, seed=5), events["other"].put)
    lse_request(lse, body, events["seeded"].put, "completion")
    ends = {}
    for name, received in events.items():
        while (event := received.get(timeout=60)).kind == "token":
            pass
        ends[name] = event
    assert ends["other"].kind == "end"
    assert text_of(ends["seeded"].data) == alone


# ---- penalties, against a numpy computation from transformers' logits ----

def penalized(logits: np.ndarray, seen: set[int], presence: float = 0.0, repetition: float = 1.0) -> np.ndarray:
    """The spec: presence_penalty is subtracted once from each distinct seen token's logit;
    repetition_penalty divides a seen token's positive logit and multiplies a negative one."""
    out = logits.astype(np.float64).copy()
    idx = np.array(sorted(seen))
    out[idx] = np.where(out[idx] > 0, out[idx] / repetition, out[idx] * repetition) - presence
    return out


@pytest.fixture(scope="module")
def repeating_prompt(base: Path) -> tuple[tuple[int, ...], np.ndarray]:
    """A prompt whose greedy next token is one it already holds (tiny random models repeat), and
    the logits for that next token."""
    tokenizer = vocab(base)
    for text in ("Paris is the capital of", "The quick brown fox", "def add(a, b):", "Tokens are sampled"):
        prompt = tuple(tokenizer.encode(text).ids)
        ids, _ = hf_reference(base, prompt, 6)
        for k in range(6):
            candidate = prompt + tuple(ids[:k])
            if ids[k] in candidate:
                _, logits = hf_reference(base, candidate, 1)
                return candidate, logits[0]
    raise AssertionError("no prompt whose greedy continuation repeats a token")


@pytest.mark.parametrize("fields, presence, repetition", [
    ({"presence_penalty": 4.0}, 4.0, 1.0),
    ({"repetition_penalty": 3.0}, 0.0, 3.0),
    ({"frequency_penalty": 2.0}, 0.0, 3.0),          # repetition_penalty = 1 + frequency_penalty
    ({"frequency_penalty": 2.0, "repetition_penalty": 1.0}, 0.0, 1.0),   # an explicit one wins
])
def test_penalties_change_the_greedy_token_as_specified(lse: LSE, repeating_prompt, fields: dict,
                                                        presence: float, repetition: float) -> None:
    prompt, logits = repeating_prompt
    plain = int(np.argmax(logits))
    expected = penalized(logits, set(prompt), presence, repetition)
    chosen = int(np.argmax(expected))
    assert plain in prompt and (chosen != plain) == (presence != 0.0 or repetition != 1.0)
    assert np.sort(expected)[-1] - np.sort(expected)[-2] > 1e-3     # no near-tie to flip
    body = {"prompt": list(prompt), "max_tokens": 1, "temperature": 0, "logprobs": 1}
    assert reply(lse, body, "completion")["choices"][0]["logprobs"]["tokens"] == [vocab_token(lse, plain)]
    data = reply(lse, body | fields, "completion")
    assert data["choices"][0]["logprobs"]["tokens"] == [vocab_token(lse, chosen)]


def vocab_token(lse: LSE, token: int) -> str:
    return lse.model.tokenizer.decode([token])


def test_penalties_look_at_the_last_64_tokens_only(base: Path) -> None:
    """A prompt [x] + 64 other tokens, where x is the best token once every token of the 64 is
    penalized: x is out of the window, so the engine picks it (penalizing the whole prompt would not)."""
    filler = list(range(100, 164))
    x = 0
    for _ in range(10):                                    # a fixed point: x is the best unpenalized token
        _, logits = hf_reference(base, (x, *filler), 1)
        best = int(np.argmax(penalized(logits[0], set(filler), presence=50.0)))
        if best == x:
            break
        x = best
    assert best == x and x not in filler
    whole = penalized(logits[0], set(filler) | {x}, presence=50.0)
    assert int(np.argmax(whole)) != x
    with open_engine(base, kv_len=128) as lse:
        body = {"prompt": [x, *filler], "max_tokens": 1, "temperature": 0, "logprobs": 1, "presence_penalty": 50.0}
        data = reply(lse, body, "completion")
    assert data["choices"][0]["logprobs"]["tokens"] == [vocab_token(lse, x)]


def test_a_failing_consumer_fails_nobody_else(lse: LSE) -> None:
    """An on_event callback that raises must not fail the other sequences of the engine step, nor
    stop the engine."""
    def broken(event: Event) -> None:
        raise RuntimeError("a consumer bug")

    other: queue.Queue[Event] = queue.Queue()
    lse_request(lse, chat(max_tokens=6), other.put)
    lse_request(lse, chat(max_tokens=6), broken)
    while (event := other.get(timeout=60)).kind == "token":
        pass
    assert event.kind == "end" and event.data["usage"]["completion_tokens"] == 6
    assert reply(lse, chat(max_tokens=2))["usage"]["completion_tokens"] == 2

