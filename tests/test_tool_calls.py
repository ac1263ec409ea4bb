"""Tool calls in replies: the streaming parser, and the JSON a client sees end to end.

A random model never writes a tool call. So the end-to-end tests make it, as test_thinking_e2e.py does:
the tokenizer gains `<tool_call>`, `</tool_call>` and one whole call's JSON as added tokens, and the
model's vocabulary is permuted so that the tokens it greedily emits at chosen steps become those tokens and
then the end-of-turn token. The permuted model is exactly the original one with those ids renamed, so
transformers' greedy ids on the original checkpoint say which text comes before the call."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tokenizers
from checkpoints import train_tokenizer, write_checkpoint
from test_api_contract import hf_reference, open_engine, render_reference, reply, streamed, streamed_text
from test_thinking_e2e import renamed

from lse_core.api import LSE
from lse_core.protocol import parse_chat
from lse_core.template.render import ChatTemplate
from lse_core.tools import (
    APRIEL,
    COMMAND_R,
    DEEPSEEK,
    GRANITE,
    HERMES,
    HERMES_XML,
    KIMI,
    LFM2,
    LLAMA3,
    MISTRAL,
    SOLAR,
    ToolCallFormat,
    ToolCallParser,
    parameter_types,
    parse_calls,
    tool_call_format,
)

TEMPLATES = Path("/work/shared/fixtures/chat_templates")
CALL = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
CALL_JSON = json.dumps(CALL)
CALL_ID = re.compile(r"call_[0-9a-f]{24}|[A-Za-z0-9]{9}")   # Mistral's templates check for 9 characters


def call_of(call: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A returned call checked for OpenAI's shape: its name and its decoded arguments."""
    assert set(call) == {"id", "type", "function"} and call["type"] == "function"
    assert CALL_ID.fullmatch(call["id"]) and set(call["function"]) == {"name", "arguments"}
    assert isinstance(call["function"]["arguments"], str)
    return call["function"]["name"], json.loads(call["function"]["arguments"])


def parse(deltas: list[str], call_format=HERMES, tools=None) -> tuple[list[str], list[dict[str, Any]]]:
    """The content streamed for each delta, then the held-back content, and the calls."""
    parser = ToolCallParser(call_format, tools)
    streamed_content = [parser.feed(delta) for delta in deltas]
    held, calls = parser.finish()
    return [*streamed_content, held], calls


# ---- the format, from the template's text, and a call as the template writes it ----

FORMATS: dict[str, ToolCallFormat | None] = {
    "Bielik-11B-v3.0-Instruct": HERMES, "CohereForAI-c4ai-command-r7b-12-2024-tool_use": COMMAND_R,
    "GLM-4.7-Flash": HERMES, "LFM2-8B-A1B": LFM2, "LFM2.5-8B-A1B": LFM2, "MiMo-VL": HERMES,
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": HERMES_XML, "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": HERMES,
    "Qwen-QwQ-32B": HERMES, "Qwen-Qwen2.5-7B-Instruct": HERMES, "Qwen-Qwen2.5-Coder-0.5B-Instruct": HERMES,
    "Qwen-Qwen3-0.6B": HERMES, "Qwen3-Coder": HERMES_XML, "Reka-Edge": HERMES, "qwen38-synthetic": HERMES,
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": DEEPSEEK, "deepseek-ai-DeepSeek-V3.1": DEEPSEEK,
    "ibm-granite-granite-3.3-2B-Instruct": GRANITE, "ibm-granite-granite-4.0": HERMES,
    "ibm-granite-granite-4.1": HERMES, "meta-llama-Llama-3.1-8B-Instruct": LLAMA3,
    "meta-llama-Llama-3.2-3B-Instruct": LLAMA3, "mistralai-Mistral-Nemo-Instruct-2407": MISTRAL,
    "moonshotai-Kimi-K2": KIMI, "ollama-laguna-v8": HERMES, "ollama-nemotron3nano": HERMES_XML,
    "poolside-Laguna-XS.2": HERMES, "stepfun-ai-Step-3.5-Flash": HERMES_XML, "unsloth-Apriel-1.5": APRIEL,
    "upstage-Solar-Open-100B": SOLAR,
    # no tools, or a way of calling LSE does not read (the reply stays content)
    "GigaChat3-10B-A1.8B": None, "HuggingFaceTB-SmolLM2-135M-Instruct": None, "HuggingFaceTB-SmolLM3-3B": None,
    "google-gemma-2-2b-it": None, "google-gemma-4-31B-it": None, "microsoft-Phi-3.5-mini-instruct": None,
    "openai-gpt-oss-120b": None,
}
# Templates that do not write an assistant's earlier calls: the format their instructions show.
SHOWN = {
    "ibm-granite-granite-3.3-2B-Instruct":
        '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]',
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B":
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        '```json\n{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
}
WEATHER_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
WEATHER_ARGUMENTS = {"city": "Paris", "days": 3}
END_OF_TURN = ("</s>", "<|eot_id|>", "<|end_of_text|>", "<|im_end|>", "<｜end▁of▁sentence｜>")


