"""Decode @1 on jit:0 against the read bandwidth of the same threads.

The ceiling is a read-only stream: a numba parallel sum over a 512 MiB array on the engine's threads (the
best of several; a decode step only reads its weights, so compare.py's copy, read plus write, is not its
bound). Bytes per token are the weights a decode step reads as jit:0 holds them (every linear's weight once,
a tied embedding once as the output layer; the K types and Q5_1 as their converted blocks), and
as the file stores them. Each round measures the stream, then decodes --tokens tokens one step at a time
after a prompt of --context tokens; medians of the rounds. Where the rest goes: benchmarks/profile_step.py.

    NUMBA_NUM_THREADS=2 python benchmarks/decode_bandwidth.py -m model.gguf [--rounds 3] [--tokens 32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numba
import numpy as np
from numba import njit, prange
from profile_step import step_of

from lse_backends.jit import JitDevice, program
from lse_core.devices.hookspec import CompileContext
from lse_core.graph.plan import Plan
from lse_core.model.arch import build_graph
from lse_core.model.default import load_model
from lse_core.model.model import QuantTensor


@njit(parallel=True, fastmath=True, cache=True)
def _stream_sum(values: np.ndarray) -> float:
    total = 0.0
    for i in prange(values.size):
        total += values[i]
    return total


def read_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """GB/s of the best of ``repeats`` parallel sums over ``mib`` MiB of float32 (the bytes read)."""
    values = np.ones(mib * 2**20 // 4, np.float32)
    _stream_sum(values)
    best = min(_timed(lambda: _stream_sum(values)) for _ in range(repeats))
    return values.nbytes / best / 1e9


def _timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def weight_bytes(kernel: program.Program) -> int:
    """Bytes of the weights the linked program's linears read, each weight once."""
    seen: set[tuple[str, int]] = set()
    for row in kernel.code:
        if row[0] == program.LINEAR_Q:
            seen.update(("qmats", row[program._weight_arg(part)]) for part in range(program._parts(row)))
        elif row[0] == program.LINEAR:
            seen.add(("mats", row[program.ARG]))
    return sum(kernel.resources[kind][index].nbytes for kind, index in seen)


def stored_bytes(weights: dict) -> int:
    """Bytes of the matrices a decode token reads as the file stores them: an embedding table only where it
    is tied (the output layer reads it whole; a lookup reads one row)."""
    matrices = {name: w for name, w in weights.items() if len(w.shape) == 2}
    if "lm_head.weight" in matrices:
        matrices.pop("model.embed_tokens.weight", None)
    return sum(w.data.nbytes if isinstance(w, QuantTensor) else w.nbytes for w in matrices.values())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-m", "--model", default=None)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model = load_model(args.model)
    plan = Plan.build(build_graph(model), [JitDevice()], CompileContext(1, args.context + args.tokens + 8, 64),
                      None, False)
    (linked,) = [s for s in plan.stages if len(s.placements) > 1]
    read = weight_bytes(linked.kernel)
    stored = stored_bytes(model.weights)
    prompt = list(range(100, 100 + args.context))
    bandwidths, rates = [], []
    for _ in range(args.rounds):
        bandwidths.append(read_bandwidth())
        plan.run(step_of([(0, prompt, 0)]))
        seconds = _timed(lambda: [plan.run(step_of([(0, [42], args.context + i)])) for i in range(args.tokens)])
        rates.append(args.tokens / seconds)
    bandwidth, rate = statistics.median(bandwidths), statistics.median(rates)
    print(f"{numba.get_num_threads()} threads; read bandwidth {bandwidth:.1f} GB/s (rounds: "
          f"{', '.join(f'{b:.1f}' for b in bandwidths)})")
    print(f"weights a decode token reads: {read / 1e6:.0f} MB as jit:0 holds them, {stored / 1e6:.0f} MB as stored")
    print(f"decode @1: {rate:.1f} tok/s (rounds: {', '.join(f'{r:.1f}' for r in rates)}) = "
          f"{rate * read / 1e9:.1f} GB/s read, {100 * rate * read / 1e9 / bandwidth:.0f}% of the ceiling "
          f"({100 * rate * stored / 1e9 / bandwidth:.0f}% counting the stored bytes)")


if __name__ == "__main__":
    main()
