"""The host's cost of the batch's per-round budget choice (`BatchBudget.choose`) and of one round-cost
look-up (`RoundCostTable.seconds`), on this machine's CPU.

    python -m benchmarks.budget_choice_cost [OUTPUT.json] [--rows 16] [--calls 2000]

The choice runs on the engine thread once a round, so its microseconds add to every batched
round (at 16 streams on the H200 the rounds are bound by the host: benchmarks/README.md). The table
is the demo pair's start-up timing on an H200 (ms per round at context 64, rows 1..32 at ar / 16 /
64); the chooser has seen 3000 rounds at 16 and 64. Timed: `--rows` greedy rows (one temperature
bucket), the same rows split over two buckets, and one table look-up; microseconds per call.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from ddtree.batch_budget import BatchBudget, BatchRow
from ddtree.bench.machine import git_revision
from ddtree.bench.timing import host_us_per_call
from ddtree.config import parse_tree_budget
from ddtree.round_costs import RoundCost, RoundCostTable

# ms per round at context 64 by rows: ar, 16, 64 (the H200 server's start-up timing of the demo pair)
H200_DEMO_MS = {1: (0.28, 0.41, 0.47), 2: (0.32, 0.47, 0.53), 4: (0.28, 0.49, 0.56), 8: (0.29, 0.56, 0.62),
                16: (0.32, 0.62, 0.77), 32: (0.40, 0.84, 1.02)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("output", nargs="?")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--calls", type=int, default=2000)
    args = p.parse_args()
    budgets = [parse_tree_budget(label) for label in ("ar", "16", "64")]
    table = RoundCostTable([RoundCost(64, rows, b.label, b.nodes(16), ms / 1000)
                            for rows, times in H200_DEMO_MS.items() for b, ms in zip(budgets, times)])
    chooser = BatchBudget(table, 16, tuple(budgets))
    rng = random.Random(0)
    for bucket in ("greedy", "t1"):
        for _ in range(3000):
            chooser.observe(bucket, budgets[rng.randrange(1, 3)], rng.randint(1, 8 if bucket == "greedy" else 3))
    one_bucket = [BatchRow("greedy", 100 + 7 * i) for i in range(args.rows)]
    two_buckets = [BatchRow("greedy" if i % 2 else "t1", 100 + 7 * i) for i in range(args.rows)]
    result = {
        "benchmark": "budget_choice_cost",
        "command": "python -m benchmarks.budget_choice_cost " + " ".join(
            f"--{k} {v}" for k, v in vars(args).items() if k != "output"),
        "git_revision": git_revision(),
        "rows": args.rows,
        "choose_one_bucket_us": host_us_per_call(lambda: chooser.choose(one_bucket), args.calls),
        "choose_two_buckets_us": host_us_per_call(lambda: chooser.choose(two_buckets), args.calls),
        "table_seconds_us": host_us_per_call(lambda: table.seconds(args.rows, args.rows * 65, 180.0), args.calls),
        "chosen_one_bucket": [b.label for b in chooser.choose(one_bucket)],
        "chosen_two_buckets": [b.label for b in chooser.choose(two_buckets)],
    }
    print(json.dumps(result, indent=1))
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
