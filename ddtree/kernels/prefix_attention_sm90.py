"""The unmasked prefix of a verify's attention on Hopper (sm_90), written in Gluon: N query tokens
over keys [0, P) of the KV cache, P a device scalar, in FlashAttention-3's order within a warp group.

Why: over long contexts the tree attention is nearly all prefix (every row sees every key), and the
Triton kernel's prefix loop runs its two products at 87% of the matmul rate but the softmax between
them does not overlap them (+45%, benchmarks/README.md). Here each key tile's q.k product is issued
asynchronously before the previous tile's p.v product, and the softmax of this tile runs while p.v
is still on the tensor cores (FlashAttention-3, "intra-warpgroup overlapping"); the order is explicit
(`warpgroup_mma(is_async=True)` / `warpgroup_mma_wait`), which Triton's `tl.dot` does not expose.

Layout: rows are (token, query head of the KV head's group) pairs, row = token * group + g, as in
`tree_attention`; each program holds BLOCK_M rows of one KV head and one split of the keys:
grid (row blocks, KV heads, splits). Keys and values are read with cp.async into a ring of STAGES
shared-memory tiles (any cache strides with a unit last one); the keys past P are masked.

Output, as `tree_attention.cudnn_prefix` gives it, for the combine launch to merge with the rest
of the attention: o [splits, Hkv, N * group, D] in q's dtype, each split's normalised output; lse
[splits, Hkv, N * group] float32, the natural log of each row's softmax denominator over its split
(scale applied), -inf for a split with no keys (its o is 0).

Status: compiled for sm_90 (scripts/compile_prefix_attention_sm90.py, a CPU test); not yet run on a GPU.
"""
from __future__ import annotations

import math

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

LOG2E = 1.4426950408889634
LN2 = gl.constexpr(0.6931471805599453)


@gluon.jit
def _load_kv_tile(k_ptr, v_ptr, k_buf, v_buf, tile_start, end, stride_kt, stride_vt,
                  BLOCK_N: gl.constexpr, D: gl.constexpr, LOAD: gl.constexpr):
    """cp.async keys and values [tile_start, tile_start + BLOCK_N) of one KV head into a ring slot,
    zeros past `end`, as one commit group (issued even when empty, so the groups count tiles)."""
    offs_n = tile_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LOAD))
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, LOAD))
    mask = (offs_n[:, None] < end) & (offs_d[None, :] < D)
    cp.async_copy_global_to_shared(k_buf, k_ptr + offs_n[:, None] * stride_kt + offs_d[None, :], mask=mask)
    cp.async_copy_global_to_shared(v_buf, v_ptr + offs_n[:, None] * stride_vt + offs_d[None, :], mask=mask)
    cp.commit_group()


