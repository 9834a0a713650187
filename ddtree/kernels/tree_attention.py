"""Masked attention of a few new tokens over a cached context, as one Triton kernel: the verify of
a tree, an autoregressive step, the drafter's block.

PyTorch's attention with a boolean/additive mask gives each (KV head, 64-row query tile) one
program that walks every key: at Qwen3-8B shape that is 8 programs for an autoregressive step
(27 us per layer, 1.0 ms per forward, where reading the keys takes a few microseconds). Here:

- rows are (token, query head of the KV head's group) pairs, read straight from q [N, Hq, D], so
  the keys and values of a KV head are read once for its whole group, with no copies in or out;
- the keys are split across programs (flash-decoding) until the GPU is full (`attention_plan`);
  the last split of each row block to finish (an arrival counter) combines the splits' partial
  softmax sums, so a split costs no second launch (when the partials are few; else a combine
  kernel does it: `attention_combine`);
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
Long prefixes may go through other kernels first (`attention_libraries`): on sm_90 the Gluon kernel
of `prefix_attention_sm90` by default, cuDNN as an opt-in; their partials are merged by the combine
launch.

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

import logging
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install has no Triton: `layers.attend` uses PyTorch's attention
    triton = None

from ddtree.kernels import attention_combine, attention_libraries
from ddtree.kernels.attention_plan import (BALANCE_MAX_ROWS, BALANCE_MIN_KEYS, AttentionConfig, plan, plan_rows,
                                           sm_count, tiling)

if triton is not None:
    from ddtree.kernels.attention_combine import combine
    from ddtree.kernels.attention_plan import device_row_items, row_value

# The last split combines in the kernel only while it reads at most this many partial rows
# (block_m x splits): H200, Qwen3-8B heads, per layer: N = 1 (16 x 12) 8.6 -> 5.9 us, N = 257
# (64 x 2) 25.3 -> 24.3; but N = 17 (64 x 12) 13.5 -> 22.7, one program reading them all.
FOLD_MAX_PARTIALS = 512
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
    a CUDA graph's replays included. Where it is long and the rows many, the prefix goes through a
    library first (`attention_libraries.attend_prefix`): on sm_90 the whole prefix [0, prefix_len)
    through the warp-specialised Gluon kernel (`prefix_attention_sm90`), the prefix length read on
    the device, and so do the block's columns (its first split's programs read them through the
    mask; GLUON_BLOCK), leaving the combine launch alone to merge its splits; or, opt-in, keys
    [0, P), P = min_prefix rounded down to CUDNN_QUANTUM, through cuDNN (`cudnn_prefix`). Then
    this kernel attends to the rest, merging both in its combine launch. prefix_partials: (o, lse,
    P) in `cudnn_prefix`'s layout for keys [0, P), or for the whole prefix where P is None, made by
    the caller instead (tests).

    causal_block (a prefill chunk): mask is the lower triangle [N, N] and prefix_len equals
    min_prefix. With the Gluon prefix, the block's keys [P, P + N) then go through cuDNN's causal
    attention instead of the Triton kernel (`attention_libraries._causal_block`), merged with the
    prefix by the combine launch."""
    n, hq, d = q.shape
    rows = n * (hq // k.shape[1])
    prefix = prefix_len is not None
    if prefix and prefix_partials is None:
        whole, prefix_partials = attention_libraries.attend_prefix(q, k, v, mask, scale, prefix_len, min_prefix,
                                                                   causal_block, config)
        if whole is not None:
            return whole
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
    row's tokens many (`attention_libraries.attend_batch`), every row's prefix and block go
    through the Gluon kernel (`prefix_attention_sm90`, the rows a batch of one launch) and one
    combine launch merges them.

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
    if prefix and splits is None:
        out = attention_libraries.attend_batch(q, k, v, block_mask, scale, prefix_len, first_slot, max_kv, config)
        if out is not None:
            return out
    config = config or tiling(m * (hq // k.shape[1]), max_kv, d, batch, q.element_size())
    return _launch(q, k, v, block_mask.reshape(rows_total, cols), prefix_len if prefix else ranges, first_slot, batch,
                   max_kv, scale, prefix, splits, config)


def _launch(q, k, v, mask, ranges, first_slot, batch, max_kv, scale, prefix, splits, config, library=None):
    """One `_attention` launch (and, when the partials are many, a combine launch:
    `attention_combine.launch_combine`) over `batch` rows of q's tokens; keys are split over
    [0, max_kv) of each row. library: (o, lse, P), `cudnn_prefix`'s partial sums over the keys
    before k[0] (P of them; the prefix form, one batch row), merged by the combine launch; P None:
    over the whole prefix, whose length the kernel reads on the device, k and v whole (the kernel
    then reads the block's columns alone: max_kv is their count)."""
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
        block_m, slots = plan_rows(rows, hkv, batch, max_kv, sm_count(q.device), config)
        slots = slots if splits is None else max(1, min(splits, batch * key_blocks))
        splits = min(slots + 1, key_blocks)  # the most work items a row gets
        items = slots + batch  # the grid's split axis; the partials' leading dim
        keys_per_split = 0  # each row's own, on the device
    else:
        block_m, auto_splits = plan(rows, hkv * batch, max_kv, sm_count(q.device), config)
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
        attention_combine.launch_combine(part_o, part_ml, out, batch * rows, hkv, group, d, splits, config, library,
                                         rows_of)
    return out.view(n, hq * d)


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
        start at key key0 (the keys before it summed by the library, merged by the combine launch);
        PREFIX_DONE: the whole prefix was summed by the library, so only the block's columns here
        (keys_per_split and splits planned over them).
        BATCHED: axis 2 is (batch row b, split s); b's `rows` rows follow b - 1's, its keys start at
        slot first_ptr[b] of k and v, and its prefix length is range_ptr[b] (PREFIX), or each of its
        tokens' ranges and mask rows follow the previous row's (counted from that first slot).
        BALANCED (PREFIX): axis 2 is the work item w of `device_row_items`: the row b whose items hold w,
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
                firsts, counts, spans = device_row_items(range_ptr, batch, block_cols, max_kv, slots, BLOCK_N, BATCH_P)
                item = tl.program_id(2)
                b = tl.sum((firsts + counts <= item).to(tl.int32), 0)  # rows whose items all come before
                valid = b < batch
                b = tl.minimum(b, batch - 1)
                item0 = row_value(firsts, rb, b)
                n_items = row_value(counts, rb, b)
                split_keys = row_value(spans, rb, b) * BLOCK_N
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
                combine(part_o_ptr, part_ml_ptr, out_ptr, r_item, live, tok, head, dims, h, tl.num_programs(1),
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
