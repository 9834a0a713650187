"""The Gluon prefix kernel (`ddtree/kernels/prefix_attention_sm90.py`) against the tree attention's
Triton kernel and cuDNN's chunked prefix, on an sm_90 GPU:

    python benchmarks/prefix_attention_sm90.py [--heads 32,8,128] [--context 32768] [--tokens 17,65,257]
        [--output FILE.json]

For each context and N: microseconds per call (CUDA-graph replay of 10 calls) of
- `gluon_sN`: the Gluon kernel over the whole prefix (keys [0, context)) in N key splits, at the
  count `plan_splits` picks (the opt-in path's) and those that make one and two waves of its
  programs (one program an SM at these tiles; a count met twice is timed once), with
  64-key tiles and three stages (`_n128`: 128-key tiles, two stages, head_dim <= 128; `_m64`: 64-row
  blocks in one warp group, two programs an SM, less padding of a tree's rows);
- `triton_whole`: `masked_attention` in the engine's form (prefix + the tree's block), the default
  tiling: the whole attention the Gluon kernel's prefix would sit inside;
- `gluon_whole`: the same call with DDTREE_GLUON_PREFIX's path on (the Gluon kernel over the prefix
  in one wave of splits, the Triton kernel over the block's columns, one combine launch);
- `cudnn_chunks`: `tree_attention.cudnn_prefix` over the same prefix, chunked as the opt-in path does;
beside the floor of the prefix's products at this GPU's measured bf16 matmul rate (4 N x context x D x
Hq FLOPs). The Gluon and cuDNN figures are the prefix alone: a merge with the tree's block would add
the combine launch.
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch

from benchmarks.attention_configs import call_us
from benchmarks.round_latency import measure_ceilings
from ddtree.bench.machine import git_revision, results_path
from ddtree.kernels import tree_attention
from ddtree.kernels.prefix_attention_sm90 import plan_splits, prefix_attention, tiling
from ddtree.kernels.tree_attention import cudnn_prefix, cudnn_splits, masked_attention
from ddtree.tree import build_tree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", default="32,8,128", help="query heads, KV heads, head_dim")
    ap.add_argument("--context", default="32768")
    ap.add_argument("--tokens", default="17,65,257")
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    hq, hkv, d = (int(x) for x in args.heads.split(","))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ceilings = measure_ceilings(torch.device("cuda"))
    rows_out = []
    for context in map(int, args.context.split(",")):
        for n in map(int, args.tokens.split(",")):
            keys = -(-(context + n) // 256) * 256
            gen = torch.Generator(device="cuda").manual_seed(n)
            q = torch.randn(n, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            cache = torch.randn(2, keys, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            k, v = cache[0], cache[1]
            logp = torch.log_softmax(torch.randn(15, 1000, device="cuda", generator=gen), dim=-1)
            block = build_tree(logp, torch.tensor(1, device="cuda"), n - 1).visible if n > 1 else \
                torch.ones(1, 1, dtype=torch.bool, device="cuda")
            prefix = torch.tensor(context, device="cuda")
            prefix32 = prefix.to(torch.int32)
            scale = d ** -0.5
            rows = n * (hq // hkv)
            flops = 4 * n * context * d * hq
            row = {"context": context, "tokens": n, "floor_us": flops / ceilings["bf16_flops"] * 1e6,
                   "triton_whole_us": call_us(lambda: masked_attention(q, k, v, block, scale, prefix_len=prefix))}
            tree_attention.GLUON_PREFIX = True  # the opt-in path: Gluon prefix, the kernel's block, one combine
            try:
                row["gluon_whole_us"] = call_us(
                    lambda: masked_attention(q, k, v, block, scale, prefix_len=prefix, min_prefix=context))
            except Exception as error:
                row["gluon_whole_error"] = f"{type(error).__name__}: {str(error)[:300]}"
            finally:
                tree_attention.GLUON_PREFIX = False
            chunks = cudnn_splits(rows, hkv, d, context, sms)
            try:
                row["cudnn_chunks_us"] = call_us(lambda: cudnn_prefix(q, k, v, context, chunks, scale))
            except RuntimeError as error:
                row["cudnn_chunks_error"] = str(error)[:200]
            configs = {"": {}, "_m64": {"BLOCK_M": 64, "num_warps": 4}}
            if d <= 128:
                configs["_n128"] = {"BLOCK_N": 128, "STAGES": 2}
            for waves, (label, config) in itertools.product((0, 1, 2), configs.items()):
                row_blocks = -(-rows // (tiling(d) | config)["BLOCK_M"])
                per_sm = 2 if config.get("num_warps") == 4 and d <= 128 else 1  # shared memory allows
                splits = plan_splits(row_blocks * hkv, per_sm * sms, keys) if waves == 0 else \
                    max(1, waves * per_sm * sms // (row_blocks * hkv))
                if f"gluon_s{splits}{label}_us" in row:
                    continue
                try:
                    row[f"gluon_s{splits}{label}_us"] = call_us(
                        lambda: prefix_attention(q, k, v, prefix32, keys, splits, scale, config))
                except Exception as error:  # report it and go on: the first runs of a new kernel
                    row[f"gluon_s{splits}{label}_error"] = f"{type(error).__name__}: {str(error)[:300]}"
            rows_out.append(row)
            print(json.dumps({key: round(val, 1) if isinstance(val, float) else val for key, val in row.items()}),
                  flush=True)
    result = {"benchmark": "prefix_attention_sm90", "command": "python benchmarks/prefix_attention_sm90.py " + " ".join(
                  f"--{key} {val}" for key, val in vars(args).items() if val is not None),
              "heads": [hq, hkv, d], "gpu": torch.cuda.get_device_name(), "ceilings": ceilings,
              "git_revision": git_revision(), "rows": rows_out}
    results_path(args.output, "prefix_attention_sm90").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    with torch.inference_mode():
        main()
