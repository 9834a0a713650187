"""The DFlash block-diffusion drafter (z-lab format), written for the engine.

Each layer's attention reads two kinds of keys: the committed context, whose keys and values are
projected from the target's features (`hidden_norm(fc(features))`, the same input for every
layer) and cached, and the block being drafted, `[bonus, MASK x (b - 1)]`, which attends to the
whole context and to itself (non-causally, unless the layer is a sliding-window layer, which is
causal and windowed as in the reference). The drafter has no embedding or LM head: it borrows the
target's.
"""
from __future__ import annotations

import torch
from torch import nn

from ddtree.kernels import blaslt
from ddtree.kv_cache import KVCache
from ddtree.models.configs import DrafterConfig
from ddtree.models.fused import EAGER, LayerOps, compiled_ops
from ddtree.models.layers import AttentionMeta, RMSNorm, RotaryTable, SwiGLU, apply_rope, attend, logits_float32


class DrafterAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qkv_weight: torch.Tensor | None = None  # set by DFlashDrafter.fuse_projections
        self.qkv_bias: torch.Tensor | None = None
        self.sliding = cfg.layer_types[layer_idx] == "sliding_attention"
        self.window = cfg.sliding_window if self.sliding else None
        self.scale = self.head_dim**-0.5

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [M, H] -> rotated, normed keys and values [M, kv_heads, head_dim]."""
        m = x.shape[0]
        k = self.k_norm(self.k_proj(x).view(m, self.n_kv, self.head_dim))
        return apply_rope(k, cos, sin), self.v_proj(x).view(m, self.n_kv, self.head_dim)


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DrafterAttention(cfg, layer_idx)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, delta, cos, sin, metas: dict[str, AttentionMeta], cache: KVCache, ops: LayerOps):
        """(h, delta) -> this layer's output as (h, delta), as in `TargetLayer.forward`."""
        a, mlp = self.self_attn, self.mlp
        eps = self.input_layernorm.eps
        if a.qkv_weight is not None:  # fused: one matmul for q, k and v
            x, q, k, v = ops.project_qkv(h, delta, self.input_layernorm.weight, a.qkv_weight, a.qkv_bias,
                                         a.q_norm.weight, a.k_norm.weight, cos, sin, a.n_heads, a.n_kv, a.head_dim, eps)
        else:
            x, q, k, v = ops.project_qkv_split(
                h, delta, self.input_layernorm.weight, a.q_proj.weight, a.k_proj.weight, a.v_proj.weight,
                a.q_proj.bias, a.k_proj.bias, a.v_proj.bias, a.q_norm.weight, a.k_norm.weight,
                cos, sin, a.n_heads, a.n_kv, a.head_dim, eps)
        meta = metas["sliding" if a.sliding else "full"]
        keys, values = cache.write(a.layer_idx, meta.write_slots, k, v, meta.kv_len)
        attn = attend(q, keys, values, meta, a.scale, ops.mask_bias)
        return ops.finish_layer(x, attn, a.o_proj.weight, a.o_proj.bias, self.post_attention_layernorm.weight,
                                mlp.gate_up_proj.weight, mlp.gate_up_proj.bias, mlp.down_proj.weight, mlp.down_proj.bias, eps)


