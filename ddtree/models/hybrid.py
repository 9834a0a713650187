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
and runs the tree form of the recurrence, writing no state; a sequence (prefill, `ar` step,
commit) advances the state and the window.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.kv_cache import KVCache
from ddtree.models import gated_deltanet as gdn
from ddtree.models.configs import TargetConfig
from ddtree.models.layers import AttentionMeta, RotaryTable, SwiGLU, attend, logits_float32
from ddtree.models.fused import rotate
from ddtree.recurrent_state import HybridCache, RecurrentScratch, RecurrentState

log = logging.getLogger("ddtree.models")

try:  # the Triton kernels of the tree and token-loop forms (CUDA); the PyTorch forms elsewhere
    from ddtree.kernels import gdn_tree as gdn_kernels
except ImportError:
    gdn_kernels = None


def _use_kernels(q, k, v, state) -> bool:
    return q.is_cuda and gdn_kernels is not None and gdn_kernels.supported(q, k, v, state)

# Sequences that extend a committed state by up to this many tokens (an `ar` step, a commit) run
# the token loop; a prefill runs the chunked form.
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

    def forward(self, x, cos, sin, meta: AttentionMeta, cache: KVCache) -> torch.Tensor:
        """x [N, H] (normed) -> [N, H]."""
        n = x.shape[0]
        qg, k, v = F.linear(x, self.qkv_proj.weight, self.qkv_proj.bias).split(self.split, dim=-1)
        q, gate = qg.view(n, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = rotate(zero_centred_rms_norm(q, self.q_norm, self.eps), cos, sin)
        k = rotate(zero_centred_rms_norm(k.view(n, self.n_kv, self.head_dim), self.k_norm, self.eps), cos, sin)
        keys, values = cache.write(self.kv_index, meta.write_slots, k, v.view(n, self.n_kv, self.head_dim), meta.kv_len)
        out = attend(q, keys, values, meta, self.scale)
        out = out * torch.sigmoid(gate.reshape(n, -1))
        return F.linear(out, self.o_proj.weight, self.o_proj.bias)


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

    def _mix(self, conv_in: torch.Tensor, a: torch.Tensor, b: torch.Tensor):
        """conv_in [T, K, C] (each row's K conv inputs, oldest first), a, b [T, Hv] -> the
        recurrence's q, k [T, Hk, Dk] (float32, normalised), v [T, Hv, Dv], g, beta [T, Hv]."""
        t = conv_in.shape[0]
        mixed = (conv_in.float() * self.conv_weight.float().t()[None]).sum(1).to(conv_in.dtype)
        q, k, v = F.silu(mixed).split(self.qkv_split, dim=-1)
        q, k = gdn.normalize_qk(q.view(t, self.hk, self.dk), k.view(t, self.hk, self.dk))
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        return q, k, v.view(t, self.hv, self.dv), g, b.sigmoid().float()

    def _advance(self, mixed, a, b, state: torch.Tensor, window: torch.Tensor, length, fresh: bool):
        """Run a sequence from (state, window) [K - 1, C], both updated in place to after its first
        `length` rows -> o [T, Hv, Dv] float32."""
        t, k1 = mixed.shape[0], self.kernel - 1
        if fresh:
            state.zero_()
            window.zero_()
        padded = torch.cat([window, mixed], dim=0)  # [K - 1 + T, C]
        conv_in = padded.unfold(0, self.kernel, 1).transpose(1, 2)  # [T, K, C]
        q, k, v, g, beta = self._mix(conv_in, a, b)
        last = torch.arange(k1, device=mixed.device) + (t if length is None else length)
        window.copy_(padded.index_select(0, last))
        if t <= LOOP_MAX_TOKENS and not fresh:
            if _use_kernels(q, k, v, state):
                return gdn_kernels.recurrent_gated_delta(q, k, v, g, beta, state, length)
            return gdn.recurrent_gated_delta(q, k, v, g, beta, state, length)
        return gdn.chunked_gated_delta(q, k, v, g, beta, state, length)

    def _output(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """o [N, Hv, Dv] float32, z [N, Hv * Dv] -> [N, H]."""
        n = o.shape[0]
        out = gated_rms_norm(o.to(z.dtype), z.view(n, self.hv, self.dv), self.norm, self.eps)
        return F.linear(out.reshape(n, -1), self.out_proj.weight)

    # -- the forward and the commit ----------------------------------------------------------------

    def forward(self, x, meta: AttentionMeta, cache: RecurrentState) -> torch.Tensor:
        """x [N, H] (normed) -> [N, H]."""
        mixed, z, b, a = F.linear(x, self.in_proj.weight).split(self.split, dim=-1)
        state, window = cache.state[self.linear_index], cache.conv[self.linear_index]
        if meta.parents is None:
            o = self._advance(mixed, a, b, state, window, meta.length, fresh=meta.causal)
            return self._output(o, z)
        meta.scratch.store(self.linear_index, mixed, a, b)
        if "conv_ancestors" not in meta._shared:  # the same for every layer of this forward
            meta._shared["conv_ancestors"] = conv_ancestors(meta.parents, meta.depths, self.kernel)
        conv_in = torch.cat([window, mixed], dim=0)[meta._shared["conv_ancestors"]]  # [N, K, C]
        q, k, v, g, beta = self._mix(conv_in, a, b)
        if _use_kernels(q, k, v, state):
            o = gdn_kernels.tree_gated_delta(q, k, v, g, beta, meta.block_mask, state)
        else:
            o = gdn.tree_gated_delta(q, k, v, g, beta, meta.block_mask, state)
        return self._output(o, z)

    def commit(self, cache: RecurrentState, scratch: RecurrentScratch, order: torch.Tensor, length) -> None:
        """Advance the state and window by the accepted path: the stashed nodes `order` [M] (the
        path first, root included), of which the first `length` are real."""
        mixed, a, b = scratch.rows(self.linear_index, order)
        self._advance(mixed, a, b, cache.state[self.linear_index], cache.conv[self.linear_index], length, fresh=False)


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

    def forward(self, h, cos, sin, meta: AttentionMeta, cache: HybridCache) -> torch.Tensor:
        x = zero_centred_rms_norm(h, self.input_layernorm, self.eps)
        if self.kind == "linear_attention":
            h = h + self.linear_attn(x, meta, cache.recurrent)
        else:
            h = h + self.self_attn(x, cos, sin, meta, cache.kv)
        return h + self.mlp(zero_centred_rms_norm(h, self.post_attention_layernorm, self.eps))


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

    def use_compiled(self) -> None:
        """Kept for the engine's interface: the hybrid layers run eagerly (their Triton kernels
        and cuBLAS do the heavy work; the elementwise glue is not yet fused)."""

    def new_cache(self, slots: int, device, dtype) -> HybridCache:
        cfg, g = self.config, self.config.gdn
        kv = KVCache(len(cfg.attention_layers), slots, cfg.num_key_value_heads, cfg.head_dim, device, dtype)
        state = RecurrentState(len(self.linear_layers), g.num_value_heads, g.key_head_dim, g.value_head_dim,
                               g.conv_kernel, g.conv_dim, device, dtype)
        return HybridCache(kv, state)

    def new_scratch(self, nodes: int, device, dtype) -> RecurrentScratch:
        g = self.config.gdn
        return RecurrentScratch(len(self.linear_layers), nodes, g.conv_dim, g.num_value_heads, device, dtype)

    def commit(self, cache: HybridCache, start, order: torch.Tensor, length, scratch: RecurrentScratch) -> None:
        """After a round's walk: move the accepted nodes' KV entries into place (`order` [M]: the
        accepted path first) and advance every recurrent layer by the path's `length` nodes."""
        cache.kv.compact(start, order)
        for layer in self.linear_layers:
            layer.commit(cache.recurrent, scratch, order, length)

    def forward(self, tokens, positions, meta: AttentionMeta, cache: HybridCache,
                feature_layers: list[int] | None = None, logit_rows=None):
        """Returns (logits [rows, V] in float32, features [N, len(feature_layers) * H] or None)."""
        h = self.embed_tokens(tokens)
        cos, sin = self.rotary(positions, h.dtype)
        wanted = set(feature_layers or ())
        taps = {}
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, meta, cache)
            if i in wanted:
                taps[i] = h
        features = torch.cat([taps[i] for i in feature_layers], dim=-1) if feature_layers else None
        if logit_rows is not None:
            h = h[logit_rows]
        normed = zero_centred_rms_norm(h, self.norm, self.config.rms_norm_eps)
        return logits_float32(normed, self.lm_head.weight), features
