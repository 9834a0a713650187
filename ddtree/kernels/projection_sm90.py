"""A projection of a verify's few rows against a large weight on Hopper (sm_90), written in Gluon:
y [M, N] = x [M, K] @ w [N, K]^T, or y += that, for M <= 128, bf16 / fp16, float32 accumulation.

Why: at a tree's 17-65 rows the product is bound by the weight's bytes, and cuBLAS reads them below
the copy rate: on the H200 at Qwen3-8B's four projections and 65 rows, 113.6 us a layer against
90.6 us of their weights at 4.26 TB/s (`verify_profile_h200_qwen3_8b_32k_64_folded_norms.json`),
0.83 ms a 32k verify, most of it in the three smaller projections and the down projection's
split-K sum (a launch of its own). The Triton few-row kernel (`skinny_gemm.py`) pads x to
`tl.dot`'s power-of-two tiles and lost to cuBLAS at 65 rows.

How:

- the weight is the MMA's A operand and x its B: each step is wgmma [BM weight rows, BK] x
  [BK, MP tokens], MP a power of two, and where M is at most 8 past one a second product of 8
  columns beside it (`token_tiles`), so 65 rows cost 72 columns, not 128;
- the work is the flat list of (weight tile, BK-column step) pairs, cut into one even run per
  program (one program an SM): every program streams the same number of weight bytes however the
  tiles divide (a stream-K split). A run that covers a tile whole writes its rows of y; where
  several runs share a tile, each writes its float32 partial and adds its steps to the tile's
  arrival count, and the run that completes the count adds the others' partials (in program order)
  to its own and writes y. No second launch, no atomics on the data;
- a loader warp copies each step's weight tile with TMA into a ring of W_STAGES slots and another
  its x tile (from L2) into a shallower ring of its own, each as the products release a slot, so
  the weights' copies never wait on a product or on x (warp specialised: with the copies issued by
  the warps that multiply, each call took 0.6-2 us longer at 17 and 65 rows);
- it is a programmatic dependent launch: its first weight tiles are copied while the launch before
  it ends (the weights are not that launch's output), and it waits for that launch's end
  (griddepcontrol.wait) before it copies x or touches y, the partials or the counts; it lets the
  launch after it start as soon as it runs.

Where it stands (H100, Qwen3-8B's projections, `benchmarks/projection_sm90.py`; benchmarks/README.md,
"A projection kernel of our own in Gluon"): at one row it beats or ties cuBLAS at all four
projections; at 65 rows it loses by 4-8 us a call: the weights alone stream faster than cuBLAS's
whole call, but the shared tiles' partials and their merge cost 7-9 us and the products with y's
writes 2-6 more. So nothing calls it yet. Tested against PyTorch's product on the GPU
(`tests/test_projection_sm90.py`); compiled for sm_90 on the CPU by `scripts/compile_projection_sm90.py`.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ddtree.kernels.prefix_attention_sm90 import _dependents_may_start, _inputs_ready

MAX_ROWS = 128
DTYPES = (torch.bfloat16, torch.float16)
SHARED_BYTES = 212 * 1024  # the rings' budget, within sm_90's 227 KB a program


@gluon.jit
def _copy_weights(w_desc, w_ring, w_ready, i, s, steps_k, BM: gl.constexpr, BK: gl.constexpr,
                  W_STAGES: gl.constexpr):
    """Step i of this program (flat step s: weight tile s // steps_k, columns (s % steps_k) * BK):
    the weight tile's copy into its slot."""
    slot = i % W_STAGES
    mbarrier.expect(w_ready.index(slot), w_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(w_desc, [(s // steps_k) * BM, (s % steps_k) * BK], w_ready.index(slot),
                                    w_ring.index(slot))


@gluon.jit
def _copy_x(x_desc, xt_desc, x_ring, xt_ring, x_ready, i, s, steps_k, BK: gl.constexpr, X_STAGES: gl.constexpr,
            TAIL: gl.constexpr):
    """Step i's x tiles: rows [0, MP) and, with TAIL, rows [MP, MP + 8) (rows past M read as zeros)."""
    slot = i % X_STAGES
    X_BYTES: gl.constexpr = x_desc.block_type.nbytes + xt_desc.block_type.nbytes * (TAIL // 8)
    mbarrier.expect(x_ready.index(slot), X_BYTES)
    tma.async_copy_global_to_shared(x_desc, [0, (s % steps_k) * BK], x_ready.index(slot), x_ring.index(slot))
    if TAIL > 0:
        tma.async_copy_global_to_shared(xt_desc, [0, (s % steps_k) * BK], x_ready.index(slot), xt_ring.index(slot))


@gluon.jit
def _run_start(p, programs, total):
    """The first flat step of program p's run: runs differ in length by at most one step."""
    return (p * total) // programs


@gluon.jit
def _write(y_ptr, acc, tile, token0, M, N, stride_ym, BM: gl.constexpr, COLS: gl.constexpr, ACC: gl.constexpr,
           ACCUMULATE: gl.constexpr):
    """acc [BM weight rows, COLS tokens from token0] -> y[token, tile * BM + row] (added to y's
    values with ACCUMULATE), rows past N and tokens past M left alone."""
    n = tile * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, ACC))
    t = token0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, ACC))
    at = y_ptr + t[None, :] * stride_ym + n[:, None]
    live = (n[:, None] < N) & (t[None, :] < M)
    if ACCUMULATE:
        acc = acc + gl.load(at, mask=live, other=0.0).to(gl.float32)
    gl.store(at, acc.to(y_ptr.dtype.element_ty), mask=live)


@gluon.jit
def _entries(BM: gl.constexpr, COLS: gl.constexpr, ACC: gl.constexpr):
    """Where each entry of a [BM, COLS] accumulator lies in a partial of that shape."""
    rows = gl.arange(0, BM, layout=gl.SliceLayout(1, ACC))
    cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, ACC))
    return rows[:, None] * COLS + cols[None, :]


