"""One batched tree-attention launch for R sequences (`tree_attention.batched_masked_attention`)
against the per-row loop it replaces (R `masked_attention` calls), at a head layout (default
Qwen3-8B's: 32 query / 8 KV heads, head_dim 128), bf16, per layer.

    python benchmarks/batched_attention.py [--rows 1,4,16] [--tokens 1,17,65] [--contexts 512,mixed,skewed]
        [--heads HQ,HKV,D] [--row-slots N] [--output FILE.json]

Each row holds a random tree of N tokens after its context (`mixed`: 100, 3000, 17, 40000 cycled
over the rows, so short rows share a launch with a long one; `skewed`: one row of 32768 and the
rest of 512); its cache row has `--row-slots` slots (default: the longest context + N + 64).
Microseconds per call (CUDA-graph replay of 10 calls) of the loop, of the batched launch with
max_kv = the longest row's keys (what `attend` passes in an eager round), and with max_kv = the
row's slot count (what one graph per batch bucket would pass), that last one also with every row
split alike over max_kv (`balance_rows` False, `batched_slots_uniform_us`) and by the rows' own keys
(True, `batched_slots_balanced_us`; the default takes one of the two), beside the floor max(KV
bytes / bandwidth, FLOPs / peak) at this GPU's measured copy bandwidth and bf16 matmul rate. Each row also gives the key split each way: the longest
row's programs a KV head x key tiles each (`plan`). `--plan-only` prints those alone, for
`--sms` SMs, without a GPU.
"""
from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import replace

import torch

from benchmarks.round_latency import measure_ceilings
from ddtree.bench.machine import git_revision, results_path
from ddtree.bench.timing import median_replay_ms
from ddtree.engine import capture_graph
from ddtree.kernels.attention_plan import plan, plan_rows, row_items, tiling
from ddtree.kernels.tree_attention import batched_masked_attention, masked_attention
from ddtree.tree import build_tree

MIXED = (100, 3000, 17, 40000)


def contexts_of(kind: str, rows: int) -> list[int]:
    """Each row's context for --contexts' `kind`: a number, `mixed` or `skewed`."""
    if kind == "mixed":
        return [MIXED[i % len(MIXED)] for i in range(rows)]
    if kind == "skewed":
        return [32768] + [512] * (rows - 1)
    return [int(kind)] * rows


def call_us(fn) -> float:
    graph, _ = capture_graph(lambda: [fn() for _ in range(10)])
    return median_replay_ms(graph, 20) * 100


