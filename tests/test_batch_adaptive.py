"""Budgets chosen per round in a batch (ddtree.batching with a batch_budget) on the demo pair in
float32 on the CPU: a row whose budget changes every round still gives exactly its solo greedy
tokens, a row that decoded with `ar` drafts afterwards from its full drafter context, and the round
costs are timed on the engine itself. No timed assertions."""
from __future__ import annotations

import pytest

from ddtree import batch_engine
from ddtree.batch_budget import BatchBudget
from ddtree.budget_selector import CANDIDATES
from ddtree.batch_engine import BatchEngine
from ddtree.batching import BatchedRequests
from ddtree.config import SamplingParams
from ddtree.llm import LLM
from ddtree.round_costs import RoundCost, RoundCostTable, measure_round_costs
from ddtree.tree_shape import AR, CHAIN, TreeShape

MAX_LEN = 96
B3, B16, B64 = TreeShape.best(3), TreeShape.best(16), TreeShape.best(64)


@pytest.fixture(scope="module")
def llm(demo_pair):
    return LLM(*demo_pair, device="cpu", max_model_len=MAX_LEN)


def params(temperature=0.0, seed=None, max_tokens=24) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, ignore_eos=True)


class Scripted:
    """A batch_budget whose choice is a script: script(round, row index) -> the adaptive row's budget."""

    candidates = (AR, B3, B16, B64, CHAIN)

    def __init__(self, script):
        self.script, self.round = script, 0

    def choose(self, rows):
        chosen = [row.budget or self.script(self.round, i) for i, row in enumerate(rows)]
        self.round += 1
        return chosen

    def observe(self, *args):
        pass


@pytest.fixture
def scripted(llm):
    def use(script):
        llm.batch_budget = Scripted(script)
        return llm.batch_budget

    yield use
    llm.batch_budget = None


def run(batch, requests) -> dict[int, object]:
    """Add (prompt ids, params, budget, adaptive) requests, step until all finish -> results by index."""
    index, results = {}, {}
    for i, (ids, sampling, budget, adaptive) in enumerate(requests):
        request, event = batch.add(ids, sampling, budget, adaptive)
        index[id(request)] = i
    while batch.running:
        for request, event in batch.step():
            if event.result is not None:
                results[index[id(request)]] = event.result
    return results


def test_rows_whose_budget_changes_every_round_give_their_solo_greedy_tokens(llm, scripted):
    cycle = [AR, AR, B16, CHAIN, B64, B3, AR]
    scripted(lambda k, i: cycle[(k + i) % len(cycle)])
    prompts = ["def fib(n):", "import os\n", "class Stack:"]
    sampled = ("for i in range(", params(0.8, seed=5), B16)  # a fixed, sampled neighbour
    requests = [(llm.encode(p), params(), B64, True) for p in prompts]
    requests += [(llm.encode("x = [1, 2"), params(), CHAIN, False), (llm.encode(sampled[0]), *sampled[1:], False)]
    results = run(llm.batched(), requests)
    for i, prompt in enumerate(prompts):
        assert results[i].token_ids == llm.generate(prompt, params(), tree_budget="ar").token_ids, prompt
        stats = results[i].stats
        assert stats.tree_budget == "adaptive" and len(stats.budget_rounds) > 3
        assert sum(stats.budget_rounds.values()) == stats.decode_rounds
    assert results[3].token_ids == llm.generate("x = [1, 2", params(), tree_budget="chain").token_ids
    assert results[3].stats.budget_rounds == {"chain": results[3].stats.decode_rounds}
    assert results[4].token_ids == llm.generate(sampled[0], sampled[1], tree_budget=16).token_ids


@pytest.mark.parametrize("feed_every,neighbour", [(64, None), (64, CHAIN), (3, CHAIN)],
                         ids=["fed_every_round", "fed_at_the_switch", "fed_on_the_way_too"])
