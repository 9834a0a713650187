"""Our DFlash drafter against z-lab's reference module (`dflash.model.DFlashDraftModel`).

Both read the same random checkpoint written in the z-lab format. The reference gets the target's
features from transformers (`output_hidden_states` + `dflash.model.extract_context_feature`) and
its own cache, driven the way `dflash.model.dflash_generate` drives it; ours gets them from our
target. Block positions are the same; hidden outputs and logits must agree.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ddtree import LLM, SamplingParams
from ddtree.engine import Engine
from ddtree.models.configs import TargetConfig
from ddtree.models.layers import AttentionMeta
from ddtree.models.loading import load_drafter, load_target
from tiny_models import make_drafter, make_target, reference_draft_logprobs

dflash_model = pytest.importorskip("dflash.model")
transformers = pytest.importorskip("transformers")

MAX_POS = 256
REL_TOL = 1e-4


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


CASES = {
    # name: (target kwargs, drafter kwargs, dflash_config extras)
    "full-gqa": (dict(layers=6, kv_heads=2), dict(layers=2, block_size=8), {}),
    "sliding-window-3": (
        dict(layers=6, kv_heads=2),
        dict(layers=2, block_size=8, layer_types=["full_attention", "sliding_attention"], sliding_window=3),
        {},
    ),
    "three-layers-mha-all-sliding": (
        dict(layers=8, heads=4, kv_heads=4),
        dict(layers=3, block_size=6, layer_types=["sliding_attention"] * 3, sliding_window=4),
        {},
    ),
    "logit-multiplier-softcap": (
        dict(layers=6, kv_heads=1),
        dict(layers=2, block_size=8),
        {"output_multiplier": 0.5, "final_logit_softcapping": 3.0},
    ),
}


class Pair:
    """A random target + drafter on disk, loaded both ways."""

    def __init__(self, root: Path, target_kw: dict, draft_kw: dict, extras: dict):
        self.target_dir, self.draft_dir = root / "target", root / "drafter"
        make_target(self.target_dir, "qwen3", **target_kw)
        make_drafter(self.draft_dir, self.target_dir, **draft_kw)
        if extras:
            cfg = json.loads((self.draft_dir / "config.json").read_text())
            cfg["dflash_config"].update(extras)
            (self.draft_dir / "config.json").write_text(json.dumps(cfg))
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(self.target_dir, dtype=torch.float32).eval()
        self.ref = dflash_model.DFlashDraftModel.from_pretrained(str(self.draft_dir), dtype=torch.float32).eval()
        tcfg = TargetConfig.from_dir(self.target_dir)
        self.target = load_target(self.target_dir, "cpu", torch.float32, MAX_POS)
        self.drafter = load_drafter(self.draft_dir, tcfg, "cpu", torch.float32, MAX_POS)
        self.block = self.drafter.config.block_size
        assert self.block == self.ref.block_size
        assert self.drafter.config.target_layer_ids == list(self.ref.target_layer_ids)
        assert self.drafter.config.mask_token_id == self.ref.mask_token_id

    @torch.no_grad()
    def reference_features(self, seq: torch.Tensor) -> torch.Tensor:
        """[len(seq), taps * H] from transformers' hidden states."""
        out = self.hf(seq[None], output_hidden_states=True)
        return dflash_model.extract_context_feature(out.hidden_states, self.ref.target_layer_ids)[0]

    @torch.no_grad()
    def our_features(self, seq: torch.Tensor) -> torch.Tensor:
        n = seq.shape[0]
        cache = self.target.new_cache(n, "cpu", torch.float32)
        pos = torch.arange(n)
        _, feats = self.target(seq, pos, AttentionMeta(pos, n, None, causal=True), cache,
                               self.drafter.config.target_layer_ids)
        return feats

    def block_tokens(self, bonus: int) -> torch.Tensor:
        block = torch.full((self.block,), self.drafter.config.mask_token_id, dtype=torch.long)
        block[0] = bonus
        return block


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory) -> Pair:
    target_kw, draft_kw, extras = CASES[request.param]
    return Pair(tmp_path_factory.mktemp(request.param), target_kw, draft_kw, extras)


