"""Structured output with llguidance: a request's constraint becomes a grammar, each constrained sequence a
matcher, and each step's allowed tokens a bitmask that the ``mask`` sampling op of every device applies.

  OutputConstraint (lse_core.protocol)   what the request asked: a JSON schema, regex, choice, Lark or GBNF
  tool_call_grammar                       enforced tool calls, in the call syntax the model's template shows
  GrammarTokenizer                        the model's vocabulary as llguidance sees it, one per engine
  with_reasoning                          a grammar that leaves the reasoning block free and constrains the answer
  Constraint                              one sequence's matcher: from the reply's start, or lazily from a tool
                                          call's opening marker; and when the reply ends
  compute_masks                           the step's masks, computed in a worker thread during the forward pass

A lazy matcher sees the reply's tokens once the marker has appeared: bytes that follow the marker inside the
same token are fed to it too, so its state is the text the client sees.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import cached_property
from typing import Any

import llguidance
import llguidance.numpy as llnp
import numpy as np
from llguidance.gbnf_to_lark import any_to_lark

from lse_core.errors import invalid_request
from lse_core.graph.ir import SamplingBatch
from lse_core.protocol import OutputConstraint
from lse_core.tools import ToolCallFormat

# JSON as json.dumps writes it ("a": 1, "b": 2): what models saw most; free whitespace lets a small
# model pad a reply with newlines until its limit.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KINDS = ("json_object", "json_schema", "regex", "choice", "lark", "gbnf")
_ENGINE = f"llguidance {importlib.metadata.version('llguidance')}"   # read once: it reads the package metadata


def supported() -> dict[str, Any]:
    """What /v1/models and lse_model_info say of structured output (a fresh copy each call)."""
    return {"supported": True, "engine": _ENGINE, "kinds": list(KINDS),
            "fields": ["response_format", "structured_outputs", "grammar", "json_schema"],
            "tool_choice": ["auto", "none", "required", "function"]}


def constraint_grammar(constraint: OutputConstraint) -> str:
    """The llguidance grammar of a request's constraint (checked when its matcher is built)."""
    value = constraint.value
    match constraint.kind:
        case "json_schema":
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(value, defaults=JSON_OPTIONS)
            except ValueError as e:
                raise invalid_request(f"{constraint.param}: {e}", "invalid_value", constraint.param) from None
        case "regex":
            return llguidance.LLMatcher.grammar_from_regex(value)
        case "choice":
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(_lark_string(c) for c in value))
        case _:   # lark or gbnf: llguidance tells them apart and converts GBNF
            try:
                return llguidance.LLMatcher.grammar_from_lark(any_to_lark(value))
            except Exception as e:   # the converter's own errors have several types
                raise invalid_request(f"{constraint.param}: {e}", "invalid_value", constraint.param) from None


def tool_call_grammar(call_format: ToolCallFormat, tools: list[dict[str, Any]], name: str | None, parallel: bool,
                      vocab: GrammarTokenizer, lazy: bool, syntax: tuple[str, str, str] | None = None) -> str:
    """A grammar of the calls the reply must make: to ``name``, or to any offered tool when None; several
    when ``parallel``. ``lazy``: the grammar of what follows the opening marker (the reply chose to call).
    ``syntax``: for calls written between tokens, the text before a call's name, between it and the JSON
    arguments, and after them (lse_core.tools.call_syntax). Special tokens in markers are named as tokens."""
    offered = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    if call_format.body == "xml":
        return _xml_call_grammar(call_format, offered, parallel, vocab, lazy)
    if syntax is not None:
        return _tagged_call_grammar(call_format, offered, parallel, vocab, lazy, syntax)
    calls = [{"type": "object", "properties": {call_format.name_key: {"const": f["name"]},
                                               call_format.arguments_key: f.get("parameters") or {"type": "object"}},
              "required": [call_format.name_key, call_format.arguments_key], "additionalProperties": False}
             for f in offered]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if call_format.body == "list":
        body = {"type": "array", "items": one, "minItems": 1} | ({} if parallel else {"maxItems": 1})
    else:
        body = one
    rules = [f"body: %json {json.dumps(body | {'x-guidance': JSON_OPTIONS})}"]
    if call_format.whole_reply:
        rules.insert(0, "start: body")
        return llguidance.LLMatcher.grammar_from_lark("\n".join(rules))
    opening = vocab.literal(call_format.open_marker)
    closing = vocab.literal(call_format.close_marker) if call_format.close_marker else ""
    block = f'"\\n"? body "\\n"? {closing}' if closing else "body"
    if lazy:
        rules.insert(0, f"start: {block}")
    else:
        repeat = ' ("\\n" call)*' if parallel and call_format.body == "object" else ""
        rules[:0] = [f"start: call{repeat}", f"call: {opening} {block}"]
    return llguidance.LLMatcher.grammar_from_lark("\n".join(rules))


