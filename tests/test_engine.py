"""The engine on the CPU interpreter: continuous batching gives each sequence exactly the ids it
gets alone, prompts are chunked, slots are freed on cancel and reused for shared prefixes, and
stop strings never leak into the text, even when they straddle tokens."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
from checkpoints import cpu_plan, lse_greedy, prompt_ids

from lse_core.engine.engine import Engine
from lse_core.engine.sequence import Delta, SeqParams, Sequence
from lse_core.errors import LSEError
from lse_core.model.files import load_hf
from lse_core.sampling import NEUTRAL_SAMPLING

PROMPTS = ["The quick brown fox", "def add(a, b):", "Hello", "Once upon a time, in a land far away, there"]


@pytest.fixture(scope="module")
def model(llama_checkpoint):
    return load_hf(str(llama_checkpoint))


def run(engine: Engine, params_list: list[SeqParams]) -> list:
    """Submit every request at once and wait for all; returns the finished sequences."""
    left = threading.Semaphore(0)
    seqs = [engine.submit(p, lambda s, d: None, lambda s: left.release()) for p in params_list]
    for _ in seqs:
        assert left.acquire(timeout=300)
    return seqs


def greedy(prompt: list[int], n: int, **kw) -> SeqParams:
    return SeqParams(prompt=prompt, max_new_tokens=n, limit_reason="max_tokens",
                     sampling=replace(NEUTRAL_SAMPLING, temperature=0.0), **kw)


def test_batched_decode_equals_each_alone(model, llama_checkpoint):
    prompts = [prompt_ids(llama_checkpoint, p) for p in PROMPTS]
    assert len({len(p) for p in prompts}) == len(prompts), "prompt lengths should differ"
    alone = [lse_greedy(model, p, 12)[0] for p in prompts]
    engine = Engine(cpu_plan(model, kv_slots=4), model.tokenizer, n_slots=4, max_queue=8, prefill_chunk=7)
    try:
        seqs = run(engine, [greedy(p, 12) for p in prompts])
    finally:
        engine.close()
    assert [s.output for s in seqs] == alone
    assert all(s.stop_reason == "max_tokens" and s.finish_reason == "length" for s in seqs)


def test_more_requests_than_slots_wait_and_all_finish(model, llama_checkpoint):
    prompts = [prompt_ids(llama_checkpoint, p) for p in PROMPTS] * 2
    engine = Engine(cpu_plan(model, kv_slots=2), model.tokenizer, n_slots=2, max_queue=8, prefill_chunk=64)
    try:
        seqs = run(engine, [greedy(p, 6) for p in prompts])
        assert [s.output for s in seqs[:4]] == [s.output for s in seqs[4:]]
        assert engine.scheduler.slots.n_free == 2
    finally:
        engine.close()


def test_queue_full_is_503(model, llama_checkpoint):
    prompt = prompt_ids(llama_checkpoint, PROMPTS[0])
    engine = Engine(cpu_plan(model, kv_slots=1), model.tokenizer, n_slots=1, max_queue=1, prefill_chunk=64)
    started, release = threading.Event(), threading.Event()

    def hold(seq: Sequence, delta: Delta) -> None:     # the engine thread waits here: the slot stays taken
        started.set()
        release.wait(60)

    try:
        running = engine.submit(greedy(prompt, 4), hold, lambda s: None)
        assert started.wait(60)                      # it holds the only slot
        waiting = engine.submit(greedy(prompt, 4), lambda s, d: None, lambda s: None)
        with pytest.raises(LSEError) as info:
            engine.submit(greedy(prompt, 4), lambda s, d: None, lambda s: None)
        assert info.value.status == 503 and info.value.body()["error"]["type"] == "server_error"
        engine.cancel(running)
        engine.cancel(waiting)
    finally:
        release.set()
        engine.close()


def test_cancel_frees_the_slot_and_prefix_is_reused(model, llama_checkpoint):
    prompt = prompt_ids(llama_checkpoint, PROMPTS[3])
    engine = Engine(cpu_plan(model, kv_slots=1), model.tokenizer, n_slots=1, max_queue=4, prefill_chunk=64)
    try:
        finished = threading.Event()
        # cancelled from its first token's callback, so it cannot end first by filling the context
        seq = engine.submit(greedy(prompt, engine.plan.ctx.kv_len - len(prompt)), lambda s, d: engine.cancel(s),
                            lambda s: finished.set())
        assert finished.wait(60)
        assert seq.stop_reason == "cancelled" and seq.finish_reason is None
        assert engine.scheduler.slots.n_free == 1
        again = run(engine, [greedy(prompt, 5)])[0]
        assert again.cached == len(prompt) - 1          # the slot still held this prompt's K/V
        assert again.output == lse_greedy(model, prompt, 5)[0]
    finally:
        engine.close()


def test_a_reply_that_could_outgrow_the_context_is_refused(model, llama_checkpoint):
    prompt = prompt_ids(llama_checkpoint, PROMPTS[0])
    engine = Engine(cpu_plan(model, kv_slots=1), model.tokenizer, n_slots=1, max_queue=1, prefill_chunk=64)
    try:
        with pytest.raises(ValueError, match="exceed the context of 128"):
            engine.submit(greedy(prompt, 129 - len(prompt)), lambda s, d: None, lambda s: None)
        assert run(engine, [greedy(prompt, 128 - len(prompt))])[0].stop_reason == "max_tokens"
    finally:
        engine.close()


def test_stop_string_across_tokens_never_appears(model, llama_checkpoint):
    prompt = prompt_ids(llama_checkpoint, PROMPTS[1])
    engine = Engine(cpu_plan(model), model.tokenizer, n_slots=1, max_queue=4, prefill_chunk=64)
    try:
        free = run(engine, [greedy(prompt, 24)])[0]
        text = model.tokenizer.decode(free.output, skip_special_tokens=True)
        # a stop string made of the end of one token and the start of the next
        pieces = [model.tokenizer.decode([t], skip_special_tokens=True) for t in free.output]
        i = next(i for i in range(3, len(pieces) - 1) if pieces[i] and pieces[i + 1])
        stop = pieces[i][-1] + pieces[i + 1][:1]
        deltas: list[str] = []
        done = threading.Event()
        seq = engine.submit(greedy(prompt, 24, stop=[stop]),
                            lambda s, d: deltas.append(d.content), lambda s: done.set())
        assert done.wait(60)
        expected = text[: text.index(stop)]
        assert seq.stop_reason == "stop_sequence" and "".join(deltas) == expected
        assert all(stop not in "".join(deltas[:k]) for k in range(len(deltas) + 1))
    finally:
        engine.close()
