"""Micro-benchmark: the jit device's quantized linears (lse_backends.jit.quant.linear) on SmolLM2-135M's
shapes, with synthetic weights.

30 layers of Q4_1 q/k/v/o/gate/up/down (hidden 576, 3 kv heads of 64, FFN 1536) and the tied Q8_0 output
projection (vocab 49152): 96 MB of weights a decoded token reads. Reports, for each thread count, the
ms/token of all one token's layer GEMVs (with and without the output layer) and the prefill tok/s of
the layer GEMMs for each chunk size; medians of wall time, and of the process's CPU time (all threads,
spinning included: on a shared machine the steadier figure for one thread).

    python benchmarks/gemv_q4.py [--threads 1,2] [--chunks 128,512] [--repeat 20]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numba
import numpy as np

import lse_backends.jit.quant as quant

HIDDEN, KV, FFN, VOCAB, LAYERS = 576, 192, 1536, 49152, 30
LAYER_SHAPES = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (FFN, HIDDEN), (FFN, HIDDEN),
                (HIDDEN, FFN)]


def synthetic_weight(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> tuple[int, np.ndarray]:
    """Random quants with small, valid f16 scales (and mins) in every block, prepared for ``linear``."""
    block_bytes, header_bytes = quant.LAYOUT[quant.KINDS[qtype]]
    blocks = rng.integers(0, 256, size=(rows, cols // quant.BLOCK, block_bytes), dtype=np.uint8)
    header = rng.uniform(-0.02, 0.02, size=(rows, cols // quant.BLOCK, header_bytes // 2)).astype(np.float16)
    blocks[:, :, :header_bytes] = header.view(np.uint8)
    return quant.prepare(qtype, blocks.reshape(rows, -1))


def median_seconds(run: Callable[[], None], repeat: int) -> tuple[float, float]:
    """Median wall and CPU seconds of one run()."""
    wall, cpu = [], []
    for _ in range(repeat):
        start, start_cpu = time.perf_counter(), time.process_time()
        run()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return float(np.median(wall)), float(np.median(cpu))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", default=f"1,{numba.config.NUMBA_NUM_THREADS}",
                        help="thread counts to run, each at most NUMBA_NUM_THREADS")
    parser.add_argument("--chunks", default="128,512", help="prefill rows per step")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    chunks = [int(c) for c in args.chunks.split(",")]
    rng = np.random.default_rng(0)
    layers = [synthetic_weight("Q4_1", rows, cols, rng) for _ in range(LAYERS) for rows, cols in LAYER_SHAPES]
    output = synthetic_weight("Q8_0", VOCAB, HIDDEN, rng)
    inputs = {n: rng.standard_normal((max(chunks), n)).astype(np.float32) for n in (HIDDEN, FFN)}
    outputs = {rows: np.empty((max(chunks), rows), np.float32) for rows in (HIDDEN, KV, FFN, VOCAB)}

    def step(n_tokens: int, with_output: bool) -> None:
        for kind, blocks in layers:
            n_in = blocks.shape[1] // quant.LAYOUT[kind][0] * quant.BLOCK
            quant.linear(kind, blocks, inputs[n_in][:n_tokens], outputs[blocks.shape[0]][:n_tokens])
        if with_output:
            quant.linear(*output, inputs[HIDDEN][:1], outputs[VOCAB][:1])

    start = time.perf_counter()
    step(1, True)
    print(f"numba {numba.__version__} ({numba.threading_layer()}), AVX2 path {quant.AVX2}, "
          f"first call (compile or cache load) {time.perf_counter() - start:.2f} s")
    for threads in (int(t) for t in args.threads.split(",")):
        numba.set_num_threads(threads)
        step(max(chunks), False)  # warm the threads and the caches
        for name, with_output in (("layer GEMVs", False), ("layer GEMVs + output", True)):
            wall, cpu = median_seconds(lambda w=with_output: step(1, w), args.repeat)
            print(f"{threads} thread(s), decode {name}: {1e3 * wall:.2f} ms/token wall, {1e3 * cpu:.2f} ms CPU")
        for chunk in chunks:
            wall, cpu = median_seconds(lambda c=chunk: step(c, False), max(2, args.repeat // 5))
            print(f"{threads} thread(s), prefill layer GEMMs, chunk {chunk}: {chunk / wall:.0f} tok/s wall "
                  f"({1e3 * wall / chunk:.3f} ms/token), {1e3 * cpu / chunk:.3f} ms CPU/token")


if __name__ == "__main__":
    main()
