"""The unmasked prefix of a verify's attention on Hopper (sm_90), and with it the tree's own block,
written in Gluon: N query tokens over keys [0, P) of the KV cache, P a device scalar, split over the
keys, with the work of a program divided among partitions of warps as FlashAttention-3 does.

Why: over long contexts the tree attention is nearly all prefix (every row sees every key). The
Triton kernel runs the prefix loop's two products near the matmul rate, but its softmax does not
overlap them and its loads are issued by the same warps (benchmarks/README.md, "A prefix kernel
in FlashAttention-3's form"). Here:

- a loader warp copies key and value tiles with TMA into rings of STAGES shared-memory slots,
  signalling `ready` barriers as tiles land and waiting on `empty` barriers for slots to reuse;
- one or two consumer warp groups of 64 query rows each run q.k, the online softmax and p.v in
  FlashAttention-3's order within a warp group (q.k of tile j issued before p.v of tile j - 1; this
  tile's softmax while p.v runs: `warpgroup_mma(is_async=True)` / `warpgroup_mma_wait`, which
  Triton's `tl.dot` does not expose), releasing each slot as its product retires. With two, a
  program's 128 rows read each key tile once; the warp groups are not in lockstep (no barrier
  between them), so one's softmax runs while the other's products hold the tensor cores. A warp
  group with no real row (the last row block's second, e.g. at 65 tokens x 6 heads) does nothing
  and its partner releases each slot for both (`SKIP_IDLE`, a tiling entry, on unless set False);
- with two consumers, the rows past the last whole 128-row block, where they are at most 16
  (`tail_rows`: 65 tokens x 4 query heads leave 4 of 260, x 6 at head_dim 256 6 of 390), go to a fourth
  partition instead of a row block of their own: a tail warp group, its products transposed
  (s^T = k . q^T, o^T += v^T . p^T) so that those few rows are the MMA's N (8 or 16) and not 64
  rows of padding (a row block of 4 real rows had cost as much as a whole one, a third of the
  programs at 65 tokens). Each row-block program's tail warp group takes its share of the split's
  key tiles, and the last of a KV head's programs to finish merges their partials (`_tail`). At
  head_dim 256 the consumers' p.v then runs as two products over the head dim's halves (`_attend`'s
  HALVES: one of N = 256 needs more registers at once than four warp groups leave a thread).

Given the tree's mask (`block`), the first split's programs go on over the tree's own keys
[P, P + M), each row seeing those its token's mask allows, so that the splits' merge is the
verify's whole attention and no other kernel reads the block (the Triton kernel's launch over it
cost more than its few products: benchmarks/README.md, "The tree's block in the prefix kernel").

Rows are (token, query head of the KV head's group) pairs, row = token * group + g, as in
`tree_attention`; grid (row blocks, KV heads, splits). Splits are planned over a static bound on P
and read P on the device, so one CUDA graph serves every committed length; the first split gives
up as many prefix keys as the block's columns take (`split_keys`), so that its programs end with
the others'.

The kernel is a programmatic dependent launch (`PDL`): its programs start while the launch before
it (the layer's KV write, which signals for it) ends, and its loader copies the prefix's first
tiles meanwhile; every partition waits for that launch's end (`_inputs_ready`) before it reads the
queries or the block's keys, or writes anything. So P, which the loader reads at once, must not be
written by the launch just before (the engine's is written by the previous round).

TMA reads whole tiles: keys past P up to the cache's end are read and masked (their scores count for
nothing), so the cache past P must hold finite values (the engine's cache is zero-initialised and
then holds real keys and values); rows past the cache's end read as zeros. The key and value caches
are [T, Hkv, D] with the last two dims contiguous (one 2-D TMA view [T, Hkv * D]).

Output, as `attention_libraries.cudnn_prefix` gives it, for the combine launch to merge with the rest of
the attention: o [splits, Hkv, N * group, D] in q's dtype, each split's normalised output; lse
[splits, Hkv, N * group] float32, the natural log of each row's softmax denominator over its split
(scale applied), -inf for a split with no keys (its o is 0).
"""
from __future__ import annotations

import math
import os

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

LOG2E = 1.4426950408889634
LN2 = gl.constexpr(0.6931471805599453)
SPLIT_KEYS = 128  # splits are multiples of this many keys, a whole number of tiles at every BLOCK_N
# Launched as a programmatic dependent launch (its programs start while the launch before it ends:
# `_inputs_ready`); DDTREE_PDL=0 (or a config's "PDL": False) launches it after that one has ended.
PDL = os.environ.get("DDTREE_PDL", "1") == "1"
TAIL_256_MAX_BLOCKS = 4  # whole row blocks up to which head_dim 256 takes the tail warp group (`tail_rows`)
TAIL_REGS_NEEDED = 56  # the tail warp group's registers (its tiles are [BLOCK_N or D, 8 or 16] float32)


@gluon.jit
def _softmax_tile(s, m_i, l_i, qk_scale):
    """Online softmax of one raw score tile s [BLOCK_M, BLOCK_N] (float32, -inf where a key counts
    for nothing) in base 2: -> (p, new running max, new running sum, alpha = how much the old sums
    shrink). The running max is kept scaled (qk_scale > 0, so max(s) * qk_scale is the scaled
    tile's max), which makes each score's exponent one fused multiply-add."""
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: exp2(-inf) = 0
    p = gl.exp2(s * qk_scale - m_safe[:, None])
    alpha = gl.exp2(m_i - m_safe)
    l_new = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_new, alpha


@gluon.jit
def _keys_before(s, tile_start, end, BLOCK_N: gl.constexpr, QK: gl.constexpr):
    """s with the keys of the tile at tile_start from `end` on at -inf (a split's last tile)."""
    offs_n = tile_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, QK))
    return gl.where(offs_n[None, :] < end, s, float("-inf"))


