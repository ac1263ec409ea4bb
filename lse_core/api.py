"""The in-process API: lse_open / lse_request / lse_model_info / lse_status / lse_close.

The HTTP server is a thin transport over these functions; every JSON body they produce is
shaped by lse_core.protocol, so both return the same JSON."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

from typing_extensions import TypedDict

from lse_core import embeddings, protocol, structured
from lse_core.adapters import anthropic, ollama, responses
from lse_core.adapters.common import CoreDelta, Count, Translation, core_delta, core_end
from lse_core.adapters.responses import ResponseStore
from lse_core.config import KV_CACHE_TYPES, KVCacheType, LSEConfig
from lse_core.devices import hookspec  # hookspec.Device: an open device; Device below is its JSON
from lse_core.devices.hookspec import CompileContext, DeviceInfo
from lse_core.devices.host_memory import return_large_blocks
from lse_core.devices.registry import Registry, discover, open_devices, open_interpreter, resolve_pool
from lse_core.engine.engine import Engine, EngineLoad
from lse_core.engine.sequence import Delta, ReasoningBudget, SeqParams, Sequence
from lse_core.engine.speculation import Speculation
from lse_core.errors import LSEError, StartupError, invalid_request, model_not_found, server_error
from lse_core.fallback import CPUFallback, FallbackLog
from lse_core.graph.ir import Graph
from lse_core.graph.plan import Placement, Plan
from lse_core.limits import check_prompt_text, prompt_tokens, prompt_too_long, resolve_limit
from lse_core.model.arch import build_graph
from lse_core.model.catalog import model_id
from lse_core.model.default import load_model
from lse_core.model.model import Model
from lse_core.sampling import GenerationDefaults, generation_defaults, resolve_sampling
from lse_core.stats import RequestStats, Stats
from lse_core.template.probe import TemplateThinking, probe
from lse_core.template.reasoning import THINK_MARKERS, ReasoningSplitter, reasoning_splitter
from lse_core.template.render import ChatTemplate, RenderTooLong
from lse_core.template.thinking import Level, Thinking, resolve_level, template_variables, thinking_budget
from lse_core.tools import BARE_JSON, ToolCallParser, call_syntax, tool_call_format

log = logging.getLogger("lse")

EVENT_TOKEN = "token"
EVENT_END = "end"
EVENT_ERROR = "error"


@dataclass
class Event:
    """One event of a request. token: ``data`` is a chunk object (the SSE chunk when streaming).
    end: ``data`` is the response object, or for a stream the list of its closing chunks.
    error: ``status`` and ``data``, the error body the server sends (in a stream: its error event, or the list of
    the events that end it)."""

    kind: str
    data: Any
    status: int = 200


def error_in_stream(status: int) -> bool:
    """Whether a streamed request's error, even one before its first token, is sent in its stream: a request
    that failed (500, CPU fallback refused...) is, as the spec asks; an error the client can fix (4xx: a bad
    field, a prompt that fills the context) or retry (503: a full queue) keeps its HTTP status."""
    return status == 500


@dataclass
class LSE:
    """An open engine."""

    config: LSEConfig
    model: Model
    model_id: str
    template: ChatTemplate | None
    thinking: TemplateThinking
    defaults: GenerationDefaults
    context_length: int
    registry: Registry
    devices: list[hookspec.Device]
    plan: Plan
    engine: Engine
    fallback: FallbackLog
    startup_warnings: list[str]
    grammars: structured.GrammarTokenizer
    stats: Stats = field(default_factory=Stats)

    @cached_property
    def call_syntax(self) -> tuple[str, str, str] | None:
        """How the template writes one call between tokens, read once off its rendering (tools.call_syntax)."""
        call_format = tool_call_format(self.template.source) if self.template is not None else None
        return call_syntax(self.template, call_format) if call_format is not None else None
    responses: ResponseStore = field(default_factory=ResponseStore)   # /v1/responses' stored conversations


def lse_open_or_raise(config: LSEConfig | dict[str, Any] | None = None) -> LSE:
    """Open the engine, raising StartupError with the one-line reason when it cannot start."""
    if not isinstance(config, LSEConfig):
        config = LSEConfig(**(config or {}))
    refused = config.cpu_fallback_refused
    return_large_blocks()
    registry = discover()
    infos, warnings = resolve_pool(registry, config.pool, refused)
    for warning in warnings:
        log.warning("lse: %s", warning)
    model = load_model(config.model)
    _ = model.tokenizer.max_token_bytes   # read once here: every prompt's size is checked against it
    template = None
    if model.chat_template is not None:
        template = ChatTemplate(model.chat_template, model.chat_template_source, model.tokenizer.template_variables())
    thinking = probe(template)
    defaults = generation_defaults(model.generation_config, model.config, config.temperature)
    graph = build_graph(model)
    context_length = config.kv_len or min(model.trained_context, 4096)
    if context_length < 2:
        raise StartupError(f"--kv-len {context_length} is too small; it is the context length in tokens")
    devices = open_devices(registry, infos)
    fallback = FallbackLog(allowed=not refused)
    interpreter = None if refused else open_interpreter(registry)
    if config.deterministic:
        _check_deterministic(devices + ([interpreter] if interpreter else []))
    ctx = CompileContext(kv_slots=config.parallel, kv_len=context_length,
                         max_tokens=max(config.prefill_chunk, config.parallel), deterministic=config.deterministic,
                         **_cache_types(config, graph, devices + ([interpreter] if interpreter else []), warnings))
    # the devices hold the weights as they lay them out: the file's pages go as each group compiles
    plan = Plan.build(graph, devices, ctx, interpreter, not refused, fallback.record, model.release_file_pages)
    _log_plan(plan)
    speculation = None if config.spec_type == "none" else Speculation(config.draft_max, config.draft_min)
    engine = Engine(plan, model.tokenizer, config.parallel, config.max_queue, config.prefill_chunk, speculation)
    grammars = structured.GrammarTokenizer(model.tokenizer, _logits_width(graph))
    return LSE(config, model, config.model_id or model_id(model.source), template, thinking, defaults,
               context_length, registry, devices, plan, engine, fallback, warnings, grammars)


def _cache_types(config: LSEConfig, graph: Graph, devices: list[hookspec.Device],
                 warnings: list[str]) -> dict[str, str]:
    """The KV cache types asked for (f16 where not named). A named type must be one every device stores, and
    q8_0 needs head dims of whole blocks; a device without the default f16 keeps f32, said in ``warnings``."""
    types = {}
    for option in ("cache_type_k", "cache_type_v"):
        named = getattr(config, option)
        flag = "--" + option.replace("_", "-")
        if named is not None and named not in KV_CACHE_TYPES:
            raise StartupError(f"{flag} must be one of {', '.join(KV_CACHE_TYPES)}, got {named!r}")
        types[option] = named or "f16"
        lacking = [d for d in devices if types[option] not in d.kv_cache_types]
        if lacking and named is not None:
            raise StartupError(f"{flag} {named} is not supported by " + "; ".join(
                f"the {d.info.backend} backend ({d.info.name} stores {', '.join(d.kv_cache_types)})" for d in lacking))
        for device in lacking:
            warnings.append(f"{device.info.name} keeps its KV cache's {option[-1]} in f32: it has no f16 cache "
                            f"({flag} f32 chooses f32 for every device)")
            log.warning("lse: %s", warnings[-1])
    head_dims = {int(n.attrs["head_dim"]) for n in graph.nodes if n.op == "attention"}
    for option, kind in types.items():
        if kind == "q8_0" and any(d % 32 for d in head_dims):
            raise StartupError(f"--{option.replace('_', '-')} q8_0 stores blocks of 32 values, and this model's "
                               f"head_dim is {', '.join(map(str, sorted(head_dims)))}; choose f16 or f32")
    return types


def _check_deterministic(devices: list[hookspec.Device]) -> None:
    """--deterministic runs only on devices whose kernels compute every row alike whatever the batch."""
    unable = [d.info.name for d in devices if not d.deterministic]
    if unable:
        raise StartupError(f"--deterministic is not supported by {', '.join(unable)}: its kernels do not promise "
                           "results independent of the batch; run without it, or with --pool jit:0 or cpu:0")


def lse_open(config: LSEConfig | dict[str, Any] | None = None) -> LSE | None:
    """Open the engine, or log the reason and return None (the C API's NULL)."""
    try:
        return lse_open_or_raise(config)
    except StartupError as e:
        log.error("lse: startup failed: %s", e)
        return None


def lse_close(lse: LSE) -> None:
    lse.engine.close()
    lse.grammars.close()
    for device in lse.devices:
        device.close()


def _logits_width(graph: Graph) -> int:
    """The vocabulary the logits cover: the rows of the matrix that makes them (it may pad the tokenizer's)."""
    head = next(n for n in graph.nodes if n.output == graph.output)
    return graph.weights[head.params[0]].shape[0]


def _log_plan(plan: Plan) -> None:
    by_device: dict[str, int] = {}
    for p in plan.placements:
        key = p.device.info.name if p.device else "refused"
        if p.fallback_cause is not None:
            key = f"{key} (CPU fallback)" if p.device else "refused (CPU fallback disabled)"
        by_device[key] = by_device.get(key, 0) + 1
    log.info("lse: plan: %s", ", ".join(f"{n} groups on {d}" for d, n in by_device.items()))


class Request:
    """A running request: ``cancel()`` ends its sequence at the next engine step and frees its slot."""

    def __init__(self, lse: LSE, endpoint: str, on_event: Callable[[Event], None], api: str | None = None) -> None:
        self.lse = lse
        self.endpoint = endpoint
        self.api = api or endpoint     # whose request it is, in the stats: "chat", "responses", "messages"...
        self.on_event = on_event
        self.sequence: Sequence | None = None
        self.done = threading.Event()

    def cancel(self, error: LSEError | None = None) -> None:
        """Cancel the request; with ``error``, it ends with that error instead (its stream's error event)."""
        if self.sequence is not None and not self.done.is_set():
            self.lse.engine.cancel(self.sequence, error)

    def pause(self, paused: bool = True) -> None:
        """Stop decoding (its consumer is behind) or, with ``paused=False``, go on; it keeps its KV slot."""
        if self.sequence is not None and not self.done.is_set():
            self.lse.engine.pause(self.sequence, paused)

    def emit(self, event: Event) -> None:
        if event.kind != EVENT_TOKEN:
            self.done.set()
        try:
            self.on_event(event)
        except Exception:   # a consumer's failure (a closed client) must never stop the engine's loop
            log.exception("lse: the event consumer of a request failed; cancelling it")
            self.cancel()


def lse_request(lse: LSE, body: Any, on_event: Callable[[Event], None], endpoint: str = "chat",
                api: str | None = None) -> Request:
    """Start a chat ("chat") or completion ("completion") request. Events arrive on ``on_event``
    from the engine's thread: token events, then one end event — or a single error event
    (status and the error body), before any work when the request is invalid. ``api`` names the API
    the request came through in the stats (an adapter's; the endpoint by default)."""
    request = Request(lse, endpoint, on_event, api)
    try:
        _start(lse, request, body)
    except LSEError as e:
        lse.stats.record(request.api, f"error_{e.status}")
        request.emit(Event(EVENT_ERROR, e.body(), e.status))
    return request


def _start(lse: LSE, request: Request, body: Any) -> None:
    if request.endpoint not in ("chat", "completion"):
        raise invalid_request(f"unknown endpoint {request.endpoint!r}: chat or completion", "invalid_value")
    chat = request.endpoint == "chat"
    req = protocol.parse_chat(body) if chat else protocol.parse_completion(body)
    _check_model(lse, req.model)
    tokenizer = lse.model.tokenizer
    level = resolve_level(lse.thinking, req.body, request.endpoint)
    prompt_text, prompt = _prompt(lse, req, level)
    if not prompt:
        raise invalid_request("the prompt is empty", "invalid_value", req.prompt_param)
    if req.echo and req.logprobs:
        raise invalid_request("echo with logprobs is not supported: LSE does not score prompt tokens",
                              "invalid_value", "echo")
    limit = resolve_limit(req.max_tokens, lse.config.max_tokens, lse.defaults, len(prompt),
                          lse.context_length, req.prompt_param)
    tool_parser = _tool_call_parser(lse, req)
    # a completion's thinking fields split the reply at <think> markers even where the template names none
    asked = level is not None and not chat
    splitter = reasoning_splitter(lse.thinking, level, prompt_text, THINK_MARKERS if asked else None)
    params = SeqParams(
        prompt=prompt, max_new_tokens=limit.max_new_tokens, limit_reason=limit.stop_reason,
        sampling=resolve_sampling(req, lse.defaults), stop=list(req.stop),
        eos_ids=() if req.ignore_eos else tokenizer.eos_ids,
        top_logprobs=req.top_logprobs if req.logprobs else None, splitter=splitter,
        # tool-call markers can be special tokens (Mistral's [TOOL_CALLS]): the parser must see them
        skip_special_tokens=tool_parser is None, reasoning_budget=_reasoning_budget(lse, req, splitter),
        constraint=_constraint(lse, req, tool_parser, splitter), speculative=req.speculative)
    reply = _ReplyBuilder(lse, request, req, prompt_text if req.echo else "", tool_parser)
    if params.max_new_tokens == 0:   # max_length leaves no room: an empty reply, no work
        reply.finish_empty(params)
        return
    request.sequence = lse.engine.submit(params, reply.on_delta, reply.on_finish)


class _ReplyBuilder:
    """Collects a sequence's deltas into events: chunks as they come, the whole reply at the end."""

    def __init__(self, lse: LSE, request: Request, req: protocol.GenerationRequest, echo: str,
                 tool_parser: ToolCallParser | None) -> None:
        self.lse = lse
        self.request = request
        self.req = req
        self.reply = protocol.Reply(req, lse.model_id)
        self.text = [echo]
        self.reasoning: list[str] = []
        self.logprobs: list[protocol.TokenLogprob] = []
        self.tool_parser = tool_parser
        if echo and req.stream:
            self.request.emit(Event(EVENT_TOKEN, self.reply.chunk(text=echo)))

    def on_delta(self, seq: Sequence, delta: Delta) -> None:
        logprobs = [self._logprob(entry) for entry in delta.logprobs]
        content = self.tool_parser.feed(delta.content) if self.tool_parser else delta.content
        self.text.append(content)
        self.reasoning.append(delta.reasoning)
        self.logprobs.extend(logprobs)
        if content or delta.reasoning or logprobs:
            self.request.emit(Event(EVENT_TOKEN, self.reply.chunk(content, delta.reasoning, logprobs)))

    def on_finish(self, seq: Sequence) -> None:
        lse, api = self.lse, self.request.api
        if seq.error is not None:
            error = seq.error if isinstance(seq.error, LSEError) else server_error(str(seq.error))
            lse.stats.record(api, f"error_{error.status}")
            self.request.emit(Event(EVENT_ERROR, error.body(), error.status))
            return
        prompt_n = len(seq.params.prompt) - seq.cached
        first = seq.t_first_token or seq.t_end
        timings = protocol.Timings(prompt_n, _ms(first - seq.t_admit), len(seq.output), _ms(seq.t_end - first),
                                   *((seq.draft_n, seq.draft_n_accepted) if seq.draft_n else ()))
        usage = protocol.Usage(len(seq.params.prompt), len(seq.output), seq.cached, seq.reasoning_tokens)
        lse.stats.record(api, seq.stop_reason, len(seq.params.prompt), seq.cached, len(seq.output),
                         seq.t_end - seq.t_submit, first - seq.t_submit)
        warnings = [protocol.LSEWarning(c, n) for c, n in seq.fallbacks.items()]
        constraint = seq.params.constraint
        if constraint is not None and not constraint.complete and seq.stop_reason != "stop_token":
            warnings.append(protocol.LSEWarning(
                f"the reply ended ({seq.stop_reason}) before it completed {constraint.description}: it does not "
                "match it", None, "structured_output_incomplete"))
        self._end(seq.stop_reason, usage, timings, warnings)

    def finish_empty(self, params: SeqParams) -> None:
        self._end(params.limit_reason, protocol.Usage(len(params.prompt), 0), protocol.Timings(0, 0.0, 0, 0.0), [])
        self.lse.stats.record(self.request.api, params.limit_reason, len(params.prompt))

    def _end(self, stop_reason: str, usage: protocol.Usage, timings: protocol.Timings,
             warnings: list[protocol.LSEWarning]) -> None:
        tool_calls = self._finish_tool_calls()
        reasoning = "".join(self.reasoning)
        choice = protocol.Choice(stop_reason, "".join(self.text), reasoning or None, tool_calls or None,
                                 logprobs=self.logprobs if self.req.logprobs else None)
        outcome = protocol.Outcome(choice, usage, self.lse.context_length, timings, warnings)
        data = self.reply.final_chunks(outcome) if self.req.stream else self.reply.response(outcome)
        self.request.emit(Event(EVENT_END, data))

    def _finish_tool_calls(self) -> list[dict[str, Any]]:
        """The reply's tool calls; a stream gets the content the parser held back, then the calls in one chunk."""
        if self.tool_parser is None:
            return []
        held, calls = self.tool_parser.finish()
        self.text.append(held)
        if self.req.stream and held:
            self.request.emit(Event(EVENT_TOKEN, self.reply.chunk(held)))
        if self.req.stream and calls:
            self.request.emit(Event(EVENT_TOKEN, self.reply.chunk(tool_calls=calls)))
        return calls

    def _logprob(self, entry: dict[str, Any]) -> protocol.TokenLogprob:
        spell = self.lse.model.tokenizer.token_bytes
        return protocol.TokenLogprob(spell(entry["token"]), entry["logprob"],
                                     [(spell(t), lp) for t, lp in entry["top"]])


def _prompt(lse: LSE, req: protocol.GenerationRequest, level: Level | None, add_generation_prompt: bool = True,
            add_special: bool | None = None) -> tuple[str, list[int]]:
    """A request's prompt as text and as tokens: a chat's messages rendered by the template (the
    template writes its own special tokens), or a completion's prompt (the tokenizer adds its own).
    A prompt too long for the context, even in the fewest tokens it could take, is refused (context_full)
    before it is tokenized, and its render stops as soon as it outgrows that bound: tokenizing megabytes
    takes seconds, and the tokenizer holds the GIL for much of it."""
    tokenizer = lse.model.tokenizer
    longest = tokenizer.longest_text(lse.context_length)
    if req.endpoint == "chat":
        if lse.template is None:
            raise invalid_request("this model has no chat template; send a plain prompt to /v1/completions",
                                  "no_chat_template", "messages")
        # every template writes every message's text: refuse before rendering
        contents = "\n".join(m["content"] for m in req.messages if isinstance(m.get("content"), str))
        check_prompt_text(contents, tokenizer, lse.context_length, req.prompt_param)
        try:
            text = lse.template.render(req.messages, add_generation_prompt=add_generation_prompt, tools=req.tools,
                                       max_chars=longest, **template_variables(level, req.body))
        except RenderTooLong:   # the template writes more than the messages' text: at least that is counted
            raise prompt_too_long(prompt_tokens(contents, tokenizer, longest), longest, lse.context_length,
                                  req.prompt_param) from None
        check_prompt_text(text, tokenizer, lse.context_length, req.prompt_param, add_special=bool(add_special))
        return text, tokenizer.encode(text, add_special_tokens=bool(add_special))
    if isinstance(req.prompt, str):
        add_special = add_special is not False
        check_prompt_text(req.prompt, tokenizer, lse.context_length, req.prompt_param, add_special)
        return req.prompt, tokenizer.encode(req.prompt, add_special_tokens=add_special)
    bad = next((i for i, t in enumerate(req.prompt) if t >= tokenizer.vocab_size), None)
    if bad is not None:
        raise invalid_request(f"token {req.prompt[bad]} is outside the vocabulary (size "
                              f"{tokenizer.vocab_size})", "invalid_value", f"prompt[{bad}]")
    return tokenizer.decode(req.prompt), list(req.prompt)


def lse_tokenize(lse: LSE, body: Any) -> dict[str, Any]:
    """/tokenize: the tokens of a chat or completion body's prompt, exactly as lse_request would
    start from them, or of llama.cpp's plain ``content``. Raises LSEError for a bad body."""
    tokenize = protocol.parse_tokenize(body)
    tokenizer = lse.model.tokenizer
    if tokenize.request is None:
        check_prompt_text(tokenize.content, tokenizer, lse.context_length, "content", bool(tokenize.add_special))
        ids = tokenizer.encode(tokenize.content, add_special_tokens=bool(tokenize.add_special))
    else:
        req = tokenize.request
        _check_model(lse, req.model)
        level = resolve_level(lse.thinking, req.body, req.endpoint)
        thinking_budget(req.body, lse.thinking.level_ids)   # refused here as lse_request would refuse it
        ids = _prompt(lse, req, level, tokenize.add_generation_prompt, tokenize.add_special)[1]
    pieces = [tokenizer.token_bytes(i) for i in ids] if tokenize.with_pieces else None
    return protocol.tokenized(ids, pieces, lse.context_length)


def _tool_call_parser(lse: LSE, req: protocol.GenerationRequest) -> ToolCallParser | None:
    """A parser for the reply's tool calls when the request offered tools the model may call and the
    template shows the model a call format, or enforces a call (then written as bare JSON if it shows none)."""
    if not req.tools or req.tool_choice == "none" or lse.template is None:
        return None
    call_format = tool_call_format(lse.template.source)
    if call_format is None and (req.tool_choice == "required" or isinstance(req.tool_choice, dict)):
        call_format = BARE_JSON
    return ToolCallParser(call_format, req.tools) if call_format else None


def _constraint(lse: LSE, req: protocol.GenerationRequest, tool_parser: ToolCallParser | None,
                splitter: ReasoningSplitter | None) -> structured.Constraint | None:
    """The grammar the reply follows, if any: the request's response_format (or another constraint field),
    or, for tool calls, every call when tool_choice is required or names a function, and with auto the
    rest of a call once its opening marker appears. A reply that may reason (``splitter``) keeps its
    reasoning block free; the grammar constrains what follows it."""
    forced = req.tool_choice == "required" or isinstance(req.tool_choice, dict)
    grammars = lse.grammars

    def constraint(grammar: str, param: str, description: str) -> structured.Constraint:
        if splitter is not None:
            grammar = structured.with_reasoning(grammar, splitter.open_marker, splitter.close_marker, splitter.inside,
                                                grammars)
        return structured.Constraint(grammars, grammars.matcher(grammar, param), description)

    if req.constraint is not None:
        if forced and req.tools:
            raise invalid_request(f"tool_choice and {req.constraint.param.split('.')[0]} both constrain the reply; "
                                  "send one", "invalid_value", "tool_choice")
        return constraint(structured.constraint_grammar(req.constraint, grammars), req.constraint.param,
                          req.constraint.param)
    syntax = None
    if tool_parser is not None and tool_parser.format.body is None:   # calls between tokens: as the template writes one
        syntax = lse.call_syntax
    if tool_parser is None or (tool_parser.format.body is None and syntax is None):
        if forced and req.tools:
            raise invalid_request("tool_choice cannot be enforced for this chat template: it does not show how it "
                                  "writes a call LSE could follow", "invalid_value", "tool_choice")
        return None
    call_format = tool_parser.format
    name = req.tool_choice["function"]["name"] if isinstance(req.tool_choice, dict) else None
    if name is not None and name not in tool_parser.names:
        raise invalid_request(f"tool_choice names {name!r:.60}, which is not among the offered tools",
                              "invalid_value", "tool_choice.function.name")
    if forced:
        grammar = structured.tool_call_grammar(call_format, req.tools, name, req.parallel_tool_calls,
                                               grammars, lazy=False, syntax=syntax)
        return constraint(grammar, "tools", "tool_choice")
    if call_format.whole_reply:   # the reply is a call or text from its first character: nothing to wait for
        return None
    try:
        grammar = structured.tool_call_grammar(call_format, req.tools, None, req.parallel_tool_calls,
                                               grammars, lazy=True, syntax=syntax)
        matcher = grammars.matcher(grammar, "tools")
    except LSEError as e:   # a schema LSE or llguidance cannot enforce: the calls stay free, as without a grammar
        log.warning("lse: tool calls are not constrained: %s", e)
        return None
    return structured.Constraint(grammars, matcher, "a tool call", trigger=call_format.open_marker,
                                 repeat=req.parallel_tool_calls and call_format.body == "object")


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


def _check_model(lse: LSE, name: str | None) -> None:
    """Requests may name the served model by id or path, or name none."""
    if name in (None, "", lse.model_id, lse.model.source):
        return
    raise model_not_found(name, [lse.model_id])


def lse_request_iter(lse: LSE, body: Any, endpoint: str = "chat") -> Iterator[Event]:
    """lse_request as an iterator; leaving the loop early cancels the request."""
    events: queue.Queue[Event] = queue.Queue()
    request = lse_request(lse, body, events.put, endpoint)
    try:
        while True:
            event = events.get()
            yield event
            if event.kind in (EVENT_END, EVENT_ERROR):
                return
    finally:
        request.cancel()


class Device(TypedDict):
    name: str
    kind: Literal["gpu", "cpu", "accelerator"]
    codegen: bool
    description: str


class PlanSummary(TypedDict):
    groups: Count
    cpu_fallback_groups: list[str]


class ModelInfo(TypedDict):
    """/v1/lse/model_info's answer (lse_model_info)."""

    object: Literal["lse.model_info"]
    id: str
    source: str
    architecture: str
    context_length: Count
    trained_context_length: Count
    vocab_size: Count
    thinking: Thinking
    generation_defaults: GenerationDefaults
    devices: list[Device]
    plan: PlanSummary
    served: protocol.Model


def lse_model_info(lse: LSE) -> ModelInfo:
    """The model, its thinking levels, sampling defaults, devices and plan; ``served`` is its
    /v1/models entry."""
    served = protocol.model_entry(lse.model_id, int(lse.stats.started), lse.context_length,
                                  lse.thinking.to_json(), lse.defaults, structured.supported())
    placements = lse.plan.placements
    return ModelInfo(
        object="lse.model_info",
        id=lse.model_id,
        source=lse.model.source,
        architecture=lse.model.architecture,
        context_length=lse.context_length,
        trained_context_length=lse.model.trained_context,
        vocab_size=lse.model.tokenizer.vocab_size,
        thinking=served["thinking"],
        generation_defaults=served["generation_defaults"],
        devices=[_device_json(d.info) for d in lse.devices],
        plan=PlanSummary(groups=len(placements), cpu_fallback_groups=[
            p.fallback_cause for p in placements if p.fallback_cause is not None]),
        served=served,
    )


class GroupPlacement(TypedDict):
    """A fused group of the plan and the device that runs it (null: refused, CPU fallback disabled)."""

    group: Count
    layer: int    # -1 outside the transformer layers
    ops: list[str]
    device: str | None
    cpu_fallback: str | None


class KVCacheDevice(TypedDict):
    name: str
    type_k: KVCacheType
    type_v: KVCacheType


class KVCache(TypedDict):
    """The KV cache types asked for (--cache-type-k/-v), and what each device holding a cache stores: f32 where
    it lacks the default f16 (a startup warning says so)."""

    type_k: KVCacheType
    type_v: KVCacheType
    devices: list[KVCacheDevice]


class EngineStatus(EngineLoad):
    steps: Count
    cpu_fallback: CPUFallback


class LSEStatus(TypedDict):
    """An open model's lse_status; /v1/lse/status carries its keys beside the model set's (model_set.ModelStatus)."""

    object: Literal["lse.status"]
    model: str
    context_length: Count
    devices: list[Device]
    placements: list[GroupPlacement]
    declined: list[str]
    startup_warnings: list[str]
    kv_cache: KVCache
    engine: EngineStatus
    stats: RequestStats


def lse_status(lse: LSE) -> LSEStatus:
    """The engine's state: devices and where each fused group runs, load, KV slots, CPU-fallback
    counters, request counters."""
    return LSEStatus(
        object="lse.status",
        model=lse.model_id,
        context_length=lse.context_length,
        devices=[_device_json(d.info) for d in lse.devices],
        placements=[_placement_json(p) for p in lse.plan.placements],
        declined=lse.registry.declined(),
        startup_warnings=lse.startup_warnings,
        kv_cache=_kv_cache_json(lse),
        engine=EngineStatus(steps=lse.engine.steps, **lse.engine.load, cpu_fallback=lse.fallback.to_json()),
        stats=lse.stats.to_json(),
    )


def _kv_cache_json(lse: LSE) -> KVCache:
    """The KV cache types asked for, and what each device that may hold a cache stores (f32 where it lacks one)."""
    ctx = lse.plan.ctx
    holders = lse.devices + [p.device for p in lse.plan.placements
                             if p.device is not None and p.device not in lse.devices and "attention" in p.group.ops]
    return KVCache(type_k=ctx.cache_type_k, type_v=ctx.cache_type_v, devices=[
        KVCacheDevice(name=d.info.name, type_k=ctx.on(d).cache_type_k, type_v=ctx.on(d).cache_type_v)
        for d in dict.fromkeys(holders)])


def _device_json(info: DeviceInfo) -> Device:
    return Device(name=info.name, kind=info.kind, codegen=info.codegen, description=info.description)


def _placement_json(placement: Placement) -> GroupPlacement:
    group = placement.group
    return GroupPlacement(group=group.index, layer=group.layer, ops=list(group.ops),
                          device=placement.device.info.name if placement.device else None,
                          cpu_fallback=placement.fallback_cause)


# ---- the other APIs: each an adapter over the chat request ----

ADAPTERS: dict[str, tuple[Callable[[LSE, Any], tuple[dict[str, Any], Translation]],
                          Callable[[dict[str, Any], int], dict[str, Any]]]] = {
    "responses": (lambda lse, body: responses.start(body, lse.responses, lse.model_id, lse.defaults),
                  responses.error_body),
    "responses_compact": (lambda lse, body: responses.compact(body, lse.responses), responses.error_body),
    "messages": (lambda lse, body: anthropic.start(body, lse.model_id), anthropic.error_body),
    "ollama_chat": (lambda lse, body: ollama.chat_start(body, lse.model_id, lse.context_length), ollama.error_body),
    "ollama_generate": (lambda lse, body: ollama.generate_start(body, lse.model_id, lse.context_length),
                        ollama.error_body),
}


def lse_api_request(lse: LSE, body: Any, on_event: Callable[[Event], None], api: str) -> Request:
    """Start an OpenAI Responses ("responses"), Anthropic Messages ("messages") or Ollama ("ollama_chat",
    "ollama_generate") request. Its body becomes a chat request (a completion, for Ollama's raw prompts);
    events arrive in that API's shapes: for a stream, a token event per stream event, then an end event whose
    data is the closing events; otherwise one end event with the response object; or an error event (that
    API's error body, or its stream error event once streaming)."""
    start, error_body = ADAPTERS[api]
    try:
        chat, translation = start(lse, body)
    except LSEError as e:
        lse.stats.record(api, f"error_{e.status}")
        request = Request(lse, api, on_event)
        request.emit(Event(EVENT_ERROR, error_body(e.body(), e.status), e.status))
        return request
    started = threading.Event()     # the core's Request is known (its sequence set): prompt tokens can be read
    core: list[Request] = []

    def prompt_tokens() -> int:
        started.wait()
        sequence = core[0].sequence
        return len(sequence.params.prompt) if sequence is not None else 0

    def on_core_event(event: Event) -> None:
        if event.kind == EVENT_TOKEN:
            events = translation.feed(core_delta(event.data), prompt_tokens() if not translation.started else 0)
            for stream_event in events if translation.stream else []:
                on_event(Event(EVENT_TOKEN, stream_event))
        elif event.kind == EVENT_END:
            sequence = core[0].sequence if core else None
            deltas, end = core_end(event.data, sequence.stop_string if sequence is not None else None)
            # the closing chunks' deltas; an empty one opens the stream of a reply that had nothing to stream
            events = [e for delta in deltas or [CoreDelta()] for e in translation.feed(delta, end.prompt_tokens)]
            closing, response = translation.finish(end)
            on_event(Event(EVENT_END, events + closing if translation.stream else response))
        elif translation.stream and (translation.started or error_in_stream(event.status)):
            on_event(Event(EVENT_ERROR, translation.stream_error(event.data, event.status), event.status))
        else:
            on_event(Event(EVENT_ERROR, error_body(event.data, event.status), event.status))

    try:
        core.append(lse_request(lse, chat | {"stream": True, "stream_options": {"include_usage": True}},
                                on_core_event, "completion" if "prompt" in chat else "chat", api))
    finally:   # never leave the engine's thread waiting, whatever happened
        started.set()
    return core[0]


def lse_error_body(error: LSEError, api: str = "chat") -> dict[str, Any]:
    """An error's body as ``api`` shapes errors: Anthropic's for "messages", Ollama's for "ollama", OpenAI's
    otherwise."""
    if api == "ollama":
        return ollama.error_body(error.body(), error.status)
    return anthropic.error_body(error.body(), error.status) if api == "messages" else error.body()


def lse_stream_error(error: LSEError, api: str = "chat", events_sent: int = 0) -> dict[str, Any]:
    """The in-stream error event that ends a stream of ``api`` after ``events_sent`` events, for a request that
    failed outside the engine (lse_ray: the replica serving it was lost)."""
    if api == "responses":
        return responses.stream_error_event(error.body(), error.status, events_sent)
    return lse_error_body(error, api)


def lse_models(lse: LSE, api: str = "chat") -> dict[str, Any]:
    """/v1/models: OpenAI's list, or Anthropic's for "messages" (its clients send anthropic-version)."""
    return model_list([lse_model_info(lse)["served"]], api)


def model_list(entries: list[dict[str, Any]], api: str = "chat") -> dict[str, Any]:
    """/v1/models of these entries: OpenAI's list, or Anthropic's for "messages"."""
    return anthropic.model_list(entries) if api == "messages" else protocol.model_list(entries)


def lse_response(lse: LSE, response_id: str) -> dict[str, Any]:
    """GET /v1/responses/{id}: a stored Responses response; raises LSEError 404 response_not_found."""
    return lse.responses.response(response_id)


def lse_delete_response(lse: LSE, response_id: str) -> dict[str, Any]:
    """DELETE /v1/responses/{id}: forget a stored response; raises LSEError 404 response_not_found."""
    return lse.responses.delete(response_id)


def lse_count_tokens(lse: LSE, body: Any) -> dict[str, Any]:
    """/v1/messages/count_tokens: {"input_tokens"}, the prompt /v1/messages would start from. Raises
    LSEError, whose body anthropic.error_body shapes."""
    tokenized = lse_tokenize(lse, anthropic.count_tokens_body(body))
    return protocol.token_count(tokenized["count"])


def lse_embeddings(lse: LSE, body: Any, cancel: threading.Event | None = None) -> dict[str, Any]:
    """/v1/embeddings: every input's pooled, L2-normalized final hidden state, computed by the engine as
    prefill-only sequences. Blocks until all are done, or ``cancel`` is set (then its sequences end at the
    next step); raises LSEError (400 context_full naming the input, 499 when cancelled)."""
    try:
        req = embeddings.parse(body)
        _check_model(lse, req.model)
        width = int(lse.model.config["hidden_size"])
        if req.dimensions is not None and req.dimensions > width:
            raise invalid_request(f"dimensions must be at most {width}, the model's hidden size",
                                  "invalid_value", "dimensions")
        mode = embeddings.pooling(lse.model)
        prompts = embeddings.prompts(req, lse.model, lse.context_length)
        rows, sequences = embeddings.hidden_states(lse.engine, prompts, lse.config.parallel, cancel)
    except LSEError as e:
        lse.stats.record("embeddings", f"error_{e.status}")
        raise
    fallbacks: dict[str, int] = {}
    for seq in sequences:
        for cause, count in seq.fallbacks.items():
            fallbacks[cause] = fallbacks.get(cause, 0) + count
    total = sum(len(p) for p in prompts)
    lse.stats.record("embeddings", "ok", total)
    return embeddings.response(req, [embeddings.pool(r, mode, req.dimensions) for r in rows], lse.model_id, total,
                               [protocol.LSEWarning(cause, n) for cause, n in fallbacks.items()])


def _reasoning_budget(lse: LSE, req: protocol.GenerationRequest, splitter: Any) -> ReasoningBudget | None:
    """The request's thinking_budget, for a reply that may reason (a splitter watches for the block) on a
    template whose end marker is known; None otherwise, when there is nothing to bound."""
    tokens = thinking_budget(req.body, lse.thinking.level_ids)
    if tokens is None or splitter is None or lse.thinking.close_marker is None:
        return None
    return ReasoningBudget(tokens, tuple(lse.model.tokenizer.encode(lse.thinking.close_marker,
                                                                    add_special_tokens=False)))
