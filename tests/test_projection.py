"""A hybrid target's projections (`models.projection.linear`): F.linear unless DDTREE_SKINNY_GEMM=1;
then, for a 2-byte weight and a few rows without bias, the streaming kernel (Triton's interpreter
here), within bf16 rounding of F.linear; everything else still F.linear exactly."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ddtree.models import projection

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_the_switch_off_is_f_linear(monkeypatch):
    monkeypatch.setattr(projection, "ENABLED", False)
    x, w = torch.randn(5, 64, device=DEVICE).bfloat16(), torch.randn(32, 64, device=DEVICE).bfloat16()
    assert torch.equal(projection.linear(x, w), F.linear(x, w))


@pytest.mark.skipif(projection.skinny_gemm is None or not projection.skinny_gemm.supported(
    torch.zeros(1, 16, dtype=torch.bfloat16, device=DEVICE), torch.zeros(16, 16, dtype=torch.bfloat16, device=DEVICE)),
    reason="needs Triton (a GPU or its interpreter)")
def test_the_switch_on_streams_what_it_can(monkeypatch):
    monkeypatch.setattr(projection, "ENABLED", True)
    calls = []
    kernel = projection.skinny_gemm.skinny_linear
    monkeypatch.setattr(projection.skinny_gemm, "skinny_linear", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(17, 128, generator=gen).to(DEVICE, torch.bfloat16)
    w = (torch.randn(96, 128, generator=gen) * 0.05).to(DEVICE, torch.bfloat16)
    torch.testing.assert_close(projection.linear(x, w).float(), F.linear(x, w).float(), atol=2e-2, rtol=1e-2)
    assert len(calls) == 1
    bias = torch.randn(96, device=DEVICE).bfloat16()
    assert torch.equal(projection.linear(x, w, bias), F.linear(x, w, bias))  # a bias: F.linear
    assert torch.equal(projection.linear(x.float(), w.float()), F.linear(x.float(), w.float()))  # float32: F.linear
    assert len(calls) == 1
