"""`ddtree bench --base-url` against a live `ddtree serve` on CPU."""
from __future__ import annotations

import json

import httpx
import pytest
from server_process import API_KEY, LiveServer

from ddtree.bench.runner import LiveBackend, parse_counters
from ddtree.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def server(demo_pair):
    """`ddtree serve` on a free loopback port (with an API key), ready once /health answers 200."""
    with LiveServer(*demo_pair, max_model_len=1024) as live:
        yield live


def test_live_sweep_of_four_budgets_over_eight_prompts(server, tmp_path, capsys):
    out, plot = tmp_path / "live.json", tmp_path / "live.png"
    code = main(["bench", "--base-url", server.url, "--api-key", API_KEY, "--tree-budgets", "ar,chain,4,16",
                 "--num-prompts", "8", "--max-tokens", "16", "--output", str(out), "--plot", str(plot), "--no-progress"])
    assert code == 0
    assert "recommended tree budget at concurrency 1:" in capsys.readouterr().out
    assert plot.read_bytes().startswith(PNG_MAGIC)
    result = json.loads(out.read_text())
    assert result["backend"]["mode"] == "live" and result["backend"]["base_url"] == server.url
    assert result["backend"]["model"] == server.model and API_KEY not in out.read_text()
    assert result["backend"]["health"]["status"] == "ok"
    rows = result["results"]
    assert [r["tree_budget"] for r in rows] == ["ar", "chain", 4, 16]
    for row in rows:
        assert row["completed"] == 8 and row["failed"] == 0
        assert row["parity_vs_ar"] == 1.0 and row["parity_ok"] is True
        assert row["acceptance_source"] == "responses" and row["mean_acceptance_length"] >= 1.0
        assert row["total_output_tokens"] > 0 and row["median_ttft_ms"] > 0 and row["median_e2el_ms"] > 0
    assert result["parity_ok"] is True
    assert result["recommendation"]["tree_budget"] in ("ar", "chain", 4, 16)


