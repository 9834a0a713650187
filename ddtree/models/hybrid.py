"""Hybrid targets (Qwen3.5 / Qwen3.6): Gated DeltaNet layers and gated full-attention layers,
written for the engine as `TargetModel` is (same forward, same cache discipline), plus the
commit of a round's accepted path into the recurrent state.

Layer math, as transformers' `qwen3_5` (the tests' oracle):
- RMSNorms are zero-centred: x_normed * (1 + w), computed in float32.
- Gated attention: `q_proj` emits per head [query | gate]; q/k RMSNorm over the head dim,
  rotary on the first `partial_rotary_factor` of each head, output * sigmoid(gate), `o_proj`.
- Gated DeltaNet: `in_proj_qkv` -> causal depthwise conv (kernel K, SiLU) -> q, k, v;
  g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b); the gated delta rule
  (`gated_deltanet`) with L2-normalised q/k; output RMSNorm(o) * w * silu(z), `out_proj`.

How a forward treats the recurrent layers depends on `AttentionMeta` (its docstring): a tree verify
(`meta.parents` set) convolves each node over its own ancestors (then the committed conv window)
and runs the tree form of the recurrence, writing no state: the conv inputs are gathered inside
the function that convolves them, which also writes the commit's stash (on CUDA the Triton kernel
`kernels.tree_gdn_inputs`, or `kernels.tree_conv` then `gdn_tree_recurrence_inputs` compiled for
head dims it does not take; elsewhere `gdn_tree_inputs`); a
sequence (prefill, `ar` step, commit) advances the state and the window.
"""
from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.kernels import blaslt, gdn_prefill, qk_rope_write
from ddtree.kv_cache import KVCache
from ddtree.models import gated_deltanet as gdn
from ddtree.models.configs import TargetConfig
from ddtree.models.layers import AttentionMeta, RotaryTable, SwiGLU, attend, logits_float32
from ddtree.models.fused import RECOMPILE_LIMIT, rotate
from ddtree.recurrent_state import HybridCache, RecurrentScratch, RecurrentState

log = logging.getLogger("ddtree.models")

try:  # the Triton kernels of the tree and token-loop forms, the tree's conv, SwiGLU (CUDA); PyTorch elsewhere
    from ddtree.kernels import gdn_tree as gdn_kernels
    from ddtree.kernels import swiglu as swiglu_kernel
    from ddtree.kernels import tree_conv, tree_gdn_inputs
except ImportError:
    gdn_kernels = swiglu_kernel = tree_conv = tree_gdn_inputs = None


# DDTREE_GDN_KERNELS=0 runs the PyTorch forms on CUDA too (to measure the kernels against them).
KERNELS_ENABLED = os.environ.get("DDTREE_GDN_KERNELS", "1") != "0"
# The verify's inputs (conv, norms, gates, stash) in one kernel (`kernels.tree_gdn_inputs`);
# DDTREE_FUSED_GDN_INPUTS=0 runs the conv kernel and compiled glue instead (to measure one against
# the other; also the path for head dims the fused kernel does not take).
FUSED_INPUTS = os.environ.get("DDTREE_FUSED_GDN_INPUTS", "1") != "0"


def _use_kernels(q, k, v, state) -> bool:
    return KERNELS_ENABLED and q.is_cuda and gdn_kernels is not None and gdn_kernels.supported(q, k, v, state)

# Without the Triton kernels, sequences that extend a committed state by up to this many tokens
# (an `ar` step, a commit) run the PyTorch token loop, and longer ones and prefills the chunked
# form. With the kernels every sequence runs the token-loop kernel: on the H200 at Qwen3.6-27B's
# heads it took 11.8 us for 16 tokens (about 0.5 us a token past the first), while the PyTorch
# chunked prefill cost about 8 us a token per layer at 8192 tokens (time to first token 3.89 s,
# 7.2x its floor, `round_latency_h200_qwen36_27b_fused_inputs.json`).
LOOP_MAX_TOKENS = 64