def template_source(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


def test_every_fixture_template_is_classified() -> None:
    assert set(FORMATS) == {path.stem for path in TEMPLATES.glob("*.jinja")}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_format_comes_from_the_template(name: str) -> None:
    assert tool_call_format(template_source(name)) == FORMATS[name]


def written_call(name: str, call_format: ToolCallFormat) -> str:
    """The call block as the template writes an assistant's earlier call (OpenAI's JSON-text arguments
    and a 9-character id, which Mistral's template insists on), up to the end of its turn."""
    if name in SHOWN:
        return SHOWN[name]
    call = {"id": "ChV3Idxd6", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps(WEATHER_ARGUMENTS)}}
    messages = parse_chat({"messages": [{"role": "user", "content": "Weather in Paris?"},
                                        {"role": "assistant", "content": None, "tool_calls": [call]}]}).messages
    template = ChatTemplate(template_source(name), special_tokens={"bos_token": "<s>", "eos_token": "</s>"})
    text = template.render(messages, tools=WEATHER_TOOLS, add_generation_prompt=False)
    text = text[text.rindex('{"name"' if call_format.whole_reply else call_format.open_marker):]
    if call_format.close_marker is not None:
        return text[:text.index(call_format.close_marker) + len(call_format.close_marker)]
    return text[:min(text.find(end) % (len(text) + 1) for end in END_OF_TURN)]


@pytest.mark.parametrize("name", sorted(n for n, f in FORMATS.items() if f is not None))
def test_a_call_as_the_template_writes_it_reads_back(name: str) -> None:
    """What the model learned from its template, split at 17 places, is the same call and no content."""
    call_format = FORMATS[name]
    text = written_call(name, call_format)
    for split in range(0, len(text) + 1, max(1, len(text) // 16)):
        content, calls = parse([text[:split], text[split:]], call_format, WEATHER_TOOLS)
        assert "".join(content) == "", (split, content)
        assert [call_of(c) for c in calls] == [("get_weather", WEATHER_ARGUMENTS)]
        assert call_format is not MISTRAL or len(calls[0]["id"]) == 9


def test_xml_arguments_are_text_unless_the_tool_declares_another_type() -> None:
    block = "<function=f>\n<parameter=n>\n3\n</parameter>\n<parameter=s>\n3\n</parameter>\n</function>"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"n": {"type": "number"}}}}}]
    assert json.loads(parse_calls(block, {})[0]["function"]["arguments"]) == {"n": "3", "s": "3"}
    assert json.loads(parse_calls(block, parameter_types(tools))[0]["function"]["arguments"]) == {"n": 3, "s": "3"}


