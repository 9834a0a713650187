"""On a CUDA GPU: CUDA-graph replay gives exactly the eager path's tokens, at every budget.

Skipped where no GPU is present (the CPU suite checks the same tensor functions eagerly)."""
from __future__ import annotations

import pytest
import torch

from ddtree.config import SamplingParams
from ddtree.llm import LLM
from tiny_models import make_drafter, make_target

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BUDGETS = ["ar", "chain", 1, 4, 16, 64, 256]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu")
    make_target(root / "t", "qwen3", vocab=512, hidden=128, layers=4, max_positions=2048, peak=10.0)
    make_drafter(root / "d", root / "t", block_size=16)
    return root / "t", root / "d"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphs_equal_eager(pair, dtype):
    target, draft = pair
    graphs = LLM(target, draft, device="cuda", dtype=dtype, use_graphs=True, max_model_len=1024)
    # float32: against the plain eager path (other kernels, exact KV and prompt lengths); bf16 rounds
    # differently in fused kernels, so there the eager run uses the same kernels, KV buckets and
    # padded prefill lengths.
    same_kernels = dict(compile_layers=True, kv_bucket=graphs.engine.kv_bucket, padded_prefill=True) if dtype == "bfloat16" else {}
    eager = LLM(target, draft, device="cuda", dtype=dtype, use_graphs=False, max_model_len=1024, **same_kernels)
    assert graphs.engine.use_graphs and not eager.engine.use_graphs
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        prompt = torch.randint(0, 500, (int(torch.randint(5, 200, (1,), generator=gen)),), generator=gen).tolist()
        params = SamplingParams(max_tokens=120, ignore_eos=True)
        for budget in BUDGETS:
            a = graphs.generate(prompt, params, budget)
            b = eager.generate(prompt, params, budget)
            assert a.token_ids == b.token_ids, (budget, prompt[:8])
            assert a.stats.acceptance_lengths == b.stats.acceptance_lengths
    assert graphs.engine.front_graphs, "no front graph was captured"
    assert graphs.engine.prefill_graphs, "no prefill graph was captured"


def test_graphs_sampling_matches_eager(pair):
    """Same seed, same budget: graph replay and eager draw the same tokens (T = 1)."""
    target, draft = pair
    graphs = LLM(target, draft, device="cuda", dtype="float32", use_graphs=True, max_model_len=1024)
    eager = LLM(target, draft, device="cuda", dtype="float32", use_graphs=False, max_model_len=1024)
    params = SamplingParams(max_tokens=64, temperature=1.0, seed=123, ignore_eos=True)
    for budget in ["ar", "chain", 16]:
        assert graphs.generate(list(range(10, 40)), params, budget).token_ids == \
            eager.generate(list(range(10, 40)), params, budget).token_ids