@torch.no_grad()
@pytest.mark.parametrize("fused", [False, True])
def test_drafter_equals_reference_over_two_rounds(pair: Pair, fused: bool):
    """Round 1: context = a 13-token prompt. Round 2: 5 more committed tokens appended to the
    context (the cached keys of round 1 are reused on both sides). `fused`: the engine's layout
    (`fuse_projections`: one q/k/v matmul per layer, one context k/v matmul for all layers)."""
    drafter = pair.drafter
    if fused:
        drafter = load_drafter(pair.draft_dir, TargetConfig.from_dir(pair.target_dir), "cpu", torch.float32, MAX_POS)
        drafter.fuse_projections()
        assert drafter.context_kv is not None and drafter.layers[0].self_attn.qkv_weight is not None
    gen = torch.Generator().manual_seed(0)
    p, a = 13, 5
    seq = torch.randint(0, pair.drafter.config.vocab_size - 1, (p + a + 1,), generator=gen)

    ref_feats = pair.reference_features(seq[: p + a])
    our_feats = pair.our_features(seq[: p + a])
    assert rel_err(our_feats, ref_feats) < REL_TOL

    ref, b = pair.ref, pair.block
    ref_cache = dflash_model._make_cache(ref.config)
    our_cache = drafter.new_cache(MAX_POS, "cpu", torch.float32)
    our_cache.k.normal_(generator=gen)  # stale garbage must never be read
    our_cache.v.normal_(generator=gen)

    for ctx_from, n, pad in ((0, p, 3), (p, p + a, 0)):
        block = pair.block_tokens(int(seq[n]))
        noise = pair.hf.get_input_embeddings()(block)
        ref_hidden = ref(target_hidden=ref_feats[None, ctx_from:n], noise_embedding=noise[None],
                         position_ids=torch.arange(ctx_from, n + b)[None], past_key_values=ref_cache, use_cache=True)[0]
        dflash_model._crop_to(ref_cache, n)
        ref_logits = ref.compute_logits(ref_hidden, pair.hf.lm_head)

        drafter.append_context(our_feats[ctx_from:n], torch.arange(ctx_from, n), our_cache)
        # `pad` extra key columns past the block: the engine reads a padded length when a tree is
        # larger than the block; those columns must be invisible.
        metas = drafter.block_metas(torch.tensor(n), b, n + b + pad)
        hidden = drafter(pair.target.embed_tokens(block), metas, our_cache)
        logits = drafter.logits(hidden, pair.target.lm_head)

        assert rel_err(hidden, ref_hidden) < REL_TOL, f"hidden, context length {n}"
        assert rel_err(logits, ref_logits) < REL_TOL, f"logits, context length {n}"


@torch.no_grad()
def test_engine_drafts_equal_reference_during_generation(pair: Pair, monkeypatch):
    """Every draft the engine makes while generating (budget 'chain' and 16) equals the reference
    drafter run from scratch on the committed sequence: the drafter's context commit is right."""
    llm = LLM(pair.target_dir, pair.draft_dir, device="cpu", dtype="float32", max_model_len=128)
    real = Engine._draft_logits
    seen: list[tuple[int, int, torch.Tensor]] = []

    def recording(self, root, n, *rest):
        logits = real(self, root, n, *rest)
        seen.append((int(root), int(n), torch.log_softmax(logits, dim=-1)))
        return logits

    monkeypatch.setattr(Engine, "_draft_logits", recording)
    prompt = [5, 9, 2, 33, 7, 41, 8]
    for budget in ("chain", 16):
        seen.clear()
        result = llm.generate(prompt, SamplingParams(max_tokens=20, ignore_eos=True), budget)
        seq = prompt + result.token_ids
        assert len(seen) == result.stats.decode_rounds >= 2
        for root, n, logp in seen:
            assert root == seq[n], "the round's root is the committed sequence's next token"
            ref_logp = reference_draft_logprobs(pair.hf, pair.ref, seq, n)
            assert (logp - ref_logp).abs().max() < 1e-4, f"budget {budget}, round at n={n}"


@torch.no_grad()
def test_engine_block_embedding_with_an_input_scale(tmp_path, monkeypatch):
    """The engine keeps the block's mask-token rows from __init__ and writes only the root's row
    each round: with an `input_embedding_scale`, the drafter's input still equals
    embed([root, mask, ..., mask]) x scale, as the drafter's config defines it."""
    target_dir, draft_dir = tmp_path / "target", tmp_path / "drafter"
    make_target(target_dir, "qwen3", layers=4)
    make_drafter(draft_dir, target_dir, layers=1, block_size=6)
    cfg = json.loads((draft_dir / "config.json").read_text())
    cfg["dflash_config"]["input_embedding_scale"] = 2.5
    (draft_dir / "config.json").write_text(json.dumps(cfg))
    llm = LLM(target_dir, draft_dir, device="cpu", dtype="float32", max_model_len=64)
    engine = llm.engine
    assert engine.drafter.config.input_embedding_scale == 2.5
    seen = []
    real_forward = type(engine.drafter).forward

    def recording(self, noise, metas, cache):
        seen.append(noise.clone())
        return real_forward(self, noise, metas, cache)

    monkeypatch.setattr(type(engine.drafter), "forward", recording)
    mask = engine.drafter.config.mask_token_id
    for root in (3, 17, mask):
        engine._draft_logits(torch.tensor(root), torch.tensor(0), 16)
        block = torch.tensor([root] + [mask] * 5)
        assert torch.equal(seen[-1], engine.target.embed_tokens(block) * 2.5)
