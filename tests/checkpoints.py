"""Tiny random Hugging Face checkpoints (llama, qwen2, qwen3) written by transformers itself, and
the two ways to run them: the real HF code (the reference) and LSE's graph on the CPU interpreter.

    path = write_checkpoint(tmp_path, "qwen3", num_hidden_layers=3)
    ids, logits = hf_greedy(path, prompt, 16)
    ids, logits = lse_greedy(load_hf(str(path)), prompt, 16)
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from lse_core.devices.hookspec import CompileContext
from lse_core.graph.ir import PENALTY_WINDOW, SamplingBatch, Step
from lse_core.graph.plan import Plan
from lse_core.model.arch import build_graph
from lse_core.model.model import Model

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CORPUS = """\
The quick brown fox jumps over the lazy dog. A serving engine turns a model into a graph of ops.
Each op runs on a device: a GPU, an accelerator, or the CPU interpreter when nothing else can.
Paris is the capital of France; Berlin is the capital of Germany; Rome is the capital of Italy.
Tokens are sampled with temperature, top-k, top-p and min-p after the penalties are applied.
The key and value cache holds every position of every sequence that is being decoded at once.
def add(a, b):\n    return a + b\nprint(add(2, 3))  # 5
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828. Unicode: café, naïve, 東京, Ωμέγα.
"""

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.1)

ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(SMALL, tie_word_embeddings=True, rope_theta=10000.0),     # SmolLM2-like
    "qwen2": dict(SMALL, tie_word_embeddings=False, rope_theta=1000000.0),
    "qwen3": dict(SMALL, num_hidden_layers=3, head_dim=32, tie_word_embeddings=False, rope_theta=1000000.0),
    "mistral": dict(SMALL, head_dim=16, tie_word_embeddings=False, rope_theta=1000000.0),
    "granite": dict(SMALL, tie_word_embeddings=True, rope_theta=10000.0),
    "phi3": dict(SMALL, tie_word_embeddings=False, rope_theta=10000.0, pad_token_id=0, sliding_window=None),
    "smollm3": dict(SMALL, num_hidden_layers=4, tie_word_embeddings=True, rope_theta=2000000.0, pad_token_id=0),
    # 8 experts, 2 a token; the dense layer (mlp_only_layers) keeps intermediate_size
    "qwen3_moe": dict(SMALL, num_hidden_layers=3, head_dim=32, tie_word_embeddings=False, rope_theta=1000000.0,
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                      mlp_only_layers=[1]),
    # YaRN's scaling within the prompts (factor 4 over 64 positions), sliding windows of 4 on even layers
    "gpt_oss": dict(SMALL, num_hidden_layers=3, head_dim=16, tie_word_embeddings=False, num_local_experts=8,
                    num_experts_per_tok=2, intermediate_size=32, sliding_window=4, rope_parameters={
                        "rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                        "original_max_position_embeddings": 64, "rope_theta": 150000.0}),
}

PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


@cache
def train_tokenizer(vocab_size: int = 600) -> str:
    """A byte-level BPE tokenizer trained on CORPUS, as tokenizer.json text (trained once per run)."""
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer)
    return tokenizer.to_str()


def write_checkpoint(directory: Path | str, arch: str, *, seed: int = 0, dtype: str = "float32",
                     max_shard_size: str | None = None, generation_config: dict | None = None,
                     chat_template: str | None = None, template_location: str = "jinja",
                     **config: Any) -> Path:
    """A random ``arch`` model saved by transformers in ``directory`` with its tokenizer files.

    ``config`` overrides the architecture's tiny defaults; ``dtype`` (float32, float16, bfloat16) is
    the stored precision; ``max_shard_size`` (e.g. "100KB") shards the weights; ``template_location``
    puts ``chat_template`` in chat_template.jinja, tokenizer_config (a string), tokenizer_config_list
    (the entry named default) or chat_template.json.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizers.Tokenizer.from_str(train_tokenizer())
    settings = {**ARCH_DEFAULTS[arch], "vocab_size": tokenizer.get_vocab_size(),
                "bos_token_id": tokenizer.token_to_id("<|endoftext|>"),
                "eos_token_id": tokenizer.token_to_id("<|im_end|>"), **config}
    hf_config = AutoConfig.for_model(arch, **settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config)
    with torch.no_grad():  # HF initialises norms to 1 and biases to 0; random ones test that they are read
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.3 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.normal_(0, 0.3)
    save_args = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.to(getattr(torch, dtype)).save_pretrained(directory, **save_args)
    (directory / "generation_config.json").unlink(missing_ok=True)  # transformers writes one; we choose

    tokenizer.save(str(directory / "tokenizer.json"))
    tokenizer_config: dict[str, Any] = {
        "bos_token": None,
        "eos_token": {"content": "<|im_end|>", "special": True},
        "pad_token": "<|endoftext|>",
        "added_tokens_decoder": {str(tokenizer.token_to_id(t)): {"content": t, "special": True}
                                 for t in SPECIAL_TOKENS},
        "model_max_length": settings["max_position_embeddings"],
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if chat_template is not None:
        if template_location == "jinja":
            (directory / "chat_template.jinja").write_text(chat_template)
        elif template_location == "tokenizer_config":
            tokenizer_config["chat_template"] = chat_template
        elif template_location == "tokenizer_config_list":
            tokenizer_config["chat_template"] = [{"name": "tool_use", "template": "{{ 'tools' }}"},
                                                 {"name": "default", "template": chat_template}]
        elif template_location == "json":
            (directory / "chat_template.json").write_text(json.dumps({"chat_template": chat_template}))
        else:
            raise ValueError(f"unknown template_location {template_location!r}")
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    if generation_config is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation_config, indent=2))
    return directory


