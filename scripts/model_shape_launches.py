"""The verify's Triton launches at real model shapes, for `check_kernels_compile.py` to compile and
report (registers, spills, shared memory, programs an SM) without a GPU:

    python scripts/check_kernels_compile.py --record-only scripts/model_shape_launches.py

Not tests: with --record-only the launches are recorded, not run (the interpreter would take
minutes at these sizes), so nothing here checks a result; `tests/` does that at small shapes.
The shapes: Qwen3.6-27B's Gated DeltaNet heads (Hk 16, Hv 48, D 128) and attention heads (24 / 4 /
256), Qwen3-8B's attention heads (32 / 8 / 128); trees of 17, 65 and 257 nodes; 8192 cached keys
(the attention's tiling changes from 4096 on), split for an H200's 132 SMs; and the tree build
(`tree_build.TreeBuildPlan`) at Qwen3's vocabulary and 15 depths for every budget `--tree-budget
auto` may measure that its kernels serve (15 to 255; larger trees are built with PyTorch), whose
compile seconds are most of a large tree's first capture.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ddtree.kernels import attention_libraries, attention_plan, gdn_tree, tree_attention, tree_build
from ddtree.tree import build_tree

CONTEXT = 8192
SMS = 132  # an H200's (and H100 SXM's): the attention's key splits follow it


@pytest.fixture(autouse=True)
def _gpu_sm_count(monkeypatch):
    monkeypatch.setattr(tree_attention, "sm_count", lambda device: SMS)
    monkeypatch.setattr(attention_libraries, "sm_count", lambda device: SMS)


def _tree(n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(n)
    logp = torch.log_softmax(torch.randn(15, 1000, generator=gen) * 8.0, dim=-1)
    return build_tree(logp, torch.tensor(1), n - 1).visible


@pytest.mark.parametrize("n", [17, 65, 257])
@pytest.mark.parametrize("config", [gdn_tree.TreeConfig(), gdn_tree.TreeConfig(prepare_registers=128),
                                    gdn_tree.TreeConfig(root_first=True)], ids=["default", "r128", "root_first"])
def test_gdn_tree_qwen36_27b(n, config):
    hk, hv, d = 16, 48, 128
    q, k = torch.randn(n, hk, d), torch.randn(n, hk, d)
    v = torch.randn(n, hv, d).bfloat16()
    g, beta = torch.randn(n, hv), torch.rand(n, hv)
    state = torch.randn(hv, d, d)
    gdn_tree.tree_gated_delta(q, k, v, g, beta, _tree(n), state, config,
                              u_out=torch.empty(hv, n, d), G_out=torch.empty(n, hv))


@pytest.mark.parametrize("n", [1, 17, 65, 257])
@pytest.mark.parametrize("heads", [(24, 4, 256), (32, 8, 128)], ids=["qwen36_27b", "qwen3_8b"])
@pytest.mark.parametrize("tiled", [False, True], ids=["combine", "combine_tiled"])
def test_tree_attention(n, heads, tiled):
    hq, hkv, d = heads
    kv_len = -(-(CONTEXT + n) // 256) * 256
    q = torch.randn(n, hq, d).bfloat16()
    cache = torch.randn(2, kv_len, hkv, d).bfloat16()
    block = _tree(n) if n > 1 else torch.ones(1, 1, dtype=torch.bool)
    config = replace(attention_plan.tiling(n * hq // hkv, kv_len, d), combine_tiled=tiled)
    tree_attention.masked_attention(q, cache[0], cache[1], block, d ** -0.5, config=config,
                                    prefix_len=torch.tensor(CONTEXT))


@pytest.mark.parametrize("n", [1, 17, 65])
@pytest.mark.parametrize("heads", [(24, 4, 256), (32, 8, 128)], ids=["qwen36_27b", "qwen3_8b"])
@pytest.mark.parametrize("balance", [True, False], ids=["balanced", "uniform"])
def test_batched_tree_attention(n, heads, balance):
    """A batch of 16 rows, each with a cache row of CONTEXT + n + 64 slots (max_kv), as the batched
    engine's verify passes them."""
    hq, hkv, d = heads
    batch, row_slots = 16, CONTEXT + n + 64
    q = torch.randn(batch * n, hq, d).bfloat16()
    cache = torch.randn(2, batch * row_slots, hkv, d).bfloat16()
    block = torch.stack([_tree(n) if n > 1 else torch.ones(1, 1, dtype=torch.bool)] * batch)
    config = replace(attention_plan.tiling(n * hq // hkv, row_slots, d, batch), balance_rows=balance)
    tree_attention.batched_masked_attention(q, cache[0], cache[1], block, d ** -0.5,
                                            torch.full((batch,), CONTEXT), torch.arange(batch) * row_slots,
                                            row_slots, config=config)


@pytest.mark.parametrize("budget", [15, 31, 63, 127, 255, 511, 1023])
def test_tree_build_qwen3_vocabulary(budget):
    depths, vocab = 15, 151936
    plan = tree_build.TreeBuildPlan(budget, depths, vocab, "cpu")
    if not plan.supported:  # the engine builds this tree with PyTorch (its rank blocks would pass MAX_SORT)
        pytest.skip(f"no tree build kernels at budget {budget} over {vocab} tokens")
    n = budget + 1
    plan.build(torch.randn(depths, vocab), torch.tensor(1), torch.empty(n, dtype=torch.long),
               torch.empty(n, dtype=torch.long), torch.empty(n, dtype=torch.long), torch.empty(n, dtype=torch.bool),
               torch.empty(n, n, dtype=torch.bool))
