"""Sampling defaults, their sources, and a request's resolved sampling (spec: "Sampling defaults",
"LSE's neutral defaults", "Request fields")."""

import pytest

from lse_core.errors import StartupError
from lse_core.protocol import parse_chat, parse_completion
from lse_core.sampling import GenerationDefaults, SamplingParams, generation_defaults, resolve_sampling

SAMPLING_FIELDS = ["temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty"]


def chat(**fields):
    return parse_chat({"messages": [{"role": "user", "content": "hi"}], **fields})


def test_neutral_defaults_table():
    assert generation_defaults({}, {}, None).to_json() == {
        "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
        "repetition_penalty": 1.0, "presence_penalty": 0.0,
        "max_new_tokens": None, "max_length": None,
        "sources": {
            "temperature": "lse_default", "top_k": "lse_default", "top_p": "lse_default",
            "min_p": "lse_default", "repetition_penalty": "lse_default", "presence_penalty": "lse_default",
            "max_new_tokens": "lse_default", "max_length": "lse_default",
        },
    }


def test_specs_generation_defaults_example():
    # Qwen3.8's generation_config.json: temperature 1.0, top_k 20, top_p 0.95.
    defaults = generation_defaults({"temperature": 1.0, "top_k": 20, "top_p": 0.95}, {}, None)
    assert defaults.to_json() == {
        "temperature": 1.0, "top_k": 20, "top_p": 0.95, "min_p": 0.0,
        "repetition_penalty": 1.0, "presence_penalty": 0.0,
        "max_new_tokens": None, "max_length": None,
        "sources": {
            "temperature": "generation_config.json", "top_k": "generation_config.json",
            "top_p": "generation_config.json", "min_p": "lse_default",
            "repetition_penalty": "lse_default", "presence_penalty": "lse_default",
            "max_new_tokens": "lse_default", "max_length": "lse_default",
        },
    }


# One value per field for each place in the order, all different from each other and from neutral.
FILE_VALUES = {
    "temperature": (0.7, 0.6, 0.5), "top_k": (20, 30, 40), "top_p": (0.9, 0.8, 0.7),
    "min_p": (0.05, 0.1, 0.15), "repetition_penalty": (1.1, 1.2, 1.3), "presence_penalty": (0.5, 0.4, 0.3),
}
REQUEST_VALUES = {"temperature": 0.2, "top_k": 5, "top_p": 0.5, "min_p": 0.2,
                  "repetition_penalty": 1.5, "presence_penalty": 1.5}


@pytest.mark.parametrize("name", SAMPLING_FIELDS)
def test_generation_config_json_wins_over_config_json(name):
    generation, embedded, top = FILE_VALUES[name]
    defaults = generation_defaults({name: generation}, {"generation_config": {name: embedded}, name: top}, None)
    assert getattr(defaults, name) == generation
    assert defaults.sources[name] == "generation_config.json"


@pytest.mark.parametrize("name", SAMPLING_FIELDS)
def test_embedded_generation_config_wins_over_top_level(name):
    _, embedded, top = FILE_VALUES[name]
    defaults = generation_defaults({}, {"generation_config": {name: embedded}, name: top}, None)
    assert getattr(defaults, name) == embedded
    assert defaults.sources[name] == "config.json"


@pytest.mark.parametrize("name", SAMPLING_FIELDS)
def test_config_json_top_level_fields_win_over_neutral(name):
    _, _, top = FILE_VALUES[name]
    defaults = generation_defaults({}, {name: top}, None)
    assert getattr(defaults, name) == top
    assert defaults.sources[name] == "config.json"


@pytest.mark.parametrize("name", SAMPLING_FIELDS)
def test_null_in_a_file_means_not_set(name):
    _, _, top = FILE_VALUES[name]
    defaults = generation_defaults({name: None}, {name: top}, None)
    assert getattr(defaults, name) == top
    assert defaults.sources[name] == "config.json"


@pytest.mark.parametrize("name", SAMPLING_FIELDS)
def test_request_wins_over_the_models_files(name):
    defaults = generation_defaults({name: FILE_VALUES[name][0]}, {}, None)
    params = resolve_sampling(chat(**{name: REQUEST_VALUES[name]}), defaults)
    assert getattr(params, name) == REQUEST_VALUES[name]


@pytest.mark.parametrize("name", SAMPLING_FIELDS)
def test_request_null_takes_the_default(name):
    defaults = generation_defaults({name: FILE_VALUES[name][0]}, {}, None)
    params = resolve_sampling(chat(**{name: None}), defaults)
    assert getattr(params, name) == FILE_VALUES[name][0]


def test_request_leaving_everything_out_gets_neutral_sampling():
    params = resolve_sampling(chat(), generation_defaults({}, {}, None))
    assert params == SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                                    repetition_penalty=1.0, presence_penalty=0.0, seed=None)


def test_completions_take_the_same_defaults():
    defaults = generation_defaults({"temperature": 0.7, "top_k": 20}, {}, None)
    params = resolve_sampling(parse_completion({"prompt": "Once", "top_k": 3}), defaults)
    assert (params.temperature, params.top_k) == (0.7, 3)


# ---- do_sample and --temperature ----