@gluon.jit
def _block_seen(s, col0, block_cols, mask_ptr, mask_stride, row0, rows, GROUP: gl.constexpr,
                BLOCK_N: gl.constexpr, QK: gl.constexpr):
    """s with the block's columns [col0, col0 + BLOCK_N) at -inf where the row's token does not
    see them (mask [N, block_cols], uint8, token t sees block key j where mask[t, j]) or past the
    block."""
    cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, QK))
    rws = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, QK))
    seen = gl.load(mask_ptr + (rws // GROUP)[:, None] * mask_stride + cols[None, :],
                   mask=(rws[:, None] < rows) & (cols[None, :] < block_cols), other=0)
    return gl.where(seen != 0, s, float("-inf"))


@gluon.jit
def _loader(k_desc, v_desc, k_ring, v_ring, k_ready, k_empty, v_ready, v_empty, start, n_tiles, prefix, n_block,
            column, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Key tile i, then value tile i, for the split's n_tiles from `start` and then the block's
    n_block from `prefix`, each into slot i % STAGES of its ring once the consumers have released
    the slot's previous tile. The prefix's tiles were written by earlier rounds, so they are copied
    before the launch before this one has finished (`_inputs_ready`); the block's are this round's."""
    for i in range(n_tiles):
        _load_tile(k_desc, v_desc, k_ring, v_ring, k_ready, k_empty, v_ready, v_empty, i, start + i * BLOCK_N,
                   column, STAGES)
    _inputs_ready()
    for i in range(n_tiles, n_tiles + n_block):
        _load_tile(k_desc, v_desc, k_ring, v_ring, k_ready, k_empty, v_ready, v_empty, i,
                   prefix + (i - n_tiles) * BLOCK_N, column, STAGES)


@gluon.jit
def _load_tile(k_desc, v_desc, k_ring, v_ring, k_ready, k_empty, v_ready, v_empty, i, key, column,
               STAGES: gl.constexpr):
    """Keys and values [key, key + BLOCK_N) of the KV head at `column` -> slot i % STAGES."""
    slot = i % STAGES
    phase = (i // STAGES) & 1
    # A fresh barrier counts as having completed the phase before phase 0: the first STAGES waits
    # (on phase 1) pass at once.
    mbarrier.wait(k_empty.index(slot), phase ^ 1)
    mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [key, column], k_ready.index(slot), k_ring.index(slot))
    mbarrier.wait(v_empty.index(slot), phase ^ 1)
    mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(v_desc, [key, column], v_ready.index(slot), v_ring.index(slot))


@gluon.jit
def _dependents_may_start():
    """Let the next launch, where it is a programmatic dependent one (the combine launch after this
    kernel), start its programs while this one ends instead of after it (griddepcontrol.launch_dependents;
    they wait for this launch's end before they read anything)."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def _inputs_ready():
    """Wait until the launch before this one has finished and its writes are visible
    (griddepcontrol.wait; at once where this launch is not a programmatic dependent one). The kernel
    is launched as one (`PDL`) so that its programs start, and its loader copies the prefix's first
    tiles, while that launch (the layer's KV write) ends: every partition waits here before it reads
    what that launch writes (the queries, the block's keys and values) or writes anything itself."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _stage_rows(q_ptr, q_smem, row0, rows, head, stride_qt, stride_qh, GROUP: gl.constexpr, D: gl.constexpr,
                ROWS: gl.constexpr):
    """Query rows [row0, row0 + ROWS) of KV head `head` (zeros past `rows`) -> q_smem [ROWS, D], an
    MMA operand: 16-byte loads, then the fence that orders those stores before wgmma reads them."""
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (D // 8), D // 8], [4, 1], [1, 0])
    offs_m = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, LOAD))
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, LOAD))
    q_rows = (offs_m // GROUP) * stride_qt + (head * GROUP + offs_m % GROUP) * stride_qh
    q = gl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=(offs_m[:, None] < rows) & (offs_d[None, :] < D),
                other=0.0)
    q_smem.store(q)
    fence_async_shared()


@gluon.jit
def _consumer(q_ptr, o_ptr, lse_ptr, q_smem, k_ring, v_ring, k_ready, k_empty, v_ready, v_empty, row0, rows, head,
              base, stride_qt, stride_qh, start, end, n_tiles, n_block, block_cols, mask_ptr, mask_stride, qk_scale,
              idle, partner_idle, GROUP: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, HALVES: gl.constexpr):
    """One warp group's 64 query rows [row0, row0 + 64), or nothing where `idle` (the last row
    block's second warp group with no real row: its partner then releases each slot for it, and
    runs its products with the tensor cores to itself)."""
    if idle == 0:
        _attend(q_ptr, o_ptr, lse_ptr, q_smem, k_ring, v_ring, k_ready, k_empty, v_ready, v_empty, row0, rows, head,
                base, stride_qt, stride_qh, start, end, n_tiles, n_block, block_cols, mask_ptr, mask_stride, qk_scale,
                partner_idle, GROUP, D, BLOCK_N, STAGES, HALVES)


@gluon.jit
def _attend(q_ptr, o_ptr, lse_ptr, q_smem, k_ring, v_ring, k_ready, k_empty, v_ready, v_empty, row0, rows, head,
            base, stride_qt, stride_qh, start, end, n_tiles, n_block, block_cols, mask_ptr, mask_stride, qk_scale,
            partner_idle, GROUP: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
            HALVES: gl.constexpr):
    """The rows [row0, row0 + 64) over the split's keys [start, end), then over the block's n_block
    tiles of columns (none but in the first split). Each slot's release counts for both warp groups
    where the partner is idle (partner_idle), so the loader never waits on it.

    HALVES 2: p.v as two products over the two halves of the head dim (acc and acc_hi, each [64,
    D / 2]). At head_dim 256 one m64n256 product needs 158 registers of a thread at once, more than
    the 128 a launch of four warp groups (a tail warp group's) leaves each; two of N = 128 fit."""
    BLOCK_M: gl.constexpr = 64
    DH: gl.constexpr = D // HALVES
    release_twice = partner_idle != 0
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    QK: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    PV: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DH, 16])
    P_OPERAND: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=PV, k_width=2)

    _inputs_ready()
    # This warp group's query rows -> its slice of shared memory, the A operand of every q.k.
    _stage_rows(q_ptr, q_smem, row0, rows, head, stride_qt, stride_qh, GROUP, D, BLOCK_M)

    # Tile 0: q.k and its softmax; its p.v is issued with tile 1's q.k.
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, QK)
    mbarrier.wait(k_ready.index(0), 0)
    s = warpgroup_mma(q_smem, k_ring.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s, ))
    mbarrier.arrive(k_empty.index(0), count=1)
    mbarrier.arrive(k_empty.index(0), count=1, pred=release_twice)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, QK))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, QK))
    p, m_i, l_i, alpha = _softmax_tile(_keys_before(s, start, end, BLOCK_N, QK), m_i, l_i, qk_scale)
    p_prev = gl.convert_layout(p.to(dtype), P_OPERAND)
    acc = gl.zeros([BLOCK_M, DH], gl.float32, PV)
    if HALVES == 2:
        acc_hi = gl.zeros([BLOCK_M, DH], gl.float32, PV)

    for j in range(1, n_tiles + n_block):
        slot = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
        s_token = warpgroup_mma(q_smem, k_ring.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
        if HALVES == 1:
            acc_token = warpgroup_mma(p_prev, v_ring.index(prev), acc, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s_token, ))
        else:
            acc_token = warpgroup_mma(p_prev, v_ring.index(prev).slice(0, DH, dim=1), acc, is_async=True)
            hi_token = warpgroup_mma(p_prev, v_ring.index(prev).slice(DH, DH, dim=1), acc_hi, is_async=True)
            s = warpgroup_mma_wait(2, deps=(s_token, ))
        mbarrier.arrive(k_empty.index(slot), count=1)  # q.k of tile j has read its keys
        mbarrier.arrive(k_empty.index(slot), count=1, pred=release_twice)
        tile_start = start + j * BLOCK_N
        if j >= n_tiles:  # the block's columns, seen through the tree's mask
            s = _block_seen(s, (j - n_tiles) * BLOCK_N, block_cols, mask_ptr, mask_stride, row0, rows, GROUP,
                            BLOCK_N, QK)
        elif tile_start + BLOCK_N > end:
            s = _keys_before(s, tile_start, end, BLOCK_N, QK)
        p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, qk_scale)
        if HALVES == 1:
            acc, p_prev = warpgroup_mma_wait(0, deps=(acc_token, p_prev))
        else:
            acc, acc_hi, p_prev = warpgroup_mma_wait(0, deps=(acc_token, hi_token, p_prev))
        mbarrier.arrive(v_empty.index(prev), count=1)  # p.v of tile j - 1 has read its values
        mbarrier.arrive(v_empty.index(prev), count=1, pred=release_twice)
        alpha_pv = gl.convert_layout(alpha, gl.SliceLayout(1, PV))
        acc = acc * alpha_pv[:, None]
        if HALVES == 2:
            acc_hi = acc_hi * alpha_pv[:, None]
        p_prev = gl.convert_layout(p.to(dtype), P_OPERAND)

    last = (n_tiles + n_block - 1) % STAGES
    mbarrier.wait(v_ready.index(last), ((n_tiles + n_block - 1) // STAGES) & 1)
    if HALVES == 1:
        acc = warpgroup_mma(p_prev, v_ring.index(last), acc, is_async=True)
        acc, p_prev = warpgroup_mma_wait(0, deps=(acc, p_prev))
    else:
        acc = warpgroup_mma(p_prev, v_ring.index(last).slice(0, DH, dim=1), acc, is_async=True)
        acc_hi = warpgroup_mma(p_prev, v_ring.index(last).slice(DH, DH, dim=1), acc_hi, is_async=True)
        acc, acc_hi, p_prev = warpgroup_mma_wait(0, deps=(acc, acc_hi, p_prev))

    l_pv = gl.convert_layout(l_i, gl.SliceLayout(1, PV))
    norm = gl.where(l_pv > 0.0, 1.0 / l_pv, 0.0)[:, None]
    rows_pv = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, PV))
    dims_pv = gl.arange(0, DH, layout=gl.SliceLayout(0, PV))
    at = o_ptr + (base + rows_pv[:, None]) * D + dims_pv[None, :]
    gl.store(at, (acc * norm).to(dtype), mask=rows_pv[:, None] < rows)
    if HALVES == 2:
        gl.store(at + DH, (acc_hi * norm).to(dtype), mask=rows_pv[:, None] < rows)
    lse = gl.where(l_i > 0.0, (m_i + gl.log2(l_i)) * LN2, float("-inf"))
    rows_qk = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, QK))
    gl.store(lse_ptr + base + rows_qk, lse, mask=rows_qk < rows)


