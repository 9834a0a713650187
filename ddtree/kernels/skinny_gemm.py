"""A projection of a few rows against a large weight, streaming the weight once: y [M, N] =
x [M, K] @ W [N, K]^T for M up to 128 (a verify's tokens), bf16 or fp16, float32 accumulation.

Why: such a product is bound by the weight's bytes, and cuBLAS reads them below the copy rate.
On the H200 at Qwen3.6-27B's shapes it read 3.3-3.7 TB/s at 65 rows and 3.5-4.1 at one, against
the 4.2 TB/s a copy reaches (`benchmarks/results/gemm_tokens_h200_qwen36_27b.json`): a 64-node
verify's matmuls take about 14 us a layer more than the same weights at the copy rate would.

How: programs tile N in BLOCK_N columns and, where that leaves too few programs to keep every SM
streaming, split K into `splits` slices (`plan`); each program loads its [BLOCK_N, K / splits]
slab of W once, BLOCK_K columns a step through a `num_stages`-deep pipeline, against the rows of x
(all M of them in one tile of BLOCK_M, a power of two of at least 16: `tl.dot`'s smallest; the
padding rows cost tensor-core time, not bytes). With one slice the program writes y; with more,
each writes its float32 partial sum and a second launch adds the slices in order (deterministic,
no atomics) and rounds once.

Measured on the H200: at 1 and 17 rows cuBLAS read the MLP's weights at the copy rate and this
kernel's best tiling was 0.97x cuBLAS; whole 27B budget-64 rounds with a hybrid's projections on
its default tiling took 26.4 ms against cuBLAS's 20.7; on an H100 at Qwen3-8B's four projections
its best tilings were 0.66-0.96x cuBLAS at 65 rows and 0.85-1.02x at 17 (benchmarks/README.md).
So nothing calls it; `benchmarks/skinny_gemm.py` compares it with cuBLAS shape by shape, and it
stays beside that benchmark until a tiling beats cuBLAS at 65 rows. Tested in Triton's
interpreter against a float32 product.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install has no Triton
    triton = None

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
MAX_ROWS = 128
DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class SkinnyConfig:
    """`block_n` output columns and `block_k` reduction columns per program step; `splits` slices
    of K (0: as many as `programs_per_sm` programs on every SM need, `plan`)."""

    block_n: int = 64
    block_k: int = 128
    splits: int = 0
    programs_per_sm: int = 2
    num_warps: int = 4
    num_stages: int = 4


DEFAULT = SkinnyConfig()


def supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """x [M, K] with 1 <= M <= 128 and unit stride along K; w [N, K] contiguous; one 2-byte dtype;
    a GPU (or Triton's interpreter)."""
    if triton is None or not (x.is_cuda or _INTERPRETED):
        return False
    return (x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1] and 1 <= x.shape[0] <= MAX_ROWS
            and x.dtype == w.dtype and x.dtype in DTYPES and x.stride(1) == 1 and w.is_contiguous())


def plan(m: int, n: int, k: int, sms: int, config: SkinnyConfig = DEFAULT) -> tuple[int, int, int]:
    """(BLOCK_M, splits, K columns per split): the rows in one tile; enough slices of K for
    `programs_per_sm` programs per SM where the column tiles alone are fewer, each slice a whole
    number of BLOCK_K steps."""
    block_m = max(16, triton.next_power_of_2(m))
    tiles = triton.cdiv(n, config.block_n)
    steps = triton.cdiv(k, config.block_k)
    splits = config.splits or max(1, min(steps, round(config.programs_per_sm * sms / tiles)))
    per_split = triton.cdiv(steps, splits) * config.block_k
    return block_m, triton.cdiv(k, per_split), per_split


