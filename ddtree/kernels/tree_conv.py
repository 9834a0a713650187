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

`commit_windows`: after the walk, every layer's window becomes the last K - 1 conv inputs of
[window; the accepted path's inputs] in one launch. PyTorch's concatenate and two gathers for it
moved the stash's whole path (about 50 MB at Qwen3.6-27B's 48 layers and a 16-node path) in
three launches, 57 us a commit on an H200 (`verify_profile --phases walk_commit`), for the 3 rows
(2.9 MB) that are kept.
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


def commit_windows_supported(windows: torch.Tensor, stash: torch.Tensor) -> bool:
    """Triton, a GPU (or the interpreter), windows [L, K - 1, C] and stash [L, N, C] with unit
    channel strides."""
    return (triton is not None and (windows.is_cuda or _INTERPRETED) and windows.dim() == 3 and stash.dim() == 3
            and windows.shape[0] == stash.shape[0] and windows.shape[2] == stash.shape[2]
            and windows.stride(2) == 1 and stash.stride(2) == 1)


def commit_windows(windows: torch.Tensor, stash: torch.Tensor, order: torch.Tensor, length: torch.Tensor) -> None:
    """windows [L, K - 1, C] (every layer's committed conv inputs, in place) <- the last K - 1 rows
    of [windows; stash[:, order[:length]]]: stash [L, N, C] the verify's conv inputs per node,
    order [M] the walk's path (root first), length a 0-d device tensor in [0, M] (0 leaves the
    windows as they are)."""
    layers, k1, c = windows.shape
    _commit_windows[(layers, triton.cdiv(c, BLOCK_C))](
        windows, stash, order, length.reshape(1), c, windows.stride(0), windows.stride(1), stash.stride(0),
        stash.stride(1), K1=k1, ROWS=triton.next_power_of_2(k1), BLOCK_C=BLOCK_C, num_warps=4)


if triton is not None:

    @triton.jit
    def _commit_windows(windows_ptr, stash_ptr, order_ptr, length_ptr, channels, sw_l, sw_r, ss_l, ss_n,
                        K1: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
        """Program (layer, channel block): row r of the new window is row length + r of [window;
        path], all K1 rows loaded as one [ROWS, BLOCK_C] tile (ROWS: K1 rounded up to a power of
        two) before any is stored, since row length + r >= r is read where row r is written."""
        layer = tl.program_id(0)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        r = tl.arange(0, ROWS)
        live = (r < K1)[:, None] & (c < channels)[None, :]
        src = tl.load(length_ptr).to(tl.int32) + r
        old = src < K1
        node = tl.load(order_ptr + src - K1, mask=(r < K1) & ~old, other=0)
        kept = tl.load(windows_ptr + layer * sw_l + src[:, None] * sw_r + c[None, :], mask=live & old[:, None])
        new = tl.load(stash_ptr + layer * ss_l + node[:, None] * ss_n + c[None, :], mask=live & ~old[:, None])
        tl.store(windows_ptr + layer * sw_l + r[:, None] * sw_r + c[None, :], tl.where(old[:, None], kept, new),
                 mask=live)

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