@gluon.jit
def _release(k_ready, k_empty, v_ready, v_empty, lo, hi, STAGES: gl.constexpr):
    """Release the slots of tiles [lo, hi) as they land, reading nothing."""
    for j in range(lo, hi):
        slot = j % STAGES
        phase = (j // STAGES) & 1
        mbarrier.wait(k_ready.index(slot), phase)
        mbarrier.arrive(k_empty.index(slot), count=1)
        mbarrier.wait(v_ready.index(slot), phase)
        mbarrier.arrive(v_empty.index(slot), count=1)


@gluon.jit
def _tail(q_ptr, o_ptr, lse_ptr, qt_smem, pt_smem, k_ring, v_ring, k_ready, k_empty, v_ready, v_empty, part_o_ptr,
          part_ml_ptr, count_ptr, row0, rows, head, base, stride_qt, stride_qh, start, end, n_tiles, n_block,
          block_cols, mask_ptr, mask_stride, qk_scale, GROUP: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr,
          STAGES: gl.constexpr, TAIL: gl.constexpr):
    """The tail warp group: the rows [row0, rows) past the last whole 128-row block (at most TAIL).

    The split's tiles are shared out: each of the KV head's row-block programs takes a run of them
    for the tail ([lo, hi)) and releases the others' slots unread; each writes its unnormalised
    partial (o^T, the running maximum, the sum) to part_o / part_ml, and the last of them to arrive
    (count_ptr, one counter per KV head, split and batch row, left at zero for the next launch)
    merges them into the split's output. The tail costs its programs about as much however its
    tiles are shared (H200, 65 tokens, 8B heads over 32k keys, against 59.9 us at 64 tokens, which
    have no tail: all of a split's tiles in one program 70.6 us, runs 71.5-71.8, every other tile
    in turn 71.9; benchmarks/README.md, "The 65th token's cost")."""
    _inputs_ready()
    parts = gl.num_programs(0)
    pid_m = gl.program_id(0)
    total = n_tiles + n_block
    per = gl.cdiv(total, parts)
    lo = gl.minimum(pid_m * per, total)
    hi = gl.minimum(lo + per, total)
    _release(k_ready, k_empty, v_ready, v_empty, 0, lo, STAGES)
    ST: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, TAIL, 16])
    if lo < hi:
        acc, m_i, l_i = _attend_tail(q_ptr, qt_smem, pt_smem, k_ring, v_ring, k_ready, k_empty, v_ready, v_empty, lo,
                                     hi, row0, rows, head, stride_qt, stride_qh, start, end, n_tiles, block_cols,
                                     mask_ptr, mask_stride, qk_scale, GROUP, D, BLOCK_N, STAGES, TAIL)
    else:  # no tile of its own (a split of fewer tiles than programs): an empty partial
        acc = gl.zeros([D, TAIL], gl.float32, ST)
        m_i = gl.full([TAIL], float("-inf"), gl.float32, gl.SliceLayout(0, ST))
        l_i = gl.zeros([TAIL], gl.float32, gl.SliceLayout(0, ST))
    _release(k_ready, k_empty, v_ready, v_empty, hi, total, STAGES)

    # This program's partial, then the arrival count; the last to arrive merges them all.
    group = gl.program_id(2) * gl.num_programs(1) + head  # (split, batch row, KV head)
    entries = gl.arange(0, TAIL, layout=gl.SliceLayout(0, ST))
    dims = gl.arange(0, D, layout=gl.SliceLayout(1, ST))
    at = (group * parts + pid_m) * TAIL + entries
    gl.store(part_o_ptr + at[None, :] * D + dims[:, None], acc)
    gl.store(part_ml_ptr + at * 2, m_i)
    gl.store(part_ml_ptr + at * 2 + 1, l_i)
    # Every thread's stores are issued before one thread releases them with the arrival count (a
    # barrier of this warp group, then a GPU-scope acquire-release atomic: a semaphore).
    gl.thread_barrier()
    arrived = gl.atomic_add(count_ptr + group, 1, sem="acq_rel", scope="gpu")
    if arrived == parts - 1:
        gl.store(count_ptr + group, 0)  # zero again for the next launch
        first = group * parts * TAIL + entries
        m_all = gl.full([TAIL], float("-inf"), gl.float32, gl.SliceLayout(0, ST))
        for p in range(parts):
            m_all = gl.maximum(m_all, gl.load(part_ml_ptr + (first + p * TAIL) * 2, cache_modifier=".cg"))
        m_safe = gl.where(m_all == float("-inf"), 0.0, m_all)
        o = gl.zeros([D, TAIL], gl.float32, ST)
        total_sum = gl.zeros([TAIL], gl.float32, gl.SliceLayout(0, ST))
        for p in range(parts):
            at_p = first + p * TAIL
            w = gl.exp2(gl.load(part_ml_ptr + at_p * 2, cache_modifier=".cg") - m_safe)  # 0: empty
            total_sum += w * gl.load(part_ml_ptr + at_p * 2 + 1, cache_modifier=".cg")
            o += w[None, :] * gl.load(part_o_ptr + at_p[None, :] * D + dims[:, None], cache_modifier=".cg")
        rws = row0 + entries
        out = o * gl.where(total_sum > 0.0, 1.0 / total_sum, 0.0)[None, :]
        gl.store(o_ptr + (base + rws[None, :]) * D + dims[:, None], out.to(q_ptr.dtype.element_ty),
                 mask=(rws[None, :] < rows) & (dims[:, None] < D))
        lse = gl.where(total_sum > 0.0, (m_all + gl.log2(total_sum)) * LN2, float("-inf"))
        gl.store(lse_ptr + base + rws, lse, mask=rws < rows)


