"""Device and host timing shared by the benchmark scripts."""
from __future__ import annotations

import statistics
import time

import torch


def median_replay_ms(graph: torch.cuda.CUDAGraph, repeats: int = 20) -> float:
    """Median milliseconds of one replay of a captured CUDA graph, by CUDA events."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def host_us_per_call(fn, calls: int) -> float:
    """Mean microseconds of one fn() on the host, over `calls` calls after a tenth as many untimed."""
    for _ in range(calls // 10):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6
