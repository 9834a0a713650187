"""Training on a hybrid target (`train-target --arch qwen3_5`):

- the features the drafter trainer reads through transformers are the engine's, in both
  checkpoint layouts;
- `--init-from-target` starts drafter layers from the hybrid's full-attention layers, norms converted;
- bad hybrid flags are refused with one line, before anything is written.
"""
from __future__ import annotations

import json

import pytest
import torch

from train_helpers import run

pytest.importorskip("transformers.models.qwen3_5")


@pytest.mark.parametrize("layout", ["causal", "conditional"])
def test_trainer_reads_the_engine_features_of_a_hybrid_target(tmp_path, layout):
    from tiny_models import make_hybrid_target

    from ddtree.models.layers import AttentionMeta
    from ddtree.models.loading import load_target
    from ddtree.train.drafter import FeatureTap, load_target_hf

    make_hybrid_target(tmp_path, layout=layout, layers=8)
    hf = load_target_hf(tmp_path, torch.device("cpu"))
    taps = [1, 3, 6]
    tokens = torch.randint(0, 96, (1, 30), generator=torch.Generator().manual_seed(0))
    features = FeatureTap(hf, taps)(tokens)[0]
    with torch.no_grad():
        hidden = hf(tokens, output_hidden_states=True).hidden_states  # [embeddings, layer 0, layer 1, ...]
    assert torch.equal(features, torch.cat([hidden[i + 1][0] for i in taps], dim=-1))
    ours = load_target(tmp_path, "cpu", torch.float32, 64)
    meta = AttentionMeta(torch.arange(30), 30, None, causal=True)
    _, engine = ours(tokens[0], torch.arange(30), meta, ours.new_cache(64, "cpu", torch.float32), feature_layers=taps)
    torch.testing.assert_close(features, engine, atol=1e-4, rtol=1e-4)


def test_drafter_layers_start_from_the_hybrid_full_attention_layers(tmp_path):
    from tiny_models import make_hybrid_target

    from ddtree.models.configs import DrafterConfig
    from ddtree.models.drafter import DFlashDrafter
    from ddtree.train.drafter import drafter_config_dict, init_drafter

    hf = make_hybrid_target(tmp_path / "t", layers=8)  # full attention at layers 3 and 7
    cfg = drafter_config_dict(tmp_path / "t", 2, 8, 95, None)
    assert cfg["num_target_layers"] == 8 and "rope_parameters" not in cfg  # whole-head rotary, as Qwen3
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    drafter = DFlashDrafter(DrafterConfig.from_dir(tmp_path / "d"), 64)
    assert drafter.config.rope.partial_rotary_factor == 1.0
    init_drafter(drafter, hf, from_target=True)
    heads, head_dim = hf.config.num_attention_heads, hf.config.head_dim
    for mine, index in zip(drafter.layers, (3, 7)):
        theirs = hf.model.layers[index]
        assert hf.config.layer_types[index] == "full_attention"
        query = theirs.self_attn.q_proj.weight.view(heads, 2 * head_dim, -1)[:, :head_dim].reshape(heads * head_dim, -1)
        assert torch.equal(mine.self_attn.q_proj.weight, query)
        for name in ("k_proj", "v_proj", "o_proj"):
            assert torch.equal(getattr(mine.self_attn, name).weight, getattr(theirs.self_attn, name).weight)
        for name in ("q_norm", "k_norm"):  # zero-centred (1 + w) in the target, plain w in the drafter
            assert torch.equal(getattr(mine.self_attn, name).weight, 1 + getattr(theirs.self_attn, name).weight)
        for name in ("input_layernorm", "post_attention_layernorm"):
            assert torch.equal(getattr(mine, name).weight, 1 + getattr(theirs, name).weight)
        gate_up = torch.cat([theirs.mlp.gate_proj.weight, theirs.mlp.up_proj.weight])
        assert torch.equal(mine.mlp.gate_up_proj.weight, gate_up)
        assert torch.equal(mine.mlp.down_proj.weight, theirs.mlp.down_proj.weight)


@pytest.mark.parametrize("flags, message", [
    (["--arch", "qwen3_5", "--head-dim", "12"], "--head-dim must be a multiple of 8 with --arch qwen3_5"),
    (["--arch", "qwen3_5", "--linear-key-heads", "3"], "--linear-value-heads 4 must be a multiple of --linear-key-heads 3"),
    (["--arch", "qwen3_5", "--linear-head-dim", "0"], "--linear-head-dim must be > 0"),
    (["--arch", "qwen3_5", "--full-attention-interval", "1"], "--full-attention-interval must be in [2, --layers 4]"),
    (["--arch", "qwen3_5", "--full-attention-interval", "5"], "--full-attention-interval must be in [2, --layers 4]"),
    (["--arch", "qwen3_5", "--conv-kernel", "1"], "--conv-kernel must be >= 2"),
    (["--conv-kernel", "4"], "--conv-kernel applies to --arch qwen3_5 only"),
])
def test_bad_hybrid_flags_are_refused_with_one_line(tmp_path, capsys, flags, message):
    shape = ["--vocab-size", "512", "--hidden-size", "64", "--layers", "4", "--heads", "4", "--kv-heads", "2",
             "--head-dim", "16"]
    if "--arch" in flags:
        shape += ["--linear-key-heads", "2", "--linear-value-heads", "4", "--linear-head-dim", "16"]
    code = run("train-target", "--corpus", tmp_path / "nowhere", "--out", tmp_path / "out", "--checkpoint-dir",
               tmp_path / "ckpt", "--device", "cpu", *shape, *flags)
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "ckpt").exists()


def test_arch_flags_default_to_the_dense_target():
    from ddtree.cli import build_parser

    args = build_parser().parse_args(["train-target", "--out", "x"])
    assert args.arch == "qwen3" and args.linear_key_heads is None and args.full_attention_interval is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train-target", "--out", "x", "--arch", "llama"])

