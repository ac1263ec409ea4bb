"""Sampling defaults with their sources, and a request's sampling parameters.

Each field a request leaves out (or sends as null) takes the first of: generation_config.json,
config.json's embedded generation_config object, config.json's top-level fields, LSE's neutral
defaults. ``--temperature`` overrides the temperature default (source ``server_option``).

do_sample: false in a file makes that file's temperature 0 (greedy), whatever temperature the file
also names, because Hugging Face ignores temperature when do_sample is false. The source reported
for that temperature is the file holding do_sample: false.

max_new_tokens and max_length come from generation_config.json only: the spec's output limits name
that file, and old config.json files carry a serialized max_length of 20 that was never a limit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from pydantic import TypeAdapter, with_config

from lse_core.adapters.common import REPLY_PART
from lse_core.errors import StartupError

if TYPE_CHECKING:
    from lse_core.protocol import GenerationRequest

# LSE's neutral defaults: plain sampling from the model's distribution.
NEUTRAL: dict[str, float | int] = {
    "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
    "repetition_penalty": 1.0, "presence_penalty": 0.0,
}
LIMIT_FIELDS = ("max_new_tokens", "max_length")
DEFAULT_FIELDS = (*NEUTRAL, *LIMIT_FIELDS)
Source = Literal["generation_config.json", "config.json", "server_option", "lse_default"]


@with_config(REPLY_PART)   # the reply part itself: its fields are the JSON's keys, each always present
@dataclass(frozen=True)
class GenerationDefaults:
    """The model's defaults; ``sources[field]`` is generation_config.json, config.json,
    server_option or lse_default."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    max_new_tokens: int | None = None
    max_length: int | None = None
    sources: dict[str, Source] = field(default_factory=lambda: dict.fromkeys(DEFAULT_FIELDS, "lse_default"))

    def to_json(self) -> dict[str, Any]:
        """The spec's generation_defaults object."""
        return _GENERATION_DEFAULTS.dump_python(self)


_GENERATION_DEFAULTS = TypeAdapter(GenerationDefaults)


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling, every field resolved. temperature <= 0 is greedy; top_k 0, top_p 1,
    min_p 0, repetition_penalty 1 and presence_penalty 0 are off; seed None means unseeded."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    seed: int | None


NEUTRAL_SAMPLING = SamplingParams(**NEUTRAL, seed=None)   # plain, unseeded sampling

# The spec allows any temperature and presence_penalty and any repetition_penalty > 0, but the kernels
# compute in float32: 1e-300 is 0 there (a division by zero) and 1e300 is inf (NaN logits). Past these
# bounds a parameter's effect is saturated (logits are at most a few hundred), so kernels get the bound.
GREEDY_BELOW = 1e-5   # a temperature under this samples greedily, as in vLLM
KERNEL_BOUNDS = {"temperature": (GREEDY_BELOW, 1e6), "repetition_penalty": (1e-6, 1e6),
                 "presence_penalty": (-1e4, 1e4),
                 "top_k": (-1, 2**31 - 1)}   # the kernels' int32; any k past the vocabulary keeps every token


def kernel_values(p: SamplingParams) -> SamplingParams:
    """``p`` with every parameter in the range the float32 (and int32) kernels compute safely."""
    bounded = {name: min(max(getattr(p, name), low), high) for name, (low, high) in KERNEL_BOUNDS.items()}
    if p.temperature < GREEDY_BELOW:
        bounded["temperature"] = 0.0
    return replace(p, **bounded)


def generation_defaults(generation_config: dict[str, Any], config: dict[str, Any],
                        server_temperature: float | None) -> GenerationDefaults:
    """The defaults from a model's generation_config.json and config.json (as parsed dicts).
    Raises StartupError naming the file and field when a value has the wrong type."""
    embedded = config.get("generation_config")
    files = [("generation_config.json", generation_config),
             ("config.json", embedded if isinstance(embedded, dict) else {}),
             ("config.json", config)]
    values: dict[str, Any] = dict(NEUTRAL)
    sources = dict.fromkeys(DEFAULT_FIELDS, "lse_default")
    for name in NEUTRAL:
        for source, data in files:
            value = _file_value(data, name, source)
            if value is not None:
                values[name], sources[name] = value, source
                break
    for name in LIMIT_FIELDS:
        values[name] = _file_value(generation_config, name, "generation_config.json")
        if values[name] is not None:
            sources[name] = "generation_config.json"
    if server_temperature is not None:
        values["temperature"], sources["temperature"] = float(server_temperature), "server_option"
    return GenerationDefaults(**values, sources=sources)


def resolve_sampling(request: GenerationRequest, defaults: GenerationDefaults) -> SamplingParams:
    """The request's sampling fields, each falling back to the model's default. A positive
    frequency_penalty becomes repetition_penalty 1 + frequency_penalty unless repetition_penalty is sent."""
    repetition_penalty = request.repetition_penalty
    if repetition_penalty is None and request.frequency_penalty is not None and request.frequency_penalty > 0:
        repetition_penalty = 1.0 + request.frequency_penalty
    top_k = defaults.top_k if request.top_k is None else request.top_k
    return SamplingParams(
        temperature=_first(request.temperature, defaults.temperature),
        top_k=max(top_k, 0),   # -1 means off, as 0 does
        top_p=_first(request.top_p, defaults.top_p),
        min_p=_first(request.min_p, defaults.min_p),
        repetition_penalty=_first(repetition_penalty, defaults.repetition_penalty),
        presence_penalty=_first(request.presence_penalty, defaults.presence_penalty),
        seed=request.seed,
    )


def _first(sent: float | None, default: float) -> float:
    return float(default if sent is None else sent)


def _file_value(data: dict[str, Any], name: str, source: str) -> float | int | None:
    """The value a model file sets for a field, or None when it sets none."""
    if name == "temperature" and data.get("do_sample") is False:
        return 0.0
    value = data.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not _finite(value):
        raise StartupError(f"{source}: {name} must be a number, got {value!r:.40}")
    if name == "top_k" or name in LIMIT_FIELDS:
        if value != int(value):
            raise StartupError(f"{source}: {name} must be an integer, got {value!r:.40}")
        if name in LIMIT_FIELDS and value < 1:
            raise StartupError(f"{source}: {name} must be a positive integer, got {value!r:.40}")
        return max(int(value), 0) if name == "top_k" else int(value)
    return float(value)


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:   # an int too large for a float
        return False
