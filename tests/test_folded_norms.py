"""`TargetModel.fold_norms`: a dense target whose norms' weights are folded into its q/k/v and
gate/up weights (the norms' row scales applied by `qk_rope_write` and `swiglu`, the residuals added
by the projections in place) computes what the same model computes unfolded: a prefill, then a
tree step over the cache, logits and the drafter's features. On the CPU through Triton's
interpreter (float32); on a GPU the engines fold by default, so `test_gpu_graphs.py` also runs the
folded layers in bf16 through graphs."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # without a GPU, conftest has put Triton in interpreter mode
pytest.importorskip("transformers")
from ddtree.models.layers import AttentionMeta  # noqa: E402
from ddtree.models.loading import load_target  # noqa: E402
from tiny_models import make_target  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _with_random_norms(model):
    """The norms' weights made unlike ones (a fresh model's are ones, which folding leaves alone)."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.copy_(1.0 + 0.5 * torch.randn(norm.weight.shape, generator=gen))
    return model


def _forward_twice(model, tokens, feature_layers):
    cache = model.new_cache(128, DEVICE, torch.float32)
    slots = torch.arange(24, device=DEVICE)
    visible = torch.ones(5, 5, dtype=torch.bool).tril()
    visible[3, 1:3] = False  # a branch: node 3 sees the root only
    with torch.no_grad():
        first = model(tokens[:19], slots[:19], AttentionMeta(slots[:19], 19, None, causal=True), cache,
                      feature_layers=feature_layers)
        step = AttentionMeta(slots[19:], 24, prefix_len=torch.tensor(19, device=DEVICE), block_mask=visible.to(DEVICE))
        second = model(tokens[19:], torch.tensor([19, 20, 21, 20, 21], device=DEVICE), step, cache,
                       feature_layers=feature_layers)
    return [*first, *second]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])  # with and without q/k norms
def test_folded_model_equals_unfolded(arch, tmp_path):
    make_target(tmp_path, arch)
    plain = _with_random_norms(load_target(tmp_path, DEVICE, torch.float32, 128))
    folded = _with_random_norms(load_target(tmp_path, DEVICE, torch.float32, 128))
    folded.fold_norms()
    folded.fold_norms()  # a second call changes nothing
    assert folded.folded and not plain.folded
    tokens = torch.randint(0, plain.config.vocab_size, (24,), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    feature_layers = [0, 2, 3]  # the last layer's output among them, as drafters tap it
    for ours, ref in zip(_forward_twice(folded, tokens, feature_layers), _forward_twice(plain, tokens, feature_layers)):
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def test_fold_unless_switched_off(tmp_path, monkeypatch):
    """The engine folds where the model allows it (a GPU) unless DDTREE_FOLDED_NORMS=0; a model with
    biases never does."""
    from ddtree.engine import Engine
    from ddtree.models import target as target_module

    make_target(tmp_path)
    model = load_target(tmp_path, DEVICE, torch.float32, 128)
    weight = model.layers[0].self_attn.qkv_proj.weight.clone()
    monkeypatch.setattr(target_module, "FOLDED_NORMS", False)
    Engine(model, None, max_model_len=64, use_graphs=False)
    assert not model.folded and torch.equal(model.layers[0].self_attn.qkv_proj.weight, weight)
    monkeypatch.setattr(target_module, "FOLDED_NORMS", True)
    Engine(model, None, max_model_len=64, use_graphs=False)
    assert model.folded == (DEVICE == "cuda")
    assert model.can_fold_norms() == (DEVICE == "cuda")
    monkeypatch.setattr(model.config, "attention_bias", True)
    assert not model.can_fold_norms()
