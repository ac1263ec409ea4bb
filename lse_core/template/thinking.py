"""A model's thinking levels (what its chat template offers) and how a request picks one.

The levels come from `probe.probe`; this module holds them and applies the spec's request rules: every
spelling of reasoning_effort and enable_thinking, the four resolution rules and the four error codes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from typing_extensions import TypedDict

from lse_core.errors import LSEError, invalid_request

TOGGLE = "enable_thinking"
EFFORT = "reasoning_effort"
# Template variables the renderer passes itself; chat_template_kwargs cannot replace them.
_RENDER_ARGUMENTS = frozenset({"messages", "tools", "add_generation_prompt"})


class ThinkingLevel(TypedDict):
    """A level as lse_model_info and /v1/models show it."""

    id: str
    enable_thinking: bool | None
    reasoning_effort: str | None
    instruction: str | None
    opens_reasoning: bool
    default: bool


class Thinking(TypedDict):
    """The template's thinking object as lse_model_info and /v1/models show it (TemplateThinking.to_json)."""

    supported: bool
    source: str | None
    toggle: Literal["enable_thinking"] | None
    effort: Literal["reasoning_effort"] | None
    default_level: str | None
    levels: list[ThinkingLevel]


@dataclass(frozen=True)
class Level:
    id: str
    enable_thinking: bool | None     # what the level passes to the toggle; None without one
    reasoning_effort: str | None     # what it passes to the effort variable; None when none
    instruction: str | None          # the text the level adds before the system prompt (the spec's placement)
    generation_prompt: str           # the assistant opening the template appends for this level
    opens_reasoning: bool            # the generation prompt leaves a reasoning block open
    default: bool = False

    @property
    def thinks(self) -> bool:
        return self.enable_thinking is not False

    def to_json(self) -> ThinkingLevel:
        return ThinkingLevel(id=self.id, enable_thinking=self.enable_thinking, reasoning_effort=self.reasoning_effort,
                             instruction=self.instruction, opens_reasoning=self.opens_reasoning, default=self.default)


@dataclass(frozen=True)
class TemplateThinking:
    """What the chat template offers (probe.probe); its JSON, the reply part, is Thinking."""

    source: str | None = None
    toggle: str | None = None
    effort: str | None = None
    levels: tuple[Level, ...] = ()
    open_marker: str | None = None    # the reasoning block's markers, as the template writes them
    close_marker: str | None = None

    @property
    def supported(self) -> bool:
        return bool(self.levels)

    @property
    def default_level(self) -> Level | None:
        return next((level for level in self.levels if level.default), None)

    @property
    def level_ids(self) -> list[str]:
        return [level.id for level in self.levels]

    def level(self, level_id: str) -> Level | None:
        return next((level for level in self.levels if level.id == level_id), None)

    def to_json(self) -> Thinking:
        default = self.default_level
        return Thinking(supported=self.supported, source=self.source, toggle=self.toggle, effort=self.effort,
                        default_level=default.id if default else None,
                        levels=[level.to_json() for level in self.levels])


@dataclass(frozen=True)
class _Sent:
    """One spelling of a thinking field the request carried."""
    param: str
    value: Any


def _field(container: Any, key: str, prefix: str) -> _Sent | None:
    if isinstance(container, dict) and container.get(key) is not None:
        return _Sent(prefix + key, container[key])
    return None


def _container(body: dict[str, Any], key: str, levels: list[str]) -> dict[str, Any]:
    value = body.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid_request(f"{key} must be an object, got {type(value).__name__}", "invalid_thinking",
                              key, levels=levels)
    return value


def _efforts(body: dict[str, Any], levels: list[str]) -> list[_Sent]:
    kwargs = _container(body, "chat_template_kwargs", levels)
    reasoning = _container(body, "reasoning", levels)
    sent = [_field(body, EFFORT, ""), _field(body, "thinking_level", ""),
            _field(kwargs, EFFORT, "chat_template_kwargs."), _field(reasoning, "effort", "reasoning.")]
    sent = [s for s in sent if s is not None]
    for s in sent:
        if not isinstance(s.value, str):
            raise invalid_request(f"{s.param} must be a string, got {type(s.value).__name__}", "invalid_thinking",
                                  s.param, levels=levels)
    return sent


def _switches(body: dict[str, Any], levels: list[str]) -> list[_Sent]:
    kwargs = _container(body, "chat_template_kwargs", levels)
    sent = [s for s in (_field(body, TOGGLE, ""), _field(kwargs, TOGGLE, "chat_template_kwargs.")) if s is not None]
    for s in sent:
        if not isinstance(s.value, bool):
            raise invalid_request(f"{s.param} must be a boolean, got {type(s.value).__name__}", "invalid_thinking",
                                  s.param, levels=levels)
    thinking = body.get("thinking")
    if isinstance(thinking, bool):
        sent.append(_Sent("thinking", thinking))
    elif isinstance(thinking, dict) and thinking.get("type") in ("enabled", "disabled"):
        sent.append(_Sent("thinking", thinking["type"] == "enabled"))
    elif thinking is not None:
        raise invalid_request('thinking must be a boolean or {"type": "enabled" | "disabled"}', "invalid_thinking",
                              "thinking", levels=levels)
    return sent


