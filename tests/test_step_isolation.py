"""One request never hurts another in the engine: sampling values at the edge of what the spec allows
run on every device's kernels, and a step that fails fails only the sequence that caused it (issue 23)."""

from __future__ import annotations

import json
import math
import queue
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from lse_core.api import LSE, Event, lse_close, lse_open_or_raise, lse_request, lse_request_iter
from lse_core.config import LSEConfig

PROMPT = {"prompt": "The quick brown fox", "temperature": 0, "ignore_eos": True}   # four tokens, whatever is sampled
# float32 underflows 1e-300 to 0 and overflows 1e300 to inf: each was a division by zero or NaN logits
EXTREMES = [{"repetition_penalty": 1e-300}, {"repetition_penalty": 1e300}, {"repetition_penalty": 1e-40},
            {"temperature": 1e-300}, {"temperature": 1e300}, {"temperature": 1e-40},
            {"presence_penalty": 1e300}, {"presence_penalty": -1e300},
            {"min_p": 1e-300, "top_p": 1e-300, "temperature": 1.0}]


@pytest.fixture(scope="module", params=["cpu:0", "jit:0", "opencl:0", "hrx:0"])
def lse(request, llama_checkpoint: Path) -> Iterator[LSE]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HRX_DEVICES", "1")
        mp.setenv("HRX_MISSING", "")
        engine = lse_open_or_raise(LSEConfig(model=str(llama_checkpoint), kv_len=64, parallel=4,
                                             pool=request.param,
                                             disable_cpu_fallback=request.param in ("jit:0", "opencl:0")))
    yield engine
    lse_close(engine)


def complete(lse: LSE, **fields) -> dict:
    events = list(lse_request_iter(lse, PROMPT | {"max_tokens": 4, "logprobs": 2} | fields, "completion"))
    assert events[-1].kind == "end", events[-1].data
    json.dumps(events[-1].data, allow_nan=False)
    return events[-1].data


@pytest.mark.parametrize("fields", EXTREMES, ids=lambda f: ",".join(f"{k}={v:g}" for k, v in f.items()))
def test_extreme_sampling_values_sample_a_real_token(lse: LSE, fields: dict) -> None:
    data = complete(lse, **fields)
    logprobs = data["choices"][0]["logprobs"]
    assert data["usage"]["completion_tokens"] == 4
    assert all(math.isfinite(x) for x in logprobs["token_logprobs"])


def test_a_temperature_too_small_for_float32_is_greedy(lse: LSE) -> None:
    greedy = complete(lse)["choices"][0]["text"]
    assert complete(lse, temperature=1e-300, seed=1)["choices"][0]["text"] == greedy


def test_a_failing_step_fails_only_the_sequence_that_causes_it(lse: LSE, monkeypatch) -> None:
    """The plan fails any step that computes a position past 40, as a kernel bug would for one
    request's values: only the long request reaches it. It ends with a server_error, while a request
    decoding in the same batch runs to its limit with exactly the text it produces alone, and the
    engine keeps serving."""
    honest = {"prompt": [5, 9, 11, 13], "max_tokens": 24, "temperature": 0}
    alone = reply(lse, honest)
    run = lse.plan.run

    def poisoned_run(step, *args, **kwargs):
        if step.positions.max() >= 40:
            raise ZeroDivisionError("float division by zero")
        return run(step, *args, **kwargs)

    monkeypatch.setattr(lse.plan, "run", poisoned_run)
    started, events = threading.Event(), queue.Queue[Event]()

    def on_event(event: Event) -> None:
        started.set()
        events.put(event)

    lse_request(lse, honest, on_event, "completion")
    assert started.wait(60)          # the honest request is decoding when the poisoned one joins its batch
    bad = list(lse_request_iter(lse, {"prompt": [3] * 45, "max_tokens": 4}, "completion"))
    while (event := events.get(timeout=60)).kind == "token":
        pass
    assert bad[-1].kind == "error" and bad[-1].status == 500
    assert "ZeroDivisionError" in bad[-1].data["error"]["message"]
    assert event.kind == "end", event.data
    assert event.data["choices"][0]["text"] == alone["choices"][0]["text"]
    monkeypatch.undo()
    assert reply(lse, honest)["choices"][0]["text"] == alone["choices"][0]["text"]


def test_a_failed_step_leaves_a_seeded_reply_unchanged(lse: LSE, monkeypatch) -> None:
    """A re-run of a failed step draws the same random numbers: the seeded reply equals the one made
    without any failure."""
    body = {"prompt": [5, 9, 11, 13], "max_tokens": 12, "temperature": 1.0, "seed": 42}
    clean = reply(lse, body)["choices"][0]["text"]
    run, failed, other_queued = lse.plan.run, [], threading.Event()

    def fails_once_in_a_batch(step, *args, **kwargs):
        if not failed:
            if len(step.slots) > 1:
                failed.append(step.serial)
                raise RuntimeError("a transient device error")
            other_queued.wait(60)   # the seeded reply waits for the other, so that they share a step
        return run(step, *args, **kwargs)

    monkeypatch.setattr(lse.plan, "run", fails_once_in_a_batch)
    done: queue.Queue[Event] = queue.Queue()
    lse_request(lse, body, lambda e: done.put(e) if e.kind != "token" else None, "completion")
    other_done: queue.Queue[Event] = queue.Queue()
    lse_request(lse, {"prompt": [5, 6], "max_tokens": 8, "temperature": 0},
                lambda e: other_done.put(e) if e.kind != "token" else None, "completion")
    other_queued.set()
    other_end, result = other_done.get(timeout=60), done.get(timeout=60)
    assert other_end.kind == "end", other_end.data
    other = other_end.data
    assert failed and other["usage"]["completion_tokens"] == 8
    assert result.kind == "end" and result.data["choices"][0]["text"] == clean


def reply(lse: LSE, body: dict) -> dict:
    events = list(lse_request_iter(lse, body, "completion"))
    assert events[-1].kind == "end", events[-1].data
    return events[-1].data