def prompt_ids(path: Path | str, text: str = PROMPT) -> list[int]:
    return tokenizers.Tokenizer.from_file(str(Path(path) / "tokenizer.json")).encode(text).ids


def hf_greedy(path: Path | str, prompt: list[int], n_new: int) -> tuple[list[int], np.ndarray]:
    """transformers' greedy continuation of ``prompt`` and the logits that chose each new token
    ([n_new, vocab]: the last prompt row, then each generated row but the last)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        ids = torch.tensor([prompt])
        for _ in range(n_new):  # a full forward per token: no HF cache in the reference
            next_id = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
        logits = model(ids).logits[0, len(prompt) - 1:-1].numpy()
    return ids[0, len(prompt):].tolist(), logits


def greedy_sampling(n_seqs: int) -> SamplingBatch:
    """Every op off, temperature 0; each field its own array, so tests can switch ops on."""
    def zeros() -> np.ndarray:
        return np.zeros(n_seqs, np.float32)

    def ones() -> np.ndarray:
        return np.ones(n_seqs, np.float32)

    return SamplingBatch(temperature=zeros(), top_k=np.zeros(n_seqs, np.int32), top_p=ones(), min_p=zeros(),
                         repetition_penalty=ones(), presence_penalty=zeros(),
                         recent=np.full((n_seqs, PENALTY_WINDOW), -1, np.int32), uniform=zeros())


def make_step(rows: list[tuple[int, list[int], int]], sampling: SamplingBatch | None = None) -> Step:
    """A Step from (slot, tokens, first position) per sequence, sampling each sequence's last row."""
    counts = [len(tokens) for _, tokens, _ in rows]
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return Step(
        tokens=np.concatenate([np.asarray(t, np.int32) for _, t, _ in rows]),
        positions=np.concatenate([np.arange(p, p + len(t), dtype=np.int32) for _, t, p in rows]),
        slots=np.array([slot for slot, _, _ in rows], np.int32),
        query_starts=starts,
        sample_rows=starts[1:] - 1,
        sampling=sampling if sampling is not None else greedy_sampling(len(rows)),
    )


