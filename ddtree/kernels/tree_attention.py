"""Masked attention of a few new tokens over a cached context, as one Triton kernel: the verify of
a tree, an autoregressive step, the drafter's block.

PyTorch's attention with a boolean/additive mask gives each (KV head, 64-row query tile) one
program that walks every key: at Qwen3-8B shape that is 8 programs for an autoregressive step
(27 us per layer, 1.0 ms per forward, where reading the keys takes a few microseconds). Here:

- rows are (token, query head of the KV head's group) pairs, read straight from q [N, Hq, D], so
  the keys and values of a KV head are read once for its whole group, with no copies in or out;
- the keys are split across programs (flash-decoding) until the GPU is full; the last split of
  each row block to finish (an arrival counter) combines the splits' partial softmax sums, so a
  split costs no second launch (when the partials are few; else a combine kernel does it);
- the mask is either a boolean [N, kv_len] (read as bytes; each program skips the key blocks
  none of its rows sees, `key_range`), or, as the engine's verify and drafter block pass it, a
  prefix length n (a device scalar: keys [0, n) are seen by every row) and a block mask [N, M]
  for keys [n, n + M): the tree's ancestor-only visibility, or the drafter block's all-True.
  Then no [N, kv_len] mask or key range is made per forward (two to four fewer launches a round)
  and only the M block columns are read from memory; the prefix's whole key blocks go through an
  inner loop with no mask, bounds or empty-row guard (FlashAttention's), which at long contexts is
  nearly all of the work.

The batched form (`batched_masked_attention`) is the prefix form for R sequences of a batch in one
launch, each row of the KV cache read from its own first slot with its own prefix length: q holds
R rows of M tokens (shorter rows padded), the block mask is [R, M, C], the prefix lengths and
first slots are [R] device tensors, and the grid's split axis becomes the batch's work items. Each
program reads every row's prefix length and finds its row and keys: the rows' keys are cut in
items of one length (`row_items`), so that a long row among short ones is spread over the GPU as
it would be alone, where a split planned alike for every row over the bucket's bound left it to a
few programs. The items' count follows (R, M, heads, a static bound on a row's keys `max_kv`)
alone, not the prefix lengths, so one CUDA graph serves a batch bucket; an item past the batch's
last reads nothing. (Below BALANCE_MIN_KEYS, or with `balance_rows` off: every row split alike
over max_kv, a split past its row's keys reading nothing and counting in the combine as seeing
nothing.)

Measured on an H200 at Qwen3-8B shape: 0.99 -> 0.22 ms of attention per one-token forward (the
combine folded in); at 257 tokens 38.7 us per layer for PyTorch's path, 24.3 us here
(benchmarks/README.md).

Exact attention (online softmax in float32); it differs from PyTorch's only in summation order.

Opt-in (`DDTREE_CUDNN_PREFIX=1`, `cudnn_prefix`): a long prefix's first keys through cuDNN, in
chunks run as a batch, merged in the combine launch; faster for the attention alone at many rows,
in a whole round only at Qwen3.6-27B shape over 32k tokens (5% at budget 256; the measurements are
at CUDNN_PREFIX). cuDNN through PyTorch in two forms that would take every prefix key was tried and
not kept (benchmarks/README.md): with the key lengths on the device (the ragged form) it took 42-50
ms a call and its graph capture failed; with an additive mask over a KV bucket's keys it was
1.3-2.9x slower than without one.

Tried and not kept: the prefix's key and value tiles through Hopper's TMA (tensor descriptors),
with and without Triton's warp specialisation of the loop: 5-10% slower than these loads at
Qwen3-8B heads over 32k keys (N = 17, 65, 257; attention_configs_h200_tma_8b.json), and the warp-
specialised loop did not compile at head_dim 256; made on the device in the unmasked prefix loop
again later, 3-10% slower at 65 and 257 tokens and within 2% at 1 and 17
(attention_configs_h200_tma_{32_8_128_32768,24_4_256_8192}.json). And a tree's last few query
rows ((B + 1) x group rows leave `group` past whole 128-row blocks: 4 of 260 at Qwen3-8B heads and N = 65, 6 of
390 at Qwen3.6-27B's) riding in a 16-row tile with the first block's programs, on its key tiles,
instead of a block of their own: 1.36-1.43x slower where it applied (H200, us per layer: 27B heads
over 8192 keys, N = 65 64.3 -> 91.9, N = 257 143.0 -> 207.8; 8B heads over 32k keys, N = 65
111.7 -> 151.9, N = 257 326.8 -> 465.9; attention_configs_h200_tail_{27b,8b}.json), the second
accumulator beside a 128-row one costing more than the block it saved. And the next key block's
q.k issued before this block's softmax (FlashAttention-3's overlap within a warp group, by hand):
slower at every shape timed (H200, us per layer: 8B heads over 32k keys N = 65 113.6 -> 137.5,
N = 257 339.6 -> 408.6; 27B heads over 8192 keys N = 257 169.5 -> 206.0;
attention_configs_h200_qk_ahead_{8b,27b}.json).
"""
from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, replace

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_wait
except ImportError:  # the CPU install has no Triton: `layers.attend` uses PyTorch's attention
    triton = None

# The last split combines in the kernel only while it reads at most this many partial rows
# (block_m x splits): H200, Qwen3-8B heads, per layer: N = 1 (16 x 12) 8.6 -> 5.9 us, N = 257
# (64 x 2) 25.3 -> 24.3; but N = 17 (64 x 12) 13.5 -> 22.7, one program reading them all.
FOLD_MAX_PARTIALS = 512
BALANCE_MIN_KEYS = 4096  # a batch's bound on a row's keys from which its split follows the rows' keys
BALANCE_MAX_ROWS = 32  # ... for rows (tokens x group) of at most this many a batch row: DEFAULT's tiles
# Arrival counters: a split launch combines in the kernel only while its (row block, KV head, batch
# row) tiles are at most this many (else a combine kernel does it). Automatic splitting stops at a
# few programs per SM, far below it; forced splits or many batch rows can pass it.
MAX_SPLIT_TILES = 4096
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
log = logging.getLogger("ddtree.tree_attention")


