"""What a long prompt joining a running batch costs the requests already decoding, in process.

    python -m benchmarks.long_prompt_join OUTPUT.json [--rows 3] [--prompt-len 1800] [--prefill-chunk 256]
        [--budget 16] [--device cpu] [--passes 2]

`--rows` requests decode together (greedy, at `--budget`) on the demo pair; after a few rounds a
prompt of `--prompt-len` tokens joins them. Every step is timed (`BatchedRequests.step`, and the
joining prompt's `add`, which the running requests wait for too), with the long prompt prefilled
whole at its `add` and a chunk of `--prefill-chunk` tokens a step (`defer_long_prompts`, the
default): for each, the running requests' longest wait between two of their rounds, their median
wait, and the long prompt's time to its first token (from its `add`). Each mode runs `--passes`
times, alternating; the last pass of each is reported, and every request's tokens must be the
same in both modes.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from ddtree.batching import BatchedRequests
from ddtree.bench.machine import git_revision, machine_info
from ddtree.config import SamplingParams, parse_tree_budget
from ddtree.llm import LLM

RUNNING_PROMPTS = ["def fib(n):", "import os\n", "class Stack:", "for i in range(", "def parse(text):"]
LONG_TEXT = "def handler(request, response):\n    return response.status(request.path)\n\n"
WARM_ROUNDS = 4  # rounds of the running requests before the long prompt joins


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_pass(llm: LLM, defer: bool, rows: int, long_prompt: list[int], budget, max_tokens: int) -> dict:
    """One pass: the running requests, the long prompt joining after WARM_ROUNDS rounds."""
    batch = BatchedRequests(llm, rows + 1, defer_long_prompts=defer)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tokens: dict[int, list[int]] = {}
    last_event: dict[int, float] = {}
    waits: list[float] = []
    names: dict[int, int] = {}
    for i in range(rows):
        request, event = batch.add(llm.encode(RUNNING_PROMPTS[i % len(RUNNING_PROMPTS)]), params, budget)
        names[id(request)], tokens[i] = i, list(event.token_ids)
    sync(llm.device)
    for i in range(rows):
        last_event[i] = time.perf_counter()
    long_id, joined_at, first_token_s, step = rows, None, None, 0
    while batch.busy:
        if step == WARM_ROUNDS:
            joined_at = time.perf_counter()
            request, event = batch.add(long_prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                                       budget)
            names[id(request)], tokens[long_id] = long_id, []
            if event is not None:
                sync(llm.device)
                first_token_s = time.perf_counter() - joined_at
                tokens[long_id] += event.token_ids
        events = batch.step()
        sync(llm.device)
        now = time.perf_counter()
        for request, event in events:
            i = names[id(request)]
            tokens[i] += event.token_ids
            if i == long_id:
                if first_token_s is None:
                    first_token_s = now - joined_at
                continue
            if step >= WARM_ROUNDS - 1:  # the waits around the join, and after it
                waits.append(now - last_event[i])
            last_event[i] = now
        step += 1
    return {"defer_long_prompts": defer, "max_wait_ms": max(waits) * 1000,
            "median_wait_ms": statistics.median(waits) * 1000, "long_prompt_first_token_ms": first_token_s * 1000,
            "steps": step, "tokens": tokens}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("output")
    p.add_argument("--rows", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=1800)
    p.add_argument("--prefill-chunk", type=int, default=256)
    p.add_argument("--budget", default="16")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens of each running request")
    p.add_argument("--device", default="cpu")
    p.add_argument("--passes", type=int, default=2)
    args = p.parse_args()
    llm = LLM(device=args.device, prefill_chunk=args.prefill_chunk, max_num_seqs=args.rows + 1)
    if args.prompt_len + 8 > llm.max_model_len:
        p.error(f"--prompt-len {args.prompt_len} does not fit the context limit of {llm.max_model_len}")
    text_ids = llm.encode(LONG_TEXT)
    long_prompt = (text_ids * (args.prompt_len // len(text_ids) + 1))[: args.prompt_len]
    budget = parse_tree_budget(args.budget)
    last = {}
    for _ in range(args.passes):
        for defer in (True, False):
            last[defer] = run_pass(llm, defer, args.rows, long_prompt, budget, args.max_tokens)
    same = last[True].pop("tokens") == last[False].pop("tokens")
    result = {"benchmark": "long_prompt_join", "command": " ".join(["python -m benchmarks.long_prompt_join",
                                                                    *sys.argv[1:]]),
              "git": git_revision(), "machine": machine_info(llm.device), "rows": args.rows,
              "prompt_len": args.prompt_len, "prefill_chunk": args.prefill_chunk, "budget": budget.label,
              "chunk_a_step": last[True], "whole_at_add": last[False], "same_tokens": same}
    print(json.dumps(result, indent=1))
    Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
