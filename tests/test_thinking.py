"""Thinking levels in requests: every spelling, the spec's four resolution rules and four error codes; and the
reasoning splitter with markers split at every position."""

from __future__ import annotations

from pathlib import Path

import pytest

from lse_core.errors import LSEError
from lse_core.template.probe import probe
from lse_core.template.reasoning import ReasoningSplitter, reasoning_splitter
from lse_core.template.render import ChatTemplate
from lse_core.template.thinking import TemplateThinking, resolve_level, template_variables

FIXTURES = Path("/work/shared/fixtures/chat_templates")


def thinking_of(name: str) -> TemplateThinking:
    path = FIXTURES / name
    return probe(ChatTemplate(path.read_text(), str(path), {"bos_token": "<s>", "eos_token": "</s>"}))


QWEN38 = thinking_of("qwen38-synthetic.jinja")                      # none, xhigh (default), medium, low
QWEN3 = thinking_of("Qwen-Qwen3-0.6B.jinja")                        # none, on (default)
BIELIK = thinking_of("Bielik-11B-v3.0-Instruct.jinja")              # none (default), on
SOLAR = thinking_of("upstage-Solar-Open-100B.jinja")                # low, minimal: effort without a switch
SMOLLM2 = thinking_of("HuggingFaceTB-SmolLM2-135M-Instruct.jinja")  # no controls
QWEN38_LEVELS = ["none", "xhigh", "medium", "low"]


def level_id(thinking: TemplateThinking, body: dict, endpoint: str = "chat") -> str | None:
    level = resolve_level(thinking, body, endpoint)
    return level.id if level else None


def error_of(thinking: TemplateThinking, body: dict, endpoint: str = "chat") -> dict:
    with pytest.raises(LSEError) as raised:
        resolve_level(thinking, body, endpoint)
    assert raised.value.status == 400
    return raised.value.body()["error"]


# --- rule 1: reasoning_effort names a level ---------------------------------------------------------------------

EFFORT_SPELLINGS = [
    lambda v: {"reasoning_effort": v},
    lambda v: {"thinking_level": v},
    lambda v: {"chat_template_kwargs": {"reasoning_effort": v}},
    lambda v: {"reasoning": {"effort": v}},
]


@pytest.mark.parametrize("spell", EFFORT_SPELLINGS, ids=["reasoning_effort", "thinking_level",
                                                         "chat_template_kwargs", "reasoning.effort"])
@pytest.mark.parametrize("value", QWEN38_LEVELS)
def test_effort_spellings_pick_the_level(spell, value: str) -> None:
    assert level_id(QWEN38, spell(value)) == value


def test_effort_with_an_agreeing_switch() -> None:
    assert level_id(QWEN38, {"reasoning_effort": "low", "enable_thinking": True}) == "low"
    assert level_id(QWEN38, {"reasoning_effort": "none", "thinking": {"type": "disabled"}}) == "none"
    assert level_id(QWEN38, {"reasoning_effort": "medium", "reasoning": {"effort": "medium"},
                             "chat_template_kwargs": {"reasoning_effort": "medium", "enable_thinking": True}}) \
        == "medium"


def test_null_means_not_sent() -> None:
    assert level_id(QWEN38, {"reasoning_effort": None, "enable_thinking": None, "thinking": None}) == "xhigh"


# --- rule 2: only the switch ----------------------------------------------------------------------------------

SWITCH_SPELLINGS = [
    lambda on: {"enable_thinking": on},
    lambda on: {"thinking": on},
    lambda on: {"thinking": {"type": "enabled" if on else "disabled"}},
    lambda on: {"chat_template_kwargs": {"enable_thinking": on}},
]


@pytest.mark.parametrize("spell", SWITCH_SPELLINGS, ids=["enable_thinking", "thinking", "thinking.type",
                                                         "chat_template_kwargs"])
