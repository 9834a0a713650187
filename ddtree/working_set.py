"""Which tree budgets keep their buffers and graphs allocated between requests.

Every budget the engine runs allocates its own buffers (and, on CUDA, graphs and a logits buffer per
KV bucket), and keeps them so that the next request at that budget starts at once. A server whose
clients may name any budget would keep allocating until memory runs out, so the engine keeps a
working set: the pinned budgets (the server's default) plus the `capacity` most recently used
others; a budget that falls out is released and prepared again if it is used again.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

from ddtree.tree_shape import TreeShape


class BudgetWorkingSet:
    """At most `capacity` budgets besides the pinned ones stay allocated (None: every budget); the
    least recently used beyond it are released. The budget about to run always is."""

    def __init__(self, engine, capacity: int | None):
        if capacity is not None and capacity < 0:
            raise ValueError(f"capacity must be >= 0 or None, got {capacity}")
        self.engine = engine
        self.capacity = capacity
        self._recent: OrderedDict[TreeShape, None] = OrderedDict()  # least recently used first

    def use(self, budget: TreeShape, pinned: Iterable[TreeShape] = ()) -> list[TreeShape]:
        """Record that `budget` runs next and release what falls out of the set; returns those."""
        if self.capacity is None:
            return []
        self._recent.pop(budget, None)
        self._recent[budget] = None
        pinned = set(pinned)
        rank = {b: i for i, b in enumerate(self._recent)}
        # Budgets prepared outside this set (a warm-up) count as the least recently used.
        held = sorted((b for b in self.engine.buffers if b not in pinned | {budget}), key=lambda b: rank.get(b, -1))
        room = max(self.capacity - (budget not in pinned), 0)  # `budget` itself takes a place
        evicted = held[: max(0, len(held) - room)]
        for old in evicted:
            self.engine.release(old)
            self._recent.pop(old, None)
        return evicted

    @property
    def held(self) -> list[TreeShape]:
        """The budgets whose buffers are allocated now."""
        return list(self.engine.buffers)
