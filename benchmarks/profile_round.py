"""Where a round's time goes: torch.profiler over a few decoding rounds of a model pair.

    python benchmarks/profile_round.py [--budget 64] [--rounds 20] [--device cuda] [--output FILE.json]

Runs one request to warm up (graphs captured, kernels compiled), then profiles `--rounds` rounds
of a second request and prints the top operators and kernels by device time (CPU time on a CPU)
with their call counts per round. The count of kernels per round and the host time between the
two graph replays are what a small model's round overhead is made of.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from ddtree.bench.machine import git_revision
from ddtree.config import SamplingParams, parse_tree_budget
from ddtree.llm import LLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--target", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--budget", default="64")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--output", default=None)
    args = ap.parse_args()

    llm = LLM(args.target, args.draft, device=args.device, dtype=args.dtype)
    budget = parse_tree_budget(args.budget)
    prompt = llm.encode("import os\nimport sys\n\n\ndef main(argv):\n    ")
    params = SamplingParams(max_tokens=args.rounds * 20, ignore_eos=True)
    llm.generate(prompt, params, budget)  # warm-up: compile, capture

    cuda = llm.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    steps = llm.engine.generate(prompt, params, budget)
    next(steps)  # prefill, outside the timing
    start = time.perf_counter()
    for _ in range(args.rounds):
        next(steps)
    plain_ms = (time.perf_counter() - start) * 1000 / args.rounds  # the same rounds, no profiler
    steps.close()
    steps = llm.engine.generate(prompt, params, budget)
    next(steps)  # prefill, outside the profile
    bufs = llm.engine.buffers[budget]
    launched = bufs.rounds
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(args.rounds):
            next(steps)
        if cuda:
            torch.cuda.synchronize()  # the round launched ahead of the last one read, profiled whole
    wall_ms = (time.perf_counter() - start) * 1000 / args.rounds
    launched = bufs.rounds - launched  # args.rounds, plus one launched ahead when rounds overlap
    steps.close()

    def device_us(e) -> float:
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)

    events = prof.key_averages()
    ranked = sorted(events, key=device_us if cuda else (lambda e: e.self_cpu_time_total), reverse=True)
    rows = [{"name": e.key, "calls_per_round": e.count / launched,
             "self_device_us_per_round": device_us(e) / launched,
             "self_cpu_us_per_round": e.self_cpu_time_total / launched} for e in ranked[: args.top]]
    on_device = [e for e in events if str(getattr(e, "device_type", "")).endswith("CUDA")]
    kernels = sum(e.count for e in on_device) / launched if cuda else None
    device_ms = sum(device_us(e) for e in on_device) / 1000 / launched if cuda else None
    print(f"budget {budget}: {plain_ms:.3f} ms per round (wall), {wall_ms:.3f} profiled; "
          f"kernels per round: {kernels}, kernel time per round: {device_ms} ms")
    print(f"{'calls/round':>11} {'device us':>10} {'cpu us':>9}  name")
    for r in rows:
        print(f"{r['calls_per_round']:11.1f} {r['self_device_us_per_round']:10.1f} {r['self_cpu_us_per_round']:9.1f}  {r['name'][:90]}")
    if args.output:
        Path(args.output).write_text(json.dumps({
            "benchmark": "profile_round", "budget": str(budget), "device": str(llm.device),
            "git_revision": git_revision(), "wall_ms_per_round": plain_ms, "profiled_wall_ms_per_round": wall_ms,
            "kernels_per_round": kernels, "kernel_ms_per_round": device_ms,
            "top": rows}, indent=2))


if __name__ == "__main__":
    main()
