"""Aggregate tokens/s of fixed tree budgets, one request at a time against N requests decoded
together (ddtree.batching), in process: which budget pays depends on the load.

Usage: python -m benchmarks.batch_budgets OUTPUT.json [--budgets ar,16,64] [--rows 1,8]
       [--temperatures 0,1] [--max-tokens 64] [--device cpu|cuda]

The same N stdlib prompts for every cell (N = the largest --rows); rows = 1 runs them one after
another through the one-request engine, rows = R > 1 through `LLM.generate` with max_num_seqs R.
Sampled rows carry seeds.
"""
from __future__ import annotations

import argparse
import json
import time

from ddtree.bench.datasets import stdlib_prompts
from ddtree.bench.machine import git_revision
from ddtree.config import SamplingParams
from ddtree.llm import LLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("output")
    parser.add_argument("--budgets", default="ar,16,64")
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    llm = LLM(device=args.device, max_num_seqs=max(max(rows_list), 2))
    prompts = [p.prompt for p in stdlib_prompts() if p.prompt][: max(rows_list)]
    cells = []
    for temperature in map(float, args.temperatures.split(",")):
        params = [SamplingParams(max_tokens=args.max_tokens, temperature=temperature, seed=100 + i, ignore_eos=True)
                  for i in range(len(prompts))]
        for budget in args.budgets.split(","):
            budget = int(budget) if budget.isdigit() else budget
            for rows in rows_list:
                llm.max_num_seqs = rows
                start = time.perf_counter()
                if rows == 1:
                    results = [llm.generate(p, sp, tree_budget=budget) for p, sp in zip(prompts, params)]
                else:
                    results = llm.generate(prompts, params, tree_budget=budget)
                seconds = time.perf_counter() - start
                tokens = sum(len(r.token_ids) for r in results)
                acceptance = [r.stats.mean_acceptance_length for r in results]
                cells.append({"temperature": temperature, "tree_budget": str(budget), "rows": rows,
                              "tokens_per_second": tokens / seconds,
                              "mean_acceptance_length": sum(acceptance) / len(acceptance)})
                print(json.dumps(cells[-1]), flush=True)
    result = {"benchmark": "batch_budgets", "settings": vars(args), "device": str(llm.device), "dtype": str(llm.dtype),
              "git_revision": git_revision(), "prompts": len(prompts), "cells": cells}
    with open(args.output, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
