"""Chat templates: every fixture loads, its thinking object is what reading the template gives, rendering
matches transformers, and hostile templates fail cleanly and fast."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from lse_core.errors import LSEError, StartupError
from lse_core.template.probe import probe
from lse_core.template.render import ChatTemplate

FIXTURES = Path("/work/shared/fixtures/chat_templates")
SPECIAL_TOKENS = {"bos_token": "<s>", "eos_token": "</s>"}

XHIGH = ("Reasoning effort is set to xhigh. Please think carefully through the task, validate key assumptions, "
         "consider plausible alternatives, and prioritize correctness, consistency, and clarity in the final answer.")
LOW = ("Reasoning effort is set to low. Keep your thinking brief and focused, moving directly to the conclusion "
       "without unnecessary elaboration.")


def load(name: str) -> ChatTemplate:
    path = FIXTURES / name
    return ChatTemplate(path.read_text(), str(path), SPECIAL_TOKENS)


def level(id: str, enable: bool | None, effort: str | None = None, *, opens: bool, default: bool = False,
          instruction: str | None = None) -> dict:
    return {"id": id, "enable_thinking": enable, "reasoning_effort": effort, "instruction": instruction,
            "opens_reasoning": opens, "default": default}


def toggled(name: str, default: str, on: dict) -> dict:
    """A template with the enable_thinking switch and no effort values: levels none and on."""
    return {"supported": True, "source": str(FIXTURES / name), "toggle": "enable_thinking", "effort": None,
            "default_level": default,
            "levels": [level("none", False, opens=False, default=default == "none"),
                       level("on", True, opens=on.get("opens", False), default=default == "on",
                             instruction=on.get("instruction"))]}


def unsupported(name: str) -> dict:
    return {"supported": False, "source": str(FIXTURES / name), "toggle": None, "effort": None,
            "default_level": None, "levels": []}


# Written by reading each template (reason on the right), not by running the probe.
EXPECTED = {
    # enable_thinking, unset = true; reasoning_effort in ('xhigh','medium','low'), unset = xhigh; xhigh and low
    # put an instruction first in the system prompt; thinking on appends '<think>\n', off closes it.
    "qwen38-synthetic.jinja": {
        "supported": True, "source": str(FIXTURES / "qwen38-synthetic.jinja"), "toggle": "enable_thinking",
        "effort": "reasoning_effort", "default_level": "xhigh",
        "levels": [level("none", False, opens=False),
                   level("xhigh", True, "xhigh", opens=True, default=True, instruction=XHIGH),
                   level("medium", True, "medium", opens=True),
                   level("low", True, "low", opens=True, instruction=LOW)]},
    # `enable_thinking is false` closes an empty <think> block; unset leaves '<|im_start|>assistant\n' (on).
    "Qwen-Qwen3-0.6B.jinja": toggled("Qwen-Qwen3-0.6B.jinja", "on", {"opens": False}),
    # unset -> true -> '/think' mode, prompt '<|im_start|>assistant\n'; off appends '<think>\n\n</think>\n'; the
    # mode line before the system prompt says '/think' where off says '/no_think': that word is on's instruction.
    "HuggingFaceTB-SmolLM3-3B.jinja": toggled("HuggingFaceTB-SmolLM3-3B.jinja", "on",
                                              {"opens": False, "instruction": "/think"}),
    # '<think>' unless enable_thinking is defined and false: unset is on; off ends with '</think>'.
    "GLM-4.7-Flash.jinja": toggled("GLM-4.7-Flash.jinja", "on", {"opens": True}),
    # `if enable_thinking`: unset is off; on appends '<think>\n' and writes its Polish thinking text after the
    # system prompt, which is no instruction (the spec's is text placed first in the system prompt).
    "Bielik-11B-v3.0-Instruct.jinja": toggled("Bielik-11B-v3.0-Instruct.jinja", "none", {"opens": True}),
    # `enable_thinking is true` appends 'assistant: <think>\n'; unset gives 'assistant:' (off).
    "Reka-Edge.jinja": toggled("Reka-Edge.jinja", "none", {"opens": True}),
    # on writes '<|think|>\n' at the top of the system turn, before the system prompt; unset is off, which
    # appends an empty thought channel. Its markers are channel tokens, not a <think>-style tag pair.
    "google-gemma-4-31B-it.jinja": toggled("google-gemma-4-31B-it.jinja", "none",
                                           {"opens": False, "instruction": "<|think|>"}),
    # unset = True; on appends '<think>\n', off '<think></think>'.
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja": toggled("NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja", "on",
                                                         {"opens": True}),
    # the same switch as Nemotron 3 Nano (plus /think scanning of the messages, absent from the probe).
    "ollama-nemotron3nano.jinja": toggled("ollama-nemotron3nano.jinja", "on", {"opens": True}),
    # enable_thinking | default(false); on appends '<think>', off '</think>'.
    "ollama-laguna-v8.jinja": toggled("ollama-laguna-v8.jinja", "none", {"opens": True}),
    "poolside-Laguna-XS.2.jinja": toggled("poolside-Laguna-XS.2.jinja", "none", {"opens": True}),
    # no enable_thinking; reasoning_effort in ["low", "minimal"] prepends an empty '<|think|><|end|>' turn, and the
    # unset value is "high" (not compared), so no level is the default. Its markers are not a tag pair.
    "upstage-Solar-Open-100B.jinja": {
        "supported": True, "source": str(FIXTURES / "upstage-Solar-Open-100B.jinja"), "toggle": None,
        "effort": "reasoning_effort", "default_level": None,
        "levels": [level("low", None, "low", opens=False), level("minimal", None, "minimal", opens=False)]},
    # reasoning_effort is only concatenated ("Reasoning: " + reasoning_effort), never compared: no levels.
    "openai-gpt-oss-120b.jinja": unsupported("openai-gpt-oss-120b.jinja"),
    # these switch on a variable named `thinking`, which is not the spec's toggle.
    "deepseek-ai-DeepSeek-V3.1.jinja": unsupported("deepseek-ai-DeepSeek-V3.1.jinja"),
    "ibm-granite-granite-3.3-2B-Instruct.jinja": unsupported("ibm-granite-granite-3.3-2B-Instruct.jinja"),
    # always open <think> (or never mention it) with no variable to switch it.
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": unsupported("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"),
    "Qwen-QwQ-32B.jinja": unsupported("Qwen-QwQ-32B.jinja"),
    "stepfun-ai-Step-3.5-Flash.jinja": unsupported("stepfun-ai-Step-3.5-Flash.jinja"),
    # no thinking variables at all.
    **{name: unsupported(name) for name in [
        "HuggingFaceTB-SmolLM2-135M-Instruct.jinja", "Qwen-Qwen2.5-Coder-0.5B-Instruct.jinja",
        "Qwen-Qwen2.5-7B-Instruct.jinja", "Qwen3-Coder.jinja", "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja",
        "GigaChat3-10B-A1.8B.jinja", "LFM2-8B-A1B.jinja", "LFM2.5-8B-A1B.jinja", "MiMo-VL.jinja",
        "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", "google-gemma-2-2b-it.jinja",
        "ibm-granite-granite-4.0.jinja", "ibm-granite-granite-4.1.jinja", "meta-llama-Llama-3.1-8B-Instruct.jinja",
        "meta-llama-Llama-3.2-3B-Instruct.jinja", "microsoft-Phi-3.5-mini-instruct.jinja",
        "mistralai-Mistral-Nemo-Instruct-2407.jinja", "moonshotai-Kimi-K2.jinja", "unsloth-Apriel-1.5.jinja"]},
}


def test_every_fixture_has_an_expectation() -> None:
    assert set(EXPECTED) == {path.name for path in FIXTURES.glob("*.jinja")}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_thinking_object(name: str) -> None:
    assert probe(load(name)).to_json() == EXPECTED[name]


def test_qwen38_is_the_spec_object() -> None:
    """The spec's /v1/models example, word for word (its source path aside)."""
    spec = {
        "supported": True, "source": str(FIXTURES / "qwen38-synthetic.jinja"), "toggle": "enable_thinking",
        "effort": "reasoning_effort", "default_level": "xhigh",
        "levels": [
            {"id": "none", "enable_thinking": False, "reasoning_effort": None,
             "instruction": None, "opens_reasoning": False, "default": False},
            {"id": "xhigh", "enable_thinking": True, "reasoning_effort": "xhigh",
             "instruction": "Reasoning effort is set to xhigh. Please think carefully through the task, validate key "
                            "assumptions, consider plausible alternatives, and prioritize correctness, consistency, "
                            "and clarity in the final answer.",
             "opens_reasoning": True, "default": True},
            {"id": "medium", "enable_thinking": True, "reasoning_effort": "medium",
             "instruction": None, "opens_reasoning": True, "default": False},
            {"id": "low", "enable_thinking": True, "reasoning_effort": "low",
             "instruction": "Reasoning effort is set to low. Keep your thinking brief and focused, moving directly "
                            "to the conclusion without unnecessary elaboration.",
             "opens_reasoning": True, "default": False}]}
    assert probe(load("qwen38-synthetic.jinja")).to_json() == spec


