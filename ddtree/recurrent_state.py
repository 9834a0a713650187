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

    def copy_from(self, other: RecurrentState) -> None:
        """This state and conv window := other's (a sequence moving rows, or prefilled elsewhere)."""
        self.state.copy_(other.state)
        self.conv.copy_(other.conv)


class RecurrentScratch:
    """What a round's verify stashes per node and layer for the commit to fold the accepted path
    into the state (`gated_deltanet.fold_path`) and to move the conv windows: the conv inputs
    `mixed` [L, N, conv_dim] (model dtype), the normalised keys `k` [L, N, Hk, Dk], the delta
    rule's new values `u` [L, Hv, N, Dv] and the path-summed log-decays `G` [L, N, Hv] (float32).
    About 4 (Hk Dk + Hv Dv) + 2 conv_dim bytes per node and layer, against 4 Hv Dk Dv for a state."""

    def __init__(self, layers: int, nodes: int, conv_dim: int, key_heads: int, key_dim: int, value_heads: int,
                 value_dim: int, device, dtype):
        self.nodes = nodes
        self.mixed = torch.zeros(layers, nodes, conv_dim, dtype=dtype, device=device)
        self.k = torch.zeros(layers, nodes, key_heads, key_dim, dtype=torch.float32, device=device)
        self.u = torch.zeros(layers, value_heads, nodes, value_dim, dtype=torch.float32, device=device)
        self.G = torch.zeros(layers, nodes, value_heads, dtype=torch.float32, device=device)

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.mixed, self.k, self.u, self.G))


class HybridCache:
    """`kv`: the attention layers' KVCache (indexed by attention layer, not model layer);
    `recurrent`: the Gated DeltaNet layers' RecurrentState (indexed by linear layer)."""

    def __init__(self, kv: KVCache, recurrent: RecurrentState):
        self.kv = kv
        self.recurrent = recurrent

    @property
    def slots(self) -> int:
        return self.kv.slots
