"""/v1/embeddings against an independent reference: transformers' base model (its last_hidden_state, after the
final norm) on the same tiny checkpoint, pooled as the checkpoint's sentence-transformers files say (or by mean
when it has none), L2-normalized. Driven in-process, through a real lse-server with the official openai SDK
(which asks for base64 by default), and on a GGUF that sets llama.cpp's pooling_type."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import gguf
import httpx
import numpy as np
import pytest
import tokenizers
from test_api_contract import open_engine
from test_gguf import write_small_gguf
from test_server import Server, lse_server, validate

from lse_core.api import LSE, lse_embeddings, lse_status
from lse_core.embeddings import pooling
from lse_core.errors import LSEError
from lse_core.model.gguf import load_gguf

TEXTS = ["The quick brown fox", "Paris is the capital of France.", "Hi", "def add(a, b):\n    return a + b",
         "Tokens are sampled with temperature.", "café, naïve, 東京", "The key and value cache"]
KV_LEN = 64
# a float32 KV cache where embeddings are held to transformers' fp32 ones within 1e-5 (the f16 default moves them
# ~1e-4: test_the_default_f16_cache_stays_near_the_reference)
F32_KV = {"cache_type_k": "f32", "cache_type_v": "f32"}


def reference(model: Path, ids: list[int], mode: str, gguf_file: str | None = None) -> np.ndarray:
    """transformers' pooled, normalized final hidden state for one input."""
    import torch
    from transformers import AutoModel

    options = {"gguf_file": gguf_file} if gguf_file else {}
    hf = AutoModel.from_pretrained(str(model), dtype=torch.float32, attn_implementation="eager", **options).eval()
    with torch.no_grad():
        hidden = hf(torch.tensor([ids])).last_hidden_state[0].double().numpy()
    vector = hidden.mean(axis=0) if mode == "mean" else hidden[-1]
    return vector / np.linalg.norm(vector)


def encode(model: Path, text: str) -> list[int]:
    return tokenizers.Tokenizer.from_file(str(model / "tokenizer.json")).encode(text).ids


def with_sentence_transformers_pooling(base: Path, directory: Path, mode_key: str) -> Path:
    """A copy of ``base`` with sentence-transformers' modules.json and 1_Pooling/config.json asking for ``mode_key``."""
    model = directory / "model"
    shutil.copytree(base, model)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (model / "modules.json").write_text(json.dumps(modules))
    (model / "1_Pooling").mkdir()
    config = {"word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
              "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
              "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": False, "include_prompt": True}
    (model / "1_Pooling" / "config.json").write_text(json.dumps(config | {mode_key: True}))
    return model


# ---- mean pooling (no pooling files), in-process ----

