"""The OpenAI JSON: request parsing and errors, responses, stream chunks and /v1/models entries.
Expected shapes are written from the spec and OpenAI's API reference."""

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lse_core.errors import LSEError, server_error
from lse_core.protocol import (
    Choice,
    LSEWarning,
    Outcome,
    Reply,
    Timings,
    TokenLogprob,
    Usage,
    model_entry,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_tokenize,
)
from lse_core.sampling import generation_defaults
from lse_core.template.render import ChatTemplate

USER = {"role": "user", "content": "hi"}


def chat(**fields):
    return parse_chat({"messages": [USER], **fields})


def refusal(parse, body):
    """The error body of a refused request, after checking it is a 400 invalid_request_error."""
    with pytest.raises(LSEError) as caught:
        parse(body)
    assert caught.value.status == 400
    error = caught.value.body()["error"]
    assert error["type"] == "invalid_request_error"
    assert isinstance(error["message"], str) and error["message"]
    return error


def chat_refusal(**fields):
    return refusal(parse_chat, {"messages": [USER], **fields})


# ---- chat parsing ----

def test_chat_request_fields():
    request = parse_chat({
        "model": "smollm2", "messages": [{"role": "system", "content": "Be brief."}, USER],
        "stream": True, "stream_options": {"include_usage": True}, "stop": ["\n\n", "END"],
        "max_tokens": 50, "temperature": 0.5, "top_k": 40, "top_p": 0.9, "min_p": 0.05,
        "presence_penalty": 0.3, "repetition_penalty": 1.1, "frequency_penalty": 0.2, "seed": 7,
        "logprobs": True, "top_logprobs": 3, "chat_template_kwargs": {"enable_thinking": False},
        "reasoning_effort": "low",
    })
    assert request.endpoint == "chat" and request.model == "smollm2"
    assert request.messages == [{"role": "system", "content": "Be brief."}, USER]
    assert request.stream and request.include_usage
    assert request.stop == ("\n\n", "END")
    assert (request.max_tokens, request.temperature, request.top_k, request.top_p, request.min_p) == \
        (50, 0.5, 40, 0.9, 0.05)
    assert (request.presence_penalty, request.repetition_penalty, request.frequency_penalty, request.seed) == \
        (0.3, 1.1, 0.2, 7)
    assert (request.logprobs, request.top_logprobs) == (True, 3)
    assert request.chat_template_kwargs == {"enable_thinking": False}
    assert request.body["reasoning_effort"] == "low"   # kept for the thinking resolver
    assert request.prompt_param == "messages"


def test_chat_defaults_when_fields_are_left_out():
    request = chat()
    assert not request.stream and not request.include_usage and not request.logprobs
    assert request.stop == () and request.max_tokens is None and request.temperature is None


def test_unknown_fields_are_ignored():
    assert chat(user="someone", frobnicate={"x": [1, 2]}).messages == [USER]


def test_text_parts_are_joined():
    request = parse_chat({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "first"}, {"type": "text", "text": "second"}]}]})
    assert request.messages == [{"role": "user", "content": "first\nsecond"}]


def test_every_role_is_accepted():
    messages = [{"role": role, "content": role} for role in ("developer", "system", "user", "assistant", "tool")]
    assert [m["role"] for m in parse_chat({"messages": messages}).messages] == \
        ["developer", "system", "user", "assistant", "tool"]


def test_assistant_tool_calls_and_reasoning_are_kept():
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}}
    request = parse_chat({"messages": [
        USER,
        {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": "I should look."},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]})
    as_object = call | {"function": {"name": "weather", "arguments": {"city": "Oslo"}}}
    assert request.messages[1] == {"role": "assistant", "content": "", "reasoning_content": "I should look.",
                                   "tool_calls": [as_object]}
    assert request.messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


def test_earlier_call_arguments_are_an_object_and_their_text():
    """Templates iterate the arguments, write them with tojson, or add them to a string."""
    text = '{"city": "Oslo", "days": 2}'
    call = {"id": "c", "type": "function", "function": {"name": "weather", "arguments": text}}
    arguments = parse_chat({"messages": [USER, {"role": "assistant", "tool_calls": [call]}]}
                           ).messages[1]["tool_calls"][0]["function"]["arguments"]
    template = ChatTemplate("{% for k, v in a | items %}{{ k }}={{ v }};{% endfor %}"
                            "|{{ a | tojson }}|{{ '(' + a + ')' }}")
    assert template.render_raw([], a=arguments) == f"city=Oslo;days=2;|{text}|({text})"
    not_json = {"id": "c", "type": "function", "function": {"name": "weather", "arguments": "city=Oslo"}}
    assert parse_chat({"messages": [USER, {"role": "assistant", "tool_calls": [not_json]}]}
                      ).messages[1]["tool_calls"] == [not_json]


def test_tools_and_tool_choice_pass_through():
    tools = [{"type": "function", "function": {"name": "weather", "description": "The weather.",
                                                "parameters": {"type": "object"}, "strict": True}}]
    request = chat(tools=tools, tool_choice={"type": "function", "function": {"name": "weather"}})
    assert request.tools == tools
    # the template renders them as sent: their fields in the client's order, unknown ones kept
    assert list(request.tools[0]["function"]) == ["name", "description", "parameters", "strict"]
    assert request.tool_choice == {"type": "function", "function": {"name": "weather"}}
    assert chat(tool_choice="auto").tool_choice == "auto"


@pytest.mark.parametrize("body, code, param", [
    ({}, "missing_field", "messages"),
    ({"messages": None}, "missing_field", "messages"),
    ({"messages": "hi"}, "invalid_type", "messages"),
    ({"messages": []}, "invalid_value", "messages"),
    ({"messages": ["hi"]}, "invalid_type", "messages[0]"),
    ({"messages": [{"content": "hi"}]}, "missing_field", "messages[0].role"),
    ({"messages": [{"role": 3, "content": "hi"}]}, "invalid_type", "messages[0].role"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "invalid_value", "messages[0].role"),
    ({"messages": [USER, USER, {"role": "user", "content": 5}]}, "invalid_type", "messages[2].content"),
    ({"messages": [{"role": "user"}]}, "missing_field", "messages[0].content"),
    ({"messages": [{"role": "user", "content": None}]}, "missing_field", "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                 {"type": "image_url", "image_url": {"url": "x"}}]}]},
     "invalid_value", "messages[0].content[1].type"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "missing_field", "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
     "invalid_type", "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": ["hi"]}]}, "invalid_type", "messages[0].content[0]"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": {"id": 1}}]},
     "invalid_type", "messages[0].tool_calls"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {}}]}]},
     "missing_field", "messages[0].tool_calls[0].function.name"),
    ({"messages": [{"role": "assistant", "content": "", "reasoning_content": 3}]},
     "invalid_type", "messages[0].reasoning_content"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 3}]},
     "invalid_type", "messages[0].tool_call_id"),
    ({"messages": [USER, {"role": "user", "content": "bad \ud800 text"}]}, "invalid_value", "messages[1].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
     "invalid_value", "messages[0].content[0].text"),
    ({"messages": [{"role": "\ud800", "content": "x"}]}, "invalid_value", "messages[0].role"),
    ({"messages": [{"role": None, "content": "x"}]}, "missing_field", "messages[0].role"),
    ({"messages": [None]}, "invalid_type", "messages[0]"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": None}]}]},
     "missing_field", "messages[0].tool_calls[0].function"),
])
def test_message_errors_name_the_path(body, code, param):
    error = refusal(parse_chat, body)
    assert (error["code"], error["param"]) == (code, param)


@pytest.mark.parametrize("fields, code, param", [
    ({"model": 5}, "invalid_type", "model"),
    ({"stream": "yes"}, "invalid_type", "stream"),
    ({"stream_options": True}, "invalid_type", "stream_options"),
    ({"stream_options": {"include_usage": 1}}, "invalid_type", "stream_options.include_usage"),
    ({"stop": 5}, "invalid_type", "stop"),
    ({"stop": ""}, "invalid_value", "stop"),
    ({"stop": ["a", ""]}, "invalid_value", "stop[1]"),
    ({"stop": ["a", 3]}, "invalid_type", "stop[1]"),
    ({"stop": ["a", None]}, "invalid_type", "stop[1]"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "invalid_value", "stop"),
    ({"n": 2}, "invalid_value", "n"),
    ({"n": 0}, "invalid_value", "n"),
    ({"temperature": "hot"}, "invalid_type", "temperature"),
    ({"temperature": True}, "invalid_type", "temperature"),
    ({"temperature": math.nan}, "invalid_value", "temperature"),
    ({"temperature": math.inf}, "invalid_value", "temperature"),
    ({"temperature": 10**400}, "invalid_value", "temperature"),
    ({"temperature": 2**1024 - 1}, "invalid_value", "temperature"),   # rounds to no float
    ({"top_k": 1.5}, "invalid_type", "top_k"),
    ({"top_k": -2}, "invalid_value", "top_k"),
    ({"top_k": False}, "invalid_type", "top_k"),
    ({"top_p": 1.5}, "invalid_value", "top_p"),
    ({"top_p": -0.1}, "invalid_value", "top_p"),
    ({"min_p": 2}, "invalid_value", "min_p"),
    ({"min_p": "0.1"}, "invalid_type", "min_p"),
    ({"presence_penalty": -math.inf}, "invalid_value", "presence_penalty"),
    ({"presence_penalty": [1]}, "invalid_type", "presence_penalty"),
    ({"repetition_penalty": 0}, "invalid_value", "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "invalid_value", "repetition_penalty"),
    ({"frequency_penalty": "x"}, "invalid_type", "frequency_penalty"),
    ({"seed": -1}, "invalid_value", "seed"),
    ({"seed": 1.5}, "invalid_type", "seed"),
    ({"seed": True}, "invalid_type", "seed"),
    ({"seed": 2**64}, "invalid_value", "seed"),
    ({"max_tokens": 10**100}, "invalid_value", "max_tokens"),
    ({"logprobs": 1}, "invalid_type", "logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "invalid_value", "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "invalid_value", "top_logprobs"),
    ({"top_logprobs": 2}, "invalid_value", "top_logprobs"),
    ({"tools": {"type": "function"}}, "invalid_type", "tools"),
    ({"tools": [{"type": "retrieval"}]}, "invalid_value", "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"description": "x"}}]},
     "missing_field", "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "city"}}]},
     "invalid_type", "tools[0].function.parameters"),
    ({"tool_choice": "sometimes"}, "invalid_value", "tool_choice"),
    ({"tool_choice": {"type": "function"}}, "missing_field", "tool_choice.function"),
    ({"chat_template_kwargs": "enable_thinking"}, "invalid_type", "chat_template_kwargs"),
    ({"response_format": {"type": "xml"}}, "invalid_value", "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "missing_field", "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "object"}}},
     "invalid_type", "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}},
     "invalid_type", "response_format.json_schema.strict"),
    ({"response_format": "json"}, "invalid_type", "response_format"),
    ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "invalid_value", "structured_outputs"),
    ({"structured_outputs": {}}, "invalid_value", "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "invalid_value", "structured_outputs.choice"),
    ({"structured_outputs": {"choice": ["a", 1]}}, "invalid_type", "structured_outputs.choice[1]"),
    ({"structured_outputs": {"json": "not json"}}, "invalid_type", "structured_outputs.json"),
    ({"grammar": ""}, "invalid_value", "grammar"),
    ({"grammar": " \n"}, "invalid_value", "grammar"),
    ({"structured_outputs": {"regex": " "}}, "invalid_value", "structured_outputs.regex"),
    ({"structured_outputs": {"json": "5"}}, "invalid_type", "structured_outputs.json"),
    ({"tools": [{"type": "function", "function": None}]}, "missing_field", "tools[0].function"),
    ({"tool_choice": 3}, "invalid_type", "tool_choice"),
    ({"grammar": 'root ::= "a"', "response_format": {"type": "json_object"}}, "invalid_value", "grammar"),
    ({"parallel_tool_calls": "no"}, "invalid_type", "parallel_tool_calls"),
    ({"ignore_eos": 1}, "invalid_type", "ignore_eos"),
    ({"logit_bias": {"50256": -100}}, "invalid_value", "logit_bias"),
    ({"logit_bias": [1]}, "invalid_type", "logit_bias"),
])
def test_request_field_errors(fields, code, param):
    error = chat_refusal(**fields)
    assert (error["code"], error["param"]) == (code, param)


@pytest.mark.parametrize("body", [[USER], "hi", None, 3, True])
def test_a_body_that_is_not_an_object_is_refused(body):
    for parse in (parse_chat, parse_completion):
        assert refusal(parse, body)["code"] == "invalid_type"


def test_accepted_edges_of_the_ranges():
    request = chat(top_p=0, min_p=1, top_k=-1, seed=0, temperature=-0.5, n=1, top_logprobs=0,
                   presence_penalty=-2, frequency_penalty=-1, seed_extra=None, stop=[])
    assert (request.top_p, request.min_p, request.top_k, request.seed, request.stop) == (0.0, 1.0, -1, 0, ())
    assert chat(logprobs=True, top_logprobs=20).top_logprobs == 20
    assert chat(stop="###").stop == ("###",)


def test_nulls_mean_not_sent():
    request = chat(**dict.fromkeys(["model", "stream", "stream_options", "stop", "n", "max_tokens", "temperature",
                                    "top_k", "top_p", "min_p", "seed", "logprobs", "top_logprobs", "tools",
                                    "tool_choice", "chat_template_kwargs"]))
    assert request.model is None and request.stop == () and not request.stream and request.tools is None


# ---- completion parsing ----

@pytest.mark.parametrize("fields, code, param", [
    ({"suffix": " end"}, "invalid_value", "suffix"),
    ({"suffix": 3}, "invalid_type", "suffix"),
    ({"best_of": 2}, "invalid_value", "best_of"),
    ({"best_of": 0}, "invalid_value", "best_of"),
])
def test_completion_field_errors(fields, code, param):
    error = refusal(parse_completion, {"prompt": "x"} | fields)
    assert (error["code"], error["param"]) == (code, param)


