"""Where the target forward's time goes at Qwen3-8B shape (random bf16 weights), by token count.

    python benchmarks/verify_breakdown.py [--tokens 1,17,65,129,257] [--output FILE.json]

For each token count N (1 = an autoregressive step, B + 1 = a tree of budget B): the forward
replayed as a CUDA graph (median ms), and its kernels by kind (matmul, attention, the rest) from
torch.profiler over a few replays. Then each of the target's matrix shapes alone at every N,
as achieved TB/s (weight bytes / time) and TFLOP/s, against the same GPU's measured copy
bandwidth and bf16 matmul peak: this says whether a slow N is the matmuls' tile fit or the rest.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from ddtree.bench.machine import git_revision, results_path
from ddtree.bench.timing import median_replay_ms
from ddtree.engine import capture_graph
from ddtree.models.layers import AttentionMeta, logits_float32
from round_latency import build_models, measure_ceilings

CONTEXT = 512


def kernel_kind(name: str) -> str:
    n = name.lower()
    if "gemm" in n or "gemv" in n or "cutlass" in n or "sm90_xmma" in n or "nvjet" in n:
        return "matmul"
    if "attention" in n or "fmha" in n or "flash" in n or "softmax" in n or n == "_combine":
        return "attention"
    if n.startswith("triton"):
        return "fused elementwise (triton)"
    if "index" in n or "copy" in n or "gather" in n or "scatter" in n:
        return "index/copy"
    return "other"


def profile_graph(graph: torch.cuda.CUDAGraph, replays: int = 5) -> dict:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    by_kind: dict = defaultdict(lambda: {"kernels": 0.0, "us": 0.0})
    top = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", 0.0)
        if not us:
            continue
        kind = kernel_kind(e.key)
        by_kind[kind]["kernels"] += e.count / replays
        by_kind[kind]["us"] += us / replays
        top.append({"name": e.key[:120], "kind": kind, "calls": e.count / replays, "us": us / replays})
    top.sort(key=lambda r: -r["us"])
    return {"by_kind": dict(by_kind), "top": top[:12]}


def forward_rows(target, tokens_list) -> list[dict]:
    device = next(target.parameters()).device
    cache = target.new_cache(CONTEXT + 1100, device, torch.bfloat16)
    rows = []
    for n in tokens_list:
        kv_len = CONTEXT + n
        tokens = torch.randint(0, 150000, (n,), device=device)
        positions = CONTEXT + torch.arange(n, device=device)
        mask = torch.ones(n, kv_len, dtype=torch.bool, device=device)
        mask[:, CONTEXT:] = torch.ones(n, n, dtype=torch.bool, device=device).tril()

        def forward():
            meta = AttentionMeta(CONTEXT + torch.arange(n, device=device), kv_len, mask)
            return target(tokens, positions, meta, cache)

        graph, _ = capture_graph(forward)
        ms = median_replay_ms(graph, 30)
        prof = profile_graph(graph)
        kernel_us = sum(k["us"] for k in prof["by_kind"].values())
        row = {"tokens": n, "forward_ms": ms, "kernel_ms": kernel_us / 1000,
               "kernels": sum(k["kernels"] for k in prof["by_kind"].values()), **prof}
        rows.append(row)
        print(f"N={n:4d}  forward {ms:6.3f} ms  kernels {row['kernels']:.0f} ({row['kernel_ms']:.3f} ms)  "
              + "  ".join(f"{k} {v['us'] / 1000:.3f}" for k, v in sorted(prof["by_kind"].items())), flush=True)
    return rows


def matmul_rows(target, tokens_list, ceilings) -> list[dict]:
    layer = target.layers[0]
    shapes = {"qkv": layer.self_attn.qkv_proj.weight, "o": layer.self_attn.o_proj.weight,
              "gate_up": layer.mlp.gate_up_proj.weight, "down": layer.mlp.down_proj.weight,
              "lm_head": target.lm_head.weight}
    rows = []
    for name, w in shapes.items():
        for n in tokens_list:
            x = torch.randn(n, w.shape[1], device=w.device, dtype=w.dtype)
            fn = (lambda: logits_float32(x, w)) if name == "lm_head" else (lambda: torch.nn.functional.linear(x, w))
            graph, _ = capture_graph(lambda: [fn() for _ in range(10)])
            us = median_replay_ms(graph, 20) * 100
            tbps = w.numel() * 2 / (us * 1e-6) / 1e12
            tflops = 2 * w.numel() * n / (us * 1e-6) / 1e12
            floor_us = max(w.numel() * 2 / ceilings["bandwidth_Bps"], 2 * w.numel() * n / ceilings["bf16_flops"]) * 1e6
            rows.append({"shape": name, "out": w.shape[0], "in": w.shape[1], "tokens": n, "us": us,
                         "TBps": tbps, "TFLOPs": tflops, "floor_us": floor_us, "x_floor": us / floor_us})
            print(f"{name:>8} N={n:4d}  {us:8.1f} us  {tbps:5.2f} TB/s  {tflops:6.1f} TFLOP/s  x{us / floor_us:4.2f} floor", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", default="1,17,65,129,257")
    ap.add_argument("--matmul-tokens", default="1,17,65,128,129,256,257,264,272,320")
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    ceilings = measure_ceilings(device)
    target, _ = build_models(device, torch.bfloat16, 1, 16, 2048)
    target.use_compiled()
    result = {"benchmark": "verify_breakdown", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "git_revision": git_revision(), "ceilings": ceilings, "context": CONTEXT,
              "forward": forward_rows(target, [int(t) for t in args.tokens.split(",")]),
              "matmul": matmul_rows(target, [int(t) for t in args.matmul_tokens.split(",")], ceilings)}
    out = results_path(args.output, "verify_breakdown")
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