def test_the_servers_own_choice_is_a_budget_and_its_rounds_are_reported(server, tmp_path, capsys):
    out = tmp_path / "server.json"
    code = main(["bench", "--base-url", server.url, "--api-key", API_KEY, "--tree-budgets", "ar,server",
                 "--concurrency", "1,4", "--num-prompts", "4", "--max-tokens", "12", "--output", str(out),
                 "--no-progress"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "server at concurrency 1: rounds at" in printed and "server at concurrency 4: rounds at" in printed
    rows = json.loads(out.read_text())["results"]
    assert [(r["tree_budget"], r["concurrency"]) for r in rows] == [("ar", 1), ("server", 1), ("ar", 4), ("server", 4)]
    for row in rows:
        assert row["completed"] == 4 and row["parity_ok"] is True
        assert sum(row["budget_rounds"].values()) == row["decode_rounds"] * 4
    assert rows[0]["budget_rounds"] == {"ar": rows[0]["decode_rounds"] * 4}
    assert set(rows[1]["budget_rounds"]) <= {"ar", "15", "63"}  # the batch's per-round choice


def test_acceptance_from_metrics_equals_the_responses(server, monkeypatch):
    """For servers without our `ddtree` statistics: /metrics counter deltas give the same acceptance."""
    import asyncio

    from ddtree.bench.datasets import load_prompts
    from ddtree.bench.runner import SweepSettings
    from ddtree.bench.sweep import run_sweep
    from ddtree.tree_shape import AR, TreeShape

    prompts = load_prompts("stdlib", 3)
    settings = SweepSettings(tree_budgets=[AR, TreeShape.best(16)], max_tokens=12, warmup=0)

    async def sweep():
        backend = LiveBackend(server.url, api_key=API_KEY)
        await backend.open()
        try:
            return await run_sweep(backend, prompts, settings, progress=False)
        finally:
            await backend.aclose()

    from_responses = asyncio.run(sweep()).rows
    monkeypatch.setattr(LiveBackend, "_take_stats", staticmethod(lambda out, stats: None))
    from_metrics = asyncio.run(sweep()).rows
    assert from_metrics[1]["acceptance_source"] == "metrics"
    assert from_metrics[1]["mean_acceptance_length"] == pytest.approx(from_responses[1]["mean_acceptance_length"])
    assert from_metrics[1]["decode_rounds"] == pytest.approx(from_responses[1]["decode_rounds"])
    assert from_metrics[0]["acceptance_source"] == "definition"  # ar drafts nothing
    for row in from_responses + from_metrics:  # the server's own view lies inside the client's
        assert 0 < row["server_mean_ttft_ms"] <= row["mean_ttft_ms"]
        assert row["server_mean_ttft_ms"] < row["server_mean_e2el_ms"] <= row["mean_e2el_ms"]
    counters = parse_counters(httpx.get(f"{server.url}/metrics", headers=server.headers).text)
    assert counters is not None and counters.drafts > 0


def test_rejected_requests_are_reported_not_hidden(server, tmp_path, capsys):
    out = tmp_path / "fail.json"
    code = main(["bench", "--base-url", server.url, "--api-key", API_KEY, "--tree-budgets", "ar", "--num-prompts", "2",
                 "--max-tokens", "5000", "--output", str(out), "--no-progress"])
    assert code == 1  # nothing completed
    row = json.loads(out.read_text())["results"][0]
    assert row["completed"] == 0 and row["failed"] == 2 and "HTTP 400" in row["errors"][0]
    assert "2 of 2 requests failed" in capsys.readouterr().out


def test_parse_counters_sums_label_sets():
    text = ('# TYPE vllm:spec_decode_num_drafts counter\n'
            'vllm:spec_decode_num_drafts_total{model_name="a"} 3.0\n'
            'vllm:spec_decode_num_drafts_total{model_name="b"} 2.0\n'
            '# TYPE vllm:spec_decode_num_accepted_tokens counter\n'
            'vllm:spec_decode_num_accepted_tokens_total{model_name="a"} 7.0\n')
    counters = parse_counters(text)
    assert (counters.drafts, counters.accepted_tokens) == (5.0, 7.0)
    assert counters.server_latency_ms() == {"server_mean_ttft_ms": None, "server_mean_e2el_ms": None}
    assert parse_counters("# nothing here\nother_metric 1.0\n") is None


def test_parse_counters_reads_the_latency_histograms():
    text = ('# TYPE vllm:time_to_first_token_seconds histogram\n'
            'vllm:time_to_first_token_seconds_bucket{le="0.01",model_name="a"} 2.0\n'
            'vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="a"} 3.0\n'
            'vllm:time_to_first_token_seconds_sum{model_name="a"} 0.03\n'
            'vllm:time_to_first_token_seconds_count{model_name="a"} 3.0\n'
            '# TYPE vllm:e2e_request_latency_seconds histogram\n'
            'vllm:e2e_request_latency_seconds_sum{model_name="a"} 0.6\n'
            'vllm:e2e_request_latency_seconds_count{model_name="a"} 3.0\n')
    before = parse_counters(text)
    after = parse_counters(text.replace("_sum{model_name=\"a\"} 0.03", "_sum{model_name=\"a\"} 0.07")
                           .replace("_count{model_name=\"a\"} 3.0", "_count{model_name=\"a\"} 5.0")
                           .replace("seconds_sum{model_name=\"a\"} 0.6", "seconds_sum{model_name=\"a\"} 1.0"))
    assert (before.drafts, before.ttft_count, before.e2el_count) == (0.0, 3.0, 3.0)
    latency = (after - before).server_latency_ms()
    assert latency["server_mean_ttft_ms"] == pytest.approx(20.0)  # 0.04 s over 2 requests
    assert latency["server_mean_e2el_ms"] == pytest.approx(200.0)
