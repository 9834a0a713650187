"""Where the prefix kernel's tail warp group costs time: the Gluon prefix kernel
(`ddtree/kernels/prefix_attention_sm90.py`) at 64 / 65 and 256 / 257 tokens over a long prefix at
Qwen3-8B's heads, against copies of the kernel module changed in one thing each, on an sm_90 GPU:

    python benchmarks/prefix_tail_variants.py OUT.json [--context 32768] [--repeats 3] [--against FILE]
        [--cases base_64,A_65,...] [--profile]

- `base`: the kernel as it is (64 / 256 tokens: no tail; 65 / 257: 4 rows a KV head in the tail);
- `notail`: 65 / 257 with the tail off (the rows past the last whole block in a row block of their own);
- `A`: the tail warp group present but computing nothing (it releases every slot as it lands and
  merges empty partials): the cost of its presence alone (the output is then wrong in those rows);
- `B<r>`: 64 / 256 tokens (no tail) with the consumers held to r registers, as the tail's
  registers leave them (216 by default): the cost of the register cut alone;
- `E<r>`: the tail warp group at r registers (the consumers get what it frees, or give what it
  takes: at 72 the consumers keep 208, at 88 200). At 56 its tile loop reloads spilled values
  every tile; at 72 the sm_90 compile moves most of those spills to the consumers (stack 80
  bytes against 72), which is what E72 and E88 time (both slower than 56: benchmarks/README.md,
  "More registers for the tail warp group");
- `D16`: the tail's products at N = 16 instead of 8 (does their cost go by instruction or by column?);
- `M`: the kernel with the tail's merge left out (no arrival count, no merge: the tail rows' output
  is then wrong): the cost of the merge at the end of the last program;
- `MB`: `M` with the warp group's barrier before the count kept (M, which drops both, was slower
  than the kernel on the H200: is it the barrier?);
- `AM`: `A` without the merge: the tail warp group only waits on and releases slots;
- `Z`: the tail warp group launched but idle (it joins no slot's release, reads nothing, merges
  nothing): the cost of a fourth warp group's mere presence beside the register cut (`B216`);
- `ZM`: `Z` with the merge (of empty partials): the arrival count and merge alone;
- `R`: the tail rows shared out among the row-block programs instead of the split's tiles: each
  program's tail warp group takes its rows (65 tokens x 4 heads, 2 programs: 2 rows each) over all
  the split's tiles and writes them as the consumers do, so no partial, count or merge;
- `QR`: the consumers' q.k with q in registers, read from shared memory once, instead of its 16 KB
  being read again for every key tile (a program's tile reads about as many cycles of shared memory
  as its products take: does that traffic bound it?);
- `against` (with --against FILE): the kernel module in FILE, e.g. an earlier revision's
  (`git show REV:ddtree/kernels/prefix_attention_sm90.py > FILE`), at every token count.

Each changed copy is written beside the module as `_variant_<name>.py`, imported, and removed at
the end. Microseconds per call: CUDA-graph replay of 10 calls, the median of `--repeats` passes
over every case in turn; each variant's largest output difference from `base` at the same tokens
and splits is reported (A's is expected to be large).

--profile: no timing; each case runs once to compile and once more inside an NVTX range named
after it, for Nsight Compute to read its counters (warp stalls, issue slots, shared-memory
traffic), e.g. `ncu --nvtx --nvtx-include "base_65/" --nvtx-include "A_65/" --section
WarpStateStats --section SchedulerStats python benchmarks/prefix_tail_variants.py OUT --cases
base_65,A_65 --profile`.
"""
from __future__ import annotations

import argparse
import importlib
import json
import statistics
from pathlib import Path

import torch

from benchmarks.attention_configs import call_us
from ddtree.bench.machine import git_revision
from ddtree.kernels import prefix_attention_sm90 as base

SOURCE = Path(base.__file__)
HEADS = (32, 8, 128)  # Qwen3-8B: query heads, KV heads, head_dim
REGISTERS_NO_TAIL = ("    return per_group, min(256, ((consumers + 1) * per_group - 24) // consumers // 8 * 8), 0",
                     "    return per_group, {}, 0")
CHANGES = {  # variant: the (old, new) text replacements of its copy
    "A": [("_release(k_ready, k_empty, v_ready, v_empty, 0, lo, STAGES)",
           "_release(k_ready, k_empty, v_ready, v_empty, 0, total, STAGES)"),
          ("    if lo < hi:\n        acc, m_i, l_i = _attend_tail", "    if lo > total:\n        acc, m_i, l_i = _attend_tail"),
          ("_release(k_ready, k_empty, v_ready, v_empty, hi, total, STAGES)",
           "_release(k_ready, k_empty, v_ready, v_empty, total, total, STAGES)")],
    **{f"E{r}": [("TAIL_REGS_NEEDED = 56", f"TAIL_REGS_NEEDED = {r}")] for r in (88, 72, 40, 32, 24)},
    "D16": [("return (8 if left <= 8 else 16), rows - left", "return 16, rows - left")],
    **{f"B{r}": [(REGISTERS_NO_TAIL[0], REGISTERS_NO_TAIL[1].format(r))] for r in (216, 224, 232)},
}
NO_MERGE = ('    gl.thread_barrier()\n    arrived = gl.atomic_add(count_ptr + group, 1, sem="acq_rel", scope="gpu")\n'
            '    if arrived == parts - 1:', "    arrived = pid_m\n    if arrived == parts + 1:")
