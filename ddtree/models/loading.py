"""Load target and drafter weights from safetensors checkpoints (single file or sharded)."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ddtree.config import DDTreeError
from ddtree.models.configs import DrafterConfig, TargetConfig
from ddtree.models.drafter import DFlashDrafter
from ddtree.models.hybrid import HybridTarget
from ddtree.models.layers import RotaryTable
from ddtree.models.target import TargetModel

log = logging.getLogger("ddtree.models")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise DDTreeError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}", "dtype")
    return DTYPES[name]


def read_safetensors(path: Path, what: str) -> dict[str, torch.Tensor]:
    """All tensors of `model.safetensors`, or of the shards listed in `model.safetensors.index.json`."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DDTreeError(f"{what}: cannot parse {index}: {exc}") from None
        files = sorted(set(weight_map.values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise DDTreeError(f"{what}: no model.safetensors or model.safetensors.index.json in {path}")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        file = path / name
        if not file.is_file():
            raise DDTreeError(f"{what}: missing weight shard {file}")
        try:
            tensors.update(load_file(str(file)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise DDTreeError(f"{what}: corrupt weight file {file}: {exc}") from None
    return tensors


def _assign(module: torch.nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    if missing:
        raise DDTreeError(f"{what}: weights missing from the checkpoint: {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
    for name, tensor in state.items():
        if name not in expected:
            continue
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise DDTreeError(f"{what}: weight {name} has shape {tuple(tensor.shape)}, config implies {tuple(expected[name].shape)}")
    module.load_state_dict({k: v for k, v in state.items() if k in expected}, strict=True)


def _fuse(raw: dict[str, torch.Tensor], prefix: str, parts: list[str], fused: str, out: dict, kind: str) -> None:
    keys = [f"{prefix}{p}.{kind}" for p in parts]
    if all(k in raw for k in keys):
        out[f"{prefix}{fused}.{kind}"] = torch.cat([raw.pop(k) for k in keys], dim=0)


def target_state_dict(raw: dict[str, torch.Tensor], cfg: TargetConfig) -> dict[str, torch.Tensor]:
    """Map Hugging Face names (`model.layers.N.self_attn.q_proj.weight`, ...) to ours, fusing qkv and gate/up."""
    raw = {(k[len("model."):] if k.startswith("model.") else k): v for k, v in raw.items()}
    out: dict[str, torch.Tensor] = {}
    for i in range(cfg.num_hidden_layers):
        for kind in ("weight", "bias"):
            _fuse(raw, f"layers.{i}.self_attn.", ["q_proj", "k_proj", "v_proj"], "qkv_proj", out, kind)
            _fuse(raw, f"layers.{i}.mlp.", ["gate_proj", "up_proj"], "gate_up_proj", out, kind)
    out.update(raw)
    if cfg.tie_word_embeddings or "lm_head.weight" not in out:
        if "embed_tokens.weight" in out:
            out["lm_head.weight"] = out["embed_tokens.weight"]
    return out


# Tensors of a Qwen3.5 / Qwen3.6 checkpoint that a text engine does not use.
HYBRID_IGNORED_PREFIXES = ("model.visual.", "mtp.", "visual.")


def hybrid_state_dict(raw: dict[str, torch.Tensor], cfg: TargetConfig, what: str) -> dict[str, torch.Tensor]:
    """Map a Qwen3.5 / Qwen3.6 checkpoint (`model.language_model.*` or `model.*`) to HybridTarget's
    names: q/k/v fused, gate/up fused, the Gated DeltaNet input projections stacked, the conv
    weight [C, 1, K] as [C, K]; the vision tower and the multi-token-prediction head dropped."""
    ignored = [k for k in raw if k.startswith(HYBRID_IGNORED_PREFIXES)]
    if ignored:
        log.info("%s: ignoring %d tensors of the vision tower / multi-token-prediction head (text only)", what, len(ignored))
    prefix = "model.language_model." if cfg.nested_text_model else "model."
    out: dict[str, torch.Tensor] = {}
    rest: dict[str, torch.Tensor] = {}
    for key, tensor in raw.items():
        if key.startswith(HYBRID_IGNORED_PREFIXES):
            continue
        rest[key[len(prefix):] if key.startswith(prefix) else key] = tensor
    for i, kind in enumerate(cfg.layer_types):
        layer = f"layers.{i}."
        _fuse(rest, f"{layer}mlp.", ["gate_proj", "up_proj"], "gate_up_proj", out, "weight")
        for name in ("input_layernorm", "post_attention_layernorm"):
            if f"{layer}{name}.weight" in rest:
                out[f"{layer}{name}"] = rest.pop(f"{layer}{name}.weight")
        if kind == "full_attention":
            for bias in ("weight", "bias"):
                _fuse(rest, f"{layer}self_attn.", ["q_proj", "k_proj", "v_proj"], "qkv_proj", out, bias)
            for name in ("q_norm", "k_norm"):
                if f"{layer}self_attn.{name}.weight" in rest:
                    out[f"{layer}self_attn.{name}"] = rest.pop(f"{layer}self_attn.{name}.weight")
        else:
            base = f"{layer}linear_attn."
            _fuse(rest, base, ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"], "in_proj", out, "weight")
            if f"{base}conv1d.weight" in rest:
                conv = rest.pop(f"{base}conv1d.weight")
                out[f"{base}conv_weight"] = conv.reshape(conv.shape[0], conv.shape[-1])
            if f"{base}norm.weight" in rest:
                out[f"{base}norm"] = rest.pop(f"{base}norm.weight")
    if "norm.weight" in rest:
        out["norm"] = rest.pop("norm.weight")
    out.update(rest)
    if cfg.tie_word_embeddings or "lm_head.weight" not in out:
        if "embed_tokens.weight" in out:
            out["lm_head.weight"] = out["embed_tokens.weight"]
    return out


def drafter_state_dict(raw: dict[str, torch.Tensor], cfg: DrafterConfig) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for i in range(cfg.num_hidden_layers):
        for kind in ("weight", "bias"):
            _fuse(raw, f"layers.{i}.mlp.", ["gate_proj", "up_proj"], "gate_up_proj", out, kind)
    out.update(raw)
    return out


def load_target(path: str | Path, device, dtype: torch.dtype, max_positions: int | None = None,
                rope_scaling: dict | None = None) -> TargetModel | HybridTarget:
    """The target at `path` (rope_scaling: over its config.json's, `TargetConfig.from_dir`)."""
    path = Path(path)
    cfg = TargetConfig.from_dir(path, rope_scaling)
    what = f"target model {path}"
    raw = read_safetensors(path, what)
    positions = max_positions or cfg.context_limit
    model_class = HybridTarget if cfg.hybrid else TargetModel
    with torch.device("meta"):
        model = model_class(cfg, 1)
    model = model.to_empty(device=device)
    _assign(model, hybrid_state_dict(raw, cfg, what) if cfg.hybrid else target_state_dict(raw, cfg), what)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = RotaryTable(cfg.rope, cfg.head_dim, positions).to(device)
    return model.to(dtype=dtype).eval().requires_grad_(False)


def load_drafter(path: str | Path, target_cfg: TargetConfig, device, dtype: torch.dtype, max_positions: int) -> DFlashDrafter:
    path = Path(path)
    cfg = DrafterConfig.from_dir(path)
    cfg.check_against(target_cfg, path)
    what = f"drafter {path}"
    raw = read_safetensors(path, what)
    with torch.device("meta"):
        model = DFlashDrafter(cfg, 1)
    model = model.to_empty(device=device)
    _assign(model, drafter_state_dict(raw, cfg), what)
    model.rotary = RotaryTable(cfg.rope, cfg.head_dim, max_positions).to(device)
    return model.to(dtype=dtype).eval().requires_grad_(False)
