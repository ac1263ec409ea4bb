"""Output limits and context checks, against the spec's "Output limits" and "Context full" sections."""

import pytest

from lse_core.errors import LSEError
from lse_core.limits import TokenLimit, check_prompt, lse_context, resolve_limit
from lse_core.protocol import Choice, finish_reason, parse_chat
from lse_core.sampling import GenerationDefaults

NO_DEFAULTS = GenerationDefaults()


def limit(max_tokens=None, cap=0, defaults=NO_DEFAULTS, prompt=40, context=512, param="messages"):
    return resolve_limit(max_tokens, cap, defaults, prompt, context, param)


# ---- the table: how a reply ends ----

@pytest.mark.parametrize("stop_reason, tool_calls, expected", [
    ("stop_token", None, "stop"),
    ("stop_token", [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
     "tool_calls"),
    ("stop_sequence", None, "stop"),
    ("max_tokens", None, "length"),
    ("context_full", None, "length"),
    ("cancelled", None, None),
])
def test_finish_reason_per_stop_reason(stop_reason, tool_calls, expected):
    assert finish_reason(Choice(stop_reason=stop_reason, tool_calls=tool_calls)) == expected


# ---- the order of token limits ----

def test_request_max_tokens_is_the_limit():
    assert limit(max_tokens=100) == TokenLimit(100, "max_tokens")


def test_request_limit_wins_over_generation_config_and_its_max_length():
    defaults = GenerationDefaults(max_new_tokens=10, max_length=60)
    assert limit(max_tokens=100, defaults=defaults) == TokenLimit(100, "max_tokens")


def test_max_tokens_wins_over_max_completion_tokens():
    request = parse_chat({"messages": [{"role": "user", "content": "hi"}],
                          "max_tokens": 7, "max_completion_tokens": 9})
    assert limit(request.max_tokens) == TokenLimit(7, "max_tokens")


def test_max_completion_tokens_alone_is_the_limit():
    request = parse_chat({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9})
    assert limit(request.max_tokens) == TokenLimit(9, "max_tokens")


def test_null_max_tokens_means_not_sent():
    request = parse_chat({"messages": [{"role": "user", "content": "hi"}], "max_tokens": None})
    assert request.max_tokens is None
    assert limit(request.max_tokens) == TokenLimit(472, "context_full")


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("value, code", [(0, "invalid_value"), (-3, "invalid_value"), (2.5, "invalid_type"),
                                         (True, "invalid_type"), ("12", "invalid_type")])
def test_token_limit_fields_must_be_positive_integers(field, value, code):
    with pytest.raises(LSEError) as caught:
        parse_chat({"messages": [{"role": "user", "content": "hi"}], field: value})
    assert caught.value.status == 400
    assert caught.value.body()["error"]["code"] == code
    assert caught.value.body()["error"]["param"] == field


def test_operator_cap_applies_when_the_request_sends_none():
    assert limit(cap=64) == TokenLimit(64, "max_tokens")


def test_request_within_the_cap_is_used():
    assert limit(max_tokens=30, cap=64) == TokenLimit(30, "max_tokens")


def test_request_above_the_cap_is_refused():
    with pytest.raises(LSEError) as caught:
        limit(max_tokens=65, cap=64)
    error = caught.value.body()["error"]
    assert caught.value.status == 400
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "max_tokens"


def test_cap_zero_means_no_cap():
    assert limit(max_tokens=400, cap=0) == TokenLimit(400, "max_tokens")


def test_operator_cap_wins_over_max_new_tokens():
    assert limit(cap=64, defaults=GenerationDefaults(max_new_tokens=10)) == TokenLimit(64, "max_tokens")


def test_generation_config_max_new_tokens_when_nothing_else_is_set():
    assert limit(defaults=GenerationDefaults(max_new_tokens=10)) == TokenLimit(10, "max_tokens")


def test_no_limit_runs_to_the_context():
    assert limit(prompt=40, context=512) == TokenLimit(472, "context_full")


# ---- max_length bounds prompt + reply for items 2 to 4 ----

def test_max_length_bounds_the_operator_cap():
    assert limit(cap=300, prompt=40, defaults=GenerationDefaults(max_length=100)) == TokenLimit(60, "max_tokens")


def test_max_length_bounds_max_new_tokens():
    defaults = GenerationDefaults(max_new_tokens=300, max_length=100)
    assert limit(prompt=40, defaults=defaults) == TokenLimit(60, "max_tokens")


def test_max_length_bounds_no_limit():
    assert limit(prompt=40, defaults=GenerationDefaults(max_length=100)) == TokenLimit(60, "max_tokens")


def test_max_length_above_the_context_leaves_the_context_as_bound():
    assert limit(prompt=40, context=512, defaults=GenerationDefaults(max_length=4096)) == \
        TokenLimit(472, "context_full")


def test_prompt_past_max_length_leaves_an_empty_reply():
    assert limit(prompt=120, defaults=GenerationDefaults(max_length=100)) == TokenLimit(0, "max_tokens")


# ---- the context always bounds prompt + reply ----

def test_request_beyond_the_context_ends_at_context_full():
    assert limit(max_tokens=1000, prompt=40, context=512) == TokenLimit(472, "context_full")


def test_cap_beyond_the_context_ends_at_context_full():
    assert limit(cap=1000, prompt=40, context=512) == TokenLimit(472, "context_full")


def test_limit_that_exactly_fills_the_context_reports_context_full():
    assert limit(max_tokens=472, prompt=40, context=512) == TokenLimit(472, "context_full")


def test_one_token_of_room():
    assert limit(prompt=511, context=512) == TokenLimit(1, "context_full")


# ---- a prompt that fills the context ----

def test_prompt_filling_the_context_is_the_specs_400_on_chat():
    with pytest.raises(LSEError) as caught:
        limit(prompt=600, context=512, param="messages")
    assert caught.value.status == 400
    assert caught.value.body() == {
        "error": {
            "message": "the prompt is 600 tokens and the context holds 512; compact or shorten the conversation",
            "type": "invalid_request_error",
            "code": "context_full",
            "param": "messages",
            "lse_context": {"tokens_used": 600, "context_length": 512, "tokens_remaining": 0},
        }
    }


def test_prompt_filling_the_context_names_prompt_on_completions():
    with pytest.raises(LSEError) as caught:
        check_prompt(512, 512, "prompt")
    assert caught.value.body() == {
        "error": {
            "message": "the prompt is 512 tokens and the context holds 512; compact or shorten the conversation",
            "type": "invalid_request_error",
            "code": "context_full",
            "param": "prompt",
            "lse_context": {"tokens_used": 512, "context_length": 512, "tokens_remaining": 0},
        }
    }


def test_prompt_with_room_passes():
    check_prompt(511, 512, "messages")


def test_lse_context_never_goes_below_zero():
    assert lse_context(40 + 472, 512) == {"tokens_used": 512, "context_length": 512, "tokens_remaining": 0}
    assert lse_context(100, 512) == {"tokens_used": 100, "context_length": 512, "tokens_remaining": 412}
    assert lse_context(700, 512)["tokens_remaining"] == 0