def test_glm_call_without_arguments_must_name_an_offered_tool() -> None:
    assert parse_calls("get_weather", parameter_types(WEATHER_TOOLS))[0]["function"]["name"] == "get_weather"
    assert parse_calls("oops", parameter_types(WEATHER_TOOLS)) is None
    content, calls = parse(["[TOOL_CALLS]oops"], MISTRAL, WEATHER_TOOLS)
    assert "".join(content) == "[TOOL_CALLS]oops" and calls == []


def test_xml_argument_of_a_type_list_with_string_stays_text() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {
        "s": {"type": ["string", "null"]}, "n": {"type": ["integer", "null"]}}}}}]
    block = "<function=f>\n<parameter=s>\n123\n</parameter>\n<parameter=n>\n123\n</parameter>\n</function>"
    assert json.loads(parse_calls(block, parameter_types(tools))[0]["function"]["arguments"]) == {"s": "123", "n": 123}


def test_lfm2_python_calls() -> None:
    text = '<|tool_call_start|>[get_weather(city="Paris", days=3), get_time()]<|tool_call_end|>Checking.'
    content, calls = parse([text], LFM2)
    assert "".join(content) == "Checking."
    assert [call_of(c) for c in calls] == [("get_weather", WEATHER_ARGUMENTS), ("get_time", {})]


@pytest.mark.parametrize("reply", ["The weather is fine.", "  {not a call} at all", '{"name": "f"} and more'])
def test_llama3_reply_that_is_not_a_call_is_content(reply: str) -> None:
    for deltas in ([reply], list(reply)):
        content, calls = parse(deltas, LLAMA3)
        assert "".join(content) == reply and calls == []


def test_llama3_call_after_the_python_tag() -> None:
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'
    for deltas in ([text], list(text)):
        content, calls = parse(deltas, LLAMA3)
        assert "".join(content) == "" and [call_of(c) for c in calls] == [("get_weather", WEATHER_ARGUMENTS)]


# ---- the parser ----

REPLY = f'Let me check.\n<tool_call>\n{CALL_JSON}\n</tool_call>'


@pytest.mark.parametrize("split", range(len(REPLY) + 1))
def test_a_split_anywhere_gives_the_same_reply(split: int) -> None:
    content, calls = parse([REPLY[:split], REPLY[split:]])
    assert "".join(content) == "Let me check."
    assert [call_of(c) for c in calls] == [("get_weather", CALL["arguments"])]
    assert not any("<" in part for part in content)     # no part of a marker is ever streamed


def test_character_by_character() -> None:
    content, calls = parse(list(REPLY))
    assert "".join(content) == "Let me check." and len(calls) == 1


def test_calls_only_have_no_content() -> None:
    second = {"name": "get_time", "arguments": {"zone": "CET"}}
    text = f'<tool_call>\n{CALL_JSON}\n</tool_call>\n<tool_call>\n{json.dumps(second)}\n</tool_call>\n'
    for deltas in ([text], list(text)):
        content, calls = parse(deltas)
        assert "".join(content) == ""
        assert [call_of(c) for c in calls] == [("get_weather", CALL["arguments"]), ("get_time", {"zone": "CET"})]
        assert calls[0]["id"] != calls[1]["id"]


def test_text_after_a_call_is_content() -> None:
    content, calls = parse([f"<tool_call>{CALL_JSON}</tool_call>", "\n\nDone", " now."])
    assert "".join(content) == "Done now." and len(calls) == 1


@pytest.mark.parametrize("block", [
    "<tool_call>\n{not json}\n</tool_call>",
    '<tool_call>{"arguments": {}}</tool_call>',            # no name
    '<tool_call>["get_weather"]</tool_call>',
    f"<tool_call>\n{CALL_JSON[:-5]}",                      # cut off before it closed
])
def test_a_block_that_is_not_a_call_is_content_unchanged(block: str) -> None:
    text = f"Before. {block} After."
    for deltas in ([text], list(text)):
        content, calls = parse(deltas)
        assert "".join(content) == text and calls == []


def test_an_open_block_at_the_end_that_parses_is_a_call() -> None:
    content, calls = parse(["<tool_call>\n", CALL_JSON])
    assert "".join(content) == "" and [call_of(c) for c in calls] == [("get_weather", CALL["arguments"])]


