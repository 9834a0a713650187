"""Device time of a CUDA graph's replay, and of one call captured many times in a graph: shared by
the benchmarks (`ddtree.bench.timing`) and by `blaslt`, which times its candidate kernels."""
from __future__ import annotations

import statistics

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
