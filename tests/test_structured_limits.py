"""Structured output can neither crash nor stall the server (issue 49). A schema of 1,000 chained $defs, a Lark
grammar of 3,000 chained rules and a GBNF grammar of 10,000 overflowed llguidance's stack (SIGSEGV, every stream
lost); a 100,000-entry choice took 20 s to end in a Rust panic. Now LSE's bounds refuse them before llguidance
sees them, a grammar llguidance refuses at its first mask ("Too many items") or that still crashes its compiler
is refused by the compile worker, each with a short 400 naming the field, on every API that reaches structured
output; a neighbour's stream meanwhile runs as it runs alone."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import llguidance
import pytest
from structured_schemas import REAL_WORLD
from test_server import Server, lse_server

from lse_core import structured
from lse_core.errors import LSEError
from lse_core.grammar_check import GrammarChecker, GrammarRefused
from lse_core.model.default import default_model_path, load_model
from lse_core.protocol import OutputConstraint


def chained_defs(n: int) -> dict[str, Any]:
    """n $defs, each an object whose property is the next def, or an integer (112 KB at 1,000)."""
    defs = {f"d{i}": {"anyOf": [{"type": "object", "properties": {"next": {"$ref": f"#/$defs/d{i + 1}"}}},
                                {"type": "integer"}]} for i in range(n)}
    return {"$defs": defs | {f"d{n}": {"type": "integer"}}, "$ref": "#/$defs/d0"}


def chained_lark(n: int) -> str:
    return "start: r0\n" + "".join(f'r{i}: "a" r{i + 1} | "b"\n' for i in range(n)) + f'r{n}: "c"'


def chained_gbnf(n: int) -> str:
    return "root ::= r0\n" + "".join(f'r{i} ::= "a" r{i + 1} | "b"\n' for i in range(n)) + f'r{n} ::= "c"'


CHAINED_DEFS = chained_defs(1000)
CHAINED_LARK = chained_lark(3000)
CHAINED_GBNF = chained_gbnf(10000)
HUGE_CHOICE = [f"option {i}" for i in range(100_000)]
# single letters and pairs of them, repeated: too ambiguous for llguidance's Earley items at the first mask
LETTERS = [chr(ord("a") + i) for i in range(26)]
TOO_MANY_ITEMS = "start: x*\nx: " + " | ".join(json.dumps(a + b) for a in ["", *LETTERS] for b in LETTERS)
# within LSE's bounds (one rule, 226 KB), but the schema it embeds overflows the worker's stack: only the worker
# stands between it and the engine
EMBEDDED_DEFS = "start: %json " + json.dumps(chained_defs(2000))
# 5,000 properties, recursion through $ref, and pydantic's nesting of optional models ten deep: all pass
WIDE = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(5000)}}
TREE = {"$defs": {"node": {"type": "object", "properties": {
    "label": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
    "$ref": "#/$defs/node"}
NESTED_MODELS = {"$defs": {f"m{i}": {"type": "object", "properties": {
    "value": {"type": "integer"}, "inner": {"anyOf": [{"$ref": f"#/$defs/m{i + 1}"}, {"type": "null"}]}}}
    for i in range(10)} | {"m10": {"type": "object"}}, "$ref": "#/$defs/m0"}


def short(message: str) -> None:
    """A one-line reason: no grammar dump, no backtrace."""
    assert len(message) < 300 and "\n" not in message and "backtrace" not in message, message
    assert not any(part in message for part in ("d999", "r2999", "option 99", '"aa"')), message


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_model(str(default_model_path())).tokenizer


@pytest.fixture
def grammars(tokenizer: Any) -> Iterator[structured.GrammarTokenizer]:
    """The default model's vocabulary, with a compile worker (and cache) of its own."""
    grammars = structured.GrammarTokenizer(tokenizer, tokenizer.vocab_size)
    yield grammars
    grammars.close()


# ---- the bounds, before llguidance ----

