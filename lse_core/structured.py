"""Structured output with llguidance: a request's constraint becomes a grammar, each constrained sequence a
matcher, and each step's allowed tokens a bitmask that the ``mask`` sampling op of every device applies.

  OutputConstraint (lse_core.protocol)   what the request asked: a JSON schema, regex, choice, Lark or GBNF
  check_schema and the other bounds       what may reach llguidance at all (its compile recurses: a deep schema
                                          or a long chain of rules overflows the stack)
  tool_call_grammar                       enforced tool calls, in the call syntax the model's template shows
  GrammarTokenizer                        the model's vocabulary as llguidance sees it, one per engine; its
                                          matchers are proven in the compile worker first (grammar_check)
  with_reasoning                          a grammar that leaves the reasoning block free and constrains the answer
  Constraint                              one sequence's matcher: from the reply's start, or lazily from a tool
                                          call's opening marker; and when the reply ends
  compute_masks                           the step's masks, computed in a worker thread during the forward pass

A lazy matcher sees the reply's tokens once the marker has appeared: bytes that follow the marker inside the
same token are fed to it too, so its state is the text the client sees.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import cached_property
from typing import Any, TypeVar

import llguidance
import llguidance.numpy as llnp
import numpy as np
from llguidance.gbnf_to_lark import is_lark_syntax

from lse_core.errors import invalid_request, server_error
from lse_core.grammar_check import (
    ENGINE_STACK_BYTES,
    GrammarChecker,
    GrammarRefused,
    Vocabulary,
    WorkerUnavailable,
    compile_matcher,
    one_line,
)
from lse_core.graph.ir import SamplingBatch
from lse_core.protocol import OutputConstraint
from lse_core.tools import ToolCallFormat

# JSON as json.dumps writes it ("a": 1, "b": 2): what models saw most; free whitespace lets a small
# model pad a reply with newlines until its limit.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KINDS = ("json_object", "json_schema", "regex", "choice", "lark", "gbnf")
_ENGINE = f"llguidance {importlib.metadata.version('llguidance')}"   # read once: it reads the package metadata
# What may reach llguidance, far above what real requests send (OpenAI's structured outputs allow 5,000
# properties, 10 levels of nesting, 1,000 enum values) and far below what overflows its compile's stack (a
# chain of 700 $defs or 3,000 rules on 8 MiB; the engine compiles on ENGINE_STACK_BYTES).
MAX_SCHEMA_BYTES = 512 << 10       # a 5,000-property schema is 190 KiB
MAX_SCHEMA_DEPTH = 128             # llguidance's JSON reader nests 128 levels; LSE counts through $ref too
MAX_GRAMMAR_BYTES = 256 << 10
MAX_GRAMMAR_RULES = 1000           # GBNF's conversion to Lark takes 0.6 s at 1,000 chained rules
MAX_CHOICES = 5000                 # llguidance compiles 5,000 in 0.2 s; 100,000 make it panic after 8-50 s
MAX_CHOICE_BYTES = 256 << 10
MAX_PATTERN_CHARS = 16 << 10
COMPILED_GRAMMARS = 64             # matchers kept compiled (and refusals remembered), by grammar hash
_RULE = re.compile(r"^[ \t]*[?!]?[\w.-]+(\[[^\]\n]*\])?[ \t]*(::=|:)", re.MULTILINE)   # Lark's and GBNF's
_T = TypeVar("_T")


def supported() -> dict[str, Any]:
    """What /v1/models and lse_model_info say of structured output (a fresh copy each call)."""
    return {"supported": True, "engine": _ENGINE, "kinds": list(KINDS),
            "fields": ["response_format", "structured_outputs", "grammar", "json_schema"],
            "tool_choice": ["auto", "none", "required", "function"]}


def constraint_grammar(constraint: OutputConstraint, vocab: GrammarTokenizer) -> str:
    """The llguidance grammar of a request's constraint, within LSE's bounds (checked when its matcher is
    built). A GBNF grammar is converted to Lark in the compile worker."""
    value, param = constraint.value, constraint.param
    match constraint.kind:
        case "json_schema":
            check_schema(value, param)
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(value, defaults=JSON_OPTIONS)
            except ValueError as e:
                raise invalid_request(one_line(str(e)), "invalid_value", param) from None
        case "regex":
            _refuse_over(len(value), MAX_PATTERN_CHARS, "the pattern has {} characters", param)
            return llguidance.LLMatcher.grammar_from_regex(value)
        case "choice":
            _refuse_over(len(value), MAX_CHOICES, "{} choices are offered", param)
            _refuse_over(sum(len(c.encode()) for c in value), MAX_CHOICE_BYTES, "the choices have {} bytes", param)
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(_lark_string(c) for c in value))
        case _:   # lark or gbnf: llguidance tells them apart
            _refuse_over(len(value.encode()), MAX_GRAMMAR_BYTES, "the grammar has {} bytes", param)
            _refuse_over(len(_RULE.findall(value)), MAX_GRAMMAR_RULES, "the grammar has {} rules", param)
            return llguidance.LLMatcher.grammar_from_lark(vocab.lark(value, param))


def check_schema(schema: Any, param: str) -> None:
    """Refuse (400 naming ``param``) a JSON schema over LSE's bounds: its size, and its nesting counted through
    $ref, which is what llguidance's compile recurses over."""
    _refuse_over(len(json.dumps(schema)), MAX_SCHEMA_BYTES, "the JSON schema has {} bytes", param)
    if _SchemaDepth(schema, MAX_SCHEMA_DEPTH).exceeded():
        raise invalid_request(f"the JSON schema nests more than {MAX_SCHEMA_DEPTH} levels deep, counting through "
                              "$ref; LSE compiles no deeper", "invalid_value", param)


