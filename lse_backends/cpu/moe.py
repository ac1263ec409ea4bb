"""numpy kernels for the mixture-of-experts ops of lse_core.graph.ir (moe_route, expert_linear,
moe_combine): the float32 reference the other devices' expert kernels are tested against."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from lse_core.devices.hookspec import CompileContext
from lse_core.graph.ir import Node, Step

from .kernels import KernelFactory, NodeKernel, OutputBuffer


def _softmax(x: np.ndarray) -> np.ndarray:
    """Row softmax in float32."""
    e = np.exp(x - np.max(x, axis=1, keepdims=True))
    return e / np.sum(e, axis=1, keepdims=True)


def moe_route(node: Node, params: list[np.ndarray], ctx: CompileContext) -> NodeKernel:
    k, mode, normalize = int(node.attrs["k"]), node.attrs["mode"], bool(node.attrs.get("normalize"))
    if mode not in ("softmax_topk", "topk_softmax"):
        raise ValueError(f"unknown moe_route mode {mode!r}")
    buffer = OutputBuffer(ctx.max_tokens)

    def run(inputs: Sequence[np.ndarray], step: Step) -> np.ndarray:
        (logits,) = inputs
        scores = _softmax(logits) if mode == "softmax_topk" else logits
        # a stable sort of the negated scores: descending, the lower id first on ties
        chosen = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        weights = np.take_along_axis(scores, chosen, axis=1)
        if mode == "topk_softmax":
            weights = _softmax(weights)
        elif normalize:
            weights = weights / np.sum(weights, axis=1, keepdims=True)
        out = buffer.take(logits.shape[0], 2 * k)
        out[:, :k] = chosen
        out[:, k:] = weights
        return out

    return run


def route_ids(routes: np.ndarray, k: int) -> np.ndarray:
    """The experts' ids of routes [T, 2k] as integers [T, k]."""
    return routes[:, :k].astype(np.intp)


def routed_groups(ids: np.ndarray, k: int) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """(expert, rows, slots) for each expert chosen in ``ids`` [n, k]: the (row, slot) pairs routed to it."""
    pairs = np.argsort(ids, axis=None, kind="stable")   # (row, slot) pairs grouped by expert
    experts, starts = np.unique(ids.reshape(-1)[pairs], return_index=True)
    for e, start, end in zip(experts.tolist(), starts.tolist(), [*starts[1:].tolist(), len(pairs)]):
        yield (e, *np.divmod(pairs[start:end], k))


def expert_linear(node: Node, params: list[np.ndarray], ctx: CompileContext) -> NodeKernel:
    """Each chosen expert's matrix meets the (row, slot) pairs routed to it as one product (a prefill's
    rows grouped by expert; a decode row's k experts one GEMV each); with ``ctx.deterministic``, one GEMV
    per pair, so a row's sums never depend on the step's other rows."""
    weight, bias = params[0], params[1] if len(params) > 1 else None
    in_width, width = weight.shape[2], weight.shape[1]
    k = int(node.attrs["k"])
    buffer = OutputBuffer(ctx.max_tokens)

    def run(inputs: Sequence[np.ndarray], step: Step) -> np.ndarray:
        x, routes = inputs
        n = x.shape[0]
        out = buffer.take(n, k * width).reshape(n, k, width)
        # [n, k, in] per-slot inputs, or [n, 1, in] when every slot reads the row itself
        x3 = x.reshape(n, k, in_width) if x.shape[1] == k * in_width else x.reshape(n, 1, in_width)
        ids = route_ids(routes, k)
        if ctx.deterministic:
            for t in range(n):
                for j in range(k):
                    np.matmul(x3[t, min(j, x3.shape[1] - 1)], weight[ids[t, j]].T, out=out[t, j])
        else:
            for e, rows, slots in routed_groups(ids, k):
                out[rows, slots] = x3[rows, np.minimum(slots, x3.shape[1] - 1)] @ weight[e].T
        if bias is not None:
            out += bias[ids]
        return out.reshape(n, k * width)

    return run


def moe_combine(node: Node, params: list[np.ndarray], ctx: CompileContext) -> NodeKernel:
    buffer = OutputBuffer(ctx.max_tokens)

    def run(inputs: Sequence[np.ndarray], step: Step) -> np.ndarray:
        y, routes = inputs
        n, k = y.shape[0], routes.shape[1] // 2
        y3 = y.reshape(n, k, -1)
        out = buffer.take(n, y3.shape[2])
        np.multiply(y3[:, 0], routes[:, k:k + 1], out=out)
        for j in range(1, k):   # slot by slot: a row's sum is the same whatever rows share its step
            out += y3[:, j] * routes[:, k + j:k + j + 1]
        return out

    return run


def clamped_swiglu(node: Node, params: list[np.ndarray], ctx: CompileContext) -> NodeKernel:
    alpha, limit = np.float32(node.attrs["alpha"]), np.float32(node.attrs["limit"])
    buffer = OutputBuffer(ctx.max_tokens)

    def run(inputs: Sequence[np.ndarray], step: Step) -> np.ndarray:
        gate, up = inputs
        g = np.minimum(gate, limit)
        out = buffer.take(*gate.shape)
        # g * sigmoid(alpha g) = g / (1 + exp(-alpha g)); -alpha g is at most alpha * limit when g is clamped
        # from above only, but unbounded below: clamped at 88, as silu's, so exp stays finite
        np.divide(g, np.float32(1) + np.exp(np.minimum(-alpha * g, np.float32(88))), out=out)
        out *= np.clip(up, -limit, limit) + np.float32(1)
        return out

    return run


MOE_KERNELS: dict[str, KernelFactory] = {
    "moe_route": moe_route,
    "expert_linear": expert_linear,
    "moe_combine": moe_combine,
    "clamped_swiglu": clamped_swiglu,
}