def supported(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the kernel handles these shapes: head_dim a power of two in [16, 256], whole GQA groups."""
    d = q.shape[-1]
    return (triton is not None and d >= 16 and d <= 256 and d & (d - 1) == 0
            and q.shape[1] % k.shape[1] == 0 and q.dtype in (torch.bfloat16, torch.float16, torch.float32))


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # Triton's interpreter (tests): enough to exercise the split path
    return torch.cuda.get_device_properties(device).multi_processor_count


@dataclass(frozen=True)
class AttentionConfig:
    """Tiling of the kernel. `block_m`: query rows per program (0: the smallest of 16/32/64 that
    holds all rows); `programs_per_sm`: keys are split until about this many programs per SM."""

    block_m: int = 0
    block_n: int = 64
    programs_per_sm: int = 2
    num_warps: int = 4
    num_stages: int = 2  # H200: the fastest of 48 tilings at N = 1, 65, 129, 257, 513; within 6% at 17, 1025
    fold_combine: bool = True  # the last split combines (no second launch) when FOLD_MAX_PARTIALS allows
    combine_loads: int = 8192  # float32 partial-sum elements the combine loads at once (splits x [rows, D])
    # Head dims per program of the combine launch: its programs are (16-row block, KV head, dim chunk).
    # Whole rows (D) per program made one autoregressive step's combine at Qwen3.6-27B heads over
    # 8192 keys (6 rows, 66 splits) 4 programs of 33 dependent loads each: 40.8 us a layer, against
    # 14.5 for the attention itself (verify_profile_h200_qwen36_27b_8192.json).
    combine_block_d: int = 32
    # The combine launch reads its rows' partial sums as [splits, rows, dims] tiles, every split at
    # once where `combine_loads` allows, and sums over the splits in registers, instead of a split
    # at a time (about 0.45 us a split: the per-split weight's layout change, a barrier each, kept
    # the loads from overlapping). None: tiled where one 16-row block holds the launch's rows (an
    # autoregressive step). H200, us a layer, split-at-a-time -> tiled: one token over 8192 keys at
    # Qwen3.6-27B heads (66 splits) 29.6 -> 3.1, over 32768 at Qwen3-8B's (33) 15.6 -> 3.1; but
    # 17 / 65 tokens at 27B heads 5.8 -> 6.7 / 3.9 -> 7.0, 65 / 257 at 8B's 7.3 -> 13.5 / 9.2 -> 16.0
    # (fewer splits, more rows; attention_profile_h200_*_tilings.json).
    combine_tiled: bool | None = None
    # A batch's key splits follow its rows' key counts, read on the device (`plan_rows`, `row_items`):
    # a row gets programs in proportion to its keys. False: every row gets the same splits, planned
    # over max_kv, so one long row among short ones runs on a few programs alone. None: where max_kv
    # is BALANCE_MIN_KEYS or more. Each program works the plan out before its first key tile (two
    # binary searches over the rows' tiles, 4 to 17 reductions of R values in all for 4 to 32 rows
    # at 32k keys, as planned for an H200), a cost not worth it where no row can be long.
    balance_rows: bool | None = None


DEFAULT = AttentionConfig()
# Many rows over a long context is compute-bound: FlashAttention's larger tiles (8 warps, 128 rows,
# a third pipeline stage). H200, Qwen3-8B heads, 32k cached keys, us per layer, DEFAULT -> LONG:
# N = 17: 69.3 -> 58.7, N = 65: 216 -> 115, N = 257: 698 -> 371 (attention_configs_h200_long.json).
LONG = AttentionConfig(block_m=128, num_warps=8, num_stages=3)
LONG_KV_MIN = 4096  # keys from which LONG serves rows > 32 at head_dim <= 128 (> 128 at 256)
# At head_dim 256 a third stage does not fit in shared memory. H200, Qwen3.6-27B heads (24/4/256),
# 8192 cached keys, N = 65 (390 rows): 133.0 us with 32-row blocks, 75.7 with these tiles
# (attention_configs_h200_qwen36_27b_8k.json). One program an SM: its tiles take 205 KB of shared
# memory and 255 registers a thread (compiled for sm_90, scripts/check_kernels_compile.py), so a
# second one per SM only made a second wave: 53.3 -> 45.8 us for the attention and 9.8 -> 3.9 for
# the combine launch at N = 65 (16 layers' caches in turn; benchmarks/attention_profile.py).
LONG_256 = AttentionConfig(block_m=128, num_warps=8, num_stages=2, programs_per_sm=1)
# 64-row blocks at head_dim 256 (33-128 rows): 168 KB of shared memory, one program an SM as well.
# Same run, N = 17 (102 rows): 28.5 -> 24.7 us, combine 21.1 -> 5.9.
MID_256 = replace(DEFAULT, programs_per_sm=1)

# Opt-in (DDTREE_CUDNN_PREFIX=1): a long prefix's first keys through cuDNN (PyTorch's
# `_scaled_dot_product_cudnn_attention`, FlashAttention-3 class on Hopper), the keys cut into
# chunks that run as a batch so that its programs fill the GPU, merged with the kernel's own part
# (the prefix's last keys and the tree's block) by log-sum-exp in its combine launch. Off by
# default because no whole round has gained from it yet. H200, us a layer (benchmarks/README.md,
# "Long contexts"): the attention alone, kernel -> with cuDNN's prefix, Qwen3-8B heads over 32768
# keys N = 17 49.2 -> 52.6, 65 113.1 -> 102.4, 257 330.3 -> 284.7; Qwen3.6-27B heads over 8192 keys
# N = 17 28.0 -> 38.1, 65 49.8 -> 49.3, 257 174.4 -> 130.3, over 32768 N = 65 153.6 -> 119.3, 257
# 586.5 -> 389.3 (attention_configs_h200_cudnn_prefix_{8b,27b}.json). Whole Qwen3-8B-shape rounds
# at 32768 tokens, ms, off -> on: 16 7.85 -> 8.17, 64 10.49 -> 10.60, 256 22.10 -> 22.14: in a round
# the kernel's part also holds the keys between the guaranteed prefix (below) and the real one,
# up to CUDNN_QUANTUM + a KV bucket + the tree, which ate the gain: with those keys left to the
# kernel (attention_configs.py --cudnn-prefix round) 8B heads over 32768 keys took 113.2 -> 115.6 us
# at N = 65 and 330.3 -> 326.7 at 257, while 27B heads kept most of theirs (N = 65 153.4 -> 135.6,
# 257 588.8 -> 397.7; nothing at 8192 keys): Qwen3.6-27B-shape rounds at 32768 tokens, 64 21.53 ->
# 21.35 ms, 256 41.20 -> 39.13 (attention_configs_h200_cudnn_prefix_round_{8b,27b}.json,
# round_latency_h200_qwen36_27b_32k_cudnn_prefix_{0,1}.json). Not a default: it gained only at
# head_dim 256 over long contexts, and each 1024-key quantum adds a cuDNN plan (37-70 ms) to the
# capture of its graphs.
CUDNN_PREFIX = os.environ.get("DDTREE_CUDNN_PREFIX", "0") == "1"
CUDNN_MIN_KEYS = 8192  # a guaranteed prefix at least this long
CUDNN_MIN_ROWS = 65  # query rows per KV head
# cuDNN's keys end at the guaranteed prefix rounded down to this: a new cuDNN plan (37-70 ms to
# build on the H200) every 1024 keys.
CUDNN_QUANTUM = 1024
_CUDNN_FAILED: set = set()


def cudnn_splits(rows: int, kv_heads: int, head_dim: int, keys: int, sms: int) -> int:
    """Chunks of the keys for `cudnn_prefix` (a power of two, each at least 512 keys): 16 at
    head_dim <= 128, where more waves of cuDNN's programs kept getting faster (H200, Qwen3-8B heads
    over 32768 keys, N = 257: 1 / 4 / 16 chunks 389 / 307 / 240 us for cuDNN's call alone); at
    head_dim 256 as many as fill one wave of its 128-row programs (Qwen3.6-27B heads over 8192 keys:
    N = 65 8 chunks 32.0 us against 16 35.2; N = 257 2 chunks 97.5 against 16 104.7;
    attention_cudnn_chunks_h200.json)."""
    want = 16 if head_dim <= 128 else max(1, sms // (kv_heads * -(-rows // 128)))
    want = max(1, min(want, 16, keys // 512))
    return 1 << (want.bit_length() - 1)


def cudnn_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: int, splits: int,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN's attention of q [N, Hq, D] over keys [0, keys) of k, v [T, Hkv, D] (no mask; any
    strides with a unit last one), the keys cut into `splits` chunks run as a batch -> (o, lse):
    o [splits, Hkv, N * group, D] in q's dtype, each chunk's normalised output with rows in the
    kernel's order (token * group + g); lse [splits, Hkv, N * group] float32, the natural log of
    each row's softmax denominator over its chunk (scale applied)."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    rows = n * (hq // hkv)
    chunk = keys // splits
    qf = q.view(n, hkv, hq // hkv, d).permute(1, 0, 2, 3).reshape(hkv, rows, d)
    kb = k.as_strided((splits, hkv, chunk, d), (chunk * k.stride(0), k.stride(1), k.stride(0), 1))
    vb = v.as_strided((splits, hkv, chunk, d), (chunk * v.stride(0), v.stride(1), v.stride(0), 1))
    o, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        qf.expand(splits, hkv, rows, d), kb, vb, None, True, scale=scale)[:2]
    return (o if o.stride(-1) == 1 else o.contiguous()), lse.reshape(splits, hkv, rows).float().contiguous()


def _cudnn_keys(q: torch.Tensor, k: torch.Tensor, min_prefix: int) -> int:
    """Keys [0, result) go through `cudnn_prefix` (0: none): on CUDA in 2-byte types, with many
    rows and a guaranteed prefix of CUDNN_MIN_KEYS or more, unless cuDNN failed on this layout."""
    n, hq, d = q.shape
    if (not CUDNN_PREFIX or _INTERPRETED or not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16)
            or min_prefix < CUDNN_MIN_KEYS or n * (hq // k.shape[1]) < CUDNN_MIN_ROWS or d % 8 or d > 256
            or (q.dtype, d) in _CUDNN_FAILED):
        return 0
    return min_prefix // CUDNN_QUANTUM * CUDNN_QUANTUM


# On by default on sm_90 (DDTREE_GLUON_PREFIX=0 turns it off): the whole unmasked prefix through the
# warp-specialised Gluon kernel of `prefix_attention_sm90`, merged in the combine launch; 2-byte
# types, where the engine's bound on the prefix (min_prefix) is long and the rows per KV head are
# many enough to gain (H200, benchmarks/prefix_attention_sm90.py: at head_dim 128, 68 rows lose
# 3 us to the extra launch and 260 gain 11 us; at 256, 102 rows gain 22 us over 32k keys).
GLUON_PREFIX = os.environ.get("DDTREE_GLUON_PREFIX", "1") == "1"
# With it, the tree's block goes through the same launch (its first split reads the block's columns
# through the mask) instead of a Triton launch of its own; DDTREE_GLUON_BLOCK=0 keeps the latter.
# Up to GLUON_BLOCK_MAX_COLS columns (three 128-key tiles): the first split's programs read them all,
# which a wider block (budgets of 512 and more) would leave running long after the others (measured
# at 65 and 257 columns). Measured on the H200 at 32k tokens, same lease: Qwen3-8B's rounds at
# budget 64 / 256 10.21 / 20.95 -> 9.87 / 20.46 ms; Qwen3.6-27B's (head_dim 256) 20.99 / 38.83 ->
# 20.91 / 38.52 and 20.88 / 38.67 (benchmarks/README.md, "The tree's block in the prefix kernel").
GLUON_BLOCK = os.environ.get("DDTREE_GLUON_BLOCK", "1") == "1"
GLUON_BLOCK_MAX_COLS = 384
GLUON_MIN_KEYS = 4096
GLUON_MIN_ROWS = {64: 129, 128: 129, 256: 65}  # by head_dim
_GLUON_FAILED: set = set()  # (dtype, head_dim) at which it failed to build or launch: the Triton kernel's there


def _gluon_failed(q: torch.Tensor, exc: Exception, where: str = "") -> None:
    """The Gluon prefix kernel failed to build or launch: raise again inside a graph capture (its
    eager call before the capture fails first), else the Triton kernel from now on at q's dtype and
    head_dim (`_GLUON_FAILED`), with a warning."""
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        raise exc
    _GLUON_FAILED.add((q.dtype, q.shape[-1]))
    log.warning("the Gluon prefix kernel failed%s (%s: %s); the Triton kernel attends from now on", where,
                type(exc).__name__, str(exc)[:300])


def _gluon_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, min_prefix: int, tokens: int | None = None) -> bool:
    """Whether the prefix goes through `prefix_attention_sm90` (the switch on, an sm_90 GPU with
    Triton's Gluon, bf16 or fp16, head_dim 64 / 128 / 256, many rows, a long guaranteed prefix, a
    cache TMA can read: heads contiguous, 16-byte aligned rows), unless it failed at this dtype and
    head_dim before (`_GLUON_FAILED`). tokens: a sequence's tokens where q holds a batch's."""
    n, hq, d = q.shape
    n = n if tokens is None else tokens
    return (GLUON_PREFIX and not _INTERPRETED and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
            and d in GLUON_MIN_ROWS and n * (hq // k.shape[1]) >= GLUON_MIN_ROWS[d]
            and min_prefix >= GLUON_MIN_KEYS
            and all(x.stride(1) == d and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0 for x in (k, v))
            and torch.cuda.get_device_capability(q.device) == (9, 0) and (q.dtype, d) not in _GLUON_FAILED
            and _gluon_available())


@functools.cache
def _gluon_available() -> bool:
    """Whether this Triton has the Gluon dialect with Hopper's TMA and warp specialisation (3.6 on)."""
    try:
        import ddtree.kernels.prefix_attention_sm90  # noqa: F401
    except (ImportError, AttributeError) as exc:
        log.warning("no Gluon prefix kernel on this Triton (%s); the Triton kernel attends alone", exc)
        return False
    return True


def tiling(rows: int, kv_len: int, head_dim: int, batch: int = 1, element_bytes: int = 2) -> AttentionConfig:
    """The tiling for `rows` (= N x group) query rows per KV head over kv_len keys, in each of
    `batch` rows of a batched launch: LONG for many rows over a long context (its programs per SM
    grow with its row blocks, as measured), else DEFAULT. LONG and LONG_256 are for 2-byte inputs:
    float32 tiles of their size do not fit in an SM's shared memory. At head_dim 256 LONG's tiles do not fit;
    there smaller tiles serve many rows (H200, Qwen3.6-27B heads 24/4/256, 512 cached keys, us per
    layer: N = 65 (390 rows) 27.3 -> 21.9 with 32-row blocks; N = 257 (1542 rows) 54.0 -> 44.3 with
    32-key blocks; N = 17 (102 rows) keeps DEFAULT's 64-row blocks, 13.5 against 24.4;
    attention_configs_h200_qwen36_27b.json), one program an SM where only one fits (MID_256,
    LONG_256)."""
    long_tiles = element_bytes <= 2 and kv_len >= LONG_KV_MIN
    if head_dim > 128:
        if rows <= 32:
            return DEFAULT
        if rows <= 128:
            return MID_256
        if long_tiles:
            return LONG_256
        return replace(DEFAULT, block_m=32, programs_per_sm=4) if rows <= 512 else replace(DEFAULT, block_n=32)
    if rows <= 32 or not long_tiles:
        return DEFAULT
    row_blocks = batch * -(-rows // LONG.block_m)
    return replace(LONG, programs_per_sm=1 if row_blocks == 1 else 2 if row_blocks <= 4 else 4)


def plan(rows: int, kv_heads: int, kv_len: int, sms: int, config: AttentionConfig = DEFAULT) -> tuple[int, int]:
    """(query rows per program, key splits) for `rows` = N x group rows per KV head: splits are
    added up to `programs_per_sm` programs per SM and no further, each split keeping at least one
    key block. Rounding the splits down keeps the programs in whole waves: one more split per row
    block would start a second wave of a few programs, each as long as the first wave's (H200,
    Qwen3-8B heads, 131072 keys, 64 rows in one 128-row block, one program per SM: 17 splits,
    136 programs on 132 SMs, took 265 us a layer; attention_configs_h200_long_128k.json)."""
    block_m = config.block_m or (16 if rows <= 16 else 32 if rows <= 32 else 64)
    programs = triton.cdiv(rows, block_m) * kv_heads
    key_blocks = triton.cdiv(kv_len, config.block_n)
    splits = max(1, min(key_blocks, config.programs_per_sm * sms // programs))
    return block_m, splits


def plan_rows(rows: int, kv_heads: int, batch: int, max_kv: int, sms: int,
              config: AttentionConfig = DEFAULT) -> tuple[int, int]:
    """(query rows per program, slots) of a batch's balanced key split (`balance_rows`), for `rows`
    = M x group rows per KV head of each of `batch` rows: slots, the programs of each row block and
    KV head that fill the GPU (`plan`'s `programs_per_sm` an SM). The grid's split axis holds slots
    + batch work items, fixed by the shapes alone as a CUDA graph needs; on the device each row's
    keys (its prefix and block columns) are cut in items of at most `chunk` key tiles (`row_items`)."""
    block_m, _ = plan(rows, kv_heads, max_kv, sms, config)
    slots = config.programs_per_sm * sms // (triton.cdiv(rows, block_m) * kv_heads)
    return block_m, max(1, min(slots, batch * triton.cdiv(max_kv, config.block_n)))


def chunk_within(tiles: list[int], items: int) -> int:
    """The smallest chunk (key tiles an item) that cuts rows of these tiles into at most `items`."""
    lo, hi = 1, max(tiles)  # hi: one item a row, which fits
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if sum(-(-t // mid) for t in tiles) <= items else (mid + 1, hi)
    return hi


def row_items(keys: list[int], block_n: int, slots: int) -> list[tuple[int, int, int]]:
    """The balanced split of rows of these key counts (each row's prefix and block columns, at most
    max_kv; `_row_items` on the device) -> each row's (first work item, items, key tiles an item).

    Of two chunks, the one whose programs should end first: the smallest that keeps the items
    within the slots (one wave, as long as its longest item), or the smallest that keeps them
    within slots + rows (more items than slots: a program that ends takes the next item, so about
    the batch's tiles / slots plus one item; a long row among short ones, whose items would be few
    and long in one wave)."""
    tiles = [max(1, -(-k // block_n)) for k in keys]
    one_wave = chunk_within(tiles, slots) if len(tiles) <= slots else None
    chunk = chunk_within(tiles, slots + len(tiles))
    if one_wave is not None and one_wave * slots <= sum(tiles) + chunk * slots:
        chunk = one_wave
    out, first = [], 0
    for t in tiles:
        span = -(-t // -(-t // chunk))  # the row's items evened out
        items = -(-t // span)
        out.append((first, items, span))
        first += items
    return out


_ARRIVALS: dict[torch.device, torch.Tensor] = {}


def _arrival_counters(device: torch.device) -> torch.Tensor:
    """Per-device int32 [MAX_SPLIT_TILES] of zeros: how many splits of each tile have finished in
    the running launch (each launch leaves them at zero). Made on the first split launch, which
    runs eagerly (graph capture is preceded by an eager run); launches on one stream at a time."""
    if device not in _ARRIVALS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("tree attention's first split launch must run before graph capture")
        _ARRIVALS[device] = torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32, device=device)
    return _ARRIVALS[device]


def key_range(mask: torch.Tensor) -> torch.Tensor:
    """mask [N, T] bool -> [N, 2] int32: each query's first visible key and last visible key + 1.
    Computed once per forward and shared by all layers; a program skips the key blocks outside
    the union of its queries' ranges (a tree's later nodes and the KV bucket's padding)."""
    cols = torch.arange(mask.shape[1], device=mask.device)  # int64 throughout: Inductor (2.11) fails
    first = torch.where(mask, cols, mask.shape[1]).amin(1)  # on int32 reductions with a scalar fill
    last = torch.where(mask, cols, -1).amax(1) + 1
    return torch.stack([first, last], dim=1).to(torch.int32)


def prefix_block_mask(prefix_len: torch.Tensor, block: torch.Tensor, kv_len: int) -> torch.Tensor:
    """The dense form of (prefix_len, block): [N, kv_len] bool, True at keys < prefix_len and, among
    keys prefix_len .. prefix_len + M - 1, where block [N, M] is True; keys past them are padding.
    prefix_len: [] long (on the device, so the shape depends on kv_len only)."""
    size = block.shape[1]
    cols = torch.arange(kv_len, device=block.device)
    rel = cols - prefix_len
    in_block = (rel >= 0) & (rel < size)
    return (cols < prefix_len)[None, :] | (block[:, rel.clamp(0, size - 1)] & in_block[None, :])


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                     ranges: torch.Tensor | None = None, splits: int | None = None,
                     config: AttentionConfig | None = None, prefix_len: torch.Tensor | None = None,
                     min_prefix: int = 0, prefix_partials: tuple | None = None,
                     causal_block: bool = False) -> torch.Tensor:
    """q [N, Hq, D]; k, v [T, Hkv, D] (any strides with a unit last one) -> out [N, Hq * D] in q's dtype.

    Without prefix_len: mask [N, T] bool (True: query i sees key j); ranges: `key_range(mask)` when
    already computed. With prefix_len ([] long on the device, prefix_len + M <= T): mask is a block
    [N, M] bool and query i sees keys < prefix_len and keys prefix_len + j where mask[i, j]
    (`prefix_block_mask`); ranges are not used. Every row must see at least one key. `splits`
    overrides the key split (tests), `config` the tiling (default: `tiling`; benchmarks/attention_configs.py).

    min_prefix (prefix form): a lower bound of prefix_len that holds for every call of these shapes,
    a CUDA graph's replays included. Where it is long and the rows many (`_cudnn_keys`), keys
    [0, P), P = min_prefix rounded down to CUDNN_QUANTUM, go through cuDNN (`cudnn_prefix`) and
    the kernel attends to the rest, merging both in its combine launch. On sm_90 (`_gluon_prefix`,
    before cuDNN's) the whole prefix [0, prefix_len) goes through the warp-specialised Gluon kernel
    (`prefix_attention_sm90`), the prefix length read on the device, and so do the block's columns
    (its first split's programs read them through the mask; GLUON_BLOCK),
    leaving the combine launch alone to merge its splits; elsewhere the kernel attends to the
    block's columns alone. prefix_partials: (o, lse, P) in `cudnn_prefix`'s layout for keys
    [0, P), or for the whole prefix where P is None, made by the caller instead (tests).

    causal_block (a prefill chunk): mask is the lower triangle [N, N] and prefix_len equals
    min_prefix. With the Gluon prefix, the block's keys [P, P + N) then go through cuDNN's causal
    attention instead of the Triton kernel (`_causal_block`), merged with the prefix by the combine
    launch."""
    n, hq, d = q.shape
    rows = n * (hq // k.shape[1])
    prefix = prefix_len is not None
    if prefix and prefix_partials is None and _gluon_prefix(q, k, v, min_prefix):
        try:
            whole, prefix_partials = _through_gluon(q, k, v, mask, scale, prefix_len, causal_block, config)
        except Exception as exc:  # noqa: BLE001 (a Triton whose Gluon does not build or launch this kernel)
            _gluon_failed(q, exc)
            whole = None
        if whole is not None:
            return whole
        if prefix_partials is not None and causal_block and (q.dtype, d) not in _CUDNN_FAILED:
            try:
                return _causal_block(q, k[min_prefix:min_prefix + n], v[min_prefix:min_prefix + n], scale,
                                     prefix_partials)
            except RuntimeError as exc:  # this cuDNN does not take the layout: the Triton kernel from now on
                _CUDNN_FAILED.add((q.dtype, d))
                log.warning("cuDNN causal attention failed (%s); the Triton kernel attends to the block", str(exc)[:200])
    if prefix and prefix_partials is None:
        keys = _cudnn_keys(q, k, min_prefix)
        if keys:
            chunks = cudnn_splits(rows, k.shape[1], d, keys, _sm_count(q.device))
            try:
                prefix_partials = (*cudnn_prefix(q, k, v, keys, chunks, scale), keys)
            except RuntimeError as exc:  # this cuDNN does not take the layout: the kernel alone from now on
                # (a graph's capture is preceded by an eager run, which fails first)
                if q.is_cuda and torch.cuda.is_current_stream_capturing():
                    raise
                _CUDNN_FAILED.add((q.dtype, d))
                log.warning("cuDNN attention failed (%s); the Triton kernel attends alone", str(exc)[:200])
    key0 = 0
    if prefix_partials is not None and prefix_partials[2] is not None:
        key0 = prefix_partials[2]
        k, v = k[key0:], v[key0:]
    # The keys the kernel reads: with the whole prefix summed elsewhere, the block's columns alone.
    t = mask.shape[1] if prefix_partials is not None and prefix_partials[2] is None else k.shape[0]
    config = config or tiling(rows, t, d, element_bytes=q.element_size())
    if prefix:
        ranges = prefix_len.reshape(1)  # the kernel reads the prefix length where the ranges would be
    elif ranges is None:
        ranges = key_range(mask)
    return _launch(q, k, v, mask, ranges, None, 1, t, scale, prefix, splits, config, prefix_partials)


def _through_gluon(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                   prefix_len: torch.Tensor, causal_block: bool, config: AttentionConfig | None) -> tuple:
    """`masked_attention`'s prefix through `prefix_attention_sm90` -> (out [N, Hq * D], None) where
    its first split takes the tree's block too and one combine launch merges the splits (GLUON_BLOCK),
    else (None, the prefix's partials (o, lse, None)) for the rest of the attention to merge with."""
    from ddtree.kernels.prefix_attention_sm90 import PDL, prefix_attention, splits_for, tiling as gluon_tiling

    n, hq, d = q.shape
    rows = n * (hq // k.shape[1])
    max_keys = k.shape[0] - mask.shape[1]  # prefix_len + M <= T
    sms = _sm_count(q.device)
    t = gluon_tiling(d, rows, k.shape[1], sms)
    gluon_splits = splits_for(t, rows, k.shape[1], sms, max_keys, d)
    if GLUON_BLOCK and not causal_block and mask.shape[1] <= GLUON_BLOCK_MAX_COLS:  # one launch, one combine
        o, lse = prefix_attention(q, k, v, prefix_len, max_keys, gluon_splits, scale, t, block=mask)
        return _merge_library(q, o, lse, mask.shape[1], config, dependent=t.get("PDL", PDL)), None
    return None, (*prefix_attention(q, k, v, prefix_len, max_keys, gluon_splits, scale, t), None)


def _merge_library(q: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, block_cols: int,
                   config: AttentionConfig | None, dependent: bool = False) -> torch.Tensor:
    """The combine launch over partials (o, lse) in `cudnn_prefix`'s layout that cover every key a
    row sees (the Gluon kernel's splits with the tree's block) -> out [N, Hq * D] in q's dtype.
    dependent: launched as a programmatic dependent launch, right after the launch that made the
    partials (which lets it start early: `prefix_attention_sm90.PDL`), its programs waiting for
    that launch's end before they read them."""
    n, hq, d = q.shape
    hkv = o.shape[1]
    rows = o.shape[2]
    config = config or tiling(rows, block_cols, d, element_bytes=q.element_size())
    out = torch.empty(n, hq, d, dtype=q.dtype, device=q.device)
    _launch_combine(lse, lse, out, rows, hkv, hq // hkv, d, 0, config, (o, lse, None),  # no split of its own
                    dependent=dependent)
    return out.view(n, hq * d)


def _cudnn_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN's causal attention of q [N, Hq, D] over k, v [N, Hkv, D] (GQA) -> (o [Hq, N, D] in q's
    dtype, normalised; lse [Hq, N], natural log of each row's softmax denominator, scale applied)."""
    o, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], None, True, is_causal=True,
        scale=scale)[:2]
    return o[0], lse.reshape(o.shape[1:3])


def _causal_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, prefix_partials: tuple) -> torch.Tensor:
    """A prefill chunk's attention: q [N, Hq, D] over its own keys k, v [N, Hkv, D] causally, through
    cuDNN (FlashAttention-3 class on Hopper; the Triton kernel reads the [N, N] mask tile by tile and
    computes the masked half too), merged with the prefix's partials (`prefix_attention_sm90`'s
    (o, lse, None)) by the combine launch -> [N, Hq * D].

    Why: at Qwen3-8B shape the 32k prefill's seven later chunks took 365 ms in the Triton kernel
    over their causal blocks, against 11 ms for cuDNN over the first chunk's, the same work
    (verify_profile_h200_qwen3_8b_32k_prefill.json)."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    rows = n * group
    o, lse = _cudnn_causal(q, k, v, scale)
    # The block as the combine's one split of its own, rows in the kernel's order (token * group + g):
    # its normalised output with a running max of lse (base 2) and a sum of 1.
    part_o = torch.empty(1, hkv, n, group, d, dtype=torch.float32, device=q.device)
    part_o[0].copy_(o.view(hkv, group, n, d).transpose(1, 2))
    top = lse.reshape(hkv, group, n).transpose(1, 2).reshape(1, hkv, rows).float() * 1.4426950408889634
    part_ml = torch.stack([top, torch.ones_like(top)], dim=-1)
    out = torch.empty(n, hq, d, dtype=q.dtype, device=q.device)
    _launch_combine(part_o.view(1, hkv, rows, d), part_ml, out, rows, hkv, group, d, 1,
                    tiling(rows, n, d, element_bytes=q.element_size()), prefix_partials)
    return out.view(n, hq * d)


def batched_masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: torch.Tensor, scale: float,
                             prefix_len: torch.Tensor | None, first_slot: torch.Tensor, max_kv: int,
                             config: AttentionConfig | None = None, splits: int | None = None,
                             ranges: torch.Tensor | None = None) -> torch.Tensor:
    """The prefix form for R rows (sequences) of a cache in one launch; with prefix_len None, the
    mask form (below).

    q [R * M, Hq, D]: row r's M tokens at r * M .. r * M + M - 1 (rows shorter than M padded);
    k, v [S, Hkv, D]: the whole cache (any strides with a unit last one); block_mask [R, M, C] bool
    (C: block columns, usually M); prefix_len, first_slot [R] long or int32 on the device. Row r's
    token i sees keys first_slot[r] + j for j < prefix_len[r], and first_slot[r] + prefix_len[r] + j
    where block_mask[r, i, j] -> out [R * M, Hq * D] in q's dtype.

    max_kv: a bound on the keys a row sees, counted from its first slot (prefix_len plus the block
    columns it uses; block columns past max_kv must be False), e.g. a row's slot count. The key
    split is planned over max_kv, so the launch depends on (R, M, C, S, heads, max_kv) alone, never
    on the prefix lengths, and one CUDA graph serves every batch of that shape. A token that sees
    no key (padding with no prefix) gets zeros; keys a row reads but does not see (block columns
    past its tokens) only need to be finite, and reads stop at the cache's end.

    On sm_90, where the rows' prefixes may be long (max_kv - C of GLUON_MIN_KEYS or more) and a
    row's tokens many (`_gluon_prefix`), every row's prefix and block go through the Gluon kernel
    (`prefix_attention_sm90`, the rows a batch of one launch) and one combine launch merges them.

    The mask form: block_mask [R, M, max_kv] is row r's mask over keys first_slot[r] + j (True:
    token i sees key j), ranges [R * M, 2] its `key_range` (each token's first visible key and last
    + 1, counted from its row's first slot; no token's range empty)."""
    rows_total, hq, d = q.shape
    batch, m, cols = block_mask.shape
    if rows_total != batch * m:
        raise ValueError(f"q has {rows_total} tokens; {batch} rows of {m} make {batch * m}")
    prefix = prefix_len is not None
    if first_slot.shape != (batch,) or (prefix and prefix_len.shape != (batch,)):
        raise ValueError(f"prefix_len and first_slot must be [{batch}], got "
                         f"{None if prefix_len is None else tuple(prefix_len.shape)} and {tuple(first_slot.shape)}")
    if not prefix and (cols != max_kv or ranges is None or ranges.shape != (rows_total, 2)):
        raise ValueError(f"the mask form needs block_mask [R, M, max_kv={max_kv}] and ranges [{rows_total}, 2], got "
                         f"{tuple(block_mask.shape)} and {None if ranges is None else tuple(ranges.shape)}")
    # (max_kv - cols bounds the rows' prefixes, it does not guarantee them: a row of a short prefix
    # leaves its later splits' programs one masked tile each)
    if (prefix and splits is None and cols <= GLUON_BLOCK_MAX_COLS and GLUON_BLOCK
            and _gluon_prefix(q, k, v, max_kv - cols, tokens=m)):
        try:  # every row's prefix and block through the Gluon kernel, one combine launch
            return _batched_through_gluon(q, k, v, block_mask, scale, prefix_len, first_slot, max_kv, config)
        except Exception as exc:  # noqa: BLE001 (a Triton whose Gluon does not build or launch this kernel)
            _gluon_failed(q, exc, " on a batch")
    config = config or tiling(m * (hq // k.shape[1]), max_kv, d, batch, q.element_size())
    return _launch(q, k, v, block_mask.reshape(rows_total, cols), prefix_len if prefix else ranges, first_slot, batch,
                   max_kv, scale, prefix, splits, config)


def _batched_through_gluon(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: torch.Tensor, scale: float,
                           prefix_len: torch.Tensor, first_slot: torch.Tensor, max_kv: int,
                           config: AttentionConfig | None) -> torch.Tensor:
    """`batched_masked_attention`'s prefix form through `prefix_attention_sm90` with its rows as a
    batch (each row's prefix below max_kv, its block in its first split), merged by one combine
    launch -> out [R * M, Hq * D]. Its rows are split alike over max_kv, not by their own keys as
    the Triton kernel's are (`row_items`): a long row among short ones runs on its few splits."""
    from ddtree.kernels.prefix_attention_sm90 import PDL, prefix_attention, splits_for, tiling as gluon_tiling

    batch, m, cols = block_mask.shape
    hkv, d = k.shape[1], q.shape[2]
    rows = m * (q.shape[1] // hkv)
    sms = _sm_count(q.device)
    t = gluon_tiling(d, rows, hkv, sms, batch)
    splits = splits_for(t, rows, hkv, sms, max_kv, d, batch)
    o, lse = prefix_attention(q, k, v, prefix_len, max_kv, splits, scale, t, block=block_mask, first_slot=first_slot)
    return _merge_library(q, o, lse, cols, config, dependent=t.get("PDL", PDL))


def _launch(q, k, v, mask, ranges, first_slot, batch, max_kv, scale, prefix, splits, config, library=None):
    """One `_attention` launch (and, when the partials are many, a `_combine_kernel` launch) over
    `batch` rows of q's tokens; keys are split over [0, max_kv) of each row. library: (o, lse, P),
    `cudnn_prefix`'s partial sums over the keys before k[0] (P of them; the prefix form, one
    batch row), merged by the combine launch; P None: over the whole prefix, whose length the kernel
    reads on the device, k and v whole (the kernel then reads the block's columns alone: max_kv
    is their count)."""
    n, hq, d = q.shape
    t, hkv = k.shape[0], k.shape[1]
    group = hq // hkv
    rows = n // batch * group  # query rows per KV head of one batch row
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_cols = mask.shape[1] if prefix else 0
    mask = mask.contiguous().view(torch.uint8)
    out = torch.empty(n, hq, d, dtype=q.dtype, device=q.device)
    block_n = config.block_n
    batched = first_slot is not None
    key_blocks = triton.cdiv(max_kv, block_n)
    # A batch's prefix form splits each row's keys by its share of the batch's (`plan_rows`);
    # `splits` then sets the work items (slots).
    balance = config.balance_rows
    if balance is None:  # measured to pay at one token a row (DEFAULT's tiles), not at 17 or 65 (LONG's)
        balance = max_kv >= BALANCE_MIN_KEYS and rows <= BALANCE_MAX_ROWS
    balanced = batched and prefix and batch > 1 and library is None and balance
    if balanced:
        block_m, slots = plan_rows(rows, hkv, batch, max_kv, _sm_count(q.device), config)
        slots = slots if splits is None else max(1, min(splits, batch * key_blocks))
        splits = min(slots + 1, key_blocks)  # the most work items a row gets
        items = slots + batch  # the grid's split axis; the partials' leading dim
        keys_per_split = 0  # each row's own, on the device
    else:
        block_m, auto_splits = plan(rows, hkv * batch, max_kv, _sm_count(q.device), config)
        splits = auto_splits if splits is None else max(1, min(splits, key_blocks))
        keys_per_split = triton.cdiv(triton.cdiv(max_kv, splits), block_n) * block_n
        splits = triton.cdiv(max_kv, keys_per_split)
        items = batch * splits
        slots = splits
    grid = (triton.cdiv(rows, block_m), hkv, items)
    split = splits > 1 or library is not None or balanced
    if split:  # partial sums [item, KV head, row, ...]: a balanced item holds one batch row's rows
        item_rows = rows if balanced else batch * rows
        part_o = torch.empty(items if balanced else splits, hkv, item_rows, d, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(*part_o.shape[:3], 2, dtype=torch.float32, device=q.device)
    else:
        part_o = part_ml = out  # unused
    tiles = grid[0] * grid[1] * batch  # each (row block, KV head, batch row) combines once
    # The library's partials are merged by a combine launch of its own: in the fold, a tile's last
    # split read them all alone (at Qwen3.6-27B heads over 8192 keys, N = 17, 16 chunks: 61 us a
    # layer more than cuDNN's part; attention_configs_h200_cudnn_prefix_fold_27b.json).
    may_fold = split and library is None and config.fold_combine and tiles <= MAX_SPLIT_TILES
    if balanced:  # rows of at most fold_items items fold; the combine launch takes the longer ones
        fold_items = min(splits, max(1, FOLD_MAX_PARTIALS // block_m)) if may_fold else 0
    else:
        fold_items = splits if may_fold and block_m * splits <= FOLD_MAX_PARTIALS else 0
    fold = fold_items > 0
    arrivals = _arrival_counters(q.device) if fold else out  # unused unless folded
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    splits_p = triton.next_power_of_2(max(fold_items, 1))
    unroll = max(1, min(splits_p, config.combine_loads // (block_m * d)))
    batch_p = triton.next_power_of_2(batch) if balanced else 1
    _attention[grid](q, k, v, mask, ranges, first_slot if batched else ranges, out, part_o, part_ml, arrivals, rows, t,
                     keys_per_split, splits, batch, max_kv, slots, fold_items, scale * 1.4426950408889634, block_cols,
                     q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), mask.stride(0),
                     out.stride(0), out.stride(1), library[2] if library is not None and library[2] is not None else 0,
                     GROUP=group, D=d, BLOCK_M=block_m, BLOCK_N=block_n, SPLIT=split, FOLD=fold, PREFIX=prefix,
                     PREFIX_DONE=library is not None and library[2] is None,
                     BATCHED=batched, BALANCED=balanced, BATCH_P=batch_p, SPLITS_P=splits_p if fold else 1,
                     UNROLL=unroll if fold else 1, PRECISION=precision, LOOP_WHILE=_INTERPRETED,
                     num_warps=config.num_warps, num_stages=config.num_stages)
    if split and splits > fold_items:
        rows_of = (ranges, batch, rows, max_kv, slots, block_cols, block_n, fold_items) if balanced else None
        _launch_combine(part_o, part_ml, out, batch * rows, hkv, group, d, splits, config, library, rows_of)
    return out.view(n, hq * d)


def _launch_combine(part_o, part_ml, out, rows: int, hkv: int, group: int, d: int, splits: int,
                    config: AttentionConfig, library=None, rows_of=None, dependent: bool = False) -> None:
    """The combine launch over `rows` rows per KV head (a batch's rows one after another): tiled
    where `config.combine_tiled` says so (by default where one 16-row block holds the rows), else a
    split at a time, the library's partials (`_launch`) merged too (splits 0: the library's alone).
    Programs (row block, KV head, head-dim chunk). rows_of: (prefix lengths, batch, rows a batch
    row, max_kv, slots, block columns, BLOCK_N, fold_items) of a balanced split (`plan_rows`), whose
    partials each row finds on the device (splits: the most work items a row has), rows of at most
    fold_items items having been combined in the attention launch."""
    combine_d = min(config.combine_block_d, d)
    splits_p = triton.next_power_of_2(max(splits, 1))
    tiled = config.combine_tiled if config.combine_tiled is not None else rows <= 16
    tiled = tiled and library is None and rows_of is None
    lib_o, lib_lse, _ = library if library is not None else (out, out, 0)
    lib_splits = lib_o.shape[0] if library is not None else 0
    if tiled:  # as few rows a program as let every split in at once, within combine_loads
        combine_m = max(1, min(16, config.combine_loads // (splits_p * combine_d)))
        combine_m = 1 << (combine_m.bit_length() - 1)  # a power of two
        combine_s = max(1, min(splits_p, config.combine_loads // (combine_m * combine_d)))
        _combine_tiled_kernel[(triton.cdiv(rows, combine_m), hkv, d // combine_d)](
            part_o, part_ml, out, rows, splits, out.stride(0), out.stride(1), GROUP=group, D=d,
            BLOCK_M=combine_m, BLOCK_D=combine_d, BLOCK_S=combine_s, num_warps=4)
    else:
        combine_m = 16
        unroll = max(1, min(splits_p, config.combine_loads // (combine_m * combine_d)))
        prefix_len, batch, row_len, max_kv, slots, block_cols, block_n, folded = (
            rows_of or (out, 1, rows, 0, splits, 0, 1, 0))
        _combine_kernel[(triton.cdiv(rows, combine_m), hkv, d // combine_d)](
            part_o, part_ml, out, rows, splits, out.stride(0), out.stride(1), lib_o, lib_lse,
            *(lib_o.stride()[:3] if library is not None else (0, 0, 0)),
            *(lib_lse.stride()[:2] if library is not None else (0, 0)), prefix_len, batch, row_len, max_kv,
            slots, block_cols, folded, GROUP=group, D=d, BLOCK_M=combine_m, BLOCK_D=combine_d, SPLITS_P=splits_p,
            UNROLL=unroll, LOOP_WHILE=_INTERPRETED, LIB_SPLITS=lib_splits,
            LIB_P=triton.next_power_of_2(max(lib_splits, 1)), BALANCED=rows_of is not None,
            BATCH_P=triton.next_power_of_2(batch), BLOCK_N=block_n, WAIT=dependent, num_warps=4,
            **({"launch_pdl": True} if dependent else {}))


if triton is not None:

    @triton.jit
    def _step_seen(q, k_ptr, v_ptr, dims, j, h, m_i, l_i, acc, scale_log2, sk_t, sk_h, sv_t, sv_h,
                   BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
        """Keys [j, j + BLOCK_N), all inside the prefix every row sees, into m_i, l_i, acc: no bounds,
        no mask and no empty-row guard (the FlashAttention inner loop; most of a long context)."""
        cols = j + tl.arange(0, BLOCK_N)
        k = tl.load(k_ptr + cols[:, None] * sk_t + h * sk_h + dims[None, :])
        logits = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        m_new = tl.maximum(m_i, tl.max(logits, 1))
        p = tl.exp2(logits - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + cols[:, None] * sv_t + h * sv_h + dims[None, :])
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return m_new, l_i, acc

    @triton.jit
    def _step(q, k_ptr, v_ptr, mask_ptr, tok, live, dims, j, end, h, m_i, l_i, acc, scale_log2, prefix_len,
              block_cols, sk_t, sk_h, sv_t, sv_h, sm_n, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
              PREFIX: tl.constexpr):
        """Keys [j, j + BLOCK_N) into the running max m_i, denominator l_i and sum acc (online softmax),
        through the mask and the bounds."""
        cols = j + tl.arange(0, BLOCK_N)
        inside = cols < end
        k = tl.load(k_ptr + cols[:, None] * sk_t + h * sk_h + dims[None, :], mask=inside[:, None], other=0.0)
        if PREFIX:  # keys < prefix_len: seen by all; then the block mask's M columns
            rel = cols - prefix_len
            in_block = (rel >= 0) & (rel < block_cols) & inside
            seen = tl.load(mask_ptr + tok[:, None] * sm_n + rel[None, :], mask=live[:, None] & in_block[None, :],
                           other=0)
            seen = (seen != 0) | (cols < prefix_len)[None, :]
        else:
            seen = tl.load(mask_ptr + tok[:, None] * sm_n + cols[None, :], mask=live[:, None] & inside[None, :],
                           other=0) != 0
        logits = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        logits = tl.where(seen, logits, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(logits, 1))
        base = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet stays at 0
        p = tl.exp2(logits - base[:, None])
        alpha = tl.exp2(m_i - base)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + cols[:, None] * sv_t + h * sv_h + dims[None, :], mask=inside[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return m_new, l_i, acc

    @triton.jit
    def _chunk_within(tiles, total, rows, items):
        """The smallest chunk (key tiles an item) that cuts `rows` rows of these tiles [BATCH_P]
        (`total` in all) into at most `items`, by a binary search between bounds that hold it: at
        least total / items, and at most the longest row, and total / (items - rows) where items >
        rows (each row's items are at most its tiles / chunk + 1). (`row_items` searches from 1 to
        the longest row: the answer is the same, the least chunk that fits.)"""
        hi = tl.max(tiles, 0)  # one item a row
        hi = tl.where(items > rows, tl.minimum(hi, (total + items - rows - 1) // tl.maximum(items - rows, 1)), hi)
        lo = tl.minimum(tl.maximum((total + items - 1) // items, 1), hi)
        while lo < hi:
            mid = (lo + hi) // 2
            fits = tl.sum((tiles + mid - 1) // mid, 0) <= items
            hi = tl.where(fits, mid, hi)
            lo = tl.where(fits, lo, mid + 1)
        return hi

    @triton.jit
    def _row_items(prefix_ptr, batch, block_cols, max_keys, slots, BLOCK_N: tl.constexpr, BATCH_P: tl.constexpr):
        """The balanced split of a batch's rows (`row_items` on the host, which says how the chunk is
        chosen): row b's keys (its prefix and block columns, at most max_keys, at least one tile)
        cut into items of `span` tiles -> (first item, items, span) [BATCH_P], zeros past `batch`."""
        rb = tl.arange(0, BATCH_P)
        real = rb < batch
        keys = tl.minimum(tl.load(prefix_ptr + rb, mask=real, other=0).to(tl.int32) + block_cols, max_keys)
        tiles = tl.where(real, tl.maximum((keys + BLOCK_N - 1) // BLOCK_N, 1), 0)
        total = tl.sum(tiles, 0)
        chunk = _chunk_within(tiles, total, batch, slots + batch)
        if batch <= slots:
            one_wave = _chunk_within(tiles, total, batch, slots)
            chunk = tl.where(one_wave * slots <= total + chunk * slots, one_wave, chunk)
        items = (tiles + chunk - 1) // chunk
        span = (tiles + tl.maximum(items, 1) - 1) // tl.maximum(items, 1)
        items = (tiles + tl.maximum(span, 1) - 1) // tl.maximum(span, 1)  # evened out, none empty
        return tl.cumsum(items, 0) - items, items, span

    @triton.jit
    def _row_value(values, rb, b):
        """values[b] of a [BATCH_P] tensor (rb its arange), b a scalar."""
        return tl.sum(tl.where(rb == b, values, 0), 0)

    @triton.jit
    def _rows_value(values, rb, b):
        """values[b[i]] for each i of b [BLOCK_M] -> [BLOCK_M] (0 where b[i] is past the batch)."""
        return tl.sum(tl.where(rb[None, :] == b[:, None], values[None, :], 0), 1)

    @triton.jit
    def _attention(q_ptr, k_ptr, v_ptr, mask_ptr, range_ptr, first_ptr, out_ptr, part_o_ptr, part_ml_ptr, arrivals_ptr,
                   rows, kv_len, keys_per_split, splits, batch, max_kv, slots, fold_items, scale_log2, block_cols,
                   sq_n, sq_h, sk_t, sk_h, sv_t, sv_h, sm_n, so_n, so_h, key0, GROUP: tl.constexpr, D: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, FOLD: tl.constexpr,
                   PREFIX: tl.constexpr, BATCHED: tl.constexpr, BALANCED: tl.constexpr, BATCH_P: tl.constexpr,
                   SPLITS_P: tl.constexpr, UNROLL: tl.constexpr, PRECISION: tl.constexpr,
                   LOOP_WHILE: tl.constexpr, PREFIX_DONE: tl.constexpr = False):
        """Program (row block, KV head h, split s): rows r = token * GROUP + g (query head h * GROUP + g)
        against keys [s * keys_per_split, ...), less the key blocks none of its rows sees. Writes the
        normalised output; or (SPLIT) the split's unnormalised sum, running max and denominator
        (base-2 logits), and (FOLD) the last of the row block's splits to finish combines them.
        PREFIX: range_ptr holds the prefix length and mask_ptr the block mask [N, block_cols]; k and v
        start at key key0 (the keys before it summed by the library, merged by `_combine_kernel`);
        PREFIX_DONE: the whole prefix was summed by the library, so only the block's columns here
        (keys_per_split and splits planned over them).
        BATCHED: axis 2 is (batch row b, split s); b's `rows` rows follow b - 1's, its keys start at
        slot first_ptr[b] of k and v, and its prefix length is range_ptr[b] (PREFIX), or each of its
        tokens' ranges and mask rows follow the previous row's (counted from that first slot).
        BALANCED (PREFIX): axis 2 is the work item w of `_row_items`: the row b whose items hold w,
        its keys [c * span, (c + 1) * span) for c = w - its first item; items past the batch's
        last do nothing. Partials are [item, KV head, b's rows]; with FOLD, a row of one item is
        written whole and one of at most fold_items combined by its last item, longer ones left to
        the combine launch."""
        r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        h = tl.program_id(1)
        live = r < rows
        valid = tl.program_id(2) >= 0  # a program with work (all but a balanced split's spare items)
        item0 = 0  # the first of the row's partials; its items: n_items
        n_items = splits
        split_keys = keys_per_split
        if BATCHED:
            if BALANCED:
                rb = tl.arange(0, BATCH_P)
                firsts, counts, spans = _row_items(range_ptr, batch, block_cols, max_kv, slots, BLOCK_N, BATCH_P)
                item = tl.program_id(2)
                b = tl.sum((firsts + counts <= item).to(tl.int32), 0)  # rows whose items all come before
                valid = b < batch
                b = tl.minimum(b, batch - 1)
                item0 = _row_value(firsts, rb, b)
                n_items = _row_value(counts, rb, b)
                split_keys = _row_value(spans, rb, b) * BLOCK_N
                split_lo = (item - item0) * split_keys
                live = live & valid
            else:
                item = tl.program_id(2) % splits
                b = tl.program_id(2) // splits
                split_lo = item * keys_per_split
            r += b * rows  # from here on rows (and tokens) count across the batch rows, in order
            all_rows = rows * batch
            first_slot = tl.load(first_ptr + b)
            k_ptr += first_slot.to(tl.int64) * sk_t
            v_ptr += first_slot.to(tl.int64) * sv_t
            kv_len = kv_len - first_slot.to(tl.int32)  # reads stop at the cache's end
        else:
            b = 0
            item = tl.program_id(2)
            split_lo = item * keys_per_split
            all_rows = rows
        if BALANCED:  # the partials' rows: a balanced item's are its batch row's alone
            item_rows = rows
            r_item = r - b * rows
        else:
            item_rows = all_rows
            r_item = r
        tok = r // GROUP
        head = h * GROUP + r % GROUP
        dims = tl.arange(0, D)
        q = tl.load(q_ptr + tok[:, None] * sq_n + head[:, None] * sq_h + dims[None, :], mask=live[:, None], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        if PREFIX:
            prefix_len = tl.load(range_ptr + b).to(tl.int32) - key0
            if PREFIX_DONE:  # keys and splits from the block's first column on
                k_ptr += prefix_len.to(tl.int64) * sk_t
                v_ptr += prefix_len.to(tl.int64) * sv_t
                kv_len = kv_len - prefix_len
                prefix_len = prefix_len * 0
            first = 0
            last = prefix_len + block_cols
        else:
            prefix_len = 0
            first = tl.min(tl.load(range_ptr + tok * 2, mask=live, other=kv_len), 0)
            last = tl.max(tl.load(range_ptr + tok * 2 + 1, mask=live, other=0), 0)
        # key blocks stay aligned to BLOCK_N, so skipping never changes how the sums are grouped
        start = tl.maximum(split_lo, (first // BLOCK_N) * BLOCK_N)
        end = tl.minimum(tl.minimum(split_lo + split_keys, kv_len), last)
        if PREFIX:  # whole key blocks of the prefix first, with no mask; the rest below, masked
            seen_end = tl.minimum(end, (prefix_len // BLOCK_N) * BLOCK_N)
            if LOOP_WHILE:
                j = start
                while j < seen_end:
                    m_i, l_i, acc = _step_seen(q, k_ptr, v_ptr, dims, j, h, m_i, l_i, acc, scale_log2, sk_t, sk_h,
                                               sv_t, sv_h, BLOCK_N, PRECISION)
                    j += BLOCK_N
            else:
                for j in range(start, seen_end, BLOCK_N):
                    m_i, l_i, acc = _step_seen(q, k_ptr, v_ptr, dims, j, h, m_i, l_i, acc, scale_log2, sk_t, sk_h,
                                               sv_t, sv_h, BLOCK_N, PRECISION)
            start = tl.maximum(start, seen_end)
        if LOOP_WHILE:  # Triton's interpreter cannot take a tensor as a `range` bound
            j = start
            while j < end:
                m_i, l_i, acc = _step(q, k_ptr, v_ptr, mask_ptr, tok, live, dims, j, end, h, m_i, l_i, acc, scale_log2,
                                      prefix_len, block_cols, sk_t, sk_h, sv_t, sv_h, sm_n, BLOCK_N, PRECISION, PREFIX)
                j += BLOCK_N
        else:
            for j in range(start, end, BLOCK_N):
                m_i, l_i, acc = _step(q, k_ptr, v_ptr, mask_ptr, tok, live, dims, j, end, h, m_i, l_i, acc, scale_log2,
                                      prefix_len, block_cols, sk_t, sk_h, sv_t, sv_h, sm_n, BLOCK_N, PRECISION, PREFIX)
        # A balanced split's row of one item, where the last item combines (FOLD), is written whole here
        # (no partials, no arrival): short rows among many, most of a batch over short contexts.
        whole = live
        keep = live
        counted = valid
        if BALANCED:
            if FOLD:
                whole = live & (n_items == 1)
                keep = live & (n_items > 1)
                counted = valid & (n_items > 1) & (n_items <= fold_items)
        if SPLIT:
            at = (item * tl.num_programs(1) + h) * item_rows + r_item
            tl.store(part_o_ptr + at[:, None] * D + dims[None, :], acc, mask=keep[:, None])
            tl.store(part_ml_ptr + at * 2, m_i, mask=keep)
            tl.store(part_ml_ptr + at * 2 + 1, l_i, mask=keep)
        if BALANCED:
            if FOLD:  # before the fold's combine, so that acc is no longer held through it
                _store_whole(out_ptr, acc, l_i, whole, tok, head, dims, so_n, so_h)
        if FOLD:
            # Every thread's stores are issued before one thread releases them with the arrival
            # count (a block barrier, then a GPU-scope acquire-release atomic: a semaphore).
            tl.debug_barrier()
            tile = h * tl.num_programs(0) + tl.program_id(0)
            if BATCHED:
                tile += b * tl.num_programs(1) * tl.num_programs(0)
            arrived = tl.atomic_add(arrivals_ptr + tile, 1, mask=counted, sem="acq_rel", scope="gpu")
            if counted & (arrived == n_items - 1):  # the tile's last split: every other's partials are visible
                tl.store(arrivals_ptr + tile, 0)  # zero again for the next launch
                _combine(part_o_ptr, part_ml_ptr, out_ptr, r_item, live, tok, head, dims, h, tl.num_programs(1),
                         item_rows, item0 + tl.zeros_like(r), n_items + tl.zeros_like(r), n_items, so_n, so_h, D,
                         BLOCK_M, D, SPLITS_P, UNROLL, LOOP_WHILE, part_o_ptr, part_ml_ptr, 0, 0, 0, 0, 0, 0,
                         1)  # no library partials in the fold
        if not SPLIT:  # a row that saw no key (batch padding) gets zeros
            _store_whole(out_ptr, acc, l_i, live, tok, head, dims, so_n, so_h)

    @triton.jit
    def _store_whole(out_ptr, acc, l_i, live, tok, head, dims, so_n, so_h):
        """The normalised output of rows that saw all their keys here (zeros where none)."""
        out = acc / tl.where(live & (l_i > 0), l_i, 1.0)[:, None]
        tl.store(out_ptr + tok[:, None] * so_n + head[:, None] * so_h + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=live[:, None])

    @triton.jit
    def _combine_group(part_o_ptr, part_ml_ptr, acc, top, first, item0, n_items, kv_heads, h, rows, r, live, dims,
                       D: tl.constexpr, UNROLL: tl.constexpr):
        """acc += w_s * partial sum of split s, for s in [first, first + UNROLL): loads issued together.
        w_s = exp2(m_s - top) from split s's own running max, loaded again (BLOCK_M floats, from L2).
        Picking row s out of the [SPLITS_P, BLOCK_M] weights in registers instead, a reduction across
        the warps per split, made the combine launch of one token at Qwen3.6-27B heads over 8192
        keys (66 splits) take 38 us, against 14.5 for the attention (H200, eager profile); this way
        the two took 41.0 us a layer against 48.5 (attention_configs_h200_combine_27b_8k_{new,old}.json)."""
        for u in tl.static_range(UNROLL):
            s = first + u
            at = ((item0 + s) * kv_heads + h) * rows + r
            ok = live & (s < n_items)
            ws = tl.exp2(tl.load(part_ml_ptr + at * 2, mask=ok, other=float("-inf"), cache_modifier=".cg") - top)
            o = tl.load(part_o_ptr + at[:, None] * D + dims[None, :], mask=ok[:, None], other=0.0,
                        cache_modifier=".cg")
            acc += ws[:, None] * o
        return acc

    @triton.jit
    def _combine(part_o_ptr, part_ml_ptr, out_ptr, r, live, tok, head, dims, h, kv_heads, rows, item0, n_items,
                 max_items, so_n, so_h, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                 SPLITS_P: tl.constexpr, UNROLL: tl.constexpr, LOOP_WHILE: tl.constexpr, lib_o_ptr, lib_lse_ptr,
                 slo_s, slo_h, slo_r, sll_s, sll_h, LIB_SPLITS: tl.constexpr, LIB_P: tl.constexpr):
        """The splits' partial sums of rows r (KV head h; r indexes the partials' `rows`), head dims
        `dims` (BLOCK_D of D) -> the normalised output there, with LIB_SPLITS more from the library
        (`cudnn_prefix`'s outputs, each normalised, and its natural-log denominators: a partial of
        max lse * log2(e) and sum 1). Row r's partials are items item0[r] .. item0[r] + n_items[r]
        - 1 ([BLOCK_M] each; n_items at most max_items, at most SPLITS_P). Loads bypass L1 (`.cg`):
        the partials may have been written by other programs of the same launch."""
        sp = tl.arange(0, SPLITS_P)
        at = ((item0[None, :] + sp[:, None]) * kv_heads + h) * rows + r[None, :]  # [SPLITS_P, BLOCK_M]
        ok = (sp[:, None] < n_items[None, :]) & live[None, :]
        m = tl.load(part_ml_ptr + at * 2, mask=ok, other=float("-inf"), cache_modifier=".cg")
        top = tl.max(m, 0)
        if LIB_SPLITS > 0:
            ls = tl.arange(0, LIB_P)
            lib_m = tl.load(lib_lse_ptr + ls[:, None] * sll_s + h * sll_h + r[None, :],
                            mask=(ls[:, None] < LIB_SPLITS) & live[None, :], other=float("-inf")) * 1.4426950408889634
            top = tl.maximum(top, tl.max(lib_m, 0))
        top = tl.where(top == float("-inf"), 0.0, top)
        w = tl.exp2(m - top[None, :])  # a split that saw nothing: 0
        total = tl.sum(w * tl.load(part_ml_ptr + at * 2 + 1, mask=ok, other=0.0, cache_modifier=".cg"), 0)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        if LOOP_WHILE:  # Triton's interpreter cannot take a tensor as a `range` bound
            first = 0
            while first < max_items:
                acc = _combine_group(part_o_ptr, part_ml_ptr, acc, top, first, item0, n_items, kv_heads, h, rows, r,
                                     live, dims, D, UNROLL)
                first += UNROLL
        else:
            for first in range(0, max_items, UNROLL):
                acc = _combine_group(part_o_ptr, part_ml_ptr, acc, top, first, item0, n_items, kv_heads, h, rows, r,
                                     live, dims, D, UNROLL)
        if LIB_SPLITS > 0:
            total += tl.sum(tl.exp2(lib_m - top[None, :]), 0)
            for u in tl.static_range(LIB_SPLITS):
                wl = tl.exp2(tl.load(lib_lse_ptr + u * sll_s + h * sll_h + r, mask=live, other=float("-inf"))
                             * 1.4426950408889634 - top)
                o = tl.load(lib_o_ptr + u * slo_s + h * slo_h + r[:, None] * slo_r + dims[None, :], mask=live[:, None],
                            other=0.0)
                acc += wl[:, None] * o.to(tl.float32)
        out = acc / tl.where(live & (total > 0), total, 1.0)[:, None]  # no key seen: zeros
        tl.store(out_ptr + tok[:, None] * so_n + head[:, None] * so_h + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=live[:, None])

    @triton.jit
    def _combine_kernel(part_o_ptr, part_ml_ptr, out_ptr, rows, splits, so_n, so_h, lib_o_ptr, lib_lse_ptr, slo_s,
                        slo_h, slo_r, sll_s, sll_h, prefix_ptr, batch, row_len, max_kv, slots, block_cols, folded,
                        GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                        SPLITS_P: tl.constexpr, UNROLL: tl.constexpr, LOOP_WHILE: tl.constexpr,
                        LIB_SPLITS: tl.constexpr, LIB_P: tl.constexpr, BALANCED: tl.constexpr,
                        BATCH_P: tl.constexpr, BLOCK_N: tl.constexpr, WAIT: tl.constexpr):
        """Program (row block, KV head, head-dim chunk): `_combine` as its own launch, when the
        partials are too many for the last split to combine them, `fold_combine` is off, or the
        library's LIB_SPLITS partials (strides slo_*, sll_*) are merged too. BALANCED: a balanced
        split's partials (`_attention`'s), each row's found from the prefix lengths of the batch's
        rows (row_len rows each) as the attention found them, but for rows of at most `folded`
        items, which the attention launch combined. WAIT: a programmatic dependent launch, which
        waits for the launch before it to end before it reads anything."""
        if WAIT:
            gdc_wait()
        r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        h = tl.program_id(1)
        dims = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
        live = r < rows
        if BALANCED:
            rb = tl.arange(0, BATCH_P)
            firsts, counts, _ = _row_items(prefix_ptr, batch, block_cols, max_kv, slots, BLOCK_N, BATCH_P)
            b = r // row_len
            item0 = _rows_value(firsts, rb, b)
            n_items = _rows_value(counts, rb, b)
            live = live & (n_items > folded)
            _combine(part_o_ptr, part_ml_ptr, out_ptr, r % row_len, live, r // GROUP, h * GROUP + r % GROUP, dims,
                     h, tl.num_programs(1), row_len, item0, n_items, tl.max(tl.where(live, n_items, 0), 0), so_n,
                     so_h, D, BLOCK_M, BLOCK_D, SPLITS_P, UNROLL, LOOP_WHILE, lib_o_ptr, lib_lse_ptr, slo_s, slo_h,
                     slo_r, sll_s, sll_h, LIB_SPLITS, LIB_P)
        else:
            zero = tl.zeros_like(r)
            _combine(part_o_ptr, part_ml_ptr, out_ptr, r, live, r // GROUP, h * GROUP + r % GROUP, dims, h,
                     tl.num_programs(1), rows, zero, zero + splits, splits, so_n, so_h, D, BLOCK_M, BLOCK_D, SPLITS_P,
                     UNROLL, LOOP_WHILE, lib_o_ptr, lib_lse_ptr, slo_s, slo_h, slo_r, sll_s, sll_h, LIB_SPLITS, LIB_P)

    @triton.jit
    def _split_tile(first, splits, kv_heads, h, rows, r, live, BLOCK_S: tl.constexpr):
        """Splits [first, first + BLOCK_S) of rows r (KV head h): each entry's index into the
        partials' [splits, KV heads, rows] layout, and which are real -> two [BLOCK_S, BLOCK_M, 1]."""
        sp = first + tl.arange(0, BLOCK_S)
        at = (sp[:, None, None] * kv_heads + h) * rows + r[None, :, None]
        ok = (sp[:, None, None] < splits) & live[None, :, None]
        return at, ok

    @triton.jit
    def _combine_tiled_kernel(part_o_ptr, part_ml_ptr, out_ptr, rows, splits, so_n, so_h, GROUP: tl.constexpr,
                              D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                              BLOCK_S: tl.constexpr):
        """Program (row block, KV head, head-dim chunk): the combine (`_combine`'s result) from
        [BLOCK_S, BLOCK_M, BLOCK_D] tiles of the partial sums, BLOCK_S splits a step (one step
        where that covers them all): a pass for the rows' largest running max, then one that sums
        the weighted partials over the split axis. Every tile keeps the 3-D layout, so no step
        waits on a layout change."""
        r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        h = tl.program_id(1)
        kv_heads = tl.num_programs(1)
        dims = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
        live = r < rows
        top = tl.full([1, BLOCK_M, 1], float("-inf"), tl.float32)
        first = 0
        while first < splits:  # runs once where BLOCK_S covers every split
            at, ok = _split_tile(first, splits, kv_heads, h, rows, r, live, BLOCK_S)
            m = tl.load(part_ml_ptr + at * 2, mask=ok, other=float("-inf"), cache_modifier=".cg")
            top = tl.maximum(top, tl.max(m, 0, keep_dims=True))
            first += BLOCK_S
        top = tl.where(top == float("-inf"), 0.0, top)  # rows that saw no key: zeros below
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        total = tl.zeros([BLOCK_M, 1], tl.float32)
        first = 0
        while first < splits:
            at, ok = _split_tile(first, splits, kv_heads, h, rows, r, live, BLOCK_S)
            w = tl.exp2(tl.load(part_ml_ptr + at * 2, mask=ok, other=float("-inf"), cache_modifier=".cg") - top)
            sums = tl.load(part_ml_ptr + at * 2 + 1, mask=ok, other=0.0, cache_modifier=".cg")
            o = tl.load(part_o_ptr + at * D + dims[None, None, :], mask=ok, other=0.0, cache_modifier=".cg")
            total += tl.sum(w * sums, 0)
            acc += tl.sum(w * o, 0)
            first += BLOCK_S
        out = acc / tl.where(live[:, None] & (total > 0), total, 1.0)
        tok, head = r // GROUP, h * GROUP + r % GROUP
        tl.store(out_ptr + tok[:, None] * so_n + head[:, None] * so_h + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=live[:, None])
