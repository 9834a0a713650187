"""SwiGLU over a fused gate/up output: the Triton kernel (`ddtree.kernels.swiglu`) against
Inductor's kernel for `hybrid.swiglu` compiled with dynamic shapes, as the hybrid glue compiles it.

    python benchmarks/swiglu.py [--rows 1,17,65,257] [--width 17408] [--output FILE.json]

Microseconds per call: the median replay of a CUDA graph of 64 calls (as a forward's 64 MLPs), each
on its own input, beside the floor: bytes moved (read 2 I, write I, bf16) over the measured copy
bandwidth. Also the largest difference between the two outputs.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from benchmarks.round_latency import measure_ceilings
from ddtree.bench.machine import git_revision, machine_info, results_path
from ddtree.bench.timing import median_replay_ms
from ddtree.engine import capture_graph
from ddtree.kernels import swiglu as swiglu_kernel
from ddtree.models import hybrid

CALLS = 64


def per_call_us(fn, inputs) -> float:
    graph, _ = capture_graph(lambda: [fn(x) for x in inputs])
    return median_replay_ms(graph, 20) * 1000 / len(inputs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,17,65,257")
    ap.add_argument("--width", type=int, default=17408, help="the intermediate size I (Qwen3.6-27B: 17408)")
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    ceilings = measure_ceilings(torch.device("cuda"))
    inductor = torch.compile(hybrid.swiglu, dynamic=True, fullgraph=True)
    rows_out = []
    for n in (int(x) for x in args.rows.split(",")):
        inputs = [torch.randn(n, 2 * args.width, device="cuda", dtype=torch.bfloat16) for _ in range(CALLS)]
        diff = (swiglu_kernel.swiglu(inputs[0]).float() - inductor(inputs[0]).float()).abs().max().item()
        row = {"rows": n, "floor_us": 3 * n * args.width * 2 / ceilings["bandwidth_Bps"] * 1e6,
               "inductor_us": per_call_us(inductor, inputs), "kernel_us": per_call_us(swiglu_kernel.swiglu, inputs),
               "max_abs_diff": diff}
        print(f"N={n:<4} floor {row['floor_us']:6.2f} us  inductor {row['inductor_us']:6.2f} us  "
              f"kernel {row['kernel_us']:6.2f} us  max |diff| {diff:.3g}", flush=True)
        rows_out.append(row)
    out = results_path(args.output, "swiglu")
    out.write_text(json.dumps({"benchmark": "swiglu", "command": "python " + " ".join(sys.argv),
                               "machine": machine_info("cuda"), "git_revision": git_revision(),
                               "width": args.width, "calls_per_graph": CALLS, "ceilings": ceilings,
                               "rows": rows_out}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
