"""Device time of each tree-attention launch (the attention and, where the keys are split and the
partial sums are many, the combine), per layer, as a verify sees them: one call per layer over
`--layers` distinct KV caches in turn (so L2 holds none of them), under torch.profiler.

    python benchmarks/attention_profile.py OUT.json [--heads 24,4,256] [--context 8192] [--tokens 1,17,65]
        [--layers 16] [--variants default,pps1,pps2,pps4,tiled]

Variants of each shape's own tiling (`attention_plan.tiling`): `default` as it is, `ppsK` with K
programs per SM (the key splits follow), `tiled` / `split` with the combine launch's tiled or
split-at-a-time form forced (`AttentionConfig.combine_tiled`; by default tiled only for one
token). Trees as benchmarks/attention_configs.py makes them. GPU only.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace

import torch
from torch.profiler import ProfilerActivity, profile

from ddtree.bench.machine import git_revision, machine_info, results_path
from ddtree.kernels.attention_plan import tiling
from ddtree.kernels.tree_attention import masked_attention
from ddtree.tree import build_tree

BUCKET = 256


def variant(config, name: str):
    if name == "default":
        return config
    if name in ("tiled", "split"):
        return replace(config, combine_tiled=name == "tiled")
    if name.startswith("pps"):
        return replace(config, programs_per_sm=int(name[3:]))
    raise ValueError(f"unknown variant {name!r}: default, tiled, split or ppsK")


def case(heads: tuple[int, int, int], context: int, n: int, layers: int, name: str, repeats: int = 5) -> dict:
    hq, hkv, d = heads
    kv_len = -(-(context + n) // BUCKET) * BUCKET
    gen = torch.Generator(device="cuda").manual_seed(n)
    q = torch.randn(n, hq, d, device="cuda", generator=gen, dtype=torch.bfloat16)
    caches = [torch.randn(2, kv_len, hkv, d, device="cuda", generator=gen, dtype=torch.bfloat16)
              for _ in range(layers)]
    logp = torch.log_softmax(torch.randn(15, 1000, device="cuda", generator=gen), dim=-1)
    block = (build_tree(logp, torch.tensor(1, device="cuda"), n - 1).visible if n > 1
             else torch.ones(1, 1, dtype=torch.bool, device="cuda"))
    prefix = torch.tensor(context, device="cuda")
    config = variant(tiling(n * (hq // hkv), kv_len, d), name)

    def run():
        for cache in caches:
            masked_attention(q, cache[0], cache[1], block, d ** -0.5, prefix_len=prefix, config=config)

    for _ in range(3):  # compile and warm
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            run()
        torch.cuda.synchronize()
    kernels = {}
    for event in prof.key_averages():
        total = getattr(event, "device_time_total", 0) or getattr(event, "cuda_time_total", 0)
        if total and event.count:
            kernels[event.key] = total / (repeats * layers)
    return {"heads": list(heads), "context": context, "tokens": n, "variant": name, "config": asdict(config),
            "us_per_layer": kernels, "total_us_per_layer": sum(kernels.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("output", nargs="?", default=None)
    ap.add_argument("--heads", default="24,4,256", help="query heads, KV heads, head_dim")
    ap.add_argument("--context", default="8192", help="cached tokens before the tree, comma-separated")
    ap.add_argument("--tokens", default="1,17,65", help="tree sizes N")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--variants", default="default,tiled,split")
    args = ap.parse_args()
    heads = tuple(int(x) for x in args.heads.split(","))
    rows = []
    for context in map(int, args.context.split(",")):
        for n in map(int, args.tokens.split(",")):
            for name in args.variants.split(","):
                row = case(heads, context, n, args.layers, name)
                rows.append(row)
                cells = "  ".join(f"{k[:16]} {v:7.2f}" for k, v in row["us_per_layer"].items())
                print(f"ctx {context:6d} N={n:5d} {name:8s} total {row['total_us_per_layer']:7.2f} us  ({cells})",
                      flush=True)
    out = results_path(args.output, "attention_profile")
    out.write_text(json.dumps({"benchmark": "attention_profile", "command": "python " + " ".join(sys.argv),
                               "machine": machine_info("cuda"), "git_revision": git_revision(), "rows": rows},
                              indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
