"""Fair steps (issue 49): while sequences decode, a prompt's chunk in a step is bounded by the time the step may
take, estimated from the steps already measured (scheduler.StepCost), so running streams keep their pace.

The scheduler is driven with a fake clock (a known cost per decode, per prompt token and per context position);
the engine runs on a deterministic CPU plan, where chunked and whole prompts give the same bits: greedy replies
and embeddings come out identical whether a prompt was cut into time-bounded chunks or computed whole."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from checkpoints import prompt_ids

from lse_backends.cpu import CPUDevice
from lse_core.devices.hookspec import CompileContext
from lse_core.embeddings import hidden_states
from lse_core.engine.engine import Engine
from lse_core.engine.scheduler import MIN_PREFILL_CHUNK, STEP_TARGET_S, Scheduler, StepCost
from lse_core.engine.sequence import SeqParams, Sequence
from lse_core.graph.plan import Plan
from lse_core.model.arch import build_graph
from lse_core.model.files import load_hf
from lse_core.model.model import Model
from lse_core.sampling import NEUTRAL_SAMPLING

# the fake clock: what a step costs on a made-up machine
DECODE_S = 0.004            # per decoding sequence
PER_TOKEN_S = 0.001         # per prompt token
PER_POSITION_S = 2e-7       # per prompt token per earlier position (attention)


def fake_step_seconds(decodes: int, chunks: list[tuple[int, int]]) -> float:
    return decodes * DECODE_S + sum(n * PER_TOKEN_S + (n * s + n * (n - 1) // 2) * PER_POSITION_S for s, n in chunks)


def sequence(prompt: list[int], max_new_tokens: int = 4) -> Sequence:
    params = SeqParams(prompt=prompt, max_new_tokens=max_new_tokens, limit_reason="max_tokens")
    return Sequence(params, lambda seq, delta: None, lambda seq: None, None, None)


def admitted(scheduler: Scheduler, prompt_len: int, computed: int) -> Sequence:
    """A sequence holding a slot, ``computed`` of its prompt done (prompt_len - 1: it decodes next step)."""
    first = 1 + 10_000 * len(scheduler.running)   # prompts of their own: no slot's cached prefix is shared
    seq = sequence(list(range(first, first + prompt_len)))
    scheduler.add(seq)
    scheduler.schedule()
    seq.computed = computed
    return seq


def run_fake_step(scheduler: Scheduler) -> tuple[list[tuple[Sequence, int]], float]:
    """Schedule a step, "run" it on the fake clock (prompts advance, decoders stay decoding), report its time."""
    batch = scheduler.schedule()
    starts = [seq.computed for seq, _ in batch]
    seconds = fake_step_seconds(sum(n == 1 for _, n in batch), [(s, n) for (_, n), s in zip(batch, starts) if n > 1])
    scheduler.observe(batch, starts, seconds)
    for seq, n in batch:
        if n > 1:
            seq.computed += n
    return batch, seconds


def measured_cost(decodes: int) -> StepCost:
    """A StepCost that has seen decode steps and prompt chunks at several contexts on the fake clock."""
    cost = StepCost()
    for _ in range(3):
        cost.observe(decodes, [], fake_step_seconds(decodes, []))
    for start, n in [(0, 512), (512, 512), (1024, 256), (2048, 100), (3000, 64)]:
        cost.observe(decodes, [(start, n)], fake_step_seconds(decodes, [(start, n)]))
    return cost


def test_the_cost_fit_recovers_the_clock_and_bounds_a_chunk() -> None:
    cost = measured_cost(decodes=8)
    assert cost.decode_s == pytest.approx(8 * DECODE_S)
    assert cost.per_token == pytest.approx(PER_TOKEN_S, rel=1e-6)
    assert cost.per_position == pytest.approx(PER_POSITION_S, rel=1e-6)
    for start in (0, 1000, 3500):
        n = cost.tokens_within(0.25, start)
        assert fake_step_seconds(0, [(start, n)]) <= 0.25 < fake_step_seconds(0, [(start, n + 1)])


def test_one_context_alone_fits_the_tokens_term() -> None:
    """Steps that cannot tell the two terms apart give a per-token cost, never a negative one."""
    cost = StepCost()
    cost.observe(0, [(0, 8)], 0.008)
    cost.observe(0, [(0, 8)], 0.010)
    assert cost.per_token > 0 and cost.per_position == 0
    assert cost.known


def test_with_decodes_a_prompt_chunk_fits_the_step_target() -> None:
    scheduler = Scheduler(n_slots=4, max_queue=4, prefill_chunk=512, cost=measured_cost(decodes=1))
    decoder = admitted(scheduler, 5, computed=4)
    prompt = admitted(scheduler, 4000, computed=0)
    chunks = []
    for start in (0, 3500):
        prompt.computed = start
        batch = dict(scheduler.schedule())
        assert batch[decoder] == 1
        chunks.append(batch[prompt])
        step = fake_step_seconds(1, [(start, batch[prompt])])
        assert step <= STEP_TARGET_S < fake_step_seconds(1, [(start, batch[prompt] + 1)])
    assert chunks[1] < chunks[0] < 512, "attention makes a later chunk of the prompt cost more per token"


def test_without_decodes_a_prompt_takes_its_full_chunk() -> None:
    scheduler = Scheduler(n_slots=4, max_queue=4, prefill_chunk=512, cost=measured_cost(decodes=1))
    prompt = admitted(scheduler, 4000, computed=3000)
    assert scheduler.schedule() == [(prompt, 512)]


def test_before_any_measurement_one_small_chunk_advances() -> None:
    scheduler = Scheduler(n_slots=4, max_queue=4, prefill_chunk=512)
    decoder = admitted(scheduler, 5, computed=4)
    first, second = admitted(scheduler, 1000, computed=0), admitted(scheduler, 1000, computed=0)
    assert scheduler.schedule() == [(decoder, 1), (first, MIN_PREFILL_CHUNK)]
    assert second.slot >= 0, "the second prompt holds a slot and waits for a later step"


def test_a_fit_from_small_chunks_is_trusted_only_for_twice_their_size() -> None:
    cost = StepCost()
    cost.observe(1, [], DECODE_S)
    cost.observe(1, [(0, 20)], fake_step_seconds(1, [(0, 20)]))
    scheduler = Scheduler(n_slots=4, max_queue=4, prefill_chunk=512, cost=cost)
    admitted(scheduler, 5, computed=4)
    prompt = admitted(scheduler, 4000, computed=0)
    assert dict(scheduler.schedule())[prompt] == 40


def test_on_the_fake_clock_every_step_stays_within_the_target() -> None:
    """8 streams decode while a 3,800-token prompt arrives: from a fresh estimate, no step takes longer than the
    target, and once measured the prompt's chunks fill most of it (the prompt is not starved)."""
    scheduler = Scheduler(n_slots=10, max_queue=4, prefill_chunk=512)
    for _ in range(8):
        admitted(scheduler, 5, computed=4)
    for _ in range(3):
        run_fake_step(scheduler)
    prompt = admitted(scheduler, 3800, computed=0)
    steps = []
    while prompt.prefilling:
        batch, seconds = run_fake_step(scheduler)
        assert sum(n == 1 for _, n in batch) == 8
        steps.append(seconds)
    assert max(steps) <= STEP_TARGET_S
    assert min(steps[6:-1]) > 0.8 * STEP_TARGET_S, steps


