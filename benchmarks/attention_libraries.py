"""Tree attention over a long cached context: `ddtree.kernels.tree_attention` against the attention
kernels PyTorch ships (cuDNN, FlashAttention-2), at the shapes of a verify.

    python -m benchmarks.attention_libraries [--heads HQ,HKV,D] [--context 8192,32768]
        [--tokens 17,65,257] [--output FILE.json]

The libraries cannot apply the tree's ancestor mask to the last N keys without a dense bias, so
they are timed on the prefix alone (all N queries over `context` keys, no mask): a lower bound on
what a prefix-by-library + tree-block-by-us split would cost. Each library call is timed in both
query layouts: per query head (q [1, Hq, N, D], GQA in the library) and with the group folded into
the rows as our kernel does (q [1, Hkv, N x group, D], each KV head's keys read once), by CUDA
events around 20 calls; `graph` records whether the call could be captured in a CUDA graph (the
engine's rounds are graphs). Our kernel is timed as the engine calls it (prefix length as a device
scalar plus the tree's block mask), by graph replay. Microseconds per layer beside the floor
max(KV bytes / bandwidth, 4 N ctx D Hq / bf16 rate) and the executed TFLOP/s. `cudnn_folded_S_chunks`:
cuDNN over the keys cut into S chunks run as a batch (`attention_libraries.cudnn_prefix`), whose S
partial sums a merge still has to combine.
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.round_latency import measure_ceilings
from ddtree.bench.machine import git_revision, results_path
from ddtree.bench.timing import median_replay_ms
from ddtree.engine import capture_graph
from ddtree.kernels.attention_libraries import cudnn_prefix
from ddtree.kernels.tree_attention import masked_attention
from ddtree.tree import build_tree


def graph_us(fn) -> float:
    graph, _ = capture_graph(lambda: [fn() for _ in range(10)])
    return median_replay_ms(graph, 20) * 100


def eager_us(fn) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / 20


def capturable(fn) -> bool:
    try:
        graph_us(fn)
        return True
    except Exception:  # noqa: BLE001 - a library call that syncs or allocates in capture
        torch.cuda.synchronize()
        return False


def library_calls(q, k, v, hkv: int, scale: float) -> dict:
    """name -> a zero-argument call computing the prefix attention with one library backend."""
    n, hq, d = q.shape
    group = hq // hkv
    per_head = q.permute(1, 0, 2)[None]  # [1, Hq, N, D]
    folded = q.view(n, hkv, group, d).permute(1, 0, 2, 3).reshape(1, hkv, n * group, d).contiguous()
    kt, vt = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, Hkv, ctx, D], strided views of the cache
    calls = {}
    for backend, name in ((SDPBackend.CUDNN_ATTENTION, "cudnn"), (SDPBackend.FLASH_ATTENTION, "flash2")):
        def per_head_call(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(per_head, kt, vt, scale=scale, enable_gqa=True)

        def folded_call(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(folded, kt, vt, scale=scale)
        calls[f"{name}_per_head"] = per_head_call
        calls[f"{name}_folded"] = folded_call
    # FlashAttention-2's varlen entry with the used key count as a device tensor: graph-safe shapes.
    q_rows = folded[0].transpose(0, 1).contiguous()  # [N x group, Hkv, D]
    cum_q = torch.tensor([0, q_rows.shape[0]], dtype=torch.int32, device=q.device)
    cum_k = torch.tensor([0, k.shape[0]], dtype=torch.int32, device=q.device)
    used = torch.tensor([k.shape[0]], dtype=torch.int32, device=q.device)
    calls["flash2_varlen_folded"] = lambda: torch.ops.aten._flash_attention_forward(
        q_rows, k, v, cum_q, cum_k, q_rows.shape[0], k.shape[0], 0.0, False, False, scale=scale, seqused_k=used)
    # cuDNN with the keys cut into chunks run as a batch (`attention_libraries.cudnn_prefix`): more programs
    # than KV heads x row tiles; its partial sums still need merging (the kernel's combine does that).
    for chunks in (2, 4, 8, 16):
        calls[f"cudnn_folded_{chunks}_chunks"] = lambda chunks=chunks: cudnn_prefix(q, k, v, k.shape[0], chunks, scale)
    return calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--heads", default="32,8,128", help="query heads, KV heads, head_dim")
    ap.add_argument("--context", default="8192,32768")
    ap.add_argument("--tokens", default="17,65,257")
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    hq, hkv, d = (int(x) for x in args.heads.split(","))
    scale = d ** -0.5
    ceilings = measure_ceilings(torch.device("cuda"))
    rows = []
    for ctx, n in itertools.product(map(int, args.context.split(",")), map(int, args.tokens.split(","))):
        gen = torch.Generator(device="cuda").manual_seed(n)
        q = torch.randn(n, hq, d, device="cuda", generator=gen, dtype=torch.bfloat16)
        cache = torch.randn(2, ctx + n, hkv, d, device="cuda", generator=gen, dtype=torch.bfloat16)
        logp = torch.log_softmax(torch.randn(15, 1000, device="cuda", generator=gen), dim=-1)
        block = build_tree(logp, torch.tensor(1, device="cuda"), n - 1).visible
        prefix = torch.tensor(ctx, device="cuda")
        flops = 4 * n * ctx * d * hq
        floor = max(2 * ctx * hkv * d * 2 / ceilings["bandwidth_Bps"], flops / ceilings["bf16_flops"]) * 1e6
        ours = graph_us(lambda: masked_attention(q, cache[0], cache[1], block, scale, prefix_len=prefix))
        row = {"context": ctx, "tokens": n, "floor_us": floor, "ours_us": ours,
               "ours_tflops": flops / ours / 1e6, "libraries": {}}
        for name, fn in library_calls(q, cache[0, :ctx], cache[1, :ctx], hkv, scale).items():
            try:
                us = eager_us(fn)
                row["libraries"][name] = {"us": us, "tflops": flops / us / 1e6, "graph": capturable(fn)}
            except Exception as exc:  # noqa: BLE001 - a backend that refuses this shape
                torch.cuda.synchronize()
                row["libraries"][name] = {"error": str(exc).splitlines()[0][:160]}
        rows.append(row)
        libs = "  ".join(f"{k} {v['us']:.1f}" if "us" in v else f"{k} -" for k, v in row["libraries"].items())
        print(f"ctx {ctx:6d} N={n:4d} floor {floor:7.1f} us  ours {ours:7.1f}  {libs}", flush=True)
    result = {"benchmark": "attention_libraries", "command": "python -m benchmarks.attention_libraries " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
              "heads": [hq, hkv, d], "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cudnn": torch.backends.cudnn.version(), "ceilings": ceilings, "git_revision": git_revision(),
              "rows": rows}
    results_path(args.output, "attention_libraries").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    with torch.inference_mode():
        main()
