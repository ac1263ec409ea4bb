"""The engine: owns the plan and the step loop thread; requests come in as sequences."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import numpy as np
from typing_extensions import TypedDict

from lse_core.adapters.common import Count
from lse_core.engine.runner import Runner, sampling_arrays
from lse_core.engine.scheduler import Scheduler
from lse_core.engine.sequence import Delta, SeqParams, Sequence
from lse_core.engine.speculation import Speculation
from lse_core.errors import server_error
from lse_core.graph.ir import PENALTY_WINDOW, SAMPLING_OP_NEEDED
from lse_core.graph.plan import Plan

log = logging.getLogger("lse")


class EngineLoad(TypedDict):
    """The scheduler's requests and KV slots, as lse_status and /metrics read them."""

    running: Count
    waiting: Count
    paused: Count
    slots: Count
    free_slots: Count


class Engine:
    def __init__(self, plan: Plan, tokenizer, n_slots: int, max_queue: int, prefill_chunk: int,
                 speculation: Speculation | None = None) -> None:
        self.plan = plan
        self.tokenizer = tokenizer
        self.runner = Runner(plan)
        self.scheduler = Scheduler(n_slots, max_queue, prefill_chunk, speculation=speculation)
        self._cond = threading.Condition()
        self._stopping = False
        self.steps = 0
        self._thread = threading.Thread(target=self._loop, name="lse-engine", daemon=True)
        self._thread.start()

    def submit(self, params: SeqParams, on_delta: Callable[[Sequence, Delta], None],
               on_finish: Callable[[Sequence], None]) -> Sequence:
        """Queue a sequence; raises LSEError (503 when the queue is full, 500 when it needs a
        group that may not run because CPU fallback is refused). The caller bounds the reply by the
        context (lse_core.limits); a sequence that could outgrow its KV slot is a caller's bug."""
        if len(params.prompt) + params.max_new_tokens > self.plan.ctx.kv_len:
            raise ValueError(f"{len(params.prompt)} prompt + {params.max_new_tokens} reply tokens exceed "
                             f"the context of {self.plan.ctx.kv_len}")
        refusal = self.plan.refusal(_sampling_ops(params))
        if refusal is not None:
            raise server_error(f"CPU fallback disabled: {refusal}")
        seq = Sequence(params, on_delta, on_finish, self.tokenizer.decode_stream(params.skip_special_tokens),
                       self.tokenizer.backend)
        with self._cond:
            if self._stopping:
                raise server_error("the engine is closed", status=503)
            self.scheduler.add(seq)
            self._cond.notify()
        return seq

    def cancel(self, seq: Sequence, error: Exception | None = None) -> None:
        """End the sequence at the next step: cancelled, or with ``error`` as its failure."""
        seq.cancel(error)
        with self._cond:
            self._cond.notify()

    def pause(self, seq: Sequence, paused: bool = True) -> None:
        """Stop (or, with ``paused=False``, resume) decoding the sequence; it keeps its KV slot."""
        with self._cond:
            seq.paused = paused
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            for seq in list(self.scheduler.waiting) + list(self.scheduler.running):
                seq.cancel()
            self._cond.notify()
        self._thread.join(timeout=30)

    @property
    def load(self) -> EngineLoad:
        with self._cond:
            return EngineLoad(running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
                              paused=sum(s.paused for s in self.scheduler.running),
                              slots=self.scheduler.slots.n_free + len(self.scheduler.running),
                              free_slots=self.scheduler.slots.n_free)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self.scheduler.has_work and not self._stopping:
                    self._cond.wait()
                if self._stopping and not self.scheduler.has_work:
                    return
                batch = self.scheduler.schedule()
            if not batch:
                continue
            starts = [seq.computed for seq, _ in batch]
            began = time.perf_counter()
            self.runner.run(batch)
            seconds = time.perf_counter() - began
            self.steps += 1
            with self._cond:
                self.scheduler.observe(batch, starts, seconds)
                for seq, _ in batch:
                    if seq.finished:
                        self.scheduler.release(seq)


def _sampling_ops(params: SeqParams) -> set[str]:
    """The sampling ops this request's parameters need."""
    one = sampling_arrays([params.sampling], np.full((1, PENALTY_WINDOW), -1, dtype=np.int32), np.zeros(1, np.float32))
    one.constrained = np.array([params.constraint is not None])
    return {op for op, needed in SAMPLING_OP_NEEDED.items() if needed(one)[0]}
