"""Cache slots shared by a batch's sequences: each sequence holds one contiguous region of the
target's and the drafter's KV caches, sized by what the request can reach (its prompt, its
max_tokens and its largest tree), not by the context limit.

    regions = SlotRegions(100_000)
    start = regions.allocate(4_000)     # None when no free range is that long
    regions.release(start)

Regions are contiguous because a sequence's slots equal its positions counted from its first slot
(`BatchEngine`): attention reads a row's keys from one base address, so a region never needs a
block table. First fit, lowest address first, with freed ranges merged with their free neighbours;
a long-lived region can still split the free space in two (`largest_free` says what fits now).
"""
from __future__ import annotations

import bisect


class SlotRegions:
    def __init__(self, total: int):
        if total < 1:
            raise ValueError(f"a slot pool needs at least one slot, got {total}")
        self.total = total
        self._free_starts = [0]  # sorted; the free ranges never touch (release merges them)
        self._free_sizes = [total]
        self._held: dict[int, int] = {}  # start -> size of every allocated region

    @property
    def free_slots(self) -> int:
        return sum(self._free_sizes)

    @property
    def used_slots(self) -> int:
        return self.total - self.free_slots

    @property
    def largest_free(self) -> int:
        """The longest region `allocate` can give now."""
        return max(self._free_sizes, default=0)

    def allocate(self, size: int) -> int | None:
        """The first slot of a new region of `size` slots (the lowest free range that holds it),
        or None when no free range is that long."""
        if size < 1:
            raise ValueError(f"a region needs at least one slot, got {size}")
        for i, (start, free) in enumerate(zip(self._free_starts, self._free_sizes)):
            if free >= size:
                if free == size:
                    del self._free_starts[i], self._free_sizes[i]
                else:
                    self._free_starts[i] += size
                    self._free_sizes[i] -= size
                self._held[start] = size
                return start
        return None

    def release(self, start: int) -> None:
        """Free the region that begins at `start`."""
        size = self._held.pop(start, None)
        if size is None:
            raise ValueError(f"no region begins at slot {start}")
        i = bisect.bisect(self._free_starts, start)
        end = start + size
        if i < len(self._free_starts) and self._free_starts[i] == end:  # merge with the next free range
            size += self._free_sizes[i]
            del self._free_starts[i], self._free_sizes[i]
        if i > 0 and self._free_starts[i - 1] + self._free_sizes[i - 1] == start:  # and the previous one
            self._free_sizes[i - 1] += size
        else:
            self._free_starts.insert(i, start)
            self._free_sizes.insert(i, size)

    def size_of(self, start: int) -> int:
        return self._held[start]
