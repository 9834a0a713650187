"""Time to first token of the batched engine against the one-request engine, in process.

    python -m benchmarks.batch_first_token OUTPUT.json [--prompts 16] [--max-num-seqs 32] [--budget 64]

Through the server with `--max-num-seqs 32`, one stream at a time waited a median 81.8 ms for its
first token on the H200 with the demo pair, against 6.1 ms with the one-request engine
(`results/bench_h200_demo_concurrency_server_auto.json`). This splits that time without HTTP: on
the demo pair, `--prompts` prompts of distinct lengths (60 to 600 tokens) each join the
`ddtree.batching.BatchedRequests` of an `LLM` alone, and the script times `add` (the prefill and the
first token), the first round after it and the next rounds, twice over the same prompts (a second
pass shows what the first one compiled or captured), then the one-request engine's first event
(`LLM.stream`) on the same prompts, and how many prompts' first tokens the two agree on.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from ddtree.bench.machine import git_revision, machine_info
from ddtree.config import SamplingParams, parse_tree_budget
from ddtree.llm import LLM
from ddtree.tree_shape import TreeShape


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ms(values: list[float]) -> dict:
    return {"median_ms": statistics.median(values) * 1000, "max_ms": max(values) * 1000}


def batched_pass(llm: LLM, batch, prompts: list[list[int]], budget: TreeShape, params: SamplingParams) -> dict:
    """Each prompt alone in the batch: add (prefill + first token), its first round, 4 more rounds."""
    adds, firsts, rounds, tokens = [], [], [], []
    for prompt in prompts:
        sync(llm.device)
        start = time.perf_counter()
        request, event = batch.add(prompt, params, budget)
        adds.append(time.perf_counter() - start)
        tokens.append(event.token_ids[0])
        start = time.perf_counter()
        batch.step()
        firsts.append(time.perf_counter() - start)
        start = time.perf_counter()
        for _ in range(4):
            batch.step()
        rounds.append((time.perf_counter() - start) / 4)
        batch.cancel(request)
    return {"add": ms(adds), "first_round": ms(firsts), "round": ms(rounds), "first_tokens": tokens}


def single_pass(llm: LLM, prompts: list[list[int]], budget: TreeShape, params: SamplingParams) -> dict:
    firsts, tokens = [], []
    for prompt in prompts:
        sync(llm.device)
        start = time.perf_counter()
        stream = llm.stream(prompt, params, budget.json_value)
        tokens.append(next(stream).token_ids[0])
        firsts.append(time.perf_counter() - start)
        stream.close()
    return {"first_event": ms(firsts), "first_tokens": tokens}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("output")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--budget", default="64")
    p.add_argument("--device", default=None)
    args = p.parse_args()
    llm = LLM(device=args.device, max_num_seqs=args.max_num_seqs)
    budget = parse_tree_budget(args.budget)
    batch = llm.batched(budget.nodes(llm.block_size))
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    vocab = llm.target.config.vocab_size
    lengths = torch.randint(60, 600, (args.prompts,), generator=gen).tolist()
    prompts = [torch.randint(20, vocab, (n,), generator=gen).tolist() for n in lengths]
    result = {"benchmark": "batch_first_token", "command": " ".join(["python -m benchmarks.batch_first_token",
                                                                      *sys.argv[1:]]),
              "machine": machine_info(llm.device), "git_revision": git_revision(), "budget": budget.label,
              "prompt_lengths": lengths, "batched": [], "single": []}
    for rep in range(2):
        result["batched"].append(batched_pass(llm, batch, prompts, budget, params))
        print(f"batched pass {rep}: {json.dumps(result['batched'][-1])}", flush=True)
    for rep in range(2):
        result["single"].append(single_pass(llm, prompts, budget, params))
        print(f"one-request pass {rep}: {json.dumps(result['single'][-1])}", flush=True)
    result["first_tokens_equal"] = sum(a == b for a, b in zip(result["batched"][-1]["first_tokens"],
                                                              result["single"][-1]["first_tokens"]))
    print(f"first tokens equal to the one-request engine's: {result['first_tokens_equal']} of {len(prompts)}")
    Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