def _refuse_over(amount: int, limit: int, what: str, param: str) -> None:
    """400 naming ``param`` when ``amount`` is over ``limit``; ``what`` says what was counted ({} the amount)."""
    if amount > limit:
        raise invalid_request(f"{what.format(amount)}; LSE compiles at most {limit}", "invalid_value", param)


class _SchemaDepth:
    """The deepest nesting of objects and arrays in a schema, where a $ref into the schema ("#/$defs/x")
    nests its target. A ref met again below itself (a recursive schema) adds nothing; each target's height is
    measured once, so the walk is linear in the schema."""

    def __init__(self, root: Any, limit: int) -> None:
        self.root = root
        self.limit = limit
        self.heights: dict[str, int] = {}
        self.open: set[str] = set()

    def exceeded(self) -> bool:
        try:
            return self._height(self.root, 0) > self.limit
        except _TooDeep:
            return True

    def _height(self, node: Any, level: int) -> int:
        if level > self.limit:   # the path so far is too deep: no need to go on (nor to recurse without end)
            raise _TooDeep
        if isinstance(node, list):
            return 1 + max((self._height(item, level + 1) for item in node), default=0)
        if not isinstance(node, dict):
            return 0
        below = max((self._height(value, level + 1) for value in node.values()), default=0)
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            below = max(below, self._ref_height(ref, level + 1))
        return 1 + below

    def _ref_height(self, ref: str, level: int) -> int:
        if ref in self.open:
            return 0
        if ref not in self.heights:
            self.open.add(ref)
            self.heights[ref] = self._height(_pointed(self.root, ref), level)
            self.open.discard(ref)
        if level + self.heights[ref] > self.limit:
            raise _TooDeep
        return self.heights[ref]


class _TooDeep(Exception):
    pass


