"""CPU-fallback accounting: the counters lse_status reports and the power-of-two log line."""

from __future__ import annotations

import logging
import threading
from typing import Any

from pydantic import TypeAdapter
from pydantic.dataclasses import dataclass as pydantic_dataclass

from lse_core.adapters.common import REPLY_PART, Count

log = logging.getLogger("lse")


@pydantic_dataclass(frozen=True)
class FallbackEvent:
    cause: str
    count: Count


@pydantic_dataclass(config=REPLY_PART)
class CPUFallback:
    """An engine's CPU-fallback counters, as lse_status and /metrics read them."""

    allowed: bool
    total: Count
    events: list[FallbackEvent]


_CPU_FALLBACK = TypeAdapter(CPUFallback)


class FallbackLog:
    def __init__(self, allowed: bool) -> None:
        self.allowed = allowed
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def record(self, cause: str) -> None:
        """One run of a group on the CPU interpreter; logs the first time and at every power of two."""
        with self._lock:
            n = self._counts.get(cause, 0) + 1
            self._counts[cause] = n
        if n & (n - 1) == 0:
            log.warning("lse: CPU FALLBACK (%d so far for this cause): %s", n, cause)

    def to_json(self) -> dict[str, Any]:
        with self._lock:
            events = [FallbackEvent(c, n) for c, n in self._counts.items()]
        total = sum(e.count for e in events)
        return _CPU_FALLBACK.dump_python(CPUFallback(self.allowed, total, events))

