"""On a CUDA GPU: a YaRN-scaled dense target decodes past its pretrained positions through the
graph path (the fused q/k rotation and cache write reads the scaled table) token for token as
transformers' greedy decoding does (float64 oracle), at ar, chain and tree budgets.

Skipped where no GPU is present (tests/test_greedy_parity.py runs the same check on the CPU)."""
from __future__ import annotations

import pytest
import torch

from ddtree.config import SamplingParams
from ddtree.llm import LLM
from tiny_models import make_drafter, make_target

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BUDGETS = ["ar", "chain", 15, 63]
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}


def test_yarn_target_past_its_positions_greedy_equals_transformers(tmp_path):
    hf = make_target(tmp_path / "t", "qwen3", vocab=512, hidden=128, layers=4, heads=4, kv_heads=2, head_dim=32,
                     max_positions=256, rope_scaling=YARN, peak=10.0)
    make_drafter(tmp_path / "d", tmp_path / "t", block_size=16)
    hf.generation_config.eos_token_id = None
    hf = hf.double().cuda()
    llm = LLM(tmp_path / "t", tmp_path / "d", device="cuda", dtype="float32", use_graphs=True)
    assert llm.target.config.context_limit == 1024
    gen = torch.Generator().manual_seed(3)
    checked = 0
    for length in (300, 520, 700):
        prompt = torch.randint(0, 500, (length,), generator=gen).tolist()
        ids = torch.tensor([prompt], device="cuda")
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                              pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        if any(float(s[0].topk(2).values.diff().abs()) < 1e-6 for s in out.scores):
            continue  # a near tie: float32 rounding, not the engine, could decide it
        expected = out.sequences[0, length:].tolist()
        checked += 1
        for budget in BUDGETS:
            got = llm.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True), budget).token_ids
            assert got == expected, (length, budget)
    assert checked >= 2