def test_a_row_drafting_after_ar_rounds_drafts_from_its_whole_context(llm, scripted, monkeypatch, feed_every,
                                                                      neighbour):
    """After k rounds of `ar` a row drafts as a request whose prompt holds those k tokens does:
    the `ar` rounds' features reached the drafter's context (alone, in fixed-shape rounds, every
    round; beside a row of another shape, in per-row rounds, all at the switch, or some once
    FEED_EVERY had gathered and the rest at the switch)."""
    monkeypatch.setattr(batch_engine, "FEED_EVERY", feed_every)
    k = 5
    scripted(lambda r, i: AR if r < k else B16)
    prompt = llm.encode("def quicksort(xs):")
    fresh = BatchedRequests(llm, max_rows=2, max_nodes=17)  # no stale drafter entries from earlier runs
    requests = [(prompt, params(max_tokens=40), B16, True)]
    if neighbour is not None:
        requests.append((llm.encode("x = [1, 2"), params(max_tokens=40), neighbour, False))
    result = run(fresh, requests)[0]
    assert result.stats.acceptance_lengths[:k] == [1] * k
    later = llm.generate(prompt + result.token_ids[:k], params(max_tokens=40 - k), tree_budget=16)
    assert result.token_ids[k:] == later.token_ids
    rounds = len(result.stats.acceptance_lengths) - k
    assert result.stats.acceptance_lengths[k:] == later.stats.acceptance_lengths[:rounds]
    assert max(later.stats.acceptance_lengths) > 1  # the drafter's guesses are worth checking


def test_only_a_sequence_that_feeds_the_drafter_can_switch_to_a_tree(llm):
    engine = BatchEngine(llm.target, llm.drafter, MAX_LEN, max_rows=2, max_nodes=17)
    plain, _ = engine.add([5, 6, 7], params(), AR)
    with pytest.raises(ValueError, match="without the drafter's context"):
        engine.set_budget(plain, B16)
    fed, _ = engine.add([5, 6, 7], params(), AR, feeds_drafter=True)
    engine.set_budget(fed, B16)
    with pytest.raises(ValueError, match="at most 17"):
        engine.set_budget(fed, B64)
    assert [step.budget for _, step in engine.step()] == [AR, B16]


def synthetic_costs() -> RoundCostTable:
    """Verify tokens dear (a CPU's picture): `ar` for a full batch, a tree alone."""
    return RoundCostTable([RoundCost(64, r, b.label, b.nodes(16), 0.002 + 0.0002 * r * b.nodes(16))
                           for r in (1, 8) for b in CANDIDATES])


def test_generate_chooses_the_budgets_of_prompts_that_name_none(llm):
    llm.adapt_batch_budget(costs=synthetic_costs())
    try:
        prompts = ["def fib(n):", "import os\n", "class Stack:"]
        results = llm.generate(prompts, params())
        named = llm.generate(prompts, params(), tree_budget=16)
    finally:
        llm.batch_budget = None
    for result, fixed in zip(results, named):
        assert result.token_ids == fixed.token_ids
        assert result.stats.tree_budget == "adaptive" and set(result.stats.budget_rounds) <= {"ar", "15", "63"}
        assert fixed.stats.tree_budget == "16" and fixed.stats.budget_rounds == {"16": fixed.stats.decode_rounds}


def test_round_costs_are_timed_on_the_engine(llm):
    engine = BatchEngine(llm.target, llm.drafter, MAX_LEN, max_rows=2, max_nodes=17)
    table = measure_round_costs(engine, [AR, B16], contexts=[8, 1000], rounds=1)
    # 1000 does not fit: it is cut to the longest context that leaves room for two rounds.
    assert [(p.context, p.rows, p.budget, p.tokens_per_row) for p in table.points] == [
        (c, r, b, n) for c in (8, MAX_LEN - 33) for r in (1, 2) for b, n in (("ar", 1), ("16", 17))]
    assert all(p.seconds > 0 for p in table.points) and not engine.sequences and engine.free_rows == 2
    engine.add([5, 6, 7], params(), AR)
    with pytest.raises(RuntimeError, match="no sequences"):
        measure_round_costs(engine, [AR])
    short = BatchEngine(llm.target, llm.drafter, 32, max_rows=1, max_nodes=17)
    with pytest.raises(ValueError, match="no room"):
        measure_round_costs(short, [AR])