def test_do_sample_false_makes_the_default_greedy():
    defaults = generation_defaults({"do_sample": False}, {}, None)
    assert defaults.temperature == 0.0
    assert defaults.sources["temperature"] == "generation_config.json"


def test_do_sample_false_overrides_the_same_files_temperature():
    defaults = generation_defaults({"do_sample": False, "temperature": 0.6, "top_p": 0.9}, {}, None)
    assert defaults.temperature == 0.0
    assert defaults.top_p == 0.9


def test_do_sample_false_in_config_json():
    defaults = generation_defaults({}, {"do_sample": False, "temperature": 1.0}, None)
    assert defaults.temperature == 0.0
    assert defaults.sources["temperature"] == "config.json"


def test_do_sample_false_in_a_later_file_loses_to_an_earlier_temperature():
    defaults = generation_defaults({"temperature": 0.6}, {"do_sample": False}, None)
    assert defaults.temperature == 0.6
    assert defaults.sources["temperature"] == "generation_config.json"


def test_do_sample_true_sets_no_temperature():
    defaults = generation_defaults({"do_sample": True}, {}, None)
    assert defaults.temperature == 1.0
    assert defaults.sources["temperature"] == "lse_default"


def test_request_temperature_wins_over_do_sample_false():
    params = resolve_sampling(chat(temperature=0.8), generation_defaults({"do_sample": False}, {}, None))
    assert params.temperature == 0.8


def test_server_temperature_overrides_the_models_temperature():
    defaults = generation_defaults({"temperature": 0.6}, {}, 0.3)
    assert defaults.to_json()["temperature"] == 0.3
    assert defaults.to_json()["sources"]["temperature"] == "server_option"


def test_server_temperature_overrides_do_sample_false_and_neutral():
    assert generation_defaults({"do_sample": False}, {}, 0.9).temperature == 0.9
    neutral = generation_defaults({}, {}, 0.0)
    assert (neutral.temperature, neutral.sources["temperature"]) == (0.0, "server_option")


def test_request_temperature_wins_over_the_server_option():
    assert resolve_sampling(chat(temperature=1.2), generation_defaults({}, {}, 0.3)).temperature == 1.2


# ---- output-limit fields ----

def test_max_new_tokens_and_max_length_from_generation_config_json():
    defaults = generation_defaults({"max_new_tokens": 256, "max_length": 2048}, {}, None)
    assert (defaults.max_new_tokens, defaults.max_length) == (256, 2048)
    assert defaults.sources["max_new_tokens"] == defaults.sources["max_length"] == "generation_config.json"


def test_config_json_sets_no_output_limit():
    # The spec's output limits come from generation_config.json; old config.json files carry
    # transformers' serialized max_length 20, which was never meant as a limit.
    defaults = generation_defaults({}, {"max_length": 20, "generation_config": {"max_new_tokens": 5}}, None)
    assert (defaults.max_new_tokens, defaults.max_length) == (None, None)
    assert defaults.sources["max_length"] == "lse_default"


# ---- file values ----

@pytest.mark.parametrize("top_k", [0, -1])
def test_top_k_off_in_a_file_is_zero(top_k):
    assert generation_defaults({"top_k": top_k}, {}, None).top_k == 0


@pytest.mark.parametrize("generation_config, config", [
    ({"temperature": "hot"}, {}),
    ({}, {"top_p": [0.9]}),
    ({"top_k": 20.5}, {}),
    ({"max_new_tokens": 0}, {}),
    ({"repetition_penalty": True}, {}),
])
def test_malformed_file_values_stop_startup_naming_the_file(generation_config, config):
    with pytest.raises(StartupError) as caught:
        generation_defaults(generation_config, config, None)
    file = "generation_config.json" if generation_config else "config.json"
    assert str(caught.value).startswith(file)


def test_defaults_are_json_types():
    defaults = generation_defaults({"temperature": 1, "top_k": 20.0}, {}, None).to_json()
    assert isinstance(defaults["temperature"], float) and isinstance(defaults["top_k"], int)


# ---- request fields ----

@pytest.mark.parametrize("top_k", [0, -1])
def test_request_top_k_off(top_k):
    assert resolve_sampling(chat(top_k=top_k), generation_defaults({"top_k": 20}, {}, None)).top_k == 0


def test_frequency_penalty_maps_to_repetition_penalty():
    params = resolve_sampling(chat(frequency_penalty=0.5), GenerationDefaults())
    assert params.repetition_penalty == 1.5


def test_explicit_repetition_penalty_wins_over_frequency_penalty():
    params = resolve_sampling(chat(frequency_penalty=0.5, repetition_penalty=1.1), GenerationDefaults())
    assert params.repetition_penalty == 1.1


@pytest.mark.parametrize("frequency_penalty", [0.0, -0.5])
def test_frequency_penalty_not_positive_leaves_the_default(frequency_penalty):
    defaults = generation_defaults({"repetition_penalty": 1.05}, {}, None)
    assert resolve_sampling(chat(frequency_penalty=frequency_penalty), defaults).repetition_penalty == 1.05


def test_seed_passes_through():
    assert resolve_sampling(chat(seed=1234), GenerationDefaults()).seed == 1234


def test_zero_or_negative_temperature_is_kept_for_greedy():
    assert resolve_sampling(chat(temperature=-1), GenerationDefaults()).temperature == -1.0
