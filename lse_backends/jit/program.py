"""Groups on jit:0 as one compiled call. Each group compiles to instructions over a small closed set
(one per IR op kind; an elementwise group is one call of its generated function), and ``execute``, an
@njit loop, runs a whole program: a decode step's hundreds of groups cost one call from Python, not
hundreds (the planner links consecutive jit:0 groups into one program, ``JitDevice.link``).

Values live in activation buffers [capacity rows, width] kept across steps; a step uses the first rows
(its tokens, or its sequences after last_rows). Weights, caches and generated functions are held in
numba typed lists of one type each, so ``execute`` has one signature for every model and compiles once
(cached on disk).
"""

from __future__ import annotations

import functools
import operator
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np
from numba import njit, prange, typed, types
from numba.core.errors import NumbaPendingDeprecationWarning

from lse_core.graph.ir import Step

from . import atomics, attention, cache, kernels, quant, sampling

# instruction ops
EMBED, EMBED_Q, RMS_NORM, LINEAR, LINEAR_Q, ROPE, ATTENTION, FUSED, LAST_ROWS = range(9)
# instruction columns: the op, then output, input and resource/integer slots (-1 where unused)
MAX_OUTPUTS, MAX_INPUTS, MAX_ARGS = 4, 6, 8
# A quantized linear's slots: outputs, one per weight (MAX_PARTS at most); args: the first weight, the
# weights' kind, the steps its activations take two planes in (quant.WIDE_PREFILL, WIDE_DECODE bits), the first
# weight's bias (-1: none), then each further weight and its bias
MAX_PARTS = 3
OUT, IN, ARG = 1, 1 + MAX_OUTPUTS, 1 + MAX_OUTPUTS + MAX_INPUTS
WIDTH = ARG + MAX_ARGS
# Work items (besides the quantized linears', quant.ITEM_WORK): about 1-5 us of work each
ROW_ITEM = 16               # token rows of a row-wise op (embedding, norm, rope, KV store)
ELEMENT_ITEM = 1 << 13      # elements of an elementwise group
F32_ITEM_WORK = 1 << 16     # multiply-adds of a float32 linear
MAX_ITEMS = quant.MAX_ITEMS
PHASES = 2                  # attention stores the step's keys and values, then attends
LINE = 8                    # int64s in a cache line: each counter has one of its own
SPINS = 4000                # pauses (~20 us here) before a waiting thread naps (on a busy machine the
NAP_US = 20                 # thread it waits for may be descheduled, and spinning would keep it so)

FUSED_SIGNATURE = types.void(*[types.float32[::1]] * (MAX_OUTPUTS + MAX_INPUTS))
_LIST_TYPES = {  # every typed list ``execute`` takes, by the kind of thing it holds (weights read-only: mmapped)
    "acts": types.float32[:, ::1], "flats": types.float32[::1],
    "mats": types.Array(types.float32, 2, "C", readonly=True), "qmats": types.Array(types.uint8, 2, "C", readonly=True),
    "vecs": types.Array(types.float32, 1, "C", readonly=True), "caches": types.uint8[:, :, :, ::1],
    "fns": types.FunctionType(FUSED_SIGNATURE),
}


_INDICES, _STEP = types.int64[::1], types.int32[::1]  # int64 counts and counters; a Step's int32 arrays
_ACT, _QMAT, _CACHE = _LIST_TYPES["acts"], _LIST_TYPES["qmats"], _LIST_TYPES["caches"]
_INT = types.int64
# The kernels _run calls through function pointers (``compiled_kernels()``), as they are called there
_LINEAR_PAIRS = types.FunctionType(types.UniTuple(_INT, 2)(
    _INT, _QMAT, _ACT, _ACT, _INT, _INT, types.float32[::1], types.boolean, _INT))
_STORE_KV = types.FunctionType(types.void(_ACT, _ACT, _CACHE, _CACHE, _INT, _INT, _STEP, _INDICES, _INT, _INT))
_ATTENTION = types.FunctionType(types.void(
    _ACT, _CACHE, _CACHE, _INT, _INT, _STEP, _INDICES, _INT, types.float32, _INT, _LIST_TYPES["vecs"], _ACT, _INT,
    _INT))
_EMBED_ROWS_SIGNATURE = (_INT, _QMAT, _STEP, types.float32, _ACT)   # quant.embed_rows, as _run calls it
_LISTS = [types.ListType(_LIST_TYPES[kind]) for kind in ("acts", "flats", "mats", "qmats", "vecs", "caches", "fns")]
_RUN = types.FunctionType(types.void(
    types.int64[::1], *[_INT] * 4, types.float32, *_LISTS, _STEP, _STEP, _INDICES, _STEP, types.float32[::1],
    types.boolean, _LINEAR_PAIRS, _STORE_KV, _ATTENTION))
