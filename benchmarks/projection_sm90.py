"""The Gluon projection kernel (`ddtree/kernels/projection_sm90.py`, sm_90 only) against cuBLAS at a
target's projections, by row count, beside the weights' bytes at the copy rate.

    python benchmarks/projection_sm90.py OUTPUT.json [--tokens 1,17,65] [--shape qwen3-8b] [--names ...]

Each (projection, rows) is timed as `benchmarks.gemm_tokens` times cuBLAS: 64 calls over 8 weight
copies (no L2 reuse) in one CUDA graph, the median of 5 replays, in turns (cuBLAS, the kernel,
cuBLAS, ...: `--repeats` passes); `--configs` times the kernel at each of several tilings
(`tiling`'s overrides; the first is the one `ours_us` reports). The projections that add into the
residual stream (o, down) are timed so: cuBLAS's `addmm_` into the output, the kernel's
`accumulate`. cuBLAS's output and the kernel's at each tiling are checked against a float32
product first (`max_abs_error`). The kernel runs as a programmatic dependent launch (its first
weight tiles copied while the call before it ends), which cuBLAS's calls do not.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F

from benchmarks.round_latency import measure_ceilings
from ddtree.bench.machine import git_revision, machine_info
from ddtree.bench.timing import graph_call_us
from ddtree.kernels.projection_sm90 import projection, tiling

# (K, N, adds into its output) of each target's projections.
SHAPES = {
    "qwen3-8b": {"gate_up": (4096, 24576, False), "down": (12288, 4096, True), "qkv": (4096, 6144, False),
                 "o": (4096, 4096, True)},
    "qwen3.6-27b": {"gate_up": (5120, 34816, False), "down": (17408, 5120, True), "qkv": (5120, 14336, False),
                    "o": (6144, 5120, True)},
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("output")
    p.add_argument("--tokens", default="1,17,65")
    p.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    p.add_argument("--names", default="")
    p.add_argument("--copies", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--configs", default="[{}]", help="a JSON list of tiling overrides, each timed")
    args = p.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    info = machine_info(dev)
    ceilings = measure_ceilings(dev)
    bandwidth = ceilings["bandwidth_Bps"]
    names = [n for n in args.names.split(",") if n] or list(SHAPES[args.shape])
    configs = json.loads(args.configs)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows = []
    for name in names:
        k, n, adds = SHAPES[args.shape][name]
        weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(args.copies)]
        for m in [int(t) for t in args.tokens.split(",")]:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            out = torch.zeros(m, n, device=dev, dtype=torch.bfloat16)
            want = x.float() @ weights[0].float().T
            err = {"cublas": float((F.linear(x, weights[0]).float() - want).abs().max()),
                   "ours": [float((projection(x, weights[0], config=config).float() - want).abs().max())
                            for config in configs], "scale": float(want.abs().max())}

            def cublas(i, x=x, out=out):
                if adds:
                    out.addmm_(x, weights[i % args.copies].T)
                else:
                    torch.matmul(x, weights[i % args.copies].T, out=out)

            def ours(i, x=x, out=out, config=None):
                projection(x, weights[i % args.copies], out, accumulate=adds, config=config)

            times = {"cublas": [], **{c: [] for c in range(len(configs))}}
            for _ in range(args.repeats):
                times["cublas"].append(graph_call_us(cublas))
                for c, config in enumerate(configs):
                    times[c].append(graph_call_us(lambda i, config=config: ours(i, config=config)))
            med = {key: round(statistics.median(v), 2) for key, v in times.items()}
            floor = round(n * k * 2 / bandwidth * 1e6, 2)  # the weight's bytes at the copy rate
            row = {"name": name, "tokens": m, "n": n, "k": k, "adds": adds, "cublas_us": med["cublas"],
                   "ours_us": med[0], "floor_us": floor, "cublas_all_us": times["cublas"],
                   "configs": [{"config": config, "tiling": tiling(m, n, k, sms, config), "us": med[c],
                                "all_us": times[c]} for c, config in enumerate(configs)],
                   "max_abs_error": err}
            rows.append(row)
            print(json.dumps({"name": name, "tokens": m, "cublas_us": med["cublas"], "floor_us": floor,
                              "ours_us": [med[c] for c in range(len(configs))]}), flush=True)
    result = {"benchmark": "projection_sm90", "command": "python benchmarks/projection_sm90.py " + " ".join(
        sys.argv[1:]), "machine": info, "ceilings": ceilings, "git_revision": git_revision(), "shape": args.shape,
        "rows": rows}
    with open(args.output, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