def test_fields_that_ask_for_nothing_more_are_accepted():
    """What clients send by default: the plain text format, an empty bias, an empty suffix, best_of 1."""
    assert chat(response_format={"type": "text"}, logit_bias={}, user="u", parallel_tool_calls=True).messages
    assert parse_completion({"prompt": "x", "suffix": "", "best_of": 1, "logit_bias": None}).prompt == "x"


def test_completion_prompt_forms():
    assert parse_completion({"prompt": "Once upon"}).prompt == "Once upon"
    assert parse_completion({"prompt": [1, 2, 3]}).prompt == [1, 2, 3]
    assert parse_completion({"prompt": ["Once upon"]}).prompt == "Once upon"
    assert parse_completion({"prompt": [[4, 5]]}).prompt == [4, 5]
    assert parse_completion({"prompt": "x"}).prompt_param == "prompt"


def test_completion_fields():
    request = parse_completion({"prompt": "x", "logprobs": 2, "echo": True, "max_tokens": 3})
    assert (request.endpoint, request.logprobs, request.top_logprobs, request.echo, request.max_tokens) == \
        ("completion", True, 2, True, 3)
    request = parse_completion({"prompt": "x", "logprobs": 0})
    assert (request.logprobs, request.top_logprobs) == (True, 0)
    assert not parse_completion({"prompt": "x"}).logprobs


@pytest.mark.parametrize("body, code, param", [
    ({}, "missing_field", "prompt"),
    ({"prompt": 5}, "invalid_type", "prompt"),
    ({"prompt": ""}, "invalid_value", "prompt"),
    ({"prompt": []}, "invalid_value", "prompt"),
    ({"prompt": ["a", "b"]}, "invalid_value", "prompt"),
    ({"prompt": [[1], [2]]}, "invalid_value", "prompt"),
    ({"prompt": [1, "a"]}, "invalid_type", "prompt[1]"),
    ({"prompt": [1, True]}, "invalid_type", "prompt[1]"),
    ({"prompt": [1, -4]}, "invalid_value", "prompt[1]"),
    ({"prompt": [[1, 2.5]]}, "invalid_type", "prompt[0][1]"),
    ({"prompt": [{"text": "a"}]}, "invalid_type", "prompt[0]"),
    ({"prompt": "x", "logprobs": 6}, "invalid_value", "logprobs"),
    ({"prompt": "x", "logprobs": True}, "invalid_type", "logprobs"),
    ({"prompt": "x", "echo": "yes"}, "invalid_type", "echo"),
    ({"prompt": "x", "top_p": 3}, "invalid_value", "top_p"),
    ({"prompt": "\ud83d"}, "invalid_value", "prompt"),
    ({"prompt": "x", "stop": ["ok", "\ud83d"]}, "invalid_value", "stop[1]"),
])
def test_completion_errors(body, code, param):
    error = refusal(parse_completion, body)
    assert (error["code"], error["param"]) == (code, param)


# ---- the tokenizer endpoints ----

def test_tokenize_forms():
    text = parse_tokenize({"content": "Hi", "add_special": True, "with_pieces": True})
    assert (text.request, text.content, text.add_special, text.with_pieces) == (None, "Hi", True, True)
    completion = parse_tokenize({"prompt": [1, 2], "add_special_tokens": False, "add_generation_prompt": False})
    assert (completion.request.prompt, completion.add_special, completion.add_generation_prompt) == \
        ([1, 2], False, False)
    chat_body = parse_tokenize({"messages": [USER], "prompt": "ignored", "content": 5})
    assert chat_body.request.messages == [USER] and chat_body.add_special is None and chat_body.add_generation_prompt


@pytest.mark.parametrize("body, code, param", [
    ({}, "missing_field", "content"),
    ({"content": 5}, "invalid_type", "content"),
    ({"content": "x", "with_pieces": 1}, "invalid_type", "with_pieces"),
    ({"prompt": "x", "add_special": "yes"}, "invalid_type", "add_special"),
    ({"prompt": [1, -1]}, "invalid_value", "prompt[1]"),
    ({"messages": [], "prompt": "x"}, "invalid_value", "messages"),
    ({"messages": [USER], "n": 3}, "invalid_value", "n"),
])
def test_tokenize_errors(body, code, param):
    error = refusal(parse_tokenize, body)
    assert (error["code"], error["param"]) == (code, param)


def test_detokenize_takes_token_ids_of_the_vocabulary():
    assert parse_detokenize({"tokens": [0, 9.0, 3]}, 10) == [0, 9, 3]
    assert parse_detokenize({"tokens": []}, 10) == []


@pytest.mark.parametrize("body, code, param", [
    ({}, "missing_field", "tokens"),
    ({"tokens": None}, "missing_field", "tokens"),
    ({"tokens": "1 2"}, "invalid_type", "tokens"),
    ({"tokens": [1, True]}, "invalid_type", "tokens[1]"),
    ({"tokens": [1, 2.5]}, "invalid_type", "tokens[1]"),
    ({"tokens": [-1]}, "invalid_value", "tokens[0]"),
    ({"tokens": [3, 10]}, "invalid_value", "tokens[1]"),
])
def test_detokenize_errors(body, code, param):
    error = refusal(lambda b: parse_detokenize(b, 10), body)
    assert (error["code"], error["param"]) == (code, param)