def test_switch_spellings(spell) -> None:
    assert level_id(QWEN38, spell(False)) == "none"
    assert level_id(QWEN38, spell(True)) == "xhigh"      # the default thinks
    assert level_id(QWEN3, spell(True)) == "on"
    assert level_id(BIELIK, spell(True)) == "on"         # the default (none) does not: the first level that thinks
    assert level_id(BIELIK, spell(False)) == "none"
    assert level_id(SOLAR, spell(True)) == "low"         # no default: the first level that thinks


# --- rule 3: neither ------------------------------------------------------------------------------------------

def test_neither_gives_the_default_level() -> None:
    assert level_id(QWEN38, {}) == "xhigh"
    assert level_id(QWEN3, {}) == "on"
    assert level_id(BIELIK, {}) == "none"
    assert level_id(SOLAR, {}) is None
    assert level_id(SMOLLM2, {}) is None


# --- rule 4: a model without thinking controls ------------------------------------------------------------------

def test_a_model_without_controls_accepts_not_thinking() -> None:
    for body in ({"reasoning_effort": "none"}, {"enable_thinking": False}, {"thinking": {"type": "disabled"}},
                 {"reasoning_effort": "none", "enable_thinking": False}):
        assert resolve_level(SMOLLM2, body, "chat") is None


@pytest.mark.parametrize("body,param", [({"enable_thinking": True}, "enable_thinking"),
                                        ({"reasoning_effort": "low"}, "reasoning_effort"),
                                        ({"thinking": {"type": "enabled"}}, "thinking"),
                                        ({"reasoning": {"effort": "high"}}, "reasoning.effort")])
def test_a_model_without_controls_refuses_to_think(body: dict, param: str) -> None:
    error = error_of(SMOLLM2, body)
    assert (error["type"], error["code"], error["param"], error["levels"]) == \
        ("invalid_request_error", "thinking_unsupported", param, [])


# --- the four error codes --------------------------------------------------------------------------------------

def test_unsupported_reasoning_effort_is_the_spec_body() -> None:
    assert error_of(QWEN38, {"reasoning_effort": "high"}) == {
        "message": "reasoning_effort 'high' is not defined by this model's chat template; levels: none, xhigh, "
                   "medium, low",
        "type": "invalid_request_error", "code": "unsupported_reasoning_effort",
        "param": "reasoning_effort", "levels": ["none", "xhigh", "medium", "low"]}


@pytest.mark.parametrize("thinking,body,param", [
    (QWEN38, {"reasoning_effort": "minimal"}, "reasoning_effort"),
    (QWEN38, {"thinking_level": "XHIGH"}, "thinking_level"),                   # no aliasing, not even case
    (QWEN38, {"reasoning": {"effort": "on"}}, "reasoning.effort"),
    (QWEN3, {"chat_template_kwargs": {"reasoning_effort": "low"}}, "chat_template_kwargs.reasoning_effort"),
    (SOLAR, {"reasoning_effort": "none"}, "reasoning_effort"),                 # no switch: no none level
])
def test_unsupported_reasoning_effort(thinking: TemplateThinking, body: dict, param: str) -> None:
    error = error_of(thinking, body)
    assert (error["code"], error["param"], error["levels"]) == \
        ("unsupported_reasoning_effort", param, thinking.level_ids)


def test_switching_off_a_template_that_cannot() -> None:
    error = error_of(SOLAR, {"enable_thinking": False})
    assert (error["code"], error["param"], error["levels"]) == ("thinking_unsupported", "enable_thinking",
                                                                ["low", "minimal"])
    assert "cannot switch thinking off" in error["message"]


