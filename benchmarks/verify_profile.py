"""Where the verify's time goes at a real shape (random bf16 weights): device time per kernel of one
verify for each budget, and the target's matmuls alone at each row count.

Usage: python -m benchmarks.verify_profile OUTPUT.json [--shape qwen3.6-27b] [--budgets chain,64]
       [--prompt-len 512] [--rows 1,16,17,32,64,65,128] [--phases draft,build,walk_commit]
       [--prefill] [--prefill-chunk 4096]

For each budget: the verify replayed as a CUDA graph (median ms), then run eagerly under
torch.profiler, its kernels summed by name (device microseconds per verify, largest first). Then,
for each distinct weight shape of the target's linear layers, F.linear over `rows` rows timed alone
(CUDA events, median of 20) and summed over the layers that have that shape: how much of a verify
the matmuls alone cost at each tree size, against the weights' bytes over the copy bandwidth.
`--phases` profiles the round's other phases the same way (`Engine.round_phases`: "draft",
"build", "walk_commit"; the last commits a round each run, so it runs last). `--prefill` profiles
the prompt's prefill first (the first budget's, to its first token; chunks of `--prefill-chunk`
tokens beyond the padded lengths), its kernels summed the same way.
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics

import torch
import torch.nn.functional as F

from benchmarks.round_latency import build_models, measure_ceilings, time_graph
from ddtree.bench.machine import git_revision
from ddtree.config import SamplingParams, parse_tree_budget
from ddtree.engine import PREFILL_CHUNK, Engine


def kernel_table(fn, calls: int = 5, limit: int = 40) -> list[dict]:
    """Device microseconds per call of each kernel `fn` launches, summed by kernel name."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time
            counts[event.name] += 1
    return [{"kernel": name[:160], "us_per_call": round(us / calls, 1), "launches_per_call": counts[name] / calls}
            for name, us in totals.most_common(limit)]


def linear_times(target: torch.nn.Module, rows: list[int]) -> dict:
    """F.linear of each distinct 2-D weight shape (embedding excluded) at each row count, summed
    over the layers sharing that shape -> {rows: total ms}, plus the per-shape table."""
    shapes = collections.Counter(tuple(p.shape) for name, p in target.named_parameters()
                                 if p.dim() == 2 and "embed_tokens" not in name)
    per_shape, totals = [], {m: 0.0 for m in rows}
    for (out_f, in_f), count in shapes.items():
        weight = torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16)
        entry = {"shape": [out_f, in_f], "layers": count}
        for m in rows:
            x = torch.randn(m, in_f, device="cuda", dtype=torch.bfloat16)
            for _ in range(3):
                F.linear(x, weight)
            times = []
            for _ in range(20):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                F.linear(x, weight)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            ms = statistics.median(times)
            entry[str(m)] = round(ms * 1000, 1)  # microseconds, one layer
            totals[m] += ms * count
        per_shape.append(entry)
        del weight
    return {"total_ms": {str(m): round(t, 3) for m, t in totals.items()}, "per_shape_us": per_shape}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("output")
    ap.add_argument("--shape", default="qwen3.6-27b", choices=["qwen3-8b", "qwen3.6-27b"])
    ap.add_argument("--budgets", default="chain,64")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--rows", default="1,16,17,32,64,65,128")
    ap.add_argument("--phases", default="", help="other round phases to profile, comma-separated")
    ap.add_argument("--prefill", action="store_true", help="profile the prompt's prefill too")
    ap.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK, help="tokens per forward of a long prefill")
    args = ap.parse_args()
    torch.manual_seed(0)
    ceilings = measure_ceilings(torch.device("cuda"))
    max_len = max(2048, args.prompt_len + 1024)
    target, drafter = build_models(torch.device("cuda"), torch.bfloat16, 5, 16, max_len, args.shape)
    engine = Engine(target, drafter, max_model_len=max_len, prefill_chunk=args.prefill_chunk)
    weight_bytes = sum(p.numel() * 2 for name, p in target.named_parameters()
                       if p.dim() == 2 and "embed_tokens" not in name)
    result = {"benchmark": "verify_profile", "shape": args.shape, "prompt_len": args.prompt_len,
              "git_revision": git_revision(), "ceilings": ceilings,
              "weights_floor_ms": weight_bytes / ceilings["bandwidth_Bps"] * 1000, "budgets": {}}
    prompt = torch.randint(0, 150000, (args.prompt_len,)).tolist()
    if args.prefill:
        def prefill():
            gen = engine.generate(prompt, SamplingParams(max_tokens=10**6, ignore_eos=True),
                                  parse_tree_budget(args.budgets.split(",")[0]))
            next(gen)  # the prefill, to the host reading the first token
            gen.close()

        kernels = kernel_table(prefill, calls=1)
        result["prefill"] = {"eager_kernel_ms": sum(k["us_per_call"] for k in kernels) / 1000, "kernels": kernels}
        print(f"prefill: {result['prefill']['eager_kernel_ms']:.1f} ms of kernels", flush=True)
        for k in kernels[:25]:
            print(f"  {k['us_per_call']:9.1f} us  x{k['launches_per_call']:5.1f}  {k['kernel'][:110]}", flush=True)
    for label in args.budgets.split(","):
        budget = parse_tree_budget(label)
        gen = engine.generate(prompt, SamplingParams(max_tokens=10**6, ignore_eos=True), budget)
        next(gen)
        next(gen)  # one round: the budget's graphs and buffers exist, the state is mid-sequence
        phases = engine.round_phases(budget)
        verify = phases["verify"]
        graph_ms = time_graph(engine, verify)
        kernels = kernel_table(verify)
        entry = {"nodes": budget.nodes(16), "verify_graph_ms": graph_ms,
                 "eager_kernel_ms": sum(k["us_per_call"] for k in kernels) / 1000, "kernels": kernels, "phases": {}}
        print(f"{label}: verify {graph_ms:.2f} ms as a graph", flush=True)
        for k in kernels[:25]:
            print(f"  {k['us_per_call']:9.1f} us  x{k['launches_per_call']:5.1f}  {k['kernel'][:110]}", flush=True)
        wanted = [p for p in ("draft", "build", "walk_commit") if p in args.phases.split(",") and p in phases]
        for phase in wanted:  # walk_commit last: it commits a round each run
            table = kernel_table(phases[phase])
            entry["phases"][phase] = {"eager_kernel_ms": sum(k["us_per_call"] for k in table) / 1000,
                                      "kernels": table}
            print(f"{label}: {phase} {entry['phases'][phase]['eager_kernel_ms']:.3f} ms of kernels", flush=True)
            for k in table[:15]:
                print(f"  {k['us_per_call']:9.1f} us  x{k['launches_per_call']:5.1f}  {k['kernel'][:110]}", flush=True)
        gen.close()
        result["budgets"][label] = entry
    result["linear"] = linear_times(target, [int(m) for m in args.rows.split(",")])
    print("matmuls alone, ms per forward:", result["linear"]["total_ms"], f"(weights / bandwidth {result['weights_floor_ms']:.2f} ms)")
    for entry in result["linear"]["per_shape_us"]:
        print("  ", entry)
    with open(args.output, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
