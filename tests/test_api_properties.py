"""Property tests: any body, valid-ish or junk, sent to lse_request on one open engine ends in
exactly one end event or one 4xx error event with the spec's error shape, and never wedges the
engine: a valid request right after each one still completes."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tokenizers
from checkpoints import train_tokenizer
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_api_contract import TEMPLATES, events_of, open_engine

from lse_core.api import LSE, lse_status

VOCAB = tokenizers.Tokenizer.from_str(train_tokenizer()).get_vocab_size()   # the tiny checkpoints' tokenizer
HEALTHY = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}


@pytest.fixture(scope="module")
def lse(tiny_checkpoint) -> Iterator[LSE]:
    model: Path = tiny_checkpoint("qwen3", chat_template=(TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text())
    with open_engine(model) as engine:
        yield engine


# ---- strategies ----

huge_numbers = st.sampled_from([0, -1, 2**31, 2**63 - 1, 2**63, 2**64, 10**30, -(10**30), 1e308, -1e308, 1e-320])
nan_strings = st.sampled_from(["NaN", "nan", "Infinity", "-Infinity", "1e999", "", " ", "null", "true", "0x10"])
scalars = (st.none() | st.booleans() | st.integers() | st.floats() | huge_numbers | nan_strings
           | st.text(max_size=12))
junk = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)

# Valid values for every field; a body is all valid, valid but for one junk field, or junk.
roles = st.sampled_from(["system", "user", "assistant", "tool", "developer"])
text_part = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)})
message = st.fixed_dictionaries({"role": roles, "content": st.text(max_size=40) | st.lists(text_part, max_size=3)},
                                optional={"name": st.text(min_size=1, max_size=8)})
token_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)
levels = st.sampled_from(["none", "on"])
stops = st.text(min_size=1, max_size=4) | st.lists(st.text(min_size=1, max_size=4), max_size=4)
COMMON: dict[str, st.SearchStrategy] = {
    "model": st.sampled_from(["", "nosuch"]),
    "max_tokens": st.integers(1, 6),
    "max_completion_tokens": st.integers(1, 6),
    "temperature": st.floats(-1.0, 3.0),
    "top_k": st.integers(-1, 50),
    "top_p": st.floats(0.0, 1.0),
    "min_p": st.floats(0.0, 1.0),
    "presence_penalty": st.floats(-3.0, 3.0),
    "repetition_penalty": st.floats(0.1, 3.0),
    "frequency_penalty": st.floats(-3.0, 3.0),
    "seed": st.integers(0, 2**63 - 1),
    "stop": stops,
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "n": st.just(1),
    "reasoning_effort": levels,
    "enable_thinking": st.booleans(),
    "thinking": st.booleans() | st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled"])}),
    "reasoning": st.fixed_dictionaries({"effort": levels}),
    "unknown_field": junk,
}
CHAT = COMMON | {
    "messages": st.lists(message, min_size=1, max_size=4),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 20),
    "chat_template_kwargs": st.fixed_dictionaries({}, optional={"enable_thinking": st.booleans(),
                                                                 "reasoning_effort": levels, "x": junk}),
    "tools": st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": st.text(min_size=1, max_size=8)})}), max_size=2),
    "tool_choice": st.sampled_from(["none", "auto", "required"]),
}
COMPLETION = COMMON | {
    "prompt": st.text(min_size=1, max_size=60) | token_ids | st.lists(st.text(min_size=1, max_size=20), max_size=1),
    "logprobs": st.integers(0, 5),
    "echo": st.booleans(),
}


def bodies(fields: dict[str, st.SearchStrategy], required: str) -> st.SearchStrategy:
    optional = {name: s for name, s in fields.items() if name != required}
    valid = st.fixed_dictionaries({required: fields[required]}, optional=optional)
    one_junk = st.tuples(valid, st.sampled_from(sorted(fields)), junk).map(lambda t: t[0] | {t[1]: t[2]})
    return valid | one_junk | junk


# ---- the properties ----

def check_outcome(lse: LSE, body: Any, endpoint: str) -> None:
    events = events_of(lse, body, endpoint, timeout=60)
    *tokens, last = events
    event(f"{last.kind} {last.status}")     # pytest --hypothesis-show-statistics shows the mix
    assert all(e.kind == "token" for e in tokens)
    for received in events:
        json.dumps(received.data, allow_nan=False)       # every event is sendable as JSON
    if last.kind == "error":
        assert 400 <= last.status < 500, last.data
        assert not tokens
        error = last.data["error"]
        assert {"message", "type", "code", "param"} <= set(error)
        assert isinstance(error["message"], str) and error["message"]
        assert error["type"] == "invalid_request_error" if last.status == 400 else isinstance(error["type"], str)
        assert isinstance(error["code"], str) and (error["param"] is None or isinstance(error["param"], str))
    else:
        assert last.kind == "end"
        final = last.data[0] if isinstance(last.data, list) else last.data
        assert final["choices"][0]["stop_reason"] in ("stop_token", "stop_sequence", "max_tokens", "context_full")
        assert {"lse_context", "timings"} <= set(final)
    healthy = events_of(lse, HEALTHY, "chat", timeout=60)[-1]
    assert healthy.kind == "end" and healthy.data["usage"]["completion_tokens"] == 1


PROPERTY = settings(max_examples=100, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@PROPERTY
@given(body=bodies(CHAT, "messages"))
def test_any_chat_body_ends_cleanly(lse: LSE, body: Any) -> None:
    check_outcome(lse, body, "chat")


@PROPERTY
@given(body=bodies(COMPLETION, "prompt"))
def test_any_completion_body_ends_cleanly(lse: LSE, body: Any) -> None:
    check_outcome(lse, body, "completion")


def test_engine_is_idle_afterwards(lse: LSE) -> None:
    deadline = time.monotonic() + 30
    while lse_status(lse)["engine"]["free_slots"] != 2:
        assert time.monotonic() < deadline, lse_status(lse)["engine"]
        time.sleep(0.01)
    assert lse_status(lse)["engine"]["waiting"] == 0
