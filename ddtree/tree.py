"""Draft trees as fixed-shape tensor functions: build, visibility, walk.

A tree of budget B has N = B + 1 nodes; node 0 is the root (the bonus token), nodes 1..B are
drafted. Nodes are ordered so that a parent always comes before its children. When fewer than B
nodes exist (a tiny vocabulary, or draft log-probs of -inf), the tail is padding: `valid` False,
visible only to itself, never accepted.

Order of nodes (the tie rule): by summed log-prob, descending; then by depth, shallower first;
then, within one depth, by the parent's place in this order and the token's rank at that depth
(rank = position when the depth's log-probs are sorted descending, ties by token id). This order
puts every parent before its children, so any prefix of it is a tree, and it is exactly the order
in which the paper's best-first heap pops nodes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree.kernels.tree_attention import prefix_block_mask


@dataclass
class Tree:
    """tokens, parents, depths, valid: [N]; visible: [N, N] (row i: the ancestors of i and i itself).
    The trees of R batch rows at one size stack as [R, N] and [R, N, N] (`walk` takes them)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    valid: torch.Tensor
    visible: torch.Tensor

    @property
    def size(self) -> int:
        return self.tokens.shape[-1]


def order_keys(values: torch.Tensor, index_bits: int) -> torch.Tensor:
    """Unique int64 keys whose descending order is (value descending, position ascending) along
    the last dim, so that one `topk` does the work of a stable descending sort. values: float32."""
    bits = (values.float() + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into +0.0
    mono = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(torch.int64) + 2**31  # order-preserving, >= 0
    positions = torch.arange(values.shape[-1], device=values.device)
    return (mono << index_bits) | ((1 << index_bits) - 1 - positions)


def top_sorted(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest entries along the last dim and their positions, ties by position (stable)."""
    index_bits = max(1, (values.shape[-1] - 1).bit_length())
    idx = torch.topk(order_keys(values, index_bits), k, dim=-1).indices
    return values.gather(-1, idx), idx


def rank_tokens(logp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logp [D, V] -> the k best log-probs and their token ids per depth, [D, k], ties by token id."""
    return top_sorted(logp.float(), k)


def ancestor_mask(parents: torch.Tensor, max_depth: int, by_squaring: bool | None = None) -> torch.Tensor:
    """parents [N] (root and padding: -1) -> visible [N, N]: True at (i, j) if j is i or an ancestor of i.

    By squaring (the default on CUDA): square the (self + parent) reachability matrix
    ceil(log2(max_depth + 1)) times, a few matrix products; otherwise (the default elsewhere):
    follow parent pointers, one vectorized step per depth.
    """
    n = parents.shape[0]
    rows = torch.arange(n, device=parents.device)
    has = parents >= 0
    step = torch.eye(n, dtype=torch.bool, device=parents.device)
    step[rows, parents.clamp(min=0)] |= has
    if parents.is_cuda if by_squaring is None else by_squaring:
        reach = step.to(torch.bfloat16)  # 0/1 entries; products count <= max_depth + 1 paths: exact in bf16
        for _ in range(max(1, max_depth).bit_length()):
            reach = ((reach @ reach) > 0).to(torch.bfloat16)
        return reach > 0
    visible = step
    cur = torch.where(has, parents[parents.clamp(min=0)], -1)
    for _ in range(max_depth - 1):
        has = cur >= 0
        visible[rows, cur.clamp(min=0)] |= has
        cur = torch.where(has, parents[cur.clamp(min=0)], cur)
    return visible


def build_tree(logp: torch.Tensor, root_token: torch.Tensor, budget: int) -> Tree:
    """The top-`budget` prefixes of the draft by summed log-prob, as a tree rooted at `root_token`.

    logp: [D, V] float32 log-probs of depths 1..D (D = block size - 1); root_token: [] long.
    Level by level, keep the `budget` best nodes of each depth (no node outside them can be in the
    global top set), then take the global top `budget`. Stable top-k selections (`top_sorted`) implement the tie rule.
    """
    depth_count, vocab = logp.shape
    device = logp.device
    b = budget
    k = min(b, vocab)
    ranked_logp, ranked_tok = rank_tokens(logp.float(), k)

    level_scores = torch.full((depth_count, b), float("-inf"), device=device)
    level_parent = torch.zeros((depth_count, b), dtype=torch.long, device=device)
    level_token = torch.zeros((depth_count, b), dtype=torch.long, device=device)
    level_scores[0, :k] = ranked_logp[0]
    level_token[0, :k] = ranked_tok[0]
    for d in range(1, depth_count):
        cand = (level_scores[d - 1][:, None] + ranked_logp[d][None, :]).reshape(-1)  # [b * k]
        values, idx = top_sorted(cand, b)
        level_scores[d] = values
        level_parent[d] = idx // k
        level_token[d] = ranked_tok[d][idx % k]

    values, idx = top_sorted(level_scores.reshape(-1), b)
    sel_depth = idx // b  # 0-based depth index
    sel_pos = idx % b
    valid = values > float("-inf")
    node_of = torch.full((depth_count, b), -1, dtype=torch.long, device=device)
    node_of[sel_depth, sel_pos] = torch.arange(1, b + 1, device=device)
    parent_pos = level_parent[sel_depth, sel_pos]
    parents = torch.where(sel_depth == 0, 0, node_of[(sel_depth - 1).clamp(min=0), parent_pos])
    parents = torch.where(valid, parents, -1)

    root = root_token.reshape(1).to(torch.long)
    tokens = torch.cat([root, torch.where(valid, level_token[sel_depth, sel_pos], 0)])
    parents = torch.cat([torch.full((1,), -1, dtype=torch.long, device=device), parents])
    depths = torch.cat([torch.zeros(1, dtype=torch.long, device=device), torch.where(valid, sel_depth + 1, 0)])
    valid = torch.cat([torch.ones(1, dtype=torch.bool, device=device), valid])
    return Tree(tokens, parents, depths, valid, ancestor_mask(parents, depth_count))


def build_chain(draft_tokens: torch.Tensor, root_token: torch.Tensor) -> Tree:
    """DFlash's linear draft: root followed by the D drafted tokens, each the child of the one before."""
    d = draft_tokens.shape[0]
    device = draft_tokens.device
    tokens = torch.cat([root_token.reshape(1).to(torch.long), draft_tokens.to(torch.long)])
    parents = torch.arange(-1, d, device=device)
    depths = torch.arange(0, d + 1, device=device)
    valid = torch.ones(d + 1, dtype=torch.bool, device=device)
    visible = torch.ones(d + 1, d + 1, dtype=torch.bool, device=device).tril()
    return Tree(tokens, parents, depths, valid, visible)


def single_node(root_token: torch.Tensor) -> Tree:
    """The tree of plain autoregressive decoding: the root alone."""
    device = root_token.device
    zero = torch.zeros(1, dtype=torch.long, device=device)
    return Tree(root_token.reshape(1).to(torch.long), zero - 1, zero, torch.ones(1, dtype=torch.bool, device=device),
                torch.ones(1, 1, dtype=torch.bool, device=device))


def context_tree_mask(n: torch.Tensor, visible: torch.Tensor, kv_len: int) -> torch.Tensor:
    """Visibility of the verify forward: [N, kv_len] bool. Every node sees the committed context
    (columns < n) and, among the tree's columns n .. n + N - 1, its ancestors and itself; columns
    past the tree are padding. n: [] long on the device, so the shape depends on kv_len only.
    (The engine hands the kernel n and visible as they are: `AttentionMeta`'s prefix form.)"""
    return prefix_block_mask(n, visible, kv_len)


@dataclass
class Walk:
    """accepted [N] bool; order [N]: accepted nodes first, in depth order; length: [] number accepted
    (root included = the round's acceptance length); bonus: [] the target's choice after the last one.
    For R stacked trees each field gains a leading [R]."""

    accepted: torch.Tensor
    order: torch.Tensor
    length: torch.Tensor
    bonus: torch.Tensor


def walk(tree: Tree, choices: torch.Tensor) -> Walk:
    """Follow the target's choices from the root. choices [N]: the target's token at every node
    (or [R, N] for R stacked trees [R, N], walked together: the rows of a batched round).

    A node is accepted when its token equals the choice at its parent and its parent is accepted;
    siblings carry distinct tokens, so the accepted nodes form one path.
    """
    nodes = torch.arange(tree.size, device=choices.device)
    parent_choice = choices.gather(-1, tree.parents.clamp(min=0))
    match = ((tree.tokens == parent_choice) & tree.valid) | (nodes == 0)
    accepted = ~(tree.visible & ~match[..., None, :]).any(dim=-1)
    taken = accepted.long()
    length = taken.sum(-1)
    # Accepted nodes first, in index (= depth) order, then the rest: a stable partition by cumsum.
    slot = torch.where(accepted, taken.cumsum(-1) - 1, length[..., None] + (1 - taken).cumsum(-1) - 1)
    order = torch.empty_like(slot).scatter_(-1, slot, nodes.expand_as(slot))
    # gather, not order[length - 1]: indexing with a 0-d tensor would copy it to the host.
    last = order.gather(-1, (length - 1)[..., None])
    return Walk(accepted, order, length, choices.gather(-1, last)[..., 0])
