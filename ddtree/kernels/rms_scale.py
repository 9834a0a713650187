"""A row's RMSNorm scale, 1 / sqrt(mean(h^2) + eps), inside a Triton kernel: what a consumer of a
projection computes when the norm's weight is folded into that projection's weight
(`TargetModel.fold_norms`), so that the norm needs no launch of its own."""
from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install has no Triton
    triton = None

if triton is not None:

    @triton.jit
    def row_rms_scale(h_ptr, offset, hidden, eps, BLOCK: tl.constexpr):
        """1 / sqrt(mean(x^2) + eps) over the `hidden` values at h_ptr + offset, float32."""
        total = tl.zeros([BLOCK], dtype=tl.float32)
        start = 0
        while start < hidden:
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(h_ptr + offset + cols, mask=cols < hidden, other=0.0).to(tl.float32)
            total += x * x
            start += BLOCK
        return tl.rsqrt(tl.sum(total, axis=0) / hidden + eps)
