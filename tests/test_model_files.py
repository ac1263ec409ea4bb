"""Hugging Face checkpoint loading: what a bad checkpoint tells the operator, what every stored
precision and layout loads to, and where the tokenizer, template and eos ids come from."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import tokenizers
from checkpoints import hf_greedy, lse_greedy, prompt_ids, write_checkpoint
from safetensors.numpy import load_file, save_file

from lse_core.errors import StartupError
from lse_core.model.arch import build_graph
from lse_core.model.files import load_hf
from lse_core.model.tokenizer import Tokenizer

TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


def open_checkpoint(path: Path):
    """What the engine does at startup: load the files, build the graph."""
    return build_graph(load_hf(str(path)))


def startup_error(path: Path) -> str:
    with pytest.raises(StartupError) as error:
        open_checkpoint(path)
    return str(error.value)


@pytest.fixture
def broken(llama_checkpoint, tmp_path) -> Path:
    """A copy of the tiny llama checkpoint to damage."""
    return Path(shutil.copytree(llama_checkpoint, tmp_path / "model"))


def test_no_config_json(broken):
    (broken / "config.json").unlink()
    message = startup_error(broken)
    assert str(broken) in message and "no config.json" in message


def test_config_json_with_a_syntax_error_names_the_line(broken):
    (broken / "config.json").write_text('{\n  "model_type": "llama",\n  "hidden_size": 64,,\n}')
    message = startup_error(broken)
    assert str(broken / "config.json") in message and "invalid JSON at line 3" in message


def test_tensor_of_the_wrong_shape(broken):
    tensors = load_file(broken / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"] = np.zeros((100, 64), np.float32)
    save_file(tensors, broken / "model.safetensors")
    message = startup_error(broken)
    assert str(broken) in message
    assert "'model.layers.1.mlp.up_proj.weight' has shape [100, 64]" in message
    assert "config.json implies [128, 64]" in message


def test_missing_tensor(broken):
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    save_file(tensors, broken / "model.safetensors")
    message = startup_error(broken)
    assert "'model.layers.0.self_attn.k_proj.weight' is missing" in message


def test_unknown_architecture_names_it_and_the_supported_ones(broken):
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "model_type": "mamba"}))
    message = startup_error(broken)
    assert "'mamba'" in message and "config.json model_type" in message
    assert all(name in message for name in ("llama", "qwen2", "qwen3"))


def test_truncated_safetensors(broken):
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    message = startup_error(broken)
    assert str(broken / "model.safetensors") in message and "truncated" in message


def test_malformed_tokenizer_config(broken):
    (broken / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>"\n "bos_token": null}')
    message = startup_error(broken)
    assert str(broken / "tokenizer_config.json") in message and "invalid JSON at line 2" in message


def test_missing_shard_of_a_sharded_checkpoint(tiny_checkpoint, tmp_path):
    sharded = Path(shutil.copytree(tiny_checkpoint("qwen2", max_shard_size="100KB"), tmp_path / "model"))
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (sharded / shard).unlink()
    message = startup_error(sharded)
    assert str(sharded / shard) in message and "missing" in message


def test_sharded_checkpoint_loads_the_same_logits(tiny_checkpoint):
    single, sharded = tiny_checkpoint("qwen2"), tiny_checkpoint("qwen2", max_shard_size="100KB")
    assert len(set(json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"].values())) > 1
    prompt = prompt_ids(single)
    ids, logits = lse_greedy(load_hf(str(single)), prompt, 4)
    sharded_ids, sharded_logits = lse_greedy(load_hf(str(sharded)), prompt, 4)
    assert sharded_ids == ids
    np.testing.assert_array_equal(sharded_logits, logits)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_checkpoint_loads_the_same_logits_as_float32(dtype, tiny_checkpoint):
    """The stored half-precision values widened to float32 are exactly what torch widens them to, and
    the logits are transformers' float32 logits of the same checkpoint."""
    import torch
    from safetensors.torch import load_file as load_torch

    path = tiny_checkpoint("qwen3", dtype=dtype)
    model = load_hf(str(path))
    stored = load_torch(path / "model.safetensors")
    assert {t.dtype for t in stored.values()} == {getattr(torch, dtype)}
    for name, tensor in stored.items():
        assert model.weights[name].dtype == np.float32
        np.testing.assert_array_equal(model.weights[name], tensor.float().numpy())
    prompt = prompt_ids(path)
    hf_ids, hf_logits = hf_greedy(path, prompt, 4)
    ids, logits = lse_greedy(model, prompt, 4)
    assert ids == hf_ids
    assert np.abs(logits - hf_logits).max() <= 1e-4 * np.abs(hf_logits).max()


