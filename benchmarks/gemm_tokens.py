"""cuBLAS bf16 projection time by token count at Qwen3.6-27B's (or Qwen3-8B's) shapes: what a verify
of N tokens pays in its matmuls over one of a single token (they read the same weights).

    python -m benchmarks.gemm_tokens OUTPUT.json [--tokens 1,16,17,48,64,65,72,80,96,128] [--tunableop]
        [--blas cublas,cublaslt] [--shape qwen3.6-27b|qwen3-8b]

Each shape is `F.linear(x [M, K], W [N, K])`, 64 calls over 8 weight copies (no L2 reuse) in one
CUDA graph, timed as the median of 5 replays; the weights' bytes over that time are the rate.
With --tunableop each shape is timed again with PyTorch's TunableOp on (`torch.cuda.tunable`):
its first calls, before the capture, time every cuBLAS / cuBLASLt algorithm for that shape and
keep the fastest, which the capture then records ("tuned_us"; its choices under "tunableop_results").
On CUDA builds TunableOp has only cuBLAS's default solution, so "tuned_us" measures its overhead.
--blas times every shape under each library PyTorch can route a bf16 matmul through
(`torch.backends.cuda.preferred_blas_library`): cuBLAS's gemm and cuBLASLt's heuristic choice
pick different kernels for the same skinny shape; `inductor` there is `torch.compile`'s
max-autotune choice (its Triton GEMM templates or cuBLAS, whichever it timed fastest).
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
# Qwen3-8B's (--shape qwen3-8b): MLP gate+up and down, attention q, k, v and o, the LM head.
SHAPES_8B = {"gate_up": (4096, 24576), "down": (12288, 4096), "attn_qkv": (4096, 4096 + 2048), "attn_o": (4096, 4096),
             "lm_head": (4096, 151936)}


def time_linear(k: int, n: int, m: int, copies: int = 8, calls: int = 64, tuned: bool = False,
                inductor: bool = False) -> float:
    """us per call of x [m, k] @ W.T for W [n, k] in bf16 (tuned: with TunableOp on, tuning in the
    warm-up calls; inductor: through `torch.compile`'s max-autotune, which times its Triton GEMM
    templates against cuBLAS for this shape and keeps the fastest)."""
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    linear = torch.nn.functional.linear
    if inductor:
        torch._dynamo.reset()
        linear = torch.compile(linear, mode="max-autotune-no-cudagraphs", dynamic=False)
    torch.cuda.tunable.enable(tuned)
    torch.cuda.tunable.tuning_enable(tuned)
    try:
        return graph_call_us(lambda i: linear(x, weights[i % copies]), calls, warm=copies)
    finally:
        torch.cuda.tunable.enable(False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("output")
    p.add_argument("--tokens", default="1,16,17,48,64,65,72,80,96,128")
    p.add_argument("--tunableop", action="store_true", help="also time each shape with TunableOp's choice")
    p.add_argument("--blas", default=None,
                   help="libraries to time each shape under, comma-separated: cublas, cublaslt, inductor")
    p.add_argument("--shape", choices=["qwen3.6-27b", "qwen3-8b"], default="qwen3.6-27b")
    args = p.parse_args()
    shapes = SHAPES if args.shape == "qwen3.6-27b" else SHAPES_8B
    tokens = [int(t) for t in args.tokens.split(",")]
    libraries = args.blas.split(",") if args.blas else [None]
    rows = []
    for library in libraries:
        if library not in (None, "inductor"):
            torch.backends.cuda.preferred_blas_library(library)
        for name, (k, n) in shapes.items():
            for m in tokens:
                us = time_linear(k, n, m, inductor=library == "inductor")
                rows.append({"shape": name, "K": k, "N": n, "tokens": m, "us": us, "weight_GBps": k * n * 2 / us / 1e3})
                if library is not None:
                    rows[-1]["blas"] = library
                tuned = ""
                if args.tunableop:
                    rows[-1]["tuned_us"] = time_linear(k, n, m, tuned=True)
                    tuned = f"  tuned {rows[-1]['tuned_us']:8.1f} us (x{us / rows[-1]['tuned_us']:.2f})"
                print(f"{library or '':8s} {name:9s} K={k:5d} N={n:5d} M={m:4d} {us:8.1f} us "
                      f"{rows[-1]['weight_GBps']:7.0f} GB/s{tuned}", flush=True)
            torch.cuda.empty_cache()
    out = {"benchmark": "gemm_tokens", "command": f"python -m benchmarks.gemm_tokens {args.output} --tokens {args.tokens}"
           + (" --tunableop" if args.tunableop else "") + (f" --blas {args.blas}" if args.blas else "") + f" --shape {args.shape}",
           "machine": machine_info(torch.device("cuda")), "git_revision": git_revision(), "rows": rows}
    if args.tunableop:
        out["tunableop_results"] = [list(map(str, r)) for r in torch.cuda.tunable.get_results()]
    with open(args.output, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
