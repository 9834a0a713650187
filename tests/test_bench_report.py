"""The benchmark's arithmetic on synthetic measurements: statistics, rows, comparisons, recommendation."""
from __future__ import annotations

import math

import numpy as np
import pytest

from ddtree.bench.report import (
    ServerCounters,
    RequestOutput,
    compare_with_ar,
    finish,
    latency_stats,
    parity,
    percentile,
    recommend,
    recommendation_line,
    std,
    summarize,
)
from ddtree.config import parse_tree_budget
from ddtree.tree_shape import AR, CHAIN, TreeShape


@pytest.mark.parametrize("n", [1, 2, 3, 10, 101])
@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 100])
def test_percentile_matches_numpy(n, q):
    values = np.random.default_rng(n * 1000 + q).lognormal(size=n).tolist()
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12)


def test_percentile_ignores_input_order_and_rejects_bad_input():
    assert percentile([5.0, 1.0, 3.0], 50) == 3.0
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_latency_stats_are_vllm_named_milliseconds():
    seconds = [0.010, 0.020, 0.030, 0.100]
    stats = latency_stats("ttft", seconds)
    ms = np.array(seconds) * 1000
    assert stats["mean_ttft_ms"] == pytest.approx(ms.mean())
    assert stats["median_ttft_ms"] == pytest.approx(np.median(ms))
    assert stats["std_ttft_ms"] == pytest.approx(ms.std())
    assert stats["p99_ttft_ms"] == pytest.approx(np.percentile(ms, 99))
    assert latency_stats("itl", []) == {"mean_itl_ms": 0.0, "median_itl_ms": 0.0, "std_itl_ms": 0.0, "p99_itl_ms": 0.0}
    assert std([2.0, 4.0]) == 1.0


def _req(index, out_tokens, ttft, itl, e2el, rounds=None, accepted=None, text="x", prompt_tokens=10):
    return RequestOutput(index, success=True, text=text, prompt_tokens=prompt_tokens, output_tokens=out_tokens,
                         ttft_s=ttft, itl_s=list(itl), e2el_s=e2el, decode_rounds=rounds, accepted_tokens=accepted)


def test_summarize_row():
    outputs = [
        _req(0, 11, 0.1, [0.2, 0.3], 0.6, rounds=2, accepted=10),
        _req(1, 21, 0.2, [0.4], 1.2, rounds=4, accepted=20),
        _req(2, 1, 0.05, [], 0.05, rounds=0, accepted=0),
        RequestOutput(3, error="HTTP 400: too long"),
    ]
    row = summarize(outputs, duration_s=2.0, tree_budget=TreeShape.best(64), concurrency=2)
    assert (row["tree_budget"].json_value, row["concurrency"], row["completed"], row["failed"]) == (64, 2, 3, 1)
    assert row["errors"] == ["HTTP 400: too long"]
    assert row["total_output_tokens"] == 33 and row["total_input_tokens"] == 30
    assert row["request_throughput"] == pytest.approx(1.5)
    assert row["output_throughput"] == pytest.approx(16.5)
    assert row["total_token_throughput"] == pytest.approx(31.5)
    tps = [11 / 0.6, 21 / 1.2, 1 / 0.05]
    assert row["median_tokens_per_second"] == pytest.approx(np.median(tps))
    assert row["mean_tokens_per_second"] == pytest.approx(np.mean(tps))
    tpot_ms = [(0.6 - 0.1) / 10 * 1000, (1.2 - 0.2) / 20 * 1000]  # one-token requests have no TPOT
    assert row["mean_tpot_ms"] == pytest.approx(np.mean(tpot_ms))
    assert row["p99_itl_ms"] == pytest.approx(np.percentile([200, 300, 400], 99))  # gaps of all requests pooled
    assert row["median_e2el_ms"] == pytest.approx(600)
    assert row["mean_ttft_ms"] == pytest.approx(np.mean([100, 200, 50]))
    assert row["mean_acceptance_length"] == pytest.approx(30 / 6)
    assert row["decode_rounds"] == pytest.approx(2.0)
    assert row["acceptance_source"] == "responses"


def test_acceptance_from_metrics_then_definition():
    outputs = [_req(0, 9, 0.1, [], 1.0), _req(1, 5, 0.1, [], 1.0)]
    row = summarize(outputs, 2.0, TreeShape.best(128), 1, ServerCounters(drafts=4, accepted_tokens=10))
    assert row["mean_acceptance_length"] == pytest.approx(1 + 10 / 4)
    assert row["decode_rounds"] == pytest.approx(2.0)
    assert row["acceptance_source"] == "metrics"
    ar = summarize(outputs, 2.0, AR, 1, ServerCounters(drafts=0, accepted_tokens=0))
    assert (ar["mean_acceptance_length"], ar["decode_rounds"], ar["acceptance_source"]) == (1.0, 6.0, "definition")
    unknown = summarize(outputs, 2.0, CHAIN, 1, None)
    assert unknown["mean_acceptance_length"] is None and unknown["acceptance_source"] is None


def _row(budget, concurrency, median_tps, throughput=None, completed=4):
    return {"tree_budget": parse_tree_budget(budget), "concurrency": concurrency, "completed": completed, "failed": 0, "errors": [],
            "median_tokens_per_second": median_tps, "output_throughput": throughput or median_tps}


