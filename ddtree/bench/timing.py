"""Device and host timing shared by the benchmark scripts."""
from __future__ import annotations

import time

from ddtree.kernels.graph_timing import graph_call_us, median_replay_ms

__all__ = ["graph_call_us", "host_us_per_call", "median_replay_ms"]


def host_us_per_call(fn, calls: int) -> float:
    """Mean microseconds of one fn() on the host, over `calls` calls after a tenth as many untimed."""
    for _ in range(calls // 10):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6
