"""A transformers target's decoder layers as weights a DFlash drafter layer can start from
(`train-drafter --init-from-target`), named as the target names them.

A dense target gives every layer as it is. A hybrid (Qwen3.5) target gives its full-attention
layers only, since a Gated DeltaNet layer holds no attention weights, converted to the drafter's
plain Qwen3 layer: `q_proj` keeps its query rows (it emits per head [query | output gate]), and
every RMSNorm weight w becomes 1 + w (the hybrid's norms scale by 1 + w, the drafter's by w).
"""
from __future__ import annotations

import torch

# Norm weights of a hybrid attention layer; all of them are zero-centred.
HYBRID_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
                "self_attn.k_norm.weight")


def is_hybrid(config) -> bool:
    """A transformers config with Gated DeltaNet ("linear_attention") layers."""
    return "linear_attention" in (getattr(config, "layer_types", None) or ())


def query_rows(q_proj: torch.Tensor, heads: int) -> torch.Tensor:
    """A gated attention's q_proj weight [heads * 2D, H] (per head: D query rows, then D gate rows)
    -> the query rows [heads * D, H]."""
    return q_proj.view(heads, 2, -1, q_proj.shape[-1])[:, 0].reshape(-1, q_proj.shape[-1])


def drafter_init_layers(target_hf) -> list[dict[str, torch.Tensor]]:
    """Per layer a drafter may copy, its weights by transformers name (`self_attn.q_proj.weight`, ...)."""
    layers = target_hf.model.layers
    if not is_hybrid(target_hf.config):
        return [dict(layer.named_parameters()) for layer in layers]
    out = []
    for kind, layer in zip(target_hf.config.layer_types, layers):
        if kind != "full_attention":
            continue
        weights = {name: p.detach() for name, p in layer.named_parameters()}
        weights["self_attn.q_proj.weight"] = query_rows(weights["self_attn.q_proj.weight"],
                                                        target_hf.config.num_attention_heads)
        for name in HYBRID_NORMS:
            weights[name] = 1.0 + weights[name]
        out.append(weights)
    return out