def _tagged_call_grammar(call_format: ToolCallFormat, offered: list[dict[str, Any]], parallel: bool,
                         vocab: GrammarTokenizer, lazy: bool, syntax: tuple[str, str, str]) -> str:
    """Calls between tokens (DeepSeek, Kimi, Solar): each as the template writes one, its name then its JSON
    arguments between the text ``syntax`` gives, inside the format's markers."""
    before, middle, after = (vocab.literal(part) for part in syntax)
    rules = [f"function_{i}: {before} {_lark_string(f['name'])} {middle} "
             f"%json {json.dumps((f.get('parameters') or {'type': 'object'}) | {'x-guidance': JSON_OPTIONS})} {after}"
             for i, f in enumerate(offered)]
    calls = f"({' | '.join(f'function_{i}' for i in range(len(offered)))}){'+' if parallel else ''}"
    closing = vocab.literal(call_format.close_marker or "")
    opening = "" if lazy else vocab.literal(call_format.open_marker)
    start = f"start: {opening} {calls} {closing}"
    return llguidance.LLMatcher.grammar_from_lark("\n".join([start, *rules]))


def _xml_call_grammar(call_format: ToolCallFormat, offered: list[dict[str, Any]], parallel: bool,
                      vocab: GrammarTokenizer, lazy: bool) -> str:
    """Qwen3-Coder's calls: <function=name>, then each parameter in the schema's order as <parameter=key>,
    its value on lines of its own (a string as it is, anything else as JSON), </parameter>."""
    newline = _lark_string("\n")
    rules, functions = [], []
    for i, function in enumerate(offered):
        schema = function.get("parameters") or {}
        required = set(schema.get("required") or [])
        parts = []
        for j, (key, prop) in enumerate((schema.get("properties") or {}).items()):
            rules.append(_xml_value(f"value_{i}_{j}", prop if isinstance(prop, dict) else {}))
            opening = _lark_string(f"<parameter={key}>\n")
            part = f"{opening} value_{i}_{j} {newline}"
            parts.append(part if key in required else f"({part})?")
        opening = _lark_string(f"<function={function['name']}>\n")
        rules.append(f"function_{i}: {opening} {' '.join(parts)} {_lark_string('</function>')}")
        functions.append(f"function_{i}")
    closing = vocab.literal(call_format.close_marker or "")
    block = f"{newline}? ({' | '.join(functions)}) {newline}? {closing}"
    if lazy:
        starts = [f"start: {block}"]
    else:
        starts = [f"start: call ({newline} call)*" if parallel else "start: call",
                  f"call: {vocab.literal(call_format.open_marker)} {block}"]
    return llguidance.LLMatcher.grammar_from_lark("\n".join([*starts, *rules]))


def _xml_value(rule: str, schema: dict[str, Any]) -> str:
    """A parameter's value and its closing tag: a string as it is (one of its enum's; a line of up to its
    maxLength characters; or any text up to the tag), anything else as JSON."""
    closing = _lark_string("\n</parameter>")
    enum = schema.get("enum")
    if enum and all(isinstance(v, str) for v in enum):
        return f"{rule}: ({' | '.join(_lark_string(v) for v in enum)}) {closing}"
    if schema.get("type") == "string" and isinstance(schema.get("maxLength"), int):
        return f"{rule}: /[^\\n]{{0,{schema['maxLength']}}}/ {closing}"
    if schema.get("type") == "string":
        return f"{rule}[stop={closing}]: /(.|\\n)*/"
    return f"{rule}: %json {json.dumps(schema | {'x-guidance': JSON_OPTIONS})} {closing}"


def with_reasoning(grammar: str, open_marker: str, close_marker: str, starts_inside: bool,
                   vocab: GrammarTokenizer) -> str:
    """``grammar`` after a reasoning block whose text is free: the block the generation prompt opened
    (``starts_inside``), or one the model may open itself with ``open_marker``."""
    top = json.loads(grammar) if grammar.lstrip().startswith("{") else {"grammars": [{"lark_grammar": grammar}]}
    top["grammars"][0]["name"] = "answer"
    block = "thought /[ \\n]*/" if starts_inside else f"({vocab.literal(open_marker)} thought /[ \\n]*/)?"
    close = vocab.special_id(close_marker)
    if close is None:   # text: the free text stops where it appears
        thought = f"thought[stop={_lark_string(close_marker)}]: /(.|\\n)*/"
    else:               # a token no text can contain ends the free text
        thought = f"thought: /(.|\\n)*/ <[{close}]>"
    return json.dumps({"grammars": [{"name": "start", "lark_grammar": f"start: {block} @answer\n{thought}"},
                                    *top["grammars"]]})


def _lark_string(text: str) -> str:
    return json.dumps(text)   # a JSON string literal is a Lark one