# ---- random bodies: parse, or a 400 in the spec's error shape, never another exception ----

json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
    st.sampled_from(["user", "assistant", "system", "tool", "developer", "text", "function", "auto", ""]),
)
json_value = st.recursive(json_leaf, lambda children: st.one_of(
    st.lists(children, max_size=5), st.dictionaries(st.text(max_size=6), children, max_size=5)), max_leaves=20)
small_ints = st.integers(min_value=-3, max_value=25)
big_ints = st.integers(min_value=-(2**70), max_value=2**70)
numbers = st.one_of(st.floats(allow_nan=True, allow_infinity=True), small_ints, big_ints)
function = st.fixed_dictionaries({}, optional={"name": st.one_of(st.text(max_size=5), json_value)})
# Each field: mostly well-typed values near its range edges, sometimes any JSON at all.
fields = {
    "model": st.text(max_size=5),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.one_of(st.booleans(), json_value)}),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.one_of(st.text(max_size=3), json_value), max_size=5)),
    "max_tokens": st.one_of(small_ints, big_ints),
    "max_completion_tokens": st.one_of(small_ints, big_ints),
    "n": small_ints,
    "temperature": numbers, "top_k": numbers, "top_p": numbers, "min_p": numbers,
    "presence_penalty": numbers, "repetition_penalty": numbers, "frequency_penalty": numbers,
    "seed": st.one_of(small_ints, big_ints),
    "logprobs": st.one_of(st.booleans(), small_ints),
    "top_logprobs": small_ints,
    "echo": st.booleans(),
    "tools": st.lists(st.fixed_dictionaries({"type": st.one_of(st.just("function"), json_value)},
                                            optional={"function": st.one_of(function, json_value)}), max_size=2),
    "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required", "any"]),
                             st.fixed_dictionaries({}, optional={"function": st.one_of(function, json_value)})),
    "chat_template_kwargs": st.dictionaries(st.text(max_size=5), json_value, max_size=3),
}
some_fields = st.sets(st.sampled_from(sorted(fields)), max_size=4).flatmap(
    lambda names: st.fixed_dictionaries({name: st.one_of(fields[name], fields[name], json_value) for name in names}))
part = st.fixed_dictionaries({}, optional={"type": st.one_of(st.just("text"), st.just("text"), json_value),
                                           "text": st.one_of(st.text(max_size=5), json_value)})
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", "developer"]),
                                 "content": st.one_of(st.text(max_size=8), st.lists(part, max_size=3))},
                                optional={"tool_calls": st.lists(st.fixed_dictionaries({"function": function}),
                                                                 max_size=2),
                                          "reasoning_content": st.text(max_size=5),
                                          "tool_call_id": st.text(max_size=5), "name": st.text(max_size=5)})
junk_message = st.one_of(message, message, message, message, json_value, st.dictionaries(
    st.sampled_from(["role", "content", "tool_calls", "reasoning_content", "tool_call_id", "name"]), json_value))
token_ids = st.lists(st.one_of(st.integers(min_value=0, max_value=50000), st.integers(min_value=0, max_value=50000),
                               big_ints, json_value), max_size=4)
prompt = st.one_of(st.text(min_size=1, max_size=5), token_ids, st.lists(token_ids, max_size=2),
                   st.lists(st.text(max_size=3), max_size=2), json_value)
chat_body = st.tuples(st.lists(junk_message, max_size=3), some_fields).map(lambda mf: {"messages": mf[0], **mf[1]})
completion_body = st.tuples(prompt, some_fields).map(lambda pf: {"prompt": pf[0], **pf[1]})
body = st.one_of(json_value, st.dictionaries(st.sampled_from([*fields, "messages", "prompt"]), json_value, max_size=8),
                 chat_body, chat_body, chat_body, completion_body, completion_body, completion_body)


def parses_or_refuses(parse, value):
    try:
        request = parse(value)
    except LSEError as error:
        assert error.status == 400
        shaped = error.body()
        assert set(shaped) == {"error"}
        assert shaped["error"]["type"] == "invalid_request_error"
        assert shaped["error"]["code"] in {"missing_field", "invalid_type", "invalid_value"}
        assert isinstance(shaped["error"]["message"], str) and shaped["error"]["message"]
        assert shaped["error"]["param"] is None or isinstance(shaped["error"]["param"], str)
        assert (shaped["error"]["param"] is None) == (not isinstance(value, dict))
        json.dumps(shaped, allow_nan=False, ensure_ascii=False).encode("utf-8")
        return
    assert isinstance(value, dict) and request.body is value
    for number in (request.temperature, request.top_p, request.min_p, request.presence_penalty,
                   request.repetition_penalty, request.frequency_penalty):
        assert number is None or (type(number) is float and math.isfinite(number))


