"""Configs of published target + drafter pairs, by name, for planning and benchmarks without their
checkpoints: `qwen3-8b` (dense) with a DFlash drafter of its width, and `qwen3.6-27b` (hybrid: 16 x
(3 Gated DeltaNet + 1 gated attention) layers) with its 5-layer drafter. Shapes only: no weights,
no tokenizer, no eos ids.
"""
from __future__ import annotations

from ddtree.models.configs import DrafterConfig, GatedDeltaNetConfig, RopeConfig, TargetConfig, build_target_layer_ids

QWEN3_8B = dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, intermediate_size=12288, vocab_size=151936, rms_norm_eps=1e-6,
                rope=RopeConfig(theta=1000000.0), max_position_embeddings=40960, qk_norm=True)

# Qwen3.6-27B's text model (/work/shared/DESIGN.md section 6).
QWEN36_27B = dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4,
                  head_dim=256, intermediate_size=17408, vocab_size=248320, rms_norm_eps=1e-6,
                  rope=RopeConfig(theta=10000000.0, partial_rotary_factor=0.25), max_position_embeddings=262144,
                  qk_norm=True)
QWEN36_GDN = GatedDeltaNetConfig(num_key_heads=16, num_value_heads=48, key_head_dim=128, value_head_dim=128,
                                 conv_kernel=4)
# Its DFlash drafter: 5 Qwen3-shaped layers (4 sliding-window of 2048, then 1 full), block 16,
# reading target layers 1, 16, 31, 46, 61. Its attention heads (32 q / 8 kv of 128) are assumed.
QWEN36_DRAFTER = dict(QWEN36_27B, num_hidden_layers=5, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                      rope=RopeConfig(theta=10000000.0))

NAMES = ("qwen3-8b", "qwen3.6-27b")


def named_pair(name: str, draft_layers: int = 5, block: int = 16) -> tuple[TargetConfig, DrafterConfig]:
    """(target, drafter) configs of a pair in NAMES; `draft_layers` applies to qwen3-8b's drafter."""
    if name == "qwen3.6-27b":
        layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(64)]
        target = TargetConfig(**QWEN36_27B, architecture="qwen3_5", layer_types=layer_types, gdn=QWEN36_GDN)
        drafter = DrafterConfig(**QWEN36_DRAFTER, block_size=block, num_target_layers=64,
                                target_layer_ids=[1, 16, 31, 46, 61], mask_token_id=248070,
                                layer_types=["sliding_attention"] * 4 + ["full_attention"], sliding_window=2048)
        return target, drafter
    if name == "qwen3-8b":
        target = TargetConfig(**QWEN3_8B, architecture="qwen3")
        drafter = DrafterConfig(**{**QWEN3_8B, "num_hidden_layers": draft_layers}, block_size=block,
                                num_target_layers=36, target_layer_ids=build_target_layer_ids(36, draft_layers),
                                mask_token_id=151935, layer_types=["full_attention"] * draft_layers)
        return target, drafter
    raise ValueError(f"unknown shape {name!r} (known: {', '.join(NAMES)})")
