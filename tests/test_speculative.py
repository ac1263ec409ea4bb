"""Speculative decoding, n-gram prompt lookup (issue 52): greedy replies are token for token those without
speculation, on a tiny checkpoint and on the default model, across stop strings, max_tokens, a full context,
streaming and concurrent sequences; a seeded sampled reply is the same too (each row draws the generator's next
number, and the generator resumes after the rows used); a rejected proposal's K/V rows leave the next step's
logits exactly as a run that never wrote them.

The engine tests run the CPU interpreter in its deterministic mode, whose rows are computed the same whatever
else a step holds: a proposal's rows then cannot perturb the arithmetic, only a fault of the speculation can.
The default model runs on the default pool, --deterministic too, for the same reason."""

from __future__ import annotations

import argparse
import threading
from dataclasses import replace

import numpy as np
import pytest
from checkpoints import make_step, prompt_ids
from test_api_contract import open_engine
from test_api_contract import reply as api_reply
from test_thinking_budget import BUDGET, qwen38  # noqa: F401 (a fixture)
from test_thinking_budget import body as thinking_body
from test_thinking_budget import expected as thinking_reference  # noqa: F401 (a fixture)

from lse_backends.cpu import CPUDevice
from lse_core.api import lse_close, lse_open_or_raise, lse_request_iter
from lse_core.cli import add_engine_options, config_from_args
from lse_core.config import LSEConfig
from lse_core.devices.hookspec import CompileContext
from lse_core.engine import scheduler
from lse_core.engine.engine import Engine
from lse_core.engine.sequence import SeqParams, Sequence
from lse_core.engine.speculation import DraftCost, Speculation, ngram_proposal
from lse_core.graph.plan import Plan
from lse_core.model.arch import build_graph
from lse_core.model.files import load_hf
from lse_core.sampling import NEUTRAL_SAMPLING

# repeated text, so the prompt holds n-grams the reply (a tiny random model's loops) can match
TEXTS = ["def add(a, b):\n    return a + b\n" * 3, "The quick brown fox jumps over the lazy dog. " * 3,
         "Paris is the capital of France; Berlin is the capital of Germany; Rome is",
         "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000"]
KV_LEN = 160


class UnmeasuredRows(DraftCost):
    """A draft cost that measures nothing: every proposal looks free, so every lookup is checked whole (the
    measured cost makes how much is proposed depend on the machine's timing, which tests must not)."""

    def observe(self, draft_rows: int, seconds: float) -> None:
        pass


@pytest.fixture(autouse=True)
def every_proposal_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scheduler, "DraftCost", UnmeasuredRows)


@pytest.fixture(scope="module")
def model(llama_checkpoint):
    return load_hf(str(llama_checkpoint))


@pytest.fixture(scope="module")
def prompts(llama_checkpoint) -> list[list[int]]:
    return [prompt_ids(llama_checkpoint, text) for text in TEXTS]


def deterministic_plan(model, kv_slots: int = 4) -> Plan:
    device = CPUDevice()
    return Plan.build(build_graph(model), pool=[device], ctx=CompileContext(kv_slots, KV_LEN, 64, deterministic=True),
                      fallback_device=device, allow_fallback=True)


def run(model, params_list: list[SeqParams], speculation: Speculation | None) -> list:
    """Every request at once on a fresh engine; the finished sequences and the deltas' text of each."""
    engine = Engine(deterministic_plan(model), model.tokenizer, n_slots=4, max_queue=8, prefill_chunk=64,
                    speculation=speculation)
    left = threading.Semaphore(0)
    texts: dict[int, list[str]] = {}
    try:
        seqs = [engine.submit(p, lambda s, d: texts.setdefault(id(s), []).append(d.content),
                              lambda s: left.release()) for p in params_list]
        for _ in seqs:
            assert left.acquire(timeout=300)
    finally:
        engine.close()
    return [(s, "".join(texts.get(id(s), []))) for s in seqs]


