"""Training on a hybrid target (`train-target --arch qwen3_5`): scripts/train_hybrid_demo.sh end to
end at smoke size on CPU, then its outputs checked one by one:

- the target is transformers' `Qwen3_5ForCausalLM`, its config.json records the whole shape, and
  ddtree's engine computes transformers' logits and greedy output (float64 oracle) at every budget;
- the drafter is a plain DFlash drafter of the target's width, vocabulary and layer count (whole-head
  rotary), loadable by the engine and by z-lab's module; the acceptance report and model cards;
- the features the trainer reads through transformers are the engine's, in both checkpoint layouts;
- `--init-from-target` starts drafter layers from the hybrid's full-attention layers, norms converted;
- bad hybrid flags are refused with one line, before anything is written.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddtree.config import DDTreeError
import torch

from train_helpers import run, write_corpus

pytest.importorskip("transformers.models.qwen3_5")

REPO = Path(__file__).resolve().parent.parent
PROMPTS = ["def parse(text):\n", "class Reader:\n    def read(self, size=-1):\n", "import os\n\n"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """The hybrid demo recipe at smoke size on a tiny corpus -> its output folder."""
    tmp = tmp_path_factory.mktemp("hybrid_demo")
    corpus = write_corpus(tmp / "corpus")
    env = {**os.environ, "DDTREE_DEMO_SMOKE": "1", "CORPUS": str(corpus), "HELD_OUT": "0.2",
           "ROOT": str(tmp / "run"), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["bash", str(REPO / "scripts" / "train_hybrid_demo.sh")], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp / "run"


def test_demo_script_measures_acceptance_and_writes_the_cards(smoke):
    report = json.loads((smoke / "hybrid-acceptance.json").read_text())
    assert report["lossless"] and set(report["results"]) == {"ar", "chain", "64"}
    assert report["results"]["ar"]["mean_acceptance_length"] == 1.0
    assert report["results"]["chain"]["rounds"] > 0 and len(report["samples"]) == 2
    target_card = (smoke / "hybrid-target" / "README.md").read_text()
    drafter_card = (smoke / "hybrid-drafter" / "README.md").read_text()
    assert "Qwen3.5-architecture hybrid" in target_card
    assert "4 layers (3 Gated DeltaNet, 1 gated full attention)" in target_card
    assert "--arch qwen3_5" in target_card and "Qwen3-architecture" not in target_card
    for card in (target_card, drafter_card):
        assert "DDTREE_DEMO_SMOKE='1' scripts/train_hybrid_demo.sh" in card and "n/a" not in card
        assert f"{report['results']['chain']['mean_acceptance_length']:.2f}" in card


def test_target_is_a_qwen3_5_checkpoint_with_its_whole_shape(smoke):
    from transformers import AutoModelForCausalLM

    from ddtree.models.configs import TargetConfig

    target = smoke / "hybrid-target"
    cfg = json.loads((target / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5ForCausalLM"] and cfg["model_type"] == "qwen3_5_text"
    assert cfg["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert (cfg["linear_num_key_heads"], cfg["linear_num_value_heads"], cfg["linear_key_head_dim"],
            cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"]) == (2, 4, 16, 16, 4)
    assert cfg["head_dim"] == 16 and cfg["rope_parameters"]["partial_rotary_factor"] == 0.25
    summary = json.loads((target / "training.json").read_text())
    assert summary["arch"] == "qwen3_5" and summary["steps"] == 20
    model = AutoModelForCausalLM.from_pretrained(str(target))
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    ours = TargetConfig.from_dir(target)
    assert ours.hybrid and ours.attention_layers == [3] and ours.rope.partial_rotary_factor == 0.25
    assert ours.gdn.num_value_heads == 4 and ours.gdn.conv_kernel == 4


@torch.no_grad()
def test_engine_decodes_the_trained_pair_as_transformers_does(smoke):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ddtree import LLM, SamplingParams
    from ddtree.models.layers import AttentionMeta
    from ddtree.models.loading import load_target

    target, drafter = smoke / "hybrid-target", smoke / "hybrid-drafter"
    # float64 oracle: transformers' own float32 chunked form is further from exact than ddtree's.
    hf = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float64).eval()
    tok = AutoTokenizer.from_pretrained(str(target))
    text = "".join(PROMPTS) + "    return [line.split() for line in text.splitlines()]\n"
    ids = torch.tensor(tok.encode(text, add_special_tokens=False))
    ours = load_target(target, "cpu", torch.float32, 512)
    cache = ours.new_cache(512, "cpu", torch.float32)
    logits, _ = ours(ids, torch.arange(len(ids)), AttentionMeta(torch.arange(len(ids)), len(ids), None, causal=True),
                     cache)
    torch.testing.assert_close(logits.double(), hf(ids[None]).logits[0], atol=2e-4, rtol=1e-4)

    llm = LLM(target, drafter, device="cpu", dtype="float32")
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for prompt in PROMPTS:
        prompt_ids = tok.encode(prompt, add_special_tokens=False)
        reference = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(prompt_ids):].tolist()
        for budget in ("ar", "chain", 8, 64):
            assert llm.generate(prompt_ids, params, tree_budget=budget).token_ids == reference, (prompt, budget)


def test_drafter_is_a_plain_dflash_drafter_of_the_target(smoke):
    from dflash.model import DFlashDraftModel

    from ddtree.models.configs import DrafterConfig, TargetConfig, build_target_layer_ids

    target, drafter = smoke / "hybrid-target", smoke / "hybrid-drafter"
    tcfg = json.loads((target / "config.json").read_text())
    cfg = json.loads((drafter / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert (cfg["hidden_size"], cfg["vocab_size"], cfg["num_target_layers"]) == (64, 1024, 4) == (
        tcfg["hidden_size"], tcfg["vocab_size"], tcfg["num_hidden_layers"])
    assert cfg["dflash_config"]["target_layer_ids"] == build_target_layer_ids(4, 2)
    assert cfg["layer_types"] == ["full_attention"] * 2 and "rope_parameters" not in cfg
    ours = DrafterConfig.from_dir(drafter)
    assert ours.rope.partial_rotary_factor == 1.0 and ours.head_dim == tcfg["head_dim"]
    ours.check_against(TargetConfig.from_dir(target), drafter)
    model, info = DFlashDraftModel.from_pretrained(str(drafter), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    summary = json.loads((drafter / "training.json").read_text())
    assert summary["steps"] == 20 and 1.0 <= summary["held_out_acceptance"] <= 16


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
    with pytest.raises(DDTreeError, match="--arch"):  # the CLI's parser reports bad values as one-line errors
        build_parser().parse_args(["train-target", "--out", "x", "--arch", "llama"])