def zero_centred_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm scaled by (1 + weight), in float32, rounded once to x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(o) * weight * silu(z) over the last dim; o and z [..., Dv] in the model's dtype."""
    of = o.float()
    normed = (of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)).to(o.dtype)
    return ((weight * normed).float() * F.silu(z.float())).to(o.dtype)


def add_and_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """The residual stream h + delta (delta None: h) and its zero-centred RMSNorm."""
    if delta is not None:
        h = h + delta
    return h, zero_centred_rms_norm(h, weight, eps)


def attention_inputs(qg, k, q_norm, k_norm, cos, sin, n_heads: int, n_kv: int, head_dim: int, eps: float):
    """The gated attention's projections qg [N, Hq * 2D], k [N, Hkv * D] -> q [N, Hq, D] and k
    [N, Hkv, D] (normed, rotated), gate [N, Hq, D] (a view of qg)."""
    q, gate = query_and_gate(qg, n_heads, head_dim)
    q = rotate(zero_centred_rms_norm(q, q_norm, eps), cos, sin)
    k = rotate(zero_centred_rms_norm(k.view(qg.shape[0], n_kv, head_dim), k_norm, eps), cos, sin)
    return q, k, gate


def query_and_gate(qg, n_heads: int, head_dim: int):
    """qg [N, Hq * 2D] (each head's query, then its gate) -> views q, gate [N, Hq, D]."""
    return qg.view(qg.shape[0], n_heads, 2 * head_dim).chunk(2, dim=-1)


def gated_output(attn, gate):
    """attn [N, Hq * D], gate [N, Hq, D] (any strides) -> attn * sigmoid(gate) [N, Hq * D]."""
    return (attn.reshape(gate.shape) * torch.sigmoid(gate)).flatten(1)


def conv_silu(taps, weight):
    """taps: the K conv inputs of every row, oldest first, as K tensors [T, C]; weight [C, K] -> the
    causal depthwise conv, summed in float32 tap by tap, rounded to the taps' dtype, then SiLU [T, C]."""
    w = weight.float()
    acc = taps[0].float() * w[:, 0]
    for j in range(1, len(taps)):
        acc = acc + taps[j].float() * w[:, j]
    return F.silu(acc.to(taps[0].dtype))


def recurrence_inputs(mixed, a, b, A_log, dt_bias, hk: int, dk: int, hv: int, dv: int):
    """mixed [T, C] (after the conv and SiLU), a, b [T, Hv] -> q, k [T, Hk, Dk] (float32,
    normalised), v [T, Hv, Dv], g, beta [T, Hv]."""
    t = mixed.shape[0]
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q, k = gdn.normalize_qk(q.reshape(t, hk, dk), k.reshape(t, hk, dk))
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return q, k, v.reshape(t, hv, dv), g, b.sigmoid().float()


def gdn_inputs(conv_in, a, b, conv_weight, A_log, dt_bias, hk: int, dk: int, hv: int, dv: int):
    """A sequence's recurrence inputs: conv_in [T, K, C] (each row's K conv inputs, oldest first),
    a, b [T, Hv] -> q, k [T, Hk, Dk] (float32, normalised), v [T, Hv, Dv], g, beta [T, Hv]."""
    mixed = conv_silu(conv_in.unbind(1), conv_weight)
    return recurrence_inputs(mixed, a, b, A_log, dt_bias, hk, dk, hv, dv)


def tree_conv_taps(window, mixed, ancestors) -> list[torch.Tensor]:
    """A tree's conv inputs as K taps [N, C], oldest first: tap j gathers, per node, the row
    `ancestors` [N, K] (`conv_ancestors`) names in [window (K - 1 rows); mixed (N rows)], by two
    selected gathers rather than a concatenation, so that compiled they are loads of the kernel
    that convolves; the last tap is each node itself, which is mixed as it is."""
    k1 = window.shape[0]
    taps = []
    for j in range(k1):
        row = ancestors[:, j]
        node = row - k1  # < 0: the window's row `row`
        taps.append(torch.where((node >= 0)[:, None], mixed[node.clamp(min=0)], window[row.clamp(max=k1 - 1)]))
    return taps + [mixed]


