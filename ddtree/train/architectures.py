"""The architectures `ddtree train-target --arch` builds, each transformers' own causal LM:

- `qwen3`: `Qwen3ForCausalLM`, a dense decoder (q/k norms, GQA, SwiGLU, RoPE).
- `qwen3_5`: `Qwen3_5ForCausalLM`, a hybrid: Gated DeltaNet ("linear_attention") layers with a
  gated full-attention layer every `--full-attention-interval` layers (3:1 at the default 4),
  rotary on a quarter of each attention head, zero-centred RMSNorms.

The hybrid's shape flags default to None on the command line so that giving one with `--arch
qwen3` can be refused; `resolve_architecture` fills in the defaults below.
"""
from __future__ import annotations

import argparse

from ddtree.config import DDTreeError

ARCHITECTURES = ("qwen3", "qwen3_5")

# Defaults for a small hybrid (hidden 384): key dims = hidden / 2 and value dims = hidden, the
# proportions of the released Qwen3.5 checkpoints.
HYBRID_DEFAULTS = {"linear_key_heads": 3, "linear_value_heads": 6, "linear_head_dim": 64,
                   "full_attention_interval": 4, "conv_kernel": 4}
PARTIAL_ROTARY_FACTOR = 0.25  # the Qwen3.5 recipe: rotary on the first quarter of each head
ROPE_THETA = 10000.0


def add_architecture_args(group) -> None:
    """`--arch` and the hybrid's shape flags (registered in the train-target parser)."""
    group.add_argument("--arch", default="qwen3", choices=ARCHITECTURES,
                       help="qwen3 (dense, default) or qwen3_5 (hybrid: Gated DeltaNet + gated attention)")
    for name, text in (("linear_key_heads", "Gated DeltaNet query/key heads"),
                       ("linear_value_heads", "Gated DeltaNet value heads (a multiple of the key heads)"),
                       ("linear_head_dim", "Gated DeltaNet head dim (keys and values)"),
                       ("full_attention_interval", "one full-attention layer every N layers, the rest Gated DeltaNet"),
                       ("conv_kernel", "Gated DeltaNet causal conv kernel length")):
        group.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                           help=f"--arch qwen3_5: {text} (default {HYBRID_DEFAULTS[name]})")


def resolve_architecture(args: argparse.Namespace) -> None:
    """Check the architecture's own flags; with qwen3_5, fill in the defaults of those not given."""
    from ddtree.train.common import check_positive  # here: the CLI's parser imports this module, common imports torch

    if args.arch not in ARCHITECTURES:
        raise DDTreeError(f"--arch must be one of {', '.join(ARCHITECTURES)}, got {args.arch!r}", "arch")
    if args.arch == "qwen3":
        given = [name for name in HYBRID_DEFAULTS if getattr(args, name, None) is not None]
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise DDTreeError(f"{flag} applies to --arch qwen3_5 only", given[0])
        return
    for name, default in HYBRID_DEFAULTS.items():
        if getattr(args, name, None) is None:
            setattr(args, name, default)
        check_positive(name, getattr(args, name))
    if args.linear_value_heads % args.linear_key_heads:
        raise DDTreeError(f"--linear-value-heads {args.linear_value_heads} must be a multiple of --linear-key-heads "
                          f"{args.linear_key_heads}", "linear_value_heads")
    if args.head_dim % 8:
        # transformers rotates int(head_dim / 4) dims as pairs: a quarter of the head must be even.
        raise DDTreeError(f"--head-dim must be a multiple of 8 with --arch qwen3_5 (rotary on a quarter of each "
                          f"head), got {args.head_dim}", "head_dim")
    if not 2 <= args.full_attention_interval <= args.layers:
        raise DDTreeError(f"--full-attention-interval must be in [2, --layers {args.layers}] (at least one "
                          f"Gated DeltaNet and one full-attention layer), got {args.full_attention_interval}",
                          "full_attention_interval")
    if args.conv_kernel < 2:
        raise DDTreeError(f"--conv-kernel must be >= 2, got {args.conv_kernel}", "conv_kernel")


def shape_fields(args: argparse.Namespace) -> tuple[str, ...]:
    """The architecture's own settings, recorded in the run config (a dense run records none, so
    its checkpoints resume as before)."""
    return ("arch", *HYBRID_DEFAULTS) if args.arch == "qwen3_5" else ()


def hybrid_layer_types(layers: int, interval: int) -> list[str]:
    """Every `interval`-th layer full attention, the rest Gated DeltaNet (the Qwen3.5 pattern)."""
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]


def build_model(args: argparse.Namespace, eos_id: int):
    """A freshly initialised causal LM of the requested architecture and shape (float32)."""
    common = dict(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
        intermediate_size=args.intermediate_size, max_position_embeddings=args.max_position_embeddings,
        tie_word_embeddings=args.tie_embeddings, rms_norm_eps=1e-6,
        eos_token_id=eos_id, pad_token_id=eos_id, bos_token_id=None, use_cache=True,
    )
    if args.arch == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        return Qwen3ForCausalLM(Qwen3Config(**common, rope_theta=ROPE_THETA))
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(
        **common,
        linear_num_key_heads=args.linear_key_heads, linear_num_value_heads=args.linear_value_heads,
        linear_key_head_dim=args.linear_head_dim, linear_value_head_dim=args.linear_head_dim,
        linear_conv_kernel_dim=args.conv_kernel,
        layer_types=hybrid_layer_types(args.layers, args.full_attention_interval),  # written to config.json
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA,
                         "partial_rotary_factor": PARTIAL_ROTARY_FACTOR},
    )
    return Qwen3_5ForCausalLM(cfg)