@settings(max_examples=400, deadline=None)
@given(body)
def test_random_bodies_into_parse_chat(value):
    parses_or_refuses(parse_chat, value)


@settings(max_examples=400, deadline=None)
@given(body)
def test_random_bodies_into_parse_completion(value):
    parses_or_refuses(parse_completion, value)


# ---- responses ----

TIMINGS = Timings(prompt_n=40, prompt_ms=20.0, predicted_n=472, predicted_ms=4720.0)
TIMINGS_JSON = {"prompt_n": 40, "prompt_ms": 20.0, "prompt_per_second": 2000.0,
                "predicted_n": 472, "predicted_ms": 4720.0, "predicted_per_second": 100.0}
CONTEXT_FULL = Outcome(choice=Choice(stop_reason="context_full", text="It was a dark and stormy night"),
                       usage=Usage(prompt_tokens=40, completion_tokens=472), context_length=512, timings=TIMINGS)


def test_context_full_chat_response_is_the_specs():
    body = Reply(chat(), "smollm2").response(CONTEXT_FULL)
    json.dumps(body, allow_nan=False)
    assert body["id"].startswith("chatcmpl-") and isinstance(body["created"], int)
    assert body["model"] == "smollm2"
    assert {k: v for k, v in body.items() if k not in ("id", "created", "model")} == {
        "object": "chat.completion",
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": "It was a dark and stormy night"},
            "finish_reason": "length",
            "stop_reason": "context_full",
            "logprobs": None,
        }],
        "usage": {"prompt_tokens": 40, "completion_tokens": 472, "total_tokens": 512,
                  "prompt_tokens_details": {"cached_tokens": 0}, "completion_tokens_details": {"reasoning_tokens": 0}},
        "lse_context": {"tokens_used": 512, "context_length": 512, "tokens_remaining": 0},
        "timings": TIMINGS_JSON,
    }


def test_context_full_completion_response_carries_text():
    body = Reply(parse_completion({"prompt": "Once"}), "smollm2").response(CONTEXT_FULL)
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["choices"] == [{"index": 0, "text": "It was a dark and stormy night", "finish_reason": "length",
                                "stop_reason": "context_full", "logprobs": None}]
    assert body["lse_context"] == {"tokens_used": 512, "context_length": 512, "tokens_remaining": 0}
    assert body["usage"]["total_tokens"] == 512


def test_context_full_final_chunk_is_the_specs():
    reply = Reply(chat(stream=True), "smollm2")
    reply.chunk("It was")
    chunks = reply.final_chunks(CONTEXT_FULL)
    assert len(chunks) == 1
    final = chunks[0]
    assert final["object"] == "chat.completion.chunk"
    assert final["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length",
                                 "stop_reason": "context_full"}]
    assert final["lse_context"] == {"tokens_used": 512, "context_length": 512, "tokens_remaining": 0}
    assert final["timings"] == TIMINGS_JSON
    assert "usage" not in final and "lse_warnings" not in final


def test_completion_final_chunk():
    reply = Reply(parse_completion({"prompt": "Once", "stream": True}), "m")
    assert reply.chunk("Once")["choices"] == [{"index": 0, "text": "Once", "logprobs": None,
                                               "finish_reason": None, "stop_reason": None}]
    [final] = reply.final_chunks(CONTEXT_FULL)
    assert final["object"] == "text_completion"
    assert final["choices"] == [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length",
                                 "stop_reason": "context_full"}]
    assert final["lse_context"]["tokens_remaining"] == 0


def test_reply_with_reasoning_cached_tokens_and_room_left():
    outcome = Outcome(choice=Choice(stop_reason="stop_token", text="Paris.", reasoning="The capital is Paris."),
                      usage=Usage(prompt_tokens=30, completion_tokens=12, cached_tokens=16),
                      context_length=4096, timings=TIMINGS)
    body = Reply(chat(), "m").response(outcome)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Paris.",
                                             "reasoning_content": "The capital is Paris."}
    assert (body["choices"][0]["finish_reason"], body["choices"][0]["stop_reason"]) == ("stop", "stop_token")
    assert body["usage"] == {"prompt_tokens": 30, "completion_tokens": 12, "total_tokens": 42,
                             "prompt_tokens_details": {"cached_tokens": 16},
                             "completion_tokens_details": {"reasoning_tokens": 0}}
    assert body["lse_context"] == {"tokens_used": 42, "context_length": 4096, "tokens_remaining": 4054}