class GrammarTokenizer:
    """The model's vocabulary for llguidance, built by the first request that needs it: it reads every token
    (0.7 s and 26 MiB for SmolLM2's 49k), which an engine that never constrains a reply should not pay."""

    def __init__(self, tokenizer: Any, logits_width: int) -> None:
        self.tokenizer = tokenizer
        self.words = math.ceil(logits_width / 32)     # the mask's int32 words per row, as the mask op reads it
        self._n_vocab = max(logits_width, tokenizer.vocab_size)
        self._lock = threading.Lock()
        self._built: llguidance.LLTokenizer | None = None

    @property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._built is None:
                self._built = llguidance.LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self._n_vocab,
                                                     eos_token=list(self.tokenizer.eos_ids))
            return self._built

    def special_id(self, text: str) -> int | None:
        """The id of the special token spelled ``text``, if the vocabulary has one."""
        return self._special_tokens.get(text)

    @cached_property
    def _special_tokens(self) -> dict[str, int]:
        """Added tokens llguidance reads as tokens, not text (their bytes are no text), by spelling."""
        added = self.tokenizer.backend.get_added_tokens_decoder()
        return {t.content: i for i, t in added.items() if self.lltokenizer.is_special_token(i)}

    def literal(self, text: str) -> str:
        """``text`` as Lark: its special tokens named as tokens, the rest as strings ("" for none)."""
        if not text:
            return '""'
        specials = sorted(self._special_tokens, key=len, reverse=True)
        items, plain, at = [], "", 0
        while at < len(text):
            token = next((t for t in specials if text.startswith(t, at)), None)
            if token is None:
                plain, at = plain + text[at], at + 1
                continue
            items += [_lark_string(plain)] if plain else []
            items.append(f"<[{self._special_tokens[token]}]>")
            plain, at = "", at + len(token)
        return " ".join(items + ([_lark_string(plain)] if plain else []))

    def matcher(self, grammar: str, param: str) -> llguidance.LLMatcher:
        """A matcher for the grammar; a grammar llguidance rejects is a 400 naming ``param``."""
        matcher = llguidance.LLMatcher(self.lltokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise invalid_request(f"{param}: {matcher.get_error()}", "invalid_value", param)
        return matcher


class Constraint:
    """One sequence's grammar, from the reply's first token; or, lazily, from the first ``trigger`` (a tool
    call's opening marker) on, and after each complete call again when ``repeat``. Otherwise a complete
    grammar ends the reply."""

    def __init__(self, tokenizer: GrammarTokenizer, matcher: llguidance.LLMatcher, description: str,
                 trigger: str | None = None, repeat: bool = False) -> None:
        self.tokenizer = tokenizer
        self.matcher = matcher
        self.description = description      # what lse_warnings names: "response_format.json_schema.schema"
        self.trigger = trigger.encode() if trigger else None
        self.lazy = trigger is not None
        self.repeat = repeat
        self.active = not self.lazy
        self._tail = b""                    # the last bytes of the reply, where a trigger may be starting

    def advance(self, token: int) -> bool:
        """Take the sampled token; True when the grammar is complete and the reply ends. Raises
        RuntimeError when the matcher fails (a limit of llguidance's, or a token it did not allow)."""
        if not self.active:
            return self._watch(self.tokenizer.tokenizer.token_bytes(token))
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"structured output failed: {self.matcher.get_error()}")
        return self._after_step()

    @property
    def complete(self) -> bool:
        """The reply so far satisfies the constraint (a lazy one: no call is left half written)."""
        if self.lazy:
            return not self.active
        return self.active and self.matcher.is_accepting()

    def _watch(self, piece: bytes) -> bool:
        seen = self._tail + piece
        at = seen.find(self.trigger)
        if at < 0:
            self._tail = seen[-(len(self.trigger) - 1):] if len(self.trigger) > 1 else b""
            return False
        rest = seen[at + len(self.trigger):]
        self.matcher.reset()
        self.active, self._tail = True, b""
        if rest and not self.matcher.consume_tokens(self.tokenizer.lltokenizer.tokenize_bytes(rest)):
            raise RuntimeError(f"structured output failed: {self.matcher.get_error()}")
        return self._after_step()

    def _after_step(self) -> bool:
        if not self.matcher.is_stopped():
            return False
        if self.repeat:
            self.active = False
            return False
        return True


class _MaskWorker:
    """One worker thread (llguidance's executor spreads a batch over its own threads) so the masks are
    computed while the engine thread runs the forward pass."""

    def __init__(self) -> None:
        self.executor = llguidance.LLExecutor()
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lse-masks")


_worker: _MaskWorker | None = None
_worker_lock = threading.Lock()


def compute_masks(batch: SamplingBatch, rows: list[tuple[Constraint, int]]) -> None:
    """Start computing the masks of ``rows`` (constraint, row) into ``batch``: ``batch.await_mask()``
    returns when ``batch.token_mask`` is ready."""
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = _MaskWorker()
    worker = _worker
    words = rows[0][0].tokenizer.words
    n_rows = len(batch.temperature)
    constrained = np.zeros(n_rows, dtype=bool)
    constrained[[row for _, row in rows]] = True
    batch.constrained = constrained
    full = llnp.allocate_token_bitmask(n_rows, rows[0][0].tokenizer.lltokenizer.vocab_size)

    def fill() -> None:
        llnp.fill_next_token_bitmask_par(worker.executor, [(c.matcher, row) for c, row in rows], full)
        batch.token_mask = full if full.shape[1] == words else np.ascontiguousarray(full[:, :words])

    batch.mask_job = worker.thread.submit(fill)
