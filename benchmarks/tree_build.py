"""The tree build alone: `ddtree.tree.build_tree` (PyTorch operators) against the Triton kernels
of `ddtree.kernels.tree_build`, each captured in a CUDA graph, at the demo and Qwen3 vocabularies.

    python benchmarks/tree_build.py [--budgets 16,32,...] [--vocabs 8192,151936] [--output FILE.json]

Prints and writes the median microseconds per build (graph replay, 15 depths) for `build_tree` and
for each selection variant of the Triton build ("sort", "topk"), and whether each output is
identical to `build_tree`'s; with --launches, also each of its four kernel launches alone.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--budgets", default="16,32,64,128,256,512,1024")
    ap.add_argument("--vocabs", default="8192,151936")
    ap.add_argument("--depths", type=int, default=15)
    ap.add_argument("--selections", default="sort,topk", help="the Triton build's selection variants to time")
    ap.add_argument("--launches", action="store_true", help="also time each of the build's four kernel launches alone")
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
            for selection in args.selections.split(","):
                plan = TreeBuildPlan(budget, args.depths, vocab, "cuda", selection=selection)
                row[f"{selection}_supported"] = plan.supported
                if not plan.supported:
                    continue
                n = budget + 1
                out = [torch.empty(n, dtype=torch.long, device="cuda") for _ in range(3)] + \
                      [torch.empty(n, dtype=torch.bool, device="cuda"), torch.empty(n, n, dtype=torch.bool, device="cuda")]
                t = time.perf_counter()
                plan.build(logp, root, *out)
                torch.cuda.synchronize()
                row[f"{selection}_first_call_s"] = time.perf_counter() - t  # Triton compile
                row[f"{selection}_us"] = replay_us(lambda: plan.build(logp, root, *out))
                if args.launches:
                    for name, launch in plan.launches(logp, root, *out):
                        row[f"{selection}_{name}_us"] = replay_us(launch)
                row[f"{selection}_identical"] = all(torch.equal(a, b) for a, b in
                                                    zip(out, [ref.tokens, ref.parents, ref.depths, ref.valid, ref.visible]))
            rows.append(row)
            print(json.dumps(row), flush=True)
            result = {"benchmark": "tree_build", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "git_revision": git_revision(), "depths": args.depths, "rows": rows}
            path.write_text(json.dumps(result, indent=2))  # after every row: a run cut short keeps its rows


if __name__ == "__main__":
    with torch.inference_mode():
        main()
