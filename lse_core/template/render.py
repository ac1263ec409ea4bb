"""Chat templates rendered as Hugging Face's apply_chat_template renders them, in a sandbox with a time bound.

The environment matches transformers (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, loopcontrols,
the `generation` tag, `raise_exception`, `strftime_now`, its `tojson`, `dict` and `namespace`), so a template
renders here as it does there. Templates are untrusted input: the sandbox keeps them away from Python
internals, and a deadline checked at every loop iteration, call, attribute access and intercepted operator
bounds their CPU time. Operators that could build huge values in one step (`*`, `**`, `+`, `~`) are checked
for size as well.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import time
from collections.abc import Iterable, Iterator
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from lse_core.errors import LSEError, StartupError

RENDER_TIME_LIMIT_S = 2.0
MAX_VALUE_LENGTH = 4_000_000   # characters in one string, items in one list: far above any real prompt
MAX_POWER_BITS = 4096          # `**` results beyond this many bits are refused before Python computes them

# The deadline of the render running in this thread (or task); None outside a render.
_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar("lse_template_deadline", default=None)
# The longest value the render running here may build: MAX_VALUE_LENGTH, or more for a large context.
_value_limit: contextvars.ContextVar[int] = contextvars.ContextVar("lse_template_value_limit", default=MAX_VALUE_LENGTH)


class TemplateLimitError(jinja2.TemplateError):
    """The template hit a resource bound: a template that does this is broken for every request."""


class TemplateTimeout(TemplateLimitError):
    """The template ran past its time limit (a loop or recursion that does not end)."""


class TemplateSizeError(TemplateLimitError):
    """The template tried to build a value far larger than any prompt."""


class RenderTooLong(Exception):
    """The rendered prompt passed the ``max_chars`` its render was given: it cannot fit the context."""


@contextlib.contextmanager
def time_limit(seconds: float = RENDER_TIME_LIMIT_S) -> Iterator[None]:
    """One deadline for every render inside the block (the load-time probe renders many times)."""
    token = _deadline.set(time.monotonic() + seconds)
    try:
        yield
    finally:
        _deadline.reset(token)


def _check_deadline() -> None:
    deadline = _deadline.get()
    if deadline is not None and time.monotonic() > deadline:
        raise TemplateTimeout(f"the chat template ran longer than {RENDER_TIME_LIMIT_S:g} s and was stopped")


def _check_size(value: Any) -> Any:
    limit = _value_limit.get()
    if isinstance(value, str | list | tuple) and len(value) > limit:
        raise TemplateSizeError(f"the chat template built a value of {len(value)} items (limit {limit})")
    return value


def _guarded_iter(iterable: Iterable[Any]) -> Iterator[Any]:
    """Wraps the iterable of every `{% for %}`: each iteration checks the render's deadline."""
    for item in iterable:
        _check_deadline()
        yield item


def _guarded_concat(value: Any) -> Any:
    _check_deadline()
    return _check_size(value)


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' tojson: unlike jinja's, no HTML escaping and non-ASCII kept as is."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _Namespace(jinja2.utils.Namespace):
    """transformers' namespace: underscore attributes could reach Python internals, so storing one fails."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's signature: `namespace(self=...)` must work
        self, args = args[0], args[1:]
        attributes = dict(*args, **kwargs)
        for name in attributes:
            _Namespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot store the namespace attribute {name!r}")


class _Dict:
    """transformers' `dict` global: building dicts only, without the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in transformers;
    rendering a prompt only needs its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox with the render deadline checked at every call, attribute access and intercepted operator."""

    intercepted_binops = frozenset({"*", "**", "+"})

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # jinja's positional names
        _check_deadline()
        return _check_size(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj: Any, attribute: str) -> Any:
        _check_deadline()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _check_deadline()
        return super().getitem(obj, argument)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_deadline()
        if operator == "*":
            sequence, count = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(sequence, str | list | tuple) and isinstance(count, int):
                if len(sequence) * max(count, 0) > _value_limit.get():
                    raise TemplateSizeError(f"the chat template repeated a value {count} times")
        if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
            if max(abs(left), 2).bit_length() * right > MAX_POWER_BITS:
                raise TemplateSizeError(f"the chat template computed {left} ** {right}")
        return _check_size(super().call_binop(context, operator, left, right))


class _AddGuards(NodeTransformer):
    """Routes every for-loop's iterable and every `~` concatenation through the guard filters."""

    def visit_For(self, node: nodes.For) -> nodes.For:
        node = self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, "lse_loop_guard", [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Filter:
        node = self.generic_visit(node)
        return nodes.Filter(node, "lse_concat_guard", [], [], None, None, lineno=node.lineno)


def _environment() -> BoundedSandbox:
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True,
                         extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters["lse_loop_guard"] = _guarded_iter
    env.filters["lse_concat_guard"] = _guarded_concat
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env


def _bounded_output(pieces: Iterator[str], max_chars: int) -> str:
    out, length = [], 0
    for piece in pieces:
        length += len(piece)
        if length > max_chars:
            raise RenderTooLong(f"the rendered prompt passed {max_chars} characters")
        out.append(piece)
    return "".join(out)


def describe_error(error: BaseException) -> str:
    """One line for a template failure: jinja's message, or the Python error's type and text."""
    if isinstance(error, jinja2.TemplateError):
        return str(error.message if error.message is not None else error)
    if isinstance(error, RecursionError):
        return "the chat template recursed too deeply"
    return f"{type(error).__name__}: {error}"


class ChatTemplate:
    """A chat template compiled once; `render` turns messages into the prompt text."""

    def __init__(self, source: str, path: str | None = None, special_tokens: dict[str, str] | None = None) -> None:
        self.source = source
        self.path = path
        self.special_tokens = dict(special_tokens or {})
        self.environment = _environment()
        try:
            self.ast = self.environment.parse(source)
            self._template = self.environment.from_string(_AddGuards().visit(self.environment.parse(source)))
        except jinja2.TemplateSyntaxError as error:
            raise StartupError(f"chat template {path or '(inline)'}: line {error.lineno}: {error.message}") from error

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, max_chars: int | None = None, **variables: Any) -> str:
        """The prompt for `messages`; a template failure (raise_exception, a bad value, the time limit) is an
        LSEError 400 with code template_error. With ``max_chars``, the render stops with RenderTooLong as
        soon as its output passes that length, so a template that expands a message cannot build a prompt
        far larger than the context."""
        try:
            return self.render_raw(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                   max_chars=max_chars, **variables)
        except RenderTooLong:
            raise
        except Exception as error:
            raise LSEError(f"chat template error: {describe_error(error)}", code="template_error",
                           param="messages") from error

    def render_raw(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                   tools: list[dict[str, Any]] | None = None, max_chars: int | None = None,
                   **variables: Any) -> str:
        """`render` without the translation of errors: the template's own exception propagates."""
        context = {**self.special_tokens, **variables, "messages": messages, "tools": tools,
                   "add_generation_prompt": add_generation_prompt}
        with contextlib.ExitStack() as scope:
            if _deadline.get() is None:
                scope.enter_context(time_limit())
            if max_chars is None:
                return self._template.render(context)
            token = _value_limit.set(max(MAX_VALUE_LENGTH, 2 * max_chars))
            scope.callback(_value_limit.reset, token)
            return _bounded_output(self._template.generate(context), max_chars)

    def startup_error(self, detail: str) -> StartupError:
        """The load-time form of a render failure, naming the template's file."""
        return StartupError(f"chat template {self.path or '(inline)'}: {detail}")