def test_speedups_and_parity_against_ar_at_the_same_concurrency():
    rows = [_row("ar", 1, 10.0, 20.0), _row("chain", 1, 25.0, 40.0), _row(64, 1, 30.0, 50.0),
            _row("ar", 4, 5.0), _row(64, 4, 20.0)]
    same = {0: "a", 1: "b", 2: "c", 3: "d"}
    texts = [same, same, {0: "a", 1: "B", 2: "c", 3: "d"}, same, {0: "a", 1: "b", 2: "c"}]
    compare_with_ar(rows, texts, greedy=True, prompt_names=["p0", "p1", "p2", "p3"])
    assert [r["speedup_vs_ar"] for r in rows] == pytest.approx([1.0, 2.5, 3.0, 1.0, 4.0])
    assert rows[2]["throughput_speedup_vs_ar"] == pytest.approx(2.5)
    assert [r["parity_vs_ar"] for r in rows] == [1.0, 1.0, 0.75, 1.0, 1.0]  # a failed request is left out
    assert [r["parity_ok"] for r in rows] == [True, True, False, True, True]
    assert rows[2]["parity_mismatches"] == ["p1"] and rows[1]["parity_mismatches"] == []


def test_parity_is_not_measured_when_sampling_or_without_ar():
    rows = [_row("ar", 1, 10.0), _row(64, 1, 30.0)]
    compare_with_ar(rows, [{0: "a"}, {0: "b"}], greedy=False)
    assert rows[1]["parity_vs_ar"] is None and rows[1]["parity_ok"] is None
    assert rows[1]["speedup_vs_ar"] == pytest.approx(3.0)
    alone = [_row(64, 1, 30.0)]
    compare_with_ar(alone, [{0: "b"}], greedy=True)
    assert alone[0]["speedup_vs_ar"] is None and alone[0]["parity_vs_ar"] is None
    assert parity({}, {0: "a"}) is None


def test_recommendation_per_concurrency_with_margins():
    rows = [_row("ar", 1, 10.0), _row("chain", 1, 25.0), _row(64, 1, 30.0), _row(256, 1, 30.0),
            _row(1024, 1, 99.0, completed=0),  # nothing completed: not a candidate
            _row("ar", 8, 12.0), _row(64, 8, 11.0)]
    picks = recommend(rows)
    assert [p["concurrency"] for p in picks] == [1, 8]
    assert picks[0]["tree_budget"] == TreeShape.best(64)  # ties go to the budget run first
    assert picks[0]["margin_over_chain"] == pytest.approx(1.2)
    assert picks[0]["margin_over_ar"] == pytest.approx(3.0)
    assert picks[1]["tree_budget"] == AR and picks[1]["margin_over_chain"] is None
    assert picks[1]["margin_over_ar"] == pytest.approx(1.0)
    line = recommendation_line(picks[0])
    assert "concurrency 1: 64" in line and "1.20x chain (+20.0%)" in line and "3.00x ar (+200.0%)" in line
    assert "chain not run" in recommendation_line(picks[1])


def test_finish_flags_parity_failures_and_failed_requests_loudly():
    rows = [_row("ar", 1, 10.0), _row(64, 1, 30.0), _row(128, 1, 20.0)]
    rows[2]["failed"], rows[2]["errors"] = 1, ["HTTP 400: bad"]
    report = finish(rows, [{0: "a", 1: "b"}, {0: "a", 1: "x"}, {0: "a"}], greedy=True, prompt_names=["f", "g"])
    assert report["parity_ok"] is False
    assert report["recommendation"]["tree_budget"] == TreeShape.best(64)
    assert any("PARITY FAILURE" in w and "64" in w and "50.0%" in w and "g" in w for w in report["warnings"])
    assert any("1 of 5 requests failed" in w and "HTTP 400: bad" in w for w in report["warnings"])
    # In bf16 the same gap is stated as expected rounding, with the float32 check to tell a bug apart.
    for dtype in ("bfloat16", "float16"):
        rows = [_row("ar", 1, 10.0), _row(64, 1, 30.0)]
        reduced = finish(rows, [{0: "a", 1: "b"}, {0: "a", 1: "x"}], greedy=True, prompt_names=["f", "g"], dtype=dtype)
        assert reduced["parity_ok"] is False
        [warning] = reduced["warnings"]
        assert warning.startswith(f"parity in {dtype}: tree budget 64") and "50.0%" in warning
        assert "--dtype float32" in warning and "PARITY FAILURE" not in warning
    rows = [_row("ar", 1, 10.0), _row(64, 1, 30.0)]
    exact = finish(rows, [{0: "a", 1: "b"}, {0: "a", 1: "x"}], greedy=True, dtype="float32")
    assert exact["warnings"][0].startswith("PARITY FAILURE")
    clean = finish([_row("ar", 1, 10.0), _row(64, 1, 30.0)], [{0: "a"}, {0: "a"}], greedy=True)
    assert clean["parity_ok"] is True and clean["warnings"] == []
    sampled = finish([_row("ar", 1, 10.0)], [{0: "a"}], greedy=False)
    assert sampled["parity_ok"] is None
    assert not math.isnan(sampled["recommendation"]["median_tokens_per_second"])


def test_decode_rate_leaves_out_the_prefill():
    """The calibrations' rate: tokens after the first over the time from the first to the last, so
    that a long prompt's prefill (the same for every budget) does not hide the budgets' speeds."""
    after_long_prompt = RequestOutput(0, success=True, output_tokens=65, ttft_s=1.67, e2el_s=1.70)
    assert after_long_prompt.decode_tokens_per_second == pytest.approx(64 / 0.03)
    assert after_long_prompt.tokens_per_second == pytest.approx(65 / 1.70)
    assert RequestOutput(0, success=True, output_tokens=1, ttft_s=0.2, e2el_s=0.2).decode_tokens_per_second is None
