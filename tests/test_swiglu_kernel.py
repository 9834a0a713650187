"""`kernels.swiglu` (Triton's interpreter on the CPU) against PyTorch's silu(gate) * up."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ddtree.kernels import swiglu as swiglu_kernel

pytestmark = pytest.mark.skipif(swiglu_kernel.triton is None, reason="needs Triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: Triton's interpreter (conftest)


def reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


@pytest.mark.parametrize("rows,width", [(1, 48), (5, 1024), (3, 1100)])  # 1100: a partial column block
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_equals_pytorch(rows, width, dtype):
    gate_up = (3 * torch.randn(rows, 2 * width, generator=torch.Generator().manual_seed(rows))).to(DEVICE, dtype)
    got = swiglu_kernel.swiglu(gate_up)
    assert got.dtype == dtype and got.shape == (rows, width)
    if dtype == torch.float32:
        torch.testing.assert_close(got, reference(gate_up), rtol=1e-6, atol=1e-6)
    else:  # float32 inside, one rounding: equal to the float32 result rounded, within one bf16 ulp
        torch.testing.assert_close(got.float(), reference(gate_up).float(), rtol=8e-3, atol=1e-6)


def test_swiglu_of_a_row_slice_and_no_rows():
    """A view with a row stride wider than its columns (a slice of a larger buffer), and N = 0."""
    big = torch.randn(4, 80, device=DEVICE)
    view = big[1:3, :64]
    torch.testing.assert_close(swiglu_kernel.swiglu(view), reference(view), rtol=1e-6, atol=1e-6)
    assert swiglu_kernel.swiglu(torch.empty(0, 64, device=DEVICE)).shape == (0, 32)


@pytest.mark.parametrize("rows,width,hidden", [(1, 48, 40), (4, 1100, 2600)])  # 2600: past two column blocks
def test_row_scale_is_the_rms_norm_of_the_mlp_input(rows, width, hidden):
    """With scale_rows h: silu(r g) * (r u), r = 1 / sqrt(mean(h^2) + eps) of each row of h."""
    gen = torch.Generator().manual_seed(width)
    gate_up = (3 * torch.randn(rows, 2 * width, generator=gen)).to(DEVICE)
    h = (5 * torch.randn(rows, hidden, generator=gen)).to(DEVICE)
    eps = 1e-6
    r = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    got = swiglu_kernel.swiglu(gate_up, scale_rows=h, eps=eps)
    torch.testing.assert_close(got, reference(gate_up * r), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="scale_rows"):
        swiglu_kernel.swiglu(gate_up, scale_rows=h[:, ::2])
