"""The Gluon prefix kernel (`ddtree/kernels/prefix_attention_sm90.py`, warp-specialised) against the
tree attention's Triton kernel and cuDNN's chunked prefix, on an sm_90 GPU:

    python benchmarks/prefix_attention_sm90.py [--heads 32,8,128] [--context 32768] [--tokens 17,65,257]
        [--repeats R] [--splits 8,12,16] [--whole-only] [--output FILE.json]

For each context and N: microseconds per call (CUDA-graph replay of 10 calls) of
- `ws_<tiling>_sS`: the Gluon kernel over the whole prefix (keys [0, context)) in S key splits
  (`splits_for`: `plan_splits`' count for its programs), at each tiling `prefix_attention_sm90.tiling` chooses
  from and a few more (`c2`/`c1`: two / one consumer warp groups a program, `n128`/`n64`: keys a
  tile, `st`: stages, `x2`: two programs an SM); `ws_default` is the one it picks for these rows
  (`ws_default_no_tail`: the same with the rows past the last whole 128-row block in a row block
  of their own instead of the tail warp group; `ws_default_no_idle_skip`: that block's second warp
  group computing its rows past the end, as before SKIP_IDLE; `ws_default_no_pdl`: each call
  launched after the one before has ended, where by default its programs start while that one
  ends; --splits: the default at more split counts, with and without the tail);
  with --repeats, the median of R passes over all of them (`_all_us`: each pass's), each pass
  starting one call later than the last (`rotated`);
- `triton_whole`: `masked_attention` in the engine's form (prefix + the tree's block), the default
  tiling: the whole attention the Gluon kernel's prefix would sit inside;
- `gluon_whole`: the same call through DDTREE_GLUON_PREFIX's path at any row count (the
  warp-specialised kernel over the prefix and, in its first split, the tree's block; one combine
  launch); `gluon_whole_triton_block`: the same with GLUON_BLOCK off (the Triton kernel over the
  block's columns, merged in its combine launch); `gluon_whole_no_pdl`: the kernel and the combine
  launched after the launch before each has ended, not as programmatic dependent launches;
  `gluon_whole_unbalanced`: the first split taking its whole share of the prefix besides the block;
  with --repeats, the gluon_whole figures too are the median of R interleaved passes;
- `cudnn_chunks`: `attention_libraries.cudnn_prefix` over the same prefix, chunked as its opt-in path does;
beside the floor of the prefix's products at this GPU's measured bf16 matmul rate (4 N x context x D x
Hq FLOPs). The Gluon and cuDNN figures are the prefix alone: a merge with the tree's block would add
the combine launch.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from benchmarks.attention_configs import call_us
from benchmarks.round_latency import measure_ceilings
from ddtree.bench.machine import git_revision, results_path
from ddtree.kernels import attention_libraries
from ddtree.kernels import prefix_attention_sm90 as sm90
from ddtree.kernels.attention_libraries import cudnn_prefix, cudnn_splits
from ddtree.kernels.tree_attention import masked_attention
from ddtree.tree import build_tree


# The whole-attention rows: (key, the block in the Gluon kernel, entries over its tiling).
GLUON_WHOLE = (("gluon_whole_us", True, {}), ("gluon_whole_triton_block_us", False, {}),
               ("gluon_whole_no_pdl_us", True, {"PDL": False}), ("gluon_whole_unbalanced_us", True, {"BALANCE": False}))


def rotated(calls: list | tuple, turn: int) -> list:
    """The pass's order: each pass starts one entry later, so that a drift within a pass (clocks
    under the power cap, say) does not always fall on the same calls. With one order for every
    pass, four runs on H100s timed the same call at 257 tokens at 224-231 us where it came first
    and 240-248 where it came fifth (medians of 2-3 passes,
    `results/prefix_attention_sm90_h100_8b_32k_tail_consumers*.json`: `gluon_whole` against
    `gluon_whole_tail_warp_group`, the default then)."""
    shift = turn % len(calls)
    return list(calls[shift:]) + list(calls[:shift])


def report(row: dict) -> None:
    print(json.dumps({key: round(val, 1) if isinstance(val, float) else val for key, val in row.items()}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", default="32,8,128", help="query heads, KV heads, head_dim")
    ap.add_argument("--context", default="32768")
    ap.add_argument("--tokens", default="17,65,257")
    ap.add_argument("--repeats", type=int, default=1, help="passes over the Gluon tilings (their median is kept)")
    ap.add_argument("--splits", default=None, help="more key split counts to time the default tiling at, e.g. 8,12,16")
    ap.add_argument("--whole-only", action="store_true", help="only the whole attention's calls, no tilings or cuDNN")
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    extra_splits = [int(x) for x in args.splits.split(",")] if args.splits else []
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
            switch, attention_libraries.GLUON_PREFIX = attention_libraries.GLUON_PREFIX, True
            picked = sm90.tiling
            fold = attention_libraries.GLUON_BLOCK
            try:  # the Gluon path whatever the rows (the engine's takes it from GLUON_MIN_ROWS on)
                minimum = attention_libraries.GLUON_MIN_ROWS
                attention_libraries.GLUON_MIN_ROWS = {64: 1, 128: 1, 256: 1}
                whole = {}
                for turn in range(args.repeats):  # passes, as the tilings below
                    for key, block_in_gluon, override in rotated(GLUON_WHOLE, turn):
                        attention_libraries.GLUON_BLOCK = block_in_gluon
                        sm90.tiling = lambda *a, override=override: picked(*a) | override  # noqa: E731
                        whole.setdefault(key, []).append(call_us(
                            lambda: masked_attention(q, k, v, block, scale, prefix_len=prefix, min_prefix=context)))
                for key, values in whole.items():
                    row[key] = statistics.median(values)
                    if args.repeats > 1:
                        row[key.replace("_us", "_all_us")] = values
            except Exception as error:
                row["gluon_whole_error"] = f"{type(error).__name__}: {str(error)[:300]}"
            finally:
                attention_libraries.GLUON_PREFIX, attention_libraries.GLUON_MIN_ROWS = switch, minimum
                attention_libraries.GLUON_BLOCK, sm90.tiling = fold, picked
            if args.whole_only:
                rows_out.append(row)
                report(row)
                continue
            chunks = cudnn_splits(rows, hkv, d, context, sms)
            try:
                row["cudnn_chunks_us"] = call_us(lambda: cudnn_prefix(q, k, v, context, chunks, scale))
            except RuntimeError as error:
                row["cudnn_chunks_error"] = str(error)[:200]
            ws_tilings = {"c2_n64_st2": {"CONSUMERS": 2, "BLOCK_N": 64, "STAGES": 2, "PER_SM": 1},
                          "c1_n64_st3": {"CONSUMERS": 1, "BLOCK_N": 64, "STAGES": 3, "PER_SM": 1}}
            if d <= 128:
                ws_tilings |= {"c2_n128_st2": {"CONSUMERS": 2, "BLOCK_N": 128, "STAGES": 2, "PER_SM": 1},
                               # (no tail warp group: with its 4 KB, three stages of 128-key tiles overflow)
                               "c2_n128_st3": {"CONSUMERS": 2, "BLOCK_N": 128, "STAGES": 3, "PER_SM": 1, "TAIL": False},
                               "c2_n64_st4": {"CONSUMERS": 2, "BLOCK_N": 64, "STAGES": 4, "PER_SM": 1},
                               "c1_n64_st3_x2": {"CONSUMERS": 1, "BLOCK_N": 64, "STAGES": 3, "PER_SM": 2}}
            ws_tilings["default"] = sm90.tiling(d, rows, hkv, sms)
            if ws_tilings["default"]["CONSUMERS"] == 2:  # the last row block's idle warp group computing
                ws_tilings["default_no_idle_skip"] = ws_tilings["default"] | {"SKIP_IDLE": False, "TAIL": False}
            if sm90.tail_rows(ws_tilings["default"], rows, d)[0]:  # the rows past whole blocks in a block of their own
                ws_tilings["default_no_tail"] = ws_tilings["default"] | {"TAIL": False}
            ws_tilings["default_no_pdl"] = ws_tilings["default"] | {"PDL": False}  # each call after the last has ended
            runs = [(label, config, sm90.splits_for(config, rows, hkv, sms, keys, d)) for label, config in ws_tilings.items()]
            runs += [(label, ws_tilings[label], splits) for splits in extra_splits
                     for label in ("default", "default_no_tail") if label in ws_tilings]
            times = {}
            for turn in range(args.repeats):  # every tiling once a pass, so that drift between passes hits all alike
                for label, config, splits in rotated(runs, turn):
                    if f"ws_{label}_error" in row:
                        continue
                    try:
                        us = call_us(lambda: sm90.prefix_attention(q, k, v, prefix32, keys, splits, scale, config))
                    except Exception as error:  # report it and go on
                        row[f"ws_{label}_error"] = f"{type(error).__name__}: {str(error)[:300]}"
                        continue
                    times.setdefault(f"ws_{label}_s{splits}_us", []).append(us)
            for key, values in times.items():
                row[key] = statistics.median(values)
                if args.repeats > 1:
                    row[key.replace("_us", "_all_us")] = values
            rows_out.append(row)
            report(row)
    result = {"benchmark": "prefix_attention_sm90", "command": "python benchmarks/prefix_attention_sm90.py " + " ".join(
                  f"--{key.replace('_', '-')}" + ("" if val is True else f" {val}")
                  for key, val in vars(args).items() if val is not None and val is not False),
              "heads": [hq, hkv, d], "gpu": torch.cuda.get_device_name(), "ceilings": ceilings,
              "git_revision": git_revision(), "rows": rows_out}
    results_path(args.output, "prefix_attention_sm90").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    with torch.inference_mode():
        main()
