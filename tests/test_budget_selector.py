"""The server's default tree budget, chosen per temperature bucket from the decode speed measured
while serving (ddtree.budget_selector), and `ddtree serve` without --tree-budget, one request at a
time, using it (with batching the batch chooses: tests/test_batch_adaptive.py)."""
from __future__ import annotations

import threading

import pytest

from ddtree.budget_selector import OnlineBudgetSelector, context_bucket
from ddtree.config import parse_tree_budget
from server_process import LiveServer, metric_values


def selector_of(*budgets, **settings) -> OnlineBudgetSelector:
    """A selector of budgets written as in JSON ("ar" or integers)."""
    return OnlineBudgetSelector(tuple(map(parse_tree_budget, budgets)), **settings)


def choose(selector: OnlineBudgetSelector, bucket: str, **context):
    """The selector's next choice, as written in JSON."""
    return selector.choose(bucket, **context).json_value


def observe(selector: OnlineBudgetSelector, bucket: str, budget, tokens: int, seconds: float) -> None:
    selector.observe(bucket, parse_tree_budget(budget), tokens, seconds)


def test_each_candidate_is_tried_in_turn_then_the_fastest_is_chosen():
    selector = selector_of("ar", 16, 64, min_samples=2, revisit_every=100)
    first = [choose(selector, "t>0.8") for _ in range(6)]
    assert first == ["ar", 16, 64, "ar", 16, 64]
    speed = {"ar": 100.0, 16: 80.0, 64: 50.0}
    for budget in first:
        observe(selector, "t>0.8", budget, tokens=32, seconds=32 / speed[budget])
    assert [choose(selector, "t>0.8") for _ in range(5)] == ["ar"] * 5
    assert selector.picks()[("t>0.8", "ctx<=2k")] == "ar"
    assert selector.estimates()[("t>0.8", "ctx<=2k")] == pytest.approx({str(b): v for b, v in speed.items()})
    # Buckets are measured apart: greedy traffic, or a long prompt, starts its own trials.
    assert choose(selector, "greedy") == "ar" and choose(selector, "greedy") == 16
    assert choose(selector, "t>0.8", context_tokens=20_000) == "ar"
    assert choose(selector, "t>0.8", context_tokens=20_000) == 16
    assert choose(selector, "t>0.8", context_tokens=2_000) == "ar"  # still the short bucket's pick


def test_context_buckets():
    assert [context_bucket(n) for n in (0, 2048, 2049, 8192, 32768, 32769, 10**6)] == \
        ["ctx<=2k", "ctx<=2k", "ctx<=8k", "ctx<=8k", "ctx<=32k", "ctx>32k", "ctx>32k"]


def test_a_budget_that_becomes_faster_takes_over_and_revisits_notice_it():
    selector = selector_of("ar", 64, min_samples=1, revisit_every=1, window=2)
    for budget, rate in (("ar", 100.0), (64, 50.0)):
        assert choose(selector, "greedy") == budget
        observe(selector, "greedy", budget, 40, 40 / rate)
    chosen = []
    for _ in range(8):
        budget = choose(selector, "greedy")
        chosen.append(budget)
        rate = 300.0 if budget == 64 else 100.0  # 64 got faster (say, a sharper workload)
        observe(selector, "greedy", budget, 40, 40 / rate)
    # 64, measured 2x slower, is revisited after 1 x 2^2 requests; then 1.17x slower, after 1.36
    # more; once its window holds only fast runs it wins, and ar (now 3x slower) waits 9 requests.
    assert chosen == ["ar", "ar", "ar", 64, "ar", 64, 64, 64]