IDLE_TAIL = [("    total = n_tiles + n_block\n", "    total = n_tiles * 0\n"),
             *[(f"mbarrier.init({b}.index(i), count=CONSUMERS + (TAIL > 0))", f"mbarrier.init({b}.index(i), count=CONSUMERS)")
               for b in ("k_empty", "v_empty")]]
Q_IN_REGISTERS = [  # the consumers' q.k with q in registers (read from shared memory once) instead of shared memory
    ("    _stage_rows(q_ptr, q_smem, row0, rows, head, stride_qt, stride_qh, GROUP, D, BLOCK_M)\n",
     "    _stage_rows(q_ptr, q_smem, row0, rows, head, stride_qt, stride_qh, GROUP, D, BLOCK_M)\n"
     "    q_reg = q_smem.load(gl.DotOperandLayout(operand_index=0, parent=QK, k_width=2))\n"),
    ("    s = warpgroup_mma(q_smem, k_ring.index(0)", "    s = warpgroup_mma(q_reg, k_ring.index(0)"),
    ("    s = warpgroup_mma_wait(0, deps=(s, ))\n    mbarrier.arrive(k_empty.index(0)",
     "    s, q_reg = warpgroup_mma_wait(0, deps=(s, q_reg))\n    mbarrier.arrive(k_empty.index(0)"),
    ("        s_token = warpgroup_mma(q_smem, k_ring", "        s_token = warpgroup_mma(q_reg, k_ring"),
    ("            s = warpgroup_mma_wait(1, deps=(s_token, ))\n        else:",
     "            s, q_reg = warpgroup_mma_wait(1, deps=(s_token, q_reg))\n        else:"),
    ("            s = warpgroup_mma_wait(2, deps=(s_token, ))", "            s, q_reg = warpgroup_mma_wait(2, deps=(s_token, q_reg))"),
]
_TEXT = SOURCE.read_text()
_TAIL_BODY = _TEXT[_TEXT.index("    _inputs_ready()\n    parts = gl.num_programs(0)"):_TEXT.index("\n\n@gluon.jit\ndef _tail_seen")]
ROWS_SHARED = [(_TAIL_BODY, """    _inputs_ready()
    parts = gl.num_programs(0)
    pid_m = gl.program_id(0)
    total = n_tiles + n_block
    share = gl.cdiv(rows - row0, parts)
    mine = row0 + pid_m * share
    mine_end = gl.minimum(mine + share, rows)
    if mine < mine_end:
        acc, m_i, l_i = _attend_tail(q_ptr, qt_smem, pt_smem, k_ring, v_ring, k_ready, k_empty, v_ready, v_empty, 0,
                                     total, mine, mine_end, head, stride_qt, stride_qh, start, end, n_tiles, block_cols,
                                     mask_ptr, mask_stride, qk_scale, GROUP, D, BLOCK_N, STAGES, TAIL)
        ST: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, TAIL, 16])
        rws = mine + gl.arange(0, TAIL, layout=gl.SliceLayout(0, ST))
        dims = gl.arange(0, D, layout=gl.SliceLayout(1, ST))
        out = acc * gl.where(l_i > 0.0, 1.0 / l_i, 0.0)[None, :]
        gl.store(o_ptr + (base + rws[None, :]) * D + dims[:, None], out.to(q_ptr.dtype.element_ty),
                 mask=(rws[None, :] < mine_end) & (dims[:, None] < D))
        lse = gl.where(l_i > 0.0, (m_i + gl.log2(l_i)) * LN2, float("-inf"))
        gl.store(lse_ptr + base + rws, lse, mask=rws < mine_end)
    else:
        _release(k_ready, k_empty, v_ready, v_empty, 0, total, STAGES)""")]
NO_COUNT = ('    arrived = gl.atomic_add(count_ptr + group, 1, sem="acq_rel", scope="gpu")\n    if arrived == parts - 1:',
            "    arrived = pid_m\n    if arrived == parts + 1:")
CHANGES |= {"M": [NO_MERGE], "MB": [NO_COUNT], "AM": CHANGES["A"] + [NO_MERGE], "Z": IDLE_TAIL + [NO_MERGE], "ZM": IDLE_TAIL, "QR": Q_IN_REGISTERS,
            "R": ROWS_SHARED}