def test_no_template() -> None:
    assert probe(None).to_json() == {"supported": False, "source": None, "toggle": None, "effort": None,
                                     "default_level": None, "levels": []}


def test_generation_prompts_and_markers() -> None:
    thinking = probe(load("qwen38-synthetic.jinja"))
    assert (thinking.open_marker, thinking.close_marker) == ("<think>", "</think>")
    assert thinking.level("xhigh").generation_prompt == "<|im_start|>assistant\n<think>\n"
    assert thinking.level("none").generation_prompt == "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    laguna = probe(load("ollama-laguna-v8.jinja"))   # '<assistant>' is a tag too, but not the reasoning one
    assert (laguna.open_marker, laguna.close_marker) == ("<think>", "</think>")
    assert probe(load("HuggingFaceTB-SmolLM2-135M-Instruct.jinja")).open_marker is None


def test_probe_time_of_the_biggest_fixture() -> None:
    biggest = max(FIXTURES.glob("*.jinja"), key=lambda path: path.stat().st_size)
    template = load(biggest.name)
    start = time.perf_counter()
    probe(template)
    elapsed = time.perf_counter() - start
    print(f"probe of {biggest.name} ({biggest.stat().st_size} bytes): {elapsed * 1000:.1f} ms")
    assert elapsed < 0.5


