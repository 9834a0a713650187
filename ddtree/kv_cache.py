"""Static per-sequence KV cache: allocated once, written by slot, compacted after each round."""
from __future__ import annotations

import torch

from ddtree.kernels import kv_write


class KVCache:
    """Keys and values for every layer: `k`, `v` are [layers, slots, kv_heads, head_dim].

    Slot i holds position i of the committed sequence; slots past the committed length are
    scratch space for the tokens of the current round (the tree, or the drafter's block).
    """

    def __init__(self, layers: int, slots: int, kv_heads: int, head_dim: int, device, dtype):
        self.k = torch.zeros(layers, slots, kv_heads, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)

    @property
    def slots(self) -> int:
        return self.k.shape[1]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_len: int):
        """Store k, v [N, kv_heads, head_dim] at `slots` [N]; return this layer's keys and values [kv_len, ...].
        On CUDA one Triton launch (`kernels.kv_write`) reads k and v in place; elsewhere `index_copy_`."""
        cache_k, cache_v = self.k[layer], self.v[layer]
        if k.is_cuda and kv_write.supported(cache_k, k):
            kv_write.write_kv(cache_k, cache_v, slots, k, v)
        else:
            cache_k.index_copy_(0, slots, k)
            cache_v.index_copy_(0, slots, v)
        return self.layer(layer, kv_len)

    def layer(self, layer: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's keys and values [kv_len, kv_heads, head_dim] (views)."""
        return self.k[layer, :kv_len], self.v[layer, :kv_len]

    def write_layers(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [N, layers, kv_heads, head_dim] (every layer's entries of N tokens) at `slots` [N]."""
        if k.shape[1] != self.k.shape[0]:
            raise ValueError(f"entries for {k.shape[1]} layers, the cache has {self.k.shape[0]}")
        if k.is_cuda and kv_write.supported(self.k, k):
            kv_write.write_kv(self.k, self.v, slots, k, v)
        else:
            for layer in range(k.shape[1]):
                self.k[layer].index_copy_(0, slots, k[:, layer])
                self.v[layer].index_copy_(0, slots, v[:, layer])

    def copy_span(self, src: int, dst: int, length: int, source: KVCache | None = None) -> None:
        """Copy slots [src, src + length) of `source` (default: this cache; one of the same layers
        and heads) to this cache's [dst, dst + length) in all layers: a sequence moving to another
        cache row, or one prefilled in another cache. Overlapping spans of one cache are copied as
        if through a temporary."""
        source = source or self
        if length <= 0 or (source is self and src == dst):
            return
        for cache, origin in ((self.k, source.k), (self.v, source.v)):
            span = origin[:, src:src + length]
            if origin is cache and abs(src - dst) < length:
                span = span.clone()
            cache[:, dst:dst + length].copy_(span)

    def compact(self, start: int | torch.Tensor, order: torch.Tensor) -> None:
        """Move slot `start + order[j]` to slot `start + j` for every j, in all layers.

        `order` [M] lists the kept tree nodes first (in depth order); entries after them are
        don't-care. Or many spans at once (a batch's rows, which do not overlap): start [R],
        order [R, M]. Gathering before writing makes overlapping moves safe. On CUDA one Triton
        launch for all layers and spans (`kernels.kv_write.compact_kv`).
        """
        if order.is_cuda and isinstance(start, torch.Tensor) and kv_write.supported(self.k, self.k):
            kv_write.compact_kv(self.k, self.v, start, order)
            return
        if order.dim() == 2:
            start = torch.as_tensor(start, device=order.device)[:, None]
        src = (order + start).reshape(-1)
        dst = (torch.arange(order.shape[-1], device=order.device) + start).reshape(-1)
        self.k.index_copy_(1, dst, self.k.index_select(1, src))
        self.v.index_copy_(1, dst, self.v.index_select(1, src))
