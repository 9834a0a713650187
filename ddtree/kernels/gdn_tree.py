"""The gated delta rule (Gated DeltaNet's recurrence) on a draft tree and over a few tokens, as
Triton kernels. References and math: `ddtree.models.gated_deltanet` (same names, same semantics).

`tree_gated_delta` (the verify): every node of a tree from the committed state S, which is read,
never written. Per value head, with G = visible @ g (log-decay summed along each node's path),
decay[i, j] = exp(G_i - G_j) over j on i's path, A[i, j] = beta_i (k_i . k_j) decay[i, j] over
strict ancestors j, P[i, j] = (q_i . k_j) decay[i, j] over j on i's path:

    (I + A) u = beta (v - exp(G) k S);   o = exp(G) q S + P u

Nodes are in topological order, so A is strictly lower-triangular; in blocks of BLOCK_T nodes,
u_b = T_b (rhs_b - sum_{c < b} A_bc u_c) with T_b = (I + A_bb)^-1. Only that recurrence over the
blocks is sequential, and it is cheap once everything else is known, so two launches:

1. `_tree_prepare`, programs per (value head, block), all in parallel: the block's rows of the
   mask give G and the union U of the earlier columns they see (their ancestors outside the
   block, compacted into a list). U is closed under ancestors, so G of each column in U is a sum
   over U too: no other block's results are needed. One program then makes A and P over U, T_b
   and P_bb; others rhs0 = beta (v - exp(G) k S) and exp(G) q S, a tile of value columns each.
   A tree has few ancestors per node (at most 16 on a root path here), so U is a few dozen
   columns (mean 37 at N = 257, 52 at 1025, deep drafts) where a dense walk over the earlier
   blocks would take ~N/2.
2. `_tree_solve`, one program per (value head, tile), block by block: gathers u over U, then
   u_b = T_b (rhs0_b - A_bU u_U), o_b = exp(G) q S + P_bU u_U + P_bb u_b; u goes to scratch for
   later blocks (a block barrier makes it visible to the program's other threads). The next
   block's other inputs are loaded before that barrier: a block waits on the u gather alone.

T_b is found by Jacobi sweeps T <- I - A_bb T, as many as the longest chain of ancestors inside the
block: a row whose in-block ancestors are final is final after one more sweep, so the sweeps do
forward substitution's arithmetic and end exactly. Any ancestor-or-self mask in topological order
is solved exactly (a forest, a chain); the depth only sets the work. A single node (N = 1, an
autoregressive step) is one token of the loop below, without the state's write.

`recurrent_gated_delta` (a decode step, a round's commit): the token loop itself. One program per
(value head, BLOCK_V columns) holds its [Dk, BLOCK_V] state tile in registers through T tokens and
writes it back; rows at or past `length` (read on the device, no host sync) decay by 1 and write
nothing, so the state is the one after the first `length` tokens, bit for bit.

Numerics: float32 throughout. `tl.dot` on float32 is TF32 by default on NVIDIA GPUs (10-bit
mantissas: errors of 7e-4 to 1e-3 of the outputs' scale, measured at the real shapes); the tree
kernels use `TreeConfig.precision`, "tf32x3" (three TF32 products) by default or "ieee"
(CUDA-core FMAs): under 6e-7 and 3e-7 measured at Qwen3.6-27B's heads on an H200, as the float32
reference. `tree_config` gives bf16 / fp16 values one TF32 product (`TWO_BYTE_PRECISION`): its
1e-3 is under the rounding such a model applies to o next (the gated norm takes it in the model's
dtype). The token loop and the fold are CUDA-core FMAs in float32 at every dtype. Decays are
exponentials of differences of G (never exp(-G) alone, which overflows).

Both are CUDA-graph capturable: no host syncs, scratch from torch's allocator. In Triton's
interpreter (CPU tests), loops with run-time bounds are `while` loops, which compile as well.

Measured on an H200 at Qwen3.6-27B's GDN heads (Hk 16, Hv 48, Dk = Dv = 128), per call in a CUDA
graph of 48 calls on 48 layer states, trees of deep drafts (`benchmarks/gdn_kernels.py`,
benchmarks/README.md): the tree, N = 1 / 16 (chain) / 17 / 65 / 257 / 1025: 3.5 / 16.1 / 19.9 /
30.6 / 125 / 686 us against the PyTorch reference's 60 / 88 / 91 / 141 / 488 / 3804; the token
loop, T = 1 and 16: 3.7 and 11.8 us against 47 and 503. A first design, one program per (head,
value tile) walking the blocks with all the work inside, took 13 / 29 / 89 / 500 us at
N = 1 / 17 / 65 / 257: each block waited on a chain of dependent loads, with two programs per
SM to hide them. `tree_config`'s per-size tilings (a third pipeline stage; above 32 nodes a
register cap) took 17.4 / 30.9 / 120.6 us at N = 17 / 65 / 257 against 18.9 / 35.8 / 132.8 before
(another lease). Of the 65-node call's 30.9, the prepare launch is about 21 us and the solve 12
(they overlap a little); in the prepare, the key and state products over Dk in 16-wide slices are
the long chains (timing-only copies without them: benchmarks/README.md).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install has no Triton: `models.gated_deltanet` is the path there
    triton = None

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class TreeConfig:
    """Tiling of the tree kernels: `block_t` nodes per block, `block_c` ancestor columns per step,
    `block_v` value columns per program of the solve and `prepare_v` of the prepare launch,
    `block_w` mask columns per step of the row scan, `block_k` key dimensions per step of the
    products (32 and 64: 250+ registers and spills at Dk = 128 on sm_90). `precision` is the
    prepare launch's (the key and state products), `solve_precision` the solve's. `root_first`:
    node 0 (which has no ancestors: its u is its right-hand side) is finished by the solve before
    its blocks, which then cover nodes 1 .. N - 1, so a round's tree of B + 1 nodes takes B /
    block_t sequential blocks, not one more for a single node; node 0 is the first entry of every
    block's ancestor list, and the state products keep their blocks of all N nodes. Off: on an
    H200 it saved the solve 1.5-1.7 us at 17 and 65 nodes, but the whole call changed by -5% to
    +3% (an earlier form, node 0's terms in the state products, made those twice as slow;
    benchmarks/README.md). `prepare_registers`: a cap on the prepare launch's registers a
    thread (ptxas' maxnreg), None for the compiler's choice: compiled for sm_90 at Qwen3.6-27B's
    heads it takes 155, so three 4-warp programs fit an SM and a 65-node tree's 480 programs take
    1.2 waves of an H200's 132 SMs; at 128 (16 bytes spilled) four fit, one wave (`tree_config`).
    The dataclass defaults are the tiling before these measurements; `tree_config` picks per size."""

    block_t: int = 16
    block_c: int = 32
    block_v: int = 32
    prepare_v: int = 128
    block_w: int = 128
    block_k: int = 16
    precision: str = "tf32x3"
    solve_precision: str = "tf32x3"
    num_warps: int = 4
    num_stages: int = 2
    root_first: bool = False
    prepare_registers: int | None = None


@dataclass(frozen=True)
class RecurrentConfig:
    """Tiling of the token loop: `block_v` value columns (of the state tile) per program. H200, Hv
    48, D 128, 12 tilings: 16 columns and one warp were the fastest at T = 16 (11.7-11.9 us) and
    within 2% of it at T = 1 (3.7 us); 32 columns and 4 warps took 17.1 and 4.4."""

    block_v: int = 16
    num_warps: int = 1


RECURRENT_DEFAULT = RecurrentConfig()


@dataclass(frozen=True)
class FoldConfig:
    """Tiling of `fold_path`: a [block_k, block_v] tile of a [Dk, Dv] state per program. The fold
    reads and writes every layer's whole state once (288 MiB at Qwen3.6-27B's 48 layers) and does
    little else, so its tiles are whole state rows (block_v = Dv: each row one contiguous load).
    H200, 48 layers of Hv 48, Dk = Dv = 128, a 16-node path (`benchmarks/gdn_kernels.py --fold`,
    gdn_kernels_h200_tf32_fold.json), us a commit with all 16 / 5 of its nodes accepted: the token
    loop's tiling (16 columns of every row, one warp), which the fold had before, 216.7 / 172.1;
    64 whole rows over 4 warps 159.6 / 105.8 (the best at 16; 8 rows and one warp 168.0 / 101.8).
    The bytes alone take about 70 us at the copy rate: each accepted node adds a dependent round of
    loads from the stash."""

    block_k: int = 64
    block_v: int = 128
    num_warps: int = 4


FOLD_DEFAULT = FoldConfig()


# Three pipeline stages (the key slices' loads further ahead) for every tree, and above 32 nodes the
# prepare launch's registers capped at 128 (155 uncapped at Qwen3.6-27B's heads: three programs an
# SM, four at the cap, so a 65-node tree's 480 programs fit one wave). H200, Hv 48, D 128, deep
# drafts, us a call (`benchmarks/gdn_kernels.py --tokens 17,65,257 --steps none --sweep --configs
# c32_w4,c32_w4_s3,c32_w4_r128,c32_w4_r128_s3 --breakdown`; gdn_kernels_h200_prepare_registers.json):
# N = 17: 18.86 -> 17.44 (the cap alone 19.34); N = 65: 35.77 -> 30.85; N = 257: 132.8 -> 120.6.
SMALL_TREE = TreeConfig(num_stages=3)
LARGE_TREE = TreeConfig(num_stages=3, prepare_registers=128)

# The products' precision for 2-byte (bf16 / fp16) inputs: one TF32 product ("tf32") has errors of
# about 1e-3 of the outputs' scale at Qwen3.6-27B's heads, under a bf16 model's own rounding step
# (2^-8 = 3.9e-3 relative), and takes a quarter less time than three (H200, us a call at 16 / 17 /
# 65 / 257 nodes: 14.4 / 17.6 / 31.1 / 121.8 -> 10.4 / 13.1 / 22.9 / 94.4, gdn_kernels_h200_tf32_fold.json;
# a 27B round at 8192 tokens, budget 64: 20.70 -> 20.28 ms). Float32 inputs always take
# TreeConfig's "tf32x3", the float32 reference's accuracy. DDTREE_GDN_TREE_PRECISION=tf32x3 (or
# ieee) gives 2-byte inputs that accuracy too.
TWO_BYTE_PRECISION = os.environ.get("DDTREE_GDN_TREE_PRECISION", "tf32")
if TWO_BYTE_PRECISION not in ("tf32", "tf32x3", "ieee"):
    raise ValueError(f"DDTREE_GDN_TREE_PRECISION must be tf32, tf32x3 or ieee, got {TWO_BYTE_PRECISION!r}")


def tree_config(n: int, dtype: torch.dtype = torch.float32) -> TreeConfig:
    """The tiling for a tree of n nodes whose values are `dtype`: SMALL_TREE up to 32 nodes,
    LARGE_TREE above, with `TWO_BYTE_PRECISION` products for bf16 / fp16 values. Of 11 accurate
    tilings before these two (`benchmarks/gdn_kernels.py --sweep`) TreeConfig() was the fastest or
    within 6% at N = 16, 17, 65, 257; 64 ancestor columns per step were 1-27% slower, 8 warps
    21-65%, 32-node blocks 56-187%; `root_first` -5% to +3% (not taken)."""
    config = SMALL_TREE if n <= 32 else LARGE_TREE
    if dtype != torch.float32:
        config = replace(config, precision=TWO_BYTE_PRECISION, solve_precision=TWO_BYTE_PRECISION)
    return config


def _pow2_dim(d: int) -> bool:
    return 16 <= d <= 256 and d & (d - 1) == 0


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor | None = None) -> bool:
    """Whether both kernels handle these inputs: Triton present, a GPU (or Triton's interpreter),
    Dk and Dv powers of two in [16, 256], whole value-head groups (Hv % Hk == 0), float32 / bf16 /
    fp16 q, k, v, and a contiguous float32 state [Hv, Dk, Dv]."""
    if triton is None or not (q.is_cuda or _INTERPRETED):
        return False
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[0] != q.shape[0]:
        return False
    return (q.dtype in DTYPES and k.dtype in DTYPES
            and supported_heads(k.shape[1], k.shape[2], v.shape[1], v.shape[2], v.dtype, state))


def supported_heads(hk: int, dk: int, hv: int, dv: int, dtype: torch.dtype, state: torch.Tensor | None = None) -> bool:
    """`supported`'s conditions on the head layout, the value dtype and the state alone (a layer
    asks before it makes q, k, v)."""
    ok = _pow2_dim(dk) and _pow2_dim(dv) and hv % hk == 0 and dtype in DTYPES
    if state is not None:
        ok = ok and state.dtype == torch.float32 and state.is_contiguous() and tuple(state.shape) == (hv, dk, dv)
    return ok


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def tree_gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     visible: torch.Tensor, state: torch.Tensor, config: TreeConfig | None = None,
                     u_out: torch.Tensor | None = None, G_out: torch.Tensor | None = None) -> torch.Tensor:
    """Every node of a tree from `state` (read only). q, k [N, Hk, Dk] (L2-normalised, q scaled);
    v [N, Hv, Dv]; g, beta [N, Hv]; visible [N, N] bool, the ancestor-or-self mask, nodes in
    topological order; state [Hv, Dk, Dv] float32. -> o [N, Hv, Dv] float32.

    Scratch (torch allocations, freed on return): the coefficients over the ancestor lists, sized
    for the worst case (every earlier node an ancestor), about 4 Hv N^2 bytes (13 MB at N = 257,
    200 MB at 1025 with Hv 48), plus 12 Hv N Dv bytes. u_out [Hv, N, Dv] float32, if given,
    receives each node's new value u (the solve's result, kept for `fold_path`); G_out [N, Hv]
    float32, if given, each node's path-summed log-decay G (`gated_deltanet.path_decay`), which
    the prepare launch finds anyway (for `fold_path` too)."""
    if k.shape[0] == 1:  # one node: one token of the loop, the state left as it is; its delta is u
        if G_out is not None:
            G_out.copy_(g)
        return _token_loop(q, k, v, g, beta, state, None, RECURRENT_DEFAULT, write_state=False, delta_out=u_out)
    launches = TreeLaunches(q, k, v, g, beta, visible, state, config, u_out, G_out)
    launches.prepare()
    launches.solve()
    return launches.result()


class TreeLaunches:
    """One `tree_gated_delta` call of N >= 2 nodes: its scratch, allocated here, and its two
    launches, run by `prepare()` then `solve()`; `result()` -> o. Apart so that a benchmark can
    time each (`benchmarks/gdn_kernels.py --breakdown`): `prepare("lists")` runs only the
    programs of part 0 (ancestor lists, A, P, T, P_bb), `prepare("rhs")` only the state products'."""

    def __init__(self, q, k, v, g, beta, visible, state, config: TreeConfig | None = None,
                 u_out: torch.Tensor | None = None, G_out: torch.Tensor | None = None):
        n, hk, dk = k.shape
        config = config or tree_config(n, v.dtype)
        hv, dv = v.shape[1], v.shape[2]
        self.q, self.k, self.v = _unit_last(q), _unit_last(k), _unit_last(v)
        self.g, self.beta = g.float(), beta.float()
        self.visible, self.state, self.config, self.n = visible, state, config, n
        bt, bc = config.block_t, config.block_c
        self.block_v, self.prepare_v = min(config.block_v, dv), min(config.prepare_v, dv)
        self.root = int(config.root_first)
        self.blocks = triton.cdiv(n - self.root, bt)  # the solve's blocks
        self.rhs_blocks = triton.cdiv(n, bt)  # the state products' (all n nodes)
        # block b's list at bt b (b - 1) / 2 + root b, at most bt b + root long
        self.slots = bt * self.blocks * (self.blocks - 1) // 2 + self.root * self.blocks + bc
        f32 = dict(dtype=torch.float32, device=q.device)
        self.out = torch.empty(n, hv, dv, **f32)
        self.cols = torch.empty(self.slots, dtype=torch.int32, device=q.device)
        self.counts = torch.empty(self.blocks, dtype=torch.int32, device=q.device)
        self.coef = torch.empty(2, hv, self.slots, bt, **f32)  # A and P over each block's ancestor list [slot, row]
        self.diag = torch.empty(2, hv, self.blocks, bt, bt, **f32)  # T = (I + A_bb)^-1 and P_bb
        self.rhs = torch.empty(2, hv, n, dv, **f32)  # beta (v - exp(G) k S) and exp(G) q S
        self.root_qk = torch.empty(hv, **f32)  # root_first: q_0 . k_0
        self.u_out = u_out
        self.direct = u_out is not None and u_out.is_contiguous()
        self.u = u_out if self.direct else torch.empty(hv, n, dv, **f32)
        self.G_out = G_out
        self.meta = dict(DK=dk, DV=dv, BLOCK_T=bt, BLOCK_C=bc, ROOT=self.root, num_warps=config.num_warps,
                         num_stages=config.num_stages)

    def prepare(self, parts: str = "all") -> None:
        """The prepare launch: every part ("all"), or part 0 alone ("lists") or the rest ("rhs")."""
        q, k, v, g, beta, config = self.q, self.k, self.v, self.g, self.beta, self.config
        hv, dv = v.shape[1], v.shape[2]
        tiles = dv // self.prepare_v
        first, count = {"all": (0, 1 + tiles), "lists": (0, 1), "rhs": (1, tiles)}[parts]
        mask = self.visible.contiguous().view(torch.uint8)
        strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                   g.stride(0), g.stride(1), beta.stride(0), beta.stride(1))
        store_g = self.G_out is not None
        g_out = self.G_out if store_g else self.out  # unused unless STORE_G
        _tree_prepare[(hv, self.rhs_blocks, count)](
            q, k, v, g, beta, mask, self.state, self.cols, self.counts, self.coef, self.diag, self.rhs, g_out,
            self.root_qk, self.n, self.slots, self.blocks, first, *strides, g_out.stride(0), g_out.stride(1),
            GROUP=hv // k.shape[1],
            BLOCK_V=self.prepare_v, BLOCK_W=config.block_w, BLOCK_K=min(config.block_k, k.shape[2]),
            PRECISION=config.precision, STORE_G=store_g, maxnreg=config.prepare_registers, **self.meta)

    def solve(self) -> None:
        hv, dv = self.v.shape[1], self.v.shape[2]
        _tree_solve[(hv, dv // self.block_v)](self.cols, self.counts, self.coef, self.diag, self.rhs, self.root_qk,
                                              self.u, self.out, self.n, self.slots, BLOCK_V=self.block_v,
                                              PRECISION=self.config.solve_precision, **self.meta)

    def result(self) -> torch.Tensor:
        """o [N, Hv, Dv] float32 (and u into u_out, where it was not written in place)."""
        if self.u_out is not None and not self.direct:
            self.u_out.copy_(self.u)
        return self.out


def recurrent_gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          state: torch.Tensor, length: torch.Tensor | int | None = None,
                          config: RecurrentConfig | None = None) -> torch.Tensor:
    """The token loop from `state`, updated in place to the state after the first `length` tokens
    (a 0-d integer tensor on the device, read by the kernel; an int; None: all T). Shapes as
    `tree_gated_delta` with T tokens. -> o [T, Hv, Dv] float32."""
    return _token_loop(q, k, v, g, beta, state, length, config or RECURRENT_DEFAULT, write_state=True)


