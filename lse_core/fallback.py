"""CPU-fallback accounting: the counters lse_status reports and the power-of-two log line."""

from __future__ import annotations

import logging
import threading
from typing import Any

log = logging.getLogger("lse")


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
            events = [{"cause": c, "count": n} for c, n in self._counts.items()]
        return {"allowed": self.allowed, "total": sum(e["count"] for e in events), "events": events}

