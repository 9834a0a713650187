"""SwiGLU, silu(gate) * up, over a fused gate/up projection's output, as one Triton kernel.

Inductor's kernel for it, compiled with dynamic shapes (one compiled function for every row
count), cannot assume the row stride or the up half's offset (the intermediate width) are
multiples of 16 bytes, so it loads two bytes at a time: on an H200 at Qwen3.6-27B's MLP (65 rows
of 2 x 17408) it took 5.6 us a layer, where the 6.8 MB it moves take under 2 us
(verify_profile_h200_qwen36_27b_8192.json). Here the widths are ordinary integer arguments,
which Triton specialises when they divide by 16, so loads and stores are 16 bytes wide.

Numerics: float32 inside, one rounding to the output dtype (as Inductor's kernel).
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install has no Triton: `hybrid.swiglu` runs in PyTorch
    triton = None

BLOCK = 1024  # output columns per program
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def supported(gate_up: torch.Tensor) -> bool:
    """A CUDA (or interpreted) [N, 2 I] tensor with a unit last stride."""
    return (triton is not None and (gate_up.is_cuda or _INTERPRETED) and gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0 and gate_up.stride(1) == 1
            and gate_up.dtype in (torch.float32, torch.bfloat16, torch.float16))


def swiglu(gate_up: torch.Tensor, scale_rows: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """gate_up [N, 2 I] (gate columns first) -> silu(gate) * up [N, I] in gate_up's dtype.

    scale_rows [N, H] (unit last stride): each row's gate and up first multiplied by that row's
    1 / sqrt(mean(h^2) + eps), the RMSNorm scale of the MLP's input, for a gate/up weight with the
    norm's weight folded into it (`TargetModel.fold_norms`)."""
    n, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(n, width, dtype=gate_up.dtype, device=gate_up.device)
    if n:
        scaled = scale_rows is not None
        if scaled and (scale_rows.shape[0] != n or scale_rows.stride(-1) != 1):
            raise ValueError("swiglu's scale_rows is [N, H] with a unit last stride")
        h = scale_rows if scaled else gate_up
        _swiglu_kernel[(n, triton.cdiv(width, BLOCK))](gate_up, out, h, width, h.shape[-1], gate_up.stride(0),
                                                        out.stride(0), h.stride(0), eps, BLOCK=BLOCK, SCALED=scaled,
                                                        num_warps=4)
    return out


if triton is not None:
    from ddtree.kernels.rms_scale import row_rms_scale

    @triton.jit
    def _swiglu_kernel(x_ptr, out_ptr, h_ptr, width, hidden, sx, so, sh, eps, BLOCK: tl.constexpr,
                       SCALED: tl.constexpr):
        """Program (row, column block)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < width
        gate = tl.load(x_ptr + row * sx + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * sx + width + cols, mask=ok, other=0.0).to(tl.float32)
        if SCALED:
            r = row_rms_scale(h_ptr, row * sh, hidden, eps, BLOCK)
            gate, up = gate * r, up * r
        out = gate * tl.sigmoid(gate) * up
        tl.store(out_ptr + row * so + cols, out.to(out_ptr.dtype.element_ty), mask=ok)
