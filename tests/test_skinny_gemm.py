"""The few-row projection kernel (`kernels.skinny_gemm`) against a float32 product, in Triton's
interpreter on the CPU (on a GPU, natively): one slice of K and several, K whole steps or not, N
ragged, M from 1 to the 128-row limit."""
from __future__ import annotations

import pytest
import torch

skinny = pytest.importorskip("ddtree.kernels.skinny_gemm")
if skinny.triton is None:
    pytest.skip("needs Triton", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def operands(m: int, n: int, k: int, dtype=torch.bfloat16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(DEVICE, dtype)
    return x, w


@pytest.mark.parametrize("m,n,k,splits", [(1, 96, 256, 1), (5, 96, 256, 4), (17, 80, 192, 2), (65, 48, 256, 0),
                                          (128, 64, 128, 1), (33, 112, 200, 3)])
def test_equals_a_float32_product(m, n, k, splits):
    x, w = operands(m, n, k, seed=m)
    config = skinny.SkinnyConfig(block_n=32, block_k=64, splits=splits, num_stages=2)
    assert skinny.supported(x, w)
    got = skinny.skinny_linear(x, w, config)
    expected = x.float() @ w.float().T
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=1e-2)


def test_fp16_and_a_strided_input():
    x, w = operands(20, 64, 128, torch.float16, seed=3)
    wide = torch.zeros(20, 256, dtype=torch.float16, device=DEVICE)
    wide[:, :128] = x
    view = wide[:, :128]  # rows 256 apart
    got = skinny.skinny_linear(view, w, skinny.SkinnyConfig(block_n=32, block_k=64, splits=2, num_stages=2))
    torch.testing.assert_close(got.float(), x.float() @ w.float().T, atol=1e-2, rtol=1e-2)


def test_plan_fills_the_device_in_whole_steps():
    # 80 column tiles on 132 SMs at 2 programs each: 3 slices of K, each a whole number of steps.
    assert skinny.plan(65, 5120, 17408, 132, skinny.SkinnyConfig(block_n=64, block_k=128)) == (128, 3, 5888)
    # Enough column tiles already: one slice.
    assert skinny.plan(1, 34816, 5120, 132, skinny.SkinnyConfig(block_n=64, block_k=128))[1:] == (1, 5120)


def test_what_it_takes():
    x, w = operands(4, 32, 64)
    assert not skinny.supported(x.float(), w.float())  # 2-byte dtypes only
    assert not skinny.supported(torch.zeros(129, 64, dtype=torch.bfloat16, device=DEVICE), w)  # over 128 rows
    assert not skinny.supported(x, w.T.contiguous().T)  # a weight that is not row-major