def cpu_plan(model: Model, kv_slots: int = 4, kv_len: int = 128, max_tokens: int = 64) -> Plan:
    from lse_backends.cpu import CPUDevice

    device = CPUDevice()
    return Plan.build(build_graph(model), pool=[device], ctx=CompileContext(kv_slots, kv_len, max_tokens),
                      fallback_device=device, allow_fallback=True)


def lse_greedy(model: Model, prompt: list[int], n_new: int, chunk: int | None = None,
               slot: int = 0) -> tuple[list[int], np.ndarray]:
    """LSE's greedy continuation on the CPU interpreter: the prompt in chunks of ``chunk`` rows
    (whole when None), then one decode row per step. Returns the ids and [n_new, vocab] logits."""
    plan = cpu_plan(model)
    chunk = chunk or len(prompt)
    for start in range(0, len(prompt), chunk):
        out = plan.run(make_step([(slot, prompt[start:start + chunk], start)]), want_logits=True)
    ids, logits = [], []
    for position in range(len(prompt), len(prompt) + n_new):
        ids.append(int(out.next_tokens[0]))
        logits.append(out.logits[0])
        if len(ids) < n_new:
            out = plan.run(make_step([(slot, [ids[-1]], position)]), want_logits=True)
    return ids, np.stack(logits)


# Hugging Face layer tensor -> llama.cpp's name (convert_hf_to_gguf.py), for the qwen3moe GGUFs below
_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
}


def _add_tokenizer(writer: Any) -> None:
    """train_tokenizer()'s vocabulary and merges as a GGUF's gpt2 tokenizer."""
    tokenizer = json.loads(train_tokenizer())
    vocab = sorted(tokenizer["model"]["vocab"].items(), key=lambda item: item[1])
    tokens = [token for token, _ in vocab] + [t["content"] for t in tokenizer["added_tokens"]
                                              if t["content"] not in tokenizer["model"]["vocab"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]])
    writer.add_eos_token_id(tokens.index("<|im_end|>"))


