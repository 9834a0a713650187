"""The Triton tree build equals `ddtree.tree.build_tree` exactly: tokens, parents, depths, valid
and visibility, on random, tie-heavy and partly -inf draft log-probs.

On a GPU the kernels run compiled, at the demo and Qwen3 vocabularies; on the CPU they run in
Triton's interpreter (numpy, slow), so the shapes there are small. Skipped where Triton is absent.
"""
from __future__ import annotations

import pytest
import torch

from ddtree.tree import build_tree, rank_tokens

CUDA = torch.cuda.is_available()
pytest.importorskip("triton")  # without a GPU, conftest has put Triton in interpreter mode
from ddtree.kernels.tree_build import TreeBuildPlan, candidates  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"


def draft_logp(depths: int, vocab: int, seed: int, levels: int = 0, dead_from: int | None = None,
               sure: int = 0) -> torch.Tensor:
    """Log-probs [depths, vocab]: `levels` > 0 quantises logits (many ties); `dead_from` makes
    depths from there on certain of a few tokens and -inf elsewhere; the first `sure` depths are
    near certain of one token (a deep chain through them, then a wide tree)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(depths, vocab, generator=gen) * 3
    logits[:sure, seed % vocab] += 30.0
    if levels:
        logits = (logits * levels).round() / levels
    if dead_from is not None:
        logits[dead_from:] = float("-inf")
        logits[dead_from:, : min(3, vocab)] = 0.0
    return torch.log_softmax(logits, dim=-1).to(DEVICE)


def check(budget: int, depths: int, vocab: int, selection: str = "topk", rank: str = "radix", **kw) -> None:
    logp = draft_logp(depths, vocab, **kw)
    root = torch.tensor(5, device=DEVICE)
    ref = build_tree(logp, root, budget)
    plan = TreeBuildPlan(budget, depths, vocab, DEVICE, selection=selection, rank=rank)
    assert plan.supported
    n = budget + 1
    out = dict(tokens=torch.full((n,), 99, dtype=torch.long, device=DEVICE),
               parents=torch.full((n,), 99, dtype=torch.long, device=DEVICE),
               depths=torch.full((n,), 99, dtype=torch.long, device=DEVICE),
               valid=torch.zeros(n, dtype=torch.bool, device=DEVICE),
               visible=torch.ones(n, n, dtype=torch.bool, device=DEVICE))
    ranked_logp, ranked_tok = rank_tokens(logp, plan.k)
    for _ in range(2):  # twice: stale scratch from the first build must not leak into the second
        plan.build(logp, root, **out)
        for name, got in out.items():
            assert torch.equal(got, getattr(ref, name)), (name, budget, depths, vocab, selection, rank, kw)
        # the whole ranking, which a tree uses only the head of
        assert torch.equal(plan.ranked_tok[:depths], ranked_tok), (budget, depths, vocab, rank, kw)
        assert torch.equal(plan.ranked_logp[:depths], ranked_logp), (budget, depths, vocab, rank, kw)


def test_candidates_are_the_pairs_that_can_win():
    i, j = candidates(16, 16)
    pairs = set(zip(i.tolist(), j.tolist()))
    assert pairs == {(a, b) for a in range(16) for b in range(16) if (a + 1) * (b + 1) <= 16}
    assert (i * 16 + j).diff().gt(0).all()  # position order


SMALL = [
    (16, 15, 50, dict(seed=0)),
    (16, 15, 50, dict(seed=1, levels=1)),
    (64, 15, 6, dict(seed=2)),  # vocabulary smaller than the budget
    (64, 6, 6, dict(seed=3, dead_from=4)),
    (8, 15, 20, dict(seed=4, levels=4, dead_from=6)),
    (32, 7, 200, dict(seed=5, levels=2)),
    (1, 15, 40, dict(seed=6)),
    (5, 1, 40, dict(seed=7)),  # one depth
    (48, 4, 100, dict(seed=8, levels=1)),
    (16, 15, 50, dict(seed=9, sure=15)),  # one chain through every depth: no level is skipped
    (32, 15, 30, dict(seed=10, sure=6, levels=2)),  # deepest node at depth 12: the last levels skipped
]


def test_the_cases_cover_full_depth_and_skipped_levels():
    """The select kernel skips the levels below the running B-th best: the cases above include
    trees that reach the last depth (nothing skipped) and trees that stop well before it."""
    deepest = {}
    for budget, depths, vocab, kw in SMALL:
        tree = build_tree(draft_logp(depths, vocab, **kw), torch.tensor(5, device=DEVICE), budget)
        deepest[(budget, depths, kw["seed"])] = (int(tree.depths.max()), depths)
    assert deepest[(16, 15, 9)] == (15, 15)
    assert 9 < deepest[(32, 15, 10)][0] < 14
    assert sum(d < total for d, total in deepest.values()) >= 4


@pytest.mark.parametrize("rank", ["radix", "bitonic", "filter"])
@pytest.mark.parametrize("budget,depths,vocab,kw", SMALL)
def test_fused_build_equals_build_tree(budget, depths, vocab, kw, rank):
    check(budget, depths, vocab, "topk", rank, **kw)


# The bitonic-sort selection (kept as a reference for the default top-k) on the cases with ties, a
# vocabulary below the budget, dead depths and a chain through every depth: each case takes 5-15 s
# in the interpreter.
SORT_CASES = [SMALL[i] for i in (1, 2, 3, 9)]


@pytest.mark.parametrize("budget,depths,vocab,kw", SORT_CASES)
def test_sort_selection_equals_build_tree(budget, depths, vocab, kw):
    check(budget, depths, vocab, "sort", **kw)


@pytest.mark.parametrize("rank", ["radix", "bitonic", "filter"])
@pytest.mark.parametrize("kw", [dict(seed=11, levels=1), dict(seed=12), dict(seed=13, dead_from=1)])
def test_rank_over_several_chunks_equals_build_tree(rank, kw):
    """A vocabulary of three rank chunks (1024 tokens each at K = 16): ties of one value in every
    chunk (levels=1 leaves a few dozen values over 3000 tokens), where the merge must keep the
    smallest token ids, and depths that are -inf but for three tokens."""
    plan = TreeBuildPlan(16, 3, 3000, DEVICE)
    assert plan.chunks == 3
    check(16, 3, 3000, rank=rank, **kw)


def test_filter_rank_where_the_threshold_lets_many_keys_through():
    """The filter rank's two fallbacks: a depth of one value everywhere (every group's maximum
    ties, so each chunk up to the threshold's passes all its keys and appends its own best KP
    instead) makes the depth's list longer than the block the last launch reads at once (it reads
    it in two); beside it a random depth and one with few distinct values."""
    budget, depths, vocab = 32, 3, 32768
    plan = TreeBuildPlan(budget, depths, vocab, DEVICE, rank="filter")
    assert (plan.chunks, plan.groups, plan.short, plan.merge) == (32, 64, 256, 1024)
    logits = torch.randn(depths, vocab, generator=torch.Generator().manual_seed(14)) * 3
    logits[0] = 0.0
    logits[2] = logits[2].round()
    logp = torch.log_softmax(logits, dim=-1).to(DEVICE)
    root = torch.tensor(5, device=DEVICE)
    n = budget + 1
    out = dict(tokens=torch.empty(n, dtype=torch.long, device=DEVICE),
               parents=torch.empty(n, dtype=torch.long, device=DEVICE),
               depths=torch.empty(n, dtype=torch.long, device=DEVICE),
               valid=torch.empty(n, dtype=torch.bool, device=DEVICE),
               visible=torch.empty(n, n, dtype=torch.bool, device=DEVICE))
    plan.build(logp, root, **out)
    assert int(plan.listed[0]) > plan.short  # the list was read in more than one block
    ref = build_tree(logp, root, budget)
    for name, got in out.items():
        assert torch.equal(got, getattr(ref, name)), name
    ranked_logp, ranked_tok = rank_tokens(logp, plan.k)
    assert torch.equal(plan.ranked_tok, ranked_tok) and torch.equal(plan.ranked_logp, ranked_logp)


def test_many_trees_in_one_build_equal_each_built_alone():
    """A batched round's rows (`TreeBuildPlan(rows=R)`: rank over rows x depths, select and
    visibility per tree) in one build: each row's tree is its own `build_tree`'s, whatever the
    others hold (different draft log-probs, roots and shapes: a chain-like row and a wide one);
    fewer trees than the plan holds, and too many are refused."""
    budget, depths, vocab = 12, 5, 40
    plan = TreeBuildPlan(budget, depths, vocab, DEVICE, rows=4)
    logp = torch.stack([draft_logp(depths, vocab, seed=s, sure=sure) for s, sure in ((0, 0), (1, 4), (2, 0))])
    roots = torch.tensor([5, 7, 11], device=DEVICE)
    n = budget + 1
    out = dict(tokens=torch.full((3, n), 99, dtype=torch.long, device=DEVICE),
               parents=torch.full((3, n), 99, dtype=torch.long, device=DEVICE),
               depths=torch.full((3, n), 99, dtype=torch.long, device=DEVICE),
               valid=torch.zeros(3, n, dtype=torch.bool, device=DEVICE),
               visible=torch.ones(3, n, n, dtype=torch.bool, device=DEVICE))
    plan.build(logp, roots, **out)
    for r in range(3):
        ref = build_tree(logp[r], roots[r], budget)
        for name, got in out.items():
            assert torch.equal(got[r], getattr(ref, name)), (r, name)
    with pytest.raises(ValueError, match="scratch holds 4"):
        plan.build(torch.cat([logp, logp]), torch.cat([roots, roots]), **{k: torch.cat([v, v]) for k, v in out.items()})


def test_unknown_selection_is_refused():
    with pytest.raises(ValueError, match="selection"):
        TreeBuildPlan(16, 15, 50, DEVICE, selection="heap")
    with pytest.raises(ValueError, match="rank"):
        TreeBuildPlan(16, 15, 50, DEVICE, rank="heap")


@pytest.mark.skipif(not CUDA, reason="large shapes need a GPU (the interpreter is slow)")
@pytest.mark.parametrize("selection,rank", [("topk", "auto"), ("sort", "auto"), ("topk", "radix"), ("topk", "bitonic"),
                                            ("topk", "filter")])
@pytest.mark.parametrize("budget", [16, 64, 256, 512, 1024])
@pytest.mark.parametrize("vocab", [8192, 151936])
def test_fused_build_equals_build_tree_at_real_sizes(budget, vocab, selection, rank):
    plan = TreeBuildPlan(budget, 15, vocab, DEVICE)
    if not plan.supported:
        pytest.skip(f"budget {budget} at vocabulary {vocab} falls back to build_tree")
    for seed, levels in [(0, 0), (1, 2), (2, 1)]:
        check(budget, 15, vocab, selection, rank, seed=seed, levels=levels)
    check(budget, 15, vocab, selection, rank, seed=3, dead_from=5)
