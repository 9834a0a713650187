"""Tiny random target and drafter checkpoints written to disk in the formats users bring.

Targets are made with transformers itself (Qwen3ForCausalLM / LlamaForCausalLM); drafters in the
z-lab DFlash format. `peak` scales the LM head so that greedy choices are never near ties.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ddtree.models.configs import build_target_layer_ids


def make_target(
    path: Path,
    arch: str = "qwen3",
    *,
    vocab: int = 96,
    hidden: int = 64,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    intermediate: int = 128,
    max_positions: int = 512,
    tie: bool = False,
    shard: bool = False,
    rope_scaling: dict | None = None,
    peak: float = 8.0,
    seed: int = 0,
    eos: int | None = 1,
):
    """Save a random target to `path`; returns the transformers model (float32, eval)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=intermediate,
        max_position_embeddings=max_positions, tie_word_embeddings=tie, eos_token_id=eos,
        bos_token_id=None, pad_token_id=None, rms_norm_eps=1e-6,
    )
    extra = {} if rope_scaling is None else {"rope_scaling": rope_scaling}
    if arch == "qwen3":
        cfg = Qwen3Config(**common, rope_theta=10000.0, **extra)
        model = Qwen3ForCausalLM(cfg)
    else:
        cfg = LlamaConfig(**common, rope_theta=500000.0, **extra)
        model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.08)
        if not tie:
            model.lm_head.weight.mul_(peak)
        else:
            model.model.embed_tokens.weight.mul_(peak ** 0.5)
    model.eval()
    model.save_pretrained(path, max_shard_size="50KB" if shard else "5GB", safe_serialization=True)
    return model


def make_drafter(
    path: Path,
    target_path: Path,
    *,
    layers: int = 2,
    block_size: int = 8,
    mask_token_id: int | None = None,
    layer_types: list[str] | None = None,
    sliding_window: int | None = None,
    seed: int = 1,
    scale: float = 0.08,
    output_scale: float = 1.0,
) -> dict:
    """Save a random z-lab DFlash drafter for the target at `target_path`; returns its config dict.
    `output_scale` scales the final norm's weight: near 0, every draft distribution is near uniform."""
    tcfg = json.loads((target_path / "config.json").read_text())
    tcfg = tcfg.get("text_config") or tcfg  # a multimodal hybrid checkpoint nests its text model
    torch.manual_seed(seed)
    hidden = tcfg["hidden_size"]
    heads, kv_heads = tcfg["num_attention_heads"], tcfg["num_key_value_heads"]
    head_dim = tcfg.get("head_dim") or hidden // heads
    inter = tcfg["intermediate_size"]
    taps = build_target_layer_ids(tcfg["num_hidden_layers"], layers)
    vocab = tcfg["vocab_size"]
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": inter,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": tcfg.get("max_position_embeddings", 512),
        "attention_bias": False,
        "hidden_act": "silu",
        "layer_types": layer_types or ["full_attention"] * layers,
        "sliding_window": sliding_window,
        "use_sliding_window": sliding_window is not None,
        "block_size": block_size,
        "num_target_layers": tcfg["num_hidden_layers"],
        "dflash_config": {"target_layer_ids": taps, "mask_token_id": vocab - 1 if mask_token_id is None else mask_token_id},
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    w = {}

    def rand(*shape):
        return torch.randn(*shape) * scale

    for i in range(layers):
        p = f"layers.{i}."
        w[p + "self_attn.q_proj.weight"] = rand(heads * head_dim, hidden)
        w[p + "self_attn.k_proj.weight"] = rand(kv_heads * head_dim, hidden)
        w[p + "self_attn.v_proj.weight"] = rand(kv_heads * head_dim, hidden)
        w[p + "self_attn.o_proj.weight"] = rand(hidden, heads * head_dim)
        w[p + "self_attn.q_norm.weight"] = 1 + rand(head_dim)
        w[p + "self_attn.k_norm.weight"] = 1 + rand(head_dim)
        w[p + "mlp.gate_proj.weight"] = rand(inter, hidden)
        w[p + "mlp.up_proj.weight"] = rand(inter, hidden)
        w[p + "mlp.down_proj.weight"] = rand(hidden, inter)
        w[p + "input_layernorm.weight"] = 1 + rand(hidden)
        w[p + "post_attention_layernorm.weight"] = 1 + rand(hidden)
    w["fc.weight"] = rand(hidden, hidden * len(taps))
    w["hidden_norm.weight"] = 1 + rand(hidden)
    w["norm.weight"] = output_scale * (1 + rand(hidden))
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in w.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return cfg


def make_tokenizer(path: Path, vocab: int = 512, eos: str = "<|endoftext|>", mask: str = "<|mask|>") -> tuple[int, int]:
    """Train a byte-level BPE tokenizer on a little Python source and save it as a Hugging Face
    tokenizer in `path`. Returns (eos id, mask id)."""
    import inspect
    import json as _json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[eos, mask],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = inspect.getsource(_json) + inspect.getsource(inspect)
    tok.train_from_iterator([text[i : i + 2000] for i in range(0, len(text), 2000)], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, additional_special_tokens=[mask])
    fast.save_pretrained(str(path))
    return tok.token_to_id(eos), tok.token_to_id(mask)