def test_revisits_of_a_slow_budget_cost_little():
    selector = selector_of("ar", 16, 64, min_samples=2)  # revisit_every 16
    speed = {"ar": 100.0, 16: 50.0, 64: 25.0}  # 16 is 2x and 64 4x slower than ar, and stay so
    seconds = 0.0
    for _ in range(1000):
        budget = choose(selector, "t>0.8")
        seconds += 64 / speed[budget]
        observe(selector, "t>0.8", budget, 64, 64 / speed[budget])
    # Against ar alone (1000 x 0.64 s): the six trials, then a revisit of 16 every 64 requests and
    # of 64 every 256 cost 1 and 3 requests' time: 1 / 64 + 3 / 256 of the time, about 2.7%.
    assert seconds / (1000 * 0.64) < 1.04


def test_short_aborted_and_unknown_requests_do_not_count():
    selector = selector_of("ar", 16, min_samples=1, min_tokens=8)
    assert [choose(selector, "greedy") for _ in range(2)] == ["ar", 16]
    observe(selector, "greedy", "ar", tokens=3, seconds=0.01)  # too short to say anything
    observe(selector, "greedy", 256, tokens=100, seconds=1.0)  # not a candidate
    observe(selector, "greedy", 16, tokens=40, seconds=0.0)
    assert selector.estimates()[("greedy", "ctx<=2k")] == {}
    # ar and 16 are retried a bounded number of times, then the first candidate is the fallback.
    assert [choose(selector, "greedy") for _ in range(2)] == ["ar", 16]
    assert [choose(selector, "greedy") for _ in range(3)] == ["ar", "ar", "ar"]


def test_choices_and_observations_from_many_threads():
    selector = selector_of("ar", 16, 64, min_samples=2)
    errors = []

    def client(seed: int):
        try:
            for i in range(200):
                budget = choose(selector, "t<=0.8")
                observe(selector, "t<=0.8", budget, 10 + (seed + i) % 7, 0.1)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert set(selector.estimates()[("t<=0.8", "ctx<=2k")]) == {"ar", "16", "64"}


def test_constructor_refuses_no_candidates():
    with pytest.raises(ValueError):
        OnlineBudgetSelector(())


@pytest.fixture(scope="module")
def default_server(demo_pair):
    with LiveServer(*demo_pair, "--max-num-seqs", "1", max_model_len=96) as live:  # no --tree-budget
        yield live


def completion(http, **extra) -> dict:
    body = {"prompt": "def fib(n):", "max_tokens": 12, "ignore_eos": True, "return_token_ids": True, **extra}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_serve_without_a_budget_measures_the_candidates_per_temperature(default_server):
    with default_server.client() as http:
        health = http.get("/health").json()
        assert health["tree_budget_mode"] == "adaptive"
        sampled = [completion(http, temperature=1.0, seed=i)["ddtree"]["tree_budget"] for i in range(6)]
        assert sampled == ["ar", "15", "63", "ar", "15", "63"]
        greedy = [completion(http, temperature=0) for _ in range(4)]
        fixed = completion(http, temperature=0, tree_budget="ar")
        values = metric_values(http.get("/metrics").text)
    assert [g["ddtree"]["tree_budget"] for g in greedy] == ["ar", "15", "63", "ar"]
    # Whatever the selector picks, the tokens are the target's own (float32, lossless).
    assert all(g["choices"][0]["token_ids"] == fixed["choices"][0]["token_ids"] for g in greedy)
    rates = {dict(labels)["tree_budget"]: v for (name, labels), v in values.items()
             if name == "ddtree:budget_tokens_per_second" and dict(labels)["temperature_bucket"] == "t>0.8"
             and dict(labels)["context_bucket"] == "ctx<=2k"}
    assert set(rates) == {"ar", "15", "63"} and all(v > 0 for v in rates.values())


def test_serve_with_a_fixed_budget_does_not_adapt(demo_pair):
    with LiveServer(*demo_pair, "--tree-budget", "16", max_model_len=96) as live, live.client() as http:
        assert http.get("/health").json()["tree_budget_mode"] == "fixed"
        assert {completion(http, temperature=1.0, seed=i)["ddtree"]["tree_budget"] for i in range(4)} == {"16"}
