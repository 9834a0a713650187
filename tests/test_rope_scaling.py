"""Rotary scaling read as transformers reads it: YaRN's frequencies and attention factor against
transformers' own at the shapes users extend (Qwen3-8B to 128k, Qwen3.6's partial rotary to 1M,
DeepSeek's mscale form), and the context limit each scaling gives, as vLLM derives it. Logits
through whole models with YaRN: tests/test_target_parity.py."""
from __future__ import annotations

import json

import pytest
import torch

from ddtree.config import DDTreeError
from ddtree.model_pair import context_limit
from ddtree.models.configs import RopeConfig, TargetConfig
from ddtree.models.layers import RotaryTable, rope_inv_freq

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

QWEN3_8B = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                max_position_embeddings=40960, rope_theta=1_000_000.0)
YARN_CASES = {
    # Qwen's own instructions for 131072 tokens
    "qwen3-8b-128k": (QWEN3_8B, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
    # partial rotary (a quarter of a 256-dim head), as Qwen3.6's attention layers
    "partial-rotary-1m": (dict(QWEN3_8B, head_dim=256, rope_theta=10_000_000.0, max_position_embeddings=262144),
                          {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 262144,
                           "partial_rotary_factor": 0.25}),
    "mscale-and-betas": (QWEN3_8B, {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                    "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 24, "beta_slow": 2}),
    "attention-factor-given-untruncated": (QWEN3_8B, {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.5,
                                                      "original_max_position_embeddings": 20480, "truncate": False}),
}


def hf_config(fields: dict, rope: dict):
    from transformers import Qwen3Config

    fields = dict(fields)
    rope = dict(rope)
    partial = rope.pop("partial_rotary_factor", None)
    cfg = Qwen3Config(**fields, rope_scaling=rope)
    if partial is not None:
        cfg.rope_parameters["partial_rotary_factor"] = partial
    return cfg


@pytest.mark.parametrize("case", list(YARN_CASES))
def test_yarn_frequencies_and_attention_factor_equal_transformers(case):
    fields, rope = YARN_CASES[case]
    cfg = hf_config(fields, rope)
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    ours = RopeConfig.from_hf(cfg.to_dict(), "target")
    assert ours.rope_type == "yarn" and ours.attention_factor == pytest.approx(want_factor, rel=1e-12)
    torch.testing.assert_close(rope_inv_freq(ours, fields["head_dim"]), want_freq, rtol=1e-6, atol=0)


def test_yarn_without_a_factor_takes_the_lengths_ratio():
    """DeepSeek-V3's form: no factor, the ratio of max_position_embeddings to the pretrained length."""
    cfg = hf_config(dict(QWEN3_8B, max_position_embeddings=163840),
                    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096})
    cfg.rope_parameters["factor"] = None
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    ours = RopeConfig.from_hf(cfg.to_dict(), "target")
    assert ours.factor == 40.0 and ours.attention_factor == pytest.approx(want_factor, rel=1e-12)
    torch.testing.assert_close(rope_inv_freq(ours, 128), want_freq, rtol=1e-6, atol=0)


def test_the_rotary_table_carries_the_attention_factor():
    """cos and sin scaled by YaRN's attention factor (transformers' attention_scaling), 1 elsewhere."""
    fields, rope = YARN_CASES["qwen3-8b-128k"]
    yarn = RopeConfig.from_hf(hf_config(fields, rope).to_dict(), "target")
    plain = RopeConfig(theta=yarn.theta)
    for config, factor in ((yarn, yarn.attention_factor), (plain, 1.0)):
        cos, sin = RotaryTable(config, 128, 64)(torch.arange(64), torch.float32)
        torch.testing.assert_close(cos * cos + sin * sin, torch.full_like(cos, factor ** 2))


@pytest.mark.parametrize("rope,max_positions,limit", [
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 40960, 131072),
    ({"rope_type": "yarn", "factor": 2.5}, 4096, 10240),  # no pretrained length: max_position_embeddings
    ({"rope_type": "linear", "factor": 2.0}, 4096, 8192),
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}, 131072, 131072),
    ({"rope_type": "default"}, 40960, 40960),
])
def test_context_limit_follows_the_rope_scaling(tmp_path, rope, max_positions, limit):
    """max_model_len may reach what the scaling extends the context to (vLLM's rule), not past it."""
    cfg = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
           "vocab_size": 96, "max_position_embeddings": max_positions, "rope_theta": 10000.0, "rope_scaling": rope}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    target = TargetConfig.from_dir(tmp_path)
    assert target.context_limit == limit and context_limit(target, None) == limit
    assert context_limit(target, limit) == limit
    with pytest.raises(DDTreeError, match=f"max_model_len must be an integer in \\[2, {limit}\\]"):
        context_limit(target, limit + 1)