def test_text_that_only_looks_like_a_marker_passes_through() -> None:
    text = "a < b and <tool> or <tool_cal"
    content, calls = parse(list(text))
    assert "".join(content) == text and calls == []
    assert content[:-1] and "".join(content[:-1]) == "a < b and <tool> or"   # only a possible marker waits


def test_string_arguments_pass_as_they_are() -> None:
    _, calls = parse(['<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'])
    assert calls[0]["function"]["arguments"] == '{"x": 1}'


def test_a_bare_json_call_of_an_offered_tool_is_a_call() -> None:
    """As a real Qwen2.5 0.5B answered: the call's JSON without the template's <tool_call> tags."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    streamed_content, calls = parse(['  {"name": "get_weather", ', '"arguments": {"city": "Paris"}}'], HERMES, tools)
    assert streamed_content == ["", "", ""]
    assert [call_of(c) for c in calls] == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("reply", ['{"name": "other_tool", "arguments": {}}', '{"city": "Paris"}',
                                   '{"name": "get_weather"} and <tool_call>{"name": "get_weather"}</tool_call>'])
def test_json_that_is_not_a_bare_call_of_an_offered_tool_is_content(reply: str) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    streamed_content, calls = parse([reply[:7], reply[7:]], HERMES, tools)
    if "<tool_call>" in reply:   # held to the end, then read as usual: the tagged call is a call
        assert "".join(streamed_content) == '{"name": "get_weather"} and' and len(calls) == 1
    else:
        assert "".join(streamed_content) == reply and calls == []


def test_mistral_list() -> None:
    second = {"name": "get_time", "arguments": {}}
    text = f"[TOOL_CALLS]{json.dumps([CALL, second])}"
    for split in range(len(text) + 1):
        content, calls = parse([text[:split], text[split:]], MISTRAL)
        assert "".join(content) == ""
        assert [call_of(c) for c in calls] == [("get_weather", CALL["arguments"]), ("get_time", {})]
    content, calls = parse(["[TOOL_CALLS] [oops"], MISTRAL)
    assert "".join(content) == "[TOOL_CALLS] [oops" and calls == []


# ---- end to end ----

# Hermes-style: tool calls in `<tool_call>` blocks. The prompt of a plain conversation holds neither the
# markers nor the end-of-turn token, so renaming those ids leaves the prompt's computation unchanged.
HERMES_TEMPLATE = """\
{%- if tools %}{{ '<|im_start|>system\\nTools: ' + (tools | tojson) + '\\n' }}{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}
{{- '<|im_start|>assistant\\n' }}
{%- for call in message.tool_calls %}{{ '<tool_call>\\n' + (call.function | tojson) + '\\n</tool_call>' }}{% endfor %}
{{- '<|im_end|>\\n' }}
{%- else %}{{ '<|im_start|>' + message.role + '\\n' + message.content + '\\n' }}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"""
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
ADDED = ("<tool_call>", "</tool_call>", CALL_JSON)
USER_MESSAGES = ["What is the weather in Paris?", "Hello!", "Count to five.", "Write add(a, b).", "Name a capital."]


def vocab(model: Path) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(model / "tokenizer.json"))


def tool_checkpoint(directory: Path, special_markers: bool) -> Path:
    """A tiny qwen3 checkpoint whose tokenizer knows the markers and the call as added tokens; with
    ``special_markers`` the markers are special tokens (as Mistral's [TOOL_CALLS] is), which a plain decode drops."""
    base_vocab = tokenizers.Tokenizer.from_str(train_tokenizer()).get_vocab_size()
    model = write_checkpoint(directory, "qwen3", chat_template=HERMES_TEMPLATE, vocab_size=base_vocab + len(ADDED))
    tokenizer = vocab(model)
    special = {t: special_markers and t != CALL_JSON for t in ADDED}
    tokenizer.add_tokens([tokenizers.AddedToken(t, special=special[t], normalized=False) for t in ADDED])
    tokenizer.save(str(model / "tokenizer.json"))
    config = json.loads((model / "tokenizer_config.json").read_text())
    for token in ADDED:
        entry = {"content": token, "special": special[token]}
        config["added_tokens_decoder"][str(tokenizer.token_to_id(token))] = entry
    (model / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return model


@pytest.fixture(scope="module", params=[False, True], ids=["plain_markers", "special_markers"])
def base(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tool_checkpoint(tmp_path_factory.mktemp("tools"), request.param)


def scripted(base: Path, directory: Path, leads: range) -> dict[str, Any]:
    """A conversation whose greedy reply, once ids are renamed, is some tokens of text (as many as one of
    `leads`), then `<tool_call>`, the call, `</tool_call>` and the end-of-turn token."""
    tokenizer = vocab(base)
    targets = [tokenizer.token_to_id(t) for t in (*ADDED[:1], ADDED[2], ADDED[1], "<|im_end|>")]
    for content, lead in ((c, n) for c in USER_MESSAGES for n in leads):
        messages = [{"role": "user", "content": content}]
        prompt = tokenizer.encode(render_reference(HERMES_TEMPLATE, messages, tools=TOOLS),
                                  add_special_tokens=False).ids
        ids, _ = hf_reference(base, tuple(prompt), leads[-1] + len(targets))
        text, renamed_ids = ids[:lead], ids[lead:lead + len(targets)]
        if len(set(renamed_ids)) < len(targets) or set(renamed_ids + targets) & set(prompt + text):
            continue
        before = tokenizer.decode(text)
        if lead and (not before.strip() or before.endswith("\ufffd")):
            continue
        model = renamed(base, directory, dict(zip(renamed_ids, targets)))
        return {"model": model, "messages": messages, "content": before.rstrip(),
                "raw": tokenizer.decode([*text, *targets[:3]]), "completion_tokens": lead + len(targets)}
    raise AssertionError("no conversation whose greedy reply can be scripted into a tool call")


@pytest.fixture(scope="module", params=[range(1), range(1, 10)], ids=["call_only", "text_then_call"])
def case(request, base: Path, tmp_path_factory) -> Iterator[tuple[LSE, dict[str, Any]]]:
    script = scripted(base, tmp_path_factory.mktemp("scripted"), request.param)
    with open_engine(script["model"], kv_len=256) as lse:
        yield lse, script


def body(script: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"messages": script["messages"], "tools": TOOLS, "temperature": 0, "max_tokens": 16} | fields


def test_reply_with_a_call(case) -> None:
    lse, script = case
    data = reply(lse, body(script))
    choice = data["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("tool_calls", "stop_token")
    assert choice["message"]["content"] == (script["content"] or None)
    assert [call_of(c) for c in choice["message"]["tool_calls"]] == [("get_weather", CALL["arguments"])]
    assert data["usage"]["completion_tokens"] == script["completion_tokens"]


def test_streamed_reply_with_a_call(case) -> None:
    lse, script = case
    chunks, closing = streamed(lse, body(script))
    assert streamed_text(chunks) == script["content"]
    assert not any("tool_call" in (c["choices"][0]["delta"].get("content") or "") for c in chunks)
    with_calls = [c["choices"][0]["delta"]["tool_calls"] for c in chunks if "tool_calls" in c["choices"][0]["delta"]]
    assert len(with_calls) == 1 and [c["index"] for c in with_calls[0]] == [0]
    assert [call_of({k: v for k, v in c.items() if k != "index"}) for c in with_calls[0]] == \
        [("get_weather", CALL["arguments"])]
    assert closing[0]["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_choice_none_leaves_the_block_as_content(case) -> None:
    lse, script = case
    choice = reply(lse, body(script, tool_choice="none"))["choices"][0]
    assert (choice["finish_reason"], choice["message"]["content"]) == ("stop", script["raw"])
    assert "tool_calls" not in choice["message"]
