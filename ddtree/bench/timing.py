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


def graph_call_us(fn, calls: int = 64, warm: int = 8, repeats: int = 5) -> float:
    """Median microseconds of one fn(i) (i: the call's index, to cycle through inputs), from a CUDA
    graph of `calls` calls replayed `repeats` times; `warm` calls first, outside the capture (so
    that libraries pick and compile their kernels)."""
    for i in range(warm):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    return median_replay_ms(graph, repeats) * 1000 / calls
