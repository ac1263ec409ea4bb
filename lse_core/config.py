"""LSEConfig: the one place engine options live. The CLI, the server and lse_open all fill this."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal, get_args

from typing_extensions import TypeAliasType

# What a KV cache may store keys and values as, by llama.cpp's names: f16 (the default, as llama.cpp's), q8_0
# (blocks of 32 values as int8 with one f16 scale, GGUF's Q8_0) or f32. A named alias: /openapi.json's KVCacheType.
KVCacheType = TypeAliasType("KVCacheType", Literal["f16", "q8_0", "f32"])
KV_CACHE_TYPES: tuple[str, ...] = get_args(KVCacheType.__value__)

# Speculative decoding, by llama-server's names: "none", or "ngram" (prompt lookup: the sequence's latest n-gram,
# found earlier in its own prompt and reply, proposes the tokens that followed it there).
SPEC_TYPES: tuple[str, ...] = ("none", "ngram")
DEFAULT_DRAFT_MAX = 16   # tokens proposed per step at most, llama-server's --draft-max default


@dataclass
class LSEConfig:
    model: str | None = None          # HF directory or .gguf file; None means the default model
    model_id: str | None = None       # the id requests name it by; None: from the file's name
    kv_len: int = 0                   # context length; 0 means min(model's trained context, 4096)
    max_tokens: int = 0               # operator cap on a reply; 0 means no cap
    temperature: float | None = None  # server-wide temperature default (reported as server_option)
    pool: str | None = None           # "--pool" text, e.g. "opencl:0,jit:0"; None picks devices itself
    disable_cpu_fallback: bool = False
    parallel: int = 4                 # sequences decoded together in one batch (KV slots)
    max_queue: int = 64               # requests waiting for a slot before new ones get 503
    prefill_chunk: int = 512          # prompt tokens processed per engine step
    deterministic: bool = False       # greedy output independent of prefix caching, batching and chunking
    # what the KV cache stores keys and values as: f16, q8_0 or f32 (KV_CACHE_TYPES); None: f16, or f32
    # on a device without f16 (reported at startup); a type named here that a pool device lacks fails startup
    cache_type_k: str | None = None
    cache_type_v: str | None = None
    spec_type: str = "none"           # one of SPEC_TYPES; a request's "speculative": false turns it off
    draft_max: int = DEFAULT_DRAFT_MAX   # tokens proposed per step at most
    draft_min: int = 0                # a shorter proposal is not made

    def __post_init__(self) -> None:
        if self.spec_type not in SPEC_TYPES:
            raise ValueError(f"spec_type {self.spec_type!r} is none of {', '.join(SPEC_TYPES)}")
        if not 0 <= self.draft_min <= self.draft_max:
            raise ValueError(f"draft_min (--draft-min) {self.draft_min} and draft_max (--draft-max) "
                             f"{self.draft_max}: a proposal's least and most tokens, 0 <= least <= most")

    @property
    def cpu_fallback_refused(self) -> bool:
        """The option, or the older LSE_REQUIRE_DEVICE_KERNELS=1 switch (never overridden by its absence)."""
        return self.disable_cpu_fallback or os.environ.get("LSE_REQUIRE_DEVICE_KERNELS") == "1"
