"""An attention layer's inputs after its q/k/v projection, in one launch: the query and key heads'
RMSNorm and rotary embedding, the queries written out, the keys and values stored at their cache
slots.

Why: compiled with Inductor, the norms and rotations of q and of k were two launches and the cache
write (`kv_write`) a third, each a few microseconds of latency for a few hundred kilobytes (H200,
Qwen3-8B at 65 tokens: 3.0 + 2.0 + 1.5 us a layer, 36 layers a verify;
benchmarks/results/verify_profile_h200_qwen3_8b_32k_current.json).

Numerics follow `fused.rms_norm` / `hybrid.zero_centred_rms_norm` and `fused.rotate` as Inductor
computes them: float32 throughout, the normalised head rounded to the inputs' dtype before the
norm's weight where `rms_norm` rounds it there, the result rounded once when stored. Tested against
those functions (eager) in Triton's interpreter.
"""
from __future__ import annotations

import torch

from ddtree.kernels.kv_write import signals_dependents

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents
except ImportError:  # the CPU install has no Triton: callers keep the compiled functions
    triton = None

HEADS_PER_PROGRAM = 4


def supported(x: torch.Tensor, cache_k: torch.Tensor) -> bool:
    """Whether the kernel serves a layer whose projection x is on a GPU, with this cache [S, Hkv, D]:
    Triton there, D a power of two, each slot's heads contiguous."""
    d = cache_k.shape[-1]
    return (triton is not None and x.is_cuda and d == triton.next_power_of_2(d) and cache_k.stride(-1) == 1
            and cache_k.stride(-2) == d)