def _pointed(root: Any, ref: str) -> Any:
    """What a local JSON pointer ("#/$defs/item") names in ``root``; None when it names nothing."""
    node = root
    for part in ref[1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def tool_call_grammar(call_format: ToolCallFormat, tools: list[dict[str, Any]], name: str | None, parallel: bool,
                      vocab: GrammarTokenizer, lazy: bool, syntax: tuple[str, str, str] | None = None) -> str:
    """A grammar of the calls the reply must make: to ``name``, or to any offered tool when None; several
    when ``parallel``. ``lazy``: the grammar of what follows the opening marker (the reply chose to call).
    ``syntax``: for calls written between tokens, the text before a call's name, between it and the JSON
    arguments, and after them (lse_core.tools.call_syntax). Special tokens in markers are named as tokens.
    Each offered tool's parameters must be within LSE's bounds (a 400 naming them)."""
    picked = [(i, t["function"]) for i, t in enumerate(tools) if name is None or t["function"]["name"] == name]
    for i, function in picked:
        check_schema(function.get("parameters") or {}, f"tools[{i}].function.parameters")
    offered = [function for _, function in picked]
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
    (0.7 s and 26 MiB for SmolLM2's 49k), which an engine that never constrains a reply should not pay. Its
    matchers come from grammars the compile worker proved first, compiled once and copied for each request."""

    def __init__(self, tokenizer: Any, logits_width: int) -> None:
        self.tokenizer = tokenizer
        self.words = math.ceil(logits_width / 32)     # the mask's int32 words per row, as the mask op reads it
        self._n_vocab = max(logits_width, tokenizer.vocab_size)
        self._lock = threading.Lock()
        self._built: llguidance.LLTokenizer | None = None
        self.checker = GrammarChecker(self.vocabulary)
        self._known_lock = threading.Lock()
        # by grammar hash: a compiled matcher, a GBNF grammar's Lark, or a lasting refusal's reason
        self._known: OrderedDict[str, llguidance.LLMatcher | str | GrammarRefused] = OrderedDict()

    def vocabulary(self) -> Vocabulary:
        """What llguidance's tokenizer is built from, here and in the compile worker."""
        return Vocabulary(self.tokenizer.backend.to_str(), self._n_vocab, list(self.tokenizer.eos_ids))

    @property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._built is None:
                self._built = self.vocabulary().lltokenizer()
            return self._built

    def close(self) -> None:
        """Stop the compile worker (the engine is closing)."""
        self.checker.close()

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
        """A matcher for the grammar; a grammar refused (llguidance's error, or one that crashed or outlasted
        the compile worker) is a 400 naming ``param``."""
        with _refusals(param):
            template = self._known_or(f"grammar {_digest(grammar)}", lambda: self._compile(grammar))
        with self._known_lock:   # one copy at a time of a template other requests share
            return template.deep_copy()

    def lark(self, text: str, param: str) -> str:
        """A Lark or GBNF grammar as Lark (GBNF converted in the compile worker); 400 naming ``param``."""
        if is_lark_syntax(text):
            return text
        with _refusals(param):
            return self._known_or(f"gbnf {_digest(text)}", lambda: self.checker.gbnf_to_lark(text))

    def _compile(self, grammar: str) -> llguidance.LLMatcher:
        if self._built is None:   # the first compile: build this vocabulary while the worker builds its own
            threading.Thread(target=lambda: self.lltokenizer, name="lse-grammar-vocabulary", daemon=True).start()
        self.checker.prove(grammar)
        matcher = compile_matcher(self.lltokenizer, grammar, ENGINE_STACK_BYTES)
        if matcher.is_error():
            raise GrammarRefused(one_line(matcher.get_error()))
        return matcher

    def _known_or(self, key: str, make: Callable[[], _T]) -> _T:
        """What the cache holds for ``key``, else ``make()`` kept there; a refusal raises GrammarRefused."""
        with self._known_lock:
            known = self._known.get(key)
            if known is not None:
                self._known.move_to_end(key)
        if known is None:
            try:
                known = make()
            except GrammarRefused as e:
                if not e.lasting:
                    raise
                known = e
            with self._known_lock:
                self._known[key] = known
                while len(self._known) > COMPILED_GRAMMARS:
                    self._known.popitem(last=False)
        if isinstance(known, GrammarRefused):
            raise GrammarRefused(known.reason)
        return known


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@contextmanager
def _refusals(param: str) -> Iterator[None]:
    """The compile worker's answers as errors: a refused grammar is a 400 naming ``param``; a worker that
    cannot start is the server's fault."""
    try:
        yield
    except GrammarRefused as e:
        raise invalid_request(e.reason, "invalid_value", param) from None
    except WorkerUnavailable as e:
        raise server_error(str(e)) from None


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