@pytest.mark.parametrize("constraint, reason", [
    (OutputConstraint("json_schema", CHAINED_DEFS, "response_format.json_schema.schema"), "nests more than 128"),
    (OutputConstraint("lark", CHAINED_LARK, "structured_outputs.grammar"), "has 3002 rules"),
    (OutputConstraint("gbnf", CHAINED_GBNF, "grammar"), "has 10002 rules"),
    (OutputConstraint("choice", HUGE_CHOICE, "structured_outputs.choice"), "100000 choices"),
    (OutputConstraint("choice", ["x" * 300_000], "structured_outputs.choice"), "300000 bytes"),
    (OutputConstraint("regex", "a" * 20_000, "structured_outputs.regex"), "20000 characters"),
    (OutputConstraint("json_schema", {"enum": ["x" * 600_000]}, "json_schema"), "600014 bytes"),
])
def test_bounds_refuse_before_llguidance(grammars: structured.GrammarTokenizer, constraint: OutputConstraint,
                                         reason: str) -> None:
    with pytest.raises(LSEError) as caught:
        structured.constraint_grammar(constraint, grammars)
    error = caught.value
    assert (error.status, error.type, error.code, error.param) == (400, "invalid_request_error", "invalid_value",
                                                                   constraint.param)
    assert reason in error.message and "LSE compiles" in error.message
    short(error.message)
    assert grammars.checker.pid is None   # the compile worker never saw them


@pytest.mark.parametrize("schema", [*(schema for _, schema in REAL_WORLD.values()), WIDE, TREE, NESTED_MODELS,
                                    chained_defs(20)])
def test_real_schemas_are_within_the_bounds(schema: dict[str, Any]) -> None:
    structured.check_schema(schema, "response_format.json_schema.schema")


def test_depth_counts_through_refs_once_each() -> None:
    """A def referred to from many places is measured once: a chain of 40 defs, each referring to the next
    twice, is 2^40 paths, measured in no time and within the bounds."""
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"},
                                                       "b": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(40)}
    structured.check_schema({"$defs": defs | {"d40": {"type": "integer"}}, "$ref": "#/$defs/d0"}, "json_schema")
    nested: Any = {"type": "integer"}
    for _ in range(200):   # arrays nest too (and deeper than this walk may recurse)
        nested = [nested]
    with pytest.raises(LSEError, match="nests more than 128"):
        structured.check_schema({"anyOf": nested}, "json_schema")


# ---- the compile worker ----

def test_a_grammar_that_crashes_the_compiler_is_refused_and_remembered(grammars: structured.GrammarTokenizer) -> None:
    with pytest.raises(LSEError) as caught:
        grammars.matcher(llguidance.LLMatcher.grammar_from_lark(EMBEDDED_DEFS), "structured_outputs.grammar")
    assert (caught.value.status, caught.value.param) == (400, "structured_outputs.grammar")
    assert caught.value.message == "llguidance's compiler crashed on it"
    assert grammars.checker.pid is None                  # the worker died with it
    grammars.matcher(structured.constraint_grammar(OutputConstraint("json_schema", TREE, "json_schema"), grammars),
                     "json_schema")                      # a fresh worker proves the next grammar
    worker = grammars.checker.pid
    assert worker is not None
    with pytest.raises(LSEError, match="crashed"):       # refused again from the cache: the worker never sees it
        grammars.matcher(llguidance.LLMatcher.grammar_from_lark(EMBEDDED_DEFS), "structured_outputs.grammar")
    assert grammars.checker.pid == worker


def test_a_grammar_is_compiled_once(grammars: structured.GrammarTokenizer) -> None:
    grammar = structured.constraint_grammar(OutputConstraint("choice", ["yes", "no"], "c"), grammars)
    first = grammars.matcher(grammar, "c")
    grammars.close()                                     # no worker: a grammar seen before needs none
    again = grammars.matcher(grammar, "c")
    assert grammars.checker.pid is None
    assert again is not first and again.consume_tokens(grammars.lltokenizer.tokenize_str("yes"))
    assert again.is_accepting() and not first.is_accepting()   # each request its own matcher


def test_too_many_items_is_found_at_the_first_mask(grammars: structured.GrammarTokenizer) -> None:
    with pytest.raises(LSEError) as caught:
        grammars.matcher(llguidance.LLMatcher.grammar_from_lark(TOO_MANY_ITEMS), "structured_outputs.grammar")
    assert caught.value.status == 400 and "Too many items" in caught.value.message
    short(caught.value.message)


