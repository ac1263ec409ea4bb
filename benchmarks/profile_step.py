"""Where one decode step's (or a prefill chunk's) time goes on jit:0, by op.

The linked program (the whole forward pass, one call) is timed for a step of --seqs sequences at context
--context (or, with --prefill N, for one sequence's first N prompt tokens); then each group's own program
is timed alone on the same inputs and summed by op. Groups timed alone each pay a Python call (shown: the
time of last_rows, a call that does almost nothing) and a cold start of the threads, so the parts sum to
more than the linked step; their proportions are the profile.

    python benchmarks/profile_step.py [-m model.gguf] [--seqs 1] [--context 200] [--prefill 512] [--repeat 30]
"""

from __future__ import annotations

import argparse
import collections
import time

import numpy as np

from lse_backends.jit import JitDevice
from lse_core.devices.hookspec import CompileContext
from lse_core.graph.ir import Step
from lse_core.graph.plan import Plan
from lse_core.model.arch import build_graph
from lse_core.model.default import load_model


def step_of(rows: list[tuple[int, list[int], int]]) -> Step:
    """A Step from (slot, tokens, first position) per sequence, each sampling its last row."""
    counts = [len(tokens) for _, tokens, _ in rows]
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return Step(tokens=np.concatenate([np.asarray(t, np.int32) for _, t, _ in rows]),
                positions=np.concatenate([np.arange(p, p + len(t), dtype=np.int32) for _, t, p in rows]),
                slots=np.array([s for s, _, _ in rows], np.int32), query_starts=starts, sample_rows=starts[1:] - 1)


def seconds(call, repeat: int) -> float:
    call()
    start = time.perf_counter()
    for _ in range(repeat):
        call()
    return (time.perf_counter() - start) / repeat


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-m", "--model", default=None)
    parser.add_argument("--seqs", type=int, default=1)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--prefill", type=int, default=0, help="profile a prompt chunk of this many tokens")
    parser.add_argument("--repeat", type=int, default=30, help="timed runs of the linked step")
    args = parser.parse_args()
    plan = Plan.build(build_graph(load_model(args.model)), [JitDevice()],
                      CompileContext(args.seqs, max(args.context, args.prefill) + 16, max(64, args.seqs, args.prefill)),
                      None, False)
    if args.prefill:
        step = step_of([(0, list(range(100, 100 + args.prefill)), 0)])
        what = f"a {args.prefill}-token prefill chunk"
    else:
        prompt = list(range(100, 100 + args.context))
        for slot in range(args.seqs):
            plan.run(step_of([(slot, prompt, 0)]))
        step = step_of([(slot, [42], args.context) for slot in range(args.seqs)])
        what = f"one step of {args.seqs} sequence(s) at context {args.context}"
    (linked,) = [s for s in plan.stages if len(s.placements) > 1]
    total = seconds(lambda: linked.kernel([], step), args.repeat)

    values: dict[str, np.ndarray] = {}
    by_op: dict[str, float] = collections.Counter()
    groups: dict[str, int] = collections.Counter()
    for p in linked.placements:
        inputs = [values[v] for v in p.group.inputs]
        op = p.group.ops[0] if len(p.group.ops) == 1 else "elementwise"
        op = "linear (output)" if op == "linear" and p.group.layer < 0 else op
        by_op[op] += seconds(lambda: p.kernel(inputs, step), max(1, args.repeat * 2 // 3))  # noqa: B023 (called at once)
        groups[op] += 1
        values.update({v: o.copy() for v, o in zip(p.group.outputs, p.kernel(inputs, step))})
    print(f"linked program, {what}: {1e3 * total:.2f} ms ({step.n_tokens / total:.1f} tok/s)")
    print(f"each group alone (a call costs about {1e6 * by_op['last_rows']:.0f} us):")
    for op, spent in sorted(by_op.items(), key=lambda item: -item[1]):
        print(f"  {op:16s} {1e3 * spent:7.2f} ms  ({groups[op]} groups)")


if __name__ == "__main__":
    main()
