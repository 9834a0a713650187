"""The fixed-shape helpers the GPU path relies on equal plain references (run on the CPU)."""
from __future__ import annotations

import random

import pytest
import torch

from ddtree.tree import ancestor_mask, context_tree_mask, top_sorted


def random_forest(n: int, max_depth: int, rng: random.Random) -> torch.Tensor:
    parents, depth = [-1], [0]
    for i in range(1, n):
        if rng.random() < 0.1:  # padding node: no parent
            parents.append(-1)
            depth.append(0)
            continue
        j = rng.choice([j for j in range(i) if depth[j] < max_depth and (j == 0 or parents[j] >= 0)])
        parents.append(j)
        depth.append(depth[j] + 1)
    return torch.tensor(parents)


@pytest.mark.parametrize("seed", range(6))
def test_ancestor_mask_by_squaring_equals_pointer_walk_and_python(seed):
    rng = random.Random(seed)
    for n, d in [(1, 1), (2, 1), (17, 15), (65, 3), (300, 15)]:
        parents = random_forest(n, d, rng)
        expected = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            j = i
            while j >= 0:
                expected[i, j] = True
                j = int(parents[j])
        assert torch.equal(ancestor_mask(parents, d, by_squaring=False), expected)
        assert torch.equal(ancestor_mask(parents, d, by_squaring=True), expected)


@pytest.mark.parametrize("seed", range(5))
def test_top_sorted_is_a_stable_descending_sort(seed):
    g = torch.Generator().manual_seed(seed)
    for shape, k in [((7,), 7), ((3, 50), 10), ((4000,), 257)]:
        values = torch.randint(-5, 1, shape, generator=g).float()  # many ties
        values[..., :2] = float("-inf")
        got_v, got_i = top_sorted(values, k)
        want_v, want_i = torch.sort(values, dim=-1, descending=True, stable=True)
        assert torch.equal(got_i, want_i[..., :k])
        assert torch.equal(got_v, want_v[..., :k])


def test_top_sorted_treats_negative_zero_as_zero():
    values = torch.tensor([-0.0, 0.0, -1.0, -0.0])
    assert top_sorted(values, 4)[1].tolist() == [0, 1, 3, 2]


@pytest.mark.parametrize("n_ctx,kv_pad", [(0, 0), (5, 0), (12, 7)])
def test_context_tree_mask_matches_python(n_ctx, kv_pad):
    parents = random_forest(9, 4, random.Random(n_ctx))
    visible = ancestor_mask(parents, 4)
    kv_len = n_ctx + 9 + kv_pad
    mask = context_tree_mask(torch.tensor(n_ctx), visible, kv_len)
    for i in range(9):
        for j in range(kv_len):
            want = j < n_ctx or (j - n_ctx < 9 and bool(visible[i, j - n_ctx]))
            assert bool(mask[i, j]) == want, (i, j)