def _token_loop(q, k, v, g, beta, state, length, config: RecurrentConfig, write_state: bool,
                delta_out: torch.Tensor | None = None) -> torch.Tensor:
    """delta_out [Hv, 1, Dv] (one token only): receives beta (v - (exp(g) S)^T k), the token's u."""
    t, hk, dk = k.shape
    hv, dv = v.shape[1], v.shape[2]
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    g, beta = g.float(), beta.float()
    block_v = min(config.block_v, dv)
    out = torch.empty(t, hv, dv, dtype=torch.float32, device=q.device)
    on_device = isinstance(length, torch.Tensor)
    length_ptr = length.reshape(1) if on_device else out  # unused unless on_device
    length_value = 0 if on_device else (t if length is None else int(length))
    store_delta = delta_out is not None
    delta = delta_out if store_delta and delta_out.is_contiguous() else (
        torch.empty(hv, t, dv, dtype=torch.float32, device=q.device) if store_delta else out)
    _recurrent_kernel[(hv, dv // block_v)](
        q, k, v, g, beta, state, out, delta, length_ptr, length_value, t,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        GROUP=hv // hk, DK=dk, DV=dv, BLOCK_V=block_v, LENGTH_ON_DEVICE=on_device, WRITE_STATE=write_state,
        STORE_DELTA=store_delta, num_warps=config.num_warps)
    if store_delta and delta is not delta_out:
        delta_out.copy_(delta)
    return out


def fold_supported(state: torch.Tensor) -> bool:
    """Whether `fold_path` runs as a kernel: Triton, a GPU (or the interpreter), a contiguous
    float32 state [L, Hv, Dk, Dv] with power-of-two head dims in [16, 256]."""
    return (triton is not None and (state.is_cuda or _INTERPRETED) and state.dtype == torch.float32
            and state.dim() == 4 and state.is_contiguous() and _pow2_dim(state.shape[2]) and _pow2_dim(state.shape[3]))


def fold_path(state: torch.Tensor, k: torch.Tensor, u: torch.Tensor, G: torch.Tensor, order: torch.Tensor,
              length: torch.Tensor, config: FoldConfig | None = None) -> None:
    """`models.gated_deltanet.fold_path` in one launch for every layer: state [L, Hv, Dk, Dv]
    (float32, in place) advanced by the path `order` [M] (root first; the first `length` real,
    a 0-d device tensor; 0 leaves the state) from the verify's stash k [L, N, Hk, Dk], u [L, Hv, N, Dv], G [L, N, Hv].
    One program per (layer, value head, state tile) holds its tile in registers and adds the
    path's M rank-one terms."""
    config = config or FOLD_DEFAULT
    layers, hv, dk, dv = state.shape
    block_k, block_v = min(config.block_k, dk), min(config.block_v, dv)
    k, u, G = k.float(), u.float(), G.float()
    _fold_kernel[(layers, hv, (dk // block_k) * (dv // block_v))](
        state, k, u, G, order, length.reshape(1), order.shape[0],
        k.stride(0), k.stride(1), k.stride(2), u.stride(0), u.stride(1), u.stride(2), G.stride(0), G.stride(1),
        GROUP=hv // k.shape[2], DK=dk, DV=dv, BLOCK_K=block_k, BLOCK_V=block_v, num_warps=config.num_warps)


if triton is not None:

    @triton.jit
    def _scan_rows(mask_ptr, g_ptr, cols_ptr, rows, live, start, end, n, h, sg_n, sg_h, store,
                   BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr):
        """Rows `rows` (the block [start, end)): G (their mask rows times g: the log-decay summed
        along each path) and the columns < start that any of them sees, stored compacted at
        cols_ptr (where `store`). -> (G [BLOCK_T], number of columns)."""
        path_g = tl.zeros([BLOCK_T], tl.float32)
        count = 0
        c0 = 0
        while c0 < end:  # the mask is lower-triangular: nothing past the block's last row
            c = c0 + tl.arange(0, BLOCK_W)
            seen = tl.load(mask_ptr + rows[:, None] * n + c[None, :], mask=live[:, None] & (c < end)[None, :],
                           other=0) != 0
            gc = tl.load(g_ptr + c * sg_n + h * sg_h, mask=c < end, other=0.0)
            path_g += tl.sum(tl.where(seen, gc[None, :], 0.0), 1)
            flag = (tl.max(seen.to(tl.int32), 0) > 0) & (c < start)
            at = count + tl.cumsum(flag.to(tl.int32), 0) - 1
            tl.store(cols_ptr + at, c, mask=flag & store)
            count += tl.sum(flag.to(tl.int32), 0)
            c0 += BLOCK_W
        return path_g, count

    @triton.jit
    def _list_path_g(mask_ptr, g_ptr, cols_ptr, c, ok, count, n, h, sg_n, sg_h, BLOCK_C: tl.constexpr):
        """G of the listed columns c: the list holds every ancestor of each of them, so G_c is
        the sum of g over the list entries that c sees."""
        ci = tl.arange(0, BLOCK_C)
        path_g = tl.zeros([BLOCK_C], tl.float32)
        m0 = 0
        while m0 < count:
            m_ok = m0 + ci < count
            m = tl.load(cols_ptr + m0 + ci, mask=m_ok, other=0)
            seen = tl.load(mask_ptr + c[:, None] * n + m[None, :], mask=ok[:, None] & m_ok[None, :], other=0) != 0
            gm = tl.load(g_ptr + m * sg_n + h * sg_h, mask=m_ok, other=0.0)
            path_g += tl.sum(tl.where(seen, gm[None, :], 0.0), 1)
            m0 += BLOCK_C
        return path_g

    @triton.jit
    def _key_products(q_ptr, k_ptr, rows, live, c, c_ok, hk, sq_n, sq_h, sk_n, sk_h, DK: tl.constexpr,
                      BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
        """k_rows . k_c and q_rows . k_c -> two [rows, cols] tiles, Dk in slices of BLOCK_K (loaded
        from the cache each time: whole [rows, Dk] float32 operands would not fit in registers)."""
        kk = tl.zeros([rows.shape[0], c.shape[0]], tl.float32)
        qk = tl.zeros([rows.shape[0], c.shape[0]], tl.float32)
        for d0 in range(0, DK, BLOCK_K):
            d = d0 + tl.arange(0, BLOCK_K)
            kc = tl.load(k_ptr + c[:, None] * sk_n + hk * sk_h + d[None, :], mask=c_ok[:, None], other=0.0)
            kc = tl.trans(kc.to(tl.float32))
            kr = tl.load(k_ptr + rows[:, None] * sk_n + hk * sk_h + d[None, :], mask=live[:, None], other=0.0)
            qr = tl.load(q_ptr + rows[:, None] * sq_n + hk * sq_h + d[None, :], mask=live[:, None], other=0.0)
            kk += tl.dot(kr.to(tl.float32), kc, input_precision=PRECISION)
            qk += tl.dot(qr.to(tl.float32), kc, input_precision=PRECISION)
        return kk, qk

    @triton.jit
    def _state_products(q_ptr, k_ptr, state_ptr, rows, live, hk, dv, sq_n, sq_h, sk_n, sk_h, DK: tl.constexpr,
                        DV: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
        """k_rows S and q_rows S for the value columns dv -> two [rows, BLOCK_V] tiles."""
        ks = tl.zeros([rows.shape[0], BLOCK_V], tl.float32)
        qs = tl.zeros([rows.shape[0], BLOCK_V], tl.float32)
        for d0 in range(0, DK, BLOCK_K):
            d = d0 + tl.arange(0, BLOCK_K)
            s = tl.load(state_ptr + d[:, None] * DV + dv[None, :])
            kr = tl.load(k_ptr + rows[:, None] * sk_n + hk * sk_h + d[None, :], mask=live[:, None], other=0.0)
            qr = tl.load(q_ptr + rows[:, None] * sq_n + hk * sq_h + d[None, :], mask=live[:, None], other=0.0)
            ks += tl.dot(kr.to(tl.float32), s, input_precision=PRECISION)
            qs += tl.dot(qr.to(tl.float32), s, input_precision=PRECISION)
        return ks, qs

    @triton.jit
    def _tree_prepare(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, mask_ptr, state_ptr, cols_ptr, count_ptr, coef_ptr,
                      diag_ptr, rhs_ptr, g_out_ptr, root_qk_ptr, n, slots, blocks, first_part, sq_n, sq_h, sk_n,
                      sk_h, sv_n, sv_h, sg_n, sg_h, sb_n, sb_h, so_n, so_h, GROUP: tl.constexpr, DK: tl.constexpr,
                      DV: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_V: tl.constexpr,
                      BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, STORE_G: tl.constexpr,
                      ROOT: tl.constexpr):
        """Program (value head h, block b, part): everything of block b that does not depend on
        other blocks' u (module docstring). Part 0: the ancestor list, A and P over it, T and P_bb
        (and, STORE_G, the block's G); part p > 0: beta (v - exp(G) k S) and exp(G) q S for value
        tile p - 1. The ancestor lists depend on the mask only: every program writes the same
        values to the same place. ROOT (`TreeConfig.root_first`): part 0's block b holds nodes
        1 + b BLOCK_T ... (`blocks` of them; the launch's last is idle when N - 1 fills whole
        blocks), the state products' nodes b BLOCK_T ..., and block 0's part 0 also stores q_0 . k_0."""
        h = tl.program_id(0)
        b = tl.program_id(1)
        part = first_part + tl.program_id(2)
        hk = h // GROUP
        hv = tl.num_programs(0)
        ti = tl.arange(0, BLOCK_T)
        shift = ROOT * (part == 0)  # the solve's blocks start after node 0; the state products' do not
        start = shift + b * BLOCK_T
        rows = start + ti
        live = rows < n
        base = BLOCK_T * (b * (b - 1) // 2) + ROOT * b
        lists = cols_ptr + base
        path_g, count = _scan_rows(mask_ptr, g_ptr, lists, rows, live, start, tl.minimum(start + BLOCK_T, n), n, h,
                                   sg_n, sg_h, (part == 0) & (b < blocks), BLOCK_T, BLOCK_W)
        beta = tl.load(beta_ptr + rows * sb_n + h * sb_h, mask=live, other=0.0)
        if (part == 0) & (b < blocks):
            if STORE_G:
                tl.store(g_out_ptr + rows * so_n + h * so_h, path_g, mask=live)
                if ROOT:
                    if b == 0:  # node 0's G is its own g
                        tl.store(g_out_ptr + h * so_h, tl.load(g_ptr + h * sg_h))
            if ROOT:
                if b == 0:
                    q0k0 = 0.0
                    for d0 in range(0, DK, BLOCK_K):
                        d = d0 + tl.arange(0, BLOCK_K)
                        q0k0 += tl.sum(tl.load(q_ptr + hk * sq_h + d).to(tl.float32)
                                       * tl.load(k_ptr + hk * sk_h + d).to(tl.float32), 0)
                    tl.store(root_qk_ptr + h, q0k0)
            tl.store(count_ptr + b, count)
            tl.debug_barrier()  # the list is read by other threads
            ci = tl.arange(0, BLOCK_C)
            coef = coef_ptr + (h * slots + base) * BLOCK_T
            j0 = 0
            while j0 < count:  # A and P over the block's ancestors outside it
                ok = j0 + ci < count
                c = tl.load(lists + j0 + ci, mask=ok, other=0)
                gc = _list_path_g(mask_ptr, g_ptr, lists, c, ok, count, n, h, sg_n, sg_h, BLOCK_C)
                seen = tl.load(mask_ptr + rows[:, None] * n + c[None, :], mask=live[:, None] & ok[None, :],
                               other=0) != 0
                decay = tl.exp(tl.where(seen, path_g[:, None] - gc[None, :], float("-inf")))
                kk, qk = _key_products(q_ptr, k_ptr, rows, live, c, ok, hk, sq_n, sq_h, sk_n, sk_h, DK, BLOCK_K,
                                       PRECISION)
                slot = (j0 + ci[None, :]) * BLOCK_T + ti[:, None]  # [slot, row] layout: the solve loads A^T
                tl.store(coef + slot, beta[:, None] * kk * decay, mask=ok[None, :])
                tl.store(coef + hv * slots * BLOCK_T + slot, qk * decay, mask=ok[None, :])
                j0 += BLOCK_C
            # The block itself: T = (I + A_bb)^-1 by Jacobi sweeps, and P_bb.
            seen = tl.load(mask_ptr + rows[:, None] * n + rows[None, :], mask=live[:, None] & live[None, :],
                           other=0) != 0
            decay = tl.exp(tl.where(seen, path_g[:, None] - path_g[None, :], float("-inf")))
            kk, qk = _key_products(q_ptr, k_ptr, rows, live, rows, live, hk, sq_n, sq_h, sk_n, sk_h, DK, BLOCK_K,
                                   PRECISION)
            strict = ti[:, None] > ti[None, :]
            a = tl.where(strict, beta[:, None] * kk * decay, 0.0)
            eye = (ti[:, None] == ti[None, :]).to(tl.float32)
            t = eye
            sweeps = tl.max(tl.sum((seen & strict).to(tl.int32), 1), 0)  # the longest in-block chain
            while sweeps > 0:
                t = eye - tl.dot(a, t, input_precision=PRECISION)
                sweeps -= 1
            square = ((h * blocks + b) * BLOCK_T + ti[:, None]) * BLOCK_T + ti[None, :]
            tl.store(diag_ptr + square, t)
            tl.store(diag_ptr + hv * blocks * BLOCK_T * BLOCK_T + square, qk * decay)
        if part > 0:
            dv = (part - 1) * BLOCK_V + tl.arange(0, BLOCK_V)
            ks, qs = _state_products(q_ptr, k_ptr, state_ptr + h * DK * DV, rows, live, hk, dv, sq_n, sq_h, sk_n,
                                     sk_h, DK, DV, BLOCK_V, BLOCK_K, PRECISION)
            vb = tl.load(v_ptr + rows[:, None] * sv_n + h * sv_h + dv[None, :], mask=live[:, None], other=0.0)
            eg = tl.exp(path_g)[:, None]
            tile = (h * n + rows[:, None]) * DV + dv[None, :]
            tl.store(rhs_ptr + tile, beta[:, None] * (vb.to(tl.float32) - eg * ks), mask=live[:, None])
            tl.store(rhs_ptr + hv * n * DV + tile, eg * qs, mask=live[:, None])

    @triton.jit
    def _solve_loads(cols_ptr, count_ptr, coef_ptr, diag_ptr, rhs_ptr, h, b, blocks, n, slots, hv, dv,
                     DV: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, ROOT: tl.constexpr):
        """Block b's inputs that do not wait on u: its ancestor count, first BLOCK_C ancestors and
        their A and P columns (the scratch has BLOCK_C entries of slack past the last list, so these
        loads need no count; entries past it are garbage until masked), T, P_bb, rhs0, exp(G) q S.
        b may be one past the last block (all masked)."""
        ti = tl.arange(0, BLOCK_T)
        ci = tl.arange(0, BLOCK_C)
        real = b < blocks
        rows = ROOT + b * BLOCK_T + ti
        live = rows < n
        base = BLOCK_T * (b * (b - 1) // 2) + ROOT * b
        count = tl.load(count_ptr + b, mask=real, other=0)
        c = tl.load(cols_ptr + base + ci)
        slot = ((h * slots + base + ci[:, None]) * BLOCK_T + ti[None, :])
        a = tl.load(coef_ptr + slot)
        p = tl.load(coef_ptr + hv * slots * BLOCK_T + slot)
        square = ((h * blocks + b) * BLOCK_T + ti[:, None]) * BLOCK_T + ti[None, :]
        t = tl.load(diag_ptr + square, mask=real, other=0.0)
        p_bb = tl.load(diag_ptr + hv * blocks * BLOCK_T * BLOCK_T + square, mask=real, other=0.0)
        tile = (h * n + rows[:, None]) * DV + dv[None, :]
        rhs = tl.load(rhs_ptr + tile, mask=live[:, None], other=0.0)
        o = tl.load(rhs_ptr + hv * n * DV + tile, mask=live[:, None], other=0.0)
        return count, c, a, p, t, p_bb, rhs, o

    @triton.jit
    def _tree_solve(cols_ptr, count_ptr, coef_ptr, diag_ptr, rhs_ptr, root_qk_ptr, u_ptr, out_ptr, n, slots,
                    DK: tl.constexpr, DV: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                    BLOCK_V: tl.constexpr, PRECISION: tl.constexpr, ROOT: tl.constexpr):
        """Program (value head h, value tile): u and o block by block (module docstring). Each
        block's inputs that do not depend on u are loaded while the block before finishes, so a
        block waits on one round trip: the gather of its ancestors' u. ROOT: node 0 first, u_0 =
        its right-hand side and o_0 = exp(g_0) q_0 S + (q_0 . k_0) u_0; the blocks follow it."""
        h = tl.program_id(0)
        hv = tl.num_programs(0)
        dv = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        ti = tl.arange(0, BLOCK_T)
        ci = tl.arange(0, BLOCK_C)
        blocks = (n - ROOT + BLOCK_T - 1) // BLOCK_T
        coef_p = coef_ptr + hv * slots * BLOCK_T
        b = 0
        count, c, a, p, t, p_bb, rhs, o = _solve_loads(cols_ptr, count_ptr, coef_ptr, diag_ptr, rhs_ptr, h, b, blocks,
                                                       n, slots, hv, dv, DV, BLOCK_T, BLOCK_C, ROOT)
        if ROOT:
            u0 = tl.load(rhs_ptr + h * n * DV + dv)
            tl.store(u_ptr + h * n * DV + dv, u0)
            o0 = tl.load(rhs_ptr + (hv * n + h * n) * DV + dv) + tl.load(root_qk_ptr + h) * u0
            tl.store(out_ptr + h * DV + dv, o0)
            tl.debug_barrier()  # u_0 is read by other threads in every block's gather
        while b < blocks:
            rows = ROOT + b * BLOCK_T + ti
            live = rows < n
            base = BLOCK_T * (b * (b - 1) // 2) + ROOT * b
            ok = ci < count
            uc = tl.load(u_ptr + (h * n + c[:, None]) * DV + dv[None, :], mask=ok[:, None], other=0.0)
            a = tl.where(ok[:, None], a, 0.0)
            p = tl.where(ok[:, None], p, 0.0)
            rhs -= tl.dot(tl.trans(a), uc, input_precision=PRECISION)
            o += tl.dot(tl.trans(p), uc, input_precision=PRECISION)
            j0 = BLOCK_C
            while j0 < count:  # ancestors past the first BLOCK_C (large trees)
                ok = j0 + ci < count
                cj = tl.load(cols_ptr + base + j0 + ci, mask=ok, other=0)
                slot = (h * slots + base + j0 + ci[:, None]) * BLOCK_T + ti[None, :]
                aj = tl.load(coef_ptr + slot, mask=ok[:, None], other=0.0)
                pj = tl.load(coef_p + slot, mask=ok[:, None], other=0.0)
                uj = tl.load(u_ptr + (h * n + cj[:, None]) * DV + dv[None, :], mask=ok[:, None], other=0.0)
                rhs -= tl.dot(tl.trans(aj), uj, input_precision=PRECISION)
                o += tl.dot(tl.trans(pj), uj, input_precision=PRECISION)
                j0 += BLOCK_C
            u = tl.dot(t, rhs, input_precision=PRECISION)
            tl.store(u_ptr + (h * n + rows[:, None]) * DV + dv[None, :], u, mask=live[:, None])
            o += tl.dot(p_bb, u, input_precision=PRECISION)
            tl.store(out_ptr + (rows[:, None] * hv + h) * DV + dv[None, :], o, mask=live[:, None])
            b += 1
            count, c, a, p, t, p_bb, rhs, o = _solve_loads(cols_ptr, count_ptr, coef_ptr, diag_ptr, rhs_ptr, h, b,
                                                           blocks, n, slots, hv, dv, DV, BLOCK_T, BLOCK_C, ROOT)
            tl.debug_barrier()  # u is read by other threads for later blocks

    @triton.jit
    def _recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, delta_ptr, length_ptr,
                          length_value, t_len, sq_n, sq_h, sk_n, sk_h, sv_n, sv_h, sg_n, sg_h, sb_n, sb_h,
                          GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_V: tl.constexpr,
                          LENGTH_ON_DEVICE: tl.constexpr, WRITE_STATE: tl.constexpr, STORE_DELTA: tl.constexpr):
        """Program (value head h, value tile): the state tile through t_len tokens, then written
        back (WRITE_STATE)."""
        h = tl.program_id(0)
        hk = h // GROUP
        dk = tl.arange(0, DK)
        dv = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        at = state_ptr + h * DK * DV + dk[:, None] * DV + dv[None, :]
        s = tl.load(at)  # [DK, BLOCK_V]
        if LENGTH_ON_DEVICE:
            length = tl.load(length_ptr).to(tl.int32)
        else:
            length = length_value
        i = 0
        while i < t_len:
            live = i < length  # rows past it: decay 1, write 0 (the state stays bit for bit)
            gi = tl.where(live, tl.load(g_ptr + i * sg_n + h * sg_h), 0.0)
            bi = tl.where(live, tl.load(beta_ptr + i * sb_n + h * sb_h), 0.0)
            ki = tl.load(k_ptr + i * sk_n + hk * sk_h + dk).to(tl.float32)
            qi = tl.load(q_ptr + i * sq_n + hk * sq_h + dk).to(tl.float32)
            vi = tl.load(v_ptr + i * sv_n + h * sv_h + dv).to(tl.float32)
            s = s * tl.exp(gi)
            delta = bi * (vi - tl.sum(s * ki[:, None], 0))
            s = s + ki[:, None] * delta[None, :]
            if STORE_DELTA:  # laid out [Hv, T, Dv], as the tree's u
                tl.store(delta_ptr + (h * t_len + i) * DV + dv, delta)
            o = tl.sum(s * qi[:, None], 0)
            tl.store(out_ptr + (i * tl.num_programs(0) + h) * DV + dv, o)
            i += 1
        if WRITE_STATE:
            tl.store(at, s)

    @triton.jit
    def _fold_kernel(state_ptr, k_ptr, u_ptr, g_ptr, order_ptr, length_ptr, m,
                     sk_l, sk_n, sk_h, su_l, su_h, su_n, sg_l, sg_n,
                     GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK_V: tl.constexpr):
        """Program (layer l, value head h, state tile): S <- exp(G_last) S + sum_j exp(G_last - G_j)
        k_j u_j^T over the path's first `length` nodes (none: S is left as it is)."""
        l = tl.program_id(0)
        h = tl.program_id(1)
        hk = h // GROUP
        tiles_v: tl.constexpr = DV // BLOCK_V
        dk = (tl.program_id(2) // tiles_v) * BLOCK_K + tl.arange(0, BLOCK_K)
        dv = (tl.program_id(2) % tiles_v) * BLOCK_V + tl.arange(0, BLOCK_V)
        length = tl.load(length_ptr).to(tl.int32)
        last = tl.load(order_ptr + tl.maximum(length - 1, 0))
        g_last = tl.where(length > 0, tl.load(g_ptr + l * sg_l + last * sg_n + h), 0.0)
        at = state_ptr + ((l * tl.num_programs(1) + h) * DK + dk[:, None]) * DV + dv[None, :]
        s = tl.load(at) * tl.exp(g_last)  # [BLOCK_K, BLOCK_V]
        steps = tl.minimum(length, m)  # the caller clamps it too; nodes past it are not on the path
        j = 0
        while j < steps:
            node = tl.load(order_ptr + j)
            weight = tl.exp(g_last - tl.load(g_ptr + l * sg_l + node * sg_n + h))
            kj = tl.load(k_ptr + l * sk_l + node * sk_n + hk * sk_h + dk)
            uj = tl.load(u_ptr + l * su_l + h * su_h + node * su_n + dv)
            s += (weight * kj)[:, None] * uj[None, :]
            j += 1
        tl.store(at, s)
