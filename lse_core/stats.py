"""Request and token counters for lse_status and the server's /metrics."""

from __future__ import annotations

import threading
import time
from typing import Literal

from typing_extensions import TypedDict

from lse_core.adapters.common import Count

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, float("inf"))


class RequestCount(TypedDict):
    endpoint: str
    outcome: str
    count: Count


class LatencyBucket(TypedDict):
    le: float | Literal["+Inf"]
    count: Count     # cumulative


class Latency(TypedDict):
    sum: float
    buckets: list[LatencyBucket]


class TimeToFirstToken(TypedDict):
    sum: float
    count: Count


class RequestStats(TypedDict):
    """A model's request and token counters (Stats.to_json), as lse_status and /metrics read them."""

    uptime_s: float
    requests: list[RequestCount]
    prompt_tokens: Count
    cached_tokens: Count
    completion_tokens: Count
    latency_seconds: Latency
    time_to_first_token_seconds: TimeToFirstToken


class Stats:
    def __init__(self) -> None:
        self.started = time.time()
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str], int] = {}     # (endpoint, outcome) -> count
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.latency_buckets = [0] * len(LATENCY_BUCKETS)
        self.latency_sum = 0.0
        self.ttft_sum = 0.0
        self.ttft_count = 0

    def record(self, endpoint: str, outcome: str, prompt: int = 0, cached: int = 0, completion: int = 0,
               seconds: float | None = None, ttft: float | None = None) -> None:
        with self._lock:
            key = (endpoint, outcome)
            self.requests[key] = self.requests.get(key, 0) + 1
            self.prompt_tokens += prompt
            self.cached_tokens += cached
            self.completion_tokens += completion
            if seconds is not None:
                self.latency_sum += seconds
                for i, bound in enumerate(LATENCY_BUCKETS):
                    if seconds <= bound:
                        self.latency_buckets[i] += 1
            if ttft is not None:
                self.ttft_sum += ttft
                self.ttft_count += 1

    def to_json(self) -> RequestStats:
        with self._lock:
            return RequestStats(
                uptime_s=round(time.time() - self.started, 3),
                requests=[RequestCount(endpoint=e, outcome=o, count=n) for (e, o), n in sorted(self.requests.items())],
                prompt_tokens=self.prompt_tokens,
                cached_tokens=self.cached_tokens,
                completion_tokens=self.completion_tokens,
                latency_seconds=Latency(sum=round(self.latency_sum, 6), buckets=[
                    LatencyBucket(le="+Inf" if b == float("inf") else b, count=n)
                    for b, n in zip(LATENCY_BUCKETS, self.latency_buckets)]),
                time_to_first_token_seconds=TimeToFirstToken(sum=round(self.ttft_sum, 6), count=self.ttft_count),
            )
