"""A draft tree's Gated DeltaNet inputs as one Triton launch per layer: the causal depthwise conv
over each node's own root path, SiLU, the L2 norms of q and k, the decay g and the write strength
beta, and the commit's stash. The verify's default on CUDA (`models.hybrid`; DDTREE_FUSED_GDN_INPUTS=0
runs `kernels.tree_conv`, the conv alone, with the rest compiled by Inductor instead). On an H200 at
Qwen3.6-27B shape it took a budget-64 round from 21.19 to 20.70 ms at a 512-token prompt and from
21.94 to 21.43 ms at 8192 (`round_latency_h200_qwen36_27b_tree_conv.json`, then
`round_latency_h200_qwen36_27b_fused_inputs.json`), and greedy output through it equals
transformers' at every budget (`tests/test_gpu_hybrid.py`).

Each node is convolved over its own root path: tap K - 1 is the node, tap K - 1 - j its j-th
ancestor, and past the root the committed conv window's rows (`models.hybrid.conv_ancestors`
names them: indices into [window (K - 1 rows); nodes (N rows)]). The arithmetic is
`models.hybrid.gdn_tree_inputs`'s, in its order and with its roundings: the conv summed in
float32 tap by tap, rounded to the inputs' dtype, SiLU'd and rounded again; q and k L2-normalised
in float32 (q scaled by Dk ** -0.5, `gated_deltanet.normalize_qk`); g = -exp(A_log) softplus(a +
dt_bias) in float32; beta = sigmoid(b) rounded to b's dtype. Sums over a head's channels may
add in another order than PyTorch's, so q and k agree with it to float32 rounding, not bit for bit.

What it would replace, with the conv kernel in place, at 65 nodes of Qwen3.6-27B: Inductor's two
norm kernels (3.5 us each per layer) and its g and beta kernels (about 1 us each)
(`verify_profile_h200_qwen36_27b_glue.json`, measured before the conv kernel). Program (node, p)
takes HEADS heads of q, k or v (p in that order) or, the last p, the node's g and beta: a node's
K source rows are found once on the scalar path, so each tap is one contiguous load, and a head's
norm is a row sum of the program's own tile. The programs also store the node's own conv inputs
in the commit's stash.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install has no Triton: `models.hybrid` runs PyTorch there
    triton = None

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
HEADS = 4  # heads per program: 512 channels at Qwen3.6-27B's head_dim 128
L2_EPS = 1e-6  # gated_deltanet.L2_EPS


def supported(window: torch.Tensor, mixed: torch.Tensor, weight: torch.Tensor, key_dim: int, value_dim: int) -> bool:
    """Triton, a GPU (or the interpreter), unit channel strides, a window [K - 1, C] and a weight
    [C, K], head dims that are powers of two."""
    if triton is None or not (mixed.is_cuda or _INTERPRETED):
        return False
    c, k = weight.shape
    pow2 = all(d >= 16 and d & (d - 1) == 0 for d in (key_dim, value_dim))
    return (pow2 and mixed.dim() == 2 and mixed.shape[1] == c and mixed.stride(1) == 1
            and window.shape == (k - 1, c) and window.stride(1) == 1 and weight.is_contiguous())


def tree_gdn_inputs(window: torch.Tensor, mixed: torch.Tensor, ancestors: torch.Tensor, weight: torch.Tensor,
                    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                    hk: int, dk: int, hv: int, dv: int, mixed_out: torch.Tensor, k_out: torch.Tensor):
    """window [K - 1, C] (committed conv inputs), mixed [N, C] (the nodes' conv inputs, C = 2 Hk Dk +
    Hv Dv, any row stride), ancestors [N, K] long (`conv_ancestors`), weight [C, K], a, b [N, Hv]
    (any row stride), A_log, dt_bias [Hv] -> q [N, Hk, Dk] float32 (normalised, scaled), v [N, Hv,
    Dv] (mixed's dtype), g, beta [N, Hv] float32. mixed_out [N, C] <- mixed; k_out [N, Hk, Dk]
    float32 <- the normalised keys (both with a unit last stride)."""
    n, c = mixed.shape
    kernel = weight.shape[1]
    device = mixed.device
    q = torch.empty(n, hk, dk, dtype=torch.float32, device=device)
    v = torch.empty(n, hv, dv, dtype=mixed.dtype, device=device)
    g = torch.empty(n, hv, dtype=torch.float32, device=device)
    beta = torch.empty(n, hv, dtype=torch.float32, device=device)
    key_blocks, value_blocks = triton.cdiv(hk, HEADS), triton.cdiv(hv, HEADS)
    _tree_gdn_inputs[(n, 2 * key_blocks + value_blocks + 1)](
        window, mixed, ancestors.contiguous(), weight, a, b, A_log, dt_bias, q, k_out, v, g, beta, mixed_out,
        window.stride(0), mixed.stride(0), a.stride(0), b.stride(0), k_out.stride(0), k_out.stride(1),
        mixed_out.stride(0), HK=hk, HV=hv, DK=dk, DV=dv, K=kernel, HEADS=HEADS,
        HV_BLOCK=triton.next_power_of_2(hv), EPS=L2_EPS, num_warps=4)
    return q, v, g, beta


if triton is not None:
    from ddtree.kernels.tree_conv import node_conv_silu  # a node's conv over a tile of channels, shared

    @triton.jit
    def _tree_gdn_inputs(window_ptr, mixed_ptr, ancestors_ptr, weight_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr,
                         q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, stash_ptr, s_window, s_mixed, s_a, s_b, sk_n, sk_h,
                         s_stash, HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                         K: tl.constexpr, HEADS: tl.constexpr, HV_BLOCK: tl.constexpr, EPS: tl.constexpr):
        """Program (node i, p): p < 2 KB: HEADS query (then key) heads, normalised; then HEADS value
        heads; the last p: the node's g and beta (KB = cdiv(HK, HEADS) key blocks)."""
        i = tl.program_id(0)
        p = tl.program_id(1)
        key_blocks = (HK + HEADS - 1) // HEADS
        value_blocks = (HV + HEADS - 1) // HEADS
        hi = tl.arange(0, HEADS)
        # Each branch names its own variables: Triton merges a name assigned in several branches,
        # which must then have one type (tiles of different shapes here).
        if p < 2 * key_blocks:
            is_key = p >= key_blocks
            key_heads = (p - key_blocks * is_key.to(tl.int32)) * HEADS + hi
            dk = tl.arange(0, DK)
            key_ok = (key_heads < HK)[:, None] & (dk < DK)[None, :]
            key_c = is_key.to(tl.int32) * HK * DK + key_heads[:, None] * DK + dk[None, :]  # [HEADS, DK]
            qk = node_conv_silu(window_ptr, mixed_ptr, ancestors_ptr, weight_ptr, stash_ptr, i, key_c, key_ok, s_window,
                            s_mixed, s_stash, K)
            qk = qk * tl.rsqrt(tl.sum(qk * qk, 1) + EPS)[:, None]
            if is_key:
                tl.store(k_ptr + i * sk_n + key_heads[:, None] * sk_h + dk[None, :], qk, mask=key_ok)
            else:
                tl.store(q_ptr + (i * HK + key_heads[:, None]) * DK + dk[None, :], qk * (DK ** -0.5), mask=key_ok)
        elif p < 2 * key_blocks + value_blocks:
            value_heads = (p - 2 * key_blocks) * HEADS + hi
            dv = tl.arange(0, DV)
            value_ok = (value_heads < HV)[:, None] & (dv < DV)[None, :]
            value_c = 2 * HK * DK + value_heads[:, None] * DV + dv[None, :]  # [HEADS, DV]
            vx = node_conv_silu(window_ptr, mixed_ptr, ancestors_ptr, weight_ptr, stash_ptr, i, value_c, value_ok,
                            s_window, s_mixed, s_stash, K)
            tl.store(v_ptr + (i * HV + value_heads[:, None]) * DV + dv[None, :], vx.to(v_ptr.dtype.element_ty),
                     mask=value_ok)
        else:
            h = tl.arange(0, HV_BLOCK)
            h_ok = h < HV
            ax = tl.load(a_ptr + i * s_a + h, mask=h_ok, other=0.0).to(tl.float32) + \
                tl.load(dt_bias_ptr + h, mask=h_ok, other=0.0).to(tl.float32)
            softplus = tl.where(ax > 20.0, ax, tl.log(1.0 + tl.exp(ax)))  # F.softplus, threshold 20
            decay = -tl.exp(tl.load(a_log_ptr + h, mask=h_ok, other=0.0).to(tl.float32)) * softplus
            tl.store(g_ptr + i * HV + h, decay, mask=h_ok)
            bb = tl.load(b_ptr + i * s_b + h, mask=h_ok, other=0.0)
            sig = (1.0 / (1.0 + tl.exp(-bb.to(tl.float32)))).to(bb.dtype).to(tl.float32)
            tl.store(beta_ptr + i * HV + h, sig, mask=h_ok)