@pytest.mark.parametrize("body,param", [
    ({"reasoning_effort": "low", "thinking_level": "medium"}, "thinking_level"),
    ({"reasoning_effort": "low", "reasoning": {"effort": "xhigh"}}, "reasoning.effort"),
    ({"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "none"}},
     "chat_template_kwargs.reasoning_effort"),
    ({"enable_thinking": True, "thinking": False}, "thinking"),
    ({"enable_thinking": False, "chat_template_kwargs": {"enable_thinking": True}},
     "chat_template_kwargs.enable_thinking"),
    ({"reasoning_effort": "low", "enable_thinking": False}, "enable_thinking"),    # the level contradicts
    ({"reasoning_effort": "none", "thinking": {"type": "enabled"}}, "thinking"),
])
def test_conflicting_thinking(body: dict, param: str) -> None:
    error = error_of(QWEN38, body)
    assert (error["type"], error["code"], error["param"], error["levels"]) == \
        ("invalid_request_error", "conflicting_thinking", param, QWEN38_LEVELS)


def test_conflicting_on_a_model_without_controls() -> None:
    assert error_of(SMOLLM2, {"reasoning_effort": "none", "enable_thinking": True})["code"] == \
        "conflicting_thinking"


@pytest.mark.parametrize("body,param", [
    ({"reasoning_effort": 3}, "reasoning_effort"),
    ({"thinking_level": True}, "thinking_level"),
    ({"reasoning": {"effort": ["low"]}}, "reasoning.effort"),
    ({"reasoning": "low"}, "reasoning"),
    ({"enable_thinking": "yes"}, "enable_thinking"),
    ({"enable_thinking": 1}, "enable_thinking"),
    ({"thinking": "enabled"}, "thinking"),
    ({"thinking": {"type": "on"}}, "thinking"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"enable_thinking": "false"}}, "chat_template_kwargs.enable_thinking"),
])
@pytest.mark.parametrize("endpoint", ["chat", "completion"])
def test_invalid_thinking(body: dict, param: str, endpoint: str) -> None:
    error = error_of(QWEN38, body, endpoint)
    assert (error["type"], error["code"], error["param"], error["levels"]) == \
        ("invalid_request_error", "invalid_thinking", param, QWEN38_LEVELS)


# --- /v1/completions: type and agreement only ---------------------------------------------------------------------

def test_completion_fields_only_decide_splitting() -> None:
    high = resolve_level(QWEN38, {"reasoning_effort": "high"}, "completion")   # not checked against the template
    assert (high.id, high.thinks) == ("high", True)
    assert resolve_level(SMOLLM2, {"enable_thinking": True}, "completion").thinks is True
    assert resolve_level(QWEN38, {"thinking": {"type": "disabled"}}, "completion").thinks is False
    assert resolve_level(QWEN38, {"reasoning_effort": "none"}, "completion").thinks is False
    assert resolve_level(QWEN38, {}, "completion") is None
    assert error_of(QWEN38, {"reasoning_effort": "low", "enable_thinking": False}, "completion")["code"] == \
        "conflicting_thinking"
    assert error_of(QWEN38, {"enable_thinking": True, "thinking": False}, "completion")["code"] == \
        "conflicting_thinking"


# --- what a level passes to the template --------------------------------------------------------------------------

def test_template_variables() -> None:
    body = {"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "low", "custom_flag": 1,
                                                                "messages": [], "add_generation_prompt": False}}
    assert template_variables(QWEN38.level("low"), body) == {"custom_flag": 1, "enable_thinking": True,
                                                             "reasoning_effort": "low"}
    assert template_variables(QWEN3.level("none"), {}) == {"enable_thinking": False}
    assert template_variables(None, {"chat_template_kwargs": {"enable_thinking": False}}) == {}


def test_a_level_renders_its_instruction() -> None:
    path = FIXTURES / "qwen38-synthetic.jinja"
    template = ChatTemplate(path.read_text(), str(path), {})
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    for body, level in (({"reasoning_effort": "low"}, "low"), ({}, "xhigh"), ({"enable_thinking": False}, "none")):
        chosen = resolve_level(QWEN38, body, "chat")
        prompt = template.render(messages, **template_variables(chosen, body))
        instruction = QWEN38.level(level).instruction
        head = "<|im_start|>system\n" + (instruction + "\n\n" if instruction else "") + "Be brief.<|im_end|>"
        assert prompt.startswith(head)
        assert prompt.endswith(chosen.generation_prompt)


