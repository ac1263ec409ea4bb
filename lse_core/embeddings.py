"""/v1/embeddings: each input runs through the engine as a prefill-only sequence (batched with every other
sequence, no decode), its final hidden rows (after the model's final norm) are pooled as the model's own
files say, and the vector is L2-normalized.

Pooling: sentence-transformers' modules.json and its Pooling module's config.json in a Hugging Face
directory (Qwen3-Embedding asks for the last token there), a GGUF's ``<arch>.pooling_type``, and mean
pooling for a model that says nothing."""

from __future__ import annotations

import base64
import json
import queue
import threading
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import Field, TypeAdapter
from pydantic.dataclasses import dataclass as pydantic_dataclass

from lse_core.adapters.common import AS_INTEGER, WIDTH_MARK, Body, Count, NonEmpty, Text, TokenId, checked
from lse_core.engine.engine import Engine
from lse_core.engine.sequence import SeqParams, Sequence
from lse_core.errors import LSEError, invalid_request
from lse_core.limits import check_prompt_text, lse_context
from lse_core.model.model import Model
from lse_core.protocol import LSEWarning

POOLING_MODES = ("mean", "max", "cls", "last")
# sentence-transformers' Pooling config keys, and llama.cpp's pooling_type enum (0 is none: not an embedding model)
SENTENCE_TRANSFORMERS_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_max_tokens": "max",
                               "pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "last"}
GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}
CANCEL_POLL_S = 0.02   # how often a waiting request looks whether its client has gone


class EmbeddingsRequest(Body):
    """A /v1/embeddings body: one input or several, as text or token ids."""

    model: str | None = None
    input: Text | NonEmpty[list[Text]] | NonEmpty[list[TokenId]] | NonEmpty[list[NonEmpty[list[TokenId]]]]
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: Annotated[int, Field(ge=1, json_schema_extra={WIDTH_MARK: True}), AS_INTEGER] | None = None
    user: str | None = None


def pooling(model: Model) -> str:
    """How the model's files say to pool its hidden rows: one of POOLING_MODES; raises LSEError when
    they ask for one LSE lacks."""
    path = Path(model.source)
    modules = path / "modules.json"
    if path.is_dir() and modules.is_file():
        module = next((m for m in json.loads(modules.read_text()) if m.get("type", "").endswith(".Pooling")), None)
        if module is not None:
            config_file = path / module.get("path", "") / "config.json"
            config = json.loads(config_file.read_text())
            modes = [mode for key, mode in SENTENCE_TRANSFORMERS_MODES.items() if config.get(key)]
            others = sorted(k for k, v in config.items() if k.startswith("pooling_mode_") and v
                            and k not in SENTENCE_TRANSFORMERS_MODES)
            if len(modes) != 1 or others:
                raise _unsupported(f"{config_file} asks for {', '.join(others + modes) or 'no pooling'}")
            return modes[0]
    kind = model.config.get("pooling_type")
    if kind in (None, 0):
        return "mean"
    if kind not in GGUF_POOLING:
        raise _unsupported(f"{model.source} sets pooling_type {kind}")
    return GGUF_POOLING[kind]


def _unsupported(what: str) -> LSEError:
    return invalid_request(f"{what}; LSE pools one way at a time: {', '.join(POOLING_MODES)}", "unsupported_pooling")


def pool(rows: np.ndarray, mode: str, dimensions: int | None) -> np.ndarray:
    """One vector from an input's hidden rows [T, width]: pooled, cut to ``dimensions``, L2-normalized."""
    vector = {"mean": lambda: rows.mean(axis=0, dtype=np.float64), "max": lambda: rows.max(axis=0),
              "cls": lambda: rows[0], "last": lambda: rows[-1]}[mode]()
    vector = np.asarray(vector, np.float64)[:dimensions]
    return (vector / max(float(np.linalg.norm(vector)), 1e-12)).astype(np.float32)