def _write_reference(checkpoint: Path, path: Path, tensors: dict[str, np.ndarray]) -> Path:
    """A copy of ``checkpoint`` with these tensors in its one safetensors file."""
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    for file in checkpoint.iterdir():
        if file.suffix != ".safetensors":
            (path / file.name).write_bytes(file.read_bytes())
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def write_moe_gguf(checkpoint: Path, directory: Path, expert_type: str = "F32") -> tuple[Path, Path]:
    """A qwen3_moe checkpoint as llama.cpp's converter writes it: arch ``qwen3moe``, its expert keys, each
    projection of every expert one 3-D ffn_*_exps tensor stored as ``expert_type`` (F32 or a GGUF quant
    type), the rest F32. Returns the GGUF and a Hugging Face checkpoint of exactly the weights it stores
    (the experts' blocks dequantized), which transformers runs as the reference."""
    import gguf
    from gguf import GGMLQuantizationType as QT

    from lse_core.model.files import load_hf

    config = json.loads((checkpoint / "config.json").read_text())
    weights = {name: np.asarray(w, np.float32) for name, w in load_hf(str(checkpoint)).weights.items()}
    n_layers, n_experts = config["num_hidden_layers"], config["num_local_experts"]
    stored: dict[str, np.ndarray] = dict(weights)   # what the GGUF holds, in HF names
    writer = gguf.GGUFWriter(str(directory / "model.gguf"), "qwen3moe")
    metadata = {"block_count": n_layers, "context_length": config["max_position_embeddings"],
                "embedding_length": config["hidden_size"], "feed_forward_length": config["intermediate_size"],
                "head_count": config["num_attention_heads"], "head_count_kv": config["num_key_value_heads"],
                "key_length": config["head_dim"], "value_length": config["head_dim"],
                "rope_freq_base": config["rope_parameters"]["rope_theta"], "layer_norm_rms_eps": config["rms_norm_eps"],
                "expert_count": n_experts, "expert_used_count": config["num_experts_per_tok"],
                "expert_feed_forward_length": config["moe_intermediate_size"]}
    for key, value in metadata.items():   # GGUFWriter's add_<key> writes qwen3moe.<its key>
        getattr(writer, f"add_{key}")(value)
    _add_tokenizer(writer)
    tensors = [("token_embd.weight", "model.embed_tokens.weight"), ("output_norm.weight", "model.norm.weight"),
               ("output.weight", "lm_head.weight")]
    for i in range(n_layers):
        p = f"model.layers.{i}"
        tensors += [(f"blk.{i}.{gguf_name}.weight", f"{p}.{hf_name}.weight") for hf_name, gguf_name
                    in _GGUF_LAYER_NAMES.items() if f"{p}.{hf_name}.weight" in weights]
        for proj in ("gate", "up", "down"):
            if f"{p}.mlp.experts.0.{proj}_proj.weight" not in weights:
                continue   # a dense layer
            experts = [f"{p}.mlp.experts.{e}.{proj}_proj.weight" for e in range(n_experts)]
            stacked = np.stack([stored.pop(name) for name in experts])
            if expert_type != "F32":
                blocks = gguf.quants.quantize(stacked, QT[expert_type])
                writer.add_tensor(f"blk.{i}.ffn_{proj}_exps.weight", blocks, raw_dtype=QT[expert_type])
                stacked = gguf.quants.dequantize(blocks, QT[expert_type]).reshape(stacked.shape)
            else:
                writer.add_tensor(f"blk.{i}.ffn_{proj}_exps.weight", stacked)
            stored.update({name: np.ascontiguousarray(w) for name, w in zip(experts, stacked)})
    for gguf_name, hf_name in tensors:
        writer.add_tensor(gguf_name, weights[hf_name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return directory / "model.gguf", _write_reference(checkpoint, directory / "reference", stored)


def write_mxfp4_checkpoint(checkpoint: Path, directory: Path) -> tuple[Path, Path]:
    """A gpt_oss checkpoint's experts as OpenAI's release stores them, MXFP4 ``*_blocks`` [experts, out, in / 32,
    16] (element 2j in byte j's low nibble, 2j + 1 in its high one) and e8m0 ``*_scales`` [experts, out, in / 32],
    quantized by gguf's MXFP4 quantizer; and a checkpoint of the same values in float32, which transformers runs
    as the reference. Returns (the MXFP4 checkpoint, the reference)."""
    import gguf
    from gguf import GGMLQuantizationType as QT

    from lse_core.model.files import load_hf

    weights = {name: np.asarray(w, np.float32) for name, w in load_hf(str(checkpoint)).weights.items()}
    packed, dense = dict(weights), dict(weights)
    for name, w in weights.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            continue
        matrices = w.transpose(0, 2, 1)   # [experts, out, in]
        blocks = gguf.quants.quantize(np.ascontiguousarray(matrices), QT.MXFP4).reshape(*matrices.shape[:2], -1, 17)
        values = np.stack([blocks[..., 1:] & 0x0F, blocks[..., 1:] >> 4], axis=-2).reshape(*blocks.shape[:3], 32)
        del packed[name]
        packed[f"{name}_blocks"] = values[..., 0::2] | (values[..., 1::2] << 4)
        packed[f"{name}_scales"] = np.ascontiguousarray(blocks[..., 0])
        dequantized = gguf.quants.dequantize(blocks.reshape(-1, 17), QT.MXFP4).reshape(matrices.shape)
        dense[name] = np.ascontiguousarray(dequantized.transpose(0, 2, 1))
    return (_write_reference(checkpoint, directory / "mxfp4", packed),
            _write_reference(checkpoint, directory / "reference", dense))


def write_gpt_oss_gguf(checkpoint: Path, directory: Path) -> tuple[Path, Path]:
    """A gpt_oss checkpoint as llama.cpp's converter writes it: arch ``gpt-oss``, YaRN and window keys, gate and up
    apart as ffn_{gate,up,down}_exps in MXFP4 ([experts, out, in]) with their biases, attn_sinks, the router as
    ffn_gate_inp, the rest F32. Returns the GGUF and a checkpoint of the values it stores for transformers."""
    import gguf
    from gguf import GGMLQuantizationType as QT

    from lse_core.model.files import load_hf

    config = json.loads((checkpoint / "config.json").read_text())
    weights = {name: np.asarray(w, np.float32) for name, w in load_hf(str(checkpoint)).weights.items()}
    stored = dict(weights)
    rope = config["rope_parameters"]
    writer = gguf.GGUFWriter(str(directory / "model.gguf"), "gpt-oss")
    metadata = {"block_count": config["num_hidden_layers"], "context_length": config["max_position_embeddings"],
                "embedding_length": config["hidden_size"], "feed_forward_length": config["intermediate_size"],
                "head_count": config["num_attention_heads"], "head_count_kv": config["num_key_value_heads"],
                "key_length": config["head_dim"], "value_length": config["head_dim"],
                "rope_freq_base": rope["rope_theta"], "layer_norm_rms_eps": config["rms_norm_eps"],
                "expert_count": config["num_local_experts"], "expert_used_count": config["num_experts_per_tok"],
                "expert_feed_forward_length": config["intermediate_size"],
                "sliding_window": config["sliding_window"], "rope_scaling_type": gguf.RopeScalingType.YARN,
                "rope_scaling_factor": rope["factor"],
                "rope_scaling_orig_ctx_len": rope["original_max_position_embeddings"]}
    for key, value in metadata.items():
        getattr(writer, f"add_{key}")(value)
    _add_tokenizer(writer)
    names = {"input_layernorm.weight": "attn_norm.weight",
             "post_attention_layernorm.weight": "post_attention_norm.weight", "self_attn.sinks": "attn_sinks.weight",
             "mlp.router.weight": "ffn_gate_inp.weight", "mlp.router.bias": "ffn_gate_inp.bias",
             **{f"self_attn.{p}_proj.{kind}": f"attn_{'output' if p == 'o' else p}.{kind}"
                for p in "qkvo" for kind in ("weight", "bias")}}
    tensors = {"token_embd.weight": weights["model.embed_tokens.weight"],
               "output_norm.weight": weights["model.norm.weight"], "output.weight": weights["lm_head.weight"]}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        tensors |= {f"blk.{i}.{gguf_name}": weights[f"{p}.{hf_name}"] for hf_name, gguf_name in names.items()}
        gate_up, down = weights[f"{p}.mlp.experts.gate_up_proj"], weights[f"{p}.mlp.experts.down_proj"]
        bias, stored_gate_up = weights[f"{p}.mlp.experts.gate_up_proj_bias"], gate_up.copy()
        for role, matrices, role_bias in (("gate", gate_up[:, :, 0::2], bias[:, 0::2]),
                                          ("up", gate_up[:, :, 1::2], bias[:, 1::2]),
                                          ("down", down, weights[f"{p}.mlp.experts.down_proj_bias"])):
            blocks = gguf.quants.quantize(np.ascontiguousarray(matrices.transpose(0, 2, 1)), QT.MXFP4)
            writer.add_tensor(f"blk.{i}.ffn_{role}_exps.weight", blocks, raw_dtype=QT.MXFP4)
            tensors[f"blk.{i}.ffn_{role}_exps.bias"] = np.ascontiguousarray(role_bias)
            values = gguf.quants.dequantize(blocks, QT.MXFP4).transpose(0, 2, 1)
            if role == "down":
                stored[f"{p}.mlp.experts.down_proj"] = np.ascontiguousarray(values)
            else:   # gate in the even columns, up in the odd ones
                stored_gate_up[:, :, ("gate", "up").index(role)::2] = values
        stored[f"{p}.mlp.experts.gate_up_proj"] = stored_gate_up
    for name, tensor in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(tensor))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return directory / "model.gguf", _write_reference(checkpoint, directory / "reference", stored)
