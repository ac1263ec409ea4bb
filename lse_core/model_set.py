"""Many models behind one handle: each opened when a request asks for it, closed when idle or to make room.

A request leases its model (ModelSet.lease). A loaded model's lease is granted at once; otherwise the request
waits (at most ``Policy.max_waiting`` per model, then 503) while a loader opens it, one model at a time, first
closing the least recently used idle models that ``max_models`` or ``memory_budget`` needs gone. A model with
a lease (a running request) is never closed. A model that fails to open fails only its own requests, with
its startup reason, until it is loaded again on purpose (ModelSet.load). Each model is an ordinary LSE
handle (lse_core.api), planned on the pool on its own."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, Literal, NotRequired

import psutil
from typing_extensions import TypedDict

from lse_core import api, protocol, structured
from lse_core.adapters.common import Count
from lse_core.adapters.responses import ResponseStore
from lse_core.config import LSEConfig
from lse_core.errors import LSEError, StartupError, model_not_found, server_error
from lse_core.model.catalog import ModelSpec, file_bytes
from lse_core.stats import RequestStats, Stats

log = logging.getLogger("lse")

UNLOADED, LOADING, LOADED, FAILED = "unloaded", "loading", "loaded", "failed"
REAP_EVERY_S = 1.0   # how often idle models are looked for, at most


@dataclass
class Policy:
    max_models: int = 0          # models open at once; 0: no limit
    memory_budget: int = 0       # bytes the open models may take together; 0: no limit
    idle_unload: float = 0.0     # seconds without a request before a model is closed; 0: never
    max_waiting: int = 64        # requests waiting for one model to open; the next gets 503


class ModelStatus(TypedDict):
    """One model's lse_status: its state in the set and, while it is loaded, its engine's (api.LSEStatus's keys)."""

    model: str
    state: protocol.ModelState
    reason: str | None
    requests: Count
    queued: Count
    idle_s: float | None
    memory_bytes: Count | None
    load_s: float | None
    context_length: NotRequired[Count]
    devices: NotRequired[list[api.Device]]
    placements: NotRequired[list[api.GroupPlacement]]
    declined: NotRequired[list[str]]
    startup_warnings: NotRequired[list[str]]
    kv_cache: NotRequired[api.KVCache]
    engine: NotRequired[api.EngineStatus]
    stats: NotRequired[RequestStats]


class Status(ModelStatus):
    """/v1/lse/status: the asked for (or default) model's status; each model's under models."""

    object: Literal["lse.status"]
    models: list[ModelStatus]


@dataclass(eq=False)
class _Entry:
    spec: ModelSpec
    state: str = UNLOADED
    reason: str | None = None             # why it failed to open
    lse: api.LSE | None = None
    leases: int = 0                       # requests using it now
    last_used: float = 0.0                # time.monotonic() of its last lease or release
    waiting: list[Future[Lease]] = field(default_factory=list)
    memory_bytes: int | None = None       # resident memory its last open took
    load_seconds: float | None = None
    served: dict[str, Any] | None = None  # its /v1/models entry, known once it has opened
    bounds: tuple[int, int] | None = None   # its vocabulary size and width, known once it has opened
    stats: Stats = field(default_factory=Stats)   # kept across opens, so /metrics' counters never go back
    keep_alive: float | None = None       # seconds it stays open once idle, as a request asked; None: the policy's


class Lease:
    """One request's hold on its model: the model is not closed before the lease is released (once)."""

    def __init__(self, models: ModelSet, entry: _Entry) -> None:
        self._models, self._entry = models, entry
        self.lse: api.LSE = entry.lse
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._models._release(self._entry)

    def until_end(self, on_event: Callable[[api.Event], None]) -> Callable[[api.Event], None]:
        """``on_event``, releasing the lease after the request's last event (its end or error)."""
        def forward(event: api.Event) -> None:
            try:
                on_event(event)
            finally:
                if event.kind != api.EVENT_TOKEN:
                    self.release()
        return forward

    def __enter__(self) -> api.LSE:
        return self.lse

    def __exit__(self, *exc: object) -> None:
        self.release()


class ModelSet:
    """The models a server holds, by id; the first is the default, for requests that name none."""

    def __init__(self, specs: list[ModelSpec], config: LSEConfig | None = None, policy: Policy | None = None,
                 open_engine: Callable[[LSEConfig], api.LSE] = api.lse_open_or_raise) -> None:
        self.config = config or LSEConfig()
        self.policy = policy or Policy(max_waiting=self.config.max_queue)
        self._open_engine = open_engine
        self._entries = {spec.id: _Entry(spec) for spec in specs}
        self.responses = ResponseStore()   # one store: a conversation may go on with another model
        self.started = time.time()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)   # a lease released, a model closed, the set closing
        self._opening = threading.Lock()   # one open or close at a time: memory peaks never overlap
        self._closed = False
        self._reaping = False   # the thread that closes idle models runs
        if self.policy.idle_unload > 0:
            self._start_reaping()

    @property
    def ids(self) -> list[str]:
        return list(self._entries)

    @property
    def specs(self) -> list[ModelSpec]:
        return [entry.spec for entry in self._entries.values()]

    # ---- leases ----

    def lease(self, name: str | None) -> Future[Lease]:
        """The model ``name`` (its id or path; None: the default) for one request, once it is open. Raises
        LSEError 404 model_not_found, or 503 overloaded when too many requests wait for it already; the
        future fails with 500 model_load_failed when it cannot open."""
        entry = self._entry(name)
        future: Future[Lease] = Future()
        with self._lock:
            if self._closed:
                raise server_error("the server is shutting down", code="shutting_down", status=503)
            if entry.state == FAILED:
                future.set_exception(_load_failed(entry))
            elif entry.state == LOADED:
                entry.leases += 1
                entry.last_used = time.monotonic()
            elif len(entry.waiting) >= self.policy.max_waiting:
                raise server_error(f"{len(entry.waiting)} requests wait for the model {entry.spec.id!r} to load "
                                   "already; retry later", code="overloaded", status=503)
            else:
                entry.waiting.append(future)
                if entry.state == UNLOADED:
                    entry.state = LOADING
                    threading.Thread(target=self._open, args=(entry,), name="lse-load", daemon=True).start()
                return future
        if not future.done():
            future.set_result(Lease(self, entry))
        return future

    @contextlib.contextmanager
    def using(self, name: str | None) -> Iterator[api.LSE]:
        """The model's LSE handle for synchronous calls (lse_tokenize, lse_embeddings...), waiting for it to open."""
        with self.lease(name).result() as lse:
            yield lse

    def request(self, body: Any, on_event: Callable[[api.Event], None], endpoint: str = "chat") -> api.Request:
        """lse_request on the model the body names (waiting for it to open); an unknown or failed model is
        an error event, as any bad request is."""
        lease = self._body_lease(body)
        if isinstance(lease, LSEError):
            request = api.Request(None, endpoint, on_event)   # no model: a request that only ends in its error
            request.emit(api.Event(api.EVENT_ERROR, lease.body(), lease.status))
            return request
        return api.lse_request(lease.lse, body, lease.until_end(on_event), endpoint)

    def request_iter(self, body: Any, endpoint: str = "chat") -> Iterator[api.Event]:
        """``request`` as an iterator (lse_request_iter's); leaving the loop early cancels the request."""
        lease = self._body_lease(body)
        if isinstance(lease, LSEError):
            yield api.Event(api.EVENT_ERROR, lease.body(), lease.status)
            return
        with lease as lse:
            yield from api.lse_request_iter(lse, body, endpoint)

    def _body_lease(self, body: Any) -> Lease | LSEError:
        try:
            return self.lease(requested_model(body)).result()
        except LSEError as e:
            return e

    # ---- loading and unloading on purpose ----

    def load(self, model_id: str) -> Future[dict[str, Any]]:
        """Open the model ``model_id`` (its id or path) if it is not open, again after a failure; the future gives
        its /v1/models entry."""
        entry = self._entry(model_id)
        with self._lock:
            if entry.state == FAILED:
                entry.state, entry.reason = UNLOADED, None
        done: Future[dict[str, Any]] = Future()

        def opened(lease: Future[Lease]) -> None:
            if lease.exception() is not None:
                done.set_exception(lease.exception())
                return
            lease.result().release()
            done.set_result(self.entry(entry.spec.id))   # by id: entry() reads no paths

        self.lease(entry.spec.id).add_done_callback(opened)
        return done

    def unload(self, model_id: str) -> dict[str, Any]:
        """Close the model now; 409 while it loads or has requests running. Returns its entry."""
        entry = self._entry(model_id)
        with self._lock:
            if entry.state == LOADING or entry.leases:
                busy = "is loading" if entry.state == LOADING else f"has {entry.leases} requests running"
                raise LSEError(f"the model {model_id!r} {busy}; unload it when it is idle", status=409,
                               code="model_busy", param="model")
            taken = [self._take(entry)]
        if taken != [None]:
            with self._opening:
                _close(taken)
        return self.entry(entry.spec.id)

    def keep_alive(self, model_id: str | None, seconds: float) -> None:
        """Keep the model open ``seconds`` once idle instead of the policy's idle_unload, until it is next closed
        (Ollama's keep_alive: the last request that names one decides): 0 closes it as soon as its requests end,
        a negative time never."""
        entry = self._entry(model_id)
        with self._lock:
            entry.keep_alive = seconds
            self._changed.notify_all()
            if not self._reaping:
                self._start_reaping()

    def idle_limit(self, model_id: str) -> float | None:
        """Seconds the model stays open once idle; None: until it is unloaded on purpose or to make room."""
        entry = self._entry(model_id)
        with self._lock:
            return self._idle_limit(entry)

    def close(self) -> None:
        """Close every model; requests still waiting for one get 503 shutting_down."""
        with self._lock:
            self._closed = True
            self._changed.notify_all()
            taken = [self._take(e) for e in self._entries.values() if e.state == LOADED]
            waiting = [f for e in self._entries.values() for f in e.waiting]
        for future in waiting:
            if future.set_running_or_notify_cancel():
                future.set_exception(server_error("the server is shutting down", code="shutting_down", status=503))
        _close(taken)

    # ---- what clients read ----

    def entry(self, model_id: str) -> dict[str, Any]:
        """The model's /v1/models entry: what is known of it (all once it has opened), its state and, when
        it failed to open, why."""
        entry = self._entry(model_id, by_path=False)
        with self._lock:
            known = entry.served or protocol.model_entry(entry.spec.id, int(self.started), None, None, None,
                                                         structured.supported())
            return protocol.model_entry_with_state(known, entry.state, entry.reason)

    def entries(self) -> list[dict[str, Any]]:
        return [self.entry(model_id) for model_id in self._entries]

    def status(self, name: str | None = None) -> Status:
        """lse_status of the model ``name`` (the default: the first), beside ``models``: every model's state
        and, for each open one, its lse_status (its own devices, placements and fallback counters)."""
        selected = self._entry(name).spec.id
        models = [self._model_status(e) for e in self._entries.values()]
        return Status(object="lse.status", **next(m for m in models if m["model"] == selected), models=models)

    def engines(self) -> list[tuple[str, Stats, api.LSE | None]]:
        """Each model's id, request counters (kept across opens) and its LSE handle while open: for /metrics."""
        with self._lock:
            return [(e.spec.id, e.stats, e.lse) for e in self._entries.values()]

    def vocabulary_bounds(self) -> tuple[int, int] | None:
        """The largest vocabulary and width of the models opened so far (None before any): /openapi.json's bounds."""
        with self._lock:
            known = [e.bounds for e in self._entries.values() if e.bounds]
        return (max(v for v, _ in known), max(w for _, w in known)) if known else None

    # ---- inside ----

    def _entry(self, name: str | None, by_path: bool = True) -> _Entry:
        if name in (None, ""):
            return next(iter(self._entries.values()))
        if name in self._entries:
            return self._entries[name]
        for entry in self._entries.values() if by_path else ():
            if entry.spec.path is not None and name == entry.spec.path:
                return entry
        raise model_not_found(name, list(self._entries))

    def _model_status(self, entry: _Entry) -> ModelStatus:
        with self._lock:
            lse = entry.lse
            idle = time.monotonic() - entry.last_used if entry.state == LOADED and not entry.leases else None
            state = ModelStatus(model=entry.spec.id, state=entry.state, reason=entry.reason, requests=entry.leases,
                                queued=len(entry.waiting), idle_s=None if idle is None else round(idle, 3),
                                memory_bytes=entry.memory_bytes, load_s=entry.load_seconds)
        if lse is None:
            return state
        status = api.lse_status(lse)
        del status["object"]
        return status | state

    def _release(self, entry: _Entry) -> None:
        with self._lock:
            entry.leases -= 1
            entry.last_used = time.monotonic()
            self._changed.notify_all()

    def _take(self, entry: _Entry) -> api.LSE | None:
        """Mark an open model closed (so no lease reaches it) and hand over its handle to close. Under _lock."""
        lse, entry.lse, entry.keep_alive = entry.lse, None, None
        if entry.state == LOADED:
            entry.state = UNLOADED
            self._changed.notify_all()
        return lse

    def _open(self, entry: _Entry) -> None:
        """The loader: make room, open the model, and grant its waiting requests their leases (or its failure)."""
        with self._opening:
            lse, reason = None, None
            try:
                self._make_room(entry)
                before, start = _resident_bytes(), time.monotonic()
                lse = self._open_engine(replace(self.config, model=entry.spec.path, model_id=entry.spec.id))
                memory, seconds = max(_resident_bytes() - before, 0), time.monotonic() - start
            except StartupError as e:
                reason = str(e)
            except Exception as e:   # a bug, not a bad file: keep the traceback in the log
                log.exception("lse: the model %s failed to load", entry.spec.id)
                reason = f"{type(e).__name__}: {e}"
            with self._lock:
                waiting, entry.waiting = entry.waiting, []
                if lse is None or self._closed:
                    entry.state, entry.reason = FAILED, reason or "the server is shutting down"
                else:
                    lse.stats, lse.responses = entry.stats, self.responses
                    entry.served = api.lse_model_info(lse)["served"]
                    entry.bounds = (lse.model.tokenizer.vocab_size, int(lse.model.config["hidden_size"]))
                    entry.lse, entry.state, entry.memory_bytes, entry.load_seconds = lse, LOADED, memory, seconds
                    entry.leases += len(waiting)
                    entry.last_used = time.monotonic()
            if lse is not None and entry.state != LOADED:   # opened as the set closed
                api.lse_close(lse)
            if entry.state == LOADED:
                log.info("lse: loaded %s in %.1f s (%d MiB)", entry.spec.id, seconds, memory >> 20)
            else:
                log.warning("lse: the model %s failed to load: %s", entry.spec.id, entry.reason)
            for future in waiting:
                if entry.state != LOADED:
                    if future.set_running_or_notify_cancel():
                        future.set_exception(_load_failed(entry))
                    continue
                lease = Lease(self, entry)
                if future.set_running_or_notify_cancel():
                    future.set_result(lease)
                else:   # its client left while it waited
                    lease.release()

    def _make_room(self, entry: _Entry) -> None:
        """Close least recently used idle models until ``entry`` fits under max_models and memory_budget,
        waiting for one to become idle when none is. Holds _opening."""
        need = entry.memory_bytes if entry.memory_bytes is not None else file_bytes(entry.spec.path)
        budget, most = self.policy.memory_budget, self.policy.max_models
        if budget and need > budget:
            raise StartupError(f"the model needs about {need >> 20} MiB, more than --memory-budget ({budget >> 20} "
                               "MiB) allows")
        while True:
            with self._lock:
                open_now = [e for e in self._entries.values() if e.state == LOADED]
                used = sum(e.memory_bytes or 0 for e in open_now)
                if (not most or len(open_now) < most) and (not budget or used + need <= budget):
                    return
                if self._closed:
                    raise StartupError("the server is shutting down")
                idle = [e for e in open_now if not e.leases]
                if not idle:
                    self._changed.wait()
                    continue
                victim = min(idle, key=lambda e: e.last_used)
                taken = [self._take(victim)]
            log.info("lse: unloading %s, the least recently used idle model, to load %s", victim.spec.id,
                     entry.spec.id)
            _close(taken)

    def _idle_limit(self, entry: _Entry) -> float | None:
        """Seconds ``entry`` stays open once idle: its keep_alive, else policy.idle_unload (0: never); None: no
        limit. Under _lock."""
        if entry.keep_alive is not None:
            return None if entry.keep_alive < 0 else entry.keep_alive
        return self.policy.idle_unload or None

    def _start_reaping(self) -> None:
        self._reaping = True
        threading.Thread(target=self._close_idle, name="lse-idle-unload", daemon=True).start()

    def _close_idle(self) -> None:
        """Close each model idle for its idle limit (a thread, while the set is open)."""
        while True:
            with self._lock:
                limits = [self._idle_limit(e) for e in self._entries.values()]
                self._changed.wait(min([REAP_EVERY_S] + [s for s in limits if s]))
                if self._closed:
                    return
            if not self._opening.acquire(blocking=False):   # a load is under way; look again later
                continue
            try:
                with self._lock:
                    now = time.monotonic()
                    expired = [(e, limit) for e in self._entries.values() if e.state == LOADED and not e.leases
                               and (limit := self._idle_limit(e)) is not None and now - e.last_used >= limit]
                    taken = [self._take(e) for e, _ in expired]
                for e, limit in expired:
                    log.info("lse: unloading %s, idle for %g s", e.spec.id, limit)
                _close(taken)
            finally:
                self._opening.release()


def requested_model(body: Any) -> str | None:
    """The model a request body names, if it names one (a bad value is left to the body's own checks)."""
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) else None


def _load_failed(entry: _Entry) -> LSEError:
    return LSEError(entry.reason or "the model failed to load", status=500, type="server_error",
                    code="model_load_failed", param="model")


def _close(taken: list[api.LSE | None]) -> None:
    """Close models and give their memory back: each engine thread stops, the devices drop their weights and
    KV caches, and with the last reference gone (the list's: it is emptied) the file is unmapped. glibc keeps
    freed heap pages (arrays below its mmap threshold, which rises as big arrays are freed) until malloc_trim
    hands them back: without it a process's RSS after unloading SmolLM2 on cpu:0 grew with each load (244,
    374, 411 MiB); with it, it stays at about 180 MiB, what the libraries themselves take
    (benchmarks/model_unload.py)."""
    while taken:
        lse = taken.pop()
        if lse is not None:
            api.lse_close(lse)
    lse = None
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _glibc()


def _resident_bytes() -> int:
    return psutil.Process().memory_info().rss