RUNS = [("base", 64), ("base", 65), ("base", 256), ("base", 257), ("notail", 65), ("notail", 257),
        ("A", 65), ("A", 257), ("B216", 64), ("B216", 256), ("B224", 64), ("B232", 64),
        ("E88", 65), ("E88", 257), ("E72", 65), ("E72", 257),
        ("E40", 65), ("E40", 257), ("E32", 65), ("E24", 65), ("D16", 65), ("D16", 257),
        *[(name, n) for name in ("M", "MB", "AM", "Z", "ZM") for n in (65, 257)], *[("QR", n) for n in (64, 65, 256, 257)],
        ("R", 65), ("R", 257)]


def variant(name: str, text: str):
    """The kernel module with CHANGES[name] applied (`against`: text as it is), imported from a
    file beside it."""
    for old, new in CHANGES.get(name, []):
        if text.count(old) != 1:
            raise RuntimeError(f"variant {name}: the kernel's text changed ({old[:60]!r})")
        text = text.replace(old, new)
    SOURCE.with_name(f"_variant_{name}.py").write_text(text)
    return importlib.import_module(f"ddtree.kernels._variant_{name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("output")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--against", default=None, help="a kernel module's file to time beside this one")
    ap.add_argument("--cases", default=None, help="only these cases, e.g. base_64,A_65")
    ap.add_argument("--profile", action="store_true", help="one call a case in an NVTX range of its name, untimed")
    args = ap.parse_args()
    runs = RUNS + ([("against", n) for n in (64, 65, 256, 257)] if args.against else [])
    if args.cases:
        wanted = args.cases.split(",")
        unknown = set(wanted) - {f"{label}_{n}" for label, n in runs}
        if unknown:
            raise SystemExit(f"unknown cases {sorted(unknown)}; the cases are {[f'{lb}_{n}' for lb, n in runs]}")
        runs = [(label, n) for label, n in runs if f"{label}_{n}" in wanted]
    hq, hkv, d = HEADS
    text = SOURCE.read_text()
    try:
        modules = {"base": base, "notail": base} | {name: variant(name, text) for name in CHANGES}
        if args.against:
            modules["against"] = variant("against", Path(args.against).read_text())
        cases = {}
        for n in sorted({n for _, n in runs}):
            keys = -(-(args.context + n) // 256) * 256
            gen = torch.Generator(device="cuda").manual_seed(n)
            q = torch.randn(n, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            cache = torch.randn(2, keys, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            cases[n] = (q, cache[0], cache[1], keys, torch.tensor(args.context, device="cuda", dtype=torch.int32))
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        times, errors, diffs, outputs = {}, {}, {}, {}
        for rep in range(1 if args.profile else args.repeats):  # every case once a pass: drift hits all alike
            for label, n in runs:
                key = f"{label}_{n}"
                if key in errors:
                    continue
                mod = modules[label]
                config = {"TAIL": False} if label == "notail" else None
                q, k, v, keys, prefix = cases[n]
                rows = n * hq // hkv
                splits = mod.splits_for(mod.tiling(d, rows, hkv, sms) | (config or {}), rows, hkv, sms, keys, d)
                call = lambda: mod.prefix_attention(q, k, v, prefix, keys, splits, d ** -0.5, config)  # noqa: E731
                try:
                    if rep == 0:
                        o = call()[0].float()
                        if label == "base":
                            outputs[(n, splits)] = o
                        elif (n, splits) in outputs:
                            diffs[key] = (o - outputs[(n, splits)]).abs().max().item()
                    if args.profile:  # compiled above; this call alone in the case's range
                        torch.cuda.synchronize()
                        with torch.cuda.nvtx.range(key):
                            call()
                        torch.cuda.synchronize()
                        continue
                    us = call_us(call)
                except Exception as error:  # report it and go on
                    errors[key] = f"{type(error).__name__}: {str(error)[:300]}"
                    print(key, errors[key], flush=True)
                    continue
                times.setdefault(key, []).append(us)
                print(rep, key, f"splits={splits}", round(us, 2), flush=True)
    finally:
        for name in [*CHANGES, "against"]:
            SOURCE.with_name(f"_variant_{name}.py").unlink(missing_ok=True)
    result = {"benchmark": "prefix_tail_variants",
              "command": f"python benchmarks/prefix_tail_variants.py OUT --context {args.context} --repeats {args.repeats}"
                         + (f" --against {args.against}" if args.against else "")
                         + (f" --cases {args.cases}" if args.cases else ""),
              "gpu": torch.cuda.get_device_name(), "git_revision": git_revision(), "context": args.context,
              "heads": list(HEADS), "median_us": {key: statistics.median(v) for key, v in times.items()},
              "all_us": times, "max_diff_from_base": diffs, "errors": errors}
    print(json.dumps(result["median_us"], indent=1))
    Path(args.output).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    with torch.inference_mode():
        main()