# --- rendering as transformers renders -------------------------------------------------------------------------

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime. é ✓"},
    {"role": "assistant", "content": "Seven."},
    {"role": "user", "content": "Another?"},
]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city"}},
                   "required": ["city"]}}}]


def _transformers_render(source: str, messages: list[dict], **kwargs) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    return render_jinja_template([messages], chat_template=source, add_generation_prompt=True,
                                 **SPECIAL_TOKENS, **kwargs)[0][0]


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["plain", "tools"])
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_renders_as_transformers(name: str, tools: list | None) -> None:
    template = load(name)
    for messages in (CONVERSATION, CONVERSATION[1:]):
        try:
            expected = _transformers_render(template.source, messages, tools=tools)
        except Exception as error:
            with pytest.raises(LSEError) as raised:
                template.render(messages, tools=tools)
            assert raised.value.code == "template_error" and raised.value.status == 400, error
            continue
        assert template.render(messages, tools=tools) == expected


def test_environment_matches_transformers() -> None:
    source = ("{{ bos_token }}{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
              "{% generation %}{{ m | tojson }}{{ m | tojson(indent=1, separators=(',', ':'), sort_keys=True) }}"
              "{% endgeneration %}{% endfor %}\n")
    messages = [{"role": "user", "content": "é<b>"}, {"role": "user", "content": "unseen"}]
    rendered = ChatTemplate(source, None, SPECIAL_TOKENS).render(messages)
    assert rendered == _transformers_render(source, messages)
    assert rendered == '<s>{"role": "user", "content": "é<b>"}{\n "content":"é<b>",\n "role":"user"\n}'


# --- failures ----------------------------------------------------------------------------------------------------

def test_unparsable_template_names_file_and_line() -> None:
    with pytest.raises(StartupError, match=r"/models/x/chat_template\.jinja: line 3: .*'}'"):
        ChatTemplate("hello\n{% if messages %}\n{{ messages }", "/models/x/chat_template.jinja")


def test_raise_exception_is_startup_error_at_load_and_400_per_request() -> None:
    with pytest.raises(StartupError, match="No way"):
        probe(ChatTemplate("{{ raise_exception('No way') }}", "t.jinja"))
    gemma = load("google-gemma-2-2b-it.jinja")
    probe(gemma)  # a user-only conversation renders
    with pytest.raises(LSEError) as raised:
        gemma.render(CONVERSATION)
    assert raised.value.body()["error"] == {"message": "chat template error: System role not supported",
                                            "type": "invalid_request_error", "code": "template_error",
                                            "param": "messages"}


