"""`torch.compile` with a bound on how many input sizes it compiles.

A function compiled with `dynamic=False` gets one variant per input size, and with `fullgraph=True`
dynamo raises once a function passes its recompile limit instead of falling back. The engine's walk
is compiled per tree size, and a client may name any tree budget, so without a bound the requests of
one client naming many budgets would make every later new budget fail (and the engine with it).
"""
from __future__ import annotations

from typing import Callable, Hashable

import torch


def compile_fixed_shapes(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=False, fullgraph=True)


class CompiledForFirstSizes:
    """fn compiled for the first `limit` distinct sizes (`size_of(*args)`) it is called with, and run
    as it is for any other size: the same results, a few more kernel launches."""

    def __init__(self, fn: Callable, limit: int, size_of: Callable[..., Hashable],
                 compile: Callable[[Callable], Callable] = compile_fixed_shapes):
        self.fn = fn
        self.compiled = compile(fn)
        self.limit = limit
        self.size_of = size_of
        self.sizes: set = set()

    def __call__(self, *args):
        size = self.size_of(*args)
        if size in self.sizes or len(self.sizes) < self.limit:
            self.sizes.add(size)
            return self.compiled(*args)
        return self.fn(*args)