def greedy(prompt: list[int], n: int, **kw) -> SeqParams:
    return SeqParams(prompt=prompt, max_new_tokens=n, limit_reason="max_tokens",
                     sampling=replace(NEUTRAL_SAMPLING, temperature=0.0), **kw)


def assert_same_replies(model, params_list: list[SeqParams]) -> list:
    """Run the requests without and with speculation: the same tokens, logprobs, text and stop; returns the
    speculative run's sequences."""
    plain = run(model, params_list, None)
    speculative = run(model, params_list, Speculation(draft_max=16))
    for (a, text_a), (b, text_b) in zip(plain, speculative):
        assert b.output == a.output
        assert (text_b, b.stop_reason, b.stop_string) == (text_a, a.stop_reason, a.stop_string)
        assert a.draft_n == 0
    return [s for s, _ in speculative]


def test_options_fill_the_config_and_contradictions_stop_the_program():
    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    config = config_from_args(parser.parse_args(["--spec-type", "ngram", "--draft-max", "8", "--draft-min", "2"]))
    assert (config.spec_type, config.draft_max, config.draft_min) == ("ngram", 8, 2)
    assert (LSEConfig().spec_type, LSEConfig().draft_max) == ("none", 16)   # llama-server's default
    with pytest.raises(SystemExit, match="--draft-min"):
        config_from_args(parser.parse_args(["--draft-min", "5", "--draft-max", "2"]))
    with pytest.raises(ValueError, match="spec_type"):
        LSEConfig(spec_type="draft")


def test_ngram_proposal_takes_what_followed_the_latest_longest_match():
    tokens = np.array([5, 1, 2, 3, 9, 9, 7, 1, 2, 3, 4, 8, 6, 1, 2, 3], dtype=np.int32)
    assert ngram_proposal(tokens, 3) == [4, 8, 6]        # 1 2 3 last stood before 4 8 6
    assert ngram_proposal(tokens, 16) == [4, 8, 6, 1, 2, 3]
    assert ngram_proposal(np.array([1, 2, 3, 4], dtype=np.int32), 4) == []   # nothing recurs


def test_proposal_length_follows_acceptance_and_row_cost(prompts):
    """Rows cost a third of a decode step: a sequence whose proposals were kept gets them all; one whose
    proposals failed gets none, and once it has declined for a while it probes again."""
    cost = DraftCost()
    for rows in (0, 4, 0, 8) * 3:
        cost.observe(rows, 0.030 + rows * 0.010)
    assert (round(cost.decode_s, 6), round(cost.per_row, 6)) == (0.03, 0.01)
    seq = Sequence(greedy(prompts[0], 32), None, None, None, None)   # propose reads its tokens and counts
    seq.output = seq.params.prompt[:12]   # repeats the prompt's start: the lookup proposes what followed it
    speculation = Speculation(draft_max=16)
    seq.draft_hits, seq.draft_misses = 20.0, 0.0
    assert len(speculation.propose(seq, 16, cost, cost.decode_s, 0)) >= 6
    seq.draft_hits, seq.draft_misses = 0.0, 6.0
    assert speculation.propose(seq, 16, cost, cost.decode_s, 0) == []
    declined = 1
    while not speculation.propose(seq, 16, cost, cost.decode_s, 0):
        declined += 1
    assert 1 < declined < 20


def test_greedy_replies_equal_without_speculation_with_concurrent_sequences(model, prompts):
    seqs = assert_same_replies(model, [greedy(p, 48, top_logprobs=2) for p in prompts])
    assert sum(s.draft_n_accepted for s in seqs) > 0, "no proposal was kept: the test checks nothing"
    assert all(s.draft_n_accepted <= s.draft_n for s in seqs)


