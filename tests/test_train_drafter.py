"""`ddtree train-drafter`: the many-anchor training forward is the engine's drafter, block for block;
training lowers the loss and resumes exactly; the output loads in the engine and in z-lab's module."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from safetensors.torch import load_file, save_file

from ddtree.models.configs import TargetConfig
from ddtree.models.loading import load_drafter
from ddtree.train.drafter import (FeatureTap, block_visibility, chain_acceptance, dense_attention, flex_attention_fn,
                                  next_batch_size, position_weights, training_forward)
from tiny_models import make_drafter, make_target
from train_helpers import evals, losses, run, write_corpus

B = 8  # block size in these tests
DATA = ["--layers", "2", "--block-size", str(B), "--prompt-len", "16", "--gen-len", "40", "--sequences", "48",
        "--held-out-sequences", "8", "--gen-batch-size", "48", "--anchors", "12", "--held-out-fraction", "0.2"]
LOOP = ["--batch-size", "8", "--steps", "20", "--warmup", "2", "--lr", "3e-3", "--eval-every", "10",
        "--device", "cpu", "--save-dtype", "float32"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny target trained briefly on a corpus (its greedy text is learnable), and one drafter run."""
    tmp = tmp_path_factory.mktemp("train_drafter")
    corpus = write_corpus(tmp / "corpus")
    target = tmp / "target"
    assert run("train-target", "--corpus", corpus, "--out", target, "--checkpoint-dir", tmp / "target-ckpt",
               "--vocab-size", "512", "--hidden-size", "64", "--layers", "4", "--heads", "4", "--kv-heads", "2",
               "--head-dim", "16", "--intermediate-size", "128", "--seq-len", "64", "--batch-size", "16",
               "--steps", "200", "--warmup", "10", "--lr", "5e-3", "--eval-every", "200", "--eval-batches", "1",
               "--held-out-fraction", "0.2", "--device", "cpu", "--save-dtype", "float32") == 0
    assert train(tmp, target, corpus, "out", "ckpt") == 0
    return tmp, target, corpus


def train(tmp, target, corpus, out, ckpt, *extra):
    return run("train-drafter", "--target", target, "--corpus", corpus, "--out", tmp / out, "--checkpoint-dir",
               tmp / ckpt, *DATA, *LOOP, *extra)


