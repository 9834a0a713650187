"""Load target and drafter weights from safetensors checkpoints (single file or sharded)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ddtree.config import DDTreeError
from ddtree.models.configs import DrafterConfig, TargetConfig
from ddtree.models.drafter import DFlashDrafter
from ddtree.models.layers import RotaryTable
from ddtree.models.target import TargetModel

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


def drafter_state_dict(raw: dict[str, torch.Tensor], cfg: DrafterConfig) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for i in range(cfg.num_hidden_layers):
        for kind in ("weight", "bias"):
            _fuse(raw, f"layers.{i}.mlp.", ["gate_proj", "up_proj"], "gate_up_proj", out, kind)
    out.update(raw)
    return out


def load_target(path: str | Path, device, dtype: torch.dtype, max_positions: int | None = None) -> TargetModel:
    path = Path(path)
    cfg = TargetConfig.from_dir(path)
    what = f"target model {path}"
    raw = read_safetensors(path, what)
    positions = max_positions or cfg.max_position_embeddings
    with torch.device("meta"):
        model = TargetModel(cfg, 1)
    model = model.to_empty(device=device)
    _assign(model, target_state_dict(raw, cfg), what)
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
