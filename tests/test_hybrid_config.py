"""Hybrid checkpoints' configs: what loads, what is refused with one line, and the Qwen3.6 drafter's
config (4 sliding-window layers + 1 full)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ddtree.config import DDTreeError
from ddtree.models.configs import DrafterConfig, TargetConfig

TEXT = {
    "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 5120, "intermediate_size": 17408,
    "num_hidden_layers": 64, "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    "max_position_embeddings": 262144, "full_attention_interval": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                        "mrope_interleaved": True, "mrope_section": [11, 11, 10]},
}


def write(path, cfg: dict):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_qwen36_27b_conditional_generation_config(tmp_path):
    cfg = TargetConfig.from_dir(write(tmp_path, {
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": TEXT,
        "vision_config": {"depth": 27}, "tie_word_embeddings": False, "eos_token_id": 248046}))
    assert cfg.hybrid and cfg.nested_text_model and cfg.architecture == "qwen3_5"
    assert cfg.layer_types.count("full_attention") == 16 and cfg.layer_types[3] == "full_attention"
    assert cfg.attention_layers[:2] == [3, 7]
    g = cfg.gdn
    assert (g.num_key_heads, g.num_value_heads, g.key_head_dim, g.conv_dim) == (16, 48, 128, 2 * 2048 + 6144)
    assert cfg.rope.partial_rotary_factor == 0.25 and cfg.rope.theta == 1e7
    assert cfg.eos_token_ids == [248046]


def test_causal_lm_layout_and_default_partial_rotary(tmp_path):
    text = {k: v for k, v in TEXT.items() if k != "rope_parameters"}
    cfg = TargetConfig.from_dir(write(tmp_path, {"architectures": ["Qwen3_5ForCausalLM"], **text, "rope_theta": 1e6}))
    assert cfg.hybrid and not cfg.nested_text_model
    assert cfg.rope.partial_rotary_factor == 0.25  # transformers' default for qwen3_5


@pytest.mark.parametrize("arch,model_type", [
    ("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe"),
    ("Qwen3NextForCausalLM", "qwen3_next"),
    ("Qwen3MoeForCausalLM", "qwen3_moe"),
])
def test_mixture_of_experts_is_refused_in_one_line(tmp_path, arch, model_type):
    write(tmp_path, {"architectures": [arch], "model_type": model_type, **{k: v for k, v in TEXT.items() if k != "model_type"}})
    with pytest.raises(DDTreeError) as err:
        TargetConfig.from_dir(tmp_path)
    message = str(err.value)
    assert "\n" not in message and "mixture of experts" in message and "Qwen3_5ForCausalLM" in message


def test_bad_layer_types_are_refused(tmp_path):
    write(tmp_path, {"architectures": ["Qwen3_5ForCausalLM"], **TEXT, "layer_types": ["linear_attention"] * 3})
    with pytest.raises(DDTreeError, match="layer_types"):
        TargetConfig.from_dir(tmp_path)


def test_qwen36_drafter_config_loads_and_matches_the_target(tmp_path):
    target = TargetConfig.from_dir(write(tmp_path / "target", {
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": TEXT}))
    drafter = DrafterConfig.from_dir(write(tmp_path / "drafter", {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 5120, "num_hidden_layers": 5,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 17408,
        "vocab_size": 248320, "rms_norm_eps": 1e-6, "rope_theta": 10000000, "max_position_embeddings": 262144,
        "layer_types": ["sliding_attention"] * 4 + ["full_attention"], "sliding_window": 2048,
        "block_size": 16, "num_target_layers": 64,
        "dflash_config": {"target_layer_ids": [1, 16, 31, 46, 61], "mask_token_id": 248070}}))
    drafter.check_against(target, tmp_path / "drafter")
    assert drafter.layer_types.count("sliding_attention") == 4 and drafter.sliding_window == 2048
    assert drafter.block_size == 16 and drafter.target_layer_ids == [1, 16, 31, 46, 61]


def test_generate_cli_on_a_hybrid_pair(tmp_path):
    """`ddtree generate` end to end on a tiny hybrid pair (multimodal layout), ids in and out."""
    from tiny_models import make_drafter, make_hybrid_target

    make_hybrid_target(tmp_path / "target", layout="conditional")
    make_drafter(tmp_path / "drafter", tmp_path / "target", block_size=8)
    out = subprocess.run(
        [sys.executable, "-m", "ddtree.cli", "generate", "--target", str(tmp_path / "target"),
         "--draft", str(tmp_path / "drafter"), "--device", "cpu", "--dtype", "float32", "--prompt-token-ids", "3,1,4,1,5",
         "--max-tokens", "12", "--tree-budget", "16", "--ignore-eos", "--json"],
        capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert len(result["token_ids"]) == 12 and result["stats"]["tree_budget"] == "16"
