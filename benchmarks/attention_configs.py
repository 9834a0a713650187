"""Tilings of `ddtree.kernels.tree_attention` at a head layout (default Qwen3-8B's: 32 query / 8 KV
heads, head_dim 128; `--heads 24,4,256` is Qwen3.6-27B's), bf16, against PyTorch's masked
attention, for the token counts of a round.

    python benchmarks/attention_configs.py [--tokens 1,17,65,129,257,513,1025] [--sweep tilings|long|combine|onewave|none]
        [--heads HQ,HKV,D] [--context 512,32768] [--no-sdpa] [--cudnn-prefix context|round] [--output FILE.json]

For each context and N (1 = autoregressive step, B + 1 = verify of budget B; the drafter's block
is 16) over the context plus the tree, with the KV length rounded up to the engine's 256-slot
bucket, in the engine's form (prefix length + the tree's block mask): microseconds per call
(CUDA-graph replay of 10 calls) of every tiling, of the default one, and of
`F.scaled_dot_product_attention` with the mask as an additive bias (the path the kernel
replaced), beside the floor max(KV bytes / bandwidth, FLOPs / peak) at this GPU's measured copy
bandwidth and bf16 matmul rate. Prints the fastest tiling per N. `--cudnn-prefix` also times the
default tiling with the prefix's first keys through cuDNN (`attention_libraries.cudnn_prefix`, switched
on for the call), below min_prefix = the context (`context`) or the least committed length a
round's front graph at this KV length serves (`round`: a 256-slot bucket, the tree and a block of
16's keep below it, as `Engine._min_prefix` gives), so that the kernel's part holds the keys a
round leaves it. `--sweep tilings` (the default) tries 72 tilings (at
head_dim 256 with 32- and 64-key blocks, else 64 and 128); `--sweep long` the DEFAULT and LONG
tilings (where LONG starts to pay);
`--sweep combine` the default tiling with the split combine in the kernel or launched on its own
(its programs over 16, 32 or 64 head dims each), at 1, 2 and 4 programs per SM, loading 8192 or
32768 partial-sum elements at once; `--sweep onewave` one program an SM (the key splits fill one
wave) with 16-64 / 64 / 128-row blocks, 32- and 64-key blocks, 4 and 8 warps.
"""
from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import replace

import torch
import torch.nn.functional as F

from benchmarks.round_latency import measure_ceilings
from ddtree.bench.machine import git_revision, results_path
from ddtree.bench.timing import median_replay_ms
from ddtree.engine import capture_graph
from ddtree.kernels import attention_libraries
from ddtree.kernels.attention_plan import DEFAULT, LONG, AttentionConfig
from ddtree.kernels.tree_attention import masked_attention, prefix_block_mask
from ddtree.tree import build_tree

CONTEXT, BUCKET, HQ, HKV, D = 512, 256, 32, 8, 128


def call_us(fn) -> float:
    graph, _ = capture_graph(lambda: [fn() for _ in range(10)])
    return median_replay_ms(graph, 20) * 100


