"""Batched decoding (ddtree.batch_engine, ddtree.batching) on the demo pair in float32 on the CPU:
every request's tokens equal its run alone through the one-request engine, whoever shares its
rounds: mixed tree budgets and sampling, per-request seeds, requests joining and leaving between
rounds, cancellation, a request filling its context, log-probs, a reused row."""
from __future__ import annotations

import pytest

from ddtree.batch_engine import BatchEngine
from ddtree.config import SamplingParams, parse_tree_budget
from ddtree.llm import LLM

MAX_LEN = 96


@pytest.fixture(scope="module")
def llm(demo_pair):
    return LLM(*demo_pair, device="cpu", max_model_len=MAX_LEN)


def params(temperature=0.0, seed=None, max_tokens=24, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, ignore_eos=True, **kw)


# (prompt, sampling, tree budget): greedy and sampled rows, every kind of tree shape.
CASES = [
    ("def fib(n):", params(), "ar"),
    ("import os\n", params(), 64),
    ("class Stack:", params(0.8, seed=7), "chain"),
    ("def quicksort(xs):", params(1.0, seed=11), 16),
    ("for i in range(", params(0.6, seed=3, top_k=20), 8),
]


def solo(llm, prompt, sampling, budget) -> list[int]:
    return llm.generate(prompt, sampling, tree_budget=budget).token_ids


@pytest.fixture(scope="module")
def solo_tokens(llm):
    return [solo(llm, *case) for case in CASES]


def test_every_row_equals_its_solo_run_with_rows_joining_and_leaving(llm, solo_tokens):
    batch = llm.batched()
    assert batch.free == 8
    outputs = {}
    # Two rows start; the others join one per round, so every row's rounds are shared with a
    # changing set of others, and the rows leave at different rounds (their budgets differ).
    for i, (prompt, sampling, budget) in enumerate(CASES[:2]):
        request, event = batch.add(llm.encode(prompt), sampling, parse_tree_budget(budget))
        outputs[id(request)] = (i, list(event.token_ids))
    joining = list(range(2, len(CASES)))
    while batch.running:
        for request, event in batch.step():
            outputs[id(request)][1].extend(event.token_ids)
            if event.result is not None:
                assert event.result.token_ids == outputs[id(request)][1]
        if joining:
            i = joining.pop(0)
            prompt, sampling, budget = CASES[i]
            request, event = batch.add(llm.encode(prompt), sampling, parse_tree_budget(budget))
            outputs[id(request)] = (i, list(event.token_ids))
    assert batch.free == 8
    for i, tokens in outputs.values():
        assert tokens == solo_tokens[i], CASES[i]


def test_padded_prompts_go_through_the_llms_engine_and_rows_equal_solo_runs(demo_pair, solo_tokens):
    """With padded prefill (as with graphs), the batch prefills each prompt through the LLM's
    one-request engine (its prefill graphs on a GPU) and copies the entries into the row."""
    padded = LLM(*demo_pair, device="cpu", max_model_len=MAX_LEN, padded_prefill=True)
    batch = padded.batched()
    assert batch.engine.prefill_engine is padded.engine
    ran = []
    prefill = padded.engine.prefill_padded
    padded.engine.prefill_padded = lambda prompt: (ran.append(len(prompt)), prefill(prompt))[1]
    outputs = {}
    for i, (prompt, sampling, budget) in enumerate(CASES):
        request, event = batch.add(padded.encode(prompt), sampling, parse_tree_budget(budget))
        outputs[id(request)] = (i, list(event.token_ids))
        if i == 1:  # the first two decode a round before the others join
            for request, event in batch.step():
                outputs[id(request)][1].extend(event.token_ids)
    while batch.running:
        for request, event in batch.step():
            outputs[id(request)][1].extend(event.token_ids)
    assert len(ran) == len(CASES)
    for i, tokens in outputs.values():
        assert tokens == solo_tokens[i], CASES[i]


def test_generate_with_a_list_batches_and_keeps_prompt_order(llm, solo_tokens):
    prompts = [case[0] for case in CASES]
    results = llm.generate(prompts, [case[1] for case in CASES], tree_budget=None)
    assert [r.prompt_token_ids for r in results] == [llm.encode(p) for p in prompts]
    # One budget for the list (the default): the greedy rows equal their solo runs at that budget.
    for result, (prompt, sampling, _) in zip(results, CASES):
        assert len(result.token_ids) == sampling.max_tokens
        if sampling.greedy:
            assert result.token_ids == solo(llm, prompt, sampling, None)


def test_cancelled_rows_stop_and_the_others_go_on(llm, solo_tokens):
    batch = llm.batched()
    requests = [batch.add(llm.encode(p), s, parse_tree_budget(b))[0] for p, s, b in CASES[:3]]
    tokens = {id(r): [] for r in requests}
    batch.step()  # one round of all three; then the middle one's client goes away
    batch.cancel(requests[1])
    assert requests[1] not in batch.running and batch.free == 8 - 2
    while batch.running:
        for request, event in batch.step():
            assert request is not requests[1]
            if event.result is not None:
                tokens[id(request)] = event.result.token_ids
    assert tokens[id(requests[0])] == solo_tokens[0]
    assert tokens[id(requests[2])] == solo_tokens[2]


def test_a_reused_row_reads_nothing_of_its_last_sequence(llm, solo_tokens):
    engine = BatchEngine(llm.target, llm.drafter, MAX_LEN, max_rows=1, max_nodes=65)
    for i in (1, 0, 1):  # the same row, three sequences one after another
        prompt, sampling, budget = CASES[i]
        seq, step = engine.add(llm.encode(prompt), sampling, parse_tree_budget(budget))
        tokens = list(step.tokens)
        while len(tokens) < sampling.max_tokens:
            tokens += engine.step()[0][1].tokens
        engine.remove(seq)
        assert tokens[: sampling.max_tokens] == solo_tokens[i]


