"""Structured output end to end: response_format, structured_outputs (json, regex, choice, Lark), llama.cpp's
GBNF grammar and enforced tool calls, on the default model and on tiny random checkpoints on every device.

A random model follows the grammar alone (its preferences are noise), so the schemas it gets are bounded
(maxLength, maxItems, integer ranges) and every reply must complete; the default model gets real-world
schemas with unbounded strings and must fill them sensibly. Every reply is checked with jsonschema.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import jsonschema
import numpy as np
import openai
import pydantic
import pytest
from checkpoints import greedy_sampling
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structured_schemas import REAL_WORLD
from test_api_contract import error, open_engine, reply, streamed, streamed_text
from test_server import lse_server
from test_thinking_e2e import QWEN3, scripted_thinking, thinking_checkpoint
from test_tool_calls import TEMPLATES, tool_checkpoint

from lse_core import structured
from lse_core.api import LSE, lse_close, lse_model_info, lse_open_or_raise
from lse_core.config import LSEConfig
from lse_core.model.default import default_model_path
from lse_core.model.files import load_hf
from lse_core.tools import HERMES

FORMATS = jsonschema.FormatChecker()
BOUNDED = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False},
    "nickname": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}]},
    "active": {"type": "boolean"}},
    "required": ["name", "age", "tags", "address", "nickname", "active"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
             "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def json_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}}


def content(data: dict[str, Any]) -> str:
    choice = data["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def valid_json(data: dict[str, Any], schema: dict[str, Any]) -> Any:
    """The reply's JSON, after checking it completed (not cut short) and matches the schema."""
    choice = data["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", "stop_token"), choice
    assert all(w["type"] == "cpu_fallback" for w in data.get("lse_warnings", [])), data["lse_warnings"]
    value = json.loads(content(data))
    jsonschema.validate(value, schema, format_checker=FORMATS)
    return value


# ---- the default model (SmolLM2-135M-Instruct on the default pool) ----

@pytest.fixture(scope="module")
def smollm2() -> Iterator[LSE]:
    lse = lse_open_or_raise(LSEConfig(kv_len=1024, parallel=16))
    yield lse
    lse_close(lse)


@pytest.mark.parametrize("name", REAL_WORLD)
def test_real_world_schemas_on_the_default_model(smollm2: LSE, name: str) -> None:
    question, schema = REAL_WORLD[name]
    body = {"messages": [{"role": "user", "content": question}], "response_format": json_format(schema),
            "temperature": 0, "max_tokens": 400}
    valid_json(reply(smollm2, body), schema)


def test_the_default_model_answers_a_person_sensibly(smollm2: LSE) -> None:
    question, schema = REAL_WORLD["person"]
    body = {"messages": [{"role": "user", "content": question}], "response_format": json_format(schema),
            "temperature": 0, "max_tokens": 400}
    person = valid_json(reply(smollm2, body), schema)
    assert (person["name"], person["age"], person["address"]["city"]) == ("Marie Curie", 66, "Paris")


def test_json_object_mode(smollm2: LSE) -> None:
    question = 'What is the capital of France? Answer in JSON with the key "capital".'
    body = {"messages": [{"role": "user", "content": question}], "response_format": {"type": "json_object"},
            "temperature": 0, "max_tokens": 200}
    assert valid_json(reply(smollm2, body), {"type": "object"}) == {"capital": "Paris"}


def test_a_reply_cut_short_says_so(smollm2: LSE) -> None:
    question, schema = REAL_WORLD["person"]
    body = {"messages": [{"role": "user", "content": question}], "response_format": json_format(schema),
            "temperature": 0, "max_tokens": 4}
    data = reply(smollm2, body)
    assert data["choices"][0]["stop_reason"] == "max_tokens"
    (warning,) = data["lse_warnings"]
    assert warning["type"] == "structured_output_incomplete"
    assert "response_format.json_schema.schema" in warning["cause"]