@pytest.fixture(scope="module")
def random_drafter(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("random_drafter")
    make_target(tmp / "t", vocab=96, hidden=64, layers=6)
    make_drafter(tmp / "d", tmp / "t", layers=2, block_size=B)
    drafter = load_drafter(tmp / "d", TargetConfig.from_dir(tmp / "t"), "cpu", torch.float32, 128)
    return tmp / "d", drafter


def test_block_mask_and_loss_weights():
    vis = block_visibility(torch.tensor([[2, 0]]), 3, 2)[0].int().tolist()
    assert vis == [[1, 1, 0, 1, 1, 0, 0], [1, 1, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 1, 1]]
    w = position_weights(16, 7.0, "cpu")
    assert w.shape == (15,) and w[0] == 1 and torch.allclose(w, torch.exp(-torch.arange(15.0) / 7))


def test_chain_acceptance_replays_rounds():
    # anchors at positions 0..7: round 1 at 0 accepts 1 + 2, round 2 at 3 accepts 1 + 0, round 3 at 4 accepts
    # 1 + 3; position 8 is past the end.
    leading = torch.tensor([2, 9, 9, 0, 3, 9, 9, 9])
    assert chain_acceptance(leading, torch.ones(8, dtype=torch.bool)) == (3 + 1 + 4, 3)
    # A block running past the eos ends the replay.
    assert chain_acceptance(leading, torch.tensor([True, True, True, True, False, True, True, True])) == (4, 2)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("kernel", ["dense", "flex"])
def test_training_forward_is_the_engine_drafter_block_by_block(random_drafter, kernel):
    _, drafter = random_drafter
    torch.manual_seed(0)
    context, hidden = 40, drafter.config.hidden_size
    features = torch.randn(2, context, len(drafter.config.target_layer_ids) * hidden)
    anchors = torch.tensor([[0, 7, 19, 32], [3, 4, 25, 30]])
    noise = torch.randn(2, 4 * B, hidden)
    attend = (dense_attention(anchors, context, B) if kernel == "dense"
              else flex_attention_fn(anchors, context, B, compiled=False))
    many = training_forward(drafter, features, noise, anchors, attend)
    for row in range(2):
        for j, p in enumerate(anchors[row].tolist()):
            cache = drafter.new_cache(context + B, "cpu", torch.float32)
            if p:
                drafter.append_context(features[row, :p], torch.arange(p), cache)
            one = drafter(noise[row, j * B:(j + 1) * B], drafter.block_metas(torch.tensor(p), B, p + B), cache)
            torch.testing.assert_close(many[row, j * B:(j + 1) * B], one, atol=2e-5, rtol=1e-4)


def test_training_forward_is_zlab_reference_module(random_drafter):
    from dflash.model import DFlashDraftModel

    path, drafter = random_drafter
    reference = DFlashDraftModel.from_pretrained(str(path), dtype=torch.float32).eval()
    torch.manual_seed(1)
    context, hidden = 30, drafter.config.hidden_size
    features = torch.randn(1, context, len(drafter.config.target_layer_ids) * hidden)
    noise = torch.randn(1, 3 * B, hidden)
    anchors = torch.tensor([[5, 12, 22]])
    with torch.no_grad():
        ours = training_forward(drafter, features, noise, anchors, dense_attention(anchors, context, B))
        for j, p in enumerate(anchors[0].tolist()):
            theirs = reference(position_ids=torch.arange(p + B)[None], noise_embedding=noise[:, j * B:(j + 1) * B],
                               target_hidden=features[:, :p])
            torch.testing.assert_close(ours[0, j * B:(j + 1) * B], theirs[0], atol=2e-5, rtol=1e-4)


def test_loss_decreases_and_output_is_zlab_format(setup):
    tmp, target, _ = setup
    curve = losses(tmp / "ckpt")
    assert sorted(curve) == list(range(1, 21))
    assert sum(curve[s] for s in (17, 18, 19, 20)) < sum(curve[s] for s in (1, 2, 3, 4)) - 4 * 0.5
    held_out = evals(tmp / "ckpt")
    assert [e["step"] for e in held_out] == [10, 20] and held_out[1]["held_out_loss"] < held_out[0]["held_out_loss"]
    assert all(1.0 <= e["held_out_acceptance"] <= B for e in held_out)
    out = tmp / "out"
    cfg = json.loads((out / "config.json").read_text())
    tcfg = json.loads((target / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == B
    assert cfg["num_target_layers"] == tcfg["num_hidden_layers"] == 4
    assert cfg["dflash_config"] == {"target_layer_ids": [1, 1], "mask_token_id": 1}
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    per_layer = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
                 "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
                 "post_attention_layernorm"]
    expected = {f"layers.{i}.{n}.weight" for i in range(2) for n in per_layer}
    assert names == expected | {"fc.weight", "hidden_norm.weight", "norm.weight"}


def test_output_loads_in_the_engine_and_in_zlab_reference(setup):
    from dflash.model import DFlashDraftModel

    from ddtree.config import SamplingParams
    from ddtree.llm import LLM

    tmp, target, _ = setup
    model, info = DFlashDraftModel.from_pretrained(str(tmp / "out"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.block_size == B and model.mask_token_id == 1 and model.target_layer_ids == [1, 1]
    llm = LLM(target, tmp / "out", device="cpu")
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outputs = {b: llm.generate("def parse(text):", params, tree_budget=b) for b in ("ar", "chain", 4)}
    assert outputs["chain"].token_ids == outputs[4].token_ids == outputs["ar"].token_ids
    assert outputs["chain"].stats.decode_rounds > 0


def test_engine_chain_acceptance_equals_the_training_forward(setup):
    """Decode with the engine's chain; then score the same sequence with the training forward at anchors
    where the engine's rounds began: each round's acceptance is the block's leading correct drafts + 1."""
    from transformers import AutoModelForCausalLM

    from ddtree.config import SamplingParams
    from ddtree.llm import LLM
    from ddtree.models.configs import DrafterConfig
    from ddtree.models.drafter import DFlashDrafter
    from ddtree.models.loading import drafter_state_dict, read_safetensors

    tmp, target, _ = setup
    # A noisy copy of the trained drafter: right for a few tokens, then wrong, so rounds vary in length.
    draft = tmp / "noisy-drafter"
    shutil.copytree(tmp / "out", draft, dirs_exist_ok=True)
    weights = load_file(str(draft / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    save_file({k: v + 2.0 * v.std() * torch.randn(v.shape, generator=g) if v.dim() == 2 else v
               for k, v in weights.items()}, str(draft / "model.safetensors"))
    cfg = DrafterConfig.from_dir(draft)
    drafter = DFlashDrafter(cfg, 256)
    drafter.load_state_dict(drafter_state_dict(read_safetensors(draft, "drafter"), cfg), strict=False)
    hf = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    tap = FeatureTap(hf, cfg.target_layer_ids)
    llm = LLM(target, draft, device="cpu")
    seen = []
    for text in ("class Reader:\n    def read(self, size=-1):\n", "def f(x):\n    return"):
        prompt = llm.encode(text)
        result = llm.generate(prompt, SamplingParams(max_tokens=48, ignore_eos=True), tree_budget="chain")
        rounds = result.stats.acceptance_lengths
        tokens = torch.tensor([prompt + result.token_ids])
        anchors, p = [], len(prompt)
        for a in rounds:
            if p + B <= tokens.shape[1]:
                anchors.append(p)
            p += a
        anchors_t = torch.tensor([anchors])
        block = torch.full((1, len(anchors), B), cfg.mask_token_id)
        block[0, :, 0] = tokens[0, anchors_t[0]]
        with torch.no_grad():
            noise = hf.get_input_embeddings()(block.flatten(1))
            hidden = training_forward(drafter, tap(tokens), noise, anchors_t,
                                      dense_attention(anchors_t, tokens.shape[1], B))
            drafts = drafter.logits(hidden.view(len(anchors), B, -1)[:, 1:], hf.get_output_embeddings()).argmax(-1)
        labels = tokens[0, anchors_t[0][:, None] + torch.arange(1, B)]
        predicted = ((drafts == labels).int().cumprod(-1).sum(-1) + 1).tolist()
        assert predicted == rounds[: len(anchors)]
        seen += predicted
    assert len(seen) >= 8 and any(1 < a < B for a in seen), seen


def test_resume_replays_the_uninterrupted_run(setup):
    tmp, target, corpus = setup
    assert train(tmp, target, corpus, "out2", "ckpt2", "--max-steps", "7") == 0
    assert json.loads((tmp / "out2" / "training.json").read_text())["stopped_by"] == "max_steps"
    assert train(tmp, target, corpus, "out2", "ckpt2", "--resume") == 0
    resumed, straight = losses(tmp / "ckpt2"), losses(tmp / "ckpt")
    assert sorted(resumed) == sorted(straight)
    for step in straight:
        assert resumed[step] == pytest.approx(straight[step], rel=1e-5, abs=1e-6), step


def test_bad_input_is_refused_and_writes_nothing(setup, tmp_path, capsys):
    tmp, target, corpus = setup
    assert train(tmp_path, target, corpus, "out", "ckpt", "--anchors", "40") == 2
    assert "--anchors 40 exceeds" in capsys.readouterr().err
    assert train(tmp_path, tmp_path / "nowhere", corpus, "out", "ckpt") == 2
    assert "not a directory" in capsys.readouterr().err
    assert train(tmp_path, target, corpus, "out", "ckpt", "--mask-token-id", "4096") == 2
    assert "mask" in capsys.readouterr().err
    assert train(tmp_path, target, corpus, "out", "ckpt", "--block-size", "1") == 2
    assert "--block-size" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "ckpt").exists()


def test_time_limit_also_bounds_the_data_generation(setup):
    """Past its share of --time-limit no generation batch starts (the held-out set and one training
    batch always run); the run still trains for what is left, evaluates and writes its outputs."""
    tmp, target, corpus = setup
    assert train(tmp, target, corpus, "limited", "limited-ckpt", "--sequences", "96", "--gen-batch-size", "16",
                 "--time-limit", "0.001") == 0
    summary = json.loads((tmp / "limited" / "training.json").read_text())
    assert summary["distill_sequences"] == 8, "one training batch (--batch-size 8), no more"
    assert summary["stopped_by"] == "time_limit" and summary["steps"] == 0
    assert (tmp / "limited" / "model.safetensors").is_file() and summary["held_out_loss"] > 0
    assert summary["held_out_sequences_evaluated"] == 8  # one chunk of rows, which here holds them all


def test_generation_batches_end_near_the_deadline():
    # No deadline: full batches. With one: a first batch of min_count to measure the pace, then what fits.
    assert next_batch_size(256, 0, 32, None, None) == 256
    assert next_batch_size(256, 0, 32, None, 100.0) == 32
    assert next_batch_size(256, 32, 32, 0.5, 40.0) == 80
    assert next_batch_size(256, 32, 32, 0.01, 40.0) == 256
    assert next_batch_size(256, 32, 32, 0.5, 0.0) == 0
    assert next_batch_size(256, 10, 32, 0.5, 0.0) == 22, "the first training batch completes even late"
