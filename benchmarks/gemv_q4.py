"""Micro-benchmark: the jit device's quantized linears on SmolLM2-135M's shapes (synthetic weights).

30 layers of Q4_1 q/k/v/o/gate/up/down (hidden 576, 3 kv heads of 64, FFN 1536) and the tied Q8_0
output projection (vocab 49152). Reports ms/token for all of one token's GEMVs (decode) and tok/s for
the GEMM-shaped path over prefill chunks, as wall time and as CPU time of the process (on a shared
machine the CPU time of a one-thread run is the steadier figure).

    OPENBLAS_NUM_THREADS=1 python benchmarks/gemv_q4.py [--chunk 512] [--repeat 20]

numba's thread count is NUMBA_NUM_THREADS (default: every core); OpenBLAS is unused here.
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np

from lse_backends.jit.quant import AVX2, BLOCK, KINDS, LAYOUT, QuantLinear

HIDDEN, KV, FFN, VOCAB, LAYERS = 576, 192, 1536, 49152, 30
LAYER_SHAPES = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (FFN, HIDDEN), (FFN, HIDDEN),
                (HIDDEN, FFN)]


def synthetic_blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random quants with small, valid f16 scales (and mins) in every block."""
    block_bytes, qs_offset, _ = LAYOUT[KINDS[qtype]]
    blocks = rng.integers(0, 256, size=(rows, cols // BLOCK, block_bytes), dtype=np.uint8)
    header = rng.uniform(-0.02, 0.02, size=(rows, cols // BLOCK, qs_offset // 2)).astype(np.float16)
    blocks[:, :, :qs_offset] = header.view(np.uint8)
    return blocks.reshape(rows, -1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--chunk", type=int, default=512, help="prefill rows per step")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    layers = [QuantLinear("Q4_1", synthetic_blocks("Q4_1", r, c, rng), None, args.chunk)
              for _ in range(LAYERS) for r, c in LAYER_SHAPES]
    output = QuantLinear("Q8_0", synthetic_blocks("Q8_0", VOCAB, HIDDEN, rng), None, 1)
    inputs = {c: rng.standard_normal((args.chunk, c)).astype(np.float32) for c in (HIDDEN, FFN)}

    def token(rows: int, with_output: bool) -> None:
        for linear in layers:
            linear(inputs[linear.n_in][:rows])
        if with_output:
            output(inputs[HIDDEN][:1])

    start = time.perf_counter()
    token(1, True)
    token(args.chunk, False)
    print(f"numba {numba.__version__}, threads {numba.get_num_threads()} ({numba.threading_layer()}), "
          f"AVX2 path {AVX2}; first calls (compile or cache load) {time.perf_counter() - start:.2f} s")

    def measure(rows: int, with_output: bool, repeat: int) -> tuple[float, float]:
        """Median wall and CPU (all threads, spinning included) seconds of one call of token()."""
        wall, cpu = [], []
        for _ in range(repeat):
            start, start_cpu = time.perf_counter(), time.process_time()
            token(rows, with_output)
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        return float(np.median(wall)), float(np.median(cpu))

    for name, with_output in (("layer GEMVs", False), ("layer GEMVs + output", True)):
        wall, cpu = measure(1, with_output, args.repeat)
        print(f"decode {name}: {1e3 * wall:.2f} ms/token wall, {1e3 * cpu:.2f} ms CPU")
    wall, cpu = measure(args.chunk, False, max(2, args.repeat // 5))
    print(f"prefill layer GEMMs, chunk {args.chunk}: {args.chunk / wall:.0f} tok/s wall "
          f"({1e3 * wall / args.chunk:.3f} ms/token), {1e3 * cpu / args.chunk:.3f} ms CPU/token")


if __name__ == "__main__":
    main()
