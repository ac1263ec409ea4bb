"""/metrics: lse_core's counters in the Prometheus text exposition format (version 0.0.4)."""

from __future__ import annotations

import math

from lse_core.api import LSE
from lse_core.stats import Stats


def prometheus_text(engines: list[tuple[str, Stats, LSE | None]], uptime_s: float) -> str:
    """``engines``: each model's id, request counters and LSE handle while it is open (ModelSet.engines).
    With several models, each sample of a model carries its ``model`` label; one model's carry none."""
    out: list[str] = []
    labelled = len(engines) > 1
    models = [({"model": model_id} if labelled else {}, stats.to_json(), lse) for model_id, stats, lse in engines]
    loaded = [(labels, lse.engine.load, lse.fallback.to_json()) for labels, _, lse in models if lse is not None]

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, dict[str, str], float]]) -> None:
        out.append(f"# HELP {name} {help_text}")
        out.append(f"# TYPE {name} {kind}")
        out.extend(f"{name}{suffix}{_labels(labels)} {_value(value)}" for suffix, labels, value in samples)

    def each_model(field: str) -> list[tuple[str, dict[str, str], float]]:
        return [("", labels, stats[field]) for labels, stats, _ in models]

    def each_engine(field: str) -> list[tuple[str, dict[str, str], float]]:
        return [("", labels, load[field]) for labels, load, _ in loaded]

    metric("lse_requests_total", "counter", "Completion requests by endpoint and outcome.",
           [("", labels | {"endpoint": r["endpoint"], "outcome": r["outcome"]}, r["count"])
            for labels, stats, _ in models for r in stats["requests"]])
    metric("lse_prompt_tokens_total", "counter", "Prompt tokens of finished requests, cached ones included.",
           each_model("prompt_tokens"))
    metric("lse_cached_prompt_tokens_total", "counter", "Prompt tokens whose KV cache was reused.",
           each_model("cached_tokens"))
    metric("lse_completion_tokens_total", "counter", "Generated tokens.", each_model("completion_tokens"))
    histogram: list[tuple[str, dict[str, str], float]] = []
    for labels, stats, _ in models:
        latency = stats["latency_seconds"]
        histogram += [("_bucket", labels | {"le": _value(b["le"])}, b["count"]) for b in latency["buckets"]]
        histogram += [("_sum", labels, latency["sum"]), ("_count", labels, latency["buckets"][-1]["count"])]
    metric("lse_request_duration_seconds", "histogram", "Time from a request's arrival to its last token.", histogram)
    metric("lse_time_to_first_token_seconds", "summary", "Time from a request's arrival to its first token.",
           [(suffix, labels, stats["time_to_first_token_seconds"][key]) for labels, stats, _ in models
            for suffix, key in (("_sum", "sum"), ("_count", "count"))])
    metric("lse_requests_running", "gauge", "Sequences holding a KV slot.", each_engine("running"))
    metric("lse_requests_waiting", "gauge", "Requests queued for a KV slot.", each_engine("waiting"))
    metric("lse_requests_paused", "gauge", "Sequences holding a KV slot whose stream's client is not reading.",
           each_engine("paused"))
    metric("lse_kv_slots", "gauge", "KV cache slots (sequences per batch).", each_engine("slots"))
    metric("lse_kv_slots_free", "gauge", "KV cache slots not held by a sequence.", each_engine("free_slots"))
    metric("lse_model_loaded", "gauge", "1 while the model is open (loaded), 0 otherwise.",
           [("", labels, int(lse is not None)) for labels, _, lse in models])
    metric("lse_cpu_fallback_allowed", "gauge", "1 when operations without a device kernel may run on the CPU.",
           [("", labels, int(fallback["allowed"])) for labels, _, fallback in loaded])
    metric("lse_cpu_fallback_total", "counter", "Runs of a fused group on the CPU interpreter, by cause.",
           [("", labels | {"cause": e["cause"]}, e["count"]) for labels, _, fallback in loaded
            for e in fallback["events"]])
    metric("lse_uptime_seconds", "gauge", "Seconds since the server started.", [("", {}, round(uptime_s, 3))])
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