# ---- the engine on a deterministic CPU plan ----

N_NEW = 6


@pytest.fixture(scope="module")
def model(llama_checkpoint: Path) -> Model:
    return load_hf(str(llama_checkpoint))


def deterministic_engine(model: Model) -> Engine:
    """An engine whose rows get the same bits however a step is made up, prompts in chunks of up to 64."""
    device = CPUDevice()
    ctx = CompileContext(kv_slots=4, kv_len=128, max_tokens=72, deterministic=True)
    plan = Plan.build(build_graph(model), pool=[device], ctx=ctx, fallback_device=device, allow_fallback=True)
    return Engine(plan, model.tokenizer, n_slots=4, max_queue=8, prefill_chunk=64)


def greedy(prompt: list[int], n: int) -> SeqParams:
    return SeqParams(prompt=prompt, max_new_tokens=n, limit_reason="max_tokens",
                     sampling=replace(NEUTRAL_SAMPLING, temperature=0.0))


def finished(engine: Engine, params: SeqParams) -> Sequence:
    done = threading.Event()
    seq = engine.submit(params, lambda s, d: None, lambda s: done.set())
    assert done.wait(300)
    return seq


def while_decoding(engine: Engine, work: Callable[[], object]) -> tuple[object, list[list[tuple[int, int]]]]:
    """Run ``work`` while another sequence decodes, every step of it held to no time (so prompts go in the
    smallest chunks); returns its result and each step's (start, tokens) per sequence."""
    steps: list[list[tuple[int, int]]] = []
    observe = engine.scheduler.observe

    def record(batch: list[tuple[Sequence, int]], starts: list[int], seconds: float) -> None:
        steps.append([(start, n) for (_, n), start in zip(batch, starts)])
        observe(batch, starts, seconds)

    engine.scheduler.observe = record
    engine.scheduler.step_target_s = 0.0
    decoding = threading.Event()
    decoder = engine.submit(greedy([5, 6, 7], 120), lambda s, d: decoding.set(), lambda s: None)
    assert decoding.wait(300)
    try:
        return work(), steps
    finally:
        engine.cancel(decoder)


def continued_beside_a_decode(steps: list[list[tuple[int, int]]]) -> bool:
    """Whether a step with a decode took a prompt chunk that continues an earlier chunk of the prompt."""
    return any(start > 0 and n > 1 for step in steps if (1 in (n for _, n in step)) for start, n in step)


def test_a_chunked_prompt_gives_the_greedy_reply_of_the_whole_one(model: Model, llama_checkpoint: Path) -> None:
    prompt = prompt_ids(llama_checkpoint, "The quick brown fox jumps over the lazy dog. " * 5)
    assert MIN_PREFILL_CHUNK < len(prompt) <= 64
    engine = deterministic_engine(model)
    try:
        whole = finished(engine, greedy(prompt, N_NEW)).output
    finally:
        engine.close()
    engine = deterministic_engine(model)
    try:
        seq, steps = while_decoding(engine, lambda: finished(engine, greedy(prompt, N_NEW)))
    finally:
        engine.close()
    assert continued_beside_a_decode(steps)
    assert seq.output == whole


def test_embeddings_split_beside_decodes_equal_the_whole_ones(model: Model, llama_checkpoint: Path) -> None:
    texts = ["Paris is the capital of France. " * 6, "Hi", "Tokens are sampled with temperature. " * 4]
    prompts = [prompt_ids(llama_checkpoint, t) for t in texts]
    assert max(len(p) for p in prompts) <= 64 < sum(len(p) for p in prompts)
    engine = deterministic_engine(model)
    try:
        whole, _ = hidden_states(engine, prompts, window=2)
    finally:
        engine.close()
    engine = deterministic_engine(model)
    try:
        (split, _), steps = while_decoding(engine, lambda: hidden_states(engine, prompts, window=2))
    finally:
        engine.close()
    assert continued_beside_a_decode(steps)
    for a, b in zip(split, whole):
        np.testing.assert_array_equal(a, b)
