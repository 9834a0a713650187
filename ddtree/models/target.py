"""The target LLM (Qwen3 / Llama), written for the engine: static KV cache, explicit positions,
attention over `context + new tokens` with an arbitrary mask on the new tokens.

The model knows nothing of requests, trees or sampling: it maps tokens at positions to logits
and to the hidden features the drafter reads.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from ddtree.kernels import blaslt, qk_rope_write, swiglu
from ddtree.kv_cache import KVCache
from ddtree.models.configs import TargetConfig
from ddtree.models.fused import EAGER, LayerOps, compiled_ops, split_heads
from ddtree.models.layers import AttentionMeta, RMSNorm, RotaryTable, SwiGLU, attend, logits_float32

# The norms folded into the projections on GPUs (`TargetModel.fold_norms`; 0.10-0.22 ms a round
# from `ar` to 64 on an H100 at 32k, benchmarks/README.md "The norms folded into the projections");
# DDTREE_FOLDED_NORMS=0 keeps the unfolded layers.
FOLDED_NORMS = os.environ.get("DDTREE_FOLDED_NORMS", "1") != "0"


class TargetAttention(nn.Module):
    def __init__(self, cfg: TargetConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.n_heads * self.head_dim
        self.kv_size = self.n_kv * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = self.head_dim**-0.5


class TargetLayer(nn.Module):
    def __init__(self, cfg: TargetConfig, layer_idx: int):
        super().__init__()
        self.self_attn = TargetAttention(cfg, layer_idx)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, delta, cos, sin, meta: AttentionMeta, cache: KVCache, ops: LayerOps):
        """(h, delta): the previous layer's output as `fused.finish_layer` leaves it (delta None for
        the embeddings) -> (this layer's input h + delta, and its own output as (h, delta))."""
        a, mlp = self.self_attn, self.mlp
        eps = self.input_layernorm.eps
        q_norm = a.q_norm.weight if a.q_norm is not None else None
        k_norm = a.k_norm.weight if a.k_norm is not None else None
        if qk_rope_write.supported(h, cache.k[a.layer_idx]):  # the heads' norms, rotations and cache write in one launch
            x, qkv = ops.norm_qkv(h, delta, self.input_layernorm.weight, a.qkv_proj.weight, a.qkv_proj.bias, eps)
            q, k, v = split_heads(qkv, a.n_heads, a.n_kv, a.head_dim)
            q = qk_rope_write.qk_rope_write(q, k, v, q_norm, k_norm, cos, sin, eps, meta.write_slots,
                                            cache.k[a.layer_idx], cache.v[a.layer_idx])
            keys, values = cache.layer(a.layer_idx, meta.kv_len)
        else:
            x, q, k, v = ops.project_qkv(h, delta, self.input_layernorm.weight, a.qkv_proj.weight, a.qkv_proj.bias,
                                         q_norm, k_norm, cos, sin, a.n_heads, a.n_kv, a.head_dim, eps)
            keys, values = cache.write(a.layer_idx, meta.write_slots, k, v, meta.kv_len)
        attn = attend(q, keys, values, meta, a.scale, ops.mask_bias)
        return x, *ops.finish_layer(x, attn, a.o_proj.weight, a.o_proj.bias, self.post_attention_layernorm.weight,
                                mlp.gate_up_proj.weight, mlp.gate_up_proj.bias, mlp.down_proj.weight, mlp.down_proj.bias, eps)

    def forward_folded(self, h, cos, sin, meta: AttentionMeta, cache: KVCache, ops: LayerOps) -> torch.Tensor:
        """h [N, H]: this layer's input, with its norms' weights folded into the q/k/v and gate/up
        weights (`TargetModel.fold_norms`) -> the layer's output, written over h. Each norm's row scale
        is applied by the kernel that reads its projection (`qk_rope_write`, `swiglu`) and each
        residual added by its projection (cuBLAS's beta = 1), so neither takes a launch of its own."""
        a, mlp = self.self_attn, self.mlp
        eps = self.input_layernorm.eps  # the q/k norms' too (`TargetConfig.rms_norm_eps`)
        q_norm = a.q_norm.weight if a.q_norm is not None else None
        k_norm = a.k_norm.weight if a.k_norm is not None else None
        q, k, v = split_heads(blaslt.linear(h, a.qkv_proj.weight), a.n_heads, a.n_kv, a.head_dim)
        q = qk_rope_write.qk_rope_write(q, k, v, q_norm, k_norm, cos, sin, eps, meta.write_slots,
                                        cache.k[a.layer_idx], cache.v[a.layer_idx], scale_rows=h)
        keys, values = cache.layer(a.layer_idx, meta.kv_len)
        blaslt.linear(attend(q, keys, values, meta, a.scale, ops.mask_bias), a.o_proj.weight, out=h, accumulate=True)
        gated = swiglu.swiglu(blaslt.linear(h, mlp.gate_up_proj.weight), scale_rows=h,
                              eps=self.post_attention_layernorm.eps)
        return blaslt.linear(gated, mlp.down_proj.weight, out=h, accumulate=True)


class TargetModel(nn.Module):
    """tokens [N] at positions [N] -> logits [N, V] (or the rows asked for) and features [N, len(taps) * H]."""

    def __init__(self, cfg: TargetConfig, max_positions: int):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(TargetLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryTable(cfg.rope, cfg.head_dim, max_positions)
        self.ops: LayerOps = EAGER
        self.folded = False

    def use_compiled(self) -> None:
        """Run the per-layer elementwise work through torch.compile (CUDA)."""
        self.ops = compiled_ops()

    def fold_norms_if_asked(self) -> None:
        """`fold_norms` where the model allows it, unless DDTREE_FOLDED_NORMS=0 (the engines call
        this, graphs or not, so that both run the same forward)."""
        if FOLDED_NORMS and self.can_fold_norms():
            self.fold_norms()

    def can_fold_norms(self) -> bool:
        """No biases (a bias is not scaled by the norm) and both kernels on this device."""
        cfg, param = self.config, self.lm_head.weight
        return (not cfg.attention_bias and not cfg.mlp_bias and param.is_cuda and qk_rope_write.triton is not None
                and swiglu.triton is not None and cfg.head_dim == qk_rope_write.triton.next_power_of_2(cfg.head_dim))

    def fold_norms(self) -> None:
        """Each layer's input norm weight folded into its q/k/v weight and its post-attention norm
        weight into its gate/up weight (W <- W diag(w), rounded once to W's dtype); the layers then
        run `TargetLayer.forward_folded`. Changes the weights in place, once."""
        if self.folded:
            return
        with torch.no_grad():
            for layer in self.layers:
                for w, norm in ((layer.self_attn.qkv_proj.weight, layer.input_layernorm.weight),
                                (layer.mlp.gate_up_proj.weight, layer.post_attention_layernorm.weight)):
                    w.copy_((w.float() * norm.float()[None, :]).to(w.dtype))
        self.folded = True

    def new_cache(self, slots: int, device, dtype) -> KVCache:
        cfg = self.config
        return KVCache(cfg.num_hidden_layers, slots, cfg.num_key_value_heads, cfg.head_dim, device, dtype)

    def new_scratch(self, nodes: int, device, dtype) -> None:
        """A dense target stashes nothing for its commit (`HybridTarget.new_scratch`)."""
        return None

    def commit(self, cache: KVCache, start, order: torch.Tensor, length, scratch=None) -> None:
        """After a round's walk: move the accepted nodes' KV entries into place (`order` [M]: the
        accepted path first); a dense target has no other state."""
        cache.compact(start, order)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMeta,
        cache: KVCache,
        feature_layers: list[int] | None = None,
        logit_rows: torch.Tensor | slice | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns (logits [rows, V] in float32, features [N, len(feature_layers) * H] or None).

        `feature_layers` are layer indices whose outputs (post-residual) the drafter reads.
        """
        h, delta = self.embed_tokens(tokens), None
        cos, sin = self.rotary(positions, h.dtype)
        taps = []
        wanted = set(feature_layers or ())
        for i, layer in enumerate(self.layers):
            if self.folded:  # h is each layer's input and, written over, its output
                if i - 1 in wanted:
                    taps.append(h.clone())
                h = layer.forward_folded(h, cos, sin, meta, cache, self.ops)
                continue
            layer_input, h, delta = layer(h, delta, cos, sin, meta, cache, self.ops)
            if i - 1 in wanted:  # layer i's input is layer i - 1's output
                taps.append(layer_input)
        last_tapped = len(self.layers) - 1 in wanted
        if logit_rows is not None and not last_tapped:  # only the rows asked for (a prefill's last)
            h, delta = h[logit_rows], None if delta is None else delta[logit_rows]
        out, normed = self.ops.final_norm(h, delta, self.norm.weight, self.norm.eps)
        if last_tapped:
            taps.append(out)
            normed = normed if logit_rows is None else normed[logit_rows]
        features = None
        if feature_layers:
            by_layer = dict(zip(sorted(wanted), taps))
            features = torch.cat([by_layer[i] for i in feature_layers], dim=-1)
        logits = logits_float32(normed, self.lm_head.weight)
        return logits, features
