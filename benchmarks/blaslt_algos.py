"""Every kernel cuBLASLt's heuristic offers for a projection, timed against PyTorch's own call.

    python -m benchmarks.blaslt_algos OUTPUT.json [--tokens 65,257] [--shape qwen3-8b|qwen3.6-27b]

Each shape is timed as the engine calls it: `y.addmm_(x, W.t())` (the residual added in place)
for the o and down projections of Qwen3-8B's folded layers, `F.linear(x, W)` for the rest (every
projection of the hybrid Qwen3.6-27B, whose norms are not folded), the LM head with float32
logits as the engine asks for them (`torch.mm(..., out_dtype=torch.float32)`). Then each of
cuBLASLt's candidates for the same call (`ddtree.kernels.blaslt`), checked against PyTorch's
output first (`blaslt.time_candidates`). Timing as `benchmarks/gemm_tokens.py`: 64 calls over 8
weight copies (no L2 reuse) in one CUDA graph, the median of 5 replays.
"""
from __future__ import annotations

import argparse
import json

import torch

from benchmarks.gemm_tokens import SHAPES, SHAPES_8B
from ddtree.bench.machine import git_revision, machine_info
from ddtree.kernels.blaslt import time_candidates

ACCUMULATE_8B = {"down", "attn_o"}  # a folded dense layer's residual adds


def time_shape(name: str, k: int, n: int, m: int, accumulate: bool, copies: int = 8) -> dict:
    out_dtype = torch.float32 if name == "lm_head" else torch.bfloat16  # the engine's logits are float32
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = torch.zeros(m, n, device="cuda", dtype=out_dtype)
    _, torch_us, timed = time_candidates(x, w, y, accumulate, out_dtype, copies=copies,
                                         timing={"calls": 64, "warm": copies, "repeats": 5})
    rows = [{"index": i, "us": t.us, "rel_err": t.rel_err, "workspace": t.candidate.workspace,
             "waves": t.candidate.waves, **t.candidate.config} for i, t in enumerate(timed)]
    agreed = [r for r in rows if r["us"] is not None]
    best = min(agreed, key=lambda r: r["us"]) if agreed else None
    return {"shape": name, "K": k, "N": n, "tokens": m, "accumulate": accumulate,
            "float32_out": out_dtype == torch.float32, "torch_us": torch_us,
            "lt_first_us": rows[0]["us"] if rows else None,
            "best_us": best["us"] if best else None, "best_index": best["index"] if best else None,
            "weights_us_at_4p24": k * n * 2 / 4.24e6, "candidates": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("output")
    p.add_argument("--tokens", default="65,257")
    p.add_argument("--shape", choices=["qwen3.6-27b", "qwen3-8b"], default="qwen3-8b")
    args = p.parse_args()
    shapes = SHAPES if args.shape == "qwen3.6-27b" else SHAPES_8B
    results = []
    for name, (k, n) in shapes.items():
        for m in (int(t) for t in args.tokens.split(",")):
            r = time_shape(name, k, n, m, args.shape == "qwen3-8b" and name in ACCUMULATE_8B)
            results.append(r)
            best = f"{r['best_us']:7.1f} us (#{r['best_index']})" if r["best_us"] else "none"
            print(f"{name:9s} M={m:4d} torch {r['torch_us']:7.1f} us  lt first {r['lt_first_us'] or 0:7.1f}  "
                  f"best {best} of {len(r['candidates'])}", flush=True)
            torch.cuda.empty_cache()
    out = {"benchmark": "blaslt_algos", "command": f"python -m benchmarks.blaslt_algos {args.output} --tokens "
           f"{args.tokens} --shape {args.shape}",
           "machine": machine_info(torch.device("cuda")), "git_revision": git_revision(), "rows": results}
    with open(args.output, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