@pytest.fixture(scope="module")
def llama(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def llama_lse(llama: Path) -> Iterator[LSE]:
    with open_engine(llama, kv_len=KV_LEN, parallel=2, **F32_KV) as lse:
        yield lse


def test_mean_pooling_matches_transformers(llama_lse: LSE, llama: Path) -> None:
    """Seven inputs through two slots: every one pooled from its own rows, in order."""
    data = lse_embeddings(llama_lse, {"input": TEXTS})
    assert [d["index"] for d in data["data"]] == list(range(len(TEXTS)))
    ids = [encode(llama, text) for text in TEXTS]
    for item, tokens in zip(data["data"], ids):
        np.testing.assert_allclose(item["embedding"], reference(llama, tokens, "mean"), atol=2e-6)
    assert data["usage"] == {"prompt_tokens": sum(map(len, ids)), "total_tokens": sum(map(len, ids))}
    assert lse_status(llama_lse)["engine"]["running"] == 0


def test_a_cached_prefix_is_recomputed(llama_lse: LSE) -> None:
    """The second request finds the input's tokens in a slot; mean pooling still needs every row."""
    first, second = (lse_embeddings(llama_lse, {"input": TEXTS[1]})["data"][0]["embedding"] for _ in range(2))
    np.testing.assert_array_equal(first, second)


def test_token_ids_and_dimensions(llama_lse: LSE, llama: Path) -> None:
    ids = encode(llama, TEXTS[0])
    whole = np.array(lse_embeddings(llama_lse, {"input": ids})["data"][0]["embedding"])
    assert whole.shape == (64,)
    cut = lse_embeddings(llama_lse, {"input": [ids, ids], "dimensions": 16})["data"]
    expected = whole[:16] / np.linalg.norm(whole[:16])
    for item in cut:
        np.testing.assert_allclose(item["embedding"], expected, atol=1e-6)
        assert abs(np.linalg.norm(item["embedding"]) - 1) < 1e-6


def test_on_the_jit_device(llama: Path) -> None:
    """jit:0 links the whole forward pass into one program; the final norm's rows still come out of it."""
    with open_engine(llama, kv_len=KV_LEN, pool="jit:0", **F32_KV) as lse:
        data = lse_embeddings(lse, {"input": TEXTS[:2]})["data"]
    for item, text in zip(data, TEXTS[:2]):
        np.testing.assert_allclose(item["embedding"], reference(llama, encode(llama, text), "mean"), atol=1e-5)


@pytest.mark.parametrize("pool", ["cpu:0", "jit:0"])
def test_the_default_f16_cache_stays_near_the_reference(llama: Path, pool: str) -> None:
    """With the default f16 KV cache, each embedding is within 5e-4 of transformers' fp32 one (measured ~1e-4)."""
    with open_engine(llama, kv_len=KV_LEN, pool=pool) as lse:
        assert lse_status(lse)["kv_cache"]["type_k"] == "f16"
        data = lse_embeddings(lse, {"input": TEXTS[:2]})["data"]
    for item, text in zip(data, TEXTS[:2]):
        np.testing.assert_allclose(item["embedding"], reference(llama, encode(llama, text), "mean"), atol=5e-4)


def test_input_past_the_context_names_its_index(llama_lse: LSE) -> None:
    with pytest.raises(LSEError) as caught:
        lse_embeddings(llama_lse, {"input": ["Hi", "word " * 100]})
    body = caught.value.body()["error"]
    assert (body["code"], body["param"]) == ("context_full", "input[1]")
    assert body["lse_context"]["context_length"] == KV_LEN and body["lse_context"]["tokens_used"] > KV_LEN


# ---- last-token pooling from sentence-transformers' files, through the server ----

@pytest.fixture(scope="module")
def last_token_model(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_sentence_transformers_pooling(tiny_checkpoint("qwen3"), tmp_path_factory.mktemp("qwen3_embedding"),
                                              "pooling_mode_lasttoken")


@pytest.fixture(scope="module")
def server(last_token_model: Path) -> Iterator[Server]:
    with lse_server(last_token_model, "--kv-len", str(KV_LEN), "--parallel", "2", "--pool", "cpu:0",
                    "--cache-type-k", "f32", "--cache-type-v", "f32") as s:
        yield s


def test_last_token_pooling_with_the_openai_sdk(server: Server, last_token_model: Path) -> None:
    client = server.openai()
    expected = [reference(last_token_model, encode(last_token_model, t), "last") for t in TEXTS[:3]]
    as_base64 = client.embeddings.create(model="model", input=TEXTS[:3])     # the SDK's default: base64
    as_floats = client.embeddings.create(model="model", input=TEXTS[:3], encoding_format="float")
    for reply in (as_base64, as_floats):
        assert reply.object == "list" and [d.index for d in reply.data] == [0, 1, 2]
        for item, vector in zip(reply.data, expected):
            np.testing.assert_allclose(item.embedding, vector, atol=2e-6)
    assert as_base64.usage.prompt_tokens == sum(len(encode(last_token_model, t)) for t in TEXTS[:3])
    mean = reference(last_token_model, encode(last_token_model, TEXTS[0]), "mean")
    assert np.abs(np.array(as_floats.data[0].embedding) - mean).max() > 0.01     # not what mean pooling gives
    short = client.embeddings.create(model="model", input=TEXTS[0], dimensions=8, encoding_format="float")
    np.testing.assert_allclose(short.data[0].embedding, expected[0][:8] / np.linalg.norm(expected[0][:8]), atol=2e-6)


def test_openapi_describes_the_reply(server: Server) -> None:
    with server.client() as http:
        doc = http.get("/openapi.json").json()
        for body in ({"input": TEXTS[:2]}, {"input": [[1, 2], [3]], "encoding_format": "base64", "dimensions": 4}):
            validate(body, "EmbeddingsRequest", doc)
            validate(http.post("/v1/embeddings", json=body).json(), "EmbeddingList", doc)


@pytest.mark.parametrize("body, code, param", [
    ({}, "missing_field", "input"),
    ({"input": []}, "invalid_value", "input"),
    ({"input": ["Hi", ""]}, "invalid_value", "input[1]"),
    ({"input": [1, 2, 100000]}, "invalid_value", "input"),
    ({"input": [[1, 2], [-1]]}, "invalid_value", "input[1][0]"),
    ({"input": [1, "two"]}, "invalid_type", "input[1]"),
    ({"input": "Hi", "encoding_format": "int8"}, "invalid_value", "encoding_format"),
    ({"input": "Hi", "dimensions": 0}, "invalid_value", "dimensions"),
    ({"input": "Hi", "dimensions": 65}, "invalid_value", "dimensions"),
    ({"input": ["Hi", "Hello", "word " * 100]}, "context_full", "input[2]"),
    ({"input": "Hi", "model": "text-embedding-3-small"}, "model_not_found", "model"),
])
def test_bad_input(server: Server, body: dict, code: str, param: str) -> None:
    with server.client() as http:
        response = http.post("/v1/embeddings", json=body)
    assert response.status_code in (400, 404), response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == (code, param), error
    assert error["type"] == "invalid_request_error" and error["message"]


def test_the_server_still_serves(server: Server) -> None:
    assert len(server.openai().embeddings.create(model="model", input="Hi").data[0].embedding) == 64
    response = httpx.post(f"{server.url}/v1/embeddings", json={"input": "Hi"})
    assert response.status_code == 401


def test_unsupported_pooling_files_are_named(tiny_checkpoint, tmp_path: Path) -> None:
    model = with_sentence_transformers_pooling(tiny_checkpoint("llama"), tmp_path, "pooling_mode_weightedmean_tokens")
    with open_engine(model) as lse:
        with pytest.raises(LSEError, match="pooling_mode_weightedmean_tokens") as caught:
            lse_embeddings(lse, {"input": "Hi"})
        assert caught.value.body()["error"]["code"] == "unsupported_pooling"


# ---- a GGUF's pooling_type ----

def test_gguf_pooling_type(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LSE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "embedding.gguf"
    write_small_gguf(path, "qwen3", pooling_type=gguf.PoolingType.LAST)
    assert pooling(load_gguf(str(path))) == "last"
    prompt = [5, 77, 140, 3, 250, 9, 61]
    with open_engine(path, **F32_KV) as lse:
        vector = lse_embeddings(lse, {"input": prompt})["data"][0]["embedding"]
    np.testing.assert_allclose(vector, reference(tmp_path, prompt, "last", gguf_file=path.name), atol=1e-5)
    plain = tmp_path / "plain.gguf"
    write_small_gguf(plain, "qwen3")
    assert pooling(load_gguf(str(plain))) == "mean"


def busy(engine: dict) -> bool:
    return bool(engine["running"] or engine["waiting"])


def test_a_client_that_leaves_cancels_its_embeddings(server: Server) -> None:
    """Many inputs, the connection closed soon after: the engine stops computing them and the slots free."""
    body = {"input": [[i % 500 + 1] * (KV_LEN - 8) for i in range(2000)]}
    with server.client() as http:
        before = http.get("/v1/lse/status").json()["engine"]["steps"]
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/embeddings", json=body, timeout=0.5)
        deadline = time.monotonic() + 10
        # In flight, a batch can have finished and the next not yet been admitted (running 0, waiting > 0).
        while busy(engine := http.get("/v1/lse/status").json()["engine"]) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine["running"] == engine["waiting"] == 0 and engine["free_slots"] == engine["slots"]
        time.sleep(0.3)
        assert http.get("/v1/lse/status").json()["engine"]["steps"] == engine["steps"]   # nothing more computed
        assert engine["steps"] - before < 1000    # far from the 1000 steps every input needs
        metrics = http.get("/metrics").text
    assert 'lse_requests_total{endpoint="embeddings",outcome="error_499"} 1' in metrics
