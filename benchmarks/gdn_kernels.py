"""The gated delta rule's Triton kernels (`ddtree.kernels.gdn_tree`) against the PyTorch references
(`ddtree.models.gated_deltanet`) at Qwen3.6-27B's GDN heads (Hk 16, Hv 48, Dk = Dv = 128).

    python benchmarks/gdn_kernels.py [--tokens 1,16,17,65,257] [--steps 1,16] [--layers 48]
        [--tree-shape deep|bushy] [--sweep] [--configs NAME,...] [--jobs 12] [--breakdown]
        [--output FILE.json]

Microseconds per call: the median replay of a CUDA graph of `--layers` calls, each on its own
layer's state (as a round's GDN layers: the states are not all in L2), divided by their number.
- `tree_gated_delta` (the verify) for each N: one node (N = 1), the chain (16 nodes), and
  `build_tree` trees of N nodes from random draft log-probs, deep (sharp, as a trained drafter's)
  or bushy (flat);
- `recurrent_gated_delta` for T tokens: T = 1 (a decode step) and T = 16 (a round's commit) with
  `length` on the device = T and = 5.
Each beside the reference's time, and the kernel's error, max |kernel - reference| / max |reference|
against the float32 reference (itself ~1e-7 from float64: tests/test_gdn_kernels.py).

--sweep times every tiling of TREE_SWEEP and RECURRENT_SWEEP (else the defaults only); --configs
keeps those named (of either table; `--steps none` skips the token loop); --jobs first compiles
them in that many processes (Triton's cache then serves this one). --breakdown adds, per tree
size and tiling, each launch timed alone (`gdn_tree.TreeLaunches`): the prepare launch, its part
0 (ancestor lists, A, P, T) and its state products apart, and the solve.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
from dataclasses import asdict

import torch

from ddtree.bench.machine import git_revision, machine_info, results_path
from ddtree.bench.timing import median_replay_ms
from ddtree.engine import capture_graph
from ddtree.kernels import gdn_tree
from ddtree.kernels.gdn_tree import FoldConfig, RecurrentConfig, TreeConfig
from ddtree.models import gated_deltanet as ref
from ddtree.tree import build_chain, build_tree

HK, HV, D = 16, 48, 128

TREE_SWEEP = {
    "c32_w4": TreeConfig(),
    "c32_w4_root": TreeConfig(root_first=True),
    "c32_w4_r128": TreeConfig(prepare_registers=128),
    "c32_w4_root_r128": TreeConfig(root_first=True, prepare_registers=128),
    "c32_w4_s3": TreeConfig(num_stages=3),
    "c32_w4_r128_s3": TreeConfig(prepare_registers=128, num_stages=3),
    "c32_w4_r128_s4": TreeConfig(prepare_registers=128, num_stages=4),
    # Wider key slices under the register cap (128 registers, no local memory at Qwen3.6-27B's heads
    # compiled for sm_90; uncapped they took 241 and 254).
    "c32_w4_r128_s3_k32": TreeConfig(prepare_registers=128, num_stages=3, block_k=32),
    "c32_w4_r128_s3_k64": TreeConfig(prepare_registers=128, num_stages=3, block_k=64),
    "c32_w4_s3_k32": TreeConfig(num_stages=3, block_k=32),
    "c32_w4_r128_s3_root": TreeConfig(prepare_registers=128, num_stages=3, root_first=True),
    # `tree_config`'s tilings with one TF32 product, its choice for bf16 / fp16 values.
    "c32_w4_s3_tf32": TreeConfig(num_stages=3, precision="tf32", solve_precision="tf32"),
    "c32_w4_r128_s3_tf32": TreeConfig(prepare_registers=128, num_stages=3, precision="tf32", solve_precision="tf32"),
    "c64_w4": TreeConfig(block_c=64),
    "c32_w8": TreeConfig(num_warps=8),
    "c64_w8": TreeConfig(block_c=64, num_warps=8),
    "c32_w4_v16": TreeConfig(block_v=16),
    "c32_w4_v64": TreeConfig(block_v=64),
    "c32_w4_pv64": TreeConfig(prepare_v=64),
    "c32_w4_s1": TreeConfig(num_stages=1),
    "c32_w4_solve_ieee": TreeConfig(solve_precision="ieee"),
    "c32_w4_ieee": TreeConfig(precision="ieee", solve_precision="ieee"),
    "t32_c32_w8": TreeConfig(block_t=32, num_warps=8),
    "c32_w4_tf32": TreeConfig(precision="tf32", solve_precision="tf32"),  # to show TF32's error
}
RECURRENT_SWEEP = {f"v{v}_w{w}": RecurrentConfig(block_v=v, num_warps=w) for v in (8, 16, 32, 64) for w in (1, 2, 4)}
# The commit's fold (`--fold`): [block_k, block_v] state tiles; k128_v16_w1 is the token loop's
# tiling, which the fold had before FoldConfig.
FOLD_SWEEP = {f"k{k}_v{v}_w{w}": FoldConfig(block_k=k, block_v=v, num_warps=w)
              for k, v, w in [(128, 16, 1), (8, 128, 1), (16, 128, 2), (16, 128, 4), (32, 128, 4), (32, 128, 8),
                              (64, 128, 4), (64, 128, 8), (32, 64, 2), (64, 64, 4)]}


def tree_inputs(n: int, shape: str, seed: int = 0):
    """q, k float32 (normalised, as `normalize_qk` returns them), v bf16, g, beta float32, the mask."""
    gen = torch.Generator().manual_seed(seed)
    q, k = ref.normalize_qk(torch.randn(n, HK, D, generator=gen), torch.randn(n, HK, D, generator=gen))
    v = torch.randn(n, HV, D, generator=gen).bfloat16()
    g = -torch.nn.functional.softplus(torch.randn(n, HV, generator=gen)) * torch.rand(HV, generator=gen)
    beta = torch.sigmoid(torch.randn(n, HV, generator=gen))
    if n == 16:
        mask = build_chain(torch.arange(15), torch.tensor(1)).visible
    else:
        logp = torch.log_softmax(torch.randn(15, 1000, generator=gen) * (8.0 if shape == "deep" else 1.0), dim=-1)
        mask = build_tree(logp, torch.tensor(1), n - 1).visible
    return [t.cuda() for t in (q, k, v, g, beta, mask)]


def states(layers: int) -> torch.Tensor:
    return 0.5 * torch.randn(layers, HV, D, D, device="cuda")


def replay_us(fn, layers: int) -> float:
    graph, _ = capture_graph(fn)
    return median_replay_ms(graph, 20) * 1000 / layers


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


def tree_stats(mask: torch.Tensor, block: int = 16) -> dict:
    """Depth and, per block of `block` nodes, how many earlier columns its rows see (the union)."""
    n = mask.shape[0]
    unions = [int(mask[b:b + block, :b].any(0).sum()) for b in range(0, n, block)]
    return {"max_depth": int(mask.sum(1).max()) - 1, "union_mean": sum(unions) / len(unions), "union_max": max(unions)}


def warm(job: tuple) -> str:
    """Compile one (kind, config, N or T) in a worker process (Triton's cache keeps the binary)."""
    kind, config, size, shape = job
    try:
        with torch.inference_mode():
            if kind == "tree":
                *x, mask = tree_inputs(size, shape)
                gdn_tree.tree_gated_delta(*x, mask, states(1)[0], config)
            else:
                *x, _ = tree_inputs(size, shape)
                gdn_tree.recurrent_gated_delta(*x, states(1)[0], torch.tensor(size, device="cuda"), config)
            torch.cuda.synchronize()
        return ""
    except Exception as e:  # reported, and the timing loop will show it too
        return f"{kind} {config} {size}: {type(e).__name__}: {e}"


def tree_rows(sizes, configs: dict, layers: int, shape: str) -> list[dict]:
    rows = []
    for n in sizes:
        q, k, v, g, beta, mask = tree_inputs(n, shape)
        s = states(layers)
        want = ref.tree_gated_delta(q, k, v, g, beta, mask, s[0])
        row = {"kernel": "tree", "tokens": n, "shape": shape if n not in (1, 16) else ("one" if n == 1 else "chain"),
               **tree_stats(mask.cpu()), "default_config": asdict(gdn_tree.tree_config(n)),
               "reference_us": replay_us(lambda: [ref.tree_gated_delta(q, k, v, g, beta, mask, s[i])
                                                  for i in range(layers)], layers)}
        for name, config in configs.items():
            try:
                got = gdn_tree.tree_gated_delta(q, k, v, g, beta, mask, s[0], config)
                row[f"{name}_err"] = rel_error(got, want)
                row[f"{name}_us"] = replay_us(lambda: [gdn_tree.tree_gated_delta(q, k, v, g, beta, mask, s[i], config)
                                                       for i in range(layers)], layers)
            except Exception as e:
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
        print_row(row, configs)
    return rows


def breakdown_rows(sizes, configs: dict, layers: int, shape: str) -> list[dict]:
    """Each launch of the tree kernels timed alone, per call: every layer's `TreeLaunches` run
    once whole (so the solve reads real lists and coefficients), then graphs of one launch each."""
    rows = []
    for n in (n for n in sizes if n > 1):
        q, k, v, g, beta, mask = tree_inputs(n, shape)
        s = states(layers)
        for name, config in configs.items():
            row = {"kernel": "tree_launches", "tokens": n, "config": name}
            try:
                launches = [gdn_tree.TreeLaunches(q, k, v, g, beta, mask, s[i], config) for i in range(layers)]
                for one in launches:
                    one.prepare()
                    one.solve()
                for part in ("all", "lists", "rhs"):
                    row[f"prepare_{part}_us"] = replay_us(lambda: [one.prepare(part) for one in launches], layers)
                row["solve_us"] = replay_us(lambda: [one.solve() for one in launches], layers)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            print(f"   launches N={n:<4} {name}: " + "  ".join(
                f"{key[:-3]} {value:7.2f}" for key, value in row.items() if key.endswith("_us")), flush=True)
    return rows


def recurrent_rows(steps, configs: dict, layers: int) -> list[dict]:
    rows = []
    for t in steps:
        q, k, v, g, beta, _ = tree_inputs(t, "deep", seed=1)
        for accepted in sorted({t, min(t, 5)}, reverse=True):
            length = torch.tensor(accepted, device="cuda")
            s = states(layers)
            row = {"kernel": "recurrent", "tokens": t, "length": accepted,
                   "reference_us": replay_us(lambda: [ref.recurrent_gated_delta(q, k, v, g, beta, s[i], length)
                                                      for i in range(layers)], layers)}
            for name, config in configs.items():
                try:
                    start = states(1)[0]
                    s_want, s_got = start.clone(), start.clone()
                    want = ref.recurrent_gated_delta(q, k, v, g, beta, s_want, length)
                    got = gdn_tree.recurrent_gated_delta(q, k, v, g, beta, s_got, length, config)
                    row[f"{name}_err"] = max(rel_error(got, want), rel_error(s_got, s_want))
                    step = gdn_tree.recurrent_gated_delta
                    row[f"{name}_us"] = replay_us(lambda: [step(q, k, v, g, beta, s[i], length, config)
                                                           for i in range(layers)], layers)
                except Exception as e:
                    row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            print_row(row, configs)
    return rows


def fold_rows(configs: dict, layers: int, path: int = 16, nodes: int = 65) -> list[dict]:
    """`fold_path` (one launch for every layer's state) along a path of `path` nodes of a
    `nodes`-node stash, all of it accepted and 5 nodes of it, against the PyTorch fold."""
    gen = torch.Generator().manual_seed(5)
    k = torch.nn.functional.normalize(torch.randn(layers, nodes, HK, D, generator=gen), dim=-1)
    u = 0.1 * torch.randn(layers, HV, nodes, D, generator=gen)
    G = -torch.rand(layers, nodes, HV, generator=gen).cumsum(1) * 0.1
    order = torch.randperm(nodes, generator=gen)[:path]
    k, u, G, order = (t.cuda() for t in (k, u, G, order))
    rows = []
    for accepted in (path, 5):
        length = torch.tensor(accepted, device="cuda")
        s = states(layers)
        row = {"kernel": "fold", "tokens": path, "length": accepted, "state_MiB": s.numel() * 4 / 2**20,
               "reference_us": replay_us(lambda: ref.fold_path(s, k, u, G, order, length), 1)}
        for name, config in configs.items():
            try:
                got, want = s.clone(), s.clone()  # s as the timing replays have left it
                gdn_tree.fold_path(got, k, u, G, order, length, config)
                ref.fold_path(want, k, u, G, order, length)
                row[f"{name}_err"] = rel_error(got, want)
                row[f"{name}_us"] = replay_us(lambda: gdn_tree.fold_path(s, k, u, G, order, length, config), 1)
                row[f"{name}_GBps"] = 2 * s.numel() * 4 / row[f"{name}_us"] / 1e3
            except Exception as e:
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
        print_row(row, configs)
    return rows


def print_row(row: dict, configs: dict) -> None:
    head = f"{row['kernel']:>9} N={row['tokens']:<4}" + (f" len={row['length']:<3}" if "length" in row else " " * 8)
    cells = [f"ref {row['reference_us']:8.1f}"]
    for name in configs:
        if f"{name}_us" in row:
            cells.append(f"{name} {row[f'{name}_us']:7.2f} (err {row[f'{name}_err']:.1e})")
        else:
            cells.append(f"{name} FAILED {row.get(f'{name}_error', '')[:120]}")
    print(head + "  us/call: " + "  ".join(cells), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,16,17,65,257", help="tree sizes N (16: the chain)")
    ap.add_argument("--steps", default="1,16", help="token-loop lengths T")
    ap.add_argument("--layers", type=int, default=48, help="calls per graph, each on its own state")
    ap.add_argument("--tree-shape", default="deep", choices=["deep", "bushy"])
    ap.add_argument("--sweep", action="store_true", help="time every tiling of TREE_SWEEP / RECURRENT_SWEEP")
    ap.add_argument("--configs", default=None, help="with --sweep: only these tilings, comma-separated")
    ap.add_argument("--jobs", type=int, default=0, help="compile the tilings in this many processes first")
    ap.add_argument("--breakdown", action="store_true", help="also time each tree launch alone")
    ap.add_argument("--fold", action="store_true", help="also time the commit's fold over FOLD_SWEEP's tilings")
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    sizes = [int(x) for x in args.tokens.split(",")]
    steps = [] if args.steps == "none" else [int(x) for x in args.steps.split(",")]
    tree_configs = TREE_SWEEP if args.sweep else {"default": None}
    rec_configs = RECURRENT_SWEEP if args.sweep else {"default": None}
    if args.sweep and args.configs:
        names = args.configs.split(",")
        unknown = set(names) - set(TREE_SWEEP) - set(RECURRENT_SWEEP)
        if unknown:
            ap.error(f"unknown tilings {sorted(unknown)}; known: {sorted(TREE_SWEEP) + sorted(RECURRENT_SWEEP)}")
        tree_configs = {k: c for k, c in TREE_SWEEP.items() if k in names}
        rec_configs = {k: c for k, c in RECURRENT_SWEEP.items() if k in names}
    if args.jobs:
        jobs = [("tree", c, n, args.tree_shape) for c in tree_configs.values() for n in sizes]
        jobs += [("recurrent", c, t, args.tree_shape) for c in rec_configs.values() for t in steps]
        with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
            for failure in pool.imap_unordered(warm, jobs):
                if failure:
                    print("compile failed:", failure[:300], flush=True)
    with torch.inference_mode():
        rows = tree_rows(sizes, tree_configs, args.layers, args.tree_shape)
        if args.breakdown:
            rows += breakdown_rows(sizes, tree_configs, args.layers, args.tree_shape)
        rows += recurrent_rows(steps, rec_configs, args.layers)
        if args.fold:
            rows += fold_rows(FOLD_SWEEP, args.layers)
    result = {
        "benchmark": "gdn_kernels",
        "command": "python " + " ".join(sys.argv),
        "machine": machine_info("cuda"),
        "git_revision": git_revision(),
        "shape": f"Hk {HK}, Hv {HV}, Dk = Dv = {D}; q, k float32, v bf16; {args.layers} layer states per graph",
        "tree_configs": {k: asdict(c) for k, c in tree_configs.items() if c},  # default: each row's
        "recurrent_configs": {k: asdict(c or gdn_tree.RECURRENT_DEFAULT) for k, c in rec_configs.items()},
        "rows": rows,
    }
    out = results_path(args.output, "gdn_kernels")
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