_WORK_SIGNATURE = types.void(
    types.int64[:, ::1], types.float32[:, ::1], *_LISTS[:2], _INDICES, *_LISTS[2:],
    _STEP, _STEP, _INDICES, _STEP, _INDICES, types.int64, types.int64, types.boolean,
    _RUN, _LINEAR_PAIRS, _STORE_KV, _ATTENTION)


# only the thread loop becomes parallel code: numba's other parallel rewrites (array expressions, slices)
# would each compile another parallel kernel here and speed up nothing
_THREADS_ONLY = {"prange": True, "comprehension": False, "reduction": False, "inplace_binop": False,
                 "setitem": False, "numpy": False, "stencil": False, "fusion": False}


@njit(cache=True, nogil=True)
def counter_size(n_instructions: int, n_threads: int) -> int:
    """int64s of counters for a program run: per instruction and phase, the items done and each thread's
    items claimed, a cache line each."""
    return n_instructions * PHASES * (n_threads + 1) * LINE


@njit(cache=True, nogil=True)
def timing_size(n_instructions: int, n_threads: int) -> int:
    """int64s after the counters that a timed run (``Program.time_tasks``) fills: per instruction, phase and
    thread, the cycle counter when the thread began the task (its wait over) and when it finished its last item
    of it (0 if it did none)."""
    return n_instructions * PHASES * n_threads * 2


@njit(cache=True, nogil=True)
def cycle_counter() -> int:
    """The cycle counter the task times are read from (atomics.cycles), callable from Python to calibrate it."""
    return atomics.cycles()


@njit(cache=True, nogil=True, inline="always")
def _wait(counters, at, value):
    """Spin until counters[at] reaches value; past SPINS spins, nap between looks. A napping thread holds
    no claimed item, so it delays nobody: should it wake late, the others will have taken its items."""
    spins = 0
    while atomics.load(counters, at) < value:
        if spins < SPINS:
            atomics.pause()
            spins += 1
        else:
            atomics.nap(NAP_US)


@njit(cache=True, nogil=True)
def _span(total, parts, i):
    """Part i of ``parts`` near-equal parts of range(total), as (start, end)."""
    return total * i // parts, total * (i + 1) // parts


@njit(cache=True, nogil=True, inline="always")
def _parts(c):
    """The weights of quantized linear ``c``: one per output."""
    parts = 1
    while parts < MAX_PARTS and c[OUT + parts] >= 0:
        parts += 1
    return parts


@njit(cache=True, nogil=True, inline="always")
def _weight_arg(part):
    """The arg slot of a quantized linear's part'th weight."""
    return ARG if part == 0 else ARG + 2 + 2 * part


@njit(cache=True, nogil=True, inline="always")
def _bias_arg(part):
    """The arg slot of a quantized linear's part'th bias: after the planes' bits for the first, else after its
    weight."""
    return ARG + 3 if part == 0 else _weight_arg(part) + 1


@njit(cache=True, nogil=True)
def _linear_q_size(c, qmats):
    """(rows, pairs of row groups) of quantized linear ``c``'s weights together: its items share out the
    pairs, each weight's in turn."""
    rows, pairs = 0, 0
    for part in range(_parts(c)):
        part_rows = qmats[c[_weight_arg(part)]].shape[0]
        rows, pairs = rows + part_rows, pairs + quant.linear_items_most(part_rows)
    return rows, pairs


@njit(cache=True, nogil=True)
def _add_bias(vecs, bias, y, r0, r1):
    """y[:, r0:r1] += vecs[bias][r0:r1] (bias -1: none)."""
    if bias >= 0:
        vector = vecs[bias]   # once: each typed-list read counts a reference, an atomic both threads contend for
        for t in range(y.shape[0]):
            for r in range(r0, r1):
                y[t, r] += vector[r]