@gluon.jit
def _finish_tile(y_ptr, part_ptr, count_ptr, acc, acc_t, tile, k0, k1, pid, programs, total, steps_k, max_runs, M,
                 N, stride_ym, BM: gl.constexpr, MP: gl.constexpr, TAIL: gl.constexpr, ACC: gl.constexpr,
                 ACC_T: gl.constexpr, ACCUMULATE: gl.constexpr):
    """This run's sum over the tile's steps [k0, k1) (acc: tokens [0, MP), acc_t: [MP, MP + TAIL)):
    y directly where that is all of them; else its partial, the arrival count, and, for the run that
    completes the count, the others' partials added to its own and y written (the count left at zero
    for the next launch)."""
    if k1 - k0 == steps_k:
        _write(y_ptr, acc, tile, 0, M, N, stride_ym, BM, MP, ACC, ACCUMULATE)
        if TAIL > 0:
            _write(y_ptr, acc_t, tile, MP, M, N, stride_ym, BM, TAIL, ACC_T, ACCUMULATE)
    else:
        SLOT: gl.constexpr = BM * (MP + TAIL)  # a partial: [BM, MP] then [BM, TAIL]
        entry = _entries(BM, MP, ACC)
        first_tile = _run_start(pid, programs, total) // steps_k
        mine = part_ptr + (pid * max_runs + tile - first_tile) * SLOT
        gl.store(mine + entry, acc)
        if TAIL > 0:
            entry_t = BM * MP + _entries(BM, TAIL, ACC_T)
            gl.store(mine + entry_t, acc_t)
        # Every thread's stores are issued before one thread releases them with the count (a barrier
        # of the warp group, then a GPU-scope acquire-release atomic: a semaphore).
        gl.thread_barrier()
        arrived = gl.atomic_add(count_ptr + tile, k1 - k0, sem="acq_rel", scope="gpu")
        if arrived + (k1 - k0) == steps_k:
            gl.store(count_ptr + tile, 0)
            # The runs that share the tile: the owners of its first and last steps, and those between.
            lo = ((tile * steps_k + 1) * programs - 1) // total
            hi = (((tile + 1) * steps_k) * programs - 1) // total
            for p in range(lo, hi + 1):
                if p != pid:
                    theirs = part_ptr + (p * max_runs + tile - _run_start(p, programs, total) // steps_k) * SLOT
                    acc += gl.load(theirs + entry, cache_modifier=".cg")
                    if TAIL > 0:
                        acc_t += gl.load(theirs + entry_t, cache_modifier=".cg")
            _write(y_ptr, acc, tile, 0, M, N, stride_ym, BM, MP, ACC, ACCUMULATE)
            if TAIL > 0:
                _write(y_ptr, acc_t, tile, MP, M, N, stride_ym, BM, TAIL, ACC_T, ACCUMULATE)


@gluon.jit
def _load_weights(w_desc, w_ring, w_ready, w_empty, begin, steps, steps_k, BM: gl.constexpr, BK: gl.constexpr,
                  W_STAGES: gl.constexpr):
    """The weight loader (one warp): step i's weight tile into slot i % W_STAGES once the products
    have released the slot's previous tile. It does not wait for the launch before this one: the
    weights are not that launch's output, so the first W_STAGES tiles are copied while it ends."""
    for i in range(steps):
        slot = i % W_STAGES
        # A fresh barrier counts as having completed the phase before phase 0: the first W_STAGES
        # waits (on phase 1) pass at once.
        mbarrier.wait(w_empty.index(slot), ((i // W_STAGES) & 1) ^ 1)
        _copy_weights(w_desc, w_ring, w_ready, i, begin + i, steps_k, BM, BK, W_STAGES)


@gluon.jit
def _load_x(x_desc, xt_desc, x_ring, xt_ring, x_ready, x_empty, begin, steps, steps_k, BK: gl.constexpr,
            X_STAGES: gl.constexpr, TAIL: gl.constexpr):
    """The x loader (one warp): step i's x tiles into slot i % X_STAGES, once the launch before this
    one has ended (x is its output) and the products have released the slot."""
    _inputs_ready()
    for i in range(steps):
        slot = i % X_STAGES
        mbarrier.wait(x_empty.index(slot), ((i // X_STAGES) & 1) ^ 1)
        _copy_x(x_desc, xt_desc, x_ring, xt_ring, x_ready, i, begin + i, steps_k, BK, X_STAGES, TAIL)


@gluon.jit
def _multiply(w_ring, x_ring, xt_ring, w_ready, w_empty, x_ready, x_empty, y_ptr, part_ptr, count_ptr, begin,
              steps, pid, programs, total, steps_k, max_runs, M, N, stride_ym, BM: gl.constexpr, MP: gl.constexpr,
              TAIL: gl.constexpr, W_STAGES: gl.constexpr, X_STAGES: gl.constexpr, ACCUMULATE: gl.constexpr,
              WARPS: gl.constexpr):
    """The products (the default partition's warp groups, 64 of the tile's rows each): each step's
    once its tiles have landed, its slots released as it retires, and each tile's end (`_finish_tile`)."""
    _inputs_ready()  # before y, the partials or the counts are touched
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, MP, 16])
    ACC_T: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                    instr_shape=[16, 8, 16])
    acc = gl.zeros([BM, MP], gl.float32, ACC)
    acc_t = gl.zeros([BM, 8], gl.float32, ACC_T)
    k0 = begin % steps_k
    for i in range(steps):
        s = begin + i
        w_slot = i % W_STAGES
        x_slot = i % X_STAGES
        mbarrier.wait(w_ready.index(w_slot), (i // W_STAGES) & 1)
        mbarrier.wait(x_ready.index(x_slot), (i // X_STAGES) & 1)
        acc = warpgroup_mma(w_ring.index(w_slot), x_ring.index(x_slot).permute((1, 0)), acc, is_async=True)
        if TAIL > 0:
            acc_t = warpgroup_mma(w_ring.index(w_slot), xt_ring.index(x_slot).permute((1, 0)), acc_t,
                                  is_async=True)
        # The loaders run ahead on their own, so one step's products are waited on at once: they
        # take a fraction of the time its weight tile takes to arrive.
        acc, acc_t = warpgroup_mma_wait(0, deps=(acc, acc_t))
        mbarrier.arrive(w_empty.index(w_slot), count=1)
        mbarrier.arrive(x_empty.index(x_slot), count=1)
        k = s % steps_k
        if (k == steps_k - 1) | (i == steps - 1):  # the end of this run's share of a tile
            _finish_tile(y_ptr, part_ptr, count_ptr, acc, acc_t, s // steps_k, k0, k + 1, pid, programs, total,
                         steps_k, max_runs, M, N, stride_ym, BM, MP, TAIL, ACC, ACC_T, ACCUMULATE)
            acc = gl.zeros([BM, MP], gl.float32, ACC)
            acc_t = gl.zeros([BM, 8], gl.float32, ACC_T)
            k0 = 0


@gluon.jit
def _projection_kernel(w_desc, x_desc, xt_desc, y_ptr, part_ptr, count_ptr, M, N, stride_ym, steps_k, total,
                       max_runs, BM: gl.constexpr, BK: gl.constexpr, MP: gl.constexpr, TAIL: gl.constexpr,
                       W_STAGES: gl.constexpr, X_STAGES: gl.constexpr, ACCUMULATE: gl.constexpr,
                       num_warps: gl.constexpr):
    """Program: one run of steps (`_run_start`), its copies issued by two loader warps (warp
    specialised: the weights' loader never waits on a product or on x) and its products by the
    default partition's warp groups."""
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    begin = _run_start(pid, programs, total)
    steps = _run_start(pid + 1, programs, total) - begin
    dtype: gl.constexpr = w_desc.dtype
    w_ring = gl.allocate_shared_memory(dtype, [W_STAGES, BM, BK], w_desc.layout)
    x_ring = gl.allocate_shared_memory(dtype, [X_STAGES, MP, BK], x_desc.layout)
    xt_ring = gl.allocate_shared_memory(dtype, [X_STAGES, 8, BK], xt_desc.layout)  # unused without TAIL
    w_ready = gl.allocate_shared_memory(gl.int64, [W_STAGES, 1], mbarrier.MBarrierLayout())
    w_empty = gl.allocate_shared_memory(gl.int64, [W_STAGES, 1], mbarrier.MBarrierLayout())
    x_ready = gl.allocate_shared_memory(gl.int64, [X_STAGES, 1], mbarrier.MBarrierLayout())
    x_empty = gl.allocate_shared_memory(gl.int64, [X_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(W_STAGES):
        mbarrier.init(w_ready.index(i), count=1)
        mbarrier.init(w_empty.index(i), count=1)
    for i in gl.static_range(X_STAGES):
        mbarrier.init(x_ready.index(i), count=1)
        mbarrier.init(x_empty.index(i), count=1)
    _dependents_may_start()
    gl.warp_specialize([
        (_multiply, (w_ring, x_ring, xt_ring, w_ready, w_empty, x_ready, x_empty, y_ptr, part_ptr, count_ptr, begin,
                     steps, pid, programs, total, steps_k, max_runs, M, N, stride_ym, BM, MP, TAIL, W_STAGES,
                     X_STAGES, ACCUMULATE, num_warps)),
        (_load_weights, (w_desc, w_ring, w_ready, w_empty, begin, steps, steps_k, BM, BK, W_STAGES)),
        (_load_x, (x_desc, xt_desc, x_ring, xt_ring, x_ready, x_empty, begin, steps, steps_k, BK, X_STAGES, TAIL)),
    ], [1, 1], [24, 24])


def max_registers(warps: int) -> int:
    """Registers a thread at launch: the products' warps and the loaders' two, launched as a warp
    group of four, share the SM's 64K (the loaders then give theirs up to 24: setmaxnreg)."""
    return 65536 // ((warps + 4) * 32) // 8 * 8


def token_tiles(m: int) -> tuple[int, int]:
    """(MP, TAIL): the MMA columns x's m rows take, a power of two MP (Gluon's shapes are) and, where m
    is at most 8 past one, a second product of TAIL = 8 columns: 65 rows -> (64, 8), 17 -> (16, 8),
    9 -> (16, 0), 1 -> (8, 0), 100 -> (128, 0)."""
    mp = max(8, 1 << (m - 1).bit_length())
    if mp >= 32 and m <= mp // 2 + 8:
        return mp // 2, 8
    return mp, 0


def tiling(m: int, n: int, k: int, sms: int, config: dict | None = None) -> dict:
    """BM weight rows a tile, BK columns a step, the token tiles (`token_tiles`), X_STAGES slots for
    x's tiles and W_STAGES for the weight's as the shared memory allows, WARPS warps (two warp groups:
    each multiplies 64 of the tile's rows), one program an SM (PER_SM; fewer where there are fewer
    steps)."""
    t = {"BM": 128, "BK": 128, "WARPS": 8, "X_STAGES": 3} | (config or {})
    mp, tail = token_tiles(m)
    x_bytes = t["X_STAGES"] * (mp + tail) * t["BK"] * 2
    t.setdefault("W_STAGES", max(2, min(12, (SHARED_BYTES // t.get("PER_SM", 1) - x_bytes) // (t["BM"] * t["BK"] * 2))))
    steps_k = triton.cdiv(k, t["BK"])
    total = triton.cdiv(n, t["BM"]) * steps_k
    t.setdefault("PROGRAMS", min(sms * t.get("PER_SM", 1), total))
    return t | {"MP": mp, "TAIL": tail, "STEPS_K": steps_k, "TOTAL": total}


_WORKSPACE: dict = {}


def _workspace(device: torch.device, floats: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The partials (float32, at least `floats`) and the per-tile arrival counts (int32 zeros, at
    least `tiles`; each launch leaves them at zero), made or grown on an eager call (a graph's
    capture is preceded by one); launches on one stream at a time."""
    part, count = _WORKSPACE.get(device, (None, None))
    if part is None or part.numel() < floats or count.numel() < tiles:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the projection kernel's first call at this size must run before graph capture")
        part = torch.empty(max(floats, 1 << 20), dtype=torch.float32, device=device)
        count = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
        _WORKSPACE[device] = (part, count)
    return part, count


def supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `projection` takes these: 2-D bf16 / fp16 on an sm_90 GPU, at most MAX_ROWS rows,
    rows of 16-byte multiples, last dims contiguous."""
    return (x.is_cuda and x.dtype in DTYPES and w.dtype == x.dtype and x.dim() == 2 and w.dim() == 2
            and x.shape[1] == w.shape[1] and 0 < x.shape[0] <= MAX_ROWS and x.stride(1) == 1 and w.stride(1) == 1
            and x.stride(0) % 8 == 0 and w.stride(0) % 8 == 0 and x.shape[1] % 8 == 0
            and torch.cuda.get_device_capability(x.device)[0] == 9)


def projection(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, accumulate: bool = False,
               config: dict | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T -> a new y [M, N] in x's dtype, or into `out` [M, N] (added to its
    values with `accumulate`). `config` overrides `tiling`'s entries (tests, benchmarks)."""
    if not supported(x, w):
        raise ValueError(f"projection takes 2-D bf16/fp16 x [M <= {MAX_ROWS}, K] and w [N, K] with contiguous rows "
                         f"on sm_90, got x {x.dtype} {tuple(x.shape)}, w {w.dtype} {tuple(w.shape)}")
    m, k = x.shape
    n = w.shape[0]
    if out is None:
        if accumulate:
            raise ValueError("projection: accumulate needs `out`")
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if out.shape != (m, n) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"projection's out is [{m}, {n}] {x.dtype} with contiguous rows, got {out.dtype} "
                         f"{tuple(out.shape)}")
    t = tiling(m, n, k, torch.cuda.get_device_properties(x.device).multi_processor_count, config)
    bm, bk, mp, tail, programs = t["BM"], t["BK"], t["MP"], t["TAIL"], t["PROGRAMS"]
    gl_dtype = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    w_desc = TensorDescriptor(w, list(w.shape), [w.stride(0), 1], [bm, bk],
                              gl.NVMMASharedLayout.get_default_for([bm, bk], gl_dtype))
    x_main = x[:mp] if tail else x
    x_desc = TensorDescriptor(x_main, list(x_main.shape), [x.stride(0), 1], [mp, bk],
                              gl.NVMMASharedLayout.get_default_for([mp, bk], gl_dtype))
    x_tail = x[mp:] if tail else x  # never read without a tail
    xt_desc = TensorDescriptor(x_tail, list(x_tail.shape), [x.stride(0), 1], [8, bk],
                               gl.NVMMASharedLayout.get_default_for([8, bk], gl_dtype))
    max_runs = triton.cdiv(triton.cdiv(t["TOTAL"], programs), t["STEPS_K"]) + 1  # tiles a run can touch
    part, count = _workspace(x.device, programs * max_runs * bm * (mp + tail), triton.cdiv(n, bm))
    _projection_kernel[(programs, )](w_desc, x_desc, xt_desc, out, part, count, m, n, out.stride(0), t["STEPS_K"],
                                     t["TOTAL"], max_runs, BM=bm, BK=bk, MP=mp, TAIL=tail, W_STAGES=t["W_STAGES"],
                                     X_STAGES=t["X_STAGES"], ACCUMULATE=accumulate, num_warps=t["WARPS"],
                                     maxnreg=max_registers(t["WARPS"]), launch_pdl=t.get("PDL", True))
    return out
