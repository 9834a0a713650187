"""Writing new keys and values into the KV cache, and compacting it after a round, as Triton kernels.

`KVCache.write` with PyTorch is two `index_copy_` launches per layer, 72 per Qwen3-8B forward,
each a few microseconds of latency for a few hundred kilobytes (on an H200: 163 us per one-token
forward, 217 us at 257 tokens). Here one program per (new token, layer) reads its keys and values
in place (views of the fused projection's rows) and stores them at its slot: one launch per layer
(52 us and 58 us there, benchmarks/README.md), or one for all layers (the drafter's context).

`compact_kv` moves the accepted tree nodes' entries into place in every layer at once (and, for a
batched round, in every row of the batch): one launch for what `index_select` + `index_copy_` do
in four (plus the index arithmetic), with all of a program's sources read before any of its
writes, so overlapping moves are safe.

The results equal `index_copy_` exactly (they are copies); tests run both, on the CPU through
Triton's interpreter.
"""
from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents
except ImportError:  # the CPU install has no Triton: `KVCache.write` uses index_copy_
    triton = None


def supported(cache_k: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the kernel handles this cache: [..., slots, Hkv, D] with unit strides inside a slot,
    and sources with a unit last stride."""
    return triton is not None and cache_k.stride(-1) == 1 and cache_k.stride(-2) == cache_k.shape[-1] \
        and k.stride(-1) == 1


@functools.cache
def signals_dependents(device: torch.device) -> bool:
    """Whether a launch on this GPU may let the next one start early (programmatic dependent launch,
    sm_90 on): the layer's attention after the write is launched so (`prefix_attention_sm90.PDL`)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def write_kv(cache_k: torch.Tensor, cache_v: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """One layer: cache_k, cache_v [S, Hkv, D]; k, v [N, Hkv, D]. Several: cache_k, cache_v [L, S, Hkv, D];
    k, v [N, L, Hkv, D]. slots [N] long; k, v with any strides and a unit last one ->
    cache_k[..., slots[i], :, :] = k[i], likewise v (one launch for all layers)."""
    if cache_k.dim() == 3:
        cache_k, cache_v, k, v = cache_k[None], cache_v[None], k[:, None], v[:, None]
    n, layers, hkv, d = k.shape
    if n == 0:
        return
    if v.stride(-1) != 1:
        v = v.contiguous()
    _write_kv[(n, layers)](k, v, slots, cache_k, cache_v, k.stride(0), k.stride(1), k.stride(2), v.stride(0),
                           v.stride(1), v.stride(2), cache_k.stride(0), cache_k.stride(1), cache_k.stride(2),
                           H=hkv, D=d, HP=triton.next_power_of_2(hkv), DP=triton.next_power_of_2(d),
                           SIGNAL=signals_dependents(k.device), num_warps=4)


def compact_kv(cache_k: torch.Tensor, cache_v: torch.Tensor, start: torch.Tensor, order: torch.Tensor) -> None:
    """cache_k, cache_v [L, S, Hkv, D]; start [] long; order [M] long -> in every layer, slot
    start + j takes what slot start + order[j] held, for j < M (the same as gathering all
    sources first, then writing). Many spans at once: start [R], order [R, M], each span r
    moved within slots start[r] .. start[r] + M - 1 (spans that do not overlap: a batch's rows)."""
    layers, _, hkv, d = cache_k.shape
    spans, m = (1, order.shape[0]) if order.dim() == 1 else order.shape
    row = hkv * d
    mp = triton.next_power_of_2(m)
    cols = min(triton.next_power_of_2(row), max(16, 8192 // mp))  # a program holds [mp, cols] entries
    col_blocks = triton.cdiv(row, cols)
    grid = (layers, 2, spans * col_blocks)
    _compact_kv[grid](cache_k, cache_v, start, order.contiguous(), cache_k.stride(0), cache_k.stride(1), row, m,
                      col_blocks, MP=mp, COLS=cols, num_warps=4)


if triton is not None:

    @triton.jit
    def _compact_kv(ck_ptr, cv_ptr, start_ptr, order_ptr, s_l, s_t, row, m, col_blocks, MP: tl.constexpr,
                    COLS: tl.constexpr):
        """Program (layer, k or v, (span, column block)): span r's rows start[r] + order[r, j] ->
        rows start[r] + j, j < m."""
        base = tl.program_id(0).to(tl.int64) * s_l
        span = tl.program_id(2) // col_blocks
        block = tl.program_id(2) % col_blocks
        if tl.program_id(1) == 0:
            _move_rows(ck_ptr + base, start_ptr + span, order_ptr + span * m, block, s_t, row, m, MP, COLS)
        else:
            _move_rows(cv_ptr + base, start_ptr + span, order_ptr + span * m, block, s_t, row, m, MP, COLS)

    @triton.jit
    def _move_rows(ptr, start_ptr, order_ptr, block, s_t, row, m, MP: tl.constexpr, COLS: tl.constexpr):
        """Reads all of the program's sources, then (after a block barrier) writes: programs touch
        disjoint columns (or spans), so no write can land before a read of the same entry."""
        c = block * COLS + tl.arange(0, COLS)
        j = tl.arange(0, MP)
        live = (j < m)[:, None] & (c < row)[None, :]
        start = tl.load(start_ptr)
        src = start + tl.load(order_ptr + j, mask=j < m, other=0)
        entries = tl.load(ptr + src[:, None] * s_t + c[None, :], mask=live)
        tl.debug_barrier()
        tl.store(ptr + (start + j)[:, None] * s_t + c[None, :], entries, mask=live)

    @triton.jit
    def _write_kv(k_ptr, v_ptr, slots_ptr, ck_ptr, cv_ptr, sk_n, sk_l, sk_h, sv_n, sv_l, sv_h, sc_l, sc_t, sc_h,
                  H: tl.constexpr, D: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr, SIGNAL: tl.constexpr):
        """Program (i, layer): token i's [H, D] keys and values of that layer -> its cache rows at slots[i].
        SIGNAL: the next launch, where it is a programmatic dependent one, may start now (its
        programs wait for this launch's end before they read what it writes)."""
        if SIGNAL:
            gdc_launch_dependents()
        i = tl.program_id(0)
        layer = tl.program_id(1)
        slot = tl.load(slots_ptr + i).to(tl.int64)
        h = tl.arange(0, HP)[:, None]
        d = tl.arange(0, DP)[None, :]
        inside = (h < H) & (d < D)
        at = layer.to(tl.int64) * sc_l + slot * sc_t + h * sc_h + d
        tl.store(ck_ptr + at, tl.load(k_ptr + i * sk_n + layer * sk_l + h * sk_h + d, mask=inside), mask=inside)
        tl.store(cv_ptr + at, tl.load(v_ptr + i * sv_n + layer * sv_l + h * sv_h + d, mask=inside), mask=inside)