def split_plans(contexts: list[int], n: int, row_slots: int, group: int, hkv: int, d: int, sms: int) -> dict:
    """The longest row's key split, [programs a KV head, key tiles each], as the batched launch
    plans it over max_kv = row_slots: alike for every row (uniform) and by the rows' keys
    (balanced, what it takes from BALANCE_MIN_KEYS on)."""
    rows, r, longest = n * group, len(contexts), max(contexts) + n
    config = tiling(rows, row_slots, d, r)
    _, splits = plan(rows, hkv * r, row_slots, sms, config)
    per_split = -(-(-(-row_slots // splits)) // config.block_n) * config.block_n
    _, slots = plan_rows(rows, hkv, r, row_slots, sms, config)
    items = row_items([c + n for c in contexts], config.block_n, slots)[contexts.index(max(contexts))]
    return {"uniform": [-(-longest // per_split), per_split // config.block_n], "balanced": list(items[1:])}


def case(r: int, n: int, contexts: list[int], row_slots: int, hq: int, hkv: int, d: int):
    gen = torch.Generator(device="cuda").manual_seed(r * 1000 + n)
    q = torch.randn(r * n, hq, d, device="cuda", generator=gen, dtype=torch.bfloat16)
    cache = torch.randn(2, r * row_slots, hkv, d, device="cuda", generator=gen, dtype=torch.bfloat16)
    blocks = []
    for _ in range(r):
        logp = torch.log_softmax(torch.randn(15, 1000, device="cuda", generator=gen), dim=-1)
        blocks.append(build_tree(logp, torch.tensor(1, device="cuda"), n - 1).visible if n > 1
                      else torch.ones(1, 1, dtype=torch.bool, device="cuda"))
    block = torch.stack(blocks)
    prefix = torch.tensor(contexts, device="cuda")
    first = torch.arange(r, device="cuda") * row_slots
    return q, cache[0], cache[1], block, prefix, first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--tokens", default="1,17,65")
    ap.add_argument("--contexts", default="512,mixed", help="each row's context: a number, 'mixed' or 'skewed'")
    ap.add_argument("--heads", default="32,8,128", help="query heads, KV heads, head_dim")
    ap.add_argument("--row-slots", type=int, default=None)
    ap.add_argument("--output", default=None)
    ap.add_argument("--plan-only", action="store_true", help="print each case's key splits alone (no GPU)")
    ap.add_argument("--sms", type=int, default=132, help="with --plan-only: the GPU's SMs (an H200's)")
    args = ap.parse_args()
    hq, hkv, d = (int(x) for x in args.heads.split(","))
    cases = list(itertools.product(args.contexts.split(","), map(int, args.rows.split(",")),
                                   map(int, args.tokens.split(","))))
    if args.plan_only:
        for ctx, r, n in cases:
            contexts = contexts_of(ctx, r)
            plans = split_plans(contexts, n, args.row_slots or max(contexts) + n + 64, hq // hkv, hkv, d, args.sms)
            print(json.dumps({"contexts": ctx, "rows": r, "tokens": n, **plans}))
        return
    ceilings = measure_ceilings(torch.device("cuda"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = []
    for ctx, r, n in cases:
        contexts = contexts_of(ctx, r)
        row_slots = args.row_slots or max(contexts) + n + 64
        q, k, v, block, prefix, first = case(r, n, contexts, row_slots, hq, hkv, d)
        scale = d**-0.5
        alone = [(q[b * n:(b + 1) * n], k[b * row_slots:b * row_slots + contexts[b] + n],
                  v[b * row_slots:b * row_slots + contexts[b] + n], block[b], prefix[b]) for b in range(r)]

        def loop():
            return [masked_attention(qb, kb, vb, blk, scale, prefix_len=p) for qb, kb, vb, blk, p in alone]

        tight = max(contexts) + n
        uniform = replace(tiling(n * hq // hkv, row_slots, d, r), balance_rows=False)
        kv_bytes = sum(2 * (c + n) * hkv * d * 2 for c in contexts)
        flops = sum(4 * n * (c + n) * d * hq for c in contexts)
        row = {"contexts": contexts, "rows": r, "tokens": n, "row_slots": row_slots,
               "split": split_plans(contexts, n, row_slots, hq // hkv, hkv, d, sms),
               "floor_us": max(kv_bytes / ceilings["bandwidth_Bps"], flops / ceilings["bf16_flops"]) * 1e6,
               "loop_us": call_us(loop),
               "batched_tight_us": call_us(lambda: batched_masked_attention(q, k, v, block, scale, prefix, first,
                                                                            tight)),
               "batched_slots_us": call_us(lambda: batched_masked_attention(q, k, v, block, scale, prefix, first,
                                                                            row_slots)),
               "batched_slots_uniform_us": call_us(lambda: batched_masked_attention(
                   q, k, v, block, scale, prefix, first, row_slots, config=uniform)),
               "batched_slots_balanced_us": call_us(lambda: batched_masked_attention(
                   q, k, v, block, scale, prefix, first, row_slots, config=replace(uniform, balance_rows=True)))}
        results.append(row)
        print(f"ctx {ctx:>6} R={r:3d} N={n:4d}  floor {row['floor_us']:8.1f}  loop {row['loop_us']:8.1f}  "
              f"batched {row['batched_tight_us']:8.1f} (max_kv {tight})  {row['batched_slots_us']:8.1f} "
              f"(max_kv {row_slots}; uniform split {row['batched_slots_uniform_us']:8.1f}, balanced "
              f"{row['batched_slots_balanced_us']:8.1f}) us", flush=True)
    out = results_path(args.output, "batched_attention")
    out.write_text(json.dumps({
        "benchmark": "batched_attention", "command": "python benchmarks/batched_attention.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v not in (None, False)),
        "heads": [hq, hkv, d], "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "ceilings": ceilings, "git_revision": git_revision(), "rows": results}, indent=2))


if __name__ == "__main__":
    with torch.inference_mode():
        main()
