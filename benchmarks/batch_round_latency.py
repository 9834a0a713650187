"""Round latency of the batched engine by batch size x tree budget, beside the floor, and the budget
the batch's choice (ddtree.batch_budget) picks at each batch size.

    python -m benchmarks.batch_round_latency OUTPUT.json [--shape qwen3-8b|demo] [--rows 1,4,16]
        [--budgets ar,16,64] [--context 512] [--acceptance 16=4.15,64=4.86] [--device cuda] [--eager]
        [--target DIR --draft DIR [--dtype bfloat16]]

`--shape qwen3-8b` builds Qwen3-8B and its 5-layer drafter with random bf16 weights (a GPU;
`qwen3.6-27b` the hybrid Qwen3.6-27B, whose rows each hold their own recurrent state);
`demo` loads the shipped demo pair (float32 on the CPU); `--target`/`--draft` any checkpoint pair
(for example `benchmarks.random_checkpoint --agreeing-draft`'s, whose rounds accept every drafted
token, as the random shapes' never do). Every row holds a dummy prompt of
`--context` tokens; each (rows, budget) cell is the median of a few `BatchEngine.step` rounds
(`ddtree.round_costs.measure_round_costs`: one untimed round, then three), every row at the
budget: the engine's fixed-shape round, on CUDA replayed from CUDA graphs (captured in the untimed
round) unless `--eager`. The floor of a round: the target's weights read once plus every row's KV
(and a hybrid row's recurrent state, read and rewritten), or its matmul and
attention FLOPs over rows x nodes tokens, whichever is longer, plus the drafter's pass for the
rows that draft (`benchmarks/round_latency.py`'s terms).

Random weights accept nothing, so the choice is made from acceptance lengths given on the command
line (default: the demo pair's on the H200 at T = 0, `adaptive_by_temperature_h200.json`: 4.15 at
16, 4.86 at 64); `ar` commits one token a round.

`--profile` then runs three more rounds of each cell under torch.profiler: each cell gains the
device's busy time per round (the sum of its kernels; on the CPU, of the operators' own time) and
its launches per round beside the round's wall time, and the kernels that took the most time with
their launches per round. A round whose wall time is far above its busy time is bound by the
host; launches that grow with the rows are work done row by row.
"""
from __future__ import annotations

import argparse
import collections
import json
import platform

import torch

from ddtree.batch_budget import WINDOW, BatchBudget, BatchRow
from ddtree.batch_engine import BatchEngine
from ddtree.bench.machine import git_revision, machine_info
from ddtree.config import parse_tree_budget
from ddtree.round_costs import dummy_rows, measure_round_costs
from ddtree.temperature_buckets import GREEDY


def models(shape: str, device: torch.device, context: int, target: str | None = None, draft: str | None = None,
           dtype: str | None = None):
    """(target, drafter) of `shape` (or the pair in `target` / `draft`), and the context limit the
    engine gets."""
    max_len = context + 1024
    if shape == "demo" or target is not None:
        from ddtree.llm import LLM

        llm = LLM(target, draft, device=str(device), dtype=dtype, max_num_seqs=1)
        return llm.target, llm.drafter, min(max_len, llm.max_model_len)
    from benchmarks.round_latency import build_models

    target, drafter = build_models(device, torch.bfloat16, 5, 16, max_len, shape)
    return target, drafter, max_len


def floor_ms(target, drafter, rows: int, nodes: int, context: int, drafts: bool, ceilings: dict) -> float:
    """The round's floor (module docstring)."""
    from benchmarks.round_latency import forward_floor, matmul_params

    tcfg, dcfg = target.config, drafter.config
    attn_layers = len(tcfg.attention_layers) if tcfg.hybrid else tcfg.num_hidden_layers
    kv_bytes = 2 * attn_layers * tcfg.num_key_value_heads * tcfg.head_dim * target.lm_head.weight.element_size()
    # A hybrid row's recurrent state (float32) is read by its verify and rewritten by its commit.
    state_bytes = 2 * target.new_recurrent_state("meta", torch.bfloat16).state.numel() * 4 if tcfg.hybrid else 0
    seen = context + nodes
    attn_flops = rows * 4 * nodes * seen * tcfg.head_dim * tcfg.num_attention_heads * attn_layers
    tparams = matmul_params(target, skip_embedding=True)
    target_s = forward_floor(tparams, rows * nodes, rows * (kv_bytes * seen + state_bytes), ceilings,
                             extra_flops=attn_flops)
    if not drafts:
        return target_s * 1000
    dparams = matmul_params(drafter, skip_embedding=True) + target.lm_head.weight.numel()
    block = dcfg.block_size
    draft_kv = 2 * dcfg.num_hidden_layers * dcfg.num_key_value_heads * dcfg.head_dim * 2 * (context + block)
    draft_flops = rows * 4 * block * (context + block) * dcfg.head_dim * dcfg.num_attention_heads * dcfg.num_hidden_layers
    draft_s = forward_floor(dparams, rows * block, rows * draft_kv, ceilings, extra_flops=draft_flops)
    return (target_s + draft_s) * 1000


def cpu_ceilings() -> dict:
    """A CPU's copy bandwidth and float32 matmul rate, measured the way `round_latency` measures a GPU's."""
    import time

    src, a = torch.empty(256 * 1024**2, dtype=torch.uint8).random_(0, 255), torch.randn(1024, 1024)
    dst = torch.empty_like(src)

    def best(fn, reps=5):
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)
    return {"bandwidth_Bps": 2 * src.numel() / best(lambda: dst.copy_(src)),
            "bf16_flops": 2 * 1024**3 / best(lambda: a @ a)}


