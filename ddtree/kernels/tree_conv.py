"""A draft tree's causal depthwise conv (Gated DeltaNet's, before the recurrence) as one Triton launch.

Each node is convolved over its own root path: tap K - 1 is the node, tap K - 1 - j its j-th
ancestor, and past the root the committed conv window's rows (`models.hybrid.conv_ancestors`
names them: indices into [window (K - 1 rows); nodes (N rows)]). The result, SiLU'd, is what
`models.hybrid.conv_silu(tree_conv_taps(...))` gives, summed in float32 tap by tap in the same
order and rounded once to the inputs' dtype before the SiLU.

Compiled by Inductor with the rest of the verify's glue this was one gather-and-convolve kernel
of about 11 us per layer at 65 nodes of Qwen3.6-27B (10240 channels: about 8 MB moved, some 2 us
at the H200's copy bandwidth; `verify_profile_h200_qwen36_27b_glue.json`). Here a program takes
one node and BLOCK_C channels: its K source rows are found once on the scalar path (a node's
ancestor indices), so each tap is one contiguous load. It also stores the node's own conv input
in the commit's stash (which the commit's window update reads), so nothing else copies it.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install has no Triton: `models.hybrid` convolves with PyTorch there
    triton = None

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_C = 1024  # channels per program: 10 programs per node at Qwen3.6-27B's 10240


def supported(window: torch.Tensor, mixed: torch.Tensor, weight: torch.Tensor) -> bool:
    """Triton, a GPU (or the interpreter), unit channel strides, a window [K - 1, C] and a weight [C, K]."""
    if triton is None or not (mixed.is_cuda or _INTERPRETED):
        return False
    c, k = weight.shape
    return (mixed.dim() == 2 and mixed.shape[1] == c and mixed.stride(1) == 1 and window.shape == (k - 1, c)
            and window.stride(1) == 1 and weight.is_contiguous())


def tree_conv_silu(window: torch.Tensor, mixed: torch.Tensor, ancestors: torch.Tensor, weight: torch.Tensor,
                   mixed_out: torch.Tensor) -> torch.Tensor:
    """window [K - 1, C] (committed conv inputs), mixed [N, C] (the nodes' conv inputs, any row
    stride), ancestors [N, K] long (`conv_ancestors`), weight [C, K] -> SiLU(conv) [N, C] in
    mixed's dtype. mixed_out [N, C] (unit channel stride) receives a copy of mixed."""
    n, c = mixed.shape
    k = weight.shape[1]
    out = torch.empty(n, c, dtype=mixed.dtype, device=mixed.device)
    ancestors = ancestors.contiguous()
    _tree_conv[(n, triton.cdiv(c, BLOCK_C))](
        window, mixed, ancestors, weight, out, mixed_out, c, window.stride(0), mixed.stride(0), mixed_out.stride(0),
        K=k, BLOCK_C=BLOCK_C, num_warps=4)
    return out


if triton is not None:

    @triton.jit
    def node_conv_silu(window_ptr, mixed_ptr, ancestors_ptr, weight_ptr, stash_ptr, i, c, ok, s_window, s_mixed,
                        s_stash, K: tl.constexpr):
        """Node i's channels c (a tile of any shape, `ok` its mask): SiLU(sum_j x_j w_j), the sum in
        float32 rounded to the inputs' dtype, SiLU'd and rounded again (returned as float32). The
        node's own inputs go to the stash."""
        acc = tl.zeros(c.shape, tl.float32)
        for j in tl.static_range(K):
            w = tl.load(weight_ptr + c * K + j, mask=ok, other=0.0).to(tl.float32)
            if j == K - 1:  # the node itself
                x = tl.load(mixed_ptr + i * s_mixed + c, mask=ok, other=0.0)
                tl.store(stash_ptr + i * s_stash + c, x, mask=ok)
            else:
                row = tl.load(ancestors_ptr + i * K + j)
                node = row - (K - 1)
                if node >= 0:
                    x = tl.load(mixed_ptr + node * s_mixed + c, mask=ok, other=0.0)
                else:
                    x = tl.load(window_ptr + row * s_window + c, mask=ok, other=0.0)
            if j == 0:
                acc = x.to(tl.float32) * w
            else:
                acc = acc + x.to(tl.float32) * w
        y = acc.to(mixed_ptr.dtype.element_ty).to(tl.float32)
        return (y / (1.0 + tl.exp(-y))).to(mixed_ptr.dtype.element_ty).to(tl.float32)

    @triton.jit
    def _tree_conv(window_ptr, mixed_ptr, ancestors_ptr, weight_ptr, out_ptr, stash_ptr, channels, s_window,
                   s_mixed, s_stash, K: tl.constexpr, BLOCK_C: tl.constexpr):
        """Program (node i, channel block): sum_j x_j w_j over its K taps, rounded, SiLU'd."""
        i = tl.program_id(0)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        ok = c < channels
        y = node_conv_silu(window_ptr, mixed_ptr, ancestors_ptr, weight_ptr, stash_ptr, i, c, ok, s_window, s_mixed,
                           s_stash, K)
        tl.store(out_ptr + i * channels + c, y.to(out_ptr.dtype.element_ty), mask=ok)
