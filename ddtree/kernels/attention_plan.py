"""How a tree-attention launch divides its work among programs: the tiling (`AttentionConfig`,
chosen by `tiling`), the key split (`plan`), and for a batch's rows the balanced split
(`plan_rows`, `row_items` on the host, `device_row_items` on the device), which cuts each row's
keys in items of one length so that a long row among short ones is spread over the GPU.

Shared by the Triton attention (`tree_attention`), its combine launch (`attention_combine`) and
the library prefix paths (`attention_libraries`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install has no Triton: `layers.attend` uses PyTorch's attention
    triton = None

BALANCE_MIN_KEYS = 4096  # a batch's bound on a row's keys from which its split follows the rows' keys
BALANCE_MAX_ROWS = 32  # ... for rows (tokens x group) of at most this many a batch row: DEFAULT's tiles


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """The device's SMs, which the splits fill."""
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
    max_kv; `device_row_items` on the device) -> each row's (first work item, items, key tiles an item).

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



if triton is not None:

    @triton.jit
    def device_chunk_within(tiles, total, rows, items):
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
    def device_row_items(prefix_ptr, batch, block_cols, max_keys, slots, BLOCK_N: tl.constexpr, BATCH_P: tl.constexpr):
        """The balanced split of a batch's rows (`row_items` on the host, which says how the chunk is
        chosen): row b's keys (its prefix and block columns, at most max_keys, at least one tile)
        cut into items of `span` tiles -> (first item, items, span) [BATCH_P], zeros past `batch`."""
        rb = tl.arange(0, BATCH_P)
        real = rb < batch
        keys = tl.minimum(tl.load(prefix_ptr + rb, mask=real, other=0).to(tl.int32) + block_cols, max_keys)
        tiles = tl.where(real, tl.maximum((keys + BLOCK_N - 1) // BLOCK_N, 1), 0)
        total = tl.sum(tiles, 0)
        chunk = device_chunk_within(tiles, total, batch, slots + batch)
        if batch <= slots:
            one_wave = device_chunk_within(tiles, total, batch, slots)
            chunk = tl.where(one_wave * slots <= total + chunk * slots, one_wave, chunk)
        items = (tiles + chunk - 1) // chunk
        span = (tiles + tl.maximum(items, 1) - 1) // tl.maximum(items, 1)
        items = (tiles + tl.maximum(span, 1) - 1) // tl.maximum(span, 1)  # evened out, none empty
        return tl.cumsum(items, 0) - items, items, span

    @triton.jit
    def row_value(values, rb, b):
        """values[b] of a [BATCH_P] tensor (rb its arange), b a scalar."""
        return tl.sum(tl.where(rb == b, values, 0), 0)

    @triton.jit
    def rows_value(values, rb, b):
        """values[b[i]] for each i of b [BLOCK_M] -> [BLOCK_M] (0 where b[i] is past the batch)."""
        return tl.sum(tl.where(rb[None, :] == b[:, None], values[None, :], 0), 1)