def chosen(costs, block_size: int, candidates, acceptance: dict, rows: int, context: int) -> str:
    """The budget the batch's choice gives `rows` greedy rows of `context` tokens, with the given
    acceptance lengths observed a full window each (so that the optimistic prior does not count)."""
    choice = BatchBudget(costs, block_size, candidates)
    for budget, length in acceptance.items():
        for _ in range(WINDOW):
            choice.acceptance.observe(GREEDY.name, budget, length)
    picks = choice.choose([BatchRow(GREEDY.name, context)] * rows)
    return ",".join(sorted({str(b) for b in picks}))


def profile_rounds(engine: BatchEngine, budget, rows: int, context: int, rounds: int = 3, top: int = 25) -> dict:
    """`rounds` rounds of `rows` dummy rows at `budget` (after an untimed one) under torch.profiler ->
    the device's busy ms and launches per round, and the `top` kernels by time (on the CPU: the
    operators, by their own time)."""
    cuda = engine.device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CUDA] if cuda else [torch.profiler.ProfilerActivity.CPU]
    with torch.inference_mode(), dummy_rows(engine, rows, budget, context):
        engine.step()  # untimed: graphs are captured here
        if cuda:
            torch.cuda.synchronize(engine.device)
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(rounds):
                engine.step()
            if cuda:
                torch.cuda.synchronize(engine.device)
    totals: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    for event in prof.events():
        if cuda and event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        totals[event.name] += event.device_time if cuda else event.self_cpu_time_total
        counts[event.name] += 1
    return {"busy_ms": sum(totals.values()) / rounds / 1000, "launches": sum(counts.values()) / rounds,
            "kernels": [{"name": name[:160], "us_per_round": round(us / rounds, 1), "per_round": counts[name] / rounds}
                        for name, us in totals.most_common(top)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("output")
    ap.add_argument("--shape", choices=("qwen3-8b", "qwen3.6-27b", "demo"), default="qwen3-8b")
    ap.add_argument("--target", help="a checkpoint pair instead of --shape (e.g. benchmarks.random_checkpoint's "
                    "pair that always agrees, whose every round accepts the whole tree's deepest path)")
    ap.add_argument("--draft", help="with --target: its drafter")
    ap.add_argument("--dtype", help="with --target: the dtype (default: the LLM's for the device)")
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--budgets", default="ar,16,64")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--acceptance", default="16=4.15,64=4.86",
                    help="mean acceptance length per drafting budget, for the choice (budget=length,...)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--eager", action="store_true", help="run the rounds eagerly, without CUDA graphs")
    ap.add_argument("--profile", action="store_true", help="profile each cell's rounds (kernels, busy time)")
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    rows_list = [int(r) for r in args.rows.split(",")]
    budgets = [parse_tree_budget(b) for b in args.budgets.split(",")]
    acceptance = {parse_tree_budget(k): float(v) for k, v in (item.split("=") for item in args.acceptance.split(","))}
    if args.draft is not None and args.target is None:
        ap.error("--draft needs --target")
    target, drafter, max_len = models(args.shape, device, args.context, args.target, args.draft, args.dtype)
    if device.type == "cuda":
        from benchmarks.round_latency import measure_ceilings

        ceilings = measure_ceilings(device)
    else:
        ceilings = cpu_ceilings()
    engine = BatchEngine(target, drafter, max_len, max(rows_list),
                         max(b.nodes(drafter.config.block_size) for b in budgets),
                         use_graphs=False if args.eager else None)
    with torch.inference_mode():
        costs = measure_round_costs(engine, budgets, rows_list, [args.context],
                                    log=lambda line: print(line, flush=True))
    block = engine.block_size
    cells = []
    for point in costs.points:
        budget = parse_tree_budget(point.budget)
        floor = floor_ms(target, drafter, point.rows, point.tokens_per_row, point.context, budget.drafts, ceilings)
        cells.append({"rows": point.rows, "tree_budget": point.budget, "tokens_per_row": point.tokens_per_row,
                      "context": point.context, "round_ms": point.seconds * 1000, "floor_ms": floor,
                      "ratio_to_floor": point.seconds * 1000 / floor})
    if args.profile:
        for cell in cells:
            budget = parse_tree_budget(cell["tree_budget"])
            cell["profile"] = profile_rounds(engine, budget, cell["rows"], cell["context"])
            print(f"rows {cell['rows']:3d}  {cell['tree_budget']:>5}  busy {cell['profile']['busy_ms']:8.2f} ms  "
                  f"{cell['profile']['launches']:6.0f} launches a round", flush=True)
    picks = {rows: chosen(costs, block, tuple(budgets), acceptance, rows, args.context) for rows in rows_list}
    for cell in cells:
        print(f"rows {cell['rows']:3d}  {cell['tree_budget']:>5}  round {cell['round_ms']:8.2f} ms  "
              f"floor {cell['floor_ms']:7.2f} ms  x{cell['ratio_to_floor']:.2f}", flush=True)
    print("chosen: " + ", ".join(f"{rows} rows: {pick}" for rows, pick in picks.items()))
    result = {"benchmark": "batch_round_latency",
              "command": "python -m benchmarks.batch_round_latency " + " ".join(
                  [args.output] + [f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                                   if k not in ("output", "eager", "profile") and v is not None]
                  + (["--eager"] if args.eager else []) + (["--profile"] if args.profile else [])),
              "machine": {**machine_info(device), "python": platform.python_version()},
              "git_revision": git_revision(), "shape": args.shape if args.target is None else None,
              "target": args.target, "draft": args.draft, "graphs": engine.use_graphs, "ceilings": ceilings,
              "acceptance": {str(k): v for k, v in acceptance.items()}, "cells": cells,
              "chosen": {str(rows): pick for rows, pick in picks.items()}}
    with open(args.output, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
