"""The in-memory model every loader produces and every architecture file consumes."""

from __future__ import annotations

import mmap
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Bytes per block and values per block of the GGUF quantization types LSE keeps as stored.
QUANT_BLOCKS: dict[str, tuple[int, int]] = {
    "Q4_0": (18, 32),
    "Q4_1": (20, 32),
    "Q5_0": (22, 32),
    "Q5_1": (24, 32),
    "Q8_0": (34, 32),
    "Q4_K": (144, 256),
    "Q5_K": (176, 256),
    "Q6_K": (210, 256),
    "MXFP4": (17, 32),   # gpt-oss's experts: an e8m0 exponent and 32 e2m1 values
}


@dataclass
class QuantTensor:
    """A 2-D weight kept in its GGUF block layout: row r of the logical [rows, cols] matrix is
    ``data[r]``, the row's blocks back to back. Devices with quantized kernels read the blocks
    directly; others call ``dequantize`` once at load. A mixture's experts are one 3-D weight
    [experts, out, in] whose rows are every expert's [out, in] rows, expert after expert."""

    qtype: str
    data: np.ndarray               # uint8 [rows, bytes_per_row]
    shape: tuple[int, ...]         # logical [out, in], HF layout (or [experts, out, in])

    def dequantize(self) -> np.ndarray:
        from gguf import GGMLQuantizationType, quants

        return quants.dequantize(self.data, GGMLQuantizationType[self.qtype]).astype(np.float32).reshape(self.shape)


Weight = np.ndarray | QuantTensor


@dataclass
class Model:
    """A loaded checkpoint. ``config`` is Hugging Face's config.json (GGUF imports synthesise
    one), ``weights`` uses Hugging Face tensor names, so architecture files see one layout."""

    source: str                                  # the directory or .gguf file it came from
    config: dict[str, Any]
    weights: Mapping[str, Weight]
    tokenizer: Any                               # lse_core.model.tokenizer.Tokenizer
    generation_config: dict[str, Any] = field(default_factory=dict)
    chat_template: str | None = None
    chat_template_source: str | None = None      # the file the template came from
    mapping: mmap.mmap | None = None             # the memory-mapped weight file, when weights are views of it

    def release_file_pages(self) -> None:
        """Let the OS drop the mapped file's resident pages: once devices have laid the weights out, reads
        of the mapping are rare, and a page read again is simply faulted back in from the file."""
        if self.mapping is not None and hasattr(mmap, "MADV_DONTNEED"):
            self.mapping.madvise(mmap.MADV_DONTNEED)

    @property
    def architecture(self) -> str:
        return self.config.get("model_type", "")

    @property
    def trained_context(self) -> int:
        return int(self.config.get("max_position_embeddings") or 4096)