def _agreed(sent: list[_Sent], what: str, levels: list[str]) -> _Sent | None:
    for other in sent[1:]:
        if other.value != sent[0].value:
            raise invalid_request(f"{sent[0].param} {sent[0].value!r} and {other.param} {other.value!r} disagree; "
                                  f"send one {what}", "conflicting_thinking", other.param, levels=levels)
    return sent[0] if sent else None


def _levels_text(levels: list[str]) -> str:
    return ", ".join(levels) if levels else "(none)"


def _check_switch(level: Level, switch: _Sent | None, effort: _Sent, levels: list[str]) -> None:
    if switch is not None and switch.value != level.thinks:
        state = "on" if level.thinks else "off"
        raise invalid_request(f"{effort.param} {effort.value!r} turns thinking {state} but {switch.param} is "
                              f"{str(switch.value).lower()}", "conflicting_thinking", switch.param, levels=levels)


def _request_level(effort: _Sent | None, switch: _Sent | None, levels: list[str]) -> Level | None:
    """On /v1/completions the prompt is the client's: the fields only say whether to split reasoning."""
    if effort is None and switch is None:
        return None
    effort_id = effort.value if effort is not None else None
    thinks = switch.value if switch is not None else effort_id != "none"
    if switch is not None and effort is not None and (effort_id != "none") != switch.value:
        raise invalid_request(f"{effort.param} {effort_id!r} and {switch.param} {str(switch.value).lower()} "
                              "disagree", "conflicting_thinking", switch.param, levels=levels)
    return Level(id=effort_id or ("on" if thinks else "none"), enable_thinking=thinks,
                 reasoning_effort=effort_id if effort_id != "none" else None,
                 instruction=None, generation_prompt="", opens_reasoning=False)


def resolve_level(thinking: TemplateThinking, body: dict[str, Any], endpoint: str) -> Level | None:
    """The level a request gets, or None when the template is rendered with no thinking variables.

    endpoint is "chat" or "completion". Raises LSEError 400 (invalid_request_error) with code
    unsupported_reasoning_effort, thinking_unsupported, conflicting_thinking or invalid_thinking, and the
    model's level ids under `levels`.
    """
    levels = thinking.level_ids
    effort = _agreed(_efforts(body, levels), "reasoning effort", levels)
    switch = _agreed(_switches(body, levels), "thinking switch", levels)
    if endpoint == "completion":
        return _request_level(effort, switch, levels)

    if effort is not None:                                        # rule 1
        if not thinking.supported:                                # rule 4
            if effort.value == "none":
                if switch is not None and switch.value:
                    raise invalid_request(f"{effort.param} 'none' turns thinking off but {switch.param} is true",
                                          "conflicting_thinking", switch.param, levels=levels)
                return None
            raise _unsupported(effort.param, f"{effort.param} {effort.value!r}")
        level = thinking.level(effort.value)
        if level is None:
            raise invalid_request(f"{effort.param} {effort.value!r} is not defined by this model's chat template; "
                                  f"levels: {_levels_text(levels)}", "unsupported_reasoning_effort", effort.param,
                                  levels=levels)
        _check_switch(level, switch, effort, levels)
        return level

    if switch is not None:                                        # rule 2
        if not switch.value:
            off = next((level for level in thinking.levels if not level.thinks), None)
            if off is not None or not thinking.supported:         # rule 4: already doesn't think
                return off
            raise invalid_request(f"{switch.param} false: this model's chat template cannot switch thinking off; "
                                  f"levels: {_levels_text(levels)}", "thinking_unsupported", switch.param,
                                  levels=levels)
        if not thinking.supported:
            raise _unsupported(switch.param, f"{switch.param} true")
        default = thinking.default_level
        if default is not None and default.thinks:
            return default
        return next(level for level in thinking.levels if level.thinks)

    return thinking.default_level                                 # rule 3


def _unsupported(param: str, asked: str) -> LSEError:
    return invalid_request(f"{asked} asks for thinking, but this model's chat template has no thinking controls",
                           "thinking_unsupported", param, levels=[])


def thinking_budget(body: dict[str, Any], levels: list[str]) -> int | None:
    """The request's thinking_budget (LSE's field; Anthropic's thinking.budget_tokens): the reply tokens its
    reasoning may take before LSE closes the block with the template's end marker. None when not sent."""
    value = body.get("thinking_budget")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise invalid_request("thinking_budget must be a positive integer: the reply tokens the reasoning may take",
                              "invalid_thinking", "thinking_budget", levels=levels)
    return value


def template_variables(level: Level | None, body: dict[str, Any]) -> dict[str, Any]:
    """The variables a chat request passes to the template: the request's chat_template_kwargs, with the
    thinking variables replaced by the level's own."""
    kwargs = body.get("chat_template_kwargs") or {}
    variables = {key: value for key, value in kwargs.items()
                 if key not in _RENDER_ARGUMENTS and key not in (TOGGLE, EFFORT)}
    if level is not None and level.enable_thinking is not None:
        variables[TOGGLE] = level.enable_thinking
    if level is not None and level.reasoning_effort is not None:
        variables[EFFORT] = level.reasoning_effort
    return variables
