"""`ddtree.kernels.blaslt_search`: every configuration cuBLASLt accepts for a projection computes it.

GPU only: the walk asks cuBLASLt, which needs a device. A sample of each shape's accepted
configurations (spread over the list, split-K and cluster settings among them) is run against a
float32 product.
"""
from __future__ import annotations

import pytest
import torch

from ddtree.kernels import blaslt, blaslt_search

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("m", [1, 65, 257])
@pytest.mark.parametrize("mode", ["plain", "accumulate", "float32_out"])
def test_searched_configurations_match_pytorch(m, mode):
    torch.manual_seed(0)
    n, k = 1024, 2048
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    base = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    out_dtype = torch.float32 if mode == "float32_out" else torch.bfloat16
    plan = blaslt.LtProjection(m, n, k, torch.bfloat16, accumulate=mode == "accumulate", out_dtype=out_dtype)
    found, counts = blaslt_search.search(plan, seconds=5.0)
    assert counts["accepted"] == len(found) > 0 and counts["checked"] >= len(found) and counts["ids"] > 0
    assert any(c.config.get("splitk", 1) > 1 for c in found), "no split-K configuration was accepted"
    want = (x.float() @ w.float().T) + (base.float() if mode == "accumulate" else 0)
    tol = 2e-2 * want.abs().max().item()
    sample = found[:: max(1, len(found) // 48)]
    for cand in sample:
        y = base.clone() if mode == "accumulate" else torch.empty(m, n, device="cuda", dtype=out_dtype)
        got = plan(x, w, y, cand)
        assert (got.float() - want).abs().max().item() <= tol, cand.label()


@pytest.mark.parametrize("m", [65, 257])
def test_the_heuristics_neighbours_hold_its_own_kernels_and_compute_the_product(m):
    torch.manual_seed(0)
    n, k = 1024, 2048
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    plan = blaslt.LtProjection(m, n, k, torch.bfloat16)
    heuristic = plan.candidates()
    found, counts = blaslt_search.search(plan, seconds=5.0, bases=heuristic)
    assert counts["bases"] == len(heuristic) and counts["ids"] == 0 and len(found) > len(heuristic)
    configs = {tuple(sorted(c.config.items())) for c in found}
    first = heuristic[0].config
    if first.get("splitk", 1) == 1 and first.get("swizzle", 0) == 0:  # walked first: it is its own neighbour
        assert tuple(sorted(first.items())) in configs
    want = x.float() @ w.float().T
    for cand in found[:: max(1, len(found) // 48)]:
        got = plan(x, w, torch.empty(m, n, device="cuda", dtype=torch.bfloat16), cand)
        assert (got.float() - want).abs().max().item() <= 2e-2 * want.abs().max().item(), cand.label()


def test_screen_orders_by_time_and_skips_nothing_that_runs():
    m, n, k = 65, 1024, 2048
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    plan = blaslt.LtProjection(m, n, k, torch.bfloat16)
    found, _ = blaslt_search.search(plan, seconds=2.0, limit=40)
    timed = blaslt_search.screen(plan, found, x, [w, w.clone()], torch.empty(m, n, device="cuda", dtype=torch.bfloat16))
    assert len(timed) == len(found)
    assert [t for t, _ in timed] == sorted(t for t, _ in timed) and all(t > 0 for t, _ in timed)
