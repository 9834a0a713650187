"""The per-layer work around attention as plain functions of tensors, so that on CUDA one
`torch.compile` of each fuses its elementwise work (RMSNorm, q/k norms, rotary, SwiGLU, residuals)
into a few kernels shared by every layer of every model. On the CPU they run eagerly.

Weights are arguments (not module attributes) so one compiled function serves all layers
without recompiling.

Residuals: a layer hands the next one (h, delta) — its stream after attention's residual and its
MLP's output — and the next layer's first function adds them as it normalises (`add_residual`).
Written as `h + F.linear(...)` inside one compiled function, Inductor turns each residual into a
cuBLAS addmm, which first copies h into the output: two extra launches per layer (on an H200 at
Qwen3-8B shape, 87 us per one-token forward and 148 us at 257 tokens, benchmarks/README.md).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ddtree.kernels import blaslt
from ddtree.kernels.tree_attention import key_range


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, head_dim]; cos, sin: [N, rotary_dim]. Rotates the first rotary_dim channels."""
    rd = cos.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]
    x1, x2 = rot[..., : rd // 2], rot[..., rd // 2 :]
    out = rot * cos[:, None, :] + torch.cat((-x2, x1), dim=-1) * sin[:, None, :]
    return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out


def add_residual(h: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
    """h + delta (delta None: h), as `h + delta` rounds it (in float32, once to h's dtype), but
    never matched by Inductor as a matmul's bias (see the module docstring)."""
    if delta is None:
        return h
    return (h.float() + delta.float()).to(h.dtype)


def norm_qkv(h, delta, norm_w, qkv_w, qkv_b, eps: float):
    """h + delta [N, H] (the layer's input) -> (that input, the q/k/v projection of its RMSNorm
    [N, (Hq + 2 Hkv) D]): on a GPU the heads' norms, rotations and the cache write then take one
    launch (`kernels.qk_rope_write`)."""
    h = add_residual(h, delta)
    return h, blaslt.linear(rms_norm(h, norm_w, eps), qkv_w, qkv_b)


def split_heads(qkv, n_heads: int, n_kv: int, head_dim: int):
    """qkv [N, (Hq + 2 Hkv) D] -> views q [N, Hq, D], k [N, Hkv, D], v [N, Hkv, D]."""
    n = qkv.shape[0]
    q, k, v = qkv.split([n_heads * head_dim, n_kv * head_dim, n_kv * head_dim], dim=-1)
    return q.view(n, n_heads, head_dim), k.view(n, n_kv, head_dim), v.view(n, n_kv, head_dim)


def project_qkv(h, delta, norm_w, qkv_w, qkv_b, q_norm_w, k_norm_w, cos, sin, n_heads: int, n_kv: int,
                head_dim: int, eps: float):
    """h + delta [N, H] (the layer's input) -> (that input, q [N, Hq, D], k [N, Hkv, D] (normed,
    rotated), v [N, Hkv, D])."""
    h, qkv = norm_qkv(h, delta, norm_w, qkv_w, qkv_b, eps)
    q, k, v = split_heads(qkv, n_heads, n_kv, head_dim)
    if q_norm_w is not None:
        q, k = rms_norm(q, q_norm_w, eps), rms_norm(k, k_norm_w, eps)
    return h, rotate(q, cos, sin), rotate(k, cos, sin), v


def project_qkv_split(h, delta, norm_w, q_w, k_w, v_w, q_b, k_b, v_b, q_norm_w, k_norm_w, cos, sin, n_heads: int,
                      n_kv: int, head_dim: int, eps: float):
    """As project_qkv, with separate q/k/v matrices (the drafter's layout)."""
    h = add_residual(h, delta)
    n = h.shape[0]
    x = rms_norm(h, norm_w, eps)
    q = rms_norm(blaslt.linear(x, q_w, q_b).view(n, n_heads, head_dim), q_norm_w, eps)
    k = rms_norm(blaslt.linear(x, k_w, k_b).view(n, n_kv, head_dim), k_norm_w, eps)
    v = blaslt.linear(x, v_w, v_b).view(n, n_kv, head_dim)
    return h, rotate(q, cos, sin), rotate(k, cos, sin), v


def project_kv(x, k_w, k_b, v_w, v_b, k_norm_w, cos, sin, n_kv: int, head_dim: int, eps: float):
    """x [M, H] (no input norm: the drafter's context) -> k [M, Hkv, D] (normed, rotated), v [M, Hkv, D]."""
    m = x.shape[0]
    k = rms_norm(blaslt.linear(x, k_w, k_b).view(m, n_kv, head_dim), k_norm_w, eps)
    return rotate(k, cos, sin), blaslt.linear(x, v_w, v_b).view(m, n_kv, head_dim)


def project_context_kv(x, kv_w, kv_b, k_norm_w, cos, sin, n_kv: int, head_dim: int, eps: float):
    """x [M, H] (the drafter's context) -> k, v [M, L, Hkv, D] of all L layers from one matmul:
    kv_w [L * 2 * Hkv * D, H] stacks each layer's k then v rows; k_norm_w [L, D]; k normed and rotated."""
    m, layers = x.shape[0], k_norm_w.shape[0]
    kv = blaslt.linear(x, kv_w, kv_b).view(m, layers, 2, n_kv, head_dim)
    k = rms_norm(kv[:, :, 0], k_norm_w[None, :, None, :], eps).reshape(m, layers * n_kv, head_dim)
    return rotate(k, cos, sin).view(m, layers, n_kv, head_dim), kv[:, :, 1]


def finish_layer(h, attn, o_w, o_b, norm_w, gate_up_w, gate_up_b, down_w, down_b, eps: float):
    """The rest of a decoder layer after attention: o_proj + residual, then RMSNorm -> SwiGLU ->
    (h [N, H], delta [N, H]): the layer's output is h + delta, added by whatever reads it next."""
    h = add_residual(h, blaslt.linear(attn, o_w, o_b))
    gate, up = blaslt.linear(rms_norm(h, norm_w, eps), gate_up_w, gate_up_b).chunk(2, dim=-1)
    return h, blaslt.linear(F.silu(gate) * up, down_w, down_b)


def final_norm(h, delta, norm_w, eps: float):
    """The last layer's output h + delta [N, H] and its RMSNorm."""
    h = add_residual(h, delta)
    return h, rms_norm(h, norm_w, eps)


def mask_bias(mask: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """mask [N, T] bool -> additive bias [group * N, T] (0 where visible, -inf elsewhere), repeated
    for the query heads that share a KV head (`layers.attend` stacks them along the query axis)."""
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    return bias.repeat(group, 1)


def block_masks(context_len: torch.Tensor, block: int, kv_len: int, window: int | None, sliding: bool):
    """A drafter block at positions context_len .. context_len + block - 1 (context_len [] long)
    -> (positions [b], and with `sliding` the sliding layers' mask [b, kv_len] and its key ranges
    [b, 2], else None, None): sliding layers are causal (and windowed), columns past the block are
    padding. (Full layers see the context and the whole block: `AttentionMeta`'s prefix form.)"""
    positions = context_len + torch.arange(block, device=context_len.device)
    if not sliding:
        return positions, None, None
    cols = torch.arange(kv_len, device=context_len.device)[None, :]
    mask = cols <= positions[:, None]
    if window is not None:
        mask = mask & (positions[:, None] - cols < window)
    return positions, mask, key_range(mask)


class LayerOps:
    """The functions a layer calls: eager, or compiled once for all layers (CUDA)."""

    def __init__(self, compiled: bool):
        if compiled:
            self.project_qkv = torch.compile(project_qkv, dynamic=True, fullgraph=True)
            self.norm_qkv = torch.compile(norm_qkv, dynamic=True, fullgraph=True)
            self.finish_layer = torch.compile(finish_layer, dynamic=True, fullgraph=True)
            self.project_qkv_split = torch.compile(project_qkv_split, dynamic=True, fullgraph=True)
            self.project_kv = torch.compile(project_kv, dynamic=True, fullgraph=True)
            self.project_context_kv = torch.compile(project_context_kv, dynamic=True, fullgraph=True)
            self.rms_norm = torch.compile(rms_norm, dynamic=True, fullgraph=True)
            self.final_norm = torch.compile(final_norm, dynamic=True, fullgraph=True)
            self.mask_bias = torch.compile(mask_bias, dynamic=True, fullgraph=True)
            self.block_masks = torch.compile(block_masks, dynamic=True, fullgraph=True)
        else:
            self.project_kv, self.project_context_kv = project_kv, project_context_kv
            self.project_qkv, self.finish_layer, self.rms_norm = project_qkv, finish_layer, rms_norm
            self.norm_qkv = norm_qkv
            self.project_qkv_split, self.final_norm = project_qkv_split, final_norm
            self.mask_bias, self.block_masks = mask_bias, block_masks


EAGER = LayerOps(compiled=False)
_COMPILED: LayerOps | None = None


# One compiled function serves every layer of both models, in every dtype, at N = 1 and N > 1
# (dynamic shapes specialise 1), with and without a residual to add: more variants than
# dynamo's default of 8 recompiles per function, which `fullgraph=True` turns into an error.
RECOMPILE_LIMIT = 64


def compiled_ops() -> LayerOps:
    global _COMPILED
    if _COMPILED is None:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        _COMPILED = LayerOps(compiled=True)
    return _COMPILED