def test_tool_call_reply():
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
    outcome = Outcome(choice=Choice(stop_reason="stop_token", tool_calls=[call]),
                      usage=Usage(10, 5), context_length=100, timings=TIMINGS)
    choice = Reply(chat(), "m").response(outcome)["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": None, "tool_calls": [call]}
    assert (choice["finish_reason"], choice["stop_reason"]) == ("tool_calls", "stop_token")


def test_cpu_fallback_warnings_appear_only_when_there_are_some():
    cause = "fused group 12 (3 nodes: mul, silu, add); opencl:0: no kernel for silu"
    outcome = Outcome(choice=Choice(stop_reason="max_tokens", text="x"), usage=Usage(3, 1),
                      context_length=100, timings=TIMINGS, warnings=[LSEWarning(cause=cause, count=4)])
    expected = [{"type": "cpu_fallback", "cause": cause, "count": 4}]
    assert Reply(chat(), "m").response(outcome)["lse_warnings"] == expected
    reply = Reply(chat(stream=True), "m")
    assert reply.final_chunks(outcome)[-1]["lse_warnings"] == expected
    assert "lse_warnings" not in Reply(chat(), "m").response(CONTEXT_FULL)


def test_cancelled_reply_has_no_finish_reason():
    outcome = Outcome(choice=Choice(stop_reason="cancelled", text="It"), usage=Usage(3, 1),
                      context_length=100, timings=TIMINGS)
    choice = Reply(chat(), "m").response(outcome)["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == (None, "cancelled")


def test_timings_with_nothing_computed():
    timings = Timings(prompt_n=0, prompt_ms=0.0, predicted_n=0, predicted_ms=0.0).to_json()
    assert timings["prompt_per_second"] == 0.0 and timings["predicted_per_second"] == 0.0


# ---- streams ----

def test_chat_stream_chunks():
    reply = Reply(chat(stream=True, stream_options={"include_usage": True}), "smollm2")
    first = reply.chunk(reasoning="Let me think.")
    second = reply.chunk("Paris")
    outcome = Outcome(choice=Choice(stop_reason="stop_token"), usage=Usage(30, 12, cached_tokens=16),
                      context_length=4096, timings=TIMINGS)
    final, usage = reply.final_chunks(outcome)
    for chunk in (first, second, final, usage):
        assert (chunk["id"], chunk["created"], chunk["model"]) == (reply.id, reply.created, "smollm2")
        assert chunk["object"] == "chat.completion.chunk"
    assert first["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": "",
                                                       "reasoning_content": "Let me think."},
                                 "logprobs": None, "finish_reason": None, "stop_reason": None}]
    assert second["choices"][0]["delta"] == {"content": "Paris"}
    assert final["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop",
                                 "stop_reason": "stop_token"}]
    assert final["lse_context"] == {"tokens_used": 42, "context_length": 4096, "tokens_remaining": 4054}
    assert first["usage"] is None and final["usage"] is None
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 30, "completion_tokens": 12, "total_tokens": 42,
                              "prompt_tokens_details": {"cached_tokens": 16},
                             "completion_tokens_details": {"reasoning_tokens": 0}}


def test_stream_without_include_usage_has_no_usage_chunk():
    reply = Reply(chat(stream=True), "m")
    reply.chunk("a")
    chunks = reply.final_chunks(CONTEXT_FULL)
    assert len(chunks) == 1 and "usage" not in chunks[0]


def test_empty_stream_still_sends_the_role_first():
    reply = Reply(chat(stream=True), "m")
    role, final = reply.final_chunks(Outcome(choice=Choice(stop_reason="stop_token"), usage=Usage(3, 1),
                                             context_length=100, timings=TIMINGS))
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert final["choices"][0]["finish_reason"] == "stop"


def test_streamed_tool_calls_carry_their_index():
    reply = Reply(chat(stream=True), "m")
    reply.chunk()
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
    delta = reply.chunk(tool_calls=[call])["choices"][0]["delta"]
    assert delta == {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                     "function": {"name": "weather", "arguments": "{}"}}]}


def test_error_inside_a_stream_is_the_same_body():
    error = server_error("CPU fallback disabled: fused group 12 (3 nodes: mul, silu, add)")
    assert error.body() == {"error": {"message": "CPU fallback disabled: fused group 12 (3 nodes: mul, silu, add)",
                                      "type": "server_error", "code": None, "param": None}}


# ---- logprobs ----

def test_chat_logprobs_shape():
    reply = Reply(chat(logprobs=True, top_logprobs=2), "m")
    tokens = [TokenLogprob("Hé".encode(), -0.25, [("Hé".encode(), -0.25), (b"Hi", -1.5)])]
    outcome = Outcome(choice=Choice(stop_reason="max_tokens", text="Hé", logprobs=tokens), usage=Usage(3, 1),
                      context_length=100, timings=TIMINGS)
    assert reply.response(outcome)["choices"][0]["logprobs"] == {"content": [{
        "token": "Hé", "logprob": -0.25, "bytes": [72, 195, 169],
        "top_logprobs": [{"token": "Hé", "logprob": -0.25, "bytes": [72, 195, 169]},
                         {"token": "Hi", "logprob": -1.5, "bytes": [72, 105]}],
    }], "refusal": None}