@functools.lru_cache(maxsize=None)
def _sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def skinny_linear(x: torch.Tensor, w: torch.Tensor, config: SkinnyConfig | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T -> [M, N] in x's dtype (`supported` inputs)."""
    config = config or DEFAULT
    m, k = x.shape
    n = w.shape[0]
    sms = _sms(x.device.index if x.device.index is not None else torch.cuda.current_device()) if x.is_cuda else 4
    block_m, splits, per_split = plan(m, n, k, sms, config)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    split = splits > 1
    part = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if split else out
    grid = (triton.cdiv(n, config.block_n), splits)
    _skinny_kernel[grid](x, w, out, part, m, n, k, per_split, x.stride(0), w.stride(0),
                         BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                         EVEN_K=k % config.block_k == 0, SPLIT=split, INTERPRETED=_INTERPRETED,
                         num_warps=config.num_warps,
                         num_stages=config.num_stages)
    if split:
        block = 1024
        _sum_splits[(triton.cdiv(m * n, block),)](part, out, m * n, splits, BLOCK=block)
    return out


if triton is not None:

    @triton.jit
    def _step(acc, x_ptr, w_ptr, k0, end, rm, rn, rk, row_ok, col_ok, sx_m, sw_n, EVEN_K: tl.constexpr,
              INTERPRETED: tl.constexpr):
        """acc + x[:, k0 : k0 + BLOCK_K] @ W[tile, k0 : k0 + BLOCK_K]^T."""
        kk = k0 + rk
        if EVEN_K:  # every step whole: no mask along K
            xk = tl.load(x_ptr + rm[:, None] * sx_m + kk[None, :], mask=row_ok[:, None], other=0.0)
            wk = tl.load(w_ptr + rn[:, None] * sw_n + kk[None, :], mask=col_ok[:, None], other=0.0)
        else:
            k_ok = kk < end
            xk = tl.load(x_ptr + rm[:, None] * sx_m + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wk = tl.load(w_ptr + rn[:, None] * sw_n + kk[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if INTERPRETED:  # Triton's interpreter: its bf16 holds raw bits, which tl.dot would multiply as ints
            xk, wk = xk.to(tl.float32), wk.to(tl.float32)
        return tl.dot(xk, tl.trans(wk), acc)

    @triton.jit
    def _skinny_kernel(x_ptr, w_ptr, out_ptr, part_ptr, m, n, k, per_split, sx_m, sw_n,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                       SPLIT: tl.constexpr, INTERPRETED: tl.constexpr):
        """Program (column tile, K slice s): the slice's sum for all rows; written as y (one slice)
        or as the slice's float32 partial [s, M, N] (SPLIT). INTERPRETED (Triton's interpreter): the
        K loop as a `while` (a `for` is what the compiler pipelines), the operands in float32."""
        rm = tl.arange(0, BLOCK_M)
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        s = tl.program_id(1)
        start = s * per_split
        end = tl.minimum(start + per_split, k)
        row_ok = rm < m
        col_ok = rn < n
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if INTERPRETED:
            k0 = start
            while k0 < end:
                acc = _step(acc, x_ptr, w_ptr, k0, end, rm, rn, rk, row_ok, col_ok, sx_m, sw_n, EVEN_K, INTERPRETED)
                k0 += BLOCK_K
        else:
            for k0 in range(start, end, BLOCK_K):
                acc = _step(acc, x_ptr, w_ptr, k0, end, rm, rn, rk, row_ok, col_ok, sx_m, sw_n, EVEN_K, INTERPRETED)
        ok = row_ok[:, None] & col_ok[None, :]
        if SPLIT:
            tl.store(part_ptr + (s * m + rm[:, None]) * n + rn[None, :], acc, mask=ok)
        else:
            tl.store(out_ptr + rm[:, None] * n + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _sum_splits(part_ptr, out_ptr, size, splits, BLOCK: tl.constexpr):
        """out = the partials [splits, size] summed in slice order, rounded once."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < size
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        s = 0
        while s < splits:
            acc += tl.load(part_ptr + s * size + i, mask=ok, other=0.0)
            s += 1
        tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=ok)