@pytest.mark.parametrize("rope,fragment", [
    ({"rope_type": "dynamic", "factor": 2.0}, "rope type 'dynamic' is not supported"),
    ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}, "rope type 'longrope'"),
    ({"rope_type": "yarn", "factor": -1.0}, "rope factor"),
    ({"rope_type": "yarn", "factor": 4.0, "attention_factor": 0.0}, "attention_factor must be positive"),
    ({"rope_type": "yarn", "factor": "four"}, "rope factor"),
])
def test_rope_settings_ddtree_cannot_serve_are_one_line_errors(rope, fragment):
    with pytest.raises(DDTreeError, match=fragment):
        RopeConfig.from_hf({"rope_theta": 10000.0, "max_position_embeddings": 4096, "rope_scaling": rope}, "target")


def test_the_flag_over_a_config_equals_the_config_that_says_it(tmp_path):
    """`LLM(rope_scaling=...)` (`--rope-scaling`) over a target with no scaling decodes as the same
    weights whose config.json holds that scaling, past max_position_embeddings, with the context
    limit grown to match; the transformers-5 `rope_parameters` keep their rope_theta, and a legacy
    "type" key counts as "rope_type"."""
    import shutil

    from ddtree import LLM, SamplingParams
    from tiny_models import make_target

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 48}
    scaled, plain = tmp_path / "scaled", tmp_path / "plain"
    make_target(scaled, "qwen3", max_positions=48, rope_scaling=yarn)
    shutil.copytree(scaled, plain)
    config = json.loads((plain / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": config["rope_parameters"]["rope_theta"]}
    (plain / "config.json").write_text(json.dumps(config))
    assert TargetConfig.from_dir(plain).context_limit == 48

    flag = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 48}
    overridden = TargetConfig.from_dir(plain, flag)
    assert overridden.rope == TargetConfig.from_dir(scaled).rope and overridden.context_limit == 192
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompt = torch.randint(0, 96, (100,), generator=torch.Generator().manual_seed(3)).tolist()
    by_config = LLM(scaled, device="cpu", dtype="float32", use_draft=False)
    by_flag = LLM(plain, device="cpu", dtype="float32", use_draft=False, rope_scaling=flag)
    assert by_config.max_model_len == by_flag.max_model_len == 192
    assert by_flag.generate(prompt, params).token_ids == by_config.generate(prompt, params).token_ids


def test_serve_with_rope_scaling_takes_prompts_past_the_targets_limit(demo_pair):
    """`ddtree serve --rope-scaling` (the engine in its own process): /health reports the grown
    context limit and a prompt longer than the demo target's 2048 positions completes."""
    import httpx

    from server_process import LiveServer

    yarn = '{"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048}'
    with LiveServer(*demo_pair, "--rope-scaling", yarn, "--tree-budget", "16", max_model_len=4096) as server:
        headers = server.headers
        assert httpx.get(server.url + "/health", timeout=30).json()["max_model_len"] == 4096
        prompt = [3 + i % 500 for i in range(2100)]
        reply = httpx.post(server.url + "/v1/completions", headers=headers, timeout=300,
                           json={"model": server.model, "prompt": prompt, "max_tokens": 4, "temperature": 0})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"] == {"prompt_tokens": 2100, "completion_tokens": 4, "total_tokens": 2104}