@gluon.jit
def _softmax_tile(s, m_i, l_i, tile_start, end, qk_scale, BLOCK_N: gl.constexpr, QK: gl.constexpr,
                  MASKED: gl.constexpr):
    """Online softmax of one score tile s [BLOCK_M, BLOCK_N] (float32, QK layout) in base 2:
    -> (p, new running max, new running sum, alpha = how much the old sums shrink). MASKED: keys
    from `end` on count for nothing (only a split's last tile needs it)."""
    s = s * qk_scale
    if MASKED:
        offs_n = tile_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, QK))
        s = gl.where(offs_n[None, :] < end, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: exp2(-inf) = 0
    p = gl.exp2(s - m_safe[:, None])
    alpha = gl.exp2(m_i - m_safe)
    l_new = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_new, alpha


@gluon.jit
def _prefix_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, prefix_ptr,
                   n_tokens, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                   keys_per_split, qk_scale,
                   GROUP: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   STAGES: gl.constexpr, Q_SMEM: gl.constexpr, KV_SMEM: gl.constexpr, num_warps: gl.constexpr):
    pid_m = gl.program_id(0)
    head = gl.program_id(1)
    split = gl.program_id(2)
    kv_heads = gl.num_programs(1)
    rows = n_tokens * GROUP
    dtype: gl.constexpr = q_ptr.dtype.element_ty

    QK: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                 instr_shape=[16, BLOCK_N, 16])
    PV: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                 instr_shape=[16, D, 16])
    P_OPERAND: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=PV, k_width=2)
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (D // 8), D // 8], [num_warps, 1], [1, 0])  # 16-byte copies

    start = split * keys_per_split
    end = gl.minimum(start + keys_per_split, gl.load(prefix_ptr))
    n_tiles = gl.maximum(gl.cdiv(end - start, BLOCK_N), 1)  # one (empty) tile for a split past P
    k_head = k_ptr + head * stride_kh
    v_head = v_ptr + head * stride_vh

    # This block's query rows -> shared memory, the A operand of every q.k product.
    offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LOAD))
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, LOAD))
    q_rows = (offs_m // GROUP) * stride_qt + (head * GROUP + offs_m % GROUP) * stride_qh
    q = gl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=(offs_m[:, None] < rows) & (offs_d[None, :] < D),
                other=0.0)
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, D], Q_SMEM, q)
    k_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], KV_SMEM)
    v_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], KV_SMEM)

    # The ring's first STAGES - 1 tiles.
    for i in gl.static_range(STAGES - 1):
        _load_kv_tile(k_head, v_head, k_ring.index(i), v_ring.index(i), start + i * BLOCK_N, end,
                      stride_kt, stride_vt, BLOCK_N, D, LOAD)

    # Tile 0: q.k and its softmax; its p.v is issued with tile 1's q.k.
    cp.wait_group(STAGES - 2)
    gl.thread_barrier()
    fence_async_shared()
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, QK)
    s = warpgroup_mma(q_smem, k_ring.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s, ))
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, QK))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, QK))
    p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, start, end, qk_scale, BLOCK_N, QK, True)
    p_prev = gl.convert_layout(p.to(dtype), P_OPERAND)
    acc = gl.zeros([BLOCK_M, D], gl.float32, PV)
    _load_kv_tile(k_head, v_head, k_ring.index(STAGES - 1), v_ring.index(STAGES - 1),
                  start + (STAGES - 1) * BLOCK_N, end, stride_kt, stride_vt, BLOCK_N, D, LOAD)

    for j in range(1, n_tiles):
        slot = j % STAGES
        prev = (j - 1) % STAGES
        cp.wait_group(STAGES - 2)  # tile j has landed (this thread's copies) ...
        gl.thread_barrier()  # ... and every thread's
        fence_async_shared()
        # q.k of tile j, then p.v of tile j - 1, both in flight; the first to finish is q.k.
        s_token = warpgroup_mma(q_smem, k_ring.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        acc_token = warpgroup_mma(p_prev, v_ring.index(prev), acc, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s_token, ))
        # This tile's softmax while p.v of the last one runs on the tensor cores; only a split's
        # last tile masks its keys (the rest are whole: no compare and select per score).
        tile_start = start + j * BLOCK_N
        if tile_start + BLOCK_N <= end:
            p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, tile_start, end, qk_scale, BLOCK_N, QK, False)
        else:
            p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, tile_start, end, qk_scale, BLOCK_N, QK, True)
        # p_prev is p.v's A operand in registers: kept alive until the product retires.
        acc, p_prev = warpgroup_mma_wait(0, deps=(acc_token, p_prev))
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, PV))[:, None]
        p_prev = gl.convert_layout(p.to(dtype), P_OPERAND)
        # Slot `prev` is free once both warp groups' p.v of tile j - 1 have finished.
        gl.thread_barrier()
        _load_kv_tile(k_head, v_head, k_ring.index(prev), v_ring.index(prev), start + (j + STAGES - 1) * BLOCK_N,
                      end, stride_kt, stride_vt, BLOCK_N, D, LOAD)

    last = (n_tiles - 1) % STAGES
    acc = warpgroup_mma(p_prev, v_ring.index(last), acc, is_async=True)
    acc, p_prev = warpgroup_mma_wait(0, deps=(acc, p_prev))
    cp.wait_group(0)

    l_pv = gl.convert_layout(l_i, gl.SliceLayout(1, PV))
    out = acc * gl.where(l_pv > 0.0, 1.0 / l_pv, 0.0)[:, None]
    rows_pv = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, PV))
    dims_pv = gl.arange(0, D, layout=gl.SliceLayout(0, PV))
    base = (split * kv_heads + head) * rows
    gl.store(o_ptr + (base + rows_pv[:, None]) * D + dims_pv[None, :], out.to(dtype),
             mask=(rows_pv[:, None] < rows) & (dims_pv[None, :] < D))
    lse = gl.where(l_i > 0.0, (m_i + gl.log2(l_i)) * LN2, float("-inf"))
    rows_qk = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, QK))
    gl.store(lse_ptr + base + rows_qk, lse, mask=rows_qk < rows)


def tiling(head_dim: int) -> dict:
    """BLOCK_M, BLOCK_N, STAGES and warps by head dim: 128 query rows in two warp groups; at head_dim
    256 two stages of 64 keys (Q 64 KB + K and V 128 KB of shared memory), else three."""
    return {"BLOCK_M": 128, "BLOCK_N": 64, "STAGES": 2 if head_dim > 128 else 3, "num_warps": 8}