def gdn_tree_inputs(window, mixed, ancestors, visible, a, b, conv_weight, A_log, dt_bias, mixed_out, k_out, G_out,
                    hk: int, dk: int, hv: int, dv: int):
    """A tree's recurrence inputs, gathered, convolved and normalised in one function (compiled, a
    few fused kernels, nothing [N, K, C] in memory). window [K - 1, C] (the committed conv
    inputs), mixed [N, C], ancestors [N, K] (`conv_ancestors`), visible [N, N] bool, a, b [N, Hv]
    -> q [N, Hk, Dk], v [N, Hv, Dv], g, beta [N, Hv]. The commit's stash is written here, in
    place: mixed_out [N, C] <- mixed; k_out [N, Hk, Dk] float32 <- the normalised keys (the
    recurrence reads them there); G_out [N, Hv] float32 <- `gated_deltanet.path_decay`."""
    conv = conv_silu(tree_conv_taps(window, mixed, ancestors), conv_weight)
    q, k, v, g, beta = recurrence_inputs(conv, a, b, A_log, dt_bias, hk, dk, hv, dv)
    mixed_out.copy_(mixed)
    k_out.copy_(k)
    G_out.copy_(gdn.path_decay(g, visible))
    return q, v, g, beta


def gdn_tree_recurrence_inputs(conv, a, b, A_log, dt_bias, k_out, hk: int, dk: int, hv: int, dv: int):
    """`gdn_tree_inputs` after the conv, for the kernel path (`tree_conv` convolves and stashes the
    conv inputs; `tree_gated_delta` writes G): conv [N, C] (SiLU'd), a, b [N, Hv] -> q, v, g,
    beta; k_out [N, Hk, Dk] float32 <- the normalised keys."""
    q, k, v, g, beta = recurrence_inputs(conv, a, b, A_log, dt_bias, hk, dk, hv, dv)
    k_out.copy_(k)
    return q, v, g, beta


def gdn_output(o, z, norm_w, eps: float, hv: int, dv: int):
    """o [N, Hv, Dv] float32, z [N, Hv * Dv] -> RMSNorm(o) * w * silu(z) as [N, Hv * Dv]."""
    n = o.shape[0]
    return gated_rms_norm(o.to(z.dtype), z.view(n, hv, dv), norm_w, eps).reshape(n, hv * dv)


