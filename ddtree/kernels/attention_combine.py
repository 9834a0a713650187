"""The merge of a split attention's partial sums: each key split (and a library's chunks: cuDNN's,
the Gluon prefix kernel's splits) leaves per row a partial output and its softmax statistics, and
the combine weighs each by exp(its max - the overall max) and normalises by the summed
denominators, as flash-decoding does.

- `combine` (device): the merge of one row block's partials, called by the attention kernel's last
  split to finish (the fold, no second launch) and by the combine launch;
- `launch_combine` (host): the combine as its own launch, where the partials are too many to fold,
  or come from a library; tiled over [splits, rows, dims] where one 16-row block holds the rows.

Partial layouts: the Triton kernel's part_o [items, Hkv, rows, D] float32 (unnormalised sums) and
part_ml [items, Hkv, rows, 2] (running max in base 2, denominator); a library's (o, lse) as
`attention_libraries.cudnn_prefix` gives them (normalised outputs, natural-log denominators).
"""
from __future__ import annotations

import os

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_wait
except ImportError:  # the CPU install has no Triton: `layers.attend` uses PyTorch's attention
    triton = None

from ddtree.kernels.attention_plan import AttentionConfig

if triton is not None:
    from ddtree.kernels.attention_plan import device_row_items, rows_value

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def launch_combine(part_o, part_ml, out, rows: int, hkv: int, group: int, d: int, splits: int,
                   config: AttentionConfig, library=None, rows_of=None, dependent: bool = False) -> None:
    """The combine launch over `rows` rows per KV head (a batch's rows one after another): tiled
    where `config.combine_tiled` says so (by default where one 16-row block holds the rows), else a
    split at a time, the library's partials (`tree_attention._launch`'s) merged too (splits 0:
    the library's alone).
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
    def combine(part_o_ptr, part_ml_ptr, out_ptr, r, live, tok, head, dims, h, kv_heads, rows, item0, n_items,
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
        """Program (row block, KV head, head-dim chunk): `combine` as its own launch, when the
        partials are too many for the last split to combine them, `fold_combine` is off, or the
        library's LIB_SPLITS partials (strides slo_*, sll_*) are merged too. BALANCED: a balanced
        split's partials (`tree_attention._attention`'s), each row's found from the prefix lengths
        of the batch's rows (row_len rows each) as the attention found them, but for rows of at
        most `folded` items, which the attention launch combined. WAIT: a programmatic dependent
        launch, which waits for the launch before it to end before it reads anything."""
        if WAIT:
            gdc_wait()
        r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        h = tl.program_id(1)
        dims = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
        live = r < rows
        if BALANCED:
            rb = tl.arange(0, BATCH_P)
            firsts, counts, _ = device_row_items(prefix_ptr, batch, block_cols, max_kv, slots, BLOCK_N, BATCH_P)
            b = r // row_len
            item0 = rows_value(firsts, rb, b)
            n_items = rows_value(counts, rb, b)
            live = live & (n_items > folded)
            combine(part_o_ptr, part_ml_ptr, out_ptr, r % row_len, live, r // GROUP, h * GROUP + r % GROUP, dims,
                     h, tl.num_programs(1), row_len, item0, n_items, tl.max(tl.where(live, n_items, 0), 0), so_n,
                     so_h, D, BLOCK_M, BLOCK_D, SPLITS_P, UNROLL, LOOP_WHILE, lib_o_ptr, lib_lse_ptr, slo_s, slo_h,
                     slo_r, sll_s, sll_h, LIB_SPLITS, LIB_P)
        else:
            zero = tl.zeros_like(r)
            combine(part_o_ptr, part_ml_ptr, out_ptr, r, live, r // GROUP, h * GROUP + r % GROUP, dims, h,
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
        """Program (row block, KV head, head-dim chunk): the combine (`combine`'s result) from
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