def test_long_context_rows_are_prefilled_once_for_every_budget(llm, monkeypatch):
    """From `shared_from` tokens of context on, a point's rows serve every budget in turn: one
    prefill a row, the same points timed; below it (and where the cache cannot hold rows with room
    for every budget's rounds) each budget's rows are prefilled afresh."""
    engine = BatchEngine(llm.target, llm.drafter, MAX_LEN, max_rows=2, max_nodes=17)
    added = []
    add = engine.add
    monkeypatch.setattr(engine, "add", lambda prompt, *a, **k: added.append(len(prompt)) or add(prompt, *a, **k))
    table = measure_round_costs(engine, [AR, B3, B16], contexts=[8, 40], rounds=1, shared_from=32)
    assert [(p.context, p.rows, p.budget) for p in table.points] == [
        (c, r, b) for c in (8, 40) for r in (1, 2) for b in ("ar", "3", "16")]
    assert all(p.seconds > 0 for p in table.points) and not engine.sequences and engine.free_rows == 2
    # context 8: each budget its own rows, 1 + 2 rows x 3 budgets; context 40: 1 + 2 rows once.
    assert added == [8] * 9 + [40] * 3
    # A cache that cannot hold rows with room for all three budgets' rounds: afresh, the same points.
    slots, room = engine.region_slots, 3 * engine.block_size  # one budget's room at rounds=1
    monkeypatch.setattr(engine, "region_slots", lambda n, new=None, nodes=None: 10**9 if new and new > room
                        else slots(n, new, nodes))
    added.clear()
    table = measure_round_costs(engine, [AR, B3, B16], contexts=[40], rounds=1, shared_from=32, rows=[1])
    assert [p.budget for p in table.points] == ["ar", "3", "16"] and added == [40] * 3


def test_an_adaptive_request_needs_a_batch_budget(llm):
    with pytest.raises(ValueError, match="batch_budget"):
        llm.batched().add(llm.encode("x"), params(), AR, True)
    assert isinstance(llm.adapt_batch_budget(costs=synthetic_costs()), BatchBudget)
    llm.batch_budget = None


def test_serve_with_batching_and_no_budget_chooses_per_round_and_shows_it(demo_pair):
    from concurrent.futures import ThreadPoolExecutor

    from server_process import LiveServer, metric, metric_values

    def completion(http, prompt, **extra):
        body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                **extra}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()

    prompts = ["def fib(n):", "import os\n", "class Stack:", "for i in range("]
    with LiveServer(*demo_pair, max_model_len=96) as live, live.client() as http:  # no --tree-budget
        health = http.get("/health").json()
        assert health["tree_budget_mode"] == "adaptive" and health["max_num_seqs"] > 1
        with ThreadPoolExecutor(len(prompts)) as pool:
            chosen = list(pool.map(lambda p: completion(http, p), prompts))
        named = [completion(http, p, tree_budget="ar") for p in prompts]
        values = metric_values(http.get("/metrics").text)
    for reply, fixed in zip(chosen, named):
        assert reply["choices"][0]["token_ids"] == fixed["choices"][0]["token_ids"]  # lossless, float32
        stats = reply["ddtree"]
        assert stats["tree_budget"] == "adaptive" and sum(stats["budget_rounds"].values()) == stats["decode_rounds"]
    # Every row of every batched round is counted at its budget, by batch size.
    replies = chosen + named
    rounds = {}
    for reply in replies:
        for budget, count in reply["ddtree"]["budget_rounds"].items():
            rounds[budget] = rounds.get(budget, 0) + count
    for budget, count in rounds.items():
        assert metric(values, "ddtree:batch_rounds_total", tree_budget=budget) == count
    assert metric(values, "ddtree:batch_rounds_total") == sum(r["ddtree"]["decode_rounds"] for r in replies)
    drafted = sum(count for budget, count in rounds.items() if budget != "ar")
    assert metric(values, "vllm:spec_decode_num_drafts_total") == drafted
    assert {dict(labels)["tree_budget"] for (name, labels), _ in values.items()
            if name == "ddtree:batch_budget_acceptance"} == {"15", "63"}
