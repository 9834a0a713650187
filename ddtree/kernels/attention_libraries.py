"""The prefix of a verify's attention through other kernels than `tree_attention`'s Triton one,
merged with the rest by the combine launch (`attention_combine.launch_combine`):

- on sm_90, by default, the warp-specialised Gluon kernel of `prefix_attention_sm90` over the whole
  prefix (its length read on the device), and with it the tree's own block (GLUON_BLOCK), so that
  the combine launch alone follows it; a prefill chunk's own keys then go through cuDNN's causal
  attention (`_causal_block`);
- opt-in (`DDTREE_CUDNN_PREFIX=1`, `cudnn_prefix`): a long prefix's first keys through cuDNN, in
  chunks run as a batch; faster for the attention alone at many rows, in a whole round only at
  Qwen3.6-27B shape over 32k tokens (5% at budget 256; the measurements are at CUDNN_PREFIX).

cuDNN through PyTorch in two forms that would take every prefix key was tried and not kept
(benchmarks/README.md): with the key lengths on the device (the ragged form) it took 42-50 ms a
call and its graph capture failed; with an additive mask over a KV bucket's keys it was 1.3-2.9x
slower than without one.

A path that fails to build or launch on this machine (an older Triton, a cuDNN that refuses the
layout) is logged once and not tried again at that dtype and head_dim: the Triton kernel attends.
"""
from __future__ import annotations

import functools
import logging
import os

import torch

