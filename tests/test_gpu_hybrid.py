"""On a CUDA GPU: a hybrid target (Gated DeltaNet + gated attention) through the graph path.

- float32, graphs on: greedy output equals transformers' `Qwen3_5ForCausalLM` (float64 oracle) at
  ar, chain and several budgets;
- graph replay equals the eager path's tokens (float32: plain eager; bf16: the same kernels,
  buckets and padded prefill), greedy and sampled.

Skipped where no GPU is present (the CPU suite runs the same model eagerly)."""
from __future__ import annotations

import pytest
import torch

from ddtree.config import SamplingParams
from ddtree.llm import LLM
from tiny_models import make_drafter, make_hybrid_target

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BUDGETS = ["ar", "chain", 4, 16, 64]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-hybrid")
    hf = make_hybrid_target(root / "t", vocab=512, hidden=128, layers=8, heads=4, kv_heads=2, head_dim=64,
                            linear_key_heads=2, linear_value_heads=4, linear_head_dim=32, max_positions=2048,
                            peak=10.0)
    make_drafter(root / "d", root / "t", block_size=16)
    hf.generation_config.eos_token_id = None
    return hf.double().cuda(), root / "t", root / "d"


def test_graphs_greedy_equals_transformers(pair):
    hf, target, draft = pair
    llm = LLM(target, draft, device="cuda", dtype="float32", use_graphs=True, max_model_len=1024)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        prompt = torch.randint(0, 500, (int(torch.randint(5, 60, (1,), generator=gen)),), generator=gen).tolist()
        ids = torch.tensor([prompt], device="cuda")
        with torch.no_grad():
            expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                                   pad_token_id=0)[0, len(prompt):].tolist()
        for budget in BUDGETS:
            out = llm.generate(prompt, SamplingParams(max_tokens=32, ignore_eos=True), budget)
            assert out.token_ids == expected, (budget, prompt[:8])
    assert llm.engine.front_graphs and llm.engine.prefill_graphs


def test_long_prompt_prefill_greedy_equals_transformers(pair):
    """Prompts past the PyTorch token loop's 64 tokens (a padded prefill graph of 384 tokens, and
    an eager chunked prefill of 1100 tokens in chunks of 512): the recurrence runs the token-loop
    kernel over the whole prompt, and greedy output still equals transformers'."""
    hf, target, draft = pair
    llm = LLM(target, draft, device="cuda", dtype="float32", use_graphs=True, max_model_len=2048)
    llm.engine.prefill_chunk = 512
    gen = torch.Generator().manual_seed(3)
    for length in (300, 1100):
        prompt = torch.randint(0, 500, (length,), generator=gen).tolist()
        ids = torch.tensor([prompt], device="cuda")
        with torch.no_grad():
            expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                                   pad_token_id=0)[0, length:].tolist()
        for budget in ("ar", 16):
            assert llm.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True), budget).token_ids == expected, \
                (length, budget)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def graphs_and_eager(pair, request):
    """(dtype, an LLM with graphs, one without) over the same checkpoint, shared by the budgets' tests
    (each budget its own test, so that a run with a time limit reports the ones it finished)."""
    dtype = request.param
    _, target, draft = pair
    graphs = LLM(target, draft, device="cuda", dtype=dtype, use_graphs=True, max_model_len=1024)
    same_kernels = dict(compile_layers=True, kv_bucket=graphs.engine.kv_bucket, padded_prefill=True) \
        if dtype == "bfloat16" else {}
    eager = LLM(target, draft, device="cuda", dtype=dtype, use_graphs=False, max_model_len=1024, **same_kernels)
    return dtype, graphs, eager


@pytest.mark.parametrize("budget", BUDGETS, ids=str)
def test_graphs_equal_eager(graphs_and_eager, budget):
    dtype, graphs, eager = graphs_and_eager
    prompt = list(range(10, 90))
    for params in (SamplingParams(max_tokens=64, ignore_eos=True),
                   SamplingParams(max_tokens=48, temperature=1.0, seed=7, ignore_eos=True)):
        a, b = graphs.generate(prompt, params, budget), eager.generate(prompt, params, budget)
        assert a.token_ids == b.token_ids, (dtype, budget, params.temperature)
        assert a.stats.acceptance_lengths == b.stats.acceptance_lengths


def test_conv_kernel_path_greedy_equals_transformers(pair, monkeypatch):
    """The verify's other kernel path (DDTREE_FUSED_GDN_INPUTS=0: `kernels.tree_conv`, then the
    compiled glue, as for head dims the fused inputs kernel does not take) through the graph path:
    greedy output equals transformers' in float32 at every budget."""
    from ddtree.models import hybrid

    monkeypatch.setattr(hybrid, "FUSED_INPUTS", False)
    hf, target, draft = pair
    llm = LLM(target, draft, device="cuda", dtype="float32", use_graphs=True, max_model_len=1024)
    prompt = list(range(20, 61))
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                               pad_token_id=0)[0, len(prompt):].tolist()
    for budget in BUDGETS:
        assert llm.generate(prompt, SamplingParams(max_tokens=32, ignore_eos=True), budget).token_ids == expected, budget
