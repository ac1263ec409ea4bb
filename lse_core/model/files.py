"""A Hugging Face checkpoint directory -> Model: config.json, safetensors (single or sharded),
tokenizer.json + tokenizer_config.json, generation_config.json and the chat template.

Every missing or malformed file raises StartupError naming the file and what is wrong with it;
tensor shapes are checked against config.json by the architecture builder (arch/llama.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers

from lse_core.devices.host_memory import release_freed_heap
from lse_core.errors import StartupError
from lse_core.model.model import Model
from lse_core.model.tokenizer import Tokenizer

# safetensors dtypes a checkpoint may store its weights in (BF16 is read as the top half of a
# float32); all become float32 on load but U8, the bytes of packed weights (gpt-oss's MXFP4 experts).
_NUMPY_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "F64": np.dtype("<f8"), "BF16": np.dtype("<u2"),
                 "U8": np.dtype("u1")}
_MAX_HEADER_BYTES = 100 << 20   # the safetensors library's own cap on the JSON header


def load_hf(path: str) -> Model:
    root = Path(path)
    config_file = root / "config.json"
    if not config_file.is_file():
        raise StartupError(f"{root}: no config.json (not a Hugging Face checkpoint directory)")
    config = _read_json(config_file)
    generation_config = _read_json(root / "generation_config.json", missing={})
    return Model(
        source=str(root),
        config=config,
        weights=_load_weights(root),
        tokenizer=_load_tokenizer(root, config, generation_config),
        generation_config=generation_config,
        **_chat_template(root),
    )


def _read_json(file: Path, missing: dict | None = None) -> dict[str, Any]:
    """The JSON object in ``file``; ``missing`` when the file is absent (None: absence is an error)."""
    if not file.is_file():
        if missing is not None:
            return missing
        raise StartupError(f"{file}: file not found")
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise StartupError(f"{file}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except UnicodeDecodeError as e:
        raise StartupError(f"{file}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not isinstance(value, dict):
        raise StartupError(f"{file}: expected a JSON object, found {type(value).__name__}")
    return value


def _load_weights(root: Path) -> dict[str, np.ndarray]:
    index_file = root / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map = _read_json(index_file).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise StartupError(f"{index_file}: no weight_map object naming the shards")
        shards = list(dict.fromkeys(weight_map.values()))
    elif (root / "model.safetensors").is_file():
        weight_map, shards = None, ["model.safetensors"]
    else:
        raise StartupError(f"{root}: no model.safetensors or model.safetensors.index.json")

    weights: dict[str, np.ndarray] = {}
    for shard in shards:
        file = root / shard
        if not file.is_file():
            raise StartupError(f"{file}: shard listed in {index_file.name} is missing")
        weights.update(_read_safetensors(file))
    if weight_map is not None:
        absent = [name for name in weight_map if name not in weights]
        if absent:
            raise StartupError(f"{index_file}: tensor {absent[0]!r} is not in its shard {weight_map[absent[0]]}")
    return weights


def _read_safetensors(file: Path) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file: an 8-byte little-endian header length, the JSON header
    ({name: {dtype, shape, data_offsets: [begin, end]}}, offsets from the end of the header), the data.
    The header is checked against the file's size before any of it is used."""
    data = file.read_bytes()

    def error(what: str) -> StartupError:
        return StartupError(f"{file}: not a valid safetensors file: {what}")

    if len(data) < 8:
        raise error(f"{len(data)} bytes, shorter than the 8-byte header length (the file is truncated)")
    header_bytes = int.from_bytes(data[:8], "little")
    if header_bytes > _MAX_HEADER_BYTES:
        raise error(f"the header length {header_bytes} is over {_MAX_HEADER_BYTES} bytes (the file is corrupt)")
    if header_bytes > len(data) - 8:
        raise error(f"the {header_bytes}-byte header ends past the file's end ({len(data)} bytes): "
                    "the file is truncated or corrupt")
    try:
        header = json.loads(data[8:8 + header_bytes].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise error(f"the header is not JSON text ({e})") from None
    if not isinstance(header, dict):
        raise error(f"the header is a JSON {type(header).__name__}, not an object")
    body = memoryview(data)[8 + header_bytes:]
    return {name: _tensor(error, name, entry, body) for name, entry in header.items() if name != "__metadata__"}


def _tensor(error: Callable[[str], StartupError], name: str, entry: Any, body: memoryview) -> np.ndarray:
    """One header entry's tensor as float32 (U8 as bytes), its dtype, shape and offsets checked against the data."""
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise error(f"tensor {name!r} is not an object of dtype, shape and data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in _NUMPY_DTYPES:
        raise error(f"tensor {name!r} has dtype {dtype!r}; LSE reads F32, F16, BF16, F64 and U8")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise error(f"tensor {name!r} has shape {shape!r}, not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= len(body)):
        raise error(f"tensor {name!r} has data_offsets {offsets!r}, not [begin, end] within the "
                    f"{len(body)} bytes of data (the file is truncated or corrupt)")
    begin, end = offsets
    itemsize = _NUMPY_DTYPES[dtype].itemsize
    if end - begin != math.prod(shape) * itemsize:
        raise error(f"tensor {name!r} has {end - begin} bytes of data, but its shape {shape} in {dtype} "
                    f"takes {math.prod(shape) * itemsize}")
    array = np.frombuffer(body[begin:end], _NUMPY_DTYPES[dtype]).reshape(shape)
    if dtype == "BF16":   # bfloat16 is the top half of a float32: widen the bits, exactly
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array if array.dtype in (np.float32, np.uint8) else array.astype(np.float32)


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    """eos_token_id as config files write it: an int, a list of ints, or null."""
    if isinstance(value, int):
        return [value]
    return [v for v in value if isinstance(v, int)] if isinstance(value, list) else []


def _load_tokenizer(root: Path, config: dict[str, Any], generation_config: dict[str, Any]) -> Tokenizer:
    tokenizer_file = root / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise StartupError(f"{root}: no tokenizer.json (LSE reads the fast-tokenizer file)")
    try:
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    except Exception as e:  # tokenizers raises a bare Exception for malformed files
        raise StartupError(f"{tokenizer_file}: not a valid tokenizers file: {e}") from None
    release_freed_heap()   # what parsing tokenizer.json freed (hundreds of MiB for a large vocabulary)

    tokenizer_config_file = root / "tokenizer_config.json"
    tokenizer_config = _read_json(tokenizer_config_file, missing={})
    decoder = tokenizer_config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        raise StartupError(f"{tokenizer_config_file}: added_tokens_decoder must be an object of id -> token")
    # Tokens the config declares but tokenizer.json lacks are added, as transformers does.
    for token_id, entry in decoder.items():
        content = _token_content(entry)
        if not isinstance(entry, dict) or content is None or not str(token_id).isdigit():
            raise StartupError(f"{tokenizer_config_file}: added_tokens_decoder entry {token_id!r} is not "
                               f'{{"content": ..., "special": ...}} under a token id')
        if backend.token_to_id(content) is None:
            is_special = bool(entry.get("special"))
            add = backend.add_special_tokens if is_special else backend.add_tokens
            add([tokenizers.AddedToken(content, special=is_special)])

    special = {}
    for key, value in tokenizer_config.items():
        if key.endswith("_token") and key not in ("bos_token", "eos_token"):
            content = _token_content(value)
            if content is not None:
                special[key] = content
    bos_token = _token_content(tokenizer_config.get("bos_token"))
    eos_token = _token_content(tokenizer_config.get("eos_token"))

    eos_id = backend.token_to_id(eos_token) if eos_token is not None else None
    eos_ids = ([eos_id] if eos_id is not None else []) + _ids(config.get("eos_token_id")) \
        + _ids(generation_config.get("eos_token_id"))
    return Tokenizer(backend, tuple(dict.fromkeys(eos_ids)), bos_token, eos_token, special)


def _chat_template(root: Path) -> dict[str, str | None]:
    """The template in the spec's order: chat_template.jinja, tokenizer_config.json's
    chat_template (a string, or the list entry named "default"), then chat_template.json."""
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            return {"chat_template": jinja_file.read_text(encoding="utf-8"), "chat_template_source": str(jinja_file)}
        except UnicodeDecodeError as e:
            raise StartupError(f"{jinja_file}: not UTF-8 text ({e.reason} at byte {e.start})") from None

    tokenizer_config_file = root / "tokenizer_config.json"
    template = _read_json(tokenizer_config_file, missing={}).get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        if "default" not in named:
            raise StartupError(f"{tokenizer_config_file}: chat_template is a list with no entry named 'default' "
                               f"(names: {', '.join(map(str, named))})")
        template = named["default"]
    if template is not None:
        if not isinstance(template, str):
            raise StartupError(f"{tokenizer_config_file}: chat_template must be a string or a list of "
                               f"{{name, template}} objects")
        return {"chat_template": template, "chat_template_source": str(tokenizer_config_file)}

    json_file = root / "chat_template.json"
    template = _read_json(json_file, missing={}).get("chat_template")
    if template is not None:
        if not isinstance(template, str):
            raise StartupError(f"{json_file}: chat_template must be a string")
        return {"chat_template": template, "chat_template_source": str(json_file)}
    return {"chat_template": None, "chat_template_source": None}
