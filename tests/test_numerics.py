"""The graph on the CPU interpreter against Hugging Face transformers (the real model code), the
fused groups each architecture makes, and the interpreter's kernels against the IR's semantics."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from checkpoints import cpu_plan, greedy_sampling, hf_greedy, lse_greedy, make_step, prompt_ids

from lse_backends.cpu import KERNELS, CPUDevice, lse_backend
from lse_core.devices.hookspec import CompileContext
from lse_core.graph import ir
from lse_core.graph.fuse import fuse
from lse_core.model.arch import build_graph
from lse_core.model.files import load_hf
from lse_core.model.model import QuantTensor

N_NEW = 16

VARIANTS = {
    "llama": ("llama", {}),
    # Llama 3 style: rope_scaling llama3, biases everywhere, head_dim from hidden / heads
    "llama-llama3-rope-bias": ("llama", dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=False,
                                             rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                           "original_max_position_embeddings": 16})),
    "llama-linear-rope": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "qwen2": ("qwen2", {}),
    # layers from max_window_layers on attend to the last 5 positions only
    "qwen2-sliding-window": ("qwen2", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1)),
    "qwen3": ("qwen3", {}),
    # every layer attends to the last 5 positions
    "mistral-sliding-window": ("mistral", dict(sliding_window=5)),
    "mistral": ("mistral", dict(sliding_window=None)),
    # Granite 3's multipliers, at values of the size the real configs use
    "granite": ("granite", dict(embedding_multiplier=12.0, attention_multiplier=0.0625, residual_multiplier=0.22,
                                logits_scaling=8.0)),
    "phi3": ("phi3", {}),
    "smollm3": ("smollm3", {}),    # layer 3 of 4 has no rope (transformers' default no_rope_layers)
    # Phi-3.5 / Phi-4-mini: longrope inside the trained context (short factors), partial rotary as Phi-4-mini's
    "phi3-longrope-short": ("phi3", dict(partial_rotary_factor=0.75, original_max_position_embeddings=4096,
                                         max_position_embeddings=131072, rope_scaling={
                                             "rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 2.0, 3.5, 6.0],
                                             "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 30.0]})),
    # a trained context of 16 that every prompt here exceeds: the long factors throughout
    "phi3-longrope-long": ("phi3", dict(original_max_position_embeddings=16, rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0] * 8,
        "long_factor": [1.0, 1.5, 2.0, 3.0, 5.0, 8.0, 12.0, 16.0]})),
}


def assert_close(lse: np.ndarray, hf: np.ndarray, label: str) -> None:
    diff, scale = float(np.abs(lse - hf).max()), float(np.abs(hf).max())
    print(f"{label}: max |diff| {diff:.3g}, max |logits| {scale:.3g}, ratio {diff / scale:.3g}")
    assert diff <= 1e-4 * scale, f"{label}: max |diff| {diff} > 1e-4 * {scale}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_prefill_and_greedy_decode_match_transformers(variant, tiny_checkpoint):
    arch, options = VARIANTS[variant]
    path = tiny_checkpoint(arch, **options)
    prompt = prompt_ids(path)
    hf_ids, hf_logits = hf_greedy(path, prompt, N_NEW)
    ids, logits = lse_greedy(load_hf(str(path)), prompt, N_NEW)
    assert logits.dtype == np.float32
    assert ids == hf_ids
    assert_close(logits, hf_logits, variant)


@pytest.mark.parametrize("variant", ["qwen3", "qwen2-sliding-window"])
def test_chunked_prefill_matches_transformers(variant, tiny_checkpoint):
    """Chunks of 3 rows: each continues an earlier prefill of the same sequence in its KV slot
    (and, with a window of 5, reads back past the chunk's start only as far as the window)."""
    arch, options = VARIANTS[variant]
    path = tiny_checkpoint(arch, **options)
    prompt = prompt_ids(path)
    hf_ids, hf_logits = hf_greedy(path, prompt, 4)
    ids, logits = lse_greedy(load_hf(str(path)), prompt, 4, chunk=3, slot=3)
    assert ids == hf_ids
    assert_close(logits, hf_logits, f"{variant} chunked prefill")


def test_step_mixing_prefill_chunks_and_decodes(qwen2_checkpoint):
    """One step holds a decode row of sequence A and a prefill chunk of B (in other slots), the next
    decodes both: each sequence's logits are what it gets alone in transformers."""
    plan = cpu_plan(load_hf(str(qwen2_checkpoint)))
    a = prompt_ids(qwen2_checkpoint)
    b = prompt_ids(qwen2_checkpoint, "The quick brown fox jumps over the lazy dog.")
    a_ids, a_logits = hf_greedy(qwen2_checkpoint, a, 3)
    b_ids, b_logits = hf_greedy(qwen2_checkpoint, b, 2)

    first = plan.run(make_step([(2, a, 0)]), want_logits=True)
    mixed = plan.run(make_step([(2, [a_ids[0]], len(a)), (0, b, 0)]), want_logits=True)
    both = plan.run(make_step([(0, [b_ids[0]], len(b)), (2, [a_ids[1]], len(a) + 1)]), want_logits=True)

    assert [first.next_tokens[0], mixed.next_tokens[0], both.next_tokens[1]] == a_ids
    assert [mixed.next_tokens[1], both.next_tokens[0]] == b_ids
    assert_close(np.stack([first.logits[0], mixed.logits[0], both.logits[1]]), a_logits, "sequence A")
    assert_close(np.stack([mixed.logits[1], both.logits[0]]), b_logits, "sequence B")


LLAMA_LAYER = ["rms_norm", "linear", "linear", "linear", "rope", "rope", "attention", "linear", "add",
               "rms_norm", "linear", "linear", "silu, mul", "linear", "add"]
QWEN3_LAYER = LLAMA_LAYER[:4] + ["rms_norm", "rms_norm"] + LLAMA_LAYER[4:]


@pytest.mark.parametrize("arch, layer_ops", [("llama", LLAMA_LAYER), ("qwen2", LLAMA_LAYER),
                                             ("qwen3", QWEN3_LAYER)])
def test_fused_groups_of_a_layer(arch, layer_ops, tiny_checkpoint):
    """Layer 1's groups, numbered after the embedding and layer 0: norm, q/k/v projections (Qwen3's
    per-head norms), two ropes, attention, o_proj, residual add, norm, gate/up, silu * up fused,
    down, residual add."""
    groups = fuse(build_graph(load_hf(str(tiny_checkpoint(arch)))))
    first = 1 + len(layer_ops)
    expected = [f"fused group {first + i} ({ops.count(',') + 1} node{'s' if ',' in ops else ''}: {ops})"
                for i, ops in enumerate(layer_ops)]
    assert [g.describe() for g in groups if g.layer == 1] == expected
    fused = first + layer_ops.index("silu, mul")
    assert groups[fused].describe() == f"fused group {fused} (2 nodes: silu, mul)"
    tail = [g.describe().split(": ", 1)[1][:-1] for g in groups if g.layer == -1][1:]
    assert tail == ["rms_norm", "last_rows", "linear", *ir.SAMPLING_OPS]


def test_graph_reads_the_models_weights_without_copies(llama_checkpoint):
    model = load_hf(str(llama_checkpoint))
    graph = build_graph(model)
    assert all(graph.weights[name] is model.weights[name] for name in graph.weights)
    # tied embeddings: the head reads embed_tokens
    assert graph.nodes[-len(ir.SAMPLING_OPS) - 1].params == ("model.embed_tokens.weight",)


# --- the interpreter's kernels, against the semantics ir.py documents ---------------------------


def test_the_interpreter_has_a_kernel_for_every_op():
    assert set(KERNELS) == ir.OPS


def test_backend_offers_one_cpu_device_without_codegen():
    backend = lse_backend()
    (info,) = backend.devices()
    assert (backend.name, info.name, info.kind, info.codegen, info.declined) == ("cpu", "cpu:0", "cpu", False, None)
    assert isinstance(backend.open(0), CPUDevice)


def test_every_value_stays_float32_through_every_op(llama_checkpoint, monkeypatch):
    """A step with every sampling op switched on; each group's outputs are recorded (unlinked, so
    that every group is a stage of its own)."""
    monkeypatch.setattr(CPUDevice, "can_link", lambda self, kernel: False)
    model = load_hf(str(llama_checkpoint))
    plan = cpu_plan(model)
    dtypes = {}
    for stage in plan.stages:
        def record(inputs, step, kernel=stage.kernel, names=stage.outputs):
            outputs = kernel(inputs, step)
            dtypes.update({name: out.dtype for name, out in zip(names, outputs, strict=True)})
            return outputs
        stage.kernel = record
    prompt = prompt_ids(llama_checkpoint)
    sampling = greedy_sampling(1)
    sampling.temperature[:], sampling.top_k[:], sampling.top_p[:], sampling.min_p[:] = 0.7, 50, 0.9, 0.01
    sampling.repetition_penalty[:], sampling.presence_penalty[:] = 1.1, 0.2
    sampling.recent[0, :4], sampling.uniform[:] = prompt[-4:], 0.5
    words = -(-model.config["vocab_size"] // 32)
    sampling.constrained, sampling.token_mask = np.array([True]), np.full((1, words), -1, np.int32)
    plan.run(make_step([(0, prompt, 0)], sampling))
    assert dtypes.pop("next_tokens") == np.int32
    assert {f"sampling.{i}.{op}" for i, op in enumerate(ir.SAMPLING_OPS[:-1])} <= set(dtypes)
    assert set(dtypes.values()) == {np.dtype(np.float32)}


def run_node(node: ir.Node, inputs: list[np.ndarray], step: ir.Step, weights: dict | None = None):
    group = fuse(ir.Graph([node], weights or {}, output=node.output))[0]
    kernel = CPUDevice().compile(group, weights or {}, CompileContext(kv_slots=4, kv_len=32, max_tokens=16))
    (out,) = kernel(inputs, step)
    return out


def test_gelu_scale_and_embedding_scale():
    x = np.linspace(-6, 6, 24, dtype=np.float32).reshape(2, 12)
    step = make_step([(0, [3, 1], 0)])
    gelu = run_node(ir.Node("gelu", ("x",), "y"), [x], step)
    expected = torch.nn.functional.gelu(torch.from_numpy(x), approximate="tanh").numpy()
    np.testing.assert_allclose(gelu, expected, rtol=1e-6, atol=1e-6)
    assert gelu.dtype == np.float32
    np.testing.assert_array_equal(run_node(ir.Node("scale", ("x",), "y", attrs={"factor": 0.5}), [x], step), x / 2)
    table = np.arange(20, dtype=np.float32).reshape(5, 4)
    embedded = run_node(ir.Node("embedding", (), "e", ("t",), {"scale": 2.0}), [], step, {"t": table})
    np.testing.assert_array_equal(embedded, [[24, 26, 28, 30], [8, 10, 12, 14]])


def test_quantized_weight_is_dequantized_once_and_used_transposed():
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(0)
    dense = rng.standard_normal((8, 64)).astype(np.float32)
    blocks = quants.quantize(dense, GGMLQuantizationType.Q8_0)
    weight = QuantTensor("Q8_0", blocks, (8, 64))
    x = rng.standard_normal((3, 64)).astype(np.float32)
    out = run_node(ir.Node("linear", ("x",), "y", ("w",)), [x], make_step([(0, [1, 2, 3], 0)]), {"w": weight})
    np.testing.assert_allclose(out, x @ weight.dequantize().T, rtol=1e-5, atol=1e-5)
    assert np.abs(out - x @ dense.T).max() < 0.05 * np.abs(x @ dense.T).max()  # Q8_0 is close to dense


def sampling_step(n_seqs: int, **fields) -> ir.Step:
    sampling = greedy_sampling(n_seqs)
    for name, value in fields.items():
        setattr(sampling, name, np.asarray(value, dtype=SAMPLING_DTYPES.get(name) or getattr(sampling, name).dtype))
    return make_step([(i, [0], 0) for i in range(n_seqs)], sampling)


def sampling_op(op: str, logits, step: ir.Step) -> np.ndarray:
    return run_node(ir.Node(op, ("logits",), "out"), [np.asarray(logits, np.float32)], step)


INF = np.inf
SAMPLING_DTYPES = {"constrained": bool, "token_mask": np.int32}   # fields greedy_sampling leaves None


def test_mask_drops_the_tokens_whose_bit_is_clear_in_constrained_rows_only():
    vocab = 40                                  # two words; the second word's bits past token 39 are unused
    allowed = [0, 5, 31, 32, 39]
    bits = np.zeros(2 * 32, np.uint8)
    bits[allowed] = 1
    word = np.packbits(bits, bitorder="little").view("<i4").astype(np.int32)
    step = sampling_step(2, constrained=[True, False], token_mask=np.stack([word, np.zeros(2, np.int32)]))
    logits = np.arange(2 * vocab, dtype=np.float32).reshape(2, vocab)
    out = sampling_op("mask", logits, step)
    np.testing.assert_array_equal(np.flatnonzero(np.isfinite(out[0])), allowed)
    np.testing.assert_array_equal(out[0, allowed], logits[0, allowed])
    np.testing.assert_array_equal(out[1], logits[1])      # an unconstrained row is untouched


def test_penalize_divides_positive_multiplies_negative_and_subtracts_presence_once():
    recent = np.full((2, ir.PENALTY_WINDOW), -1, np.int32)
    recent[0, :4] = [1, 2, 1, 1]        # token 1 three times: penalised once
    recent[1, :2] = [0, 3]
    step = sampling_step(2, repetition_penalty=[2.0, 1.0], presence_penalty=[0.5, 0.0], recent=recent)
    out = sampling_op("penalize", [[4.0, 4.0, -4.0, 1.0], [4.0, 4.0, -4.0, 1.0]], step)
    np.testing.assert_array_equal(out, [[4.0, 1.5, -8.5, 1.0], [4.0, 4.0, -4.0, 1.0]])  # row 1 needs nothing


def test_temperature_divides_only_rows_that_sample():
    step = sampling_step(3, temperature=[0.5, 0.0, 1.0])
    out = sampling_op("temperature", [[1.0, -2.0]] * 3, step)
    np.testing.assert_array_equal(out, [[2.0, -4.0], [1.0, -2.0], [1.0, -2.0]])


def test_top_k_keeps_ties_at_the_kth_value():
    step = sampling_step(2, temperature=[1.0, 1.0], top_k=[2, 0])
    out = sampling_op("top_k", [[1.0, 3.0, 2.0, 2.0, 0.0]] * 2, step)
    np.testing.assert_array_equal(out, [[-INF, 3.0, 2.0, 2.0, -INF], [1.0, 3.0, 2.0, 2.0, 0.0]])


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass():
    logits = np.log(np.array([[0.1, 0.5, 0.15, 0.25]] * 3, np.float32))
    step = sampling_step(3, temperature=[1.0, 1.0, 1.0], top_p=[0.7, 0.8, 0.01])
    out = sampling_op("top_p", logits, step)
    # by probability 0.5, 0.25, 0.15, 0.1: 0.75 reaches 0.7, 0.9 reaches 0.8; the top token always stays
    assert np.isfinite(out).tolist() == [[False, True, False, True], [False, True, True, True],
                                         [False, True, False, False]]


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    logits = np.log(np.array([[0.1, 0.5, 0.15, 0.25]], np.float32))
    out = sampling_op("min_p", logits, sampling_step(1, temperature=[1.0], min_p=[0.4]))
    assert np.isfinite(out).tolist() == [[False, True, False, True]]  # cut at 0.2


def test_sample_walks_the_cumulative_distribution_in_id_order():
    logits = np.log(np.array([[0.1, 0.5, 0.15, 0.25]] * 4, np.float32))
    logits[3] = [1.0, 5.0, 5.0, 2.0]   # greedy row with a tie: the lowest id
    step = sampling_step(4, temperature=[1.0, 1.0, 1.0, 0.0], uniform=[0.05, 0.59, 0.61, 0.3])
    out = sampling_op("sample", logits, step)
    assert out.dtype == np.int32
    assert out.tolist() == [0, 1, 2, 1]


def test_sample_never_picks_a_dropped_token():
    logits = np.array([[-INF, 1.0, -INF, 1.0, -INF]], np.float32)
    for u in (0.0, 0.49, 0.51, 0.999999):
        token = sampling_op("sample", logits, sampling_step(1, temperature=[1.0], uniform=[u]))[0]
        assert token in (1, 3)