@gluon.jit
def _tail_seen(s, j, n_tiles, start, end, block_cols, mask_ptr, mask_stride, rws, rows, GROUP: gl.constexpr,
               BLOCK_N: gl.constexpr, ST: gl.constexpr):
    """s^T [BLOCK_N, TAIL] of tile j with the keys a row does not see at -inf: past the split's end,
    or in the block's columns (tiles from n_tiles on) where the row's token's mask says so."""
    keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ST))
    if j >= n_tiles:
        cols = (j - n_tiles) * BLOCK_N + keys
        seen = gl.load(mask_ptr + (rws // GROUP)[None, :] * mask_stride + cols[:, None],
                       mask=(rws[None, :] < rows) & (cols[:, None] < block_cols), other=0)
        s = gl.where(seen != 0, s, float("-inf"))
    else:
        s = gl.where((start + j * BLOCK_N + keys)[:, None] < end, s, float("-inf"))
    return s


@gluon.jit
def _attend_tail(q_ptr, qt_smem, pt_smem, k_ring, v_ring, k_ready, k_empty, v_ready, v_empty, lo, hi, row0, rows,
                 head, stride_qt, stride_qh, start, end, n_tiles, block_cols, mask_ptr, mask_stride, qk_scale,
                 GROUP: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                 TAIL: gl.constexpr):
    """Rows [row0, row0 + TAIL) (those below `rows` real) over tiles [lo, hi) of the split's keys
    and, in the first split, the block's columns (tiles from n_tiles on), with every product
    transposed so that the few rows are the MMA's N (a multiple of 8) instead of 64 rows of which
    most are padding: s^T [BLOCK_N, TAIL] = k . q^T, the softmax down each column, o^T [D, TAIL] +=
    v^T . p^T (v^T read from its slot as is, p^T through shared memory). As the consumers do, tile
    j's k . q^T is issued before tile j - 1's v^T . p^T and its softmax runs while that product
    does; the softmax's sums are kept per entry and added down the columns once at the end (one
    cross-warp reduction a tile, the maximum). Releases the slots of [lo, hi); -> (o^T unnormalised
    [D, TAIL], running maximum (scaled, base 2) [TAIL], softmax sum [TAIL])."""
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    ST: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, TAIL, 16])

    _stage_rows(q_ptr, qt_smem, row0, rows, head, stride_qt, stride_qh, GROUP, D, TAIL)  # q [TAIL, D], as the B^T
    rws = row0 + gl.arange(0, TAIL, layout=gl.SliceLayout(0, ST))

    # Tile lo: k . q^T and its softmax; its v^T . p^T is issued with tile lo + 1's k . q^T.
    s_zero = gl.zeros([BLOCK_N, TAIL], gl.float32, ST)
    first = lo % STAGES
    mbarrier.wait(k_ready.index(first), (lo // STAGES) & 1)
    s = warpgroup_mma(k_ring.index(first), qt_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s, ))
    mbarrier.arrive(k_empty.index(first), count=1)
    s = _tail_seen(s, lo, n_tiles, start, end, block_cols, mask_ptr, mask_stride, rws, rows, GROUP, BLOCK_N, ST)
    m_i = gl.max(s, axis=0) * qk_scale
    p = gl.exp2(s * qk_scale - gl.where(m_i == float("-inf"), 0.0, m_i)[None, :])
    sums = p  # [BLOCK_N, TAIL]: each entry's share of its column's softmax denominator
    pt_smem.store(gl.permute(p.to(dtype), [1, 0]))
    fence_async_shared()
    acc = gl.zeros([D, TAIL], gl.float32, ST)

    for j in range(lo + 1, hi):
        slot = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
        s_token = warpgroup_mma(k_ring.index(slot), qt_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
        acc_token = warpgroup_mma(v_ring.index(prev).permute((1, 0)), pt_smem.permute((1, 0)), acc, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s_token, ))
        mbarrier.arrive(k_empty.index(slot), count=1)
        s = _tail_seen(s, j, n_tiles, start, end, block_cols, mask_ptr, mask_stride, rws, rows, GROUP, BLOCK_N, ST)
        m_new = gl.maximum(m_i, gl.max(s, axis=0) * qk_scale)
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s * qk_scale - m_safe[None, :])
        alpha = gl.exp2(m_i - m_safe)
        sums = sums * alpha[None, :] + p
        m_i = m_new
        acc = warpgroup_mma_wait(0, deps=(acc_token, ))
        mbarrier.arrive(v_empty.index(prev), count=1)  # v^T . p^T of tile j - 1 has read its values
        acc = acc * alpha[None, :]
        pt_smem.store(gl.permute(p.to(dtype), [1, 0]))  # that product has read p^T too
        fence_async_shared()

    last = (hi - 1) % STAGES
    mbarrier.wait(v_ready.index(last), ((hi - 1) // STAGES) & 1)
    acc = warpgroup_mma(v_ring.index(last).permute((1, 0)), pt_smem.permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    mbarrier.arrive(v_empty.index(last), count=1)  # the tiles past hi need the slot
    return acc, m_i, gl.sum(sums, axis=0)


@gluon.jit
def _prefix_kernel(q_ptr, k_desc, v_desc, o_ptr, lse_ptr, prefix_ptr, first_ptr, mask_ptr, part_o_ptr, part_ml_ptr,
                   count_ptr, n_tokens, batch, stride_qt, stride_qh, keys_per_split, lead, block_cols, mask_stride,
                   qk_scale, full_rows, GROUP: gl.constexpr, D: gl.constexpr, CONSUMERS: gl.constexpr,
                   SKIP_IDLE: gl.constexpr, TAIL: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                   Q_SMEM: gl.constexpr, CONSUMER_REGS: gl.constexpr, TAIL_REGS: gl.constexpr, BATCHED: gl.constexpr,
                   num_warps: gl.constexpr):
    pid_m = gl.program_id(0)
    head = gl.program_id(1)
    rows = n_tokens * GROUP
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    if BATCHED:  # grid axis 2: (split, batch row); the row's queries, mask, prefix and first cache slot
        r = gl.program_id(2) % batch
        split = gl.program_id(2) // batch
        prefix = gl.load(prefix_ptr + r).to(gl.int32)
        slot0 = gl.load(first_ptr + r).to(gl.int32)
        q_ptr = q_ptr + r * n_tokens * stride_qt
        mask_ptr = mask_ptr + r * n_tokens * mask_stride
    else:
        r = 0
        split = gl.program_id(2)
        prefix = gl.load(prefix_ptr).to(gl.int32)  # int64 as the engine keeps it: no conversion launch a layer
        slot0 = 0
    _dependents_may_start()
    # Split s takes prefix keys [s * keys_per_split - lead, (s + 1) * keys_per_split - lead) (`split_keys`):
    # the first split's programs also read the block's columns [P, P + block_cols) (none: 0), so
    # they give up `lead` prefix keys, as many as those columns' tiles, to end with the others.
    start = gl.maximum(split * keys_per_split - lead, 0)
    end = gl.minimum((split + 1) * keys_per_split - lead, prefix)
    n_tiles = gl.maximum(gl.cdiv(end - start, BLOCK_N), 1)  # one (masked) tile for a split past P
    n_block = gl.where(split == 0, gl.cdiv(block_cols, BLOCK_N), 0)
    base = ((split * gl.num_programs(1) + head) * batch + r) * rows  # o [splits, Hkv, batch * rows, D]
    row0 = pid_m * CONSUMERS * 64
    # The last row block's second warp group may have no real row (e.g. 65 tokens x 6 heads = 390
    # rows at head_dim 256, where no tail warp group takes them: its rows 448-511); it then does
    # nothing and the first runs alone (SKIP_IDLE).
    tail_idle = (row0 + 64 >= rows).to(gl.int32)
    if not SKIP_IDLE:
        tail_idle = tail_idle * 0

    q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, 64, D], Q_SMEM)
    k_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], k_desc.layout)
    v_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], v_desc.layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS + (TAIL > 0))  # each consumer's arrival frees a slot
        mbarrier.init(v_empty.index(i), count=CONSUMERS + (TAIL > 0))

    # (Partitions and their arguments are written in the call itself: tuples built before it would
    # turn their functions and constexprs into tensors.)
    if TAIL > 0:  # two consumers over whole 128-row blocks, the rows past them in a tail warp group
        HALVES: gl.constexpr = (D + 127) // 128  # p.v in two products at head_dim 256 (`_attend`)
        qt_smem = gl.allocate_shared_memory(dtype, [TAIL, D], gl.NVMMASharedLayout.get_default_for([TAIL, D], dtype))
        pt_smem = gl.allocate_shared_memory(dtype, [TAIL, BLOCK_N],
                                            gl.NVMMASharedLayout.get_default_for([TAIL, BLOCK_N], dtype))
        gl.warp_specialize([
            (_consumer, (q_ptr, o_ptr, lse_ptr, q_smem.index(0), k_ring, v_ring, k_ready, k_empty, v_ready, v_empty,
                         row0, rows, head, base, stride_qt, stride_qh, start, end, n_tiles, n_block, block_cols,
                         mask_ptr, mask_stride, qk_scale, 0, False, GROUP, D, BLOCK_N, STAGES, HALVES)),
            (_consumer, (q_ptr, o_ptr, lse_ptr, q_smem.index(1), k_ring, v_ring, k_ready, k_empty, v_ready, v_empty,
                         row0 + 64, rows, head, base, stride_qt, stride_qh, start, end, n_tiles, n_block, block_cols,
                         mask_ptr, mask_stride, qk_scale, 0, False, GROUP, D, BLOCK_N, STAGES, HALVES)),
            (_tail, (q_ptr, o_ptr, lse_ptr, qt_smem, pt_smem, k_ring, v_ring, k_ready, k_empty, v_ready, v_empty,
                     part_o_ptr, part_ml_ptr, count_ptr, full_rows, rows, head, base, stride_qt, stride_qh, start,
                     end, n_tiles, n_block, block_cols, mask_ptr, mask_stride, qk_scale, GROUP, D, BLOCK_N, STAGES,
                     TAIL)),
            (_loader, (k_desc, v_desc, k_ring, v_ring, k_ready, k_empty, v_ready, v_empty, slot0 + start, n_tiles,
                       slot0 + prefix, n_block, head * D, BLOCK_N, STAGES)),
        ], [4, 4, 1], [CONSUMER_REGS, TAIL_REGS, 24])
    elif CONSUMERS == 2:
        gl.warp_specialize([
            (_consumer, (q_ptr, o_ptr, lse_ptr, q_smem.index(0), k_ring, v_ring, k_ready, k_empty, v_ready, v_empty,
                         row0, rows, head, base, stride_qt, stride_qh, start, end, n_tiles, n_block, block_cols,
                         mask_ptr, mask_stride, qk_scale, 0, tail_idle, GROUP, D, BLOCK_N, STAGES, 1)),
            (_consumer, (q_ptr, o_ptr, lse_ptr, q_smem.index(1), k_ring, v_ring, k_ready, k_empty, v_ready, v_empty,
                         row0 + 64, rows, head, base, stride_qt, stride_qh, start, end, n_tiles, n_block, block_cols,
                         mask_ptr, mask_stride, qk_scale, tail_idle, False, GROUP, D, BLOCK_N, STAGES, 1)),
            (_loader, (k_desc, v_desc, k_ring, v_ring, k_ready, k_empty, v_ready, v_empty, slot0 + start, n_tiles,
                       slot0 + prefix, n_block, head * D, BLOCK_N, STAGES)),
        ], [4, 1], [CONSUMER_REGS, 24])
    else:
        gl.warp_specialize([
            (_consumer, (q_ptr, o_ptr, lse_ptr, q_smem.index(0), k_ring, v_ring, k_ready, k_empty, v_ready, v_empty,
                         row0, rows, head, base, stride_qt, stride_qh, start, end, n_tiles, n_block, block_cols,
                         mask_ptr, mask_stride, qk_scale, 0, False, GROUP, D, BLOCK_N, STAGES, 1)),
            (_loader, (k_desc, v_desc, k_ring, v_ring, k_ready, k_empty, v_ready, v_empty, slot0 + start, n_tiles,
                       slot0 + prefix, n_block, head * D, BLOCK_N, STAGES)),
        ], [1], [24])


