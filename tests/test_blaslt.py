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


class _FakePlan:
    """Stands in for `LtProjection` on the CPU: candidate i computes x @ w.T times `scales[i]`."""

    scales = (1.0, 1.0, 1.5, 1.0)

    def __init__(self, m, n, k, dtype, accumulate, device, out_dtype):
        self.accumulate = accumulate

    def candidates(self):
        return [blaslt.Candidate(blaslt._Algo(), 0, 1.0, {"index": i}) for i in range(len(self.scales))]

    def __call__(self, x, w, y, cand):
        product = (x @ w.T) * self.scales[cand.config["index"]]
        return y.add_(product) if self.accumulate else y.copy_(product)


def _fake_timing(monkeypatch, times):
    """graph_call_us returns `times` in order: PyTorch's call first, then each agreeing candidate."""
    queue = list(times)
    monkeypatch.setattr(blaslt, "graph_call_us", lambda fn, **kw: (fn(0), queue.pop(0))[1])
    monkeypatch.setattr(blaslt, "LtProjection", _FakePlan)
    monkeypatch.setattr(blaslt, "_l2_bytes", lambda device: 1 << 20)
    return queue


@pytest.mark.parametrize("accumulate", [False, True])
def test_choose_takes_the_fastest_candidate_that_agrees(monkeypatch, accumulate):
    # PyTorch 10 us; candidates 0, 1 and 3 agree (2 is off by half) and take 9.5, 8.0 and 8.5 us.
    queue = _fake_timing(monkeypatch, [10.0, 9.5, 8.0, 8.5])
    x, w, out = torch.randn(3, 16), torch.randn(8, 16), torch.randn(3, 8)
    before = out.clone()
    choice = blaslt._choose(x, w, out, accumulate, torch.float32)
    assert queue == []  # the disagreeing candidate was never timed
    assert choice.candidate.config == {"index": 1} and (choice.torch_us, choice.us) == (10.0, 8.0)
    assert torch.equal(out, before)  # the caller's output is not touched while timing


@pytest.mark.parametrize("times", [[10.0, 9.8, 9.9, 9.9], [5.0, 4.8, 4.8, 4.9]])
def test_choose_keeps_pytorch_unless_a_candidate_wins_clearly(monkeypatch, times):
    # 2% faster, or 0.2 us faster: within what two timings of one kernel differ by.
    _fake_timing(monkeypatch, times)
    assert blaslt._choose(torch.randn(3, 16), torch.randn(8, 16), None, False, torch.float32) is None


def test_choose_keeps_pytorch_where_timing_runs_out_of_memory(monkeypatch):
    def no_room(fn, **kw):
        raise torch.OutOfMemoryError("no room")

    _fake_timing(monkeypatch, [])
    monkeypatch.setattr(blaslt, "graph_call_us", no_room)
    assert blaslt._choose(torch.randn(3, 16), torch.randn(8, 16), None, False, torch.float32) is None


def test_the_op_traces_whole_inside_a_compiled_function(enabled):
    """`blaslt_linear` is what `linear` becomes inside a `torch.compile`d function on a GPU (the
    drafter's layers): one opaque op with a shape rule, no graph break (fullgraph), PyTorch's
    product where no kernel was chosen."""
    torch.manual_seed(0)
    x, w = torch.randn(5, 32), torch.randn(24, 32)
    torch.library.opcheck(torch.ops.ddtree.blaslt_linear.default, (x, w, False))
    fn = torch.compile(lambda x, w: torch.ops.ddtree.blaslt_linear(x, w, False).relu(), backend="aot_eager",
                       fullgraph=True, dynamic=True)
    torch.testing.assert_close(fn(x, w), F.linear(x, w).relu())
    torch.testing.assert_close(fn(x[:3], w), F.linear(x[:3], w).relu())


def test_training_keeps_pytorchs_call(enabled, monkeypatch):
    """Gradients flow: a projection whose inputs need them never goes through cuBLASLt's call."""
    monkeypatch.setattr(blaslt, "_linear", lambda *a: pytest.fail("cuBLASLt's path taken while training"))
    x, w = torch.randn(3, 16), torch.randn(8, 16, requires_grad=True)
    enabled.linear(x, w).sum().backward()
    torch.testing.assert_close(w.grad, x.sum(0).expand(8, 16))
