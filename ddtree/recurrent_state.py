"""A hybrid target's caches: the KV cache of its attention layers, and the recurrent state and conv
window of its Gated DeltaNet layers, plus the per-round stash a tree verify leaves for the commit.

The recurrent state is one per sequence (not per slot): a verify reads it and writes nothing, and
the commit of a round advances it by exactly the accepted path (`HybridTarget.commit`).
"""
from __future__ import annotations

import torch

from ddtree.kv_cache import KVCache


class RecurrentState:
    """Every Gated DeltaNet layer's state `state` [L, Hv, Dk, Dv] (float32) and conv window `conv`
    [L, K - 1, conv_dim] (the last K - 1 conv inputs of the committed sequence, oldest first)."""

    def __init__(self, layers: int, value_heads: int, key_dim: int, value_dim: int, conv_kernel: int,
                 conv_dim: int, device, dtype):
        self.state = torch.zeros(layers, value_heads, key_dim, value_dim, dtype=torch.float32, device=device)
        self.conv = torch.zeros(layers, conv_kernel - 1, conv_dim, dtype=dtype, device=device)

    @property
    def bytes(self) -> int:
        return self.state.numel() * self.state.element_size() + self.conv.numel() * self.conv.element_size()


class RecurrentScratch:
    """What a tree verify stashes per node for the commit to replay the accepted path: each layer's
    conv inputs `mixed` [L, N, conv_dim] and decay / write-strength projections `a`, `b` [L, N, Hv]
    (a few KiB per node and layer, against 4 * Hv * Dk * Dv bytes for a state per node)."""

    def __init__(self, layers: int, nodes: int, conv_dim: int, value_heads: int, device, dtype):
        self.mixed = torch.zeros(layers, nodes, conv_dim, dtype=dtype, device=device)
        self.a = torch.zeros(layers, nodes, value_heads, dtype=dtype, device=device)
        self.b = torch.zeros(layers, nodes, value_heads, dtype=dtype, device=device)

    def store(self, layer: int, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        n = mixed.shape[0]
        self.mixed[layer, :n].copy_(mixed)
        self.a[layer, :n].copy_(a)
        self.b[layer, :n].copy_(b)

    def rows(self, layer: int, order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The stashed (mixed, a, b) of nodes `order` [M], in that order."""
        return (self.mixed[layer].index_select(0, order), self.a[layer].index_select(0, order),
                self.b[layer].index_select(0, order))


class HybridCache:
    """`kv`: the attention layers' KVCache (indexed by attention layer, not model layer);
    `recurrent`: the Gated DeltaNet layers' RecurrentState (indexed by linear layer)."""

    def __init__(self, kv: KVCache, recurrent: RecurrentState):
        self.kv = kv
        self.recurrent = recurrent

    @property
    def slots(self) -> int:
        return self.kv.slots
