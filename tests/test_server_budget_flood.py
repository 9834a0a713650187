"""A live server flooded with 200 requests, each naming a different tree budget spread over 1..4096
(the server allowing all of them): it stays up, keeps at most the default budget and
--max-cached-budgets others allocated, its resident memory grows by less than RSS_GROWTH_LIMIT, and
its greedy outputs do not change. Without the working set every budget stayed allocated (up to
28.6 MB each on the CPU with the demo pair, about 2.4 GB for these 200).

`flood` is shared with tests/test_gpu_budget_flood.py, which runs the same flood against a server on a
GPU and bounds its GPU memory too."""
from __future__ import annotations

import pytest

from server_process import LiveServer, metric, metric_values

BUDGETS = sorted({round(1 + i * 4095 / 199) for i in range(200)})
CACHED = 4
MB = 1 << 20
# The working set holds the default budget (64) and 4 others: at most 4 x 28.6 MB of buffers at the
# largest budgets, plus what the allocator keeps of the freed ones.
RSS_GROWTH_LIMIT = 300 * MB


def flood_server(demo_pair, device: str = "cpu") -> LiveServer:
    return LiveServer(*demo_pair, "--max-tree-budget", "4096", "--max-cached-budgets", str(CACHED),
                      max_model_len=64, device=device)


@pytest.fixture(scope="module")
def server(demo_pair):
    with flood_server(demo_pair) as live:
        yield live


def greedy(http, budget) -> list[int]:
    body = {"prompt": "def fib(n):", "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            "tree_budget": budget}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def gpu_memory(http) -> dict[str, float]:
    values = metric_values(http.get("/metrics").text)
    return {kind: metric(values, "ddtree:gpu_memory_bytes", kind=kind) for kind in ("allocated", "reserved")}


def flood(server: LiveServer) -> dict:
    """Settle at the working set's worst case, send the 200 budgets, and check that the server is up
    with its outputs unchanged. Returns the memory figures (RSS, and the GPU gauges on a GPU) before,
    at the peak and after."""
    assert len(BUDGETS) == 200 and BUDGETS[0] == 1 and BUDGETS[-1] == 4096
    with server.client(timeout=600) as http:
        before = [greedy(http, budget) for budget in ("ar", 64, 3)]
        # Settle the allocator at the working set's worst case (the largest budgets) before measuring.
        for budget in BUDGETS[-CACHED - 1:]:
            assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "tree_budget": budget}).status_code == 200
        rss_before, gpu_before = server.rss_bytes(), gpu_memory(http)
        rss_peak, gpu_peak = rss_before, dict(gpu_before)
        for budget in BUDGETS:
            # One token: the prefill only, so each budget costs its buffers and not 20 s of 4096-node rounds.
            response = http.post("/v1/completions", json={"prompt": "def f(x):", "max_tokens": 1, "tree_budget": budget})
            assert response.status_code == 200, (budget, response.text)
            rss_peak = max(rss_peak, server.rss_bytes())
            gpu_peak = {kind: max(value, gpu_peak[kind]) for kind, value in gpu_memory(http).items()}
        rss_after, gpu_after = server.rss_bytes(), gpu_memory(http)
        allocated = metric(metric_values(http.get("/metrics").text), "ddtree:tree_budgets_allocated")
        after = [greedy(http, budget) for budget in ("ar", 64, 3)]
        health = http.get("/health")
    figures = {"rss": (rss_before, rss_peak, rss_after),
               **{f"gpu_{kind}": (gpu_before[kind], gpu_peak[kind], gpu_after[kind]) for kind in gpu_before}}
    for name, (first, peak, last) in figures.items():
        print(f"{name} over 200 budgets: {first / MB:.0f} MB -> {last / MB:.0f} MB "
              f"(growth {(last - first) / MB:+.0f} MB, peak {peak / MB:.0f} MB)")
    print(f"budgets allocated after: {allocated:.0f}")
    assert health.status_code == 200 and server.proc.poll() is None
    assert allocated <= 1 + CACHED  # the default and the cached ones
    assert after == before and before[0] == before[1] == before[2]
    return figures


def test_200_distinct_budgets_leave_the_server_up_with_bounded_memory(server):
    figures = flood(server)
    rss_before, rss_peak, rss_after = figures["rss"]
    assert rss_peak - rss_before < RSS_GROWTH_LIMIT and rss_after - rss_before < RSS_GROWTH_LIMIT
    assert figures["gpu_allocated"] == (0, 0, 0)  # no GPU gauge on a CPU server