def test_a_compile_past_its_deadline_is_refused_and_its_worker_replaced(
        grammars: structured.GrammarTokenizer) -> None:
    checker = GrammarChecker(grammars.vocabulary, deadline_s=1)
    try:
        slow = "start: " + " | ".join(json.dumps(c) for c in HUGE_CHOICE)   # 8 s, then a panic
        with pytest.raises(GrammarRefused) as caught:
            checker.prove(slow)
        assert (caught.value.reason, caught.value.lasting) == ("llguidance did not compile it within 1 s", False)
        assert checker.pid is None
        checker.prove('start: "ok"')
        assert checker.pid is not None
    finally:
        checker.close()


# ---- through the server, beside a running stream ----

NEIGHBOUR = {"messages": [{"role": "user", "content": "Tell me about the sea."}], "temperature": 0,
             "max_tokens": 48, "ignore_eos": True, "stream": True}
ASK = [{"role": "user", "content": "Reply in JSON."}]


def chat_schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}}}


# (path, body fields, the param the 400 names)
REFUSED = [
    ("/v1/chat/completions", chat_schema(CHAINED_DEFS), "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"structured_outputs": {"grammar": CHAINED_LARK}}, "structured_outputs.grammar"),
    ("/v1/chat/completions", {"grammar": CHAINED_GBNF}, "grammar"),
    ("/v1/chat/completions", {"structured_outputs": {"choice": HUGE_CHOICE}}, "structured_outputs.choice"),
    ("/v1/chat/completions", {"structured_outputs": {"grammar": TOO_MANY_ITEMS}}, "structured_outputs.grammar"),
    ("/v1/chat/completions", {"structured_outputs": {"grammar": EMBEDDED_DEFS}}, "structured_outputs.grammar"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": CHAINED_DEFS}}],
                              "tool_choice": "required"}, "tools[0].function.parameters"),
    ("/v1/responses", {"text": {"format": {"type": "json_schema", "name": "reply", "schema": CHAINED_DEFS}}},
     "text.format.schema"),
    ("/v1/responses", {"tools": [{"type": "function", "name": "f", "parameters": CHAINED_DEFS}],
                       "tool_choice": "required"}, "tools[0].parameters"),
    ("/v1/messages", {"output_config": {"format": {"type": "json_schema", "schema": CHAINED_DEFS}}},
     "output_config.format.schema"),
    ("/v1/messages", {"tools": [{"name": "f", "input_schema": CHAINED_DEFS}], "tool_choice": {"type": "any"}},
     "tools[0].input_schema"),
]


def request_body(path: str, fields: dict[str, Any], model: str) -> dict[str, Any]:
    if path == "/v1/responses":
        return {"model": model, "input": "Reply in JSON.", "max_output_tokens": 8} | fields
    return {"model": model, "messages": ASK, "max_tokens": 8} | fields


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with lse_server(default_model_path(), "--kv-len", "512", "--parallel", "2") as s:
        yield s


def neighbour_deltas(lines: Iterator[str]) -> list[str]:
    deltas = []
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            chunk = json.loads(line[6:])
            deltas += [choice["delta"].get("content") or "" for choice in chunk["choices"]]
    return deltas


def test_refusals_leave_the_server_and_a_neighbour_as_they_were(server: Server) -> None:
    with server.client() as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        with http.stream("POST", "/v1/chat/completions", json=NEIGHBOUR) as response:
            alone = neighbour_deltas(response.iter_lines())
        with http.stream("POST", "/v1/chat/completions", json=NEIGHBOUR) as response:
            lines = response.iter_lines()
            beside = neighbour_deltas(_until_first_chunk(lines))
            for path, fields, param in REFUSED:   # while the neighbour streams
                refused = http.post(path, json=request_body(path, fields, model))
                assert refused.status_code == 400, (path, param, refused.text[:300])
                error = refused.json()["error"]
                assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "invalid_value",
                                                                          param), error
                short(error["message"])
            beside += neighbour_deltas(lines)
        assert beside == alone and "".join(alone).strip()
        assert server.process.poll() is None and http.get("/health").status_code == 200
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                  "additionalProperties": False}   # structured output still works, the worker restarted
        reply = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 16, "temperature": 0}
                          | chat_schema(schema)).json()
        assert json.loads(reply["choices"][0]["message"]["content"]).keys() == {"ok"}, reply


def _until_first_chunk(lines: Iterator[str]) -> Iterator[str]:
    for line in lines:
        yield line
        if line.startswith("data: "):
            return
