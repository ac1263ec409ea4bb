"""Continuous batching: sequences wait in a bounded queue for a KV slot; each step takes one
token from every decoding sequence and a chunk of prompt from those still prefilling."""

from __future__ import annotations

import time
from collections import deque

from lse_core.engine.kv_slots import KVSlots
from lse_core.engine.sequence import Sequence
from lse_core.errors import server_error


class Scheduler:
    def __init__(self, n_slots: int, max_queue: int, prefill_chunk: int) -> None:
        self.slots = KVSlots(n_slots)
        self.max_queue = max_queue
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def has_work(self) -> bool:
        """Whether a step would do something: a sequence to decode, admit or end (a paused one waits)."""
        return (any(s.cancelled for s in self.waiting) or bool(self.waiting and self.slots.n_free)
                or any(s.cancelled or not s.paused for s in self.running))

    def add(self, seq: Sequence) -> None:
        if len(self.waiting) >= self.max_queue:
            raise server_error(f"the server is busy: {len(self.running)} sequences are running and "
                               f"{len(self.waiting)} requests are waiting; retry later",
                               code="overloaded", status=503)
        self.waiting.append(seq)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """This step's batch: (sequence, tokens to compute). Cancelled sequences end here."""
        for seq in [s for s in self.waiting if s.cancelled]:
            self.waiting.remove(seq)
            seq.end_cancelled()
        for seq in [s for s in self.running if s.cancelled]:
            self.release(seq)
            seq.end_cancelled()
        while self.waiting and self.slots.n_free:
            seq = self.waiting.popleft()
            seq.slot, seq.cached = self.slots.acquire(seq.params.prompt)
            if seq.params.on_hidden is not None:   # embeddings pool every row: none may come from the cache
                seq.cached = 0
            seq.computed = seq.cached
            seq.t_admit = time.perf_counter()
            self.running.append(seq)
        batch = []
        budget = self.prefill_chunk
        for seq in self.running:
            if seq.paused:   # its client is not reading: it keeps its slot and its place, and computes nothing
                continue
            remaining = len(seq.tokens) - seq.computed
            if remaining == 1:
                batch.append((seq, 1))
            elif budget > 0:
                n = min(remaining, budget)
                budget -= n
                batch.append((seq, n))
        return batch

    def release(self, seq: Sequence) -> None:
        """Free the sequence's slot, remembering the tokens its cache now holds."""
        if seq in self.running:
            self.running.remove(seq)
            self.slots.release(seq.slot, seq.tokens[: seq.computed])
