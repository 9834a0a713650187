"""A hybrid target's projections: `F.linear`, or, opt-in with DDTREE_SKINNY_GEMM=1, the kernel that
streams a 2-byte weight once for up to 128 rows (`kernels.skinny_gemm`), where it applies.

Opt-in until it is measured faster than cuBLAS on a GPU (`benchmarks/skinny_gemm.py` shape by
shape, `benchmarks/round_latency.py` with the switch on and off for whole rounds); with the switch
off every call is `F.linear`."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

try:
    from ddtree.kernels import skinny_gemm
except ImportError:  # no Triton
    skinny_gemm = None

ENABLED = os.environ.get("DDTREE_SKINNY_GEMM", "0") == "1"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias) -> [M, N]."""
    if ENABLED and bias is None and skinny_gemm is not None and x.dim() == 2 and skinny_gemm.supported(x, weight):
        return skinny_gemm.skinny_linear(x, weight)
    return F.linear(x, weight, bias)
