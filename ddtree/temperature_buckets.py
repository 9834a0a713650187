"""Temperature buckets: the sampling settings that `ddtree tune` measures apart and that
`--tree-budget auto` chooses a budget for, request by request.

Acceptance falls as the temperature rises (the drafter's guesses match a sharp distribution far
better than a flat one), so the fastest budget at T = 0 is often slower than plain decoding at T = 1.
"""
from __future__ import annotations

from dataclasses import dataclass

from ddtree.config import GREEDY_BELOW


@dataclass(frozen=True)
class TemperatureBucket:
    name: str
    upper: float  # temperatures up to and including this one (the greedy bucket: below GREEDY_BELOW)
    measured_at: float  # the temperature `ddtree tune` measures this bucket with


GREEDY = TemperatureBucket("greedy", GREEDY_BELOW, 0.0)
BUCKETS: tuple[TemperatureBucket, ...] = (
    GREEDY,
    TemperatureBucket("t<=0.4", 0.4, 0.3),
    TemperatureBucket("t<=0.8", 0.8, 0.6),
    TemperatureBucket("t>0.8", float("inf"), 1.0),
)
SAMPLED_BUCKETS = BUCKETS[1:]
BUCKET_NAMES = tuple(b.name for b in BUCKETS)


def bucket_of(temperature: float) -> TemperatureBucket:
    """The bucket a request with this temperature falls in."""
    if temperature < GREEDY_BELOW:
        return GREEDY
    return next(b for b in SAMPLED_BUCKETS if temperature <= b.upper)