def test_stop_strings_and_max_tokens_end_where_they_would(model, prompts):
    plain = run(model, [greedy(p, 48) for p in prompts], None)
    stops = [text[len(text) // 2: len(text) // 2 + 3] for _, text in plain]   # from the reply's middle
    params = [greedy(p, 48, stop=[stop]) for p, stop in zip(prompts, stops) if stop.strip()]
    params += [greedy(p, n) for p, n in zip(prompts, (1, 2, 5, 17))]
    seqs = assert_same_replies(model, params)
    assert any(s.stop_reason == "stop_sequence" for s in seqs)
    assert all(s.stop_reason == "max_tokens" for s in seqs[-4:])


def test_a_full_context_ends_the_reply_and_no_proposal_passes_it(model, prompts):
    positions: list[int] = []
    params = [SeqParams(prompt=p, max_new_tokens=KV_LEN - len(p), limit_reason="context_full",
                        sampling=replace(NEUTRAL_SAMPLING, temperature=0.0)) for p in prompts]
    seqs = assert_same_replies(model, params)
    assert all(s.stop_reason == "context_full" and len(s.tokens) == KV_LEN for s in seqs)
    engine = Engine(deterministic_plan(model), model.tokenizer, 4, 8, 64, Speculation(16))
    run_step = engine.runner.plan.run
    engine.runner.plan.run = lambda step, *a: positions.append(int(step.positions.max())) or run_step(step, *a)
    done = threading.Event()
    try:
        engine.submit(params[0], lambda s, d: None, lambda s: done.set())
        assert done.wait(300)
    finally:
        engine.close()
    assert max(positions) == KV_LEN - 2   # the last token is sampled, never computed


def test_a_seeded_sampled_reply_is_the_same(model, prompts):
    sampling = replace(NEUTRAL_SAMPLING, temperature=0.7, top_k=5, seed=11, repetition_penalty=1.1)
    seqs = assert_same_replies(model, [SeqParams(prompt=p, max_new_tokens=40, limit_reason="max_tokens",
                                                 sampling=sampling) for p in prompts])
    assert sum(s.draft_n for s in seqs) > 0


def test_speculative_false_turns_it_off(model, prompts):
    seqs = assert_same_replies(model, [greedy(p, 24, speculative=False) for p in prompts])
    assert all(s.draft_n == 0 for s in seqs)


def test_rolled_back_rows_leave_the_next_steps_logits_exact(model, prompts):
    """A step that checks a token and three proposals of which none is kept, then the next token: the logits
    equal, bit for bit, those of the run that computed only the two tokens."""
    prompt = prompts[0]
    n = len(prompt)
    plain, speculative = deterministic_plan(model, 1), deterministic_plan(model, 1)
    first = int(plain.run(make_step([(0, prompt, 0)])).next_tokens[0])
    speculative.run(make_step([(0, prompt, 0)]))
    second = int(plain.run(make_step([(0, [first], n)])).next_tokens[0])
    rejected = [(second + k) % 500 + 3 for k in (1, 2, 3)]
    speculative.run(make_step([(0, [first, *rejected], n)]))
    expected = plain.run(make_step([(0, [second], n + 1)]), want_logits=True).logits
    got = speculative.run(make_step([(0, [second], n + 1)]), want_logits=True).logits
    np.testing.assert_array_equal(got, expected)


# ---- the default model, through the request API ----

CODE = "\n".join(f"def scale_{i}(x):\n    return x * {i} + {3 * i}\n" for i in range(12))
EDIT = {"messages": [{"role": "user", "content": "Rename scale_3 to triple in this code; answer with the code "
                      "alone.\n\n" + CODE}], "max_tokens": 72, "temperature": 0}


@pytest.fixture(scope="module")
def servers():
    plain = lse_open_or_raise({"deterministic": True})
    ngram = lse_open_or_raise({"deterministic": True, "spec_type": "ngram"})
    yield plain, ngram
    lse_close(plain)
    lse_close(ngram)


def reply(lse, body: dict) -> tuple[str, dict]:
    """The reply's text (streamed or not) and its final object's timings and stop_reason."""
    events = list(lse_request_iter(lse, body))
    assert events[-1].kind == "end", events[-1].data
    if body.get("stream"):
        text = "".join(e.data["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e.data["choices"])
        final = next(c for c in events[-1].data if c.get("timings"))
        return text, {"timings": final["timings"], "stop_reason": final["choices"][0]["stop_reason"]}
    choice = events[-1].data["choices"][0]
    return choice["message"]["content"], {"timings": events[-1].data["timings"], "stop_reason": choice["stop_reason"]}


def test_default_model_code_edit_equal_and_proposals_kept(servers):
    plain, ngram = servers
    text, end = reply(ngram, EDIT)
    expected, plain_end = reply(plain, EDIT)
    assert text == expected and end["stop_reason"] == plain_end["stop_reason"]
    assert "draft_n" not in plain_end["timings"]
    assert end["timings"]["draft_n_accepted"] > 0 and end["timings"]["draft_n"] >= end["timings"]["draft_n_accepted"]


def test_default_model_streaming_stop_strings_and_concurrent_requests_equal(servers):
    plain, ngram = servers
    bodies = [dict(EDIT, stream=True), dict(EDIT, stop=["* 2 +"]), dict(EDIT, max_tokens=9),
              {"messages": [{"role": "user", "content": "Write a short poem about rain."}], "max_tokens": 40,
               "temperature": 0}]
    results: dict[int, tuple[str, dict]] = {}
    threads = [threading.Thread(target=lambda i=i, b=b: results.__setitem__(i, reply(ngram, b)))
               for i, b in enumerate(bodies)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for i, body in enumerate(bodies):
        text, end = reply(plain, body)
        assert results[i][0] == text and results[i][1]["stop_reason"] == end["stop_reason"], body
    assert results[1][1]["stop_reason"] == "stop_sequence"


def test_default_model_request_may_turn_it_off_and_is_checked(servers):
    _, ngram = servers
    _, end = reply(ngram, dict(EDIT, speculative=False, max_tokens=16))
    assert "draft_n" not in end["timings"]
    events = list(lse_request_iter(ngram, dict(EDIT, speculative="no")))
    assert events[-1].kind == "error" and events[-1].status == 400
    error = events[-1].data["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "invalid_type", "speculative")


# ---- a thinking budget, structured output and tool calls: tiny checkpoints through the request API ----

def test_a_thinking_budget_closes_the_block_where_it_would(qwen38, thinking_reference):  # noqa: F811 (fixtures)
    """test_thinking_budget's reply (transformers' reference) with speculation: the forced end marker ends a
    kept run of proposals, and the answer follows it."""
    with open_engine(qwen38, kv_len=256, spec_type="ngram") as lse:
        data = api_reply(lse, thinking_body(thinking_budget=BUDGET))
        message = data["choices"][0]["message"]
        assert message["reasoning_content"].strip() == thinking_reference["reasoning"].strip()
        assert message["content"].strip() == thinking_reference["answer"].strip() and message["content"]
        unbounded = api_reply(lse, thinking_body())
        reasoning = unbounded["choices"][0]["message"]["reasoning_content"]
        assert reasoning.strip() == thinking_reference["unbounded"].strip()
        assert data["timings"]["draft_n"] > 0


def test_structured_output_and_tool_calls_equal_without_speculation(llama_checkpoint, qwen38):  # noqa: F811
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    constrained = {"prompt": "The quick brown fox " * 4, "max_tokens": 24, "temperature": 0,
                   "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}
    with open_engine(llama_checkpoint) as plain, open_engine(llama_checkpoint, spec_type="ngram") as ngram:
        got = api_reply(ngram, constrained, "completion")
        assert got["choices"][0] == api_reply(plain, constrained, "completion")["choices"][0]
        assert "draft_n" not in got["timings"]   # a constrained sequence does not speculate
    tools = thinking_body(tools=[{"type": "function", "function": {"name": "f", "parameters": schema}}],
                          max_tokens=40)
    with open_engine(qwen38, kv_len=1024) as plain, open_engine(qwen38, kv_len=1024, spec_type="ngram") as ngram:
        got = api_reply(ngram, tools)
        assert got["choices"][0] == api_reply(plain, tools)["choices"][0]
        assert "draft_n" not in got["timings"]   # tools' calls are a (lazy) grammar: no speculation either
