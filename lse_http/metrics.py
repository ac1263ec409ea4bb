"""/metrics: lse_core's counters in the Prometheus text exposition format (version 0.0.4)."""

from __future__ import annotations

import math
from typing import Any


def prometheus_text(stats: dict[str, Any], load: dict[str, int], fallback: dict[str, Any]) -> str:
    """``stats`` is Stats.to_json(), ``load`` the engine's running/waiting/slots/free_slots,
    ``fallback`` FallbackLog.to_json()."""
    out: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, dict[str, str], float]]) -> None:
        out.append(f"# HELP {name} {help_text}")
        out.append(f"# TYPE {name} {kind}")
        out.extend(f"{name}{suffix}{_labels(labels)} {_value(value)}" for suffix, labels, value in samples)

    metric("lse_requests_total", "counter", "Completion requests by endpoint and outcome.",
           [("", {"endpoint": r["endpoint"], "outcome": r["outcome"]}, r["count"]) for r in stats["requests"]])
    metric("lse_prompt_tokens_total", "counter", "Prompt tokens of finished requests, cached ones included.",
           [("", {}, stats["prompt_tokens"])])
    metric("lse_cached_prompt_tokens_total", "counter", "Prompt tokens whose KV cache was reused.",
           [("", {}, stats["cached_tokens"])])
    metric("lse_completion_tokens_total", "counter", "Generated tokens.", [("", {}, stats["completion_tokens"])])
    latency = stats["latency_seconds"]
    buckets = [("_bucket", {"le": _value(b["le"])}, b["count"]) for b in latency["buckets"]]
    metric("lse_request_duration_seconds", "histogram", "Time from a request's arrival to its last token.",
           [*buckets, ("_sum", {}, latency["sum"]), ("_count", {}, latency["buckets"][-1]["count"])])
    ttft = stats["time_to_first_token_seconds"]
    metric("lse_time_to_first_token_seconds", "summary", "Time from a request's arrival to its first token.",
           [("_sum", {}, ttft["sum"]), ("_count", {}, ttft["count"])])
    metric("lse_requests_running", "gauge", "Sequences holding a KV slot.", [("", {}, load["running"])])
    metric("lse_requests_waiting", "gauge", "Requests queued for a KV slot.", [("", {}, load["waiting"])])
    metric("lse_requests_paused", "gauge", "Sequences holding a KV slot whose stream's client is not reading.",
           [("", {}, load["paused"])])
    metric("lse_kv_slots", "gauge", "KV cache slots (sequences per batch).", [("", {}, load["slots"])])
    metric("lse_kv_slots_free", "gauge", "KV cache slots not held by a sequence.", [("", {}, load["free_slots"])])
    metric("lse_cpu_fallback_allowed", "gauge", "1 when operations without a device kernel may run on the CPU.",
           [("", {}, int(fallback["allowed"]))])
    metric("lse_cpu_fallback_total", "counter", "Runs of a fused group on the CPU interpreter, by cause.",
           [("", {"cause": e["cause"]}, e["count"]) for e in fallback["events"]])
    metric("lse_uptime_seconds", "gauge", "Seconds since the engine opened.", [("", {}, stats["uptime_s"])])
    return "\n".join(out) + "\n"


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _value(value: float) -> str:
    if isinstance(value, float) and math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value) if isinstance(value, float) else str(value)