def case(n: int):
    """q [N, Hq, D], k, v [kv_len, Hkv, D], the tree's block mask [N, N] and the prefix length."""
    kv_len = -(-(CONTEXT + n) // BUCKET) * BUCKET
    gen = torch.Generator(device="cuda").manual_seed(n)
    q = torch.randn(n, HQ, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    cache = torch.randn(2, kv_len, HKV, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    logp = torch.log_softmax(torch.randn(15, 1000, device="cuda", generator=gen), dim=-1)
    tree = build_tree(logp, torch.tensor(1, device="cuda"), n - 1) if n > 1 else None
    block = tree.visible if tree is not None else torch.ones(1, 1, dtype=torch.bool, device="cuda")
    return q, cache[0], cache[1], block, torch.tensor(CONTEXT, device="cuda")


def floor_us(n: int, kv_len: int, ceilings: dict) -> float:
    """KV read once (bytes / bandwidth) or the q.k and p.v FLOPs at the matmul rate, the larger."""
    kv_bytes = 2 * kv_len * HKV * D * 2
    flops = 4 * n * (CONTEXT + n) * D * HQ
    return max(kv_bytes / ceilings["bandwidth_Bps"], flops / ceilings["bf16_flops"]) * 1e6


def sdpa_us(q, k, v, block, prefix) -> float:
    n = q.shape[0]
    group = HQ // HKV
    mask = prefix_block_mask(prefix, block, k.shape[0])
    bias = torch.zeros(mask.shape, dtype=q.dtype, device="cuda").masked_fill(~mask, float("-inf")).repeat(group, 1)

    def fn():
        qg = q.view(n, HKV, group, D).permute(1, 2, 0, 3).reshape(1, HKV, group * n, D)
        out = F.scaled_dot_product_attention(qg, k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                             attn_mask=bias[None, None], scale=D**-0.5)
        return out.view(HKV, group, n, D).permute(2, 0, 1, 3).reshape(n, HQ * D)
    return call_us(fn)


def cudnn_prefix_us(q, k, v, block, prefix, bound: str) -> float:
    """The default tiling with the prefix's first keys through cuDNN (the opt-in path, on for this
    call), below the context or below the engine's bound for a round at this KV length."""
    n = q.shape[0]
    least = CONTEXT if bound == "context" else max(0, k.shape[0] - BUCKET - n + 1 - 16)
    attention_libraries.CUDNN_PREFIX = True
    try:
        return call_us(lambda: masked_attention(q, k, v, block, D**-0.5, prefix_len=prefix, min_prefix=least))
    finally:
        attention_libraries.CUDNN_PREFIX = False


def main() -> None:
    global HQ, HKV, D, CONTEXT
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", default="1,17,65,129,257,513,1025")
    ap.add_argument("--sweep", choices=("tilings", "combine", "long", "onewave", "none"), default="tilings")
    ap.add_argument("--heads", default=f"{HQ},{HKV},{D}", help="query heads, KV heads, head_dim")
    ap.add_argument("--context", default=str(CONTEXT), help="cached tokens before the tree, comma-separated")
    ap.add_argument("--no-sdpa", action="store_true", help="skip PyTorch's masked attention (slow at long contexts)")
    ap.add_argument("--cudnn-prefix", choices=("context", "round"), default=None,
                    help="also time the default tiling with the prefix's first keys through cuDNN, below the "
                         "context or below the least committed length a round at this KV length serves")
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    HQ, HKV, D = (int(x) for x in args.heads.split(","))
    if args.sweep == "tilings":
        # At head_dim 256, compiled for sm_90 (scripts/check_kernels_compile.py's alignments), 64-key
        # tiles take 75.8 KB of shared memory with 16-row blocks and 168 KB with 64-row ones (one
        # program per SM); 32-key tiles 42 and 100 KB.
        key_blocks = (32, 64) if D > 128 else (64, 128)
        configs = [AttentionConfig(block_m=m, block_n=bn, programs_per_sm=p, num_warps=w, num_stages=st)
                   for m, bn, p, w, st in itertools.product((0, 64, 128), key_blocks, (1, 2, 4), (4, 8), (2, 3))]
    elif args.sweep == "combine":
        configs = [AttentionConfig(programs_per_sm=p, fold_combine=True, combine_loads=loads)
                   for p, loads in itertools.product((1, 2, 4), (8192, 32768))]
        configs += [AttentionConfig(programs_per_sm=p, fold_combine=False, combine_loads=loads, combine_block_d=bd)
                    for p, loads, bd in itertools.product((1, 2, 4), (8192, 32768), (16, 32, 64))]
    elif args.sweep == "onewave":  # one program an SM: row blocks, warps and key blocks
        configs = [AttentionConfig(block_m=m, block_n=bn, programs_per_sm=1, num_warps=w, num_stages=2)
                   for m, bn, w in itertools.product((0, 64, 128), (32, 64), (4, 8))]
    elif args.sweep == "long":  # where the LONG tiling starts to pay
        configs = [DEFAULT] + [replace(LONG, programs_per_sm=p) for p in (1, 2, 4)]
    else:
        configs = []
    rows = []
    ceilings = measure_ceilings(torch.device("cuda"))
    for CONTEXT, n in itertools.product(map(int, args.context.split(",")), map(int, args.tokens.split(","))):
        q, k, v, block, prefix = case(n)
        row = {"context": CONTEXT, "tokens": n, "kv_len": k.shape[0], "floor_us": floor_us(n, k.shape[0], ceilings),
               "sdpa_us": None if args.no_sdpa else sdpa_us(q, k, v, block, prefix),
               "default_us": call_us(lambda: masked_attention(q, k, v, block, D**-0.5, prefix_len=prefix)),
               "cudnn_prefix_us": cudnn_prefix_us(q, k, v, block, prefix, args.cudnn_prefix)
               if args.cudnn_prefix else None,
               "configs": []}
        for cfg in configs:
            if cfg.block_m == 128 and n * (HQ // HKV) <= 64:
                continue
            try:
                us = call_us(lambda: masked_attention(q, k, v, block, D**-0.5, config=cfg, prefix_len=prefix))
            except Exception as exc:  # a tiling too large for this head_dim (shared memory, registers)
                row.setdefault("failed", []).append({**cfg.__dict__, "error": str(exc)[:120]})
                continue
            row["configs"].append({**cfg.__dict__, "us": us})
        best = min(row["configs"], key=lambda c: c["us"]) if row["configs"] else None
        row["best"] = best
        rows.append(row)
        sdpa = "-" if row["sdpa_us"] is None else f"{row['sdpa_us']:.1f}"
        print(f"ctx {CONTEXT:6d} N={n:5d} kv {k.shape[0]:6d}  floor {row['floor_us']:8.1f} us  sdpa {sdpa} us  "
              f"default {row['default_us']:8.1f} us (x{row['default_us'] / row['floor_us']:.2f})"
              + (f"  with cuDNN's prefix {row['cudnn_prefix_us']:8.1f} us" if args.cudnn_prefix else "")
              + (f"  best {best['us']:8.1f} us {best}" if best else ""), flush=True)
    result = {"benchmark": "attention_configs", "command": "python benchmarks/attention_configs.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v not in (None, False)),
              "heads": [HQ, HKV, D], "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "ceilings": ceilings, "git_revision": git_revision(), "default": DEFAULT.__dict__, "rows": rows}
    out = results_path(args.output, "attention_configs")
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    with torch.inference_mode():
        main()