ESCAPES = [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{{ '{0.__class__.__mro__}'.format('') }}",
    "{{ raise_exception.__globals__['os'] }}",
    "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
]


@pytest.mark.parametrize("source", ESCAPES)
def test_sandbox_blocks_python_internals(source: str) -> None:
    with pytest.raises(StartupError, match="unsafe|cannot|undefined"):
        probe(ChatTemplate(source, "hostile.jinja"))
    hidden = ChatTemplate("{% if escape %}" + source + "{% endif %}ok", "hostile.jinja")
    probe(hidden)   # loads: the escape only runs when a request asks for it
    with pytest.raises(LSEError) as raised:
        hidden.render([], escape=True)
    assert raised.value.code == "template_error"


ENDLESS = {
    "nested ranges": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "nested list loops": "{% set x = range(100000) | list %}{% for i in x %}{% for j in x %}{% endfor %}"
                         "{% endfor %}",
    "macro fan-out": "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
    "recursive loop": "{% for x in range(1000) recursive %}{{ loop(range(1000)) }}{% endfor %}",
    "string doubling": "{% set ns = namespace(s='ab') %}{% for i in range(200) %}{% set ns.s = ns.s ~ ns.s %}"
                       "{% endfor %}",
    "list doubling": "{% set ns = namespace(s=[1]) %}{% for i in range(200) %}{% set ns.s = ns.s + ns.s %}"
                     "{% endfor %}",
    "repetition": "{{ 'x' * 10 ** 12 }}",
    "huge power": "{{ 7 ** 100000000 }}",
    "self recursion": "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
}
BOUND_S = 2.0 + 1.0   # the render limit plus scheduling slack on a shared machine


@pytest.mark.parametrize("source", ENDLESS.values(), ids=ENDLESS.keys())
def test_endless_templates_fail_fast_at_load(source: str) -> None:
    start = time.perf_counter()
    with pytest.raises(StartupError, match="hostile.jinja: "):
        probe(ChatTemplate(source, "hostile.jinja"))
    assert time.perf_counter() - start < BOUND_S


@pytest.mark.parametrize("source", ENDLESS.values(), ids=ENDLESS.keys())
def test_endless_templates_fail_fast_per_request(source: str) -> None:
    template = ChatTemplate("{% if attack %}" + source + "{% endif %}ok", "hostile.jinja")
    assert probe(template).supported is False
    start = time.perf_counter()
    with pytest.raises(LSEError) as raised:
        template.render([], attack=True)
    assert time.perf_counter() - start < BOUND_S
    assert raised.value.status == 400 and raised.value.code == "template_error"
    assert template.render([]) == "ok"   # the template still serves other requests


# --- effort values from the AST ------------------------------------------------------------------------------------

def test_effort_candidates_follow_assignments_and_comparisons() -> None:
    source = """
{%- set level = reasoning_effort | default('auto') | lower %}
{%- set ns = namespace(e=level) %}
{%- set allowed = ['quick', 'deep'] %}
{%- if level == 'max' %}A{% elif 'min' == level %}B{% endif %}
{%- if ns.e is eq 'mid' %}C{% endif %}
{%- if level is in allowed %}D{% endif %}
{%- if reasoning_effort not in ('x1', 'x2') and other == 'unrelated' %}E{% endif %}
{%- if level != 'max' %}F{% endif %}"""
    from lse_core.template.probe import effort_candidates

    assert effort_candidates(ChatTemplate(source).ast) == ["max", "min", "mid", "quick", "deep", "x1", "x2"]


def test_effort_values_must_change_the_rendering_and_not_raise() -> None:
    source = ("{% if reasoning_effort == 'loud' %}LOUD {% elif reasoning_effort == 'same' %}{% endif %}"
              "{% if reasoning_effort == 'bad' %}{{ raise_exception('no') }}{% endif %}"
              "{% for m in messages %}{{ m.content }}{% endfor %}")
    thinking = probe(ChatTemplate(source, "t.jinja")).to_json()
    assert thinking["effort"] == "reasoning_effort" and thinking["toggle"] is None
    assert [level["id"] for level in thinking["levels"]] == ["loud"]