def plan_splits(programs: int, sms: int, max_keys: int, max_splits: int = 16, min_keys: int = 512) -> int:
    """Key splits for `programs` (row blocks x KV heads) at one program an SM: the count whose waves
    waste the least, ceil(programs x s / sms) / s at its least (ties: fewer splits, fewer partials
    to merge: the fewest within 3% of the least), each split at least `min_keys` keys. E.g. 72
    programs on 132 SMs: 11 splits, 792 programs in 6 whole waves; 24 programs: 11 (264, 2 waves)."""
    counts = range(1, max(1, min(max_splits, max_keys // min_keys)) + 1)
    cost = {splits: -(-programs * splits // sms) / splits for splits in counts}
    least = min(cost.values())
    return min(splits for splits in counts if cost[splits] <= least * 1.03)


def shared_layouts(head_dim: int, dtype: torch.dtype, block_m: int, block_n: int):
    """The NVMMA shared layouts of the query tile and the key / value tiles (wgmma operands)."""
    gl_dtype = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return (gl.NVMMASharedLayout.get_default_for([block_m, head_dim], gl_dtype),
            gl.NVMMASharedLayout.get_default_for([block_n, head_dim], gl_dtype))


def prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: torch.Tensor, max_keys: int,
                     splits: int, scale: float, config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [N, Hq, D] over keys [0, prefix_len) of k, v [T, Hkv, D] (prefix_len: an int32
    device scalar, at most `max_keys`, the static bound the splits are planned over) -> (o, lse) as in
    the module docstring. bf16 / fp16 on sm_90; the last dim of q, k, v contiguous. `config`
    overrides `tiling`'s entries (for benchmarks)."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    if q.dtype not in (torch.bfloat16, torch.float16) or d not in (64, 128, 256) or hq % hkv:
        raise ValueError(f"prefix_attention takes bf16/fp16 with head_dim 64, 128 or 256, got {q.dtype}, {d}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("prefix_attention needs a unit stride on the head dim")
    if any(x.stride(i) % 8 for x in (q, k, v) for i in range(x.dim() - 1)):
        raise ValueError("prefix_attention's 16-byte copies need strides that are multiples of 8 elements")
    if prefix_len.dtype != torch.int32:
        prefix_len = prefix_len.to(torch.int32)  # a device copy: graph-safe, the value read at replay
    t = tiling(d) | (config or {})
    keys_per_split = triton.cdiv(triton.cdiv(max_keys, splits), t["BLOCK_N"]) * t["BLOCK_N"]
    rows = n * group
    o = torch.empty(splits, hkv, rows, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(splits, hkv, rows, dtype=torch.float32, device=q.device)
    q_smem, kv_smem = shared_layouts(d, q.dtype, t["BLOCK_M"], t["BLOCK_N"])
    grid = (triton.cdiv(rows, t["BLOCK_M"]), hkv, splits)
    _prefix_kernel[grid](q, k, v, o, lse, prefix_len, n, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                         v.stride(0), v.stride(1), keys_per_split, scale * LOG2E,
                         GROUP=group, D=d, BLOCK_M=t["BLOCK_M"], BLOCK_N=t["BLOCK_N"], STAGES=t["STAGES"],
                         Q_SMEM=q_smem, KV_SMEM=kv_smem, num_warps=t["num_warps"])
    return o, lse


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, max_keys: int, splits: int,
              scale: float, block_n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """`prefix_attention` in float64 with PyTorch, split for split (for tests)."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    rows = n * group
    qf = q.double().view(n, hkv, group, d).permute(1, 0, 2, 3).reshape(hkv, rows, d)
    keys_per_split = -(-(-(-max_keys // splits)) // block_n) * block_n
    o = torch.zeros(splits, hkv, rows, d, dtype=torch.float64, device=q.device)
    lse = torch.full((splits, hkv, rows), -math.inf, dtype=torch.float64, device=q.device)
    for s in range(splits):
        lo, hi = s * keys_per_split, min((s + 1) * keys_per_split, prefix)
        if hi <= lo:
            continue
        kk = k[lo:hi].double().permute(1, 0, 2)
        vv = v[lo:hi].double().permute(1, 0, 2)
        logits = qf @ kk.transpose(1, 2) * scale
        lse[s] = torch.logsumexp(logits, -1)
        o[s] = torch.softmax(logits, -1) @ vv
    return o, lse