from ddtree.kernels.attention_combine import launch_combine
from ddtree.kernels.attention_plan import AttentionConfig, sm_count, tiling

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
log = logging.getLogger("ddtree.tree_attention")

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
# many enough to gain (H200, benchmarks/prefix_attention_sm90.py: at head_dim 128, 68 rows lost
# 3 us to the extra launch the tree's block then took and 260 gained 11 us; at 256, 102 rows gain
# 22 us over 32k keys). With the block in the same launch (GLUON_BLOCK), 64 rows at head_dim 128
# (the drafter's block of 16, the chain, budget 15) gain too: the drafter's five layers at 32k 1.18
# -> 1.15 ms a round on the H200, and rounds at 8k on an H100 no slower (benchmarks/README.md, "The
# drafter's block through the prefix kernel").
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
GLUON_MIN_ROWS = {64: 129, 128: 64, 256: 65}  # by head_dim
# A batch's rows in one launch (`attend_batch`) keep 129 at head_dim 128: 64-row batches through
# the kernel (the batched engine's drafts and budget-15 verifies) have not been timed.
GLUON_MIN_ROWS_BATCH = GLUON_MIN_ROWS | {128: 129}
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
    n, least = (n, GLUON_MIN_ROWS) if tokens is None else (tokens, GLUON_MIN_ROWS_BATCH)
    return (GLUON_PREFIX and not _INTERPRETED and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
            and d in least and n * (hq // k.shape[1]) >= least[d]
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


def attend_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                  prefix_len: torch.Tensor, min_prefix: int, causal_block: bool,
                  config: AttentionConfig | None) -> tuple[torch.Tensor | None, tuple | None]:
    """`tree_attention.masked_attention`'s prefix form (its arguments) through a library where one
    serves -> (out [N, Hq * D], None) where the whole attention was done here; (None, (o, lse, P))
    the partials of keys [0, P) for the Triton kernel to merge with the rest (P None: the whole
    prefix, its length read on the device); (None, None) where no library serves."""
    n, hq, d = q.shape
    partials = None
    if _gluon_prefix(q, k, v, min_prefix):
        try:
            whole, partials = _through_gluon(q, k, v, mask, scale, prefix_len, causal_block, config)
        except Exception as exc:  # noqa: BLE001 (a Triton whose Gluon does not build or launch this kernel)
            _gluon_failed(q, exc)
            whole = None
        if whole is not None:
            return whole, None
        if partials is not None and causal_block and (q.dtype, d) not in _CUDNN_FAILED:
            try:
                return _causal_block(q, k[min_prefix:min_prefix + n], v[min_prefix:min_prefix + n], scale,
                                     partials), None
            except RuntimeError as exc:  # this cuDNN does not take the layout: the Triton kernel from now on
                _CUDNN_FAILED.add((q.dtype, d))
                log.warning("cuDNN causal attention failed (%s); the Triton kernel attends to the block", str(exc)[:200])
    if partials is None:
        keys = _cudnn_keys(q, k, min_prefix)
        if keys:
            chunks = cudnn_splits(n * (hq // k.shape[1]), k.shape[1], d, keys, sm_count(q.device))
            try:
                partials = (*cudnn_prefix(q, k, v, keys, chunks, scale), keys)
            except RuntimeError as exc:  # this cuDNN does not take the layout: the kernel alone from now on
                # (a graph's capture is preceded by an eager run, which fails first)
                if q.is_cuda and torch.cuda.is_current_stream_capturing():
                    raise
                _CUDNN_FAILED.add((q.dtype, d))
                log.warning("cuDNN attention failed (%s); the Triton kernel attends alone", str(exc)[:200])
    return None, partials


def attend_batch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: torch.Tensor, scale: float,
                 prefix_len: torch.Tensor, first_slot: torch.Tensor, max_kv: int,
                 config: AttentionConfig | None) -> torch.Tensor | None:
    """`tree_attention.batched_masked_attention`'s prefix form (its arguments) through the Gluon
    kernel, every row's prefix and block in one launch and one combine launch -> out
    [R * M, Hq * D]; None where it does not serve (the rows' prefixes may be short, or a row's
    tokens few: `_gluon_prefix`; a block wider than GLUON_BLOCK_MAX_COLS) or failed."""
    cols = block_mask.shape[2]
    # (max_kv - cols bounds the rows' prefixes, it does not guarantee them: a row of a short prefix
    # leaves its later splits' programs one masked tile each)
    if not (cols <= GLUON_BLOCK_MAX_COLS and GLUON_BLOCK
            and _gluon_prefix(q, k, v, max_kv - cols, tokens=block_mask.shape[1])):
        return None
    try:
        return _batched_through_gluon(q, k, v, block_mask, scale, prefix_len, first_slot, max_kv, config)
    except Exception as exc:  # noqa: BLE001 (a Triton whose Gluon does not build or launch this kernel)
        _gluon_failed(q, exc, " on a batch")
        return None


def _through_gluon(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                   prefix_len: torch.Tensor, causal_block: bool, config: AttentionConfig | None) -> tuple:
    """`attend_prefix` through `prefix_attention_sm90` -> (out [N, Hq * D], None) where its first
    split takes the tree's block too and one combine launch merges the splits (GLUON_BLOCK), else
    (None, the prefix's partials (o, lse, None)) for the rest of the attention to merge with."""
    from ddtree.kernels.prefix_attention_sm90 import PDL, prefix_attention, splits_for, tiling as gluon_tiling

    n, hq, d = q.shape
    rows = n * (hq // k.shape[1])
    max_keys = k.shape[0] - mask.shape[1]  # prefix_len + M <= T
    sms = sm_count(q.device)
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
    launch_combine(lse, lse, out, rows, hkv, hq // hkv, d, 0, config, (o, lse, None),  # no split of its own
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
    launch_combine(part_o.view(1, hkv, rows, d), part_ml, out, rows, hkv, group, d, 1,
                   tiling(rows, n, d, element_bytes=q.element_size()), prefix_partials)
    return out.view(n, hq * d)


def _batched_through_gluon(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: torch.Tensor, scale: float,
                           prefix_len: torch.Tensor, first_slot: torch.Tensor, max_kv: int,
                           config: AttentionConfig | None) -> torch.Tensor:
    """`attend_batch`: the prefix form through `prefix_attention_sm90` with its rows as a
    batch (each row's prefix below max_kv, its block in its first split), merged by one combine
    launch -> out [R * M, Hq * D]. Its rows are split alike over max_kv, not by their own keys as
    the Triton kernel's are (`row_items`): a long row among short ones runs on its few splits."""
    from ddtree.kernels.prefix_attention_sm90 import PDL, prefix_attention, splits_for, tiling as gluon_tiling

    batch, m, cols = block_mask.shape
    hkv, d = k.shape[1], q.shape[2]
    rows = m * (q.shape[1] // hkv)
    sms = sm_count(q.device)
    t = gluon_tiling(d, rows, hkv, sms, batch)
    splits = splits_for(t, rows, hkv, sms, max_kv, d, batch)
    o, lse = prefix_attention(q, k, v, prefix_len, max_kv, splits, scale, t, block=block_mask, first_slot=first_slot)
    return _merge_library(q, o, lse, cols, config, dependent=t.get("PDL", PDL))
