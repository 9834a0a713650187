"""A live `ddtree serve` given the same requests one after another and then all at once (streamed):
aggregate tokens/s of each, and whether every request's output was the same both times.

Usage: python -m benchmarks.concurrent_streams OUTPUT.json --base-url http://127.0.0.1:8000
       [--requests 8] [--max-tokens 64] [--temperature 0] [--tree-budget N] [--repeats 3]

Greedy by default, with no tree budget in the requests (the server's default applies): greedy
output does not depend on the tree budget, so it must be identical whichever budget each request
gets. With --temperature > 0 every request carries a seed; pass --tree-budget too so that both
runs decode it with the same tree. Each repeat runs the serial pass, then the concurrent one;
the JSON holds every repeat and the medians.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx

from ddtree.bench.datasets import stdlib_prompts


async def stream_one(client: httpx.AsyncClient, body: dict) -> dict:
    """One streamed completion -> its token ids and the times of its first and last chunks."""
    start = time.perf_counter()
    tokens: list[int] = []
    first = last = None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            ids = chunk["choices"][0].get("token_ids") or []
            if ids:
                last = time.perf_counter()
                first = first or last
                tokens += ids
    return {"tokens": tokens, "ttft_s": (first or start) - start, "e2e_s": time.perf_counter() - start}


async def run(args) -> dict:
    prompts = [p.prompt for p in stdlib_prompts() if p.prompt][: args.requests]
    bodies = []
    for i, prompt in enumerate(prompts):
        body = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": args.temperature, "stream": True,
                "ignore_eos": True, "return_token_ids": True}
        if args.temperature > 0:
            body["seed"] = 1000 + i
        if args.tree_budget is not None:
            body["tree_budget"] = args.tree_budget
        bodies.append(body)
    repeats = []
    async with httpx.AsyncClient(base_url=args.base_url, timeout=3600) as client:
        await stream_one(client, dict(bodies[0], max_tokens=4))  # the server's first request pays set-up costs
        for _ in range(args.repeats):
            start = time.perf_counter()
            serial = [await stream_one(client, body) for body in bodies]
            serial_s = time.perf_counter() - start
            start = time.perf_counter()
            together = await asyncio.gather(*(stream_one(client, body) for body in bodies))
            together_s = time.perf_counter() - start
            tokens = sum(len(r["tokens"]) for r in serial)
            repeats.append({
                "serial_tokens_per_second": tokens / serial_s,
                "concurrent_tokens_per_second": sum(len(r["tokens"]) for r in together) / together_s,
                "identical_outputs": sum(a["tokens"] == b["tokens"] for a, b in zip(serial, together)),
                "concurrent_e2e_s": sorted(r["e2e_s"] for r in together),
                "concurrent_ttft_s": sorted(r["ttft_s"] for r in together),
            })
            print(json.dumps({k: v for k, v in repeats[-1].items() if not k.startswith("concurrent_e") and "ttft" not in k}),
                  flush=True)
    serial = statistics.median(r["serial_tokens_per_second"] for r in repeats)
    together = statistics.median(r["concurrent_tokens_per_second"] for r in repeats)
    return {"benchmark": "concurrent_streams", "settings": vars(args), "repeats": repeats,
            "median_serial_tokens_per_second": serial, "median_concurrent_tokens_per_second": together,
            "speedup": together / serial,
            "all_identical": all(r["identical_outputs"] == args.requests for r in repeats)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("output")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--tree-budget", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    result = asyncio.run(run(args))
    with open(args.output, "w") as f:
        json.dump(result, f, indent=2)
    print(f"serial {result['median_serial_tokens_per_second']:.1f} tok/s, {args.requests} at once "
          f"{result['median_concurrent_tokens_per_second']:.1f} tok/s: x{result['speedup']:.2f}; "
          f"identical outputs in every repeat: {result['all_identical']}")


if __name__ == "__main__":
    main()