def test_a_row_filling_its_context_equals_its_solo_run(llm):
    prompt = llm.encode("def f(x):\n    return x\n" * 6)
    room = MAX_LEN - len(prompt)
    assert 8 < room < 60
    cases = [(prompt, params(max_tokens=room), 64), ("x = 1", params(max_tokens=16), "chain")]
    expected = [solo(llm, *case) for case in cases]
    results = llm.generate([c[0] for c in cases], [c[1] for c in cases], tree_budget=64)
    assert results[0].token_ids == expected[0] and results[0].finish_reason == "length"
    assert len(prompt) + len(results[0].token_ids) == MAX_LEN


def test_logprobs_equal_the_solo_runs(llm):
    sampling = params(max_tokens=12, logprobs=3)
    expected = llm.generate("def fib(n):", sampling, tree_budget=64)
    batch = llm.batched()
    batch.add(llm.encode("import os\n"), params(max_tokens=12), parse_tree_budget("chain"))
    batch.add(llm.encode("def fib(n):"), sampling, parse_tree_budget(64))
    result = None
    while batch.running:
        for request, event in batch.step():
            if event.result is not None and event.result.logprobs is not None:
                result = event.result
    assert result.token_ids == expected.token_ids
    for got, want in zip(result.logprobs, expected.logprobs):
        assert got.token_id == want.token_id
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t for t, _ in got.top] == [t for t, _ in want.top]


def test_refusals(llm):
    engine = BatchEngine(llm.target, llm.drafter, MAX_LEN, max_rows=1, max_nodes=17)
    with pytest.raises(ValueError, match="at most 17"):
        engine.add([1, 2, 3], params(), parse_tree_budget(64))
    engine.add([1, 2, 3], params(), parse_tree_budget(16))
    with pytest.raises(RuntimeError, match="every row is in use"):
        engine.add([1, 2, 3], params(), parse_tree_budget(16))
    with pytest.raises(ValueError, match="max_rows"):
        BatchEngine(llm.target, llm.drafter, MAX_LEN, max_rows=0)


@pytest.mark.parametrize("overlap", [True, False])
def test_rounds_launched_ahead_give_the_same_tokens(llm, overlap):
    """With overlap each `step` queues the next round before reading this one: rows that finish
    (by length or a stop string) or are cancelled in a round have one more round launched, whose
    result is dropped, and rows joining take the round after. Every row equals its solo run either way."""
    from ddtree.batching import BatchedRequests

    batch = BatchedRequests(llm, max_rows=3, max_nodes=17, overlap=overlap)
    cases = [("def fib(n):", params(max_tokens=30)), ("import os\n", params(max_tokens=5)),
             ("class Stack:", params(0.8, seed=7, max_tokens=22)), ("def quicksort(xs):", params(max_tokens=18)),
             ("for i in range(", SamplingParams(max_tokens=40, stop=["\n"], temperature=0.6, seed=3)),
             ("x = [1, 2", params(max_tokens=26))]
    budget = parse_tree_budget(16)
    waiting, got, handles, launched_ahead = list(range(len(cases))), {}, {}, 0
    cancel_after = 3  # the fourth request's client leaves after a few of its rounds
    while waiting or batch.running:
        while waiting and batch.fits(len(llm.encode(cases[waiting[0]][0])), cases[waiting[0]][1], budget):
            i = waiting.pop(0)
            request, event = batch.add(llm.encode(cases[i][0]), cases[i][1], budget)
            handles[id(request)], got[i] = i, list(event.token_ids)
        for request, event in batch.step():
            i = handles[id(request)]
            got[i] += event.token_ids
            if event.result is not None:
                assert event.result.token_ids == got[i]
        launched_ahead += batch._in_flight is not None
        for request in list(batch.running):
            if handles[id(request)] == 3 and len(got[3]) > cancel_after:
                batch.cancel(request)
                got[3] = None
    assert (launched_ahead > 0) == overlap and batch.engine.regions.used_slots == 0
    for i, (prompt, sampling) in enumerate(cases):
        if got[i] is not None:
            assert got[i] == llm.generate(prompt, sampling, tree_budget=16).token_ids, prompt


def test_requests_begun_together_start_with_one_read(llm, solo_tokens):
    """`begin` queues each prefill without reading its first token; `started` reads them all at
    once (first events in order); a request cancelled before that never starts; a step waits for
    `started`. Every row still equals its solo run."""
    from ddtree.batching import BatchedRequests

    batch = BatchedRequests(llm, max_rows=8, max_nodes=65)
    begun = [batch.begin(llm.encode(p), s, parse_tree_budget(b)) for p, s, b in CASES]
    with pytest.raises(RuntimeError, match="started"):
        batch.step()
    batch.cancel(begun[1])
    reads = []
    first_steps = batch.engine.first_steps
    batch.engine.first_steps = lambda tokens: (reads.append(len(tokens)), first_steps(tokens))[1]
    started = batch.started()
    assert reads == [len(CASES) - 1] and [r for r, _ in started] == [begun[i] for i in (0, 2, 3, 4)]
    tokens = {id(r): list(e.token_ids) for r, e in started}
    while batch.running:
        for request, event in batch.step():
            tokens[id(request)] += event.token_ids
    for i in (0, 2, 3, 4):
        assert tokens[id(begun[i])] == solo_tokens[i], CASES[i]
    assert batch.engine.regions.used_slots == 0 and batch.free == 8
