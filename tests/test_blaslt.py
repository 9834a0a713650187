"""`ddtree.kernels.blaslt`: projections through the cuBLASLt kernel timed fastest.

On the CPU `linear` is PyTorch's call whatever the switch says; on a GPU every candidate cuBLASLt
offers agrees with PyTorch's product, and a chosen kernel runs the same in eager calls and graphs.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ddtree.kernels import blaslt


@pytest.fixture
def enabled(monkeypatch):
    monkeypatch.setattr(blaslt, "ENABLED", True)
    monkeypatch.setattr(blaslt, "_CHOSEN", {})
    return blaslt


@pytest.mark.parametrize("accumulate", [False, True])
def test_cpu_runs_pytorchs_call(enabled, accumulate):
    torch.manual_seed(0)
    x, w = torch.randn(5, 32), torch.randn(24, 32)
    out = torch.randn(5, 24)
    want = out + x @ w.T if accumulate else F.linear(x, w)
    got = enabled.linear(x, w, out=out.clone() if accumulate else None, accumulate=accumulate)
    torch.testing.assert_close(got, want)
    assert enabled.chosen() == []


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_gpu
@pytest.mark.parametrize("m", [1, 17, 65])
@pytest.mark.parametrize("mode", ["plain", "accumulate", "float32_out"])
def test_every_candidate_matches_pytorch(m, mode):
    torch.manual_seed(0)
    n, k = 768, 512
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    base = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    out_dtype = torch.float32 if mode == "float32_out" else None
    plan = blaslt.LtProjection(m, n, k, torch.bfloat16, accumulate=mode == "accumulate", out_dtype=out_dtype)
    want = (x.float() @ w.float().T) + (base.float() if mode == "accumulate" else 0)
    candidates = plan.candidates()
    assert candidates, "cuBLASLt offered no kernel"
    for cand in candidates:
        y = base.clone() if mode == "accumulate" else torch.empty(m, n, device="cuda", dtype=out_dtype or x.dtype)
        got = plan(x, w, y, cand)
        assert got.data_ptr() == y.data_ptr()
        tol = 2e-2 * want.abs().max().item()
        assert (got.float() - want).abs().max().item() <= tol, cand.label()


@needs_gpu
def test_a_chosen_kernel_runs_the_same_in_a_graph(enabled):
    torch.manual_seed(0)
    m, n, k = 65, 4096, 1024
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    h = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    eager = enabled.linear(x, w, out=h.clone(), accumulate=True)  # times the candidates here
    assert len(enabled._CHOSEN) == 1
    torch.testing.assert_close(eager.float(), h.float() + x.float() @ w.float().T, atol=0.1, rtol=2e-2)
    out = h.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        enabled.linear(x, w, out=out, accumulate=True)
    out.copy_(h)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    assert len(enabled._CHOSEN) == 1


@needs_gpu
def test_a_shape_first_met_in_a_capture_keeps_pytorchs_call(enabled):
    x = torch.randn(9, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = enabled.linear(x, w)
    graph.replay()
    assert list(enabled._CHOSEN.values()) == [None]
    assert torch.equal(enabled.linear(x, w), F.linear(x, w))
    torch.cuda.synchronize()
    assert torch.equal(y, F.linear(x, w))
