"""The model set in-process (lse_core.model_set): ids from files, routing by a body's model, the LRU, budget and
idle policies, the bounded wait while a model opens, and a model that fails among good ones. Real engines
on tiny random checkpoints (tests/checkpoints.py) on cpu:0."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from lse_core.api import EVENT_END, EVENT_ERROR, lse_close, lse_open_or_raise, lse_tokenize
from lse_core.cli import format_status
from lse_core.config import LSEConfig
from lse_core.errors import LSEError, StartupError
from lse_core.model.catalog import ModelSpec, model_specs
from lse_core.model_set import ModelSet, Policy
from lse_http.server import parse_args

CONFIG = LSEConfig(pool="cpu:0", kv_len=64, parallel=2)
PROMPT = {"prompt": "Paris is", "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def two(tiny_checkpoint) -> list[ModelSpec]:
    return [ModelSpec("q", str(tiny_checkpoint("qwen3"))), ModelSpec("l", str(tiny_checkpoint("llama")))]


def states(models: ModelSet) -> dict[str, str]:
    return {entry["id"]: entry["state"] for entry in models.entries()}


def complete(models: ModelSet, name: str) -> dict:
    *_, end = models.request_iter({**PROMPT, "model": name}, "completion")
    assert end.kind == EVENT_END, end.data
    return end.data


def test_ids_come_from_names_and_aliases(tmp_path: Path) -> None:
    (tmp_path / "chat.Q4_K.gguf").write_bytes(b"GGUF")
    (tmp_path / "coder").mkdir()
    (tmp_path / "coder" / "config.json").write_text("{}")
    (tmp_path / "notes").mkdir()           # no config.json: not a model
    (tmp_path / "readme.txt").write_text("not a model")
    specs = model_specs([], str(tmp_path), [f"big={tmp_path / 'coder'}", "extra=/elsewhere/x.gguf"])
    assert [(s.id, s.path) for s in specs] == [("chat.Q4_K", str(tmp_path / "chat.Q4_K.gguf")),
                                               ("big", str(tmp_path / "coder")), ("extra", "/elsewhere/x.gguf")]
    assert [s.id for s in model_specs([])] == ["SmolLM2-135M-Instruct.Q4_1"]   # the default model
    with pytest.raises(StartupError, match="two models have the id 'coder'"):
        model_specs([str(tmp_path / "coder"), "/other/coder"])
    with pytest.raises(StartupError, match="must be ID=PATH"):
        model_specs([], None, ["no-equals-sign"])
    with pytest.raises(StartupError, match="--models-dir /no/such/dir"):
        model_specs([], "/no/such/dir")
    with pytest.raises(StartupError, match="holds no .gguf file"):
        model_specs([], str(tmp_path / "notes"))


def test_a_body_selects_its_model(two: list[ModelSpec]) -> None:
    models = ModelSet(two, CONFIG)
    try:
        assert states(models) == {"q": "unloaded", "l": "unloaded"}
        assert complete(models, "l")["model"] == "l" and complete(models, "q")["model"] == "q"
        assert complete(models, two[0].path)["model"] == "q"   # by path, as one model's server accepts
        with models.using(None) as lse:          # naming none: the first
            assert lse.model_id == "q"
        with models.using("l") as lse:
            # the same tokens as the model opened on its own
            alone = lse_open_or_raise(replace(CONFIG, model=two[1].path))
            try:
                assert lse_tokenize(lse, {"content": "Paris"}) == lse_tokenize(alone, {"content": "Paris"})
            finally:
                lse_close(alone)
        with pytest.raises(LSEError) as e:
            models.lease("gpt-4o")
        assert (e.value.status, e.value.code, e.value.extra["models"]) == (404, "model_not_found", ["q", "l"])
        events = []
        models.request({"model": "gpt-4o", "prompt": "x"}, events.append, "completion")
        assert [(ev.kind, ev.status) for ev in events] == [(EVENT_ERROR, 404)]
        [error] = models.request_iter({"model": "gpt-4o", "prompt": "x"}, "completion")
        assert (error.kind, error.data["error"]["code"]) == (EVENT_ERROR, "model_not_found")
    finally:
        models.close()


def test_the_least_recently_used_idle_model_makes_room(two: list[ModelSpec], tiny_checkpoint) -> None:
    third = ModelSpec("q2", str(tiny_checkpoint("qwen2")))
    models = ModelSet([*two, third], CONFIG, Policy(max_models=2))
    try:
        complete(models, "q")
        complete(models, "l")
        complete(models, "q")                     # l is now the least recently used
        complete(models, "q2")
        assert states(models) == {"q": "loaded", "l": "unloaded", "q2": "loaded"}
        with models.using("q2"):                  # q2 is busy: q goes, though q2 was used last
            complete(models, "l")
            assert states(models) == {"q": "unloaded", "l": "loaded", "q2": "loaded"}
        assert models.status("l")["stats"]["requests"] == [{"endpoint": "completion", "outcome": "max_tokens",
                                                            "count": 2}]   # counters kept across its unload
    finally:
        models.close()


def test_a_model_with_a_request_waits_for_room(two: list[ModelSpec]) -> None:
    """With every open model busy, a request for another waits until one is idle, then that one goes."""
    models = ModelSet(two, CONFIG, Policy(max_models=1))
    try:
        held = models.lease("q").result()
        waiting = models.lease("l")
        time.sleep(0.5)
        assert not waiting.done() and states(models) == {"q": "loaded", "l": "loading"}
        with pytest.raises(LSEError) as e:
            models.unload("q")
        assert (e.value.status, e.value.code) == (409, "model_busy")
        held.release()
        with waiting.result(timeout=60):
            assert states(models) == {"q": "unloaded", "l": "loaded"}
    finally:
        models.close()


def test_the_memory_budget(two: list[ModelSpec]) -> None:
    models = ModelSet(two, CONFIG, Policy(memory_budget=1000))   # less than either model's files
    try:
        with pytest.raises(LSEError) as e:
            models.lease("q").result()
        assert (e.value.status, e.value.code) == (500, "model_load_failed")
        assert "more than --memory-budget" in e.value.message
        assert (models.entry("q")["state"], models.entry("q")["reason"]) == ("failed", e.value.message)
    finally:
        models.close()


def test_idle_models_are_unloaded(two: list[ModelSpec]) -> None:
    models = ModelSet(two, CONFIG, Policy(idle_unload=0.5))
    try:
        complete(models, "q")
        with models.using("l"):
            deadline = time.monotonic() + 30
            while states(models)["q"] != "unloaded":
                assert time.monotonic() < deadline, states(models)
                time.sleep(0.1)
            time.sleep(1.0)
            assert states(models)["l"] == "loaded"   # leased: never unloaded under its request
        assert complete(models, "q")["model"] == "q"   # opened again on demand
    finally:
        models.close()


def test_requests_wait_in_a_bounded_queue_and_a_failure_is_its_own(two: list[ModelSpec]) -> None:
    """The open of q is held until the test lets it fail: its requests wait, at most two, then get its reason;
    l serves after it."""
    go = threading.Event()

    def open_engine(config: LSEConfig):
        if config.model_id == "q":
            go.wait(60)
            raise StartupError("q.gguf: the file is truncated")
        return lse_open_or_raise(config)

    models = ModelSet(two, CONFIG, Policy(max_waiting=2), open_engine)
    try:
        first, second = models.lease("q"), models.lease("q")
        with pytest.raises(LSEError) as e:
            models.lease("q")
        assert (e.value.status, e.value.type, e.value.code) == (503, "server_error", "overloaded")
        assert models.status("q")["queued"] == 2
        go.set()
        for waiting in (first, second):
            with pytest.raises(LSEError) as e:
                waiting.result(timeout=60)
            assert (e.value.status, e.value.code, e.value.message) == (500, "model_load_failed",
                                                                      "q.gguf: the file is truncated")
        assert models.entry("q")["state"] == "failed" and complete(models, "l")["model"] == "l"
    finally:
        models.close()


def test_server_options_for_many_models() -> None:
    args = parse_args(["-m", "a.gguf", "-m", "b", "--memory-budget", "1.5G", "--max-models", "2",
                       "--idle-unload", "300", "--alias", "x=c.gguf"])
    assert (args.models, args.memory_budget, args.max_models, args.idle_unload, args.alias) == (
        ["a.gguf", "b"], 3 << 29, 2, 300.0, ["x=c.gguf"])
    assert [parse_args(["--memory-budget", size]).memory_budget for size in ("512M", "8GiB", "4096", "2kb")] == [
        512 << 20, 8 << 30, 4096, 2048]
    with pytest.raises(SystemExit):
        parse_args(["--memory-budget", "lots"])


def test_lse_status_prints_each_model(two: list[ModelSpec]) -> None:
    models = ModelSet(two, CONFIG)
    try:
        complete(models, "l")
        text = format_status(models.status())
    finally:
        models.close()
    q, l = text.split("\n\n")
    assert q.splitlines()[:2] == ["model  q", "state  unloaded"]
    assert "state              loaded" in l and "devices            cpu:0" in l and "free KV slots      2 of 2" in l


def test_a_refused_pool_fails_each_load_with_the_startup_message(two: list[ModelSpec]) -> None:
    """The options are every model's: with the CPU refused, each load fails as lse_open would, and the set
    still answers (a one-model server would exit 1 with the same line)."""
    models = ModelSet(two, replace(CONFIG, disable_cpu_fallback=True))
    try:
        with pytest.raises(StartupError) as startup:
            lse_open_or_raise(replace(CONFIG, model=two[0].path, disable_cpu_fallback=True))
        for model_id in ("q", "l"):
            with pytest.raises(LSEError) as e:
                models.lease(model_id).result()
            assert (e.value.code, e.value.message) == ("model_load_failed", str(startup.value))
        assert str(startup.value).startswith("device cpu:0 is refused")
        assert states(models) == {"q": "failed", "l": "failed"}
    finally:
        models.close()