def tiling(head_dim: int, rows: int, kv_heads: int, sms: int, batch: int = 1) -> dict:
    """CONSUMERS (warp groups of 64 rows a program), BLOCK_N, STAGES and PER_SM (programs an SM) for
    `rows` query rows per KV head (H200, benchmarks/prefix_attention_sm90.py): two consumers sharing
    each key tile; 128-key tiles in 2 stages at head_dim <= 128, 64-key tiles in 2 stages at 256 (Q
    64 KB + 64 KB of keys and values a stage). Where two consumers' programs could not fill the SMs
    even at 16 key splits (few rows), one consumer: twice the programs, at 64-key tiles in 3 stages
    (head_dim <= 128: two programs an SM). With two, `tail_rows` says whether a tail warp group takes
    the rows past the last whole 128-row block (its entry "TAIL", on unless set False). batch: rows
    (sequences) of a batched launch, each with `rows` of its own."""
    if triton.cdiv(rows, 128) * kv_heads * batch * 16 < sms:
        return {"CONSUMERS": 1, "BLOCK_N": 64, "STAGES": 3, "PER_SM": 2 if head_dim <= 128 else 1}
    return {"CONSUMERS": 2, "BLOCK_N": 128 if head_dim <= 128 else 64, "STAGES": 2, "PER_SM": 1}


