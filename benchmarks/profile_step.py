"""Where one decode step's (or a prefill chunk's) time goes on jit:0, by op.

The linked program (the whole forward pass, one call) is timed for a step of --seqs sequences at context
--context (or, with --prefill N, for one sequence's first N prompt tokens); then each group's own program
is timed alone on the same inputs and summed by op. Groups timed alone each pay a Python call (shown: the
time of last_rows, a call that does almost nothing) and a cold start of the threads, so the parts sum to
more than the linked step; their proportions are the profile. With --tasks, the linked step's own tasks are
timed instead, inside the one call (``Program.time_tasks``: a cycle counter read on each thread as it begins
and ends each task): each task's share of the step is from the end of the task before it to its own last
thread's end, and the longest tasks are listed with their weights' bytes and rate.

    python benchmarks/profile_step.py [-m model.gguf] [--seqs 1] [--context 200] [--prefill 512] [--repeat 30]
                                      [--tasks]
"""

from __future__ import annotations

import argparse
import collections
import time

import numpy as np

from lse_backends.jit import JitDevice, program
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
    parser.add_argument("--tasks", action="store_true", help="time the linked step's tasks, not each group alone")
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
    if args.tasks:
        print(f"linked program, {what}: {1e3 * total:.2f} ms ({step.n_tokens / total:.1f} tok/s)")
        print_tasks(linked.kernel, step, args.repeat)
        return

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


OP_NAMES = {program.EMBED: "embedding", program.EMBED_Q: "embedding", program.RMS_NORM: "rms_norm",
            program.LINEAR: "linear (float32)", program.LINEAR_Q: "linear", program.ROPE: "rope",
            program.ATTENTION: "attention", program.FUSED: "elementwise", program.LAST_ROWS: "last_rows"}


def task_name(op: int, phase: int) -> str:
    return OP_NAMES[op] + (f" ({('store', 'attend')[phase]})" if op == program.ATTENTION else "")


def cycles_per_second() -> float:
    start, start_cycles = time.perf_counter(), program.cycle_counter()
    time.sleep(0.2)
    return (program.cycle_counter() - start_cycles) / (time.perf_counter() - start)


def print_tasks(linked: program.Program, step: Step, repeat: int) -> None:
    """Each task's time within the linked step (median over ``repeat`` timed runs), by op and the longest."""
    linked.time_tasks = True
    runs = []
    for _ in range(repeat + 1):
        linked([], step)
        runs.append(linked.task_cycles())
    linked.time_tasks = False
    rate = cycles_per_second()
    spans = collections.defaultdict(list)   # (instruction, phase) -> seconds, one per run
    whole = []   # each run's, from its first task's start to its last task's end
    for stamps in runs[1:]:
        taken = stamps[..., 1] > 0   # [instruction, phase, thread]: the thread did some of the task's items
        ends = stamps[..., 1].max(axis=2)
        previous = stamps[..., 0][taken].min()
        for k, phase in zip(*np.nonzero(taken.any(axis=2))):
            spans[k, phase].append((ends[k, phase] - previous) / rate)
            previous = ends[k, phase]
        whole.append((ends.max() - stamps[..., 0][taken].min()) / rate)
    median = {task: float(np.median(s)) for task, s in spans.items()}
    by_op: dict[str, float] = collections.Counter()
    for (k, phase), spent in median.items():
        by_op[task_name(linked.instructions[k].op, phase)] += spent
    step_seconds = sum(median.values())
    print(f"its tasks, timed inside the call (medians of {repeat} runs; first start to last end "
          f"{1e3 * np.median(whole):.2f} ms):")
    for op, spent in sorted(by_op.items(), key=lambda item: -item[1]):
        print(f"  {op:20s} {1e3 * spent:7.2f} ms  {100 * spent / step_seconds:5.1f} %")
    print("the longest tasks:")
    for (k, phase), spent in sorted(median.items(), key=lambda item: -item[1])[:10]:
        ins = linked.instructions[k]
        weights = [a for a in ins.args if isinstance(a, np.ndarray) and a.dtype == np.uint8]
        nbytes = sum(w.nbytes for w in weights)
        rate_text = f", {nbytes / 1e6:.2f} MB of weights at {nbytes / spent / 1e9:.1f} GB/s" if nbytes else ""
        print(f"  #{k} {task_name(ins.op, phase):20s} {1e6 * spent:8.1f} us{rate_text}")


if __name__ == "__main__":
    main()
