"""The fusion pass: runs of consecutive elementwise nodes become one fused group; every other
node is a group of its own. Groups are numbered in execution order from 0."""

from __future__ import annotations

from dataclasses import dataclass

from .ir import ELEMENTWISE_OPS, SAMPLING_OPS, Graph, Node


@dataclass(frozen=True)
class FusedGroup:
    index: int
    nodes: tuple[Node, ...]
    inputs: tuple[str, ...]    # values the group reads that are produced outside it
    outputs: tuple[str, ...]   # values it produces that later groups (or the caller) read
    params: tuple[str, ...]    # weight names its nodes read

    @property
    def ops(self) -> tuple[str, ...]:
        return tuple(n.op for n in self.nodes)

    @property
    def layer(self) -> int:
        return self.nodes[0].layer

    @property
    def sampling_op(self) -> str | None:
        """The sampling op this group is, or None for a model group."""
        return self.nodes[0].op if self.nodes[0].op in SAMPLING_OPS else None

    def describe(self) -> str:
        n = len(self.nodes)
        return f"fused group {self.index} ({n} node{'s' if n != 1 else ''}: {', '.join(self.ops)})"


def fuse(graph: Graph) -> list[FusedGroup]:
    runs: list[list[Node]] = []
    for node in graph.nodes:
        if runs and node.op in ELEMENTWISE_OPS and runs[-1][-1].op in ELEMENTWISE_OPS \
                and runs[-1][-1].layer == node.layer:
            runs[-1].append(node)
        else:
            runs.append([node])

    read_later: list[set[str]] = [set() for _ in runs]
    needed = {graph.output, "next_tokens"}
    for i in range(len(runs) - 1, -1, -1):
        read_later[i] = set(needed)
        for node in runs[i]:
            needed.update(node.inputs)

    groups = []
    for i, run in enumerate(runs):
        produced = {n.output for n in run}
        inputs = list(dict.fromkeys(v for n in run for v in n.inputs if v not in produced))
        outputs = [n.output for n in run if n.output in read_later[i]]
        params = list(dict.fromkeys(p for n in run for p in n.params))
        groups.append(FusedGroup(i, tuple(run), tuple(inputs), tuple(outputs), tuple(params)))
    return groups