def registers(consumers: int, programs_per_sm: int, tail: bool = False) -> tuple[int, int, int]:
    """(maxnreg, consumer registers, tail registers): the kernel's warp groups (the consumers', the
    loader's, whose one warp is launched with three more, and the tail's) share the SM's 64K
    registers; setmaxnreg then gives the loader 24, the tail warp group TAIL_REGS_NEEDED and the
    consumers the rest."""
    if tail:  # four warp groups: the loader's warp is launched with three more
        consumer = (65536 // programs_per_sm - 128 * 24 - 128 * TAIL_REGS_NEEDED) // (128 * consumers) // 8 * 8
        return 65536 // (programs_per_sm * (consumers + 2) * 128) // 8 * 8, min(256, consumer), TAIL_REGS_NEEDED
    per_group = 65536 // (programs_per_sm * (consumers + 1) * 128) // 8 * 8
    return per_group, min(256, ((consumers + 1) * per_group - 24) // consumers // 8 * 8), 0


def tail_rows(config: dict, rows: int, head_dim: int) -> tuple[int, int]:
    """(TAIL, rows in whole 128-row blocks): where two consumers' last row block would hold at most
    16 real rows (65 tokens x 4 query heads: 4 of 128), those rows go to the tail warp group, its
    products transposed to N = TAIL (8 or 16), and the row blocks stop at the last whole one;
    else (0, rows). The config's "TAIL": False turns it off (tests, benchmarks). head_dim: any the
    kernel takes; at 256 its consumers' p.v then runs in two halves to fit the registers, which
    pays where the whole blocks are few (H200, Qwen3.6-27B heads over 32k keys: 65 tokens, 3
    blocks, 136.9 -> 99.5 us) and not where they are many (257 tokens, 12 blocks, 372.1 -> 394.9;
    prefix_attention_sm90_branch_ab_h200.json), so there only up to TAIL_256_MAX_BLOCKS."""
    left = rows % 128
    if config["CONSUMERS"] != 2 or not config.get("TAIL", True) or rows < 128 or not 0 < left <= 16:
        return 0, rows
    if head_dim > 128 and rows // 128 > TAIL_256_MAX_BLOCKS:
        return 0, rows
    return (8 if left <= 8 else 16), rows - left


def plan_splits(programs: int, sms: int, max_keys: int, max_splits: int = 16, min_keys: int = 512) -> int:
    """Key splits for `programs` (row blocks x KV heads) at one program an SM: the count whose waves
    waste the least, ceil(programs x s / sms) / s at its least (ties: fewer splits, fewer partials
    to merge: the fewest within 3% of the least), each split at least `min_keys` keys. E.g. 72
    programs on 132 SMs: 11 splits, 792 programs in 6 whole waves; 24 programs: 11 (264, 2 waves)."""
    counts = range(1, max(1, min(max_splits, max_keys // min_keys)) + 1)
    cost = {splits: -(-programs * splits // sms) / splits for splits in counts}
    least = min(cost.values())
    return min(splits for splits in counts if cost[splits] <= least * 1.03)


def splits_for(config: dict, rows: int, kv_heads: int, sms: int, max_keys: int, head_dim: int, batch: int = 1) -> int:
    """`plan_splits` for a tiling's programs: its row blocks (`tail_rows`' whole ones where a tail
    warp group takes the rest) x KV heads x batch rows, PER_SM of them an SM."""
    programs = triton.cdiv(tail_rows(config, rows, head_dim)[1], 64 * config["CONSUMERS"]) * kv_heads * batch
    return plan_splits(programs, config["PER_SM"] * sms, max_keys)


def shared_layouts(head_dim: int, dtype: torch.dtype, block_m: int, block_n: int):
    """The NVMMA shared layouts of the query tile and the key / value tiles (wgmma operands)."""
    gl_dtype = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return (gl.NVMMASharedLayout.get_default_for([block_m, head_dim], gl_dtype),
            gl.NVMMASharedLayout.get_default_for([block_n, head_dim], gl_dtype))


def split_keys(max_keys: int, splits: int, block_cols: int = 0) -> tuple[int, int]:
    """(keys_per_split, lead): split s takes prefix keys [s * keys_per_split - lead, (s + 1) *
    keys_per_split - lead) (clipped to [0, P)), whole SPLIT_KEYS; the first split, which also reads the
    block's block_cols columns, gives up `lead` of its keys for them, so that every split's programs
    read about as many tiles (H200, one wave at 32k: the first split's extra tiles had set the kernel's
    end, a tile of 32 at 65 tokens and three of 128 at 257, at 8 and 2 splits)."""
    lead = triton.cdiv(block_cols, SPLIT_KEYS) * SPLIT_KEYS
    return triton.cdiv(triton.cdiv(max_keys + lead, splits), SPLIT_KEYS) * SPLIT_KEYS, lead


_TAIL_COUNTS: dict[torch.device, torch.Tensor] = {}


def _tail_counters(device: torch.device, count: int) -> torch.Tensor:
    """int32 zeros, at least `count` of them, one per (split, batch row, KV head) of a launch with a
    tail warp group: how many row-block programs have written their tail partial (each launch leaves them at
    zero). Made or grown on an eager call (a graph's capture is preceded by one); launches on one
    stream at a time."""
    have = _TAIL_COUNTS.get(device)
    if have is None or have.numel() < count:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the prefix kernel's first call with a tail at this size must run before graph capture")
        _TAIL_COUNTS[device] = torch.zeros(max(count, 8192), dtype=torch.int32, device=device)
    return _TAIL_COUNTS[device]


def prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: torch.Tensor, max_keys: int,
                     splits: int, scale: float, config: dict | None = None, block: torch.Tensor | None = None,
                     first_slot: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [N, Hq, D] over keys [0, prefix_len) of k, v [T, Hkv, D] (prefix_len: an int32
    or int64 device scalar, read in place, at most `max_keys`, the static bound the splits are
    planned over) -> (o, lse) as in the module docstring. bf16 / fp16 on sm_90; q's last dim and
    k's and v's last two contiguous, and k, v finite past the prefix. `config` overrides `tiling`'s
    entries (tests, benchmarks).

    block: the tree's mask [N, M] (bool; token i sees key prefix_len + j where block[i, j]): the
    first split then attends to those M keys too, so that the splits' merge is the whole attention
    (the prefix's keys past max_keys, if any, count for nothing there: max_keys + M <= T).

    first_slot [R] (int32 / int64 on the device): R rows (sequences) of a cache in one launch, as
    `tree_attention.batched_masked_attention` lays them out: q [R * N, Hq, D], row r's N tokens at
    r * N.., seeing keys first_slot[r] + j for j < prefix_len[r] ([R]) and, with block [R, N, M],
    first_slot[r] + prefix_len[r] + j where block[r, i, j]; max_keys bounds every row's prefix. ->
    o [splits, Hkv, R * N * group, D], lse [splits, Hkv, R * N * group] (row r's rows after row r -
    1's, for the combine launch)."""
    rows_total, hq, d = q.shape
    t_keys, hkv, _ = k.shape
    group = hq // hkv
    batch = 1 if first_slot is None else first_slot.numel()
    n = rows_total // batch
    if q.dtype not in (torch.bfloat16, torch.float16) or d not in (64, 128, 256) or hq % hkv:
        raise ValueError(f"prefix_attention takes bf16/fp16 with head_dim 64, 128 or 256, got {q.dtype}, {d}")
    if q.stride(-1) != 1 or any(x.stride(-1) != 1 or x.stride(1) != d for x in (k, v)):
        raise ValueError("prefix_attention needs q's last dim and k's and v's last two dims contiguous")
    if any(x.stride(0) % 8 for x in (q, k, v)) or q.stride(1) % 8:
        raise ValueError("prefix_attention's 16-byte copies need strides that are multiples of 8 elements")
    if prefix_len.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"prefix_attention's prefix_len is an int32 or int64 device scalar, got {prefix_len.dtype}")
    if first_slot is not None and (first_slot.dim() != 1 or prefix_len.shape != (batch,) or rows_total % batch
                                   or first_slot.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"prefix_attention's batch: first_slot and prefix_len [R] int32 / int64 and q [R * N, ...], "
                         f"got {tuple(first_slot.shape)}, {tuple(prefix_len.shape)}, {rows_total} tokens")
    if block is not None and first_slot is not None and block.dim() == 3 and block.shape[:2] == (batch, n):
        block = block.reshape(rows_total, block.shape[2])
    if block is not None and (block.dtype != torch.bool or block.dim() != 2 or block.shape[0] != rows_total):
        raise ValueError(f"prefix_attention's block is a bool mask [{n}, M] ([R, N, M] for R rows), got "
                         f"{block.dtype} {tuple(block.shape)}")
    rows = n * group
    t = tiling(d, rows, hkv, torch.cuda.get_device_properties(q.device).multi_processor_count, batch) | (config or {})
    consumers, block_n = t["CONSUMERS"], t["BLOCK_N"]
    o = torch.empty(splits, hkv, batch * rows, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(splits, hkv, batch * rows, dtype=torch.float32, device=q.device)
    q_smem, kv_smem = shared_layouts(d, q.dtype, 64, block_n)
    k_desc = TensorDescriptor(k, [t_keys, hkv * d], [k.stride(0), 1], [block_n, d], kv_smem)
    v_desc = TensorDescriptor(v, [t_keys, hkv * d], [v.stride(0), 1], [block_n, d], kv_smem)
    if block is not None:
        mask, block_cols = block.contiguous().view(torch.uint8), block.shape[1]
    else:  # never read (no program has block columns): empty, so no fill launch on every call
        mask, block_cols = torch.empty(1, 1, dtype=torch.uint8, device=q.device), 0
    keys_per_split, lead = split_keys(max_keys, splits, block_cols if t.get("BALANCE", True) else 0)
    tail, full_rows = tail_rows(t, rows, d)
    maxnreg, consumer_regs, tail_regs = registers(consumers, t["PER_SM"], tail > 0)
    grid = (triton.cdiv(full_rows, consumers * 64), hkv, splits * batch)
    if tail:  # each row-block program's partial for the tail rows, merged by the last to finish
        part_o = torch.empty(grid[2] * hkv * grid[0] * tail * d, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(grid[2] * hkv * grid[0] * tail * 2, dtype=torch.float32, device=q.device)
        counts = _tail_counters(q.device, grid[2] * hkv)
    else:  # never read
        part_o, part_ml, counts = lse, lse, lse
    _prefix_kernel[grid](q, k_desc, v_desc, o, lse, prefix_len, prefix_len if first_slot is None else first_slot, mask,
                         part_o, part_ml, counts, n, batch, q.stride(0), q.stride(1), keys_per_split, lead, block_cols,
                         mask.stride(0), scale * LOG2E, full_rows, GROUP=group, D=d, CONSUMERS=consumers,
                         SKIP_IDLE=t.get("SKIP_IDLE", True), TAIL=tail, BLOCK_N=block_n, STAGES=t["STAGES"],
                         Q_SMEM=q_smem, CONSUMER_REGS=consumer_regs, TAIL_REGS=tail_regs,
                         BATCHED=first_slot is not None, num_warps=4, maxnreg=maxnreg, launch_pdl=t.get("PDL", PDL))
    return o, lse


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, max_keys: int, splits: int,
              scale: float, block: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`prefix_attention` in float64 with PyTorch, split for split, the splits' keys as `split_keys`
    gives them, the block's keys in the first split (for tests)."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    rows = n * group
    qf = q.double().view(n, hkv, group, d).permute(1, 0, 2, 3).reshape(hkv, rows, d)
    keys_per_split, lead = split_keys(max_keys, splits, 0 if block is None else block.shape[1])
    o = torch.zeros(splits, hkv, rows, d, dtype=torch.float64, device=q.device)
    lse = torch.full((splits, hkv, rows), -math.inf, dtype=torch.float64, device=q.device)
    for s in range(splits):
        lo, hi = max(s * keys_per_split - lead, 0), min((s + 1) * keys_per_split - lead, prefix)
        keys = torch.arange(lo, max(lo, hi), device=q.device)
        seen = torch.ones(rows, len(keys), dtype=torch.bool, device=q.device)
        if block is not None and s == 0:
            keys = torch.cat([keys, prefix + torch.arange(block.shape[1], device=q.device)])
            seen = torch.cat([seen, block.repeat_interleave(group, 0)], dim=1)
        if len(keys) == 0:
            continue
        kk = k[keys].double().permute(1, 0, 2)
        vv = v[keys].double().permute(1, 0, 2)
        logits = (qf @ kk.transpose(1, 2) * scale).masked_fill(~seen[None], -math.inf)
        lse[s] = torch.logsumexp(logits, -1)
        o[s] = torch.nan_to_num(torch.softmax(logits, -1)) @ vv
    return o, lse