def test_completion_logprobs_shape_across_chunks():
    reply = Reply(parse_completion({"prompt": "x", "logprobs": 1, "stream": True}), "m")
    first = reply.chunk(" The", logprobs=[TokenLogprob(b" The", -0.5, [(b" The", -0.5)])])
    second = reply.chunk(" cat", logprobs=[TokenLogprob(b" cat", -2.0, [(b" dog", -1.0)])])
    assert first["choices"][0]["logprobs"] == {"tokens": [" The"], "token_logprobs": [-0.5],
                                               "top_logprobs": [{" The": -0.5}], "text_offset": [0]}
    assert second["choices"][0]["logprobs"] == {"tokens": [" cat"], "token_logprobs": [-2.0],
                                                "top_logprobs": [{" dog": -1.0}], "text_offset": [4]}


def test_logprobs_of_tokens_that_split_a_character():
    """Byte-level tokens can hold part of a UTF-8 character: "bytes" keeps the real bytes, "token"
    names them as OpenAI does, and text_offset counts a character once, where it starts."""
    tokens = [TokenLogprob(b" caf", -0.1), TokenLogprob(b"\xc3", -0.2, [(b"\xc3", -0.2), (b"e", -3.0)]),
              TokenLogprob(b"\xa9", -0.3), TokenLogprob(b"!", -0.4)]
    outcome = Outcome(choice=Choice(stop_reason="max_tokens", text=" café!", logprobs=tokens), usage=Usage(1, 4),
                      context_length=100, timings=TIMINGS)
    chat_entries = Reply(chat(logprobs=True, top_logprobs=2), "m").response(outcome)["choices"][0]["logprobs"]
    assert [(e["token"], e["bytes"]) for e in chat_entries["content"]] == [
        (" caf", [32, 99, 97, 102]), ("bytes:\\xc3", [0xC3]), ("bytes:\\xa9", [0xA9]), ("!", [33])]
    assert bytes(b for e in chat_entries["content"] for b in e["bytes"]).decode() == " café!"
    assert chat_entries["content"][1]["top_logprobs"][1] == {"token": "e", "logprob": -3.0, "bytes": [101]}
    completion = Reply(parse_completion({"prompt": "x", "logprobs": 1}), "m").response(outcome)
    logprobs = completion["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [" caf", "bytes:\\xc3", "bytes:\\xa9", "!"]
    assert logprobs["top_logprobs"][1] == {"bytes:\\xc3": -0.2, "e": -3.0}
    assert logprobs["text_offset"] == [0, 4, 4, 5]
    assert [" café!"[o] for o in logprobs["text_offset"]] == [" ", "é", "é", "!"]


# ---- /v1/models ----

def test_model_entry():
    thinking = {"supported": False, "source": None, "toggle": None, "effort": None,
                "default_level": None, "levels": []}
    defaults = generation_defaults({"temperature": 1.0, "top_k": 20, "top_p": 0.95}, {}, None)
    structured_outputs = {"supported": True, "engine": "llguidance 1.0", "kinds": ["json_schema"],
                          "fields": ["response_format"], "tool_choice": ["auto"]}   # as structured.supported()
    entry = model_entry("SmolLM2-135M-Instruct", 1700000000, 4096, thinking, defaults, structured_outputs)
    assert entry == {"id": "SmolLM2-135M-Instruct", "object": "model", "created": 1700000000, "owned_by": "lse",
                     "context_length": 4096, "thinking": thinking,
                     "generation_defaults": defaults.to_json(), "structured_outputs": structured_outputs}
    assert entry["generation_defaults"]["sources"]["top_k"] == "generation_config.json"
    json.dumps(entry, allow_nan=False)


def test_completion_response_offsets_start_at_zero_after_chunks():
    # lse_request emits token chunks for every request; the whole response still counts from 0.
    reply = Reply(parse_completion({"prompt": "x", "logprobs": 0}), "m")
    tokens = [TokenLogprob(b" The", -0.5), TokenLogprob(b" cat", -2.0)]
    reply.chunk(" The", logprobs=tokens[:1])
    reply.chunk(" cat", logprobs=tokens[1:])
    outcome = Outcome(choice=Choice(stop_reason="max_tokens", text=" The cat", logprobs=tokens),
                      usage=Usage(1, 2), context_length=100, timings=TIMINGS)
    assert reply.response(outcome)["choices"][0]["logprobs"] == {
        "tokens": [" The", " cat"], "token_logprobs": [-0.5, -2.0], "top_logprobs": [{}, {}], "text_offset": [0, 4]}