def test_tokenizer_special_tokens_and_eos_ids(tiny_checkpoint):
    path = tiny_checkpoint("llama", generation_config={"eos_token_id": [0, 2], "max_new_tokens": 7})
    model = load_hf(str(path))
    tokenizer = model.tokenizer
    vocab = tokenizer.backend.get_vocab()
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.bos_token is None
    # the tokenizer's eos, config.json's eos_token_id, generation_config.json's list, once each
    assert sorted(tokenizer.eos_ids) == sorted({vocab["<|im_end|>"], vocab["<|endoftext|>"]})
    assert tokenizer.special == {"pad_token": "<|endoftext|>"}
    assert model.generation_config == {"eos_token_id": [0, 2], "max_new_tokens": 7}
    assert tokenizer.encode("<|im_start|>user", add_special_tokens=False)[0] == vocab["<|im_start|>"]


def test_added_tokens_decoder_entries_missing_from_tokenizer_json_are_added(broken):
    config = json.loads((broken / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"]["900"] = {"content": "<think>", "special": False}
    (broken / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = load_hf(str(broken)).tokenizer
    think = tokenizer.backend.token_to_id("<think>")
    assert think is not None
    assert tokenizer.encode("a<think>b", add_special_tokens=False).count(think) == 1


def test_without_generation_config_or_template(llama_checkpoint):
    model = load_hf(str(llama_checkpoint))
    assert model.generation_config == {}
    assert model.chat_template is None and model.chat_template_source is None


@pytest.mark.parametrize("location, source", [("jinja", "chat_template.jinja"),
                                              ("tokenizer_config", "tokenizer_config.json"),
                                              ("tokenizer_config_list", "tokenizer_config.json"),
                                              ("json", "chat_template.json")])
def test_chat_template_locations(location, source, tmp_path):
    path = write_checkpoint(tmp_path, "llama", chat_template=TEMPLATE, template_location=location)
    model = load_hf(str(path))
    assert model.chat_template == TEMPLATE
    assert model.chat_template_source == str(path / source)


def test_chat_template_jinja_comes_before_tokenizer_config(tmp_path):
    path = write_checkpoint(tmp_path, "llama", chat_template="from tokenizer_config",
                            template_location="tokenizer_config")
    (path / "chat_template.jinja").write_text(TEMPLATE)
    (path / "chat_template.json").write_text(json.dumps({"chat_template": "from chat_template.json"}))
    model = load_hf(str(path))
    assert (model.chat_template, model.chat_template_source) == (TEMPLATE, str(path / "chat_template.jinja"))


def test_template_list_without_a_default_entry(broken):
    config = json.loads((broken / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": TEMPLATE}]
    (broken / "tokenizer_config.json").write_text(json.dumps(config))
    message = startup_error(broken)
    assert str(broken / "tokenizer_config.json") in message and "no entry named 'default'" in message


SENTENCEPIECE_DECODERS = {
    # Llama 2's tokenizer.json: a space is "▁", unknown characters are <0xNN> pieces, and the
    # decoder strips the space the normalizer put in front of the text
    "replace": tokenizers.decoders.Sequence([tokenizers.decoders.Replace("▁", " "), tokenizers.decoders.ByteFallback(),
                                             tokenizers.decoders.Fuse(), tokenizers.decoders.Strip(" ", 1, 0)]),
    "metaspace": tokenizers.decoders.Sequence([tokenizers.decoders.ByteFallback(), tokenizers.decoders.Metaspace()]),
}


@pytest.mark.parametrize("decoder", SENTENCEPIECE_DECODERS)
def test_token_bytes_of_a_sentencepiece_vocabulary(decoder: str):
    """A token's bytes keep the space its "▁" stands for (the whole text's decode strips the first),
    and a <0xNN> piece is its byte."""
    pieces = ["<unk>", *(f"<0x{b:02X}>" for b in range(256)), "▁", "c", "a", "f", "▁c", "▁ca", "▁caf"]
    merges = [("▁", "c"), ("▁c", "a"), ("▁ca", "f")]
    backend = tokenizers.Tokenizer(tokenizers.models.BPE({p: i for i, p in enumerate(pieces)}, merges,
                                                         unk_token="<unk>", byte_fallback=True))
    backend.normalizer = tokenizers.normalizers.Sequence([tokenizers.normalizers.Prepend("▁"),
                                                          tokenizers.normalizers.Replace(" ", "▁")])
    backend.decoder = SENTENCEPIECE_DECODERS[decoder]
    tokenizer = Tokenizer(backend, eos_ids=())
    ids = tokenizer.encode("café caf", False)
    assert [tokenizer.token_bytes(i) for i in ids] == [b" caf", b"\xc3", b"\xa9", b" caf"]
    assert tokenizer.decode(ids).strip() == "café caf"
