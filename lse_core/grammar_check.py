"""The compile worker: a grammar llguidance has not compiled before is compiled first in a process of its own,
so a native fault (a stack overflow in llguidance's recursive descent over a deep grammar, a Rust panic that
aborts) or a compile that does not end takes that process and not the engine; the request gets a 400.

  Vocabulary      what llguidance's tokenizer is built from; the engine and the worker build the same one
  GrammarChecker  the engine's side: starts the worker with the vocabulary, sends it grammars, restarts it when
                  it dies or misses its deadline
  serve           the worker's side (this file run as a script): compiles each grammar it is sent and
                  computes its first mask, as the engine will; converts GBNF to Lark (a Python conversion whose
                  time grows with the square of the rules, which the deadline bounds)
  on_stack        runs a compile on a thread with a stack of known size: the worker's is half the engine's, so
                  a grammar proven in the worker has room to spare in the engine

The worker imports llguidance and the standard library only (this file runs as a script, with -P so that
lse_core's modules do not shadow the standard library's), so it starts in well under a second; it exits when
the engine's end of its pipe closes. Messages are JSON, each after its length (4 bytes, big-endian).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import llguidance
import llguidance.numpy as llnp
from llguidance.gbnf_to_lark import gbnf_to_lark

ENGINE_STACK_BYTES = 32 << 20
WORKER_STACK_BYTES = ENGINE_STACK_BYTES // 2
COMPILE_DEADLINE_S = 10.0        # a real grammar compiles in milliseconds, a 5,000-property schema in 0.4 s
START_DEADLINE_S = 120.0         # the worker builds the vocabulary first (0.4 s for 49k tokens, more for 250k)
REASON_CHARS = 200               # an error's first line, cut here: no grammar dump, no backtrace
_T = TypeVar("_T")


def parser_limits() -> llguidance.LLParserLimits:
    """llguidance's limits for every matcher: its defaults (a step's Earley items and lexer fuel bound the
    time of a mask), but errors without the parser's state and grammar in them."""
    return llguidance.LLParserLimits(verbose_errors=False)


def one_line(error: str) -> str:
    """An llguidance error as a client reads it: its first line (a panic's backtrace follows it), cut short."""
    line = error.strip().split("\n", 1)[0].strip()
    return line if len(line) <= REASON_CHARS else line[:REASON_CHARS - 3] + "..."


