"""GPU memory of the engine over a flood of distinct tree budgets, in process (the server's budget
flood without HTTP), and where the memory that stays allocated was allocated.

Usage: python -m benchmarks.budget_memory OUTPUT.json [--budgets 200] [--cached 4] [--stacks 15]

Prefills one token at each of `--budgets` budgets spread over 1..4096 with a working set of
`--cached` budgets, after settling at the largest ones. Records the caching allocator's allocated
and reserved bytes every 20 budgets (after gc), and at the end the live allocations made during the
flood grouped by their allocation stack (torch.cuda.memory._record_memory_history), largest first.
"""
from __future__ import annotations

import argparse
import collections
import gc
import json
import sys

import torch

from ddtree.config import SamplingParams
from ddtree.llm import LLM

MB = 1 << 20


def live_blocks_by_stack(snapshot: dict, limit: int) -> list[dict]:
    """Allocated blocks of the snapshot, summed by the Python frames that allocated them."""
    sizes: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    for segment in snapshot["segments"]:
        for block in segment["blocks"]:
            if block["state"] != "active_allocated":
                continue
            frames = [f"{f['filename'].split('/')[-1]}:{f['line']} {f['name']}" for f in block.get("frames", [])
                      if f["filename"].endswith(".py")][:6]
            key = " <- ".join(frames) or "(no Python frames)"
            sizes[key] += block["size"]
            counts[key] += 1
    return [{"mb": round(size / MB, 2), "blocks": counts[key], "stack": key} for key, size in sizes.most_common(limit)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output")
    parser.add_argument("--budgets", type=int, default=200)
    parser.add_argument("--cached", type=int, default=4)
    parser.add_argument("--stacks", type=int, default=15)
    args = parser.parse_args()
    llm = LLM(device="cuda", max_cached_budgets=args.cached, max_model_len=64)
    budgets = sorted({round(1 + i * 4095 / (args.budgets - 1)) for i in range(args.budgets)})
    one_token = SamplingParams(max_tokens=1, temperature=0)
    for budget in budgets[-args.cached - 1:]:
        llm.generate("def f(x):", one_token, tree_budget=budget)
    torch.cuda.synchronize()
    gc.collect()
    start = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    trace = []
    for i, budget in enumerate(budgets):
        llm.generate("def f(x):", one_token, tree_budget=budget)
        if i % 20 == 19 or i == len(budgets) - 1:
            torch.cuda.synchronize()
            gc.collect()
            row = {"budgets_done": i + 1, "last_budget": budget,
                   "allocated_growth_mb": round((torch.cuda.memory_allocated() - start[0]) / MB, 1),
                   "reserved_growth_mb": round((torch.cuda.memory_reserved() - start[1]) / MB, 1)}
            print(json.dumps(row), flush=True)
            trace.append(row)
    stacks = live_blocks_by_stack(torch.cuda.memory._snapshot(), args.stacks)
    torch.cuda.memory._record_memory_history(enabled=None)
    for entry in stacks:
        print(f"{entry['mb']:9.2f} MB in {entry['blocks']:5d} blocks: {entry['stack']}")
    json.dump({"command": "python -m benchmarks.budget_memory " + " ".join(sys.argv[1:]),
               "start_allocated_mb": round(start[0] / MB, 1), "start_reserved_mb": round(start[1] / MB, 1),
               "held_after": [str(b) for b in llm.working_set.held], "trace": trace,
               "live_allocations_by_stack": stacks}, open(args.output, "w"), indent=2)


if __name__ == "__main__":
    main()
