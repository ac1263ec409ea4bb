"""The spec's CPU fallback and --no-cpu-fallback sections, row by row, over the in-process API,
with the example plugin lse-hrx (a simulated accelerator with a deliberately partial kernel set:
HRX_MISSING names the ops it has no kernel for) and LSE_BACKENDS choosing which backends load."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from lse_core.api import EVENT_END, EVENT_ERROR, lse_close, lse_open, lse_open_or_raise, lse_request_iter, lse_status
from lse_core.config import LSEConfig
from lse_core.errors import StartupError

BODY = {"prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0}


@pytest.fixture
def hrx(monkeypatch):
    """One simulated hrx device, missing the kernels named; returns a setter."""
    monkeypatch.setenv("HRX_DEVICES", "1")
    monkeypatch.delenv("LSE_REQUIRE_DEVICE_KERNELS", raising=False)

    def missing(ops: str) -> None:
        monkeypatch.setenv("HRX_MISSING", ops)

    missing("silu")
    return missing


def open_engine(path, **options):
    return lse_open_or_raise(LSEConfig(model=str(path), kv_len=64, parallel=2, **options))


def complete(lse, **fields) -> tuple[str, dict]:
    """(kind of the last event, its data) for one completion."""
    events = list(lse_request_iter(lse, {**BODY, **fields}, "completion"))
    return events[-1].kind, events[-1].data | ({"status": events[-1].status} if events[-1].kind == EVENT_ERROR else {})


def silu_cause(lse) -> str:
    causes = [p.fallback_cause for p in lse.plan.placements if p.fallback_cause and "silu" in p.fallback_cause]
    assert causes, "the plan should place the silu group on the CPU interpreter"
    return causes[0]


def test_fallback_is_reported_in_the_log_the_response_and_the_status(llama_checkpoint, hrx, caplog):
    lse = open_engine(llama_checkpoint, pool="hrx:0")
    try:
        cause = silu_cause(lse)
        assert cause.startswith("fused group ") and "(2 nodes: silu, mul)" in cause
        assert cause.endswith("hrx:0: no kernel for silu")
        with caplog.at_level(logging.WARNING, logger="lse"):
            kind, data = complete(lse)
        assert kind == EVENT_END
        # the group runs once per step: one prefill step, then one per further token
        warning = next(w for w in data["lse_warnings"] if w["cause"] == cause)
        assert warning == {"type": "cpu_fallback", "cause": cause, "count": BODY["max_tokens"]}
        logged = [r.getMessage() for r in caplog.records if "CPU FALLBACK" in r.getMessage()]
        # the first time and at each power of two, per cause
        counts = sorted(int(m.split("(")[1].split()[0]) for m in logged if m.endswith(cause))
        assert counts == [1, 2, 4]
        assert all(m.startswith("lse: CPU FALLBACK (") for m in logged)
        fb = lse_status(lse)["engine"]["cpu_fallback"]
        assert fb["allowed"] is True
        assert {"cause": cause, "count": BODY["max_tokens"]} in fb["events"]
        assert fb["total"] == sum(e["count"] for e in fb["events"])
    finally:
        lse_close(lse)


def test_streamed_warnings_are_in_the_final_chunk(llama_checkpoint, hrx):
    lse = open_engine(llama_checkpoint, pool="hrx:0")
    try:
        events = list(lse_request_iter(lse, {**BODY, "stream": True}, "completion"))
        assert all("lse_warnings" not in e.data for e in events[:-1])
        final = events[-1].data[0]
        assert final["choices"][0]["finish_reason"] == "length"
        assert any(w["cause"] == silu_cause(lse) for w in final["lse_warnings"])
    finally:
        lse_close(lse)


def test_a_sampling_choice_decides_the_fallback(llama_checkpoint, hrx):
    hrx("")         # the whole model on hrx; it has no top_p kernel
    lse = open_engine(llama_checkpoint, pool="hrx:0")
    try:
        _, greedy = complete(lse)
        assert "lse_warnings" not in greedy
        _, nucleus = complete(lse, temperature=1.0, top_p=0.9, seed=1)
        assert [w["cause"].split("; ")[0].split(" (")[1] for w in nucleus["lse_warnings"]] == ["1 node: top_p)"]
    finally:
        lse_close(lse)


# ---- --no-cpu-fallback, the spec's table row by row ----

def test_no_device_backend_without_the_option_runs_on_cpu_with_a_warning(llama_checkpoint, monkeypatch, caplog):
    monkeypatch.setenv("LSE_BACKENDS", "cuda")          # cuda declines: no GPU here
    with caplog.at_level(logging.WARNING, logger="lse"):
        lse = open_engine(llama_checkpoint)
    try:
        assert [d.info.name for d in lse.devices] == ["cpu:0"]
        warning = next(r.getMessage() for r in caplog.records if "no device backend came up" in r.getMessage())
        assert "cuda: " in warning
        assert complete(lse)[0] == EVENT_END
    finally:
        lse_close(lse)


@pytest.mark.parametrize("switch", ["option", "config_dict", "env"])
def test_no_device_backend_with_the_option_fails_startup(llama_checkpoint, monkeypatch, caplog, switch):
    monkeypatch.setenv("LSE_BACKENDS", "cuda")
    config = {"model": str(llama_checkpoint), "kv_len": 64}
    if switch == "env":
        monkeypatch.setenv("LSE_REQUIRE_DEVICE_KERNELS", "1")
    else:
        config["disable_cpu_fallback"] = 1 if switch == "config_dict" else True
    with caplog.at_level(logging.ERROR, logger="lse"):
        assert lse_open(config) is None
    message = next(r.getMessage() for r in caplog.records if "startup failed" in r.getMessage())
    assert "no device backend came up and CPU fallback is disabled (--no-cpu-fallback)" in message
    assert "cuda: " in message


def test_pool_cpu_is_a_member_without_the_option_and_refused_with_it(llama_checkpoint):
    lse = open_engine(llama_checkpoint, pool="cpu:0")
    try:
        assert complete(lse)[0] == EVENT_END
        assert lse_status(lse)["engine"]["cpu_fallback"]["total"] == 0   # a pool member is no fallback
    finally:
        lse_close(lse)
    with pytest.raises(StartupError, match=r"^device cpu:0 is refused: it has no device code generator"):
        open_engine(llama_checkpoint, pool="cpu:0", disable_cpu_fallback=True)


@pytest.mark.parametrize("refuse", [False, True])
def test_pool_device_that_does_not_come_up_fails_startup(llama_checkpoint, monkeypatch, refuse):
    monkeypatch.setenv("HRX_DEVICES", "0")
    with pytest.raises(StartupError, match=r"device hrx:0 did not come up"):
        open_engine(llama_checkpoint, pool="hrx:0", disable_cpu_fallback=refuse)


def test_missing_kernel_with_the_option_fails_the_request_and_the_next_runs(llama_checkpoint, hrx):
    hrx("")
    lse = open_engine(llama_checkpoint, pool="hrx:0", disable_cpu_fallback=True)
    try:
        kind, error = complete(lse, temperature=1.0, top_p=0.9)
        assert kind == EVENT_ERROR and error["status"] == 500
        assert error["error"]["type"] == "server_error"
        assert error["error"]["message"].startswith("CPU fallback disabled: fused group ")
        assert "top_p" in error["error"]["message"]
        streamed = list(lse_request_iter(lse, {**BODY, "stream": True, "top_p": 0.5, "temperature": 1}, "completion"))
        assert streamed[-1].kind == EVENT_ERROR and streamed[-1].status == 500
        kind, ok = complete(lse)                 # the engine stayed loaded
        assert kind == EVENT_END and ok["choices"][0]["finish_reason"] == "length"
        assert lse_status(lse)["engine"]["cpu_fallback"] == {"allowed": False, "total": 0, "events": []}
    finally:
        lse_close(lse)


def test_env_switch_is_not_overridden_by_leaving_out_the_option(llama_checkpoint, hrx, monkeypatch):
    monkeypatch.setenv("LSE_REQUIRE_DEVICE_KERNELS", "1")
    with pytest.raises(StartupError, match="device cpu:0 is refused"):
        open_engine(llama_checkpoint, pool="cpu:0", disable_cpu_fallback=False)


def test_lse_exits_1_with_a_one_line_reason(llama_checkpoint):
    result = subprocess.run([sys.executable, "-m", "lse_core.cli", "-m", str(llama_checkpoint), "--raw", "-p", "hi",
                             "--pool", "cpu:0", "--no-cpu-fallback"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith("lse: device cpu:0 is refused")
