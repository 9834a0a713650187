"""Compile the Gluon projection kernel (`ddtree/kernels/projection_sm90.py`) for sm_90 without a GPU,
at Qwen3-8B's projections and a verify's row counts, and report each tiling's shared memory,
registers and any spills:

    python scripts/compile_projection_sm90.py

Exit status 1 if a case does not compile. Whether it is right and fast is the GPU's to find
(tests/test_projection_sm90.py, benchmarks/projection_sm90.py).
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

CASES = (  # (rows, N, K, accumulate): gate/up, down (added into the residual), q/k/v, o
    (65, 24576, 4096, False), (65, 4096, 12288, True), (17, 6144, 4096, False), (1, 4096, 4096, True),
    (128, 4096, 4096, False))


def main() -> int:
    from triton.experimental.gluon import language as gl

    from check_kernels_compile import SHARED_LIMITS, compile_gluon, resource_usage
    from ddtree.kernels.projection_sm90 import _projection_kernel, max_registers, tiling

    failed = 0
    for m, n, k, accumulate in CASES:
        t = tiling(m, n, k, 132)
        bm, bk, mp = t["BM"], t["BK"], t["MP"]
        layouts = {name: gl.NVMMASharedLayout.get_default_for(shape, gl.bfloat16)
                   for name, shape in (("w", [bm, bk]), ("x", [mp, bk]), ("xt", [8, bk]))}
        signature = {"w_desc": f"tensordesc<bf16[{bm}, {bk}],{layouts['w']!r}>",
                     "x_desc": f"tensordesc<bf16[{mp}, {bk}],{layouts['x']!r}>",
                     "xt_desc": f"tensordesc<bf16[8, {bk}],{layouts['xt']!r}>", "y_ptr": "*bf16",
                     "part_ptr": "*fp32", "count_ptr": "*i32", "M": "i32", "N": "i32", "stride_ym": "i32",
                     "steps_k": "i32", "total": "i32", "max_runs": "i32"}
        constexprs = {"BM": bm, "BK": bk, "MP": mp, "TAIL": t["TAIL"], "W_STAGES": t["W_STAGES"],
                      "X_STAGES": t["X_STAGES"], "ACCUMULATE": accumulate, "num_warps": t["WARPS"]}
        signature |= {key: "constexpr" for key in constexprs}
        name = f"{m} rows x [{n}, {k}]{' +=' if accumulate else ''}"
        compiled = compile_gluon(_projection_kernel, signature, constexprs, {},
                                 {"num_warps": t["WARPS"], "maxnreg": max_registers(t["WARPS"])}, name)
        if compiled is None:
            failed += 1
            continue
        usage = resource_usage(compiled.asm["cubin"])
        shared = compiled.metadata.shared
        fits = "fits" if shared <= SHARED_LIMITS[90] else "OVER"
        print(f"ok     {name}: MP {mp} + {t['TAIL']}, W_STAGES {t['W_STAGES']}, X_STAGES {t['X_STAGES']}, shared "
              f"{shared} bytes ({fits}), registers {usage.get('registers')}, local {usage.get('local')}, "
              f"stack (spills) {usage.get('stack')}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
