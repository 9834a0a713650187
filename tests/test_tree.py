"""The tree builder, the walk and KV compaction against plain Python references.

`build_tree` must select exactly the nodes, in exactly the order, that the paper's best-first heap
pops: keys (-score, depth, parent's pop index, rank), scores summed in float32 as
parent_score + logp, ranks from a stable descending sort with ties by token id; nodes whose score
is -inf do not exist. Tables are quantised so that ties are common.
"""
from __future__ import annotations

import heapq
import itertools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddtree.kv_cache import KVCache
from ddtree.tree import Tree, ancestor_mask, build_chain, build_tree, context_tree_mask, single_node, walk

NEG_INF = float("-inf")


# -- references ---------------------------------------------------------------------------------


def ranked(logp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per depth: token ids sorted by log-prob descending, ties by token id; and their log-probs."""
    order = np.stack([sorted(range(logp.shape[1]), key=lambda t: (-logp[d, t], t)) for d in range(logp.shape[0])])
    return order, np.take_along_axis(logp, order, axis=1)


def heap_reference(logp: np.ndarray, budget: int) -> list[dict]:
    """The best-first heap: pop the best node, push its next sibling and its first child.

    Returns the popped nodes in pop order (root excluded) as dicts with the token path, parent pop
    index (0 = root), depth, token and score.
    """
    logp = logp.astype(np.float32)
    depth_count, vocab = logp.shape
    order, values = ranked(logp)
    f32 = np.float32
    heap: list[tuple] = []

    def push(parent_score, depth, parent_pop, rank, parent_path):
        if depth > depth_count or rank >= vocab:
            return
        score = f32(f32(parent_score) + values[depth - 1, rank])
        if score == NEG_INF:
            return
        heapq.heappush(heap, (-float(score), depth, parent_pop, rank, parent_path))

    push(0.0, 1, 0, 0, ())
    nodes: list[dict] = []
    while heap and len(nodes) < budget:
        neg, depth, parent_pop, rank, parent_path = heapq.heappop(heap)
        token = int(order[depth - 1, rank])
        path = parent_path + (token,)
        nodes.append(dict(path=path, parent=parent_pop, depth=depth, token=token, score=-neg))
        pop_index = len(nodes)
        parent_score = 0.0 if parent_pop == 0 else nodes[parent_pop - 1]["score"]
        push(parent_score, depth, parent_pop, rank + 1, parent_path)  # next sibling
        push(-neg, depth + 1, pop_index, 0, path)  # first child
    return nodes


def ancestors_by_loop(parents: list[int]) -> np.ndarray:
    n = len(parents)
    visible = np.zeros((n, n), dtype=bool)
    for i in range(n):
        j = i
        while j >= 0:
            visible[i, j] = True
            j = parents[j]
    return visible


def tree_paths(tree) -> list[tuple]:
    """Token path (root excluded) of every valid node, by following parents in Python."""
    tokens, parents, valid = tree.tokens.tolist(), tree.parents.tolist(), tree.valid.tolist()
    paths = []
    for i in range(tree.size):
        if not valid[i]:
            paths.append(None)
            continue
        path, j = [], i
        while j > 0:
            path.append(tokens[j])
            j = parents[j]
        paths.append(tuple(reversed(path)))
    return paths


def reference_walk(tree, choices: list[int]) -> tuple[list[int], int]:
    """Accepted node indices (root first) and the bonus token, by following children in Python."""
    tokens, parents, valid = tree.tokens.tolist(), tree.parents.tolist(), tree.valid.tolist()
    path = [0]
    while True:
        cur = path[-1]
        nxt = [i for i in range(1, tree.size) if valid[i] and parents[i] == cur and tokens[i] == choices[cur]]
        assert len(nxt) <= 1, "siblings must carry distinct tokens"
        if not nxt:
            return path, choices[cur]
        path.append(nxt[0])


# -- strategies ---------------------------------------------------------------------------------

LEVELS = [0.0, -0.0, -1e-45, -0.5, -1.0, -1.5, -2.0, -3.0, -1e30, NEG_INF]  # -1e-45: a float32 denormal


@st.composite
def logp_tables(draw, max_depth=5, max_vocab=6, quantised=None):
    depth = draw(st.integers(1, max_depth))
    vocab = draw(st.integers(1, max_vocab))
    if quantised is None:
        quantised = draw(st.booleans())
    if quantised:
        cells = st.sampled_from(LEVELS)
    else:
        cells = st.one_of(st.floats(-6.0, 0.0, allow_nan=False, width=32), st.just(NEG_INF))
    values = draw(st.lists(cells, min_size=depth * vocab, max_size=depth * vocab))
    return np.array(values, dtype=np.float32).reshape(depth, vocab)


def possible_nodes(logp: np.ndarray) -> int:
    """How many nodes with a finite score exist (sum over depths of the product of finite counts)."""
    finite = np.isfinite(logp).sum(axis=1)
    return int(sum(np.prod(finite[: d + 1]) for d in range(logp.shape[0])))


# -- build_tree -----------------------------------------------------------------------------------


def check_tree_against_heap(logp: np.ndarray, budget: int, root: int = 7) -> None:
    tree = build_tree(torch.from_numpy(logp), torch.tensor(root), budget)
    expected = heap_reference(logp, budget)
    n = budget + 1
    assert tree.size == n
    for t in (tree.tokens, tree.parents, tree.depths, tree.valid):
        assert t.shape == (n,)
    assert tree.visible.shape == (n, n) and tree.visible.dtype == torch.bool

    count = len(expected)
    assert count == min(budget, possible_nodes(logp))
    valid = tree.valid.tolist()
    assert valid == [True] * (count + 1) + [False] * (budget - count), "valid nodes first, padding after"
    assert int(tree.tokens[0]) == root and int(tree.parents[0]) == -1 and int(tree.depths[0]) == 0

    paths = tree_paths(tree)
    assert paths[1 : count + 1] == [e["path"] for e in expected], "node set and order"
    assert tree.tokens[1 : count + 1].tolist() == [e["token"] for e in expected]
    assert tree.parents[1 : count + 1].tolist() == [e["parent"] for e in expected]
    assert tree.depths[1 : count + 1].tolist() == [e["depth"] for e in expected]
    assert all(p == -1 for p in tree.parents[count + 1 :].tolist()), "padding has no parent"

    # Padding has parent -1, so the loop makes it visible to itself only.
    assert (tree.visible.numpy() == ancestors_by_loop(tree.parents.tolist())).all()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(logp=logp_tables(), budget=st.integers(1, 40))
def test_build_tree_equals_best_first_heap(logp, budget):
    check_tree_against_heap(logp, budget)


@settings(max_examples=100, deadline=None)
@given(logp=logp_tables(max_depth=1, max_vocab=8), budget=st.integers(1, 12))
def test_build_tree_depth_one(logp, budget):
    check_tree_against_heap(logp, budget)


@settings(max_examples=100, deadline=None)
@given(logp=logp_tables(max_depth=6, max_vocab=2, quantised=True), budget=st.integers(1, 140))
def test_build_tree_vocab_one_or_two_and_budget_past_all_nodes(logp, budget):
    check_tree_against_heap(logp, budget)


def test_build_tree_all_ties_is_breadth_first_by_token_id():
    """Every log-prob 0: ties everywhere, so the order is by depth, then parent, then token id."""
    logp = np.zeros((3, 3), dtype=np.float32)
    tree = build_tree(torch.from_numpy(logp), torch.tensor(0), 12)
    assert tree_paths(tree)[1:] == [(0,), (1,), (2,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2),
                                    (2, 0), (2, 1), (2, 2)]


def brute_force_scores(logp: np.ndarray) -> dict[tuple, np.float32]:
    """Score of every token sequence of length 1..D, summed left to right in float32."""
    depth_count, vocab = logp.shape
    scores = {}
    for d in range(1, depth_count + 1):
        for path in itertools.product(range(vocab), repeat=d):
            s = np.float32(0.0)
            for i, t in enumerate(path):
                s = np.float32(s + logp[i, t])
            if s != NEG_INF:
                scores[path] = s
    return scores


@settings(max_examples=200, deadline=None)
@given(logp=logp_tables(max_depth=4, max_vocab=3), budget=st.integers(1, 60))
def test_build_tree_is_top_budget_prefixes(logp, budget):
    """Brute force: the tree is prefix-closed and no prefix left out scores above one kept in."""
    scores = brute_force_scores(logp)
    tree = build_tree(torch.from_numpy(logp), torch.tensor(0), budget)
    kept = [p for p in tree_paths(tree)[1:] if p is not None]
    assert len(kept) == len(set(kept)) == min(budget, len(scores))
    kept_set = set(kept)
    assert all(p[:-1] in kept_set for p in kept if len(p) > 1), "prefix-closed"
    left_out = [s for p, s in scores.items() if p not in kept_set]
    if kept and left_out:
        assert min(scores[p] for p in kept) >= max(left_out)


@settings(max_examples=100, deadline=None)
@given(logp=logp_tables(max_depth=3, max_vocab=4, quantised=False), budget=st.integers(1, 30))
def test_build_tree_exact_set_without_ties(logp, budget):
    scores = brute_force_scores(logp)
    values = sorted(scores.values(), reverse=True)
    if len(set(values)) != len(values):
        return  # a tie: the set is not unique; the heap test covers the tie rule
    best = {p for p, _ in sorted(scores.items(), key=lambda kv: -kv[1])[:budget]}
    tree = build_tree(torch.from_numpy(logp), torch.tensor(0), budget)
    assert {p for p in tree_paths(tree)[1:] if p is not None} == best


def test_build_tree_large_budget_real_shape():
    """A block-16-shaped table (15 depths, 64 tokens) at budget 256, continuous log-probs."""
    gen = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(15, 64, generator=gen) * 3, dim=-1)
    check_tree_against_heap(logp.numpy(), 256)


def random_parents(gen: torch.Generator, size: int, padding: int) -> list[int]:
    """Parents of a random tree (each parent before its child) followed by `padding` nodes with parent -1."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, size)]
    return parents + [-1] * padding


@pytest.mark.parametrize("by_squaring", [False, True])
@pytest.mark.parametrize("seed", range(10))
def test_ancestor_mask_both_ways_equal_loop(seed, by_squaring):
    gen = torch.Generator().manual_seed(seed)
    parents = random_parents(gen, int(torch.randint(1, 40, (1,), generator=gen)), seed % 3)
    depth = [0] * len(parents)
    for i, p in enumerate(parents):
        depth[i] = depth[p] + 1 if p >= 0 else 0
    for max_depth in (max(depth), max(depth) + 3):
        visible = ancestor_mask(torch.tensor(parents), max(max_depth, 1), by_squaring=by_squaring)
        assert (visible.numpy() == ancestors_by_loop(parents)).all()


@pytest.mark.parametrize("seed", range(10))
def test_context_tree_mask_equals_loop(seed):
    gen = torch.Generator().manual_seed(seed)
    parents = random_parents(gen, int(torch.randint(1, 12, (1,), generator=gen)), 2)
    visible = torch.from_numpy(ancestors_by_loop(parents))
    size = len(parents)
    n = int(torch.randint(0, 20, (1,), generator=gen))
    kv_len = n + size + int(torch.randint(0, 5, (1,), generator=gen))
    mask = context_tree_mask(torch.tensor(n), visible, kv_len)
    expected = torch.zeros(size, kv_len, dtype=torch.bool)
    for i in range(size):
        for j in range(kv_len):
            expected[i, j] = j < n or (n <= j < n + size and bool(visible[i, j - n]))
    assert torch.equal(mask, expected)


# -- chain and single node -------------------------------------------------------------------------


def test_chain_and_single_node():
    chain = build_chain(torch.tensor([5, 6, 7]), torch.tensor(4))
    assert chain.tokens.tolist() == [4, 5, 6, 7]
    assert chain.parents.tolist() == [-1, 0, 1, 2]
    assert chain.depths.tolist() == [0, 1, 2, 3]
    assert (chain.visible.numpy() == ancestors_by_loop(chain.parents.tolist())).all()
    one = single_node(torch.tensor(9))
    assert one.tokens.tolist() == [9] and one.visible.tolist() == [[True]]


# -- walk -------------------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(logp=logp_tables(max_depth=5, max_vocab=3), budget=st.integers(1, 30), data=st.data())
def test_walk_equals_reference(logp, budget, data):
    vocab = logp.shape[1]
    tree = build_tree(torch.from_numpy(logp), torch.tensor(0), budget)
    choices = data.draw(st.lists(st.integers(0, vocab - 1), min_size=tree.size, max_size=tree.size))
    path, bonus = reference_walk(tree, choices)
    result = walk(tree, torch.tensor(choices))
    assert int(result.length) == len(path)
    assert result.order[: len(path)].tolist() == path
    assert sorted(result.order.tolist()) == list(range(tree.size)), "order is a permutation"
    assert result.accepted.tolist() == [i in path for i in range(tree.size)]
    assert int(result.bonus) == bonus


def test_walk_chain_stops_at_first_mismatch():
    chain = build_chain(torch.tensor([5, 6, 7]), torch.tensor(4))
    result = walk(chain, torch.tensor([5, 6, 1, 2]))
    assert int(result.length) == 3 and result.order[:3].tolist() == [0, 1, 2] and int(result.bonus) == 1
    full = walk(chain, torch.tensor([5, 6, 7, 3]))
    assert int(full.length) == 4 and int(full.bonus) == 3


@settings(max_examples=100, deadline=None)
@given(logp=logp_tables(max_depth=4, max_vocab=3), budget=st.integers(1, 12), rows=st.integers(1, 4),
       data=st.data())
def test_walk_of_stacked_trees_equals_each_tree_alone(logp, budget, rows, data):
    """A batched round walks its rows' trees (one size, stacked [R, N]) in one call: row by row,
    the same walk as each tree alone, whatever the other rows choose."""
    vocab = logp.shape[1]
    trees, choices = [], []
    for r in range(rows):
        root = torch.tensor(data.draw(st.integers(0, vocab - 1)))
        trees.append(build_tree(torch.from_numpy(logp) + 0.01 * r, root, budget))
        choices.append(torch.tensor(data.draw(st.lists(st.integers(0, vocab - 1), min_size=trees[-1].size,
                                                        max_size=trees[-1].size))))
    if len({t.size for t in trees}) > 1:  # stacked rows share one size (a fixed-shape round's)
        return
    stacked = Tree(*(torch.stack([getattr(t, f) for t in trees]) for f in ("tokens", "parents", "depths", "valid",
                                                                              "visible")))
    together = walk(stacked, torch.stack(choices))
    assert together.order.shape == (rows, trees[0].size) and together.length.shape == (rows,)
    for r, (tree, chosen) in enumerate(zip(trees, choices)):
        alone = walk(tree, chosen)
        for field in ("accepted", "order", "length", "bonus"):
            assert torch.equal(getattr(together, field)[r], getattr(alone, field)), (r, field)


# -- KV compaction ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(20))
def test_kv_compact_equals_python_loop(seed):
    gen = torch.Generator().manual_seed(seed)
    layers, slots, heads, dim = 3, 40, 2, 4
    cache = KVCache(layers, slots, heads, dim, "cpu", torch.float32)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    old_k, old_v = cache.k.clone(), cache.v.clone()
    start = int(torch.randint(0, 20, (1,), generator=gen))
    nodes = int(torch.randint(1, slots - start + 1, (1,), generator=gen))
    keep = int(torch.randint(1, nodes + 1, (1,), generator=gen))
    order = torch.randperm(nodes, generator=gen)[:keep]
    cache.compact(start, order)
    exp_k, exp_v = old_k.clone(), old_v.clone()
    for j, src in enumerate(order.tolist()):
        exp_k[:, start + j] = old_k[:, start + src]
        exp_v[:, start + j] = old_v[:, start + src]
    assert torch.equal(cache.k, exp_k) and torch.equal(cache.v, exp_v)
