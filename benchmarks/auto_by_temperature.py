"""`--tree-budget auto` against `ar` and fixed budgets at several temperatures, in process.

Usage: python -m benchmarks.auto_by_temperature TUNE_FILE OUTPUT.json [--prompts N] [--max-tokens N]
       [--device cpu|cuda]
The auto budget is what the server would use: the tune file's pick for the request's temperature
bucket (`LLM.auto_budgets`, a request naming no tree_budget).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from ddtree.bench.report import median
from ddtree.bench.runner import OfflineBackend
from ddtree.bench.tune import _calibration_prompts, bucket_picks, read_tune_file
from ddtree.config import SamplingParams
from ddtree.llm import LLM
from ddtree.temperature_buckets import bucket_of

FIXED = ["ar", "chain", 16, 64]
TEMPERATURES = [0.0, 0.6, 1.0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("tune_file")
    parser.add_argument("output")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (bf16 and CUDA graphs, as served)")
    args = parser.parse_args()
    llm = LLM(device=args.device)
    llm.auto_budgets = bucket_picks(read_tune_file(args.tune_file))
    backend = OfflineBackend(llm)
    backend.prompt_ids = dict(enumerate(_calibration_prompts(llm, args.max_tokens)[:args.prompts]))
    # Every graph a budget can use (prefill lengths, each KV bucket's front) captured before timing:
    # otherwise each budget's first requests at a new prompt length or KV bucket pay a capture.
    for budget in {str(b) for b in FIXED} | {str(b) for b in llm.auto_budgets.values()}:
        llm.warmup(budget)
    results = []
    for temperature in TEMPERATURES:
        for budget in FIXED + ["auto"]:
            used = llm.budget_for(temperature) if budget == "auto" else budget
            tps, accepted, rounds = [], 0, 0
            # Untimed first: a budget's first request allocates its buffers and captures its graphs.
            backend.generate_one(0, None if budget == "auto" else budget,
                                 SamplingParams(max_tokens=args.max_tokens, temperature=temperature, seed=0,
                                                ignore_eos=True), time.perf_counter())
            for i in range(args.prompts):
                params = SamplingParams(max_tokens=args.max_tokens, temperature=temperature,
                                        seed=i if temperature > 0 else None, ignore_eos=True)
                out = backend.generate_one(i, None if budget == "auto" else budget, params, time.perf_counter())
                tps.append(out.tokens_per_second)
                accepted += out.accepted_tokens or 0
                rounds += out.decode_rounds or 0
            row = {"temperature": temperature, "tree_budget": str(budget), "budget_used": str(used),
                   "median_tokens_per_second": round(median(tps), 2),
                   "mean_acceptance_length": round(accepted / rounds, 3) if rounds and used != "ar" else 1.0}
            print(json.dumps(row), flush=True)
            results.append(row)
    json.dump({"command": "python -m benchmarks.auto_by_temperature " + " ".join(sys.argv[1:]),
               "auto_picks": {k: str(v) for k, v in llm.auto_budgets.items()},
               "device": str(llm.device), "dtype": str(llm.dtype),
               "buckets_of": {str(t): bucket_of(t).name for t in TEMPERATURES},
               "results": results}, open(args.output, "w"), indent=2)


if __name__ == "__main__":
    main()
