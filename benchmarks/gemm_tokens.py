"""cuBLAS bf16 projection time by token count at Qwen3.6-27B's shapes: what a verify of N tokens
pays in its matmuls over one of a single token (they read the same weights).

    python -m benchmarks.gemm_tokens OUTPUT.json [--tokens 1,16,17,48,64,65,72,80,96,128]

Each shape is `F.linear(x [M, K], W [N, K])`, 64 calls over 8 weight copies (no L2 reuse) in one
CUDA graph, timed as the median of 5 replays; the weights' bytes over that time are the rate.
"""
from __future__ import annotations

import argparse
import json

import torch

from ddtree.bench.machine import git_revision, machine_info
from ddtree.bench.timing import graph_call_us

# (K, N) of the 27B target's projections: MLP gate+up and down, a Gated DeltaNet layer's input
# (q, k, v, z, then b and a) and output, a gated attention layer's q (with its gate), k, v and o.
SHAPES = {"gate_up": (5120, 34816), "down": (17408, 5120), "gdn_in": (5120, 16384 + 96), "gdn_out": (6144, 5120),
          "attn_qkv": (5120, 12288 + 2048), "attn_o": (6144, 5120)}


def time_linear(k: int, n: int, m: int, copies: int = 8, calls: int = 64) -> float:
    """us per call of x [m, k] @ W.T for W [n, k] in bf16."""
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    return graph_call_us(lambda i: torch.nn.functional.linear(x, weights[i % copies]), calls, warm=copies)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("output")
    p.add_argument("--tokens", default="1,16,17,48,64,65,72,80,96,128")
    args = p.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = []
    for name, (k, n) in SHAPES.items():
        for m in tokens:
            us = time_linear(k, n, m)
            rows.append({"shape": name, "K": k, "N": n, "tokens": m, "us": us, "weight_GBps": k * n * 2 / us / 1e3})
            print(f"{name:9s} K={k:5d} N={n:5d} M={m:4d} {us:8.1f} us {rows[-1]['weight_GBps']:7.0f} GB/s", flush=True)
        torch.cuda.empty_cache()
    out = {"benchmark": "gemm_tokens", "command": f"python -m benchmarks.gemm_tokens {args.output} --tokens {args.tokens}",
           "machine": machine_info(torch.device("cuda")), "git_revision": git_revision(), "rows": rows}
    with open(args.output, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
