"""GGUF -> Model: the header read and checked by gguf_file.py, the tensors memory-mapped.

The file's metadata becomes a Hugging Face-style config dict, its tensors get Hugging Face names and
shapes, so architecture files see what an HF directory gives them. Quantized matrices stay in their
GGUF blocks (QuantTensor); F32/F16/BF16 tensors become float32.

What is slow is building the tokenizer (rebuilding a SentencePiece vocabulary's merges: ~5 s);
tensor data is only memory-mapped. So the parsed header (config, tokenizer, template, tensor table)
is cached under ``$LSE_CACHE_DIR`` (default ``~/.cache/lse``)/gguf/<content key>.json: a cached
import of SmolLM2 takes ~0.3 s. Tensors are read from the file through one read-only mmap either way.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
from tqdm import tqdm

from lse_core.devices.host_memory import release_freed_heap
from lse_core.errors import StartupError

from .gguf_file import GGUFTensor, read_gguf_header
from .gguf_tokenizer import build_tokenizer
from .model import QUANT_BLOCKS, Model, QuantTensor, Weight
from .tokenizer import Tokenizer

CACHE_FORMAT = 5   # part of the cache key: bump it whenever the header's content or its checks change
ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", "qwen3moe", "gpt-oss")
# llama.cpp's architecture name -> config.json's model_type (the architecture file's name), where they differ
_MODEL_TYPES = {"qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss"}
FLOAT_TYPES = ("F32", "F16", "BF16")
ROPE_FACTORS = "rope_freqs.weight"   # Llama 3's rope scaling, as a divisor per frequency

# GGUF tensor name -> Hugging Face name ({} is the layer index).
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # mixtures of experts: the router, and each projection of every expert as one [experts, out, in] tensor
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
# Gemma's sandwich norms: its ffn_norm is the pre-FFN norm.
_GEMMA3_LAYER_NAMES = _LAYER_NAMES | {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# gpt-oss: its router and sinks by their Hugging Face names; post_attention_norm is its pre-FFN norm
_GPT_OSS_LAYER_NAMES = _LAYER_NAMES | {
    "ffn_gate_inp": "mlp.router",
    "attn_sinks": "self_attn.sinks",
    "post_attention_norm": "post_attention_layernorm",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

# generation_config fields llama.cpp's converter stores under general.sampling.*
_SAMPLING_KEYS = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                  "penalty_repeat": "repetition_penalty"}


def load_gguf(path: str) -> Model:
    """Import a .gguf file; raises StartupError for a file LSE cannot read or run."""
    path = os.path.abspath(path)
    # the content key reads the file first: one still being written (a FIFO, a slow mount) is waited for here
    cache_file = _cache_dir() / f"{content_key(path)}.json"
    if os.path.getsize(path) == 0:   # mmap refuses an empty file
        raise StartupError(f"{path}: the file is empty")
    with open(path, "rb") as file:
        mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    header = _cached_header(cache_file, path, mapping)
    config = header["config"]
    saved = header["tokenizer"]
    tokenizer = Tokenizer(tokenizers.Tokenizer.from_str(saved["json"]), eos_ids=tuple(saved["eos_ids"]),
                          bos_token=saved["bos_token"], eos_token=saved["eos_token"], special=saved["special"])
    release_freed_heap()   # what parsing the tokenizer's JSON freed (hundreds of MiB for a large vocabulary)
    return Model(source=path, config=config, weights=_read_weights(mapping, path, config, header["tensors"]),
                 mapping=mapping, tokenizer=tokenizer, generation_config=header["generation_config"],
                 chat_template=header["chat_template"],
                 chat_template_source=path if header["chat_template"] is not None else None)


# ---- header: metadata -> config, tokenizer, template, tensor table (cached) ----

def _cached_header(cache_file: Path, path: str, mapping: mmap.mmap) -> dict[str, Any]:
    try:
        return json.loads(cache_file.read_text())
    except (OSError, ValueError):
        pass
    header = _read_header(path, mapping)
    try:  # a cache that cannot be written only costs the next start its seconds
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        partial = cache_file.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(header))
        os.replace(partial, cache_file)
    except OSError:
        pass
    return header


def _cache_dir() -> Path:
    return Path(os.environ.get("LSE_CACHE_DIR") or Path.home() / ".cache" / "lse") / "gguf"


def content_key(path: str, head_bytes: int = 32 << 20, samples: int = 16, sample_bytes: int = 64 << 10) -> str:
    """A cheap key for a file's content: its size, its first 32 MiB (the whole metadata of any
    usual file, where in-place metadata edits land) and evenly spaced samples of the rest."""
    digest = hashlib.sha256(f"lse-gguf-{CACHE_FORMAT}".encode())
    size = os.path.getsize(path)
    digest.update(str(size).encode())
    with open(path, "rb") as f:
        digest.update(f.read(head_bytes))
        for i in range(samples):
            f.seek(head_bytes + (size - head_bytes) * i // samples if size > head_bytes else size)
            digest.update(f.read(sample_bytes))
    return digest.hexdigest()


def _read_header(path: str, mapping: mmap.mmap) -> dict[str, Any]:
    with tqdm(total=2, desc=f"importing {os.path.basename(path)}", unit="step", disable=None) as bar:
        bar.set_postfix_str("metadata")
        header = read_gguf_header(path, mapping)
        meta, tensors = header.metadata, header.tensors
        _check_metadata(meta, path)
        config = _config(meta, {t.name: t.dims for t in tensors}, path)
        factors = next((t for t in tensors if t.name == ROPE_FACTORS), None)
        if factors is not None:
            config["rope_scaling"] = _rope_factors(config.get("rope_scaling"), factors, mapping, path)
            tensors = [t for t in tensors if t.name != ROPE_FACTORS]
        for name, qtype, *_ in tensors:
            if qtype not in FLOAT_TYPES and qtype not in QUANT_BLOCKS:
                raise StartupError(f"{path}: tensor {name} has type {qtype}, which LSE does not support "
                                   f"(supported: {', '.join(FLOAT_TYPES + tuple(QUANT_BLOCKS))})")
        bar.update()
        bar.set_postfix_str("tokenizer")
        tokenizer = build_tokenizer(meta, path)
        bar.update()
    generation_config = {hf: meta[f"general.sampling.{key}"] for key, hf in _SAMPLING_KEYS.items()
                         if f"general.sampling.{key}" in meta}
    return {
        "config": config,
        "tokenizer": {"json": tokenizer.backend.to_str(), "eos_ids": list(tokenizer.eos_ids),
                      "bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token,
                      "special": tokenizer.special},
        "chat_template": meta.get("tokenizer.chat_template"),
        "generation_config": generation_config,
        "tensors": tensors,
    }


# (check, what it wants) for the metadata values LSE reads
_COUNT = (lambda v: type(v) is int and v > 0, "a positive integer")
_INDEX = (lambda v: type(v) is int and v >= 0, "a non-negative integer")
_NUMBER = (lambda v: type(v) in (int, float), "a number")
_STRING = (lambda v: type(v) is str, "a string")
_FLAG = (lambda v: type(v) is bool, "a bool")
_STRINGS = (lambda v: type(v) is list and all(type(x) is str for x in v), "a list of strings")
_INDICES = (lambda v: type(v) is list and all(type(x) is int and x >= 0 for x in v), "a list of integers")
_WINDOW_PATTERN = (lambda v: _COUNT[0](v) or (type(v) is list and all(type(x) in (bool, int) for x in v)),
                   "a positive integer (every n-th layer global) or a flag per layer")

# The metadata LSE reads ({} is the architecture) and what each value must be: a value of another type
# is refused here, not met later as a TypeError or a division by zero.
_METADATA_TYPES: dict[str, tuple[Any, str]] = {
    "general.architecture": _STRING,
    "{}.block_count": _COUNT,
    "{}.context_length": _COUNT,
    "{}.embedding_length": _COUNT,
    "{}.feed_forward_length": _COUNT,
    "{}.attention.head_count": _COUNT,
    "{}.attention.head_count_kv": _COUNT,
    "{}.attention.key_length": _COUNT,
    "{}.rope.dimension_count": _COUNT,
    "{}.attention.layer_norm_rms_epsilon": _NUMBER,
    "{}.rope.freq_base": _NUMBER,
    "{}.rope.freq_base_swa": _NUMBER,
    "{}.rope.scaling.type": _STRING,
    "{}.rope.scaling.factor": _NUMBER,
    "{}.rope.scaling.original_context_length": _COUNT,
    "{}.pooling_type": _INDEX,
    "{}.attention.sliding_window": _INDEX,
    "{}.attention.sliding_window_pattern": _WINDOW_PATTERN,
    "{}.expert_count": _COUNT,
    "{}.expert_used_count": _COUNT,
    "{}.expert_feed_forward_length": _COUNT,
    "{}.expert_weights_norm": _FLAG,
    "tokenizer.ggml.model": _STRING,
    "tokenizer.ggml.pre": _STRING,
    "tokenizer.ggml.tokens": _STRINGS,
    "tokenizer.ggml.token_type": _INDICES,
    "tokenizer.ggml.merges": _STRINGS,
    "tokenizer.ggml.add_bos_token": _FLAG,
    "tokenizer.ggml.add_eos_token": _FLAG,
    "tokenizer.ggml.add_space_prefix": _FLAG,
    "tokenizer.chat_template": _STRING,
    **{f"tokenizer.ggml.{name}_token_id": _INDEX
       for name in ("bos", "eos", "eot", "eom", "padding", "unknown")},
    **{f"general.sampling.{key}": _NUMBER for key in _SAMPLING_KEYS},
}


def _check_metadata(meta: dict[str, Any], path: str) -> None:
    if not meta.get("tokenizer.ggml.tokens"):
        raise StartupError(f"{path}: metadata has no tokenizer.ggml.tokens (the vocabulary)")
    arch = meta.get("general.architecture")
    for pattern, (is_valid, expected) in _METADATA_TYPES.items():
        key = pattern.format(arch)
        if key in meta and not is_valid(meta[key]):
            value = meta[key]
            shown = f"a list of {len(value)}" if isinstance(value, list) else repr(value)[:60]
            raise StartupError(f"{path}: metadata {key} is {shown}, expected {expected}")


def _config(meta: dict[str, Any], tensor_dims: dict[str, list[int]], path: str) -> dict[str, Any]:
    """Hugging Face config.json fields from llama.cpp's metadata keys."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise StartupError(f"{path}: architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    hidden, heads = key("embedding_length"), key("attention.head_count")
    if hidden is None or heads is None or key("block_count") is None:
        raise StartupError(f"{path}: metadata lacks {arch}.embedding_length, .block_count or .attention.head_count")
    if hidden < heads:
        raise StartupError(f"{path}: metadata {arch}.embedding_length {hidden} is less than its "
                           f"{heads} attention heads")
    if key("block_count") > len(tensor_dims):   # each layer has tensors of its own
        raise StartupError(f"{path}: metadata {arch}.block_count is {key('block_count')}, but the file has "
                           f"{len(tensor_dims)} tensors")
    # Each width is some tensor's dimension (the architecture checks which); one larger than all of them is
    # refused before anything is sized by it (rope tables, say).
    widest = max((d for dims in tensor_dims.values() for d in dims), default=0)
    for width in ("embedding_length", "feed_forward_length", "attention.head_count", "attention.head_count_kv",
                  "attention.key_length", "rope.dimension_count", "expert_count", "expert_feed_forward_length"):
        if (key(width) or 0) > widest:
            raise StartupError(f"{path}: metadata {arch}.{width} is {key(width)}, more than any tensor "
                               f"dimension in the file ({widest})")
    config: dict[str, Any] = {
        "model_type": _MODEL_TYPES.get(arch, arch),
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": key("attention.key_length") or key("rope.dimension_count") or hidden // heads,
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": key("rope.freq_base", 10000.0),
        "max_position_embeddings": key("context_length", 4096),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        # llama.cpp writes the output matrix only when it is not the embedding table
        "tie_word_embeddings": "output.weight" not in tensor_dims,
        # HF's attention_bias puts biases on q, k, v and o; Qwen2's q/k/v-only biases need no flag
        "attention_bias": "blk.0.attn_output.bias" in tensor_dims,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    scaling = key("rope.scaling.type")
    if scaling in ("linear", "yarn") and key("rope.scaling.factor") is None:
        raise StartupError(f"{path}: {scaling} rope scaling without {arch}.rope.scaling.factor")
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": key("rope.scaling.factor")}
    elif scaling == "yarn":   # YaRN as gpt-oss trained with it (no truncated correction range)
        if key("rope.scaling.original_context_length") is None:
            raise StartupError(f"{path}: yarn rope scaling without {arch}.rope.scaling.original_context_length")
        config["rope_scaling"] = {"rope_type": "yarn", "factor": key("rope.scaling.factor"), "beta_fast": 32.0,
                                  "beta_slow": 1.0, "truncate": False,
                                  "original_max_position_embeddings": key("rope.scaling.original_context_length")}
    elif scaling not in (None, "none"):
        raise StartupError(f"{path}: rope scaling {scaling!r} is not supported (none, linear, yarn)")
    if key("pooling_type") is not None:   # an embedding model's: llama.cpp's enum (1 mean, 2 cls, 3 last)
        config["pooling_type"] = key("pooling_type")
    if arch == "gemma3":
        config |= _gemma3_config(config, key, path)
    if arch in ("qwen3moe", "gpt-oss"):
        config |= _experts_config(config, key, tensor_dims, path)
    if arch == "gpt-oss":   # llama.cpp's: every other layer, from the first, attends through the window
        config |= {"sliding_window": key("attention.sliding_window", 128), "num_local_experts": config["num_experts"],
                   "intermediate_size": config["moe_intermediate_size"],
                   "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                                   for i in range(config["num_hidden_layers"])]}
    return config


def _rope_factors(scaling: dict[str, Any] | None, factors: GGUFTensor, mapping: mmap.mmap,
                  path: str) -> dict[str, Any]:
    """rope_freqs.weight: a divisor per rotary frequency, what llama.cpp's converter writes for
    Llama 3's rope scaling; a linear factor in the metadata divides every frequency as well."""
    if factors.qtype != "F32" or len(factors.dims) != 1:
        raise StartupError(f"{path}: {ROPE_FACTORS} must be a float32 vector, got {factors.qtype} {factors.dims}")
    linear = float(scaling["factor"]) if scaling else 1.0
    values = np.frombuffer(mapping, np.float32, factors.dims[0], factors.offset)
    return {"rope_type": "freq_factors", "factors": [float(f) * linear for f in values]}


def _gemma3_config(config: dict[str, Any], key: Any, path: str) -> dict[str, Any]:
    """What Gemma 3 adds; llama.cpp's defaults where the file is silent (as in the 270M file)."""
    layers = config["num_hidden_layers"]
    pattern = key("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):   # one flag per layer, true = sliding
        if len(pattern) != layers:
            raise StartupError(f"{path}: metadata gemma3.attention.sliding_window_pattern has {len(pattern)} "
                               f"flags for {layers} layers")
        sliding = [bool(p) for p in pattern]
    else:                           # every pattern-th layer is global
        sliding = [(i + 1) % pattern != 0 for i in range(layers)]
    return {
        "sliding_window": key("attention.sliding_window", 4096),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "rope_local_base_freq": key("rope.freq_base_swa", 10000.0),
        "query_pre_attn_scalar": config["head_dim"],
        "hidden_activation": "gelu_pytorch_tanh",
    }


def _experts_config(config: dict[str, Any], key: Any, tensor_dims: dict[str, list[int]],
                    path: str) -> dict[str, Any]:
    """A mixture's experts. llama.cpp always renormalises Qwen3-MoE's chosen experts' weights (transformers reads
    these files so too); a layer without a router (ffn_gate_inp) is a dense one."""
    arch = config["model_type"]
    if key("expert_count") is None or key("expert_used_count") is None:
        raise StartupError(f"{path}: metadata lacks {arch}'s expert_count or expert_used_count")
    width = key("expert_feed_forward_length") or config["intermediate_size"]
    if width is None:
        raise StartupError(f"{path}: metadata lacks {arch}'s expert_feed_forward_length")
    return {
        "num_experts": key("expert_count"),
        "num_experts_per_tok": key("expert_used_count"),
        "moe_intermediate_size": width,
        "intermediate_size": config["intermediate_size"] or width,
        "norm_topk_prob": key("expert_weights_norm", True),
        "mlp_only_layers": [i for i in range(config["num_hidden_layers"])
                            if f"blk.{i}.ffn_gate_inp.weight" not in tensor_dims],
    }


# ---- tensors ----

def _read_weights(mapping: mmap.mmap, path: str, config: dict[str, Any], table: list[Any]) -> dict[str, Weight]:
    arch = config["model_type"]
    layer_names = {"gemma3": _GEMMA3_LAYER_NAMES, "gpt_oss": _GPT_OSS_LAYER_NAMES}.get(arch, _LAYER_NAMES)
    data = np.frombuffer(mapping, np.uint8)  # read-only arrays over the mapping
    weights: dict[str, Weight] = {}
    for name, qtype, gguf_shape, offset, nbytes in table:
        hf_name = _hf_name(name, layer_names, path)
        tensor = _tensor(data[offset:offset + nbytes], qtype, tuple(reversed(gguf_shape)))
        if arch == "llama" and ".attn_q." in name:
            tensor = _unpermute_rows(tensor, config["num_attention_heads"], name, path)
        elif arch == "llama" and ".attn_k." in name:
            tensor = _unpermute_rows(tensor, config["num_key_value_heads"], name, path)
        elif arch == "gemma3" and name.endswith("norm.weight"):
            # llama.cpp stores Gemma's (1 + w) norm weights with the 1 added; HF keeps w
            tensor = tensor - np.float32(1.0)
        elif name.endswith(".attn_sinks.weight"):   # a parameter of its own in HF, with no .weight
            hf_name = hf_name.removesuffix(".weight")
        weights[hf_name] = tensor
    return weights


def _hf_name(name: str, layer_names: dict[str, str], path: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER_TENSOR.fullmatch(name)
    if match and match[2] in layer_names:
        return f"model.layers.{match[1]}.{layer_names[match[2]]}.{match[3]}"
    raise StartupError(f"{path}: tensor {name} has no place in this architecture")


def _tensor(raw: np.ndarray, qtype: str, shape: tuple[int, ...]) -> Weight:
    """``shape`` is numpy order (GGUF lists dimensions innermost first)."""
    if qtype == "F32":
        return raw.view(np.float32).reshape(shape)
    if qtype == "F16":
        return raw.view(np.float16).reshape(shape).astype(np.float32)
    if qtype == "BF16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    block_bytes, block_values = QUANT_BLOCKS[qtype]
    quant = QuantTensor(qtype, raw.reshape(rows, cols // block_values * block_bytes), (rows, cols))
    if len(shape) == 3:   # experts' matrices [experts, out, in]: each expert's rows back to back
        return QuantTensor(qtype, quant.data, shape)
    return quant if len(shape) == 2 else quant.dequantize().reshape(shape)


def _unpermute_rows(tensor: Weight, n_heads: int, name: str, path: str) -> Weight:
    """Undo convert_hf_to_gguf.py's ``permute`` of llama Q/K rows: within each head it interleaved
    the two rotary halves (row i of half h went to 2i + h). Rows move whole, so quantized blocks do too."""
    rows = tensor.shape[0]
    if rows % (2 * n_heads):
        raise StartupError(f"{path}: tensor {name} has {rows} rows, which do not split into {n_heads} heads "
                           "of rotary pairs")
    order = np.arange(rows).reshape(n_heads, rows // n_heads // 2, 2).swapaxes(1, 2).reshape(rows)
    if isinstance(tensor, QuantTensor):
        return QuantTensor(tensor.qtype, np.ascontiguousarray(tensor.data[order]), tensor.shape)
    return np.ascontiguousarray(tensor[order])