def on_stack(stack_bytes: int, work: Callable[[], _T]) -> _T:
    """``work()`` on a new thread whose stack is ``stack_bytes`` (a compile's recursion depth is what it needs)."""
    done: Future[_T] = Future()

    def run() -> None:
        try:
            done.set_result(work())
        except Exception as e:   # raised in the caller's thread
            done.set_exception(e)

    with _stack_size_lock:   # the size applies to threads started while it is set, process-wide
        previous = threading.stack_size(stack_bytes)
        try:
            thread = threading.Thread(target=run, name="lse-grammar-compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    return done.result()


_stack_size_lock = threading.Lock()


@dataclass(frozen=True)
class Vocabulary:
    """What llguidance's tokenizer is built from: the tokenizer's JSON, the vocabulary's size (the logits'
    width, which may pad the tokenizer's) and the end-of-turn ids."""

    tokenizer_json: str
    n_vocab: int
    eos_ids: list[int]

    def lltokenizer(self) -> llguidance.LLTokenizer:
        return llguidance.LLTokenizer(self.tokenizer_json, n_vocab=self.n_vocab, eos_token=self.eos_ids)


def compile_matcher(tokenizer: llguidance.LLTokenizer, grammar: str, stack_bytes: int) -> llguidance.LLMatcher:
    """A matcher for ``grammar`` with LSE's limits, compiled on a stack of ``stack_bytes``; check is_error()."""
    return on_stack(stack_bytes, lambda: llguidance.LLMatcher(tokenizer, grammar, log_level=0,
                                                               limits=parser_limits()))


class GrammarRefused(Exception):
    """A grammar the worker could not use; the message is the one-line reason. ``lasting``: the same grammar
    would be refused again (llguidance's error, or a crash); a missed deadline may be the machine's load."""

    def __init__(self, reason: str, lasting: bool = True) -> None:
        super().__init__(reason)
        self.reason = reason
        self.lasting = lasting


class WorkerUnavailable(Exception):
    """The worker could not be started: a fault of the server, not of the request."""


class GrammarChecker:
    """The engine's side of the worker, one per vocabulary. Requests take turns (one worker, one compile at a
    time); the worker starts on the first and stays, ready, until close() or a fault."""

    def __init__(self, vocabulary: Callable[[], Vocabulary], deadline_s: float = COMPILE_DEADLINE_S,
                 stack_bytes: int = WORKER_STACK_BYTES) -> None:
        self._vocabulary = vocabulary       # called at each start: the tokenizer's JSON is not kept here
        self.deadline_s = deadline_s
        self.stack_bytes = stack_bytes
        self._lock = threading.Lock()
        self._worker: _Worker | None = None

    def prove(self, grammar: str) -> None:
        """Return when llguidance compiles ``grammar`` and computes its first mask in the worker; else raise
        GrammarRefused with the reason: llguidance's error, the worker dying, or the deadline passing."""
        self._ask({"prove": grammar})

    def gbnf_to_lark(self, text: str) -> str:
        """A GBNF grammar as Lark, converted in the worker; raises GrammarRefused."""
        return self._ask({"gbnf": text})["lark"]

    @property
    def pid(self) -> int | None:
        """The worker's process id while one runs."""
        return self._worker.process.pid if self._worker is not None else None

    def close(self) -> None:
        with self._lock:
            if self._worker is not None:
                self._stop_worker()

    def _ask(self, message: dict[str, str]) -> dict[str, Any]:
        with self._lock:
            if self._worker is not None and self._worker.process.poll() is not None:
                self._stop_worker()   # it died between requests: the next grammar is not to blame
            if self._worker is None:
                self._worker = _Worker.start(self._vocabulary(), self.stack_bytes)
            try:
                reply = self._worker.ask(message, self.deadline_s)
            except TimeoutError:
                self._stop_worker()
                raise GrammarRefused(f"llguidance did not compile it within {self.deadline_s:g} s",
                                     lasting=False) from None
            except (EOFError, OSError):
                self._stop_worker()
                raise GrammarRefused("llguidance's compiler crashed on it") from None
        if "error" in reply:
            raise GrammarRefused(reply["error"])
        return reply

    def _stop_worker(self) -> None:
        """Stop the worker; the next request starts a fresh one."""
        self._worker.stop()
        self._worker = None


class _Worker:
    """One running worker: its process and the two pipes to it."""

    def __init__(self, process: subprocess.Popen[bytes], requests: int, replies: int) -> None:
        self.process = process
        self.requests = requests
        self.replies = replies
        # an engine that drops its checker without close() must not leave the process behind
        self._finalizer = weakref.finalize(self, _stop_process, process, requests, replies)

    @classmethod
    def start(cls, vocabulary: Vocabulary, stack_bytes: int) -> _Worker:
        to_worker, requests = os.pipe()
        replies, from_worker = os.pipe()
        try:
            process = subprocess.Popen(
                [sys.executable, "-P", __file__, str(to_worker), str(from_worker), str(stack_bytes)],
                pass_fds=(to_worker, from_worker), stdin=subprocess.DEVNULL)
        except OSError as e:
            for fd in (to_worker, requests, replies, from_worker):
                os.close(fd)
            raise WorkerUnavailable(f"the grammar compile worker could not start: {e}") from None
        os.close(to_worker)
        os.close(from_worker)
        worker = cls(process, requests, replies)
        try:
            _send(requests, asdict(vocabulary))
            _receive(replies, time.monotonic() + START_DEADLINE_S)
        except (TimeoutError, EOFError, OSError) as e:
            worker.stop()
            raise WorkerUnavailable(f"the grammar compile worker did not start ({type(e).__name__})") from None
        return worker

    def ask(self, message: dict[str, str], deadline_s: float) -> dict[str, Any]:
        _send(self.requests, message)
        return _receive(self.replies, time.monotonic() + deadline_s)

    def stop(self) -> None:
        self._finalizer()


def _stop_process(process: subprocess.Popen[bytes], *fds: int) -> None:
    for fd in fds:
        os.close(fd)
    process.kill()
    process.wait()


def _send(fd: int, message: dict[str, Any]) -> None:
    data = json.dumps(message).encode()
    data = len(data).to_bytes(4, "big") + data
    while data:
        data = data[os.write(fd, data):]


def _receive(fd: int, deadline: float | None) -> dict[str, Any]:
    """The next message; EOFError when the other end closed, TimeoutError when ``deadline`` (monotonic) passes."""
    size = int.from_bytes(_read(fd, 4, deadline), "big")
    return json.loads(_read(fd, size, deadline))


def _read(fd: int, n: int, deadline: float | None) -> bytes:
    data = bytearray()
    while len(data) < n:
        if deadline is not None:   # poll, not select: a busy server's descriptors pass select's 1024
            left = deadline - time.monotonic()
            readable = select.poll()
            readable.register(fd, select.POLLIN)
            if left <= 0 or not readable.poll(left * 1000):
                raise TimeoutError
        chunk = os.read(fd, n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return bytes(data)


# ---- the worker ----

def serve(requests: int, replies: int, stack_bytes: int) -> None:
    """Answer the engine until it closes the pipe: first the vocabulary (answered when built), then grammars."""
    tokenizer = Vocabulary(**_receive(requests, None)).lltokenizer()
    executor = llguidance.LLExecutor()
    _send(replies, {})
    while True:
        try:
            message = _receive(requests, None)
        except EOFError:
            return
        _send(replies, _answer(message, tokenizer, executor, stack_bytes))


def _answer(message: dict[str, str], tokenizer: llguidance.LLTokenizer, executor: llguidance.LLExecutor,
            stack_bytes: int) -> dict[str, str]:
    if "gbnf" in message:
        try:
            return {"lark": gbnf_to_lark(message["gbnf"])}
        except Exception as e:   # the converter's own errors have several types (RecursionError among them)
            return {"error": one_line(str(e)) or type(e).__name__}
    matcher = compile_matcher(tokenizer, message["prove"], stack_bytes)
    if not matcher.is_error():   # the first mask as the engine computes it: some limits are met only there
        mask = llnp.allocate_token_bitmask(1, tokenizer.vocab_size)
        llnp.fill_next_token_bitmask_par(executor, [(matcher, 0)], mask)
    return {"error": one_line(matcher.get_error())} if matcher.is_error() else {}


if __name__ == "__main__":
    serve(*map(int, sys.argv[1:4]))