# --- the reasoning splitter ---------------------------------------------------------------------------------------

def run(splitter: ReasoningSplitter, pieces: list[str]) -> tuple[str, str]:
    outputs = [splitter.feed(piece) for piece in pieces] + [splitter.finish()]
    return "".join(r for r, _ in outputs), "".join(c for _, c in outputs)


REPLIES = [
    # (reply text, starts inside, expected reasoning, expected content)
    ("<think>\nLet me see.\n</think>\n\nParis.", False, "Let me see.\n", "Paris."),
    ("  \n<think>a<b</think>c", False, "a<b", "c"),
    ("Let me see.</think>Paris.", True, "Let me see.", "Paris."),
    ("\nreason </thin and more</think>\n\nanswer <think> stays", True, "reason </thin and more",
     "answer <think> stays"),
    ("Paris, no thinking.", False, "", "Paris, no thinking."),
    ("<thinking is a word", False, "", "<thinking is a word"),
    ("still thinking when the reply ends", True, "still thinking when the reply ends", ""),
    ("<think>cut off </thi", False, "cut off </thi", ""),
    ("The answer: <think> is not at the start", False, "", "The answer: <think> is not at the start"),
    ("  ", False, "", "  "),
]


@pytest.mark.parametrize("reply,inside,reasoning,content", REPLIES)
def test_splitter_at_every_split_position(reply: str, inside: bool, reasoning: str, content: str) -> None:
    for i in range(len(reply) + 1):
        for j in range(i, len(reply) + 1):
            pieces = [reply[:i], reply[i:j], reply[j:]]
            assert run(ReasoningSplitter("<think>", "</think>", inside), pieces) == (reasoning, content), pieces
    assert run(ReasoningSplitter("<think>", "</think>", inside), list(reply)) == (reasoning, content)


def test_splitter_holds_back_only_a_possible_marker() -> None:
    splitter = ReasoningSplitter("<think>", "</think>", True)
    assert splitter.feed("abc</th") == ("abc", "")
    assert splitter.feed("ey") == ("</they", "")
    assert splitter.feed("<") == ("", "")
    assert splitter.feed("/think>ok") == ("", "ok")
    assert splitter.feed(" more") == ("", " more")
    outside = ReasoningSplitter("<think>", "</think>", False)
    assert outside.feed("<thi") == ("", "")              # may still open the block
    assert outside.feed("s") == ("", "<this")
    assert outside.feed(" </think>") == ("", " </think>")


def test_splitter_with_other_markers() -> None:
    splitter = ReasoningSplitter("<seed:think>", "</seed:think>", False)
    assert run(splitter, ["<seed:th", "ink>x</seed:", "think>y"]) == ("x", "y")


def test_splitter_for_a_level() -> None:
    xhigh, none = QWEN38.level("xhigh"), QWEN38.level("none")
    assert run(reasoning_splitter(QWEN38, xhigh, "...<|im_start|>assistant\n<think>\n"), ["a</think>b"]) == ("a", "b")
    assert reasoning_splitter(QWEN38, none, "...<think>\n\n</think>\n\n") is None
    assert reasoning_splitter(SMOLLM2, None, "<|im_start|>assistant\n") is None
    on = reasoning_splitter(QWEN3, QWEN3.level("on"), "<|im_start|>assistant\n")   # the model opens it itself
    assert run(on, ["<think>\nhm\n</think>\n\nyes"]) == ("hm\n", "yes")
    assert run(reasoning_splitter(QWEN3, QWEN3.level("on"), "x"), ["plain"]) == ("", "plain")
