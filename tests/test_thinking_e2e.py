"""Thinking levels end to end over the in-process API, on tiny qwen3 checkpoints carrying real
templates (Qwen3's own, and the synthetic Qwen3.8 one with effort levels) and a tokenizer that knows
<think> and </think> as added tokens, as Qwen3's does.

A random model never writes </think> by itself. So the tests make it: the model's vocabulary is
permuted (embedding and output rows swapped) so that the tokens it greedily emits at chosen steps
become <think> and </think>. The permuted model is exactly the original one with those ids renamed,
so transformers' greedy ids on the original checkpoint say which text falls inside the block."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tokenizers
from checkpoints import train_tokenizer, write_checkpoint
from safetensors.numpy import load_file, save_file
from test_api_contract import (
    TEMPLATES,
    error,
    hf_reference,
    open_engine,
    render_reference,
    reply,
    streamed,
    streamed_text,
    text_of,
)
from test_thinking_probe import FIRST as LEVEL_TEXT_FIRST

from lse_core.api import LSE, lse_model_info

QWEN3 = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text()
QWEN38 = (TEMPLATES / "qwen38-synthetic.jinja").read_text()
SMOLLM2 = (TEMPLATES / "HuggingFaceTB-SmolLM2-135M-Instruct.jinja").read_text()
# Effort levels and no switch: a template that always thinks.
ALWAYS_THINKS = """\
{%- set effort = reasoning_effort if reasoning_effort is defined and reasoning_effort is not none else 'high' %}
{%- if effort not in ('low', 'high') %}{{ raise_exception('reasoning_effort must be low or high') }}{% endif %}
{{- '<|im_start|>system\\nThink ' + effort + '.<|im_end|>\\n' }}
{%- for message in messages %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"""
# A switch that is off unless the request turns it on.
OFF_BY_DEFAULT = """\
{%- for message in messages %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking %}{{ '<think>\\n' }}
{%- else %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}
{%- endif %}"""
QWEN38_LEVELS = ["none", "xhigh", "medium", "low"]
USER_MESSAGES = ["What is the capital of France?", "Hello!", "Count to five.", "Write add(a, b).", "Name a capital."]


def thinking_checkpoint(directory: Path, template: str, extra_tokens: tuple[str, ...] = ()) -> Path:
    """A tiny qwen3 checkpoint whose tokenizer has <think>, </think> and ``extra_tokens`` as added
    (not special) tokens at the end of the vocabulary, with ``template`` in chat_template.jinja."""
    added = ("<think>", "</think>", *extra_tokens)
    base_vocab = tokenizers.Tokenizer.from_str(train_tokenizer()).get_vocab_size()
    model = write_checkpoint(directory, "qwen3", chat_template=template, vocab_size=base_vocab + len(added))
    tokenizer = tokenizers.Tokenizer.from_file(str(model / "tokenizer.json"))
    tokenizer.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False) for t in added])
    tokenizer.save(str(model / "tokenizer.json"))
    config = json.loads((model / "tokenizer_config.json").read_text())
    for marker in added:
        config["added_tokens_decoder"][str(tokenizer.token_to_id(marker))] = {"content": marker, "special": False}
    (model / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return model


def with_template(base: Path, directory: Path, template: str) -> Path:
    model = directory / "model"
    shutil.copytree(base, model)
    (model / "chat_template.jinja").write_text(template)
    return model


def renamed(base: Path, directory: Path, swaps: dict[int, int]) -> Path:
    """A copy of ``base`` whose token ids are renamed: each key's embedding and output rows trade
    places with its value's. The copy computes exactly what ``base`` does, with the ids renamed."""
    model = directory / "model"
    shutil.copytree(base, model)
    weights = load_file(str(model / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        rows = weights[name]
        for a, b in swaps.items():
            rows[[a, b]] = rows[[b, a]]
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    return model


def vocab(model: Path) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(model / "tokenizer.json"))


def prompt_ids(model: Path, template: str, messages: list[dict], **variables: Any) -> list[int]:
    text = render_reference(template, messages, **variables)
    return vocab(model).encode(text, add_special_tokens=False).ids


def user(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


# ---- checkpoints and engines ----

@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return thinking_checkpoint(tmp_path_factory.mktemp("qwen3_thinking"), QWEN3)


@pytest.fixture(scope="module")
def markers(qwen3: Path) -> tuple[int, int]:
    tokenizer = vocab(qwen3)
    return tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>")


@pytest.fixture(scope="module")
def scripted(qwen3: Path, tmp_path_factory) -> dict[str, Any]:
    return scripted_thinking(qwen3, tmp_path_factory.mktemp("scripted"))


def scripted_thinking(qwen3: Path, directory: Path) -> dict[str, Any]:
    """A conversation whose greedy reply, once ids are renamed, opens with <think>, closes it at
    step k, then goes on: the renamed checkpoint (in ``directory``), the prompt, and the reply's
    expected parts. ``qwen3`` is a thinking_checkpoint with Qwen3's template."""
    tokenizer = vocab(qwen3)
    think, end = tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>")
    decode = tokenizer.decode
    for content in USER_MESSAGES:
        prompt = prompt_ids(qwen3, QWEN3, user(content), enable_thinking=True)
        ids, _ = hf_reference(qwen3, tuple(prompt), 16)
        first = ids[0]
        for k in range(2, 10):
            close, inside = ids[k], ids[1:k]
            if close in ids[:k] or first in inside or {first, close} & set(prompt):
                continue
            after = ids[k + 1:]
            after = after[:next((i for i, t in enumerate(after) if t in (first, close)), len(after))]
            while after and decode(after).endswith("\ufffd"):    # an unfinished character is held back
                after = after[:-1]
            reasoning, content_text = decode(inside), decode(after)
            if not reasoning.strip() or not content_text.strip():
                continue
            model = renamed(qwen3, directory, {first: think, close: end})
            reply_ids = [think, *inside, end, *after]
            return {"model": model, "messages": user(content), "prompt": prompt, "reply_ids": reply_ids,
                    "max_tokens": len(reply_ids), "reasoning": reasoning, "content": content_text}
    raise AssertionError("no conversation whose greedy reply can be scripted into a <think> block")


@pytest.fixture(scope="module")
def scripted_lse(scripted: dict[str, Any]) -> Iterator[LSE]:
    with open_engine(scripted["model"], kv_len=96) as lse:
        yield lse


@pytest.fixture(scope="module")
def qwen38(qwen3: Path, tmp_path_factory) -> Path:
    return with_template(qwen3, tmp_path_factory.mktemp("qwen38"), QWEN38)


@pytest.fixture(scope="module")
def qwen38_lse(qwen38: Path) -> Iterator[LSE]:
    with open_engine(qwen38, kv_len=256) as lse:
        yield lse


@pytest.fixture(scope="module")
def smollm2_lse(tiny_checkpoint) -> Iterator[LSE]:
    with open_engine(tiny_checkpoint("llama", chat_template=SMOLLM2), kv_len=128) as lse:
        yield lse


@pytest.fixture(scope="module")
def always_thinks_lse(qwen3: Path, tmp_path_factory) -> Iterator[LSE]:
    with open_engine(with_template(qwen3, tmp_path_factory.mktemp("always"), ALWAYS_THINKS)) as lse:
        yield lse


# ---- the thinking object ----

def test_qwen3_levels(scripted_lse: LSE, scripted: dict[str, Any]) -> None:
    off = {"id": "none", "enable_thinking": False, "reasoning_effort": None, "instruction": None,
           "opens_reasoning": False, "default": False}
    on = {"id": "on", "enable_thinking": True, "reasoning_effort": None, "instruction": None,
          "opens_reasoning": False, "default": True}     # Qwen3's generation prompt leaves <think> to the model
    expected = {"supported": True, "source": str(scripted["model"] / "chat_template.jinja"),
                "toggle": "enable_thinking", "effort": None, "default_level": "on", "levels": [off, on]}
    info = lse_model_info(scripted_lse)
    assert info["thinking"] == expected and info["served"]["thinking"] == expected


def test_qwen38_levels(qwen38_lse: LSE, qwen38: Path) -> None:
    thinking = lse_model_info(qwen38_lse)["thinking"]
    assert {k: v for k, v in thinking.items() if k != "levels"} == {
        "supported": True, "source": str(qwen38 / "chat_template.jinja"), "toggle": "enable_thinking",
        "effort": "reasoning_effort", "default_level": "xhigh"}
    assert thinking["levels"] == [
        {"id": "none", "enable_thinking": False, "reasoning_effort": None,
         "instruction": None, "opens_reasoning": False, "default": False},
        {"id": "xhigh", "enable_thinking": True, "reasoning_effort": "xhigh",
         "instruction": "Reasoning effort is set to xhigh. Please think carefully through the task, validate key "
                        "assumptions, consider plausible alternatives, and prioritize correctness, consistency, "
                        "and clarity in the final answer.",
         "opens_reasoning": True, "default": True},
        {"id": "medium", "enable_thinking": True, "reasoning_effort": "medium",
         "instruction": None, "opens_reasoning": True, "default": False},
        {"id": "low", "enable_thinking": True, "reasoning_effort": "low",
         "instruction": "Reasoning effort is set to low. Keep your thinking brief and focused, moving directly to "
                        "the conclusion without unnecessary elaboration.",
         "opens_reasoning": True, "default": False}]


def test_model_without_controls(smollm2_lse: LSE) -> None:
    thinking = lse_model_info(smollm2_lse)["thinking"]
    assert (thinking["supported"], thinking["default_level"], thinking["levels"]) == (False, None, [])
    assert (thinking["toggle"], thinking["effort"]) == (None, None)


# ---- rendering: each level is its own prompt ----

def prompt_tokens(lse: LSE, body: dict[str, Any]) -> int:
    return reply(lse, body | {"max_tokens": 1, "temperature": 0})["usage"]["prompt_tokens"]


def test_thinking_on_and_off_render_different_prompts(scripted_lse: LSE, scripted: dict[str, Any]) -> None:
    model, messages = scripted["model"], scripted["messages"]
    on = len(prompt_ids(model, QWEN3, messages, enable_thinking=True))
    off = len(prompt_ids(model, QWEN3, messages, enable_thinking=False))
    assert off > on
    body = {"messages": messages}
    assert prompt_tokens(scripted_lse, body) == on                                   # rule 3: the default
    assert prompt_tokens(scripted_lse, body | {"enable_thinking": True}) == on       # rule 2
    assert prompt_tokens(scripted_lse, body | {"reasoning_effort": "on"}) == on      # rule 1
    for off_body in ({"enable_thinking": False}, {"thinking": {"type": "disabled"}}, {"thinking": False},
                     {"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"},
                     {"reasoning": {"effort": "none"}}, {"reasoning_effort": "none", "enable_thinking": False}):
        assert prompt_tokens(scripted_lse, body | off_body) == off, off_body


@pytest.mark.parametrize("body, variables", [
    ({}, {}),                                                                  # rule 3: xhigh
    ({"enable_thinking": True}, {"enable_thinking": True, "reasoning_effort": "xhigh"}),  # rule 2: the default
    ({"enable_thinking": False}, {"enable_thinking": False}),                   # rule 2: none
    ({"reasoning_effort": "medium"}, {"enable_thinking": True, "reasoning_effort": "medium"}),
    ({"thinking_level": "low"}, {"enable_thinking": True, "reasoning_effort": "low"}),
    ({"chat_template_kwargs": {"reasoning_effort": "medium"}}, {"reasoning_effort": "medium"}),
    ({"reasoning": {"effort": "low"}, "thinking": {"type": "enabled"}}, {"reasoning_effort": "low"}),
    ({"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": False}}, {"enable_thinking": False}),
])
def test_each_spelling_renders_its_level(qwen38_lse: LSE, qwen38: Path, body: dict, variables: dict) -> None:
    messages = user("Hello!")
    assert prompt_tokens(qwen38_lse, {"messages": messages} | body) == \
        len(prompt_ids(qwen38, QWEN38, messages, **variables))


def test_levels_render_distinct_prompts(qwen38: Path) -> None:
    """The renderings above are not all the same prompt: medium drops xhigh's instruction, none
    closes the block."""
    messages = user("Hello!")
    lengths = {level: len(prompt_ids(qwen38, QWEN38, messages, enable_thinking=level != "none",
                                     **({"reasoning_effort": level} if level != "none" else {})))
               for level in QWEN38_LEVELS}
    assert len(set(lengths.values())) == 4


def test_model_without_controls_accepts_not_thinking(smollm2_lse: LSE) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    plain = prompt_tokens(smollm2_lse, {"messages": messages})
    for body in ({"reasoning_effort": "none"}, {"enable_thinking": False}, {"thinking": {"type": "disabled"}},
                 {"reasoning_effort": "none", "enable_thinking": False}):
        data = reply(smollm2_lse, {"messages": messages, "max_tokens": 1} | body)
        assert data["usage"]["prompt_tokens"] == plain
        assert "reasoning_content" not in data["choices"][0]["message"]


def test_switch_on_when_the_default_does_not_think(qwen3: Path, tmp_path: Path) -> None:
    """Rule 2: enable_thinking true picks the first level that thinks when the default does not."""
    model = with_template(qwen3, tmp_path, OFF_BY_DEFAULT)
    messages = user("Hello!")
    with open_engine(model) as lse:
        thinking = lse_model_info(lse)["thinking"]
        assert (thinking["default_level"], [level["id"] for level in thinking["levels"]]) == ("none", ["none", "on"])
        assert prompt_tokens(lse, {"messages": messages}) == len(prompt_ids(model, OFF_BY_DEFAULT, messages))
        on = len(prompt_ids(model, OFF_BY_DEFAULT, messages, enable_thinking=True))
        assert prompt_tokens(lse, {"messages": messages, "enable_thinking": True}) == on
        data = reply(lse, {"messages": messages, "enable_thinking": True, "max_tokens": 3, "temperature": 0})
        message = data["choices"][0]["message"]   # the prompt opened the block: the reply is reasoning
        assert message["content"] == "" and message["reasoning_content"]


def test_effort_levels_whose_generation_prompt_opens_the_block(qwen3: Path, tmp_path: Path) -> None:
    """Issue 23: effort levels and no switch, each level's text first in the system prompt, a generation prompt
    ending in '<think>\\n' and no '</think>' in the template. Each level reports its whole text, renders it, and
    its reply starts inside the block."""
    model = with_template(qwen3, tmp_path, LEVEL_TEXT_FIRST)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    with open_engine(model) as lse:
        levels = lse_model_info(lse)["thinking"]["levels"]
        assert [(level["id"], level["instruction"], level["opens_reasoning"], level["default"]) for level in levels] \
            == [("low", "Think briefly.", True, False), ("high", "Think hard.", True, True)]
        for effort in ("low", "high"):
            body = {"messages": messages, "reasoning_effort": effort}
            assert prompt_tokens(lse, body) == \
                len(prompt_ids(model, LEVEL_TEXT_FIRST, messages, reasoning_effort=effort))
            message = reply(lse, body | {"max_tokens": 3, "temperature": 0})["choices"][0]["message"]
            assert message["content"] == "" and message["reasoning_content"]


# ---- the reasoning split ----

def test_reply_splits_into_reasoning_and_content(scripted_lse: LSE, scripted: dict[str, Any]) -> None:
    body = {"messages": scripted["messages"], "temperature": 0, "max_tokens": scripted["max_tokens"]}
    whole = reply(scripted_lse, body)
    message = whole["choices"][0]["message"]
    # the reply's tokens inside the block: those after <think>, up to and with </think>
    inside = scripted["reply_ids"].index(vocab(scripted["model"]).token_to_id("</think>"))
    assert whole["usage"]["completion_tokens_details"]["reasoning_tokens"] == inside
    assert message["reasoning_content"].strip() == scripted["reasoning"].strip()
    assert message["content"].strip() == scripted["content"].strip()
    assert "<think>" not in message["content"] + message["reasoning_content"]
    assert "</think>" not in message["content"] + message["reasoning_content"]

    chunks, closing = streamed(scripted_lse, body)
    assert streamed_text(chunks, "reasoning_content") == message["reasoning_content"]
    assert streamed_text(chunks) == message["content"]
    assert not any("think>" in streamed_text([c]) + streamed_text([c], "reasoning_content") for c in chunks)
    assert closing[-1]["choices"][0]["finish_reason"] == "length"


def test_thinking_off_is_not_split(scripted_lse: LSE, scripted: dict[str, Any]) -> None:
    body = {"messages": scripted["messages"], "temperature": 0, "max_tokens": 8, "enable_thinking": False}
    data = reply(scripted_lse, body)
    assert "reasoning_content" not in data["choices"][0]["message"]
    assert data["usage"]["completion_tokens"] == 8
    chunks, _ = streamed(scripted_lse, body)
    assert streamed_text(chunks) == text_of(data)
    assert streamed_text(chunks, "reasoning_content") == ""


def test_stop_string_inside_the_reasoning(scripted_lse: LSE, scripted: dict[str, Any]) -> None:
    """A stop string ends the reply inside the block: what came before it is reasoning, no content."""
    raw = scripted["reasoning"]
    stop = raw.strip()[-2:]
    body = {"messages": scripted["messages"], "temperature": 0, "stop": stop, "max_tokens": scripted["max_tokens"]}
    choice = reply(scripted_lse, body)["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", "stop_sequence")
    assert (choice["message"].get("reasoning_content") or "") == raw[:raw.index(stop)].lstrip()
    assert choice["message"]["content"] == ""


def completion_body(scripted: dict[str, Any], markers: tuple[int, int], **fields: Any) -> dict[str, Any]:
    """The chat prompt with the block already opened: the model goes on from inside it."""
    return {"prompt": scripted["prompt"] + [markers[0]], "temperature": 0,
            "max_tokens": scripted["max_tokens"] - 1} | fields


def test_completion_whose_prompt_opens_the_block(scripted_lse: LSE, scripted: dict[str, Any], markers) -> None:
    choice = reply(scripted_lse, completion_body(scripted, markers, enable_thinking=True), "completion")["choices"][0]
    assert choice["reasoning_content"].strip() == scripted["reasoning"].strip()
    assert choice["text"].strip() == scripted["content"].strip()
    chunks, _ = streamed(scripted_lse, completion_body(scripted, markers, reasoning_effort="on"), "completion")
    assert streamed_text(chunks, "reasoning_content") == choice["reasoning_content"]
    assert streamed_text(chunks) == choice["text"]


def test_completion_with_thinking_off_keeps_the_markers(scripted_lse: LSE, scripted: dict[str, Any],
                                                        markers) -> None:
    body = completion_body(scripted, markers, enable_thinking=False)
    choice = reply(scripted_lse, body, "completion")["choices"][0]
    assert "reasoning_content" not in choice
    assert choice["text"] == vocab(scripted["model"]).decode(scripted["reply_ids"][1:])
    assert "</think>" in choice["text"]


@pytest.fixture(scope="module")
def scripted_without_levels(scripted: dict[str, Any], tmp_path_factory) -> Iterator[LSE]:
    """The scripted model with SmolLM2's template: no thinking levels and no reasoning markers of its own."""
    with open_engine(with_template(scripted["model"], tmp_path_factory.mktemp("plain"), SMOLLM2), kv_len=96) as lse:
        yield lse


def test_completion_fields_split_think_markers_on_a_template_without_levels(
        scripted_without_levels: LSE, scripted: dict[str, Any], markers) -> None:
    """The spec: on /v1/completions the thinking fields decide whether <think> markers are split, whatever the
    template; sent none, the reply is the model's text as it is."""
    assert lse_model_info(scripted_without_levels)["thinking"]["supported"] is False
    body = completion_body(scripted, markers, enable_thinking=True)
    choice = reply(scripted_without_levels, body, "completion")["choices"][0]
    assert choice["reasoning_content"].strip() == scripted["reasoning"].strip()
    assert choice["text"].strip() == scripted["content"].strip()
    chunks, _ = streamed(scripted_without_levels, completion_body(scripted, markers, reasoning_effort="high"),
                         "completion")
    assert streamed_text(chunks, "reasoning_content") == choice["reasoning_content"]
    assert streamed_text(chunks) == choice["text"]
    plain = reply(scripted_without_levels, completion_body(scripted, markers), "completion")["choices"][0]
    assert "reasoning_content" not in plain and "</think>" in plain["text"]


def test_completion_fields_are_not_checked_against_the_template(qwen38_lse: LSE) -> None:
    """On /v1/completions the prompt is the client's; a level the template lacks is no error there."""
    data = reply(qwen38_lse, {"prompt": "Hello", "max_tokens": 1, "reasoning_effort": "high"}, "completion")
    assert data["usage"]["completion_tokens"] == 1


# ---- errors: the four codes, each with the model's levels ----

def assert_error(lse: LSE, body: dict[str, Any], code: str, param: str, levels: list[str],
                 endpoint: str = "chat") -> dict[str, Any]:
    status, data = error(lse, body, endpoint)
    assert status == 400
    err = data["error"]
    assert set(err) == {"message", "type", "code", "param", "levels"}
    assert (err["type"], err["code"], err["param"], err["levels"]) == ("invalid_request_error", code, param, levels)
    return err


def test_unsupported_reasoning_effort_is_the_specs_body(qwen38_lse: LSE) -> None:
    status, data = error(qwen38_lse, {"messages": user("Hi"), "reasoning_effort": "high"})
    assert status == 400
    assert data == {"error": {
        "message": "reasoning_effort 'high' is not defined by this model's chat template; levels: none, xhigh, "
                   "medium, low",
        "type": "invalid_request_error", "code": "unsupported_reasoning_effort",
        "param": "reasoning_effort", "levels": ["none", "xhigh", "medium", "low"]}}


@pytest.mark.parametrize("body, param", [
    ({"reasoning_effort": "minimal"}, "reasoning_effort"),
    ({"thinking_level": "on"}, "thinking_level"),                 # Qwen3's level, not this model's
    ({"chat_template_kwargs": {"reasoning_effort": "max"}}, "chat_template_kwargs.reasoning_effort"),
    ({"reasoning": {"effort": "HIGH"}}, "reasoning.effort"),
])
def test_unsupported_reasoning_effort(qwen38_lse: LSE, body: dict, param: str) -> None:
    assert_error(qwen38_lse, {"messages": user("Hi")} | body, "unsupported_reasoning_effort", param, QWEN38_LEVELS)


@pytest.mark.parametrize("body, param", [
    ({"enable_thinking": True}, "enable_thinking"),
    ({"thinking": {"type": "enabled"}}, "thinking"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"chat_template_kwargs": {"enable_thinking": True}}, "chat_template_kwargs.enable_thinking"),
])
def test_thinking_asked_of_a_model_without_controls(smollm2_lse: LSE, body: dict, param: str) -> None:
    assert_error(smollm2_lse, {"messages": user("Hi")} | body, "thinking_unsupported", param, [])


def test_conflict_on_a_model_without_controls(smollm2_lse: LSE) -> None:
    assert_error(smollm2_lse, {"messages": user("Hi"), "reasoning_effort": "none", "enable_thinking": True},
                 "conflicting_thinking", "enable_thinking", [])


def test_switching_off_a_template_that_always_thinks(always_thinks_lse: LSE) -> None:
    found = lse_model_info(always_thinks_lse)["thinking"]["levels"]
    # No rendering lacks a level (unset is high, other values raise): each level's text is its whole sentence.
    assert [(level["id"], level["instruction"]) for level in found] == [("low", "Think low."), ("high", "Think high.")]
    levels = [level["id"] for level in found]
    assert_error(always_thinks_lse, {"messages": user("Hi"), "enable_thinking": False}, "thinking_unsupported",
                 "enable_thinking", levels)
    assert reply(always_thinks_lse, {"messages": user("Hi"), "enable_thinking": True, "max_tokens": 1})


@pytest.mark.parametrize("body, param", [
    ({"reasoning_effort": "low", "thinking_level": "medium"}, "thinking_level"),
    ({"reasoning_effort": "low", "reasoning": {"effort": "xhigh"}}, "reasoning.effort"),
    ({"enable_thinking": True, "chat_template_kwargs": {"enable_thinking": False}},
     "chat_template_kwargs.enable_thinking"),
    ({"enable_thinking": False, "thinking": {"type": "enabled"}}, "thinking"),
    ({"reasoning_effort": "none", "enable_thinking": True}, "enable_thinking"),
    ({"reasoning_effort": "medium", "thinking": False}, "thinking"),
])
def test_conflicting_thinking(qwen38_lse: LSE, body: dict, param: str) -> None:
    assert_error(qwen38_lse, {"messages": user("Hi")} | body, "conflicting_thinking", param, QWEN38_LEVELS)


@pytest.mark.parametrize("body, param", [
    ({"reasoning_effort": 3}, "reasoning_effort"),
    ({"thinking_level": ["low"]}, "thinking_level"),
    ({"enable_thinking": "yes"}, "enable_thinking"),
    ({"chat_template_kwargs": {"enable_thinking": 1}}, "chat_template_kwargs.enable_thinking"),
    ({"thinking": "on"}, "thinking"),
    ({"thinking": {"type": "maybe"}}, "thinking"),
    ({"reasoning": "low"}, "reasoning"),
])
@pytest.mark.parametrize("endpoint", ["chat", "completion"])
def test_invalid_thinking(qwen38_lse: LSE, body: dict, param: str, endpoint: str) -> None:
    base = {"messages": user("Hi")} if endpoint == "chat" else {"prompt": "Hi"}
    assert_error(qwen38_lse, base | body, "invalid_thinking", param, QWEN38_LEVELS, endpoint)


def test_completion_checks_agreement(qwen38_lse: LSE) -> None:
    assert_error(qwen38_lse, {"prompt": "Hi", "reasoning_effort": "low", "enable_thinking": False},
                 "conflicting_thinking", "enable_thinking", QWEN38_LEVELS, "completion")


def test_the_engine_still_serves_after_the_errors(qwen38_lse: LSE) -> None:
    data = reply(qwen38_lse, {"messages": user("Hi"), "max_tokens": 2, "reasoning_effort": "low"})
    assert data["usage"]["completion_tokens"] == 2
    assert np.isfinite(data["timings"]["predicted_ms"])