def swiglu(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class HybridOps:
    """The elementwise glue of the hybrid layers: eager, or each function compiled once for all
    layers (CUDA), as `fused.LayerOps` does for dense targets."""

    NAMES = ("add_and_norm", "attention_inputs", "gated_output", "gdn_inputs", "gdn_tree_inputs",
             "gdn_tree_recurrence_inputs", "gdn_output", "swiglu")

    def __init__(self, compiled: bool):
        for name in self.NAMES:
            fn = globals()[name]
            setattr(self, name, torch.compile(fn, dynamic=True, fullgraph=True) if compiled else fn)
        if compiled and swiglu_kernel is not None:
            self.swiglu = _swiglu_kernel_or(self.swiglu)


def _swiglu_kernel_or(compiled_swiglu):
    """SwiGLU through `kernels.swiglu` on CUDA tensors, else `compiled_swiglu`: Inductor's kernel,
    compiled for dynamic shapes, loads two bytes at a time (on an H200, 65 rows of Qwen3.6-27B's
    MLP: 6.1 us against the kernel's 3.6, benchmarks/swiglu.py)."""
    def swiglu_fn(gate_up):
        if gate_up.is_cuda and swiglu_kernel.supported(gate_up):
            return swiglu_kernel.swiglu(gate_up)
        return compiled_swiglu(gate_up)

    return swiglu_fn


HYBRID_EAGER = HybridOps(compiled=False)
_HYBRID_COMPILED: HybridOps | None = None


class GatedAttention(nn.Module):
    """Full attention with a sigmoid output gate; q/k/v projections fused into one matrix
    [Hq * 2D + 2 * Hkv * D, H] (rows: per head query then gate, then keys, then values)."""

    def __init__(self, cfg: TargetConfig, kv_index: int):
        super().__init__()
        self.kv_index = kv_index
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.split = [2 * q_size, kv_size, kv_size]
        self.qkv_proj = nn.Linear(cfg.hidden_size, sum(self.split), bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = nn.Parameter(torch.zeros(self.head_dim))
        self.k_norm = nn.Parameter(torch.zeros(self.head_dim))
        self.eps = cfg.rms_norm_eps
        self.scale = self.head_dim**-0.5

    def forward(self, x, cos, sin, meta: AttentionMeta, cache: KVCache, ops: HybridOps) -> torch.Tensor:
        """x [N, H] (normed) -> [N, H]."""
        n = x.shape[0]
        qg, k, v = blaslt.linear(x, self.qkv_proj.weight, self.qkv_proj.bias).split(self.split, dim=-1)
        if qk_rope_write.supported(x, cache.k[self.kv_index]):  # norms, rotations and cache write in one launch
            q, gate = query_and_gate(qg, self.n_heads, self.head_dim)
            q = qk_rope_write.qk_rope_write(q, k.view(n, self.n_kv, self.head_dim), v.view(n, self.n_kv, self.head_dim),
                                            self.q_norm, self.k_norm, cos, sin, self.eps, meta.write_slots,
                                            cache.k[self.kv_index], cache.v[self.kv_index], centred=True)
            keys, values = cache.layer(self.kv_index, meta.kv_len)
        else:
            q, k, gate = ops.attention_inputs(qg, k, self.q_norm, self.k_norm, cos, sin, self.n_heads, self.n_kv,
                                              self.head_dim, self.eps)
            keys, values = cache.write(self.kv_index, meta.write_slots, k, v.view(n, self.n_kv, self.head_dim),
                                       meta.kv_len)
        out = ops.gated_output(attend(q, keys, values, meta, self.scale), gate)
        return blaslt.linear(out, self.o_proj.weight, self.o_proj.bias)


def conv_ancestors(parents: torch.Tensor, depths: torch.Tensor, kernel: int) -> torch.Tensor:
    """A tree's conv inputs: [N, K] indices into [window (K - 1 rows); nodes (N rows)], column j
    holding the input K - 1 - j steps up node i's path (column K - 1: the node itself; past the
    root, the committed window's rows from its newest back)."""
    node = torch.arange(parents.shape[0], device=parents.device)
    cols = []
    for lag in range(kernel):
        cols.append(torch.where(node >= 0, kernel - 1 + node, kernel - 1 + depths - lag))
        node = torch.where(node >= 0, parents[node.clamp(min=0)], node)
    return torch.stack(cols[::-1], dim=1)


class GatedDeltaNet(nn.Module):
    """A Gated DeltaNet layer; `in_proj` stacks in_proj_qkv, in_proj_z, in_proj_b, in_proj_a."""

    def __init__(self, cfg: TargetConfig, linear_index: int):
        super().__init__()
        g = cfg.gdn
        self.linear_index = linear_index
        self.hk, self.hv, self.dk, self.dv, self.kernel = (g.num_key_heads, g.num_value_heads, g.key_head_dim,
                                                           g.value_head_dim, g.conv_kernel)
        self.split = [g.conv_dim, g.value_dim, g.num_value_heads, g.num_value_heads]
        self.qkv_split = [g.key_dim, g.key_dim, g.value_dim]
        self.in_proj = nn.Linear(cfg.hidden_size, sum(self.split), bias=False)
        self.conv_weight = nn.Parameter(torch.zeros(g.conv_dim, g.conv_kernel))
        self.A_log = nn.Parameter(torch.zeros(g.num_value_heads))
        self.dt_bias = nn.Parameter(torch.ones(g.num_value_heads))
        self.norm = nn.Parameter(torch.ones(g.value_head_dim))
        self.out_proj = nn.Linear(g.value_dim, cfg.hidden_size, bias=False)
        self.eps = cfg.rms_norm_eps

    # -- pieces shared by the verify, the sequence forms and the commit -------------------------

    def _inputs(self, conv_in, a, b, ops: HybridOps):
        return ops.gdn_inputs(conv_in, a, b, self.conv_weight, self.A_log, self.dt_bias, self.hk, self.dk, self.hv,
                              self.dv)

    def _advance(self, mixed, a, b, state: torch.Tensor, window: torch.Tensor, length, fresh: bool, ops: HybridOps):
        """Run a sequence (a prefill, an `ar` step, a commit) from (state, window) [K - 1, C], both
        updated in place to after its first `length` rows -> o [T, Hv, Dv] float32. The recurrence:
        the token-loop kernel where the kernels run (a long bf16 run through flash-linear-attention
        where fla-core is installed, `kernels.gdn_prefill`), else `LOOP_MAX_TOKENS` picks the form."""
        t, k1 = mixed.shape[0], self.kernel - 1
        if fresh:
            state.zero_()
            window.zero_()
        padded = torch.cat([window, mixed], dim=0)  # [K - 1 + T, C]
        conv_in = padded.unfold(0, self.kernel, 1).transpose(1, 2)  # [T, K, C]
        q, k, v, g, beta = self._inputs(conv_in, a, b, ops)
        last = torch.arange(k1, device=mixed.device) + (t if length is None else length)
        window.copy_(padded.index_select(0, last))
        if _use_kernels(q, k, v, state):  # any length, a prefill too (LOOP_MAX_TOKENS)
            if gdn_prefill.usable(v, state):  # a long run through flash-linear-attention's chunks, if installed
                o = gdn_prefill.chunked_or_none(q, k, v, g, beta, state, length)
                if o is not None:
                    return o
            return gdn_kernels.recurrent_gated_delta(q, k, v, g, beta, state, length)
        if t <= LOOP_MAX_TOKENS and not fresh:
            return gdn.recurrent_gated_delta(q, k, v, g, beta, state, length)
        return gdn.chunked_gated_delta(q, k, v, g, beta, state, length)

    # -- the forward and the commit ----------------------------------------------------------------

    def forward(self, x, meta: AttentionMeta, cache: RecurrentState, ops: HybridOps) -> torch.Tensor:
        """x [N, H] (normed) -> [N, H]. A packed batch (`meta.rows`, their tokens one row after
        another) runs each row from its own state (`RowSpan.recurrent`) with its own meta."""
        mixed, z, b, a = blaslt.linear(x, self.in_proj.weight).split(self.split, dim=-1)
        if meta.rows is None:
            o = self._sequence(mixed, a, b, meta, cache, ops)
        else:
            o = torch.cat([self._sequence(mixed[row.tokens], a[row.tokens], b[row.tokens], row.meta, row.recurrent, ops)
                           for row in meta.rows])
        return blaslt.linear(ops.gdn_output(o, z, self.norm, self.eps, self.hv, self.dv), self.out_proj.weight)

    def _sequence(self, mixed, a, b, meta: AttentionMeta, cache: RecurrentState, ops: HybridOps) -> torch.Tensor:
        """One sequence's tokens (a tree, or a run of tokens) from its state -> o [T, Hv, Dv] float32."""
        state, window = cache.state[self.linear_index], cache.conv[self.linear_index]
        if meta.parents is None:
            return self._advance(mixed, a, b, state, window, meta.length, meta.causal, ops)
        return self._verify(mixed, a, b, meta, state, window, ops)

    def _verify(self, mixed, a, b, meta: AttentionMeta, state, window, ops: HybridOps) -> torch.Tensor:
        """A round's tree: each node convolved over its own ancestors (then the committed window)
        and run through the recurrence along its root path; the state is only read. What the
        commit needs (conv inputs, keys, new values, path decays) goes to `meta.scratch`."""
        n, index, scratch = mixed.shape[0], self.linear_index, meta.scratch
        if "conv_ancestors" not in meta._shared:  # the same for every layer of this forward
            meta._shared["conv_ancestors"] = conv_ancestors(meta.parents, meta.depths, self.kernel)
        ancestors = meta._shared["conv_ancestors"]
        k = scratch.k[index, :n]  # the normalised keys go straight to the commit's stash; read from there
        u_out, G_out = scratch.u[index, :, :n], scratch.G[index, :n]
        if self._tree_kernels(window, mixed, state):
            # The conv, norms and gates as one kernel (it also stashes the conv inputs and keys),
            # or the conv alone with the rest compiled; G written by the tree kernel, which sums
            # it anyway.
            if FUSED_INPUTS and tree_gdn_inputs.supported(window, mixed, self.conv_weight, self.dk, self.dv):
                q, v, g, beta = tree_gdn_inputs.tree_gdn_inputs(
                    window, mixed, ancestors, self.conv_weight, a, b, self.A_log, self.dt_bias, self.hk, self.dk,
                    self.hv, self.dv, scratch.mixed[index, :n], k)
            else:
                conv = tree_conv.tree_conv_silu(window, mixed, ancestors, self.conv_weight, scratch.mixed[index, :n])
                q, v, g, beta = ops.gdn_tree_recurrence_inputs(conv, a, b, self.A_log, self.dt_bias, k, self.hk,
                                                               self.dk, self.hv, self.dv)
            return gdn_kernels.tree_gated_delta(q, k, v, g, beta, meta.block_mask, state, u_out=u_out, G_out=G_out)
        q, v, g, beta = ops.gdn_tree_inputs(window, mixed, ancestors, meta.block_mask, a, b, self.conv_weight,
                                            self.A_log, self.dt_bias, scratch.mixed[index, :n], k, G_out, self.hk,
                                            self.dk, self.hv, self.dv)
        return gdn.tree_gated_delta(q, k, v, g, beta, meta.block_mask, state, u_out=u_out)

    def _tree_kernels(self, window, mixed, state) -> bool:
        """Whether the verify runs the Triton path (the conv and the tree recurrence as kernels)."""
        return (KERNELS_ENABLED and mixed.is_cuda and tree_conv is not None
                and tree_conv.supported(window, mixed, self.conv_weight)
                and gdn_kernels.supported_heads(self.hk, self.dk, self.hv, self.dv, mixed.dtype, state))


class HybridLayer(nn.Module):
    def __init__(self, cfg: TargetConfig, layer_idx: int, kind: str, kind_index: int):
        super().__init__()
        self.kind = kind
        if kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, kind_index)
        else:
            self.self_attn = GatedAttention(cfg, kind_index)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        self.input_layernorm = nn.Parameter(torch.zeros(cfg.hidden_size))
        self.post_attention_layernorm = nn.Parameter(torch.zeros(cfg.hidden_size))
        self.eps = cfg.rms_norm_eps

    def forward(self, h, delta, cos, sin, meta: AttentionMeta, cache: HybridCache, ops: HybridOps):
        """(h, delta): the previous layer's output as h + delta (delta None for the embeddings), left
        unsummed so that the add is fused into this layer's first norm -> this layer's (h, delta)."""
        h, x = ops.add_and_norm(h, delta, self.input_layernorm, self.eps)
        if self.kind == "linear_attention":
            mixed = self.linear_attn(x, meta, cache.recurrent, ops)
        else:
            mixed = self.self_attn(x, cos, sin, meta, cache.kv, ops)
        h, x = ops.add_and_norm(h, mixed, self.post_attention_layernorm, self.eps)
        mlp = self.mlp
        return h, blaslt.linear(ops.swiglu(blaslt.linear(x, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias)),
                                mlp.down_proj.weight, mlp.down_proj.bias)


class HybridTarget(nn.Module):
    """tokens [N] at positions [N] -> logits [N, V] (or the rows asked for) and features
    [N, len(taps) * H]; the interface of `TargetModel`, plus `commit` and `new_scratch`."""

    def __init__(self, cfg: TargetConfig, max_positions: int):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        counts = {"linear_attention": 0, "full_attention": 0}
        layers = []
        for i, kind in enumerate(cfg.layer_types):
            layers.append(HybridLayer(cfg, i, kind, counts[kind]))
            counts[kind] += 1
        self.layers = nn.ModuleList(layers)
        self.linear_layers = [layer.linear_attn for layer in self.layers if layer.kind == "linear_attention"]
        self.norm = nn.Parameter(torch.zeros(cfg.hidden_size))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryTable(cfg.rope, cfg.head_dim, max_positions)
        self.ops = HYBRID_EAGER

    def use_compiled(self) -> None:
        """Run the layers' elementwise glue through torch.compile (CUDA)."""
        global _HYBRID_COMPILED
        if _HYBRID_COMPILED is None:
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
            _HYBRID_COMPILED = HybridOps(compiled=True)
        self.ops = _HYBRID_COMPILED

    def new_cache(self, slots: int, device, dtype) -> HybridCache:
        cfg = self.config
        kv = KVCache(len(cfg.attention_layers), slots, cfg.num_key_value_heads, cfg.head_dim, device, dtype)
        return HybridCache(kv, self.new_recurrent_state(device, dtype))

    def new_recurrent_state(self, device, dtype) -> RecurrentState:
        """One sequence's recurrent state and conv windows (every Gated DeltaNet layer's), zeroed."""
        g = self.config.gdn
        return RecurrentState(len(self.linear_layers), g.num_value_heads, g.key_head_dim, g.value_head_dim,
                              g.conv_kernel, g.conv_dim, device, dtype)

    def new_scratch(self, nodes: int, device, dtype) -> RecurrentScratch:
        g = self.config.gdn
        return RecurrentScratch(len(self.linear_layers), nodes, g.conv_dim, g.num_key_heads, g.key_head_dim,
                                g.num_value_heads, g.value_head_dim, device, dtype)

    def commit(self, cache: HybridCache, start, order: torch.Tensor, length, scratch: RecurrentScratch) -> None:
        """After a round's walk: move the accepted nodes' KV entries into place (`order` [M]: the
        accepted path first, root included) and advance every recurrent layer by the path's
        `length` nodes: its states by folding the verify's stash (one kernel for all layers on
        CUDA), its conv windows to the path's last K - 1 inputs. A length of 0 (a batch's padding
        row, or any row in a capture's warm-up) leaves the state and windows as they are."""
        cache.kv.compact(start, order)
        # A real walk accepts 1 .. len(order) nodes; a graph's warm-up runs the back half on a
        # tree that was never built, whose walk can claim more.
        length = torch.clamp(length, 0, order.shape[0])
        rec = cache.recurrent
        if rec.state.is_cuda and gdn_kernels is not None and KERNELS_ENABLED and gdn_kernels.fold_supported(rec.state):
            gdn_kernels.fold_path(rec.state, scratch.k, scratch.u, scratch.G, order, length)
        else:
            gdn.fold_path(rec.state, scratch.k, scratch.u, scratch.G, order, length)
        if tree_conv is not None and KERNELS_ENABLED and tree_conv.commit_windows_supported(rec.conv, scratch.mixed):
            tree_conv.commit_windows(rec.conv, scratch.mixed, order, length)
            return
        k1 = rec.conv.shape[1]
        padded = torch.cat([rec.conv, scratch.mixed.index_select(1, order)], dim=1)  # [L, K - 1 + M, C]
        rec.conv.copy_(padded.index_select(1, torch.arange(k1, device=order.device) + length))

    def forward(self, tokens, positions, meta: AttentionMeta, cache: HybridCache,
                feature_layers: list[int] | None = None, logit_rows=None):
        """Returns (logits [rows, V] in float32, features [N, len(feature_layers) * H] or None)."""
        h = self.embed_tokens(tokens)
        cos, sin = self.rotary(positions, h.dtype)
        wanted = set(feature_layers or ())
        taps = {}
        delta = None
        for i, layer in enumerate(self.layers):
            h, delta = layer(h, delta, cos, sin, meta, cache, self.ops)
            if i in wanted:
                h, delta = h + delta, None  # the drafter reads this layer's output
                taps[i] = h
        features = torch.cat([taps[i] for i in feature_layers], dim=-1) if feature_layers else None
        if logit_rows is not None:
            h, delta = h[logit_rows], None if delta is None else delta[logit_rows]
        _, normed = self.ops.add_and_norm(h, delta, self.norm, self.config.rms_norm_eps)
        return logits_float32(normed, self.lm_head.weight), features