def make_pair_with_tokenizer(root: Path, block_size: int = 8) -> tuple[Path, Path]:
    """A tiny random target (with tokenizer, eos and mask tokens) and its random drafter under `root`."""
    target, draft = root / "target", root / "drafter"
    target.mkdir(parents=True, exist_ok=True)
    eos, mask = make_tokenizer(target)
    make_target(target, "qwen3", vocab=512, eos=eos, max_positions=1024, peak=4.0)
    make_tokenizer(target)  # save_pretrained of the model leaves tokenizer files alone; rewrite to be sure
    make_drafter(draft, target, block_size=block_size, mask_token_id=mask)
    return target, draft


def reference_draft_logprobs(hf_target, ref_drafter, seq: list[int], n: int) -> torch.Tensor:
    """z-lab's reference draft for a sequence committed up to `n` (root = seq[n]), computed from
    scratch: transformers' hidden states of seq[:n] as context, block [seq[n], MASK x (b-1)] at
    positions n..n+b-1. Returns log-probs [b-1, V] (float32). `ref_drafter` is a
    `dflash.model.DFlashDraftModel`."""
    from dflash.model import extract_context_feature

    b = ref_drafter.block_size
    with torch.no_grad():
        out = hf_target(torch.tensor([seq[:n]]), output_hidden_states=True)
        feats = extract_context_feature(out.hidden_states, ref_drafter.target_layer_ids)
        block = torch.full((b,), ref_drafter.mask_token_id, dtype=torch.long)
        block[0] = seq[n]
        noise = hf_target.get_input_embeddings()(block)[None]
        hidden = ref_drafter(target_hidden=feats, noise_embedding=noise, position_ids=torch.arange(n + b)[None])[0]
        logits = ref_drafter.compute_logits(hidden[1:], hf_target.lm_head)
    return torch.log_softmax(logits.float(), dim=-1)



def make_hybrid_target(
    path: Path,
    *,
    layout: str = "causal",
    vocab: int = 96,
    hidden: int = 64,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    linear_key_heads: int = 2,
    linear_value_heads: int = 4,
    linear_head_dim: int = 16,
    intermediate: int = 128,
    max_positions: int = 2048,
    shard: bool = False,
    peak: float = 8.0,
    seed: int = 0,
    eos: int | None = 1,
    extra_tensors: bool = True,
    rope: dict | None = None,
):
    """Save a random Qwen3.5-style hybrid target (3 Gated DeltaNet layers per full-attention layer)
    to `path`, as `Qwen3_5ForCausalLM` (layout "causal": weights `model.*`) or as the multimodal
    `Qwen3_5ForConditionalGeneration` (layout "conditional": `model.language_model.*`, a tiny
    vision tower, and with `extra_tensors` a stand-in `mtp.*` head, both of which ddtree ignores).
    `rope`: rope parameters over the default ones (a scaling). Returns the float32
    `Qwen3_5ForCausalLM` (the oracle)."""
    from safetensors.torch import load_file
    from transformers import Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5TextConfig

    torch.manual_seed(seed)
    text = Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=intermediate,
        max_position_embeddings=max_positions, linear_num_key_heads=linear_key_heads,
        linear_num_value_heads=linear_value_heads, linear_key_head_dim=linear_head_dim,
        linear_value_head_dim=linear_head_dim, eos_token_id=eos, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25, **(rope or {})},
    )
    model = Qwen3_5ForCausalLM(text)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                continue  # transformers' init: log of uniform(0.01, 16)
            if name.endswith("linear_attn.norm.weight") or name.endswith("dt_bias"):
                p.normal_(1.0, 0.1)  # the gated norm is not zero-centred
            elif p.dim() == 1:
                p.normal_(0.0, 0.1)  # zero-centred RMSNorms: x * (1 + w)
            elif "conv1d" in name:
                p.normal_(0.0, 0.3)
            else:
                p.normal_(0.0, 0.08)
        model.lm_head.weight.mul_(peak)
    model.eval()
    shard_size = "50KB" if shard else "5GB"
    if layout == "causal":
        model.save_pretrained(path, max_shard_size=shard_size, safe_serialization=True)
        return model
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=hidden)
    full = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text.to_dict(), vision_config=vision))
    full.model.language_model.load_state_dict(model.model.state_dict())
    full.lm_head.load_state_dict(model.lm_head.state_dict())
    full.save_pretrained(path, max_shard_size=shard_size, safe_serialization=True)
    if extra_tensors:
        mtp = {"mtp.fc.weight": torch.randn(hidden, 2 * hidden), "mtp.norm.weight": torch.ones(hidden)}
        save_file(mtp, str(path / "mtp.safetensors"))
        index = path / "model.safetensors.index.json"
        if index.is_file():
            data = json.loads(index.read_text())
            data["weight_map"].update({k: "mtp.safetensors" for k in mtp})
            index.write_text(json.dumps(data))
        else:
            tensors = load_file(str(path / "model.safetensors"))
            tensors.update(mtp)
            save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
            (path / "mtp.safetensors").unlink()
    return model