class DFlashDrafter(nn.Module):
    """Appends committed context to its cache, then drafts a block of `block_size` tokens in one pass."""

    def __init__(self, cfg: DrafterConfig, max_positions: int):
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList(DrafterLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryTable(cfg.rope, cfg.head_dim, max_positions)
        self.ops: LayerOps = EAGER
        self.context_kv: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None = None  # fuse_projections
        self._block_visible: dict[tuple, torch.Tensor] = {}  # (block, device) -> all-True [block, block]

    @torch.no_grad()
    def fuse_projections(self) -> None:
        """The inference layout, made once on the final device (the engine calls it):

        - each layer's q, k and v matrices become one [(Hq + 2 Hkv) * D, H] matrix, and the three
          weights become views of it (no second copy): the block's projection is one matmul;
        - every layer's k and v rows are also stacked into one [L * 2 * Hkv * D, H] matrix (a copy:
          2 * Hkv * D * H per layer), with the k norms [L, D]: appending context is one matmul, one
          norm-and-rotate and one cache write for all layers, not three launches per layer.
        Not for training: the q/k/v parameters then share storage. A second call does nothing."""
        if self.context_kv is not None:
            return
        kv_rows, kv_biases = [], []
        for layer in self.layers:
            a = layer.self_attn
            parts = [a.q_proj, a.k_proj, a.v_proj]
            a.qkv_weight = torch.cat([p.weight for p in parts])
            a.qkv_bias = torch.cat([p.bias for p in parts]) if a.q_proj.bias is not None else None
            start = 0
            for p in parts:
                rows = p.weight.shape[0]
                p.weight = nn.Parameter(a.qkv_weight[start:start + rows], requires_grad=False)
                if a.qkv_bias is not None:
                    p.bias = nn.Parameter(a.qkv_bias[start:start + rows], requires_grad=False)
                start += rows
            kv_rows.append(a.qkv_weight[a.n_heads * a.head_dim:])
            if a.qkv_bias is not None:
                kv_biases.append(a.qkv_bias[a.n_heads * a.head_dim:])
        k_norms = torch.stack([layer.self_attn.k_norm.weight for layer in self.layers])
        self.context_kv = (torch.cat(kv_rows), torch.cat(kv_biases) if kv_biases else None, k_norms)

    def use_compiled(self) -> None:
        """Run the per-layer elementwise work through torch.compile (CUDA)."""
        self.ops = compiled_ops()

    def new_cache(self, slots: int, device, dtype) -> KVCache:
        cfg = self.config
        return KVCache(cfg.num_hidden_layers, slots, cfg.num_key_value_heads, cfg.head_dim, device, dtype)

    @torch.no_grad()
    def append_context(self, features: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                       slots: torch.Tensor | None = None) -> None:
        """Cache keys/values of committed tokens. features: [M, len(taps) * H]; positions: [M];
        slots: [M] where they go (None: their positions)."""
        slots = positions if slots is None else slots
        ops = self.ops
        ctx = ops.rms_norm(blaslt.linear(features, self.fc.weight), self.hidden_norm.weight, self.hidden_norm.eps)
        cos, sin = self.rotary(positions, ctx.dtype)
        if self.context_kv is not None:  # fused: every layer at once
            kv_w, kv_b, k_norms = self.context_kv
            a = self.layers[0].self_attn
            k, v = ops.project_context_kv(ctx, kv_w, kv_b, k_norms, cos, sin, a.n_kv, a.head_dim, a.k_norm.eps)
            cache.write_layers(slots, k, v)
            return
        for layer in self.layers:
            a = layer.self_attn
            k, v = ops.project_kv(ctx, a.k_proj.weight, a.k_proj.bias, a.v_proj.weight, a.v_proj.bias,
                                  a.k_norm.weight, cos, sin, a.n_kv, a.head_dim, a.k_norm.eps)
            cache.write(a.layer_idx, slots, k, v, 0)

    def block_metas(self, context_len: torch.Tensor, block: int, kv_len: int,
                    min_prefix: int = 0) -> dict[str, AttentionMeta]:
        """Attention metadata for a block at positions context_len .. context_len + block - 1.

        context_len: [] long (on the device); kv_len >= context_len + block (columns past the block are
        padding); min_prefix: a lower bound of context_len for every run of these shapes (a CUDA
        graph's replays included), which lets a long context go through the prefix kernel
        (`AttentionMeta.min_prefix`). Full layers see the context and the whole block; sliding layers
        are causal and windowed.
        """
        cfg = self.config
        positions, sliding, sliding_ranges = self.ops.block_masks(
            context_len, block, kv_len, cfg.sliding_window, "sliding_attention" in cfg.layer_types)
        key = (block, context_len.device)
        if key not in self._block_visible:  # made on the first (eager) call, before any graph capture
            self._block_visible[key] = torch.ones(block, block, dtype=torch.bool, device=context_len.device)
        metas = {"full": AttentionMeta(positions, kv_len, prefix_len=context_len, block_mask=self._block_visible[key],
                                       min_prefix=min_prefix)}
        if sliding is not None:
            metas["sliding"] = AttentionMeta(positions, kv_len, sliding, ranges=sliding_ranges)
        return metas

    def forward(self, noise_embedding: torch.Tensor, metas: dict[str, AttentionMeta], cache: KVCache,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """noise_embedding [b, H] at `positions` (None: the write slots `metas` give) -> hidden [b, H].

        Keys of the context positions before the block must already be cached.
        """
        positions = metas["full"].write_slots if positions is None else positions
        cos, sin = self.rotary(positions, noise_embedding.dtype)
        h, delta = noise_embedding, None
        for layer in self.layers:
            h, delta = layer(h, delta, cos, sin, metas, cache, self.ops)
        return self.ops.final_norm(h, delta, self.norm.weight, self.norm.eps)[1]

    def logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """Draft logits [b, V] in float32 through the target's LM head, with the config's multiplier/softcap."""
        cfg = self.config
        logits = logits_float32(hidden, lm_head.weight)
        if cfg.output_multiplier != 1.0:
            logits = logits * cfg.output_multiplier
        if cfg.final_logit_softcapping:
            cap = cfg.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits
