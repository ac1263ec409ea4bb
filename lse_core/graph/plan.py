"""Placement and execution: every fused group on a device of the pool, explicit copies between
devices, the CPU interpreter only as the counted (or refused) fallback.

Like ggml's backend scheduler: the pool is in priority order; several pool devices split the
layers between them in order; a group goes to its layer's device if that device has a kernel,
else to the first other pool device that has one, else to the CPU interpreter. Consecutive groups
placed on a device that links kernels run as one stage: one call per step for the run."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from lse_core.devices.hookspec import CompileContext, Device, Kernel
from lse_core.errors import server_error
from lse_core.graph.fuse import FusedGroup, fuse
from lse_core.graph.ir import SAMPLING_OP_NEEDED, Graph, Step


@dataclass
class Placement:
    group: FusedGroup
    device: Device | None          # None: no device may run it (fallback refused)
    kernel: Kernel | None
    fallback_cause: str | None     # set when the group runs on the CPU interpreter as a fallback

    @property
    def refused(self) -> bool:
        return self.kernel is None


@dataclass
class Stage:
    """What one call runs: a placement's kernel, or the linked kernel of several consecutive ones."""

    placements: list[Placement]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    kernel: Kernel | None

    @property
    def device(self) -> Device | None:
        return self.placements[0].device


@dataclass
class StepOutput:
    next_tokens: np.ndarray | None           # int32 [S], when the step had sampling parameters
    logits: np.ndarray | None                # float32 [S, vocab], when asked for
    fallbacks: list[tuple[str, np.ndarray]]  # (cause, bool[S] mask of the sequences that caused it)
    hidden: np.ndarray | None = None         # float32 [T, width], every row's final hidden state, when asked for


class Plan:
    def __init__(self, placements: list[Placement], output: str, ctx: CompileContext,
                 on_fallback: Callable[[str], None], hidden: str | None = None) -> None:
        self.placements = placements
        self.output = output
        self.hidden = hidden      # the final hidden state's value (embeddings read it), kept by linked stages
        self.ctx = ctx            # what the kernels were compiled for: slots, positions, rows
        self._on_fallback = on_fallback
        self.stages = _link(placements, output, hidden)

    @classmethod
    def build(
        cls,
        graph: Graph,
        pool: list[Device],
        ctx: CompileContext,
        fallback_device: Device | None = None,
        allow_fallback: bool = True,
        on_fallback: Callable[[str], None] = lambda cause: None,
        after_group: Callable[[], None] = lambda: None,
    ) -> Plan:
        """Place and compile every fused group of ``graph``; ``after_group`` runs after each (the engine
        lets the weight file's pages go there, so the file and the devices' copies never all coexist)."""
        placements = []
        types = frozenset(q for w in graph.weights.values() if (q := getattr(w, "qtype", None)))
        ctx = replace(ctx, weight_types=types)
        for group in fuse(graph):
            placements.append(_place(group, _preference(group, pool, graph.n_layers), graph, ctx, fallback_device,
                                     allow_fallback))
            after_group()
        return cls(placements, graph.output, ctx, on_fallback, _hidden_value(graph))

    def run(self, step: Step, want_logits: bool = False, want_hidden: bool = False) -> StepOutput:
        values: dict[str, tuple[Device, Any]] = {}
        fallbacks: list[tuple[str, np.ndarray]] = []
        every_seq = np.ones(step.n_seqs, dtype=bool)
        for stage in self.stages:
            p = stage.placements[0]   # a linked stage is model groups without fallbacks
            op = p.group.sampling_op
            if op is not None:
                if step.sampling is None:
                    break
                needed = SAMPLING_OP_NEEDED[op](step.sampling)
                if not needed.any():   # nobody needs it: the value passes through unchanged
                    values[stage.outputs[0]] = values[stage.inputs[0]]
                    continue
                if op == "mask":
                    step.sampling.await_mask()
            else:
                needed = every_seq
            if p.refused:
                raise server_error(f"CPU fallback disabled: {p.fallback_cause}")
            args = [self._fetch(values, name, p.device) for name in stage.inputs]
            for name, buf in zip(stage.outputs, stage.kernel(args, step)):
                values[name] = (p.device, buf)
            if p.fallback_cause is not None:
                self._on_fallback(p.fallback_cause)
                fallbacks.append((p.fallback_cause, needed))
        next_tokens = None
        if "next_tokens" in values:
            device, buf = values["next_tokens"]
            next_tokens = device.to_host(buf).astype(np.int32, copy=False)
        logits = None
        if want_logits:
            device, buf = values[self.output]
            logits = device.to_host(buf)
        hidden = None
        if want_hidden:
            device, buf = values[self.hidden]
            hidden = device.to_host(buf)
        return StepOutput(next_tokens, logits, fallbacks, hidden)

    @staticmethod
    def _fetch(values: dict[str, tuple[Device, Any]], name: str, device: Device) -> Any:
        """The value on ``device``, copied through the host where placement changes (cached)."""
        src, buf = values[name]
        if src is device:
            return buf
        copied = device.to_device(src.to_host(buf))
        values[name] = (device, copied)
        return copied

    def refusal(self, sampling_ops: set[str]) -> str | None:
        """The cause of the first group a request would need that may not run (fallback refused)."""
        for p in self.placements:
            op = p.group.sampling_op
            if p.refused and (op is None or op in sampling_ops):
                return p.fallback_cause
        return None

    def describe(self) -> list[dict[str, Any]]:
        """Where each group runs (for diagnostics and test messages)."""
        return [{"group": p.group.describe(), "device": p.device.info.name if p.device else None,
                 "fallback": p.fallback_cause is not None} for p in self.placements]


def _hidden_value(graph: Graph) -> str | None:
    """The final hidden state (after the final norm): the value whose sampled rows make the logits."""
    return next((n.inputs[0] for n in graph.nodes if n.op == "last_rows"), None)


def _link(placements: list[Placement], output: str, hidden: str | None = None) -> list[Stage]:
    """Stages: each maximal run of model groups placed (not as a fallback) on one device that links
    their kernels becomes one linked stage; every other placement is a stage of its own."""
    runs: list[list[Placement]] = []
    previous_linkable = False
    for p in placements:
        linkable = (p.group.sampling_op is None and p.fallback_cause is None and p.device is not None
                    and p.device.can_link(p.kernel))
        if linkable and previous_linkable and runs[-1][0].device is p.device:
            runs[-1].append(p)
        else:
            runs.append([p])
        previous_linkable = linkable
    read_after: set[str] = {output, "next_tokens"} | ({hidden} if hidden else set())
    stages: list[Stage] = []
    for run in reversed(runs):
        produced = {v for p in run for v in p.group.outputs}
        inputs = tuple(dict.fromkeys(v for p in run for v in p.group.inputs if v not in produced))
        outputs = tuple(v for p in run for v in p.group.outputs if v in read_after)
        if len(run) == 1:
            stage = Stage(run, run[0].group.inputs, run[0].group.outputs, run[0].kernel)
        else:
            stage = Stage(run, inputs, outputs, run[0].device.link([p.kernel for p in run], inputs, outputs))
        stages.append(stage)
        read_after.update(stage.inputs)
    return stages[::-1]


def _preference(group: FusedGroup, pool: list[Device], n_layers: int) -> list[Device]:
    """The group's layer's device first (layers split evenly in pool order), then the rest."""
    if len(pool) <= 1:
        return list(pool)
    if group.layer >= 0:
        owner = min(group.layer * len(pool) // max(n_layers, 1), len(pool) - 1)
    else:
        owner = 0 if group.nodes[0].op == "embedding" else len(pool) - 1
    return [pool[owner]] + [d for i, d in enumerate(pool) if i != owner]


def _place(group: FusedGroup, devices: list[Device], graph: Graph, ctx: CompileContext,
           fallback_device: Device | None, allow_fallback: bool) -> Placement:
    weights = {name: graph.weights[name] for name in group.params}
    reasons = []
    for device in devices:
        kernel = device.compile(group, weights, ctx.on(device))
        if not isinstance(kernel, str):
            return Placement(group, device, kernel, None)
        reasons.append(f"{device.info.name}: {kernel}")
    cause = "; ".join([group.describe()] + reasons)
    if not allow_fallback or fallback_device is None:
        return Placement(group, None, None, cause)
    kernel = fallback_device.compile(group, weights, ctx.on(fallback_device))
    if isinstance(kernel, str):
        raise RuntimeError(f"the CPU interpreter cannot run {group.describe()}: {kernel}")
    return Placement(group, fallback_device, kernel, cause)