def prompts(req: EmbeddingsRequest, model: Model, context_length: int) -> list[list[int]]:
    """Each input's tokens (text gets the tokenizer's own special tokens, as sentence-transformers encodes
    it); 400 for an empty input, a token outside the vocabulary or one past the context."""
    tokenizer = model.tokenizer
    inputs = req.input
    if isinstance(inputs, list) and not inputs:
        raise invalid_request("input must not be empty", "invalid_value", "input")
    single = isinstance(inputs, str) or isinstance(inputs[0], int)
    items = [inputs] if single else inputs
    result = []
    for i, item in enumerate(items):
        param = "input" if single else f"input[{i}]"
        if isinstance(item, str):
            check_prompt_text(item, tokenizer, context_length, param, add_special=True)
        ids = tokenizer.encode(item, add_special_tokens=True) if isinstance(item, str) else list(item)
        if not ids:
            raise invalid_request(f"{param} is empty", "invalid_value", param)
        bad = next((t for t in ids if not 0 <= t < tokenizer.vocab_size), None)
        if bad is not None:
            raise invalid_request(f"{param}: token {bad} is outside the vocabulary (size {tokenizer.vocab_size})",
                                  "invalid_value", param)
        if len(ids) > context_length:
            raise invalid_request(f"{param} is {len(ids)} tokens and the context holds {context_length}; shorten it",
                                  "context_full", param, lse_context=lse_context(len(ids), context_length))
        result.append(ids)
    return result


def hidden_states(engine: Engine, prompts: list[list[int]], window: int,
                  cancel: threading.Event | None = None) -> tuple[list[np.ndarray], list[Sequence]]:
    """Every prompt's final hidden rows, from prefill-only sequences, at most ``window`` in the engine at a
    time (so a long list never fills its queue); the finished sequences too. Raises a sequence's error."""
    rows: list[list[np.ndarray]] = [[] for _ in prompts]
    finished: queue.Queue[Sequence] = queue.Queue()
    submitted: list[Sequence] = []

    def submit(i: int) -> None:
        # max_new_tokens 0: the sequence ends once its prompt is computed (the token sampled then is dropped)
        params = SeqParams(prompt=prompts[i], max_new_tokens=0, limit_reason="max_tokens", on_hidden=rows[i].append)
        submitted.append(engine.submit(params, lambda seq, delta: None, finished.put))

    try:
        for i in range(min(window, len(prompts))):
            submit(i)
        for _ in prompts:
            seq = _next_finished(finished, cancel)
            if seq.error is not None:
                raise seq.error
            if len(submitted) < len(prompts):
                submit(len(submitted))
    finally:
        for seq in submitted:
            if not seq.finished:
                engine.cancel(seq)
    return [np.concatenate(r) for r in rows], submitted


def _next_finished(finished: queue.Queue[Sequence], cancel: threading.Event | None) -> Sequence:
    """The next finished sequence; LSEError 499 once ``cancel`` is set (the client has gone)."""
    while True:
        if cancel is not None and cancel.is_set():
            raise LSEError("the client closed the connection", status=499, code="cancelled")
        try:
            return finished.get(timeout=CANCEL_POLL_S)
        except queue.Empty:
            continue


@pydantic_dataclass(frozen=True)
class Embedding:
    object: Literal["embedding"]
    index: Count
    embedding: list[float] | Annotated[str, Field(description="base64 of little-endian float32")]


@pydantic_dataclass(frozen=True)
class EmbeddingUsage:
    prompt_tokens: Count
    total_tokens: Count


@pydantic_dataclass
class EmbeddingList:
    """/v1/embeddings' answer, as OpenAI's; lse_warnings only when there are any."""

    object: Literal["list"]
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage
    lse_warnings: list[LSEWarning] | None = None


_EMBEDDING = TypeAdapter(Embedding)
_EMBEDDING_LIST = TypeAdapter(EmbeddingList)


def response(req: EmbeddingsRequest, vectors: list[np.ndarray], model_id: str, prompt_tokens: int,
             warnings: list[LSEWarning]) -> dict[str, Any]:
    """OpenAI's embeddings list; base64 is the float32 vector's little-endian bytes, as OpenAI sends it. Each
    vector is built apart: one pass over thousands of them would hold the GIL, and so the engine's steps."""
    def encoded(vector: np.ndarray) -> Any:
        if req.encoding_format == "base64":
            return base64.b64encode(vector.astype("<f4").tobytes()).decode()
        return vector.tolist()

    body = EmbeddingList("list", req.model or model_id, [], EmbeddingUsage(prompt_tokens, prompt_tokens),
                         warnings or None)
    data = [_EMBEDDING.dump_python(Embedding("embedding", i, encoded(v))) for i, v in enumerate(vectors)]
    return _EMBEDDING_LIST.dump_python(body, exclude_none=True) | {"data": data}


def parse(body: Any) -> EmbeddingsRequest:
    return checked(EmbeddingsRequest, body)