@njit(cache=True, nogil=True)
def _items(c, phase, n, acts, mats, qmats, caches, n_threads):
    """How many work items instruction ``c``'s phase splits into, for n rows (every thread computes the
    same): where there are several, a multiple of the threads, so that equal threads get equal shares."""
    op = c[0]
    if op == LINEAR_Q:
        rows, most = _linear_q_size(c, qmats)
        items = quant.linear_items(rows, acts[c[IN]][:n])
    elif op == LINEAR:
        weight = mats[c[ARG]]
        most = (weight.shape[0] + kernels.ROW_TILE - 1) // kernels.ROW_TILE
        items = n * weight.size // F32_ITEM_WORK
    elif op == ATTENTION and phase == 1:
        most = n * caches[c[ARG]].shape[1]
        items = most
    elif op == FUSED:
        most = n * acts[c[IN]].shape[1]
        items = most // ELEMENT_ITEM
    elif op == LAST_ROWS:
        return 1
    else:
        most = n
        items = (n + ROW_ITEM - 1) // ROW_ITEM
    items = min(items, most, MAX_ITEMS)
    if items <= 1:
        return 1
    return min(most, (items + n_threads - 1) // n_threads * n_threads)


@njit(cache=True, nogil=True)  # called by _work through a pointer (``compiled_kernels()``)
def _run(c, phase, item, n_items, n, scalar, acts, flats, mats, qmats, vecs, caches, fns, tokens, positions,
         row_slot, sample_rows, scratch, row_invariant, linear_pairs, store_kv, attention):
    """Work item ``item`` of ``n_items`` of instruction ``c``'s phase, on n rows; the largest kernels are
    the last arguments' (a plan's linear_pairs, attention.store_kv and attention.attention, see
    ``compiled_kernels``)."""
    op, out = c[0], c[OUT]
    t0, t1 = _span(n, n_items, item)  # the item's rows, for the row-wise ops
    if op == EMBED:
        kernels.embedding(mats[c[ARG]], tokens[t0:t1], scalar, acts[out][t0:t1])
    elif op == EMBED_Q:
        quant.embed_rows(c[ARG + 1], qmats[c[ARG]], tokens[t0:t1], scalar, acts[out][t0:t1])
    elif op == RMS_NORM:
        kernels.rms_norm(acts[c[IN]][t0:t1], vecs[c[ARG]], c[ARG + 1], scalar, acts[out][t0:t1])
    elif op == ROPE:
        kernels.rope(acts[c[IN]][t0:t1], positions[t0:t1], mats[c[ARG]], mats[c[ARG + 1]], c[ARG + 2],
                     acts[out][t0:t1])
    elif op == LINEAR:
        x, y = acts[c[IN]][:n], acts[out][:n]
        tile = kernels.ROW_TILE
        r0, r1 = _span((y.shape[1] + tile - 1) // tile, n_items, item)
        r0, r1 = r0 * tile, min(y.shape[1], r1 * tile)
        kernels.linear_f32(x, mats[c[ARG]], y, r0, r1)
        _add_bias(vecs, c[ARG + 2], y, r0, r1)
    elif op == LINEAR_Q:  # the item's share of all its weights' pairs of row groups, in order
        x = acts[c[IN]][:n]
        p0, p1 = _span(_linear_q_size(c, qmats)[1], n_items, item)
        first = 0  # the part's first pair
        for part in range(_parts(c)):
            weight = qmats[c[_weight_arg(part)]]
            pairs = quant.linear_items_most(weight.shape[0])
            if max(p0, first) < min(p1, first + pairs):
                y = acts[c[OUT + part]][:n]
                r0, r1 = linear_pairs(c[ARG + 1], weight, x, y, max(p0, first) - first,
                                      min(p1, first + pairs) - first, scratch, row_invariant, c[ARG + 2])
                _add_bias(vecs, c[_bias_arg(part)], y, r0, r1)
            first += pairs
    elif op == ATTENTION and phase == 0:
        store_kv(acts[c[IN + 1]], acts[c[IN + 2]], caches[c[ARG]], caches[c[ARG + 1]], c[ARG + 4], c[ARG + 5],
                 positions, row_slot, t0, t1)
    elif op == ATTENTION:
        i0, i1 = _span(n * caches[c[ARG]].shape[1], n_items, item)
        attention(acts[c[IN]][:n], caches[c[ARG]], caches[c[ARG + 1]], c[ARG + 4], c[ARG + 5], positions,
                  row_slot, c[ARG + 2], scalar, c[ARG + 3], vecs[c[ARG + 6]], acts[out][:n], i0, i1)
    elif op == FUSED:
        s0, s1 = _span(n * acts[c[IN]].shape[1], n_items, item)
        empty = np.empty(0, np.float32)
        views = [flats[c[j]][s0:s1] if c[j] >= 0 else empty for j in range(OUT, ARG)]
        fns[c[ARG]](views[0], views[1], views[2], views[3], views[4], views[5], views[6], views[7], views[8],
                    views[9])
    elif op == LAST_ROWS:
        x, y = acts[c[IN]], acts[out]
        for i in range(sample_rows.shape[0]):
            for j in range(x.shape[1]):  # element by element, as kernels.py's doc says why
                y[i, j] = x[sample_rows[i], j]


@njit(cache=True, nogil=True)  # compiled by compiled_kernels(), when a program first runs: not at every import
def _work(code, floats, acts, flats, counts, mats, qmats, vecs, caches, fns, tokens, positions, row_slot,
          sample_rows, counters, n_threads, thread, row_invariant, run, linear_pairs, store_kv, attention):
    """Thread ``thread``'s part. Each task (an instruction, or one of its phases) starts once the one
    before it is done. A task of one item is thread 0's: the other threads go on to the next task of
    several, so a chain of small ops costs them one wait, not one each. The items of a task of several
    are split into one contiguous range per thread (a weight streams through one core's prefetches); a
    thread claims its own range's items, then what is left of the others'. numba runs the n_threads
    iterations of execute's prange on its n_threads threads at once (the join waits for all of them);
    a thread that starts late finds its items claimed by the others."""
    widest = 0
    for a in acts:
        widest = max(widest, a.shape[1])
    scratch = quant.activation_scratch(tokens.shape[0], widest)  # this thread's int8 activations
    quantized_for = -1  # the instruction they are for
    before, before_items = -1, 0  # the task before: its done counter and item count
    timings = counter_size(code.shape[0], n_threads)  # where a timed run's task times start
    timed = counters.shape[0] >= timings + timing_size(code.shape[0], n_threads)
    for k in range(code.shape[0]):
        c, n = code[k], counts[k]
        for phase in range(PHASES if c[0] == ATTENTION else 1):
            n_items = _items(c, phase, n, acts, mats, qmats, caches, n_threads)
            done = (k * PHASES + phase) * (n_threads + 1) * LINE
            if n_items > 1 or thread == 0:
                if before >= 0:
                    _wait(counters, before, before_items)
                stamp = timings + ((k * PHASES + phase) * n_threads + thread) * 2
                if timed:
                    counters[stamp] = atomics.cycles()
                for j in range(n_threads if n_items > 1 else 1):
                    owner = (thread + j) % n_threads
                    first, end = _span(n_items, n_threads, owner) if n_items > 1 else (0, 1)
                    item = first + atomics.fetch_add(counters, done + (owner + 1) * LINE, 1)
                    while item < end:
                        if c[0] == LINEAR_Q and quantized_for != k:  # once per instruction and thread
                            quant.quantize_activations(c[ARG + 1], acts[c[IN]][:n], scratch, row_invariant,
                                                       c[ARG + 2])
                            quantized_for = k
                        run(c, phase, item, n_items, n, floats[k, 0], acts, flats, mats, qmats, vecs, caches, fns,
                             tokens, positions, row_slot, sample_rows, scratch, row_invariant, linear_pairs, store_kv,
                             attention)
                        atomics.fetch_add(counters, done, 1)  # after the item's writes: whoever sees it sees them
                        if timed:
                            counters[stamp + 1] = atomics.cycles()
                        item = first + atomics.fetch_add(counters, done + (owner + 1) * LINE, 1)
            before, before_items = done, n_items


@njit(cache=True, nogil=True, parallel=_THREADS_ONLY)
def execute(kernels, code, floats, acts, flats, rows, mats, qmats, vecs, caches, fns,
            tokens, positions, slots, query_starts, sample_rows, counters, n_threads, row_invariant):
    """Run every instruction in order on ``n_threads`` threads (numba's count: each gets one part).
    ``rows`` holds each value's live row count (set for the inputs); ``counters`` has at least
    ``counter_size(n_instructions, n_threads)`` int64s (with ``timing_size`` more, the run times its tasks);
    ``kernels`` is ``compiled_kernels()``; ``row_invariant``: each row computed as a one-token step computes it
    (quant._groups), whatever else the step holds."""
    row_slot = np.empty(tokens.shape[0], np.int64)  # each token row's KV cache slot
    for i in range(slots.shape[0]):
        row_slot[query_starts[i]:query_starts[i + 1]] = slots[i]
    counts = np.empty(code.shape[0], np.int64)  # each instruction's rows, known before anything runs
    for k in range(code.shape[0]):
        c = code[k]
        counts[k] = rows[c[IN]] if c[IN] >= 0 else tokens.shape[0]
        for j in range(OUT, IN):
            if c[j] >= 0:
                rows[c[j]] = sample_rows.shape[0] if c[0] == LAST_ROWS else counts[k]
    counters[:] = 0
    # one parallel region for the whole program, its threads meeting at each instruction's end, instead
    # of waking them for each parallel op (hundreds a step)
    for thread in prange(n_threads):  # np.int64: numba types the index unsigned when it lowers the loop
        kernels[0][0](code, floats, acts, flats, counts, mats, qmats, vecs, caches, fns, tokens, positions,
                      row_slot, sample_rows, counters, n_threads, np.int64(thread), row_invariant, kernels[1][0],
                      kernels[2][0], kernels[3][0], kernels[4][0])


# name -> (function, its type as execute passes it), in execute's order; linear_pairs is made for the weight
# kinds of a plan (``quant.linear_pairs_for``: a model compiles its own kinds' tiles alone)
_KERNELS = {"work": (_work, types.FunctionType(_WORK_SIGNATURE)), "run": (_run, _RUN),
            "linear_pairs": (quant.linear_pairs_for, _LINEAR_PAIRS), "store_kv": (attention.store_kv, _STORE_KV),
            "attention": (attention.attention, _ATTENTION)}
# The kernels a second process compiles on a cold start (``compile_second_share``), with code whose types are
# known without them, while this one compiles the rest: about half the CPU time each (measured cold, one
# process, on the 2-core Zen 3: _work 3.3 s, _run 5.2, store_kv 3.7, _listed 2.1 and execute 2.1 here;
# linear_pairs 4.2, attention 4.7, the typed lists' builders 2.7 and sampling.sample 0.7 there, which starts
# earlier). linear_pairs has since grown (9.1 s on Zen 3 after the two-plane tiles, 8.7 s on the AMX Xeon)
# and execute moved here: on the Xeon the second share took 17.0-17.6 s with it, this one waiting.
SECOND_PROCESS = ("linear_pairs", "attention")
SECOND_SHARE = ", ".join(("embed_rows", *SECOND_PROCESS)) + " and sampling"   # as the log lines name it


@njit(cache=True)
def _one(function):
    result = typed.List()
    result.append(function)
    return result


_LISTED = types.Tuple([types.ListType(t) for _, t in _KERNELS.values()])(*[t for _, t in _KERNELS.values()])
_EXECUTE_SIGNATURE = (_LISTED.return_type, types.int64[:, ::1], types.float32[:, ::1],
                      *[types.ListType(_LIST_TYPES[kind]) for kind in ("acts", "flats")], _INDICES,
                      *[types.ListType(_LIST_TYPES[kind]) for kind in ("mats", "qmats", "vecs", "caches", "fns")],
                      *[_STEP] * 5, _INDICES, types.int64, types.boolean)


@njit(cache=True)  # for _LISTED only, by compiled_kernels(): not at every import (2 s on a cold cache)
def _listed(work, run, linear_pairs, store_kv, attention):
    """Each function as a typed list of one (built in compiled code, so their methods are cached, not
    compiled per process)."""
    return _one(work), _one(run), _one(linear_pairs), _one(store_kv), _one(attention)


def _kernel(name: str, kinds: int) -> tuple[Any, types.FunctionType]:
    """_KERNELS' function of this name (linear_pairs: for weights of the ``kinds`` mask) and its type."""
    function, kind = _KERNELS[name]
    return (function(kinds) if name == "linear_pairs" else function), kind


def compile_kernels(names: Sequence[str], kinds: int) -> None:
    """Compile these of _KERNELS for their types (linear_pairs for weights of the ``kinds`` mask), or load
    them from the disk cache."""
    for name in names:
        function, kind = _kernel(name, kinds)
        function.compile(kind.signature)


def compile_second_share(kinds: int) -> None:
    """What the second process compiles: SECOND_PROCESS's kernels (linear_pairs for weights of the ``kinds``
    mask), then code whose types are known without a model (the typed lists' builders, and sampling.sample,
    which a step's first token would compile after the program), all of it loaded from the cache here later.
    quant.embed_rows comes first: both shares would compile its _dequantize_row (1.5 s), and this one's is on disk
    by the time _run, after _work, reaches it there."""
    quant.embed_rows.compile(_EMBED_ROWS_SIGNATURE)
    compile_kernels(SECOND_PROCESS, kinds)
    for element in _LIST_TYPES.values():
        if isinstance(element, types.Array):
            _array_list.compile((types.List(element, reflected=True), types.int64))
    sampling.sample.compile(sampling.SAMPLE_TYPES)


@functools.cache
def second_compile(kinds: int) -> cache.CompileBeside | None:
    """The second process's share compiling (``compile_second_share``) for a model's weights of the ``kinds``
    mask, started where the disk cache lacks SECOND_PROCESS's kernels; None where it has them. jit:0 starts it
    at its first group's compile, while this process lays out the weights and compiles the elementwise groups:
    the two shares then end together."""
    if all(cache.is_cached(function, kind.signature) for function, kind in (_kernel(n, kinds) for n in SECOND_PROCESS)):
        return None
    return cache.compile_beside(f"from {__name__} import compile_second_share; compile_second_share({kinds})",
                                SECOND_SHARE)


@functools.cache
def compiled_kernels(kinds: int) -> tuple[typed.List, ...]:
    """[_work], [_run], [linear_pairs for weights of the ``kinds`` mask], [attention.store_kv],
    [attention.attention] as ``execute`` calls them: through function pointers. numba links a callee's code into its
    caller's and optimizes and emits the whole again, at every level of calls; through a pointer each of these
    compiles once, on its own: execute in 2 s instead of re-optimizing all of _work in it (25 s of a cold start),
    and _work without the largest kernels in it (CPU time of the cold compile 42 -> 28 s on the 2-core Zen 3). Being
    apart, they compile in two processes at once (``second_compile``). Passed in lists: a function argument is
    looked up at every call (1 ms here). They compile here (or load from the cache), when a program first runs, so
    that a process that imports the jit backend but runs nothing on jit:0 (another pool) does not compile its
    half-minute of kernels."""
    beside = second_compile(kinds)
    compile_kernels([name for name in _KERNELS if name not in SECOND_PROCESS], kinds)
    _compile_listed_and_execute()
    if beside is not None:
        beside.join()
    compile_kernels(SECOND_PROCESS, kinds)   # loads what the second process compiled (or, should it fail, compiles)
    return _listed(*(_kernel(name, kinds)[0] for name in _KERNELS))


@functools.cache
def _compile_listed_and_execute() -> None:
    """_listed and execute, once a process: only the kernels' types decide them, whatever the weight kinds."""
    _listed.compile(_LISTED)
    execute.compile(_EXECUTE_SIGNATURE)
    _listed.disable_compile()   # as an explicit signature would: the functions convert to their types


@dataclass
class Instruction:
    """One op of a group, over value names. ``args`` fill the argument slots in order: an array or a
    function becomes its index in the typed list of its kind, an int stays itself."""

    op: int
    outputs: tuple[str, ...]
    inputs: tuple[str, ...]
    args: tuple[Any, ...] = ()
    scalar: float = 0.0
    width: int | tuple[int, ...] | None = None  # the outputs' width (or each one's); None: the first input's
    vocab: int = 0             # embedding: ids must be below this (numba does no bounds checks)
    uses_cache: bool = False   # positions and slots must lie inside the KV cache


def _list_kind(resource: Any) -> str:
    if not isinstance(resource, np.ndarray):
        return "fns"
    return {(np.uint8, 2): "qmats", (np.uint8, 4): "caches", (np.float32, 1): "vecs",
            (np.float32, 2): "mats"}[resource.dtype.type, resource.ndim]


class Program:
    """A Kernel: instructions for groups in order, reading ``inputs`` and returning ``outputs``. ``kinds``: the
    mask (``quant.kinds_mask``) of the weight kinds its linear_pairs is compiled for, its own linears' and
    any others the model has (one compile for all of a model's programs)."""

    def __init__(self, instructions: Sequence[Instruction], inputs: Sequence[str], outputs: Sequence[str],
                 capacity: int, kv_len: int, kv_slots: int, row_invariant: bool = False, kinds: int = 0) -> None:
        self.instructions = list(instructions)
        self.row_invariant = row_invariant
        self.kinds = kinds
        for ins in self.instructions:
            if ins.op == LINEAR_Q:
                self.kinds |= 1 << ins.args[1]
        self.inputs, self.outputs = tuple(inputs), tuple(outputs)
        self.capacity, self.kv_len, self.kv_slots = capacity, kv_len, kv_slots
        self.vocab = min((i.vocab for i in self.instructions if i.vocab), default=0)
        self.uses_cache = any(i.uses_cache for i in self.instructions)
        self.slot = {name: k for k, name in enumerate(dict.fromkeys(
            [*self.inputs, *(o for i in self.instructions for o in i.outputs)]))}
        lists: dict[str, list] = {kind: [] for kind in _LIST_TYPES if kind not in ("acts", "flats")}
        where: dict[int, int] = {}  # id(resource) -> index in its list: shared weights go in once
        self.code = np.full((len(self.instructions), WIDTH), -1, np.int64)
        self.floats = np.zeros((len(self.instructions), 1), np.float32)
        for k, ins in enumerate(self.instructions):
            args = []
            for arg in ins.args:
                if isinstance(arg, int):
                    args.append(arg)
                    continue
                bucket = lists[_list_kind(arg)]
                if id(arg) not in where:
                    where[id(arg)] = len(bucket)
                    bucket.append(arg)
                args.append(where[id(arg)])
            row = self.code[k]
            row[0] = ins.op
            row[OUT:OUT + len(ins.outputs)] = [self.slot[v] for v in ins.outputs]
            row[IN:IN + len(ins.inputs)] = [self.slot[v] for v in ins.inputs]
            row[ARG:ARG + len(args)] = args
            self.floats[k, 0] = ins.scalar
        self.resources = lists  # as typed lists at the first call: a group's program is often only linked
        self.acts: list[np.ndarray] = []
        self.counters = np.zeros(0, np.int64)
        self.threads = 0   # the last run's
        self.time_tasks = False   # record each task's start and end on each thread (``task_cycles``)

    def _allocate(self, inputs: Sequence[np.ndarray], rows: int) -> None:
        """Buffers of ``rows`` rows; widths follow from the inputs' through the code. A value's buffer
        is reused once the value is dead (after its last reader), but never by the outputs of the
        instruction reading it, so no kernel writes over its own input; the outputs live to the end."""
        width = {self.slot[name]: x.shape[1] for name, x in zip(self.inputs, inputs)}
        last_read = {self.slot[name]: len(self.instructions) for name in self.outputs}
        for k, ins in enumerate(self.instructions):
            w = ins.width if ins.width is not None else width[self.slot[ins.inputs[0]]]
            width.update({self.slot[o]: w[j] if isinstance(w, tuple) else w for j, o in enumerate(ins.outputs)})
            last_read.update({self.slot[v]: max(k, last_read.get(self.slot[v], -1)) for v in ins.inputs})
        free: dict[int, list[np.ndarray]] = {}
        buffer: dict[int, np.ndarray] = {}

        def take(slot: int) -> None:
            spare = free.get(width[slot])
            buffer[slot] = spare.pop() if spare else np.empty((rows, width[slot]), np.float32)

        for name in self.inputs:
            take(self.slot[name])
        for k, ins in enumerate(self.instructions):
            for name in ins.outputs:
                take(self.slot[name])
            for slot in {self.slot[v] for v in (*ins.inputs, *ins.outputs)}:
                if last_read.get(slot, k) == k:  # read last here, or produced here and never read
                    free.setdefault(width[slot], []).append(buffer[slot])
        self.acts = [buffer[k] for k in range(len(self.slot))]
        self.lists = {kind: _typed(kind, items) for kind, items in self.resources.items()}
        self.capacity = rows
        self.typed_acts = _typed("acts", self.acts)
        self.typed_flats = _typed("flats", [a.reshape(-1) for a in self.acts])
        self.rows = np.zeros(len(self.acts), np.int64)

    def __call__(self, inputs: Sequence[np.ndarray], step: Step) -> list[np.ndarray]:
        if not self.acts:  # the first run: what every program runs compiles now (or loads from the cache)
            with cache.stage("the program's kernels"):
                compiled_kernels(self.kinds)
                cache.release_compiler_pages()   # before the step's buffers grow the resident set (its peak)
                outputs = self._run(inputs, step)
            cache.release_compiler_pages()   # compiled and loaded: LLVM's code is not needed to run it
            return outputs
        return self._run(inputs, step)

    def _run(self, inputs: Sequence[np.ndarray], step: Step) -> list[np.ndarray]:
        self._check(step)
        if not self.acts or step.n_tokens > self.capacity:
            self._allocate(inputs, max(self.capacity, step.n_tokens))
        for name, x in zip(self.inputs, inputs):
            k = self.slot[name]
            self.acts[k][:x.shape[0]] = x
            self.rows[k] = x.shape[0]
        lists, n_threads = self.lists, numba.get_num_threads()
        size = counter_size(len(self.instructions), n_threads)
        if self.time_tasks:
            size += timing_size(len(self.instructions), n_threads)
        if self.counters.size != size:
            self.counters = np.zeros(size, np.int64)
        self.threads = n_threads
        indices = [np.ascontiguousarray(a, np.int32) for a in  # _work's signature: int32, contiguous
                   (step.tokens, step.positions, step.slots, step.query_starts, step.sample_rows)]
        execute(compiled_kernels(self.kinds), self.code, self.floats, self.typed_acts, self.typed_flats, self.rows,
                lists["mats"], lists["qmats"], lists["vecs"], lists["caches"], lists["fns"], *indices, self.counters,
                n_threads, self.row_invariant)
        return [self.acts[self.slot[name]][:self.rows[self.slot[name]]] for name in self.outputs]

    def task_cycles(self) -> np.ndarray | None:
        """The last run's task times, with ``time_tasks`` set: [instruction, phase, thread, (start, end)] in
        ``cycle_counter()``'s cycles (``timing_size``), end 0 where the thread did none of the task's items (a
        task of one item is thread 0's); None for an untimed run."""
        n, threads = len(self.instructions), self.threads
        timings = counter_size(n, threads)
        if not threads or self.counters.size < timings + timing_size(n, threads):
            return None
        return self.counters[timings:timings + timing_size(n, threads)].reshape(n, PHASES, threads, 2).copy()

    def _check(self, step: Step) -> None:
        """What numba would not: ids inside the vocabulary, positions and slots inside the cache."""
        if self.vocab and step.tokens.max(initial=0) >= self.vocab:
            raise ValueError(f"token id {step.tokens.max()} is outside the vocabulary ({self.vocab})")
        if self.uses_cache and (step.positions.max(initial=0) >= self.kv_len
                                or step.slots.max(initial=0) >= self.kv_slots):
            raise ValueError(f"step outside the KV cache ({self.kv_slots} slots of {self.kv_len} positions): "
                             f"positions up to {step.positions.max()}, slots up to {step.slots.max()}")


def link(programs: Sequence[Program], inputs: Sequence[str], outputs: Sequence[str]) -> Program:
    """One program running ``programs`` in order (their groups were consecutive on jit:0)."""
    first = programs[0]
    return Program(_merge_linears([i for p in programs for i in p.instructions]), inputs, outputs, first.capacity,
                   first.kv_len, first.kv_slots, first.row_invariant,
                   functools.reduce(operator.or_, (p.kinds for p in programs)))


def _merge_linears(instructions: list[Instruction]) -> list[Instruction]:
    """Consecutive quantized linears of one input, weight type and width (q, k and v; gate and up) as one
    instruction whose work items share out all their rows: one wait for the threads instead of several,
    and a small product (k, v at one token) no longer runs on one thread while the others wait."""
    merged: list[Instruction] = []
    for ins in instructions:
        last = merged[-1] if merged else None
        if (last is None or not ins.op == last.op == LINEAR_Q or ins.inputs != last.inputs
                or ins.args[1:3] != last.args[1:3] or len(last.outputs) == MAX_PARTS):
            merged.append(ins)
            continue
        widths = last.width if isinstance(last.width, tuple) else (last.width,)
        merged[-1] = Instruction(LINEAR_Q, last.outputs + ins.outputs, last.inputs,
                                 last.args + (ins.args[0], ins.args[3]), width=widths + (ins.width,))
    return merged


def _typed(kind: str, items: Sequence[Any]) -> typed.List:
    """A numba typed list of ``_LIST_TYPES[kind]``. Arrays go in through ``_array_list``: a typed list
    filled from Python compiles its methods for the element type in every process (5 s of the first
    step here, each time the engine started)."""
    element = _LIST_TYPES[kind]
    if not isinstance(element, types.Array):  # functions: appended one by one in compiled code
        result = _no_functions()
        for item in items:
            _append_function(result, item)
        return result
    dtype = numba.np.numpy_support.as_dtype(element.dtype)
    arrays = [_as_element(np.asarray(a, dtype), element) for a in items]
    with warnings.catch_warnings():  # the reflected list argument is never written to
        warnings.simplefilter("ignore", NumbaPendingDeprecationWarning)
        return _array_list(arrays or [_as_element(np.empty((0,) * element.ndim, dtype), element)], len(arrays))


def _as_element(array: np.ndarray, element: types.Array) -> np.ndarray:
    """``array`` typed as the list's elements: a read-only view where they are read-only."""
    if not element.mutable and array.flags.writeable:
        array = array.view()
        array.flags.writeable = False
    return array


_FUSED_TYPE = _LIST_TYPES["fns"]


@njit(types.ListType(_FUSED_TYPE)(), cache=True)
def _no_functions():
    """An empty typed list of fused kernels, made in compiled code (cached): see ``_append_function``."""
    return typed.List.empty_list(_FUSED_TYPE)


@njit(types.void(types.ListType(_FUSED_TYPE), _FUSED_TYPE), cache=True)
def _append_function(functions, function):
    """functions.append(function) in compiled code: from Python, the typed list's append compiles for the
    element type in every process (0.9 s and 13 MiB of the first step here)."""
    functions.append(function)


@njit(cache=True)
def _array_list(arrays, count):
    """A typed list of arrays[:count]: cached on disk for each element type (arrays holds one, even
    for an empty list, to give the type)."""
    result = typed.List()
    for i in range(count):
        result.append(arrays[i])
    return result

