"""Every kernel cuBLASLt's heuristic offers for a projection, timed against PyTorch's own call.

    python -m benchmarks.blaslt_algos OUTPUT.json [--tokens 65,257] [--shape qwen3-8b|qwen3.6-27b]
        [--search SECONDS] [--names down,attn_o]

Each shape is timed as the engine calls it: `y.addmm_(x, W.t())` (the residual added in place)
for the o and down projections of Qwen3-8B's folded layers, `F.linear(x, W)` for the rest (every
projection of the hybrid Qwen3.6-27B, whose norms are not folded), the LM head with float32
logits as the engine asks for them (`torch.mm(..., out_dtype=torch.float32)`). Then each of
cuBLASLt's candidates for the same call (`ddtree.kernels.blaslt`), checked against PyTorch's
output first (`blaslt.time_candidates`). Timing as `benchmarks/gemm_tokens.py`: 64 calls over 8
weight copies (no L2 reuse) in one CUDA graph, the median of 5 replays.

With `--search`, also every configuration cuBLASLt accepts for the call (`blaslt_search.search`,
SECONDS a shape), each timed once in eager calls (`blaslt_search.screen`), the fastest `--keep`
of them checked against PyTorch's output and timed as the heuristic's are.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.gemm_tokens import SHAPES, SHAPES_8B
from ddtree.bench.machine import git_revision, machine_info
from ddtree.kernels import blaslt_search
from ddtree.kernels.blaslt import _agrees, _torch_linear, time_candidates
from ddtree.kernels.graph_timing import graph_call_us

ACCUMULATE_8B = {"down", "attn_o"}  # a folded dense layer's residual adds


def time_searched(plan, x, w, y, accumulate: bool, out_dtype, seconds: float, keep: int, bases,
                  copies: int = 8) -> dict:
    """The searched configurations: counts, and the fastest `keep` of the screen timed in a graph."""
    search_s = time.monotonic()
    found, counts = blaslt_search.search(plan, seconds=seconds, bases=bases)
    search_s = time.monotonic() - search_s
    weights = [w] + [w.clone() for _ in range(copies - 1)]
    scratch = y.clone()
    screened = blaslt_search.screen(plan, found, x, weights, scratch)
    want = _torch_linear(x, w, None, False, out_dtype).float()
    rows = []
    for screen_us, cand in screened[:keep]:
        err, agrees = _agrees(plan, cand, x, w, want, out_dtype)
        us = graph_call_us(lambda i: plan(x, weights[i % copies], scratch, cand), calls=64, warm=copies,
                           repeats=5) if agrees else None
        rows.append({"screen_us": screen_us, "us": us, "rel_err": err, "workspace": cand.workspace, **cand.config})
    agreed = [r for r in rows if r["us"] is not None]
    best = min(agreed, key=lambda r: r["us"], default=None)
    return {"search_s": search_s, **counts, "screened": len(screened), "best_us": best["us"] if best else None,
            "best": best, "timed": rows}


def time_shape(name: str, k: int, n: int, m: int, accumulate: bool, copies: int = 8, search: float = 0.0,
               keep: int = 24) -> dict:
    out_dtype = torch.float32 if name == "lm_head" else torch.bfloat16  # the engine's logits are float32
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = torch.zeros(m, n, device="cuda", dtype=out_dtype)
    plan, torch_us, timed = time_candidates(x, w, y, accumulate, out_dtype, copies=copies,
                                         timing={"calls": 64, "warm": copies, "repeats": 5})
    rows = [{"index": i, "us": t.us, "rel_err": t.rel_err, "workspace": t.candidate.workspace,
             "waves": t.candidate.waves, **t.candidate.config} for i, t in enumerate(timed)]
    agreed = [r for r in rows if r["us"] is not None]
    best = min(agreed, key=lambda r: r["us"]) if agreed else None
    result = {"shape": name, "K": k, "N": n, "tokens": m, "accumulate": accumulate,
              "float32_out": out_dtype == torch.float32, "torch_us": torch_us,
              "lt_first_us": rows[0]["us"] if rows else None,
              "best_us": best["us"] if best else None, "best_index": best["index"] if best else None,
              "weights_us_at_4p24": k * n * 2 / 4.24e6, "candidates": rows}
    if search:
        result["search"] = time_searched(plan, x, w, y, accumulate, out_dtype, search, keep,
                                         [t.candidate for t in timed], copies)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("output")
    p.add_argument("--tokens", default="65,257")
    p.add_argument("--shape", choices=["qwen3.6-27b", "qwen3-8b"], default="qwen3-8b")
    p.add_argument("--names", default=None, help="projections to time (default: every one of the shape)")
    p.add_argument("--search", type=float, default=0.0, help="seconds a shape for the configurations' walk")
    p.add_argument("--keep", type=int, default=24, help="searched configurations timed in a graph")
    args = p.parse_args()
    shapes = SHAPES if args.shape == "qwen3.6-27b" else SHAPES_8B
    results = []
    names = args.names.split(",") if args.names else list(shapes)
    for name, (k, n) in shapes.items():
        if name not in names:
            continue
        for m in (int(t) for t in args.tokens.split(",")):
            r = time_shape(name, k, n, m, args.shape == "qwen3-8b" and name in ACCUMULATE_8B, search=args.search,
                           keep=args.keep)
            results.append(r)
            best = f"{r['best_us']:7.1f} us (#{r['best_index']})" if r["best_us"] else "none"
            found = r.get("search")
            searched = (f"  searched {found['best_us'] or 0:7.1f} us (of {found['accepted']} accepted, "
                        f"{found['checked']} checked, {found['ids']} ids, {found['search_s']:.0f} s): "
                        f"{found['best']}") if found else ""
            print(f"{name:9s} M={m:4d} torch {r['torch_us']:7.1f} us  lt first {r['lt_first_us'] or 0:7.1f}  "
                  f"best {best} of {len(r['candidates'])}{searched}", flush=True)
            torch.cuda.empty_cache()
    extra = (f" --names {args.names}" if args.names else "") + (
        f" --search {args.search:g} --keep {args.keep}" if args.search else "")
    out = {"benchmark": "blaslt_algos", "command": f"python -m benchmarks.blaslt_algos {args.output} --tokens "
           f"{args.tokens} --shape {args.shape}{extra}",
           "machine": machine_info(torch.device("cuda")), "git_revision": git_revision(), "rows": results}
    with open(args.output, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
