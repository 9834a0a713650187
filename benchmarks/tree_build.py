"""The tree build alone: `ddtree.tree.build_tree` (PyTorch operators) against the Triton kernels
of `ddtree.kernels.tree_build`, each captured in a CUDA graph, at the demo and Qwen3 vocabularies.

    python benchmarks/tree_build.py [--budgets 16,32,...] [--vocabs 8192,151936] [--launches]
        [--ranks auto,radix,bitonic,filter] [--rank-warps 4,8,16] [--select-warps 4,8,16] [--output FILE.json]

Prints and writes the median microseconds per build (graph replay, 15 depths) for `build_tree` and
for each selection variant of the Triton build ("sort", "topk") and each way of its rank kernels
(`--ranks auto,radix,bitonic,filter`: each launch's choice by `RADIX_MIN_K`, the radix select or
the bitonic top-k in both, or the group-maxima filter), and whether each output is identical to
`build_tree`'s; with --launches, also each of its kernel launches alone. With
--rank-warps / --select-warps, every combination of the two is timed as its own variant
(`topk_r8_s16_us`, ...); without them, the plan's defaults.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from ddtree.bench.machine import git_revision, results_path
from ddtree.bench.timing import median_replay_ms
from ddtree.engine import capture_graph
from ddtree.kernels.tree_build import TreeBuildPlan
from ddtree.tree import build_tree


def replay_us(fn, repeats: int = 50) -> float:
    graph, _ = capture_graph(fn)
    return median_replay_ms(graph, repeats) * 1000


def time_plan(plan: TreeBuildPlan, name: str, logp, root, ref, launches: bool) -> dict:
    """{name}_us (the whole build), first-call seconds, per-launch times, identical to `ref`."""
    n = plan.budget + 1
    out = [torch.empty(n, dtype=torch.long, device="cuda") for _ in range(3)] + \
          [torch.empty(n, dtype=torch.bool, device="cuda"), torch.empty(n, n, dtype=torch.bool, device="cuda")]
    t = time.perf_counter()
    plan.build(logp, root, *out)
    torch.cuda.synchronize()
    row = {f"{name}_first_call_s": time.perf_counter() - t,  # Triton compile
           f"{name}_us": replay_us(lambda: plan.build(logp, root, *out))}
    # Checked before the launches are timed one by one: a launch replayed alone need not leave a
    # tree (the filter rank's list grows with each replay of its launch).
    row[f"{name}_identical"] = all(torch.equal(a, b) for a, b in
                                   zip(out, [ref.tokens, ref.parents, ref.depths, ref.valid, ref.visible]))
    if launches:
        for launch_name, launch in plan.launches(logp, root, *out):
            row[f"{name}_{launch_name}_us"] = replay_us(launch)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--budgets", default="16,32,64,128,256,512,1024")
    ap.add_argument("--vocabs", default="8192,151936")
    ap.add_argument("--depths", type=int, default=15)
    ap.add_argument("--selections", default="sort,topk", help="the Triton build's selection variants to time")
    ap.add_argument("--ranks", default="auto", help="the rank kernels' variants to time (auto, radix, bitonic, "
                    "filter); a variant other than auto is named {selection}_{rank}")
    ap.add_argument("--launches", action="store_true", help="also time each of the build's kernel launches alone")
    ap.add_argument("--rank-warps", default=None, help="warps per rank program to try, e.g. 4,8,16")
    ap.add_argument("--select-warps", default=None, help="warps of the select program to try, e.g. 4,8,16")
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    rows = []
    path = results_path(args.output, "tree_build")
    for vocab in map(int, args.vocabs.split(",")):
        gen = torch.Generator(device="cuda").manual_seed(0)
        logp = torch.log_softmax(torch.randn(args.depths, vocab, device="cuda", generator=gen) * 4, dim=-1)
        root = torch.tensor(3, device="cuda")
        for budget in map(int, args.budgets.split(",")):
            ref = build_tree(logp, root, budget)
            torch_us = replay_us(lambda: build_tree(logp, root, budget))
            row = {"vocab": vocab, "budget": budget, "torch_us": torch_us}
            warps = [(None, None)]
            if args.rank_warps or args.select_warps:
                warps = [(int(r), int(w)) for r in (args.rank_warps or "8").split(",")
                         for w in (args.select_warps or "8").split(",")]
            for selection, rank in [(s, r) for s in args.selections.split(",") for r in args.ranks.split(",")]:
                for rank_warps, select_warps in warps:
                    name = selection + ("" if rank == "auto" else f"_{rank}")
                    name += "" if rank_warps is None else f"_r{rank_warps}_s{select_warps}"
                    plan = TreeBuildPlan(budget, args.depths, vocab, "cuda", selection=selection,
                                         rank_warps=rank_warps or 8, select_warps=select_warps, rank=rank)
                    row[f"{name}_supported"] = plan.supported
                    if plan.supported:
                        row.update(time_plan(plan, name, logp, root, ref, args.launches))
            rows.append(row)
            print(json.dumps(row), flush=True)
            result = {"benchmark": "tree_build", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "git_revision": git_revision(), "depths": args.depths, "rows": rows}
            path.write_text(json.dumps(result, indent=2))  # after every row: a run cut short keeps its rows


if __name__ == "__main__":
    with torch.inference_mode():
        main()
