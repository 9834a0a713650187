"""The few-row projection kernel (`ddtree.kernels.skinny_gemm`) against cuBLAS (`F.linear`) at the
target shapes' projections, by row count, over a sweep of its tilings.

    python -m benchmarks.skinny_gemm OUTPUT.json [--tokens 1,17,65] [--shapes qwen3.6-27b,qwen3-8b] [--names gate_up,down]

Each (shape, rows, tiling) is timed as `benchmarks.gemm_tokens` times cuBLAS: 64 calls over 8
weight copies (no L2 reuse) in one CUDA graph, the median of 5 replays; the weight's bytes over
that time are the rate. Every tiling's output is checked against F.linear's (the largest error
relative to the output's largest value) before it is timed. Prints, per shape and row count,
cuBLAS, the default tiling and the best one; OUTPUT keeps every timing.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace

import torch
import torch.nn.functional as F

from benchmarks.gemm_tokens import SHAPES as SHAPES_27B
from ddtree.bench.machine import git_revision, machine_info
from ddtree.bench.timing import graph_call_us
from triton.runtime.errors import OutOfResources

from ddtree.kernels.skinny_gemm import DEFAULT, skinny_linear

# (K, N) of Qwen3-8B's projections (hidden 4096, MLP 12288, 32 query and 8 KV heads of 128) and of
# each target's lm_head (a verify's logits read it too).
SHAPES_8B = {"gate_up": (4096, 24576), "down": (12288, 4096), "qkv": (4096, 6144), "o": (4096, 4096),
             "lm_head": (4096, 151936)}
SHAPES = {"qwen3.6-27b": {**SHAPES_27B, "lm_head": (5120, 248320)}, "qwen3-8b": SHAPES_8B}
TILINGS = [DEFAULT, replace(DEFAULT, block_n=128), replace(DEFAULT, block_n=128, programs_per_sm=1, num_warps=8),
           replace(DEFAULT, programs_per_sm=4), replace(DEFAULT, block_n=128, block_k=64, num_stages=5),
           replace(DEFAULT, block_n=256, block_k=64, programs_per_sm=1, num_warps=8),
           replace(DEFAULT, block_k=256, num_stages=3), replace(DEFAULT, block_n=32, block_k=256, programs_per_sm=4,
                                                                num_stages=3),
           # Wide column tiles read x (from L2) fewer times, as cuBLAS's 384-column tiles do at 65 rows.
           replace(DEFAULT, block_n=256, programs_per_sm=1, num_warps=8, num_stages=3),
           replace(DEFAULT, block_n=128, programs_per_sm=1, num_warps=8, num_stages=3),
           # At 65 rows x's tile is 128 rows: shorter steps, deeper pipeline, within the shared memory.
           replace(DEFAULT, block_k=64, num_stages=6)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("output")
    p.add_argument("--tokens", default="1,17,65")
    p.add_argument("--shapes", default="qwen3.6-27b,qwen3-8b")
    p.add_argument("--copies", type=int, default=8)
    p.add_argument("--names", default="", help="only these projections (comma-separated, e.g. gate_up,down)")
    args = p.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = []
    for model in args.shapes.split(","):
        for name, (k, n) in SHAPES[model].items():
            if args.names and name not in args.names.split(","):
                continue
            copies = max(2, min(args.copies, int(4e9 // (k * n * 2))))  # the lm_heads: fewer copies
            weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            for m in tokens:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                reference = F.linear(x, weights[0]).float()
                row = {"model": model, "shape": name, "K": k, "N": n, "tokens": m, "weight_bytes": k * n * 2,
                       "cublas_us": graph_call_us(lambda i: F.linear(x, weights[i % copies])), "tilings": []}
                for tiling in TILINGS:
                    try:
                        err = float((skinny_linear(x, weights[0], tiling).float() - reference).abs().max()
                                    / reference.abs().max())
                    except OutOfResources as exc:  # its tiles of x and w do not fit in shared memory at m rows
                        row["tilings"].append({**asdict(tiling), "us": None, "skipped": str(exc)})
                        continue
                    us = graph_call_us(lambda i: skinny_linear(x, weights[i % copies], tiling))
                    row["tilings"].append({**asdict(tiling), "us": us, "relative_error": err})
                timed = [t for t in row["tilings"] if t["us"] is not None]
                best = min(timed, key=lambda t: t["us"])
                default_us = row["tilings"][0]["us"]
                gbps = lambda us: k * n * 2 / us / 1e3  # noqa: E731
                print(f"{model:11s} {name:8s} K={k:5d} N={n:6d} M={m:3d}  cuBLAS {row['cublas_us']:7.1f} us "
                      f"({gbps(row['cublas_us']):5.0f} GB/s)  default {default_us or float('nan'):7.1f}  best "
                      f"{best['us']:7.1f} ({gbps(best['us']):5.0f} GB/s, x{row['cublas_us'] / best['us']:.2f}) "
                      f"n{best['block_n']} k{best['block_k']} p{best['programs_per_sm']} w{best['num_warps']} "
                      f"s{best['num_stages']}  err {max(t['relative_error'] for t in timed):.1e}  "
                      f"({len(row['tilings']) - len(timed)} tilings too big)", flush=True)
                rows.append(row)
                write(args, rows)  # as it goes: a run cut short keeps what it timed
            del weights
            torch.cuda.empty_cache()


def write(args, rows: list[dict]) -> None:
    out = {"benchmark": "skinny_gemm", "command": "python -m benchmarks.skinny_gemm " + " ".join(
        [args.output, "--tokens", args.tokens, "--shapes", args.shapes] + (["--names", args.names] if args.names else [])),
        "machine": machine_info(torch.device("cuda")), "git_revision": git_revision(), "rows": rows}
    with open(args.output, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