def test_streamed_json_equals_the_whole_reply(smollm2: LSE) -> None:
    _, schema = REAL_WORLD["classify"]
    body = {"messages": [{"role": "user", "content": REAL_WORLD["classify"][0]}],
            "response_format": json_format(schema), "temperature": 0, "max_tokens": 100}
    chunks, closing = streamed(smollm2, body)
    assert closing[-1]["choices"][0]["stop_reason"] == "stop_token"
    assert streamed_text(chunks) == content(reply(smollm2, body))
    jsonschema.validate(json.loads(streamed_text(chunks)), schema)


def test_ignore_eos_runs_to_the_limit(smollm2: LSE) -> None:
    """What the benchmark uses to decode as many free tokens as constrained ones (vLLM's ignore_eos)."""
    body = {"messages": [{"role": "user", "content": "What is 2 + 2?"}], "temperature": 0, "max_tokens": 300}
    ended = reply(smollm2, body)
    assert ended["choices"][0]["stop_reason"] == "stop_token"
    longer = ended["usage"]["completion_tokens"] + 8
    ignored = reply(smollm2, body | {"ignore_eos": True, "max_tokens": longer})
    assert ignored["choices"][0]["stop_reason"] == "max_tokens" and ignored["usage"]["completion_tokens"] == longer


def test_models_say_what_is_supported(smollm2: LSE) -> None:
    entry = lse_model_info(smollm2)["served"]["structured_outputs"]
    assert entry["supported"] and entry["engine"].startswith("llguidance")
    assert {"json_schema", "json_object", "regex", "choice", "lark", "gbnf"} <= set(entry["kinds"])


# ---- tiny checkpoints on every device ----

