"""Aggregate tokens/s of the batch's per-round budget choice (ddtree.batch_budget) against fixed
tree budgets, with 1 and 8 requests in flight on one batched engine of 8 rows, in process: what
`ddtree serve` (no --tree-budget, --max-num-seqs 8) does with one client and with eight.

Usage: python -m benchmarks.batch_budgets_adaptive OUTPUT.json [--budgets ar,16,64]
       [--concurrency 1,8] [--requests 8] [--max-tokens 64] [--repeats 3] [--device cpu] [--threads 1]

The round costs are measured once at the start, as the server does at start-up (their seconds are
reported). Two adaptive modes: `adaptive` starts each run from a fresh choice that has seen no
acceptance, so its trials of untried budgets count in its time (a server's first requests);
`adaptive-warm` keeps one choice through the whole benchmark, as a server that has served a while
(acceptance does not depend on the load, so what it learned at one concurrency holds at another).
Greedy (T = 0) stdlib prompts: every run's tokens must be the same. Each repeat runs every
(concurrency, mode); the JSON holds every run and the medians, and for the adaptive runs the share
of request-rounds at each budget. One torch thread by default: on a small machine shared with other
work, two threads that wait on each other time far worse than one, and unevenly across budgets.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ddtree.batch_budget import BatchBudget
from ddtree.bench.datasets import stdlib_prompts
from ddtree.bench.machine import git_revision, machine_info
from ddtree.config import SamplingParams, parse_tree_budget
from ddtree.llm import LLM
from ddtree.round_costs import measure_round_costs
from ddtree.tree_shape import AR

ADAPTIVE, WARM = "adaptive", "adaptive-warm"


def run(llm, ids: list[list[int]], params: SamplingParams, mode: str, concurrency: int) -> tuple[float, list]:
    """Every prompt through the batched engine with at most `concurrency` in flight -> (seconds,
    results in prompt order)."""
    batch = llm.batched()
    adaptive = mode in (ADAPTIVE, WARM)
    budget = AR if adaptive else parse_tree_budget(mode)  # an adaptive row's start: the choice replaces it
    results, index, waiting = [None] * len(ids), {}, list(range(len(ids)))
    start = time.perf_counter()
    while waiting or batch.running:
        while waiting and len(batch.running) < concurrency:
            i = waiting.pop(0)
            request, event = batch.add(ids[i], params, budget, adaptive)
            index[id(request)] = i
        for request, event in batch.step():
            if event.result is not None:
                results[index[id(request)]] = event.result
    return time.perf_counter() - start, results


def merged(rounds: list[dict[str, int]]) -> dict[str, int]:
    """Rounds per budget, summed."""
    total: dict[str, int] = {}
    for part in rounds:
        for budget, count in part.items():
            total[budget] = total.get(budget, 0) + count
    return dict(sorted(total.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("output")
    parser.add_argument("--budgets", default="ar,16,64")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on a CPU")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    levels = [int(c) for c in args.concurrency.split(",")]
    budgets = [parse_tree_budget(b) for b in args.budgets.split(",")]
    llm = LLM(device=args.device, max_num_seqs=max(levels + [2]))
    llm.batched(max(b.nodes(llm.block_size) for b in budgets))
    start = time.perf_counter()
    costs = measure_round_costs(llm.batched().engine, budgets)
    cost_seconds = time.perf_counter() - start
    print(f"round costs measured in {cost_seconds:.1f} s", flush=True)
    prompts = [p.prompt for p in stdlib_prompts() if p.prompt][: args.requests]
    ids = [llm.encode(p) for p in prompts]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    modes = [ADAPTIVE, WARM] + [b.label for b in budgets]
    warm = BatchBudget(costs, llm.block_size, tuple(budgets))
    runs, reference = [], None
    for repeat in range(args.repeats):
        for concurrency in levels:
            for mode in modes:
                fresh = BatchBudget(costs, llm.block_size, tuple(budgets))
                llm.batch_budget = {ADAPTIVE: fresh, WARM: warm}.get(mode)
                seconds, results = run(llm, ids, params, mode, concurrency)
                tokens = [r.token_ids for r in results]
                reference = reference or tokens
                runs.append({"repeat": repeat, "concurrency": concurrency, "mode": mode,
                             "tokens_per_second": sum(map(len, tokens)) / seconds, "seconds": seconds,
                             "budget_rounds": merged([r.stats.budget_rounds for r in results]),
                             "identical": tokens == reference})
                print(json.dumps(runs[-1]), flush=True)
    summary = []
    for concurrency in levels:
        for mode in modes:
            mine = [r for r in runs if r["concurrency"] == concurrency and r["mode"] == mode]
            rounds = merged([r["budget_rounds"] for r in mine])
            summary.append({"concurrency": concurrency, "mode": mode,
                            "median_tokens_per_second": statistics.median(r["tokens_per_second"] for r in mine),
                            "round_shares": {b: n / sum(rounds.values()) for b, n in rounds.items()},
                            "identical_outputs": all(r["identical"] for r in mine)})
    for row in summary:
        best_fixed = max(s["median_tokens_per_second"] for s in summary
                         if s["concurrency"] == row["concurrency"] and s["mode"] not in (ADAPTIVE, WARM))
        row["vs_best_fixed"] = row["median_tokens_per_second"] / best_fixed
        shares = ", ".join(f"{b} {share:.0%}" for b, share in row["round_shares"].items())
        print(f"concurrency {row['concurrency']} {row['mode']:>13}: {row['median_tokens_per_second']:6.1f} tok/s "
              f"({row['vs_best_fixed']:.2f}x the best fixed budget); rounds at {shares}; "
              f"identical outputs: {row['identical_outputs']}")
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "output")
    result = {"benchmark": "batch_budgets_adaptive",
              "command": f"python -m benchmarks.batch_budgets_adaptive {flags} {args.output}",
              "settings": vars(args), "machine": machine_info(llm.device), "dtype": str(llm.dtype),
              "git_revision": git_revision(), "round_cost_seconds": cost_seconds, "round_costs": costs.to_json(),
              "summary": summary, "runs": runs}
    with open(args.output, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
