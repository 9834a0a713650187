"""The budget of requests that name none against `ar` and fixed budgets at several temperatures, in
process: `auto` (a tune file's pick per temperature bucket) and `adaptive` (what `ddtree serve`
does without --tree-budget: ddtree.budget_selector measuring the candidates while serving).

Usage: python -m benchmarks.auto_by_temperature OUTPUT.json [--tune-file TUNE_FILE] [--prompts N]
       [--repeats R] [--max-tokens N] [--device cpu|cuda]

Every row runs the same requests: N held-out prompts, R times each (a new sampling seed each time),
one after another, the rows taking turns request by request. `adaptive` starts from nothing at each temperature, so its figures include its
trials of every candidate; `steady_median_tokens_per_second` leaves out the requests before its
trials ended.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter

from ddtree.bench.report import median
from ddtree.bench.runner import OfflineBackend
from ddtree.bench.tune import _calibration_prompts, bucket_picks, read_tune_file
from ddtree.budget_selector import CANDIDATES, OnlineBudgetSelector
from ddtree.config import SamplingParams
from ddtree.llm import LLM
from ddtree.temperature_buckets import bucket_of
from ddtree.tree_shape import AR, CHAIN, TreeShape

FIXED = [AR, CHAIN, TreeShape.best(16), TreeShape.best(64)]
TEMPERATURES = [0.0, 0.6, 1.0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output")
    parser.add_argument("--tune-file", default=None, help="adds the `auto` row: this file's pick per bucket")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (bf16 and CUDA graphs, as served)")
    args = parser.parse_args()
    llm = LLM(device=args.device)
    picks = bucket_picks(read_tune_file(args.tune_file)) if args.tune_file else None
    backend = OfflineBackend(llm)
    backend.prompt_ids = dict(enumerate(_calibration_prompts(llm, args.max_tokens)[:args.prompts]))
    requests = [(i, r) for r in range(args.repeats) for i in range(args.prompts)]
    # Every graph a budget can use (prefill lengths, each KV bucket's front) captured before timing:
    # otherwise each budget's first requests at a new prompt length or KV bucket pay a capture.
    for budget in set(FIXED) | set(CANDIDATES) | set((picks or {}).values()):
        llm.warmup(budget)

    def run(budget, temperature: float, seed: int, index: int):
        params = SamplingParams(max_tokens=args.max_tokens, temperature=temperature,
                                seed=seed if temperature > 0 else None, ignore_eos=True)
        return backend.generate_one(index, budget, params, time.perf_counter())

    results = []
    for temperature in TEMPERATURES:
        bucket = bucket_of(temperature).name
        rows = {b.label: (lambda b=b: b) for b in FIXED}
        if picks is not None:
            rows["auto"] = lambda: picks.get(bucket, llm.default_budget)
        selector = OnlineBudgetSelector()
        rows["adaptive"] = lambda: selector.choose(bucket)
        runs = {name: [] for name in rows}
        # Request by request, every row in turn: a shared machine's load drifts, and this way the
        # drift falls on every row alike.
        for i, r in requests:
            for name, choose in rows.items():
                budget = choose()
                out = run(budget, temperature, r * args.prompts + i, i)
                if name == "adaptive":
                    selector.observe(bucket, budget, out.output_tokens - 1, sum(out.itl_s))
                runs[name].append((budget, out))
        for name, done in runs.items():
            trials = 2 * len(CANDIDATES) if name == "adaptive" else 0
            tps = [out.tokens_per_second for _, out in done]
            drafted = [out for budget, out in done if budget.drafts]
            rounds = sum(out.decode_rounds or 0 for out in drafted)
            decode_seconds = sum(sum(out.itl_s) for _, out in done)  # after the first token
            row = {"temperature": temperature, "tree_budget": name,
                   "budgets_used": dict(Counter(budget.label for budget, _ in done)),
                   "median_tokens_per_second": round(median(tps), 2),
                   "steady_median_tokens_per_second": round(median(tps[trials:]), 2),
                   "decode_tokens_per_second": round(sum(out.output_tokens - 1 for _, out in done) / decode_seconds, 2),
                   "mean_acceptance_length": round(sum(out.accepted_tokens or 0 for out in drafted) / rounds, 3)
                   if rounds else 1.0}
            print(json.dumps(row), flush=True)
            results.append(row)
    json.dump({"command": "python -m benchmarks.auto_by_temperature " + " ".join(sys.argv[1:]),
               "auto_picks": {k: v.label for k, v in picks.items()} if picks else None,
               "adaptive_candidates": [b.label for b in CANDIDATES],
               "device": str(llm.device), "dtype": str(llm.dtype), "requests_per_row": len(requests),
               "buckets_of": {str(t): bucket_of(t).name for t in TEMPERATURES},
               "results": results}, open(args.output, "w"), indent=2)


if __name__ == "__main__":
    main()
