"""Compile the Gluon prefix kernel (`ddtree/kernels/prefix_attention_sm90.py`) for sm_90 without a
GPU, at Qwen3-8B's and Qwen3.6-27B's heads, and report its shared memory and registers a thread:

    python scripts/compile_prefix_attention_sm90.py

Exit status 1 if a configuration does not compile. Compiling is not running: whether it is right and
fast is the GPU's to find (tests/test_prefix_attention_sm90.py, benchmarks/prefix_attention_sm90.py).
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def main() -> int:
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from check_kernels_compile import SHARED_LIMITS, programs_per_sm, resource_usage
    from ddtree.kernels.prefix_attention_sm90 import _prefix_kernel, shared_layouts, tiling

    target = GPUTarget("cuda", 90, 32)
    failed = 0
    for name, group, head_dim, dtype, override in (
            ("qwen3-8b", 4, 128, torch.bfloat16, {}),
            ("qwen3-8b, 128-key tiles", 4, 128, torch.bfloat16, {"BLOCK_N": 128, "STAGES": 2}),
            ("qwen3-8b, 64-row blocks", 4, 128, torch.bfloat16, {"BLOCK_M": 64, "num_warps": 4}),
            ("qwen3.6-27b", 6, 256, torch.bfloat16, {}),
            ("qwen3.6-27b, 64-row blocks", 6, 256, torch.bfloat16, {"BLOCK_M": 64, "num_warps": 4}),
            ("fp16, head_dim 64", 4, 64, torch.float16, {})):
        t = tiling(head_dim) | override
        q_smem, kv_smem = shared_layouts(head_dim, dtype, t["BLOCK_M"], t["BLOCK_N"])
        ptr = "*bf16" if dtype == torch.bfloat16 else "*fp16"
        signature = {"q_ptr": ptr, "k_ptr": ptr, "v_ptr": ptr, "o_ptr": ptr, "lse_ptr": "*fp32", "prefix_ptr": "*i32",
                     "n_tokens": "i32", "stride_qt": "i32", "stride_qh": "i32", "stride_kt": "i32",
                     "stride_kh": "i32", "stride_vt": "i32", "stride_vh": "i32", "keys_per_split": "i32",
                     "qk_scale": "fp32"}
        constexprs = {"GROUP": group, "D": head_dim, "BLOCK_M": t["BLOCK_M"], "BLOCK_N": t["BLOCK_N"],
                      "STAGES": t["STAGES"], "Q_SMEM": q_smem, "KV_SMEM": kv_smem, "num_warps": t["num_warps"]}
        signature |= {key: "constexpr" for key in constexprs}
        aligned = ("q_ptr", "k_ptr", "v_ptr", "o_ptr", "lse_ptr", "stride_qt", "stride_qh", "stride_kt", "stride_kh",
                   "stride_vt", "stride_vh")
        attrs = {(_prefix_kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
        try:
            compiled = triton.compile(GluonASTSource(_prefix_kernel, signature, constexprs, attrs), target=target,
                                      options={"num_warps": t["num_warps"]})
        except Exception as error:
            failed += 1
            print(f"FAILED {name}: {type(error).__name__}: {str(error).strip()[-3000:]}")
            continue
        usage = resource_usage(compiled.asm["cubin"])
        shared = compiled.metadata.shared
        fits = programs_per_sm(usage.get("registers", 0), shared, t["num_warps"], SHARED_LIMITS[90]) if usage else "?"
        print(f"ok     {name} {t}: shared {shared} bytes, registers {usage.get('registers')}, "
              f"local {usage.get('local')} ({fits} an SM)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