@pytest.fixture(scope="module")
def qwen2(tiny_checkpoint) -> Path:
    return tiny_checkpoint("qwen2", chat_template=(TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text())


@pytest.fixture(scope="module", params=["cpu:0", "jit:0", "opencl:0", "hrx:0"])
def tiny(request, qwen2: Path) -> Iterator[LSE]:
    """The tiny model on each device; hrx (the example plugin) runs the mask op itself."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HRX_DEVICES", "1")
        with open_engine(qwen2, pool=request.param, kv_len=1024, parallel=4) as lse:
            yield lse


@pytest.mark.parametrize("seed", [None, 1, 2])
def test_bounded_schema_on_every_device(tiny: LSE, seed: int | None) -> None:
    sampling = {"temperature": 0} if seed is None else {"temperature": 1.0, "seed": seed}
    body = {"messages": ASK, "response_format": json_format(BOUNDED), "max_tokens": 600} | sampling
    valid_json(reply(tiny, body), BOUNDED)


def test_regex_choice_lark_and_gbnf(tiny: LSE) -> None:
    cases = [
        ({"structured_outputs": {"regex": r"\(\d{3}\) \d{3}-\d{4}"}}, re.compile(r"\(\d{3}\) \d{3}-\d{4}")),
        ({"structured_outputs": {"choice": ["yes", "no", "not sure"]}}, re.compile("yes|no|not sure")),
        ({"structured_outputs": {"grammar": 'start: "[" NUM ("," NUM)~0..3 "]"\nNUM: /[1-9][0-9]?/'}},
         re.compile(r"\[[1-9][0-9]?(,[1-9][0-9]?){0,3}\]")),
        ({"grammar": 'root ::= greeting " " name\ngreeting ::= "hi" | "hello"\nname ::= [a-z] [a-z]? [a-z]?'},
         re.compile(r"(hi|hello) [a-z]{1,3}")),
    ]
    for fields, pattern in cases:
        for seed in (1, 2):
            data = reply(tiny, {"messages": ASK, "temperature": 1.0, "seed": seed, "max_tokens": 100} | fields)
            assert data["choices"][0]["stop_reason"] == "stop_token", (fields, data)
            assert pattern.fullmatch(content(data)), (fields, content(data))


def test_completions_take_a_constraint(tiny: LSE) -> None:
    data = reply(tiny, {"prompt": "The answer:", "structured_outputs": {"choice": ["alpha", "beta"]},
                        "temperature": 1.0, "seed": 3}, "completion")
    assert content(data) in ("alpha", "beta")


def test_enforced_call_to_a_named_function(tiny: LSE) -> None:
    for seed in (1, 2, 3):
        data = reply(tiny, {"messages": ASK, "tools": TOOLS, "temperature": 1.0, "seed": seed, "max_tokens": 200,
                            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
        choice = data["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)


def test_bad_constraints_are_refused_and_the_engine_goes_on(tiny: LSE) -> None:
    cases = [
        ({"response_format": json_format({"type": "wat"})}, "response_format.json_schema.schema"),
        ({"response_format": json_format({"type": "string", "pattern": "(?=a)b"})},   # look-ahead: unsupported
         "response_format.json_schema.schema"),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "start: missing_rule"}}, "structured_outputs.grammar"),
        ({"grammar": 'root ::= "a'}, "grammar"),
        ({"grammar": "root ::= undefined"}, "grammar"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ]
    for fields, param in cases:
        status, body = error(tiny, {"messages": ASK} | fields)
        assert (status, body["error"]["code"], body["error"]["param"]) == (400, "invalid_value", param), body
        assert body["error"]["message"]
    valid_json(reply(tiny, {"messages": ASK, "response_format": json_format(BOUNDED), "temperature": 0,
                            "max_tokens": 600}), BOUNDED)


def test_sixteen_sequences_half_constrained(qwen2: Path) -> None:
    """The free half's replies are exactly what they are alone (on the fp32 interpreter, whose batched
    decode equals each sequence's alone); the constrained half's all match the schema."""
    questions = ["Name a fruit.", "Count to three.", "What is 2 + 2?", "Say hello.",
                 "Name a color.", "What is the capital of Italy?", "Name an animal.", "Spell cat."]
    free = [{"messages": [{"role": "user", "content": q}], "temperature": 0, "max_tokens": 24} for q in questions]
    constrained = [body | {"response_format": json_format(BOUNDED), "max_tokens": 600} for body in free]
    results: dict[int, dict[str, Any]] = {}
    with open_engine(qwen2, pool="cpu:0", kv_len=1024, parallel=16) as lse:
        alone = [content(reply(lse, body)) for body in free]

        def run(i: int, body: dict[str, Any]) -> None:
            results[i] = reply(lse, body)

        threads = [threading.Thread(target=run, args=(i, b)) for i, b in enumerate(free + constrained)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    assert [content(results[i]) for i in range(8)] == alone
    for i in range(8, 16):
        valid_json(results[i], BOUNDED)


# ---- generated schemas ----

def _leaf() -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(
        st.just({"type": "boolean"}), st.just({"type": "null"}),
        st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
                  st.integers(-50, 50), st.integers(0, 100)),
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 8)),
        st.builds(lambda values: {"enum": values}, st.lists(st.text("abcxyz", min_size=1, max_size=4), min_size=1,
                                                            max_size=3, unique=True)))


def _compound(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    objects = st.dictionaries(st.text("abcdefgh", min_size=1, max_size=5), children, min_size=1, max_size=3).map(
        lambda props: {"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False})
    arrays = st.builds(lambda item, n: {"type": "array", "items": item, "maxItems": n}, children, st.integers(0, 3))
    unions = st.lists(children, min_size=2, max_size=3).map(lambda options: {"anyOf": options})
    return st.one_of(objects, arrays, unions)


SCHEMAS = st.recursive(_leaf(), _compound, max_leaves=6)


@pytest.fixture(scope="module")
def tiny_jit(qwen2: Path) -> Iterator[LSE]:
    with open_engine(qwen2, pool="jit:0", kv_len=1024, parallel=2) as lse:
        yield lse


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS, seed=st.integers(0, 2**16))
def test_every_reply_to_a_generated_schema_is_valid(tiny_jit: LSE, schema: dict[str, Any], seed: int) -> None:
    body = {"messages": ASK, "response_format": json_format(schema), "temperature": 1.0, "seed": seed,
            "max_tokens": 800}
    valid_json(reply(tiny_jit, body), schema)


# ---- enforced tool calls in each template's own call syntax ----

FAMILIES = ["Qwen-Qwen2.5-7B-Instruct", "mistralai-Mistral-Nemo-Instruct-2407", "meta-llama-Llama-3.1-8B-Instruct",
            "ibm-granite-granite-3.3-2B-Instruct", "CohereForAI-c4ai-command-r7b-12-2024-tool_use",
            "unsloth-Apriel-1.5", "LFM2-8B-A1B", "HuggingFaceTB-SmolLM2-135M-Instruct", "Qwen3-Coder",
            "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", "deepseek-ai-DeepSeek-V3.1", "moonshotai-Kimi-K2",
            "upstage-Solar-Open-100B"]


@pytest.mark.parametrize("family", FAMILIES)
def test_required_calls_read_back_in_every_family(tiny_checkpoint, family: str) -> None:
    model = tiny_checkpoint("qwen2", chat_template=(TEMPLATES / f"{family}.jinja").read_text())
    with open_engine(model, pool="jit:0", kv_len=8192) as lse:    # a tiny vocabulary spells templates long
        # a random model would think forever: thinking off where the template can switch it off, else bounded
        levels = {level["id"] for level in lse_model_info(lse)["thinking"]["levels"]}
        no_thinking = {"reasoning_effort": "none"} if "none" in levels else {"thinking_budget": 8}
        for seed, parallel in ((1, True), (2, False), (3, True)):
            body = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": parallel,
                    "temperature": 1.0, "seed": seed, "max_tokens": 800} | no_thinking
            choice = reply(lse, body)["choices"][0]
            assert choice["finish_reason"] == "tool_calls", (family, choice)
            calls = choice["message"]["tool_calls"]
            assert calls and (parallel or len(calls) == 1)
            for call in calls:
                tool = next(t["function"] for t in TOOLS if t["function"]["name"] == call["function"]["name"])
                jsonschema.validate(json.loads(call["function"]["arguments"]), tool["parameters"])


def test_a_call_marker_that_is_a_special_token(tmp_path: Path) -> None:
    """<tool_call> as a special token: the grammar names the token, and the parser still reads the call."""
    model = tool_checkpoint(tmp_path, special_markers=True)
    with open_engine(model, pool="jit:0", kv_len=1024) as lse:
        for seed in (1, 2):
            body = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
                    "temperature": 1.0, "seed": seed, "max_tokens": 300, "logprobs": True}
            data = reply(lse, body)
            choice = data["choices"][0]
            assert choice["finish_reason"] == "tool_calls", choice
            assert choice["logprobs"]["content"][0]["token"] == "<tool_call>"   # the one special token
            for call in choice["message"]["tool_calls"]:
                assert call["function"]["name"] in ("get_weather", "get_time")


# ---- thinking: the reasoning stays free, the answer is constrained ----

@pytest.fixture(scope="module")
def thinking(tmp_path_factory) -> dict[str, Any]:
    qwen3 = thinking_checkpoint(tmp_path_factory.mktemp("qwen3_thinking"), QWEN3)
    return scripted_thinking(qwen3, tmp_path_factory.mktemp("scripted"))


def test_reasoning_is_free_and_the_answer_constrained(thinking: dict[str, Any]) -> None:
    with open_engine(thinking["model"], pool="jit:0", kv_len=1024) as lse:
        body = {"messages": thinking["messages"], "temperature": 0, "max_tokens": 600,
                "response_format": json_format(BOUNDED)}
        data = reply(lse, body)
        valid_json(data, BOUNDED)
        assert data["choices"][0]["message"]["reasoning_content"] == thinking["reasoning"]
        free = reply(lse, {"messages": thinking["messages"], "temperature": 0, "max_tokens": thinking["max_tokens"]})
        assert free["choices"][0]["message"]["reasoning_content"] == thinking["reasoning"]
        assert content(free) != content(data)


# ---- tool_choice auto: free text, then a constrained call once its marker appears ----

def allowed_tokens(constraint: structured.Constraint) -> set[int]:
    batch = greedy_sampling(1)
    structured.compute_masks(batch, [(constraint, 0)])
    batch.await_mask()
    return set(np.flatnonzero(np.unpackbits(batch.token_mask[0].view(np.uint8), bitorder="little")).tolist())


def test_a_lazy_call_grammar_starts_at_the_marker_and_ends_with_the_call(tmp_path: Path) -> None:
    model = load_hf(str(tool_checkpoint(tmp_path, special_markers=False)))
    tokenizer = model.tokenizer
    grammars = structured.GrammarTokenizer(tokenizer, tokenizer.vocab_size)
    grammar = structured.tool_call_grammar(HERMES, TOOLS, None, True, grammars, lazy=True)
    constraint = structured.Constraint(grammars, grammars.matcher(grammar, "tools"), "a tool call",
                                       trigger=HERMES.open_marker, repeat=True)

    def feed(text: str) -> None:
        for token in tokenizer.encode(text, add_special_tokens=False):
            assert not constraint.advance(token)

    feed("Let me check. ")
    assert not constraint.active                      # free text: no mask is computed
    feed("<tool_call>")
    assert constraint.active
    paris = tokenizer.encode('{"name": "get_weather", "arguments": {"city": "Paris"}}', add_special_tokens=False)
    first = allowed_tokens(constraint)
    assert paris[0] in first and tokenizer.backend.token_to_id("<|im_end|>") not in first
    feed('\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 3}}\n')
    assert tokenizer.encode("</tool_call>", add_special_tokens=False)[0] in allowed_tokens(constraint)
    feed("</tool_call>")
    assert not constraint.active and constraint.complete   # the call is done; more text or calls may follow
    feed(" Done. <tool_call>")
    assert constraint.active and not constraint.complete
    # a call the schema forbids: days must be 1-7, unit one of two
    bad = tokenizer.encode('{"name": "get_weather", "arguments": {"city": "Rome", "unit": "kelvin"',
                           add_special_tokens=False)
    with pytest.raises(RuntimeError, match="structured output failed"):
        for token in bad:
            constraint.advance(token)


# ---- the official openai SDK against lse-server ----

class City(pydantic.BaseModel):
    name: str
    country: str
    population_millions: float = pydantic.Field(ge=0, le=100)


class GetWeather(pydantic.BaseModel):
    """The weather in a city."""
    city: str
    unit: Literal["celsius", "fahrenheit"]


@pytest.fixture(scope="module")
def sdk() -> Iterator[tuple[openai.OpenAI, str]]:
    with lse_server(default_model_path(), "--kv-len", "1024") as server:
        client = server.openai()
        yield client, client.models.list().data[0].id


def test_openai_sdk_parse_returns_the_pydantic_object(sdk: tuple[openai.OpenAI, str]) -> None:
    client, model = sdk
    messages = [{"role": "user", "content": "Describe Paris as JSON: its name, country and population."}]
    completion = client.chat.completions.parse(model=model, messages=messages, response_format=City,
                                               temperature=0, max_tokens=200)
    city = completion.choices[0].message.parsed
    assert isinstance(city, City) and city.name == "Paris"
    with client.chat.completions.stream(model=model, messages=messages, response_format=City, temperature=0,
                                        max_tokens=200) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.parsed == city


def test_openai_sdk_enforced_function_tool(sdk: tuple[openai.OpenAI, str]) -> None:
    client, model = sdk
    completion = client.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "What is the weather in Paris?"}], temperature=0,
        tools=[openai.pydantic_function_tool(GetWeather)], tool_choice="required", max_tokens=200)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "GetWeather" and isinstance(call.function.parsed_arguments, GetWeather)