def qk_rope_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm: torch.Tensor | None,
                  k_norm: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, eps: float, slots: torch.Tensor,
                  cache_k: torch.Tensor, cache_v: torch.Tensor, centred: bool = False,
                  scale_rows: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, Hq, D], k, v [N, Hkv, D] (views of the projection's rows), norms [D] or None (no q/k
    norm), cos, sin [N, R] (R <= D rotary channels, as `fused.rotate` takes them), slots [N] long,
    cache_k, cache_v [S, Hkv, D] -> q normed and rotated [N, Hq, D] (contiguous); k normed and
    rotated and v stored at cache rows `slots`. centred: the norm scales by (1 + weight) in float32
    and rounds once (`hybrid.zero_centred_rms_norm`), else by weight after rounding (`fused.rms_norm`).
    scale_rows [N, H] (unit last stride): each token's q, k and v first multiplied by its row's
    1 / sqrt(mean(h^2) + eps), the layer's input norm, for a q/k/v weight with that norm's weight
    folded into it (`TargetModel.fold_norms`)."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    rotary = cos.shape[-1]
    if rotary % 2 or rotary > d or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError(f"qk_rope_write takes cos, sin [N, R] with R even, at most {d}, unit last strides")
    if q.stride(-1) != 1 or any(x.stride(-1) != 1 or x.stride(-2) != d for x in (k, v)):
        raise ValueError("qk_rope_write takes q with a unit last stride and k, v with each token's heads contiguous")
    scaled = scale_rows is not None
    if scaled and (scale_rows.shape[0] != n or scale_rows.stride(-1) != 1):
        raise ValueError("qk_rope_write's scale_rows is [N, H] with a unit last stride")
    out = torch.empty(n, hq, d, dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    h = scale_rows if scaled else q
    norm = q_norm is not None
    blocks = triton.cdiv(hq, HEADS_PER_PROGRAM) + triton.cdiv(hkv, HEADS_PER_PROGRAM)
    _qk_rope_write[(n, blocks)](
        q, k, v, q_norm if norm else q, k_norm if norm else k, cos, sin, slots, out, cache_k, cache_v,
        q.stride(0), q.stride(1), k.stride(0), v.stride(0), cos.stride(0), sin.stride(0), cache_k.stride(0), eps,
        hq, hkv, h, h.stride(0), h.shape[-1] if scaled else 0, D=d, ROTARY=rotary, HB=HEADS_PER_PROGRAM, NORM=norm,
        CENTRED=centred, SCALED=scaled, SIGNAL=signals_dependents(q.device), num_warps=4)
    return out


if triton is not None:
    from ddtree.kernels.rms_scale import row_rms_scale

    @triton.jit
    def _norm_rope(x_ptr, rows, live, dims, partner, w_ptr, cos, sin, eps, scale, D: tl.constexpr,
                   ROTARY: tl.constexpr, NORM: tl.constexpr, CENTRED: tl.constexpr):
        """Heads at x_ptr + rows [HB, 1] (+ dims [1, D]), times `scale` -> normed and rotated, float32
        [HB, D]. partner: the channel each rotary channel pairs with (the other half's), itself past
        the rotary ones."""
        x = tl.load(x_ptr + rows + dims, mask=live, other=0.0).to(tl.float32) * scale
        xp = tl.load(x_ptr + rows + partner, mask=live, other=0.0).to(tl.float32) * scale
        if NORM:
            r = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
            w = tl.load(w_ptr + dims).to(tl.float32)
            wp = tl.load(w_ptr + partner).to(tl.float32)
            if CENTRED:  # (x r (1 + w)) rounded once, as the result is
                x = (x * r * (1.0 + w)).to(x_ptr.dtype.element_ty).to(tl.float32)
                xp = (xp * r * (1.0 + wp)).to(x_ptr.dtype.element_ty).to(tl.float32)
            else:  # w * round(x r)
                x = w * (x * r).to(x_ptr.dtype.element_ty).to(tl.float32)
                xp = wp * (xp * r).to(x_ptr.dtype.element_ty).to(tl.float32)
        sign = tl.where(dims < ROTARY // 2, -1.0, 1.0)
        return tl.where(dims < ROTARY, x * cos + sign * xp * sin, x)

    @triton.jit
    def _qk_rope_write(q_ptr, k_ptr, v_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, slots_ptr, out_ptr, ck_ptr, cv_ptr,
                       sq_n, sq_h, sk_n, sv_n, scos_n, ssin_n, sc_t, eps, HQ, HKV, h_ptr, sh_n, hidden,
                       D: tl.constexpr, ROTARY: tl.constexpr, HB: tl.constexpr, NORM: tl.constexpr,
                       CENTRED: tl.constexpr, SCALED: tl.constexpr, SIGNAL: tl.constexpr):
        """Program (token i, block of HB heads): query heads' blocks first, then the KV heads'.
        SIGNAL: the next launch, where it is a programmatic dependent one (the layer's attention),
        may start now (its programs wait for this launch's end before they read what it writes)."""
        if SIGNAL:
            gdc_launch_dependents()
        i = tl.program_id(0)
        block = tl.program_id(1)
        q_blocks = tl.cdiv(HQ, HB)
        dims = tl.arange(0, D)[None, :]
        partner = tl.where(dims < ROTARY, (dims + ROTARY // 2) % ROTARY, dims)
        cos = tl.load(cos_ptr + i * scos_n + dims, mask=dims < ROTARY, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + i * ssin_n + dims, mask=dims < ROTARY, other=0.0).to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        scale = row_rms_scale(h_ptr, i * sh_n, hidden, eps, 1024) if SCALED else 1.0
        if block < q_blocks:
            heads = block * HB + tl.arange(0, HB)[:, None]
            live = heads < HQ
            x = _norm_rope(q_ptr, i * sq_n + heads * sq_h, live, dims, partner, qn_ptr, cos, sin, eps, scale, D,
                           ROTARY, NORM, CENTRED)
            tl.store(out_ptr + (i * HQ + heads) * D + dims, x.to(dtype), mask=live)
        else:
            heads = (block - q_blocks) * HB + tl.arange(0, HB)[:, None]
            live = heads < HKV
            x = _norm_rope(k_ptr, i * sk_n + heads * D, live, dims, partner, kn_ptr, cos, sin, eps, scale, D,
                           ROTARY, NORM, CENTRED)
            at = tl.load(slots_ptr + i).to(tl.int64) * sc_t + heads * D + dims
            tl.store(ck_ptr + at, x.to(dtype), mask=live)
            v = tl.load(v_ptr + i * sv_n + heads * D + dims, mask=live)
            if SCALED:  # the input norm's scale, rounded once
                v = (v.to(tl.float32) * scale).to(dtype)
            tl.store(cv_ptr + at, v, mask=live)
