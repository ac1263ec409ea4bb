"""What int8 activations cost a model's answers: the first-token logits of chat prompts, each prefilled with
every linear's input rounded as jit:0's GEMM tiles round it, against float32 on the same weights.

The interpreter (cpu) runs the model on its weights dequantized to float32; each linear's input is first
replaced by what the int8 tiles see of it, ``int8.dequantize`` of ``int8.quantize_compact`` (the jit's own
rounding): one plane (8 bits a value, llama.cpp's Q8_0 activations) or two (15 bits, what jit:0 gives Q4
weights' prefill). The output projection meets one row in a one-token tile and is left in float32. The
prompts: 20 questions in the model's chat template (as plain text where it has none), each also cut 4 and 8
tokens short where that leaves most of it. For each it reports the RMS and largest logit error against
float32 and whether the top token differs. ``--two-for`` gives two planes to the weights whose names contain
one of the given parts and one to the rest, to see where the error comes from.

    python benchmarks/activation_precision.py [-m model.gguf] [--two-for q_proj,k_proj --two-for down_proj]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

import lse_backends.cpu as cpu
from lse_backends.cpu import CPUDevice
from lse_backends.jit import int8
from lse_core.devices.hookspec import CompileContext
from lse_core.graph.ir import Node, Step
from lse_core.graph.plan import Plan
from lse_core.model.arch import build_graph
from lse_core.model.default import load_model
from lse_core.template.render import ChatTemplate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_step import step_of  # noqa: E402  (a sibling file, not a package)

QUESTIONS = (
    "What is the capital of France?", "Write a short poem about the sea.", "Explain photosynthesis to a child.",
    "List three uses of copper.", "How do I sort a list in Python?", "Who wrote Hamlet?", "What is 17 times 23?",
    "Translate 'good morning' into Spanish.", "Give me a recipe for pancakes.", "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet.", "What are the planets of the solar system?",
    "How does a bicycle stay upright?", "Name a famous painter from Spain.", "What is the boiling point of water?",
    "Describe a cat in three words.", "What causes earthquakes?", "How many legs does a spider have?",
    "Suggest a name for a pet fish.", "What is machine learning?")
CUTS = (0, 4, 8)   # each prompt whole and this many tokens short: more positions, other near-ties


def as_tiles_see(x: np.ndarray, planes: int) -> np.ndarray:
    """x's rows as the int8 GEMM tiles multiply them: each block of 32 rounded to ``planes`` planes."""
    x = np.ascontiguousarray(x, np.float32)
    scratch = np.empty((x.shape[0], int8.compact_width(x.shape[1], planes)), np.float32)
    int8.quantize_compact(x, scratch, planes)
    return int8.dequantize(x, scratch, planes)


@contextlib.contextmanager
def rounded_linears(planes_of: dict[str, int]) -> Iterator[None]:
    """The interpreter's linears, while this runs, multiplying their input as rounded by ``as_tiles_see`` in
    ``planes_of[weight name]`` planes (0: float32, as is)."""
    float_linear = cpu.KERNELS["linear"]

    def linear(node: Node, params: list[np.ndarray], ctx: CompileContext):
        run = float_linear(node, params, ctx)
        planes = planes_of.get(node.params[0], 0) if node.output != "logits" else 0

        def rounded(inputs: Sequence[np.ndarray], step: Step) -> np.ndarray:
            return run([as_tiles_see(inputs[0], planes)] if planes else inputs, step)

        return rounded

    cpu.KERNELS["linear"] = linear
    try:
        yield
    finally:
        cpu.KERNELS["linear"] = float_linear


def first_logits(model, prompts: list[list[int]], planes_of: dict[str, int]) -> np.ndarray:
    """[prompt, vocabulary]: each prompt's next-token logits, its prefill's linears rounded as planes_of says."""
    with rounded_linears(planes_of):
        device = CPUDevice()
        plan = Plan.build(build_graph(model), [device], CompileContext(1, max(map(len, prompts)) + 1, 512), device)
    return np.array([plan.run(step_of([(0, ids, 0)]), want_logits=True).logits[0] for ids in prompts])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-m", "--model", default=None)
    parser.add_argument("--two-for", action="append", default=[],
                        help="comma-separated parts of weight names that take two planes (the rest one)")
    args = parser.parse_args()
    model = load_model(args.model)
    template = model.chat_template and ChatTemplate(model.chat_template, model.chat_template_source,
                                                    model.tokenizer.template_variables())
    prompts = []
    for question in QUESTIONS:   # a model without a chat template completes the question as plain text
        ids = (model.tokenizer.encode(template.render([{"role": "user", "content": question}]), False) if template
               else model.tokenizer.encode(f"Question: {question}\nAnswer:", True))
        prompts += [ids[:len(ids) - cut] for cut in CUTS if cut < len(ids) // 2]
    linears = [n.params[0] for n in build_graph(model).nodes if n.op == "linear" and n.output != "logits"]

    reference = first_logits(model, prompts, {})
    top2 = np.sort(reference, axis=1)[:, -2:]
    print(f"{len(prompts)} prompts, {len(linears)} linears rounded; top-2 margin under 0.1 logits at "
          f"{int(np.sum(top2[:, 1] - top2[:, 0] < 0.1))} of them")
    print("| activations | RMS logit error | largest, mean over prompts | top token differs |")
    print("|---|---:|---:|---:|")
    runs = [("one plane (8 bits)", dict.fromkeys(linears, 1)), ("two planes (15 bits)", dict.fromkeys(linears, 2))]
    for parts in args.two_for:
        wide = parts.split(",")
        runs.append((f"two for {parts}, one elsewhere",
                     {name: 2 if any(p in name for p in wide) else 1 for name in linears}))
    for label, planes_of in runs:
        logits = first_logits(model, prompts, planes_of)
        error = logits - reference
        flips = int(np.sum(logits.argmax(axis=1) != reference.argmax(axis=1)))
        print(f"| {label} | {np.sqrt(np.mean(error ** 2, axis=1)).mean():.4f} | "
              f"{np.abs(error).max(axis=1).mean():.4f} | {flips} of {len(prompts)} |")


if __name__ == "__main__":
    main()
