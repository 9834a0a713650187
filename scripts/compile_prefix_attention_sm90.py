"""Compile the Gluon prefix kernel (`ddtree/kernels/prefix_attention_sm90.py`) for sm_90 without a
GPU, at every tiling it picks from, at Qwen3-8B's and Qwen3.6-27B's heads, for one sequence and for
a batch's rows, and report its shared memory, its registers (maxnreg, and what setmaxnreg gives
each partition) and any spills (ptxas spills to the stack frame, not to the LOCAL count):

    python scripts/compile_prefix_attention_sm90.py [--sass-hash]

--sass-hash adds a hash of each tiling's disassembled instructions (addresses dropped), to show that
a change to the source left the machine code of a tiling as it was.

Exit status 1 if a configuration does not compile. Compiling is not running: whether it is right and
fast is the GPU's to find (tests/test_prefix_attention_sm90.py, benchmarks/prefix_attention_sm90.py).
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


TILINGS = (  # (name, group, head_dim, dtype name, tiling): every tiling `tiling` picks, at both models' heads
    ("qwen3-8b, two consumers, 128-key tiles", 4, 128, "bf16",
     {"CONSUMERS": 2, "BLOCK_N": 128, "STAGES": 2, "PER_SM": 1}),
    ("qwen3-8b, one consumer, two programs an SM", 4, 128, "bf16",
     {"CONSUMERS": 1, "BLOCK_N": 64, "STAGES": 3, "PER_SM": 2}),
    ("qwen3.6-27b, two consumers, 64-key tiles", 6, 256, "bf16",
     {"CONSUMERS": 2, "BLOCK_N": 64, "STAGES": 2, "PER_SM": 1}),
    ("qwen3.6-27b, one consumer", 6, 256, "bf16", {"CONSUMERS": 1, "BLOCK_N": 64, "STAGES": 3, "PER_SM": 1}),
    ("fp16, head_dim 64", 4, 64, "fp16", {"CONSUMERS": 2, "BLOCK_N": 128, "STAGES": 2, "PER_SM": 1}),
    ("qwen3-8b, two consumers and a tail of 8", 4, 128, "bf16",
     {"CONSUMERS": 2, "BLOCK_N": 128, "STAGES": 2, "PER_SM": 1, "TAIL": 8}),
    ("fp16, head_dim 64, a tail of 16", 4, 64, "fp16",
     {"CONSUMERS": 2, "BLOCK_N": 128, "STAGES": 2, "PER_SM": 1, "TAIL": 16}),
    ("qwen3.6-27b, two consumers and a tail of 8", 6, 256, "bf16",
     {"CONSUMERS": 2, "BLOCK_N": 64, "STAGES": 2, "PER_SM": 1, "TAIL": 8}),
    ("qwen3.6-27b, two consumers and a tail of 16", 6, 256, "bf16",
     {"CONSUMERS": 2, "BLOCK_N": 64, "STAGES": 2, "PER_SM": 1, "TAIL": 16}),
    ("qwen3-8b, a batch's rows, two consumers and a tail of 8", 4, 128, "bf16",
     {"CONSUMERS": 2, "BLOCK_N": 128, "STAGES": 2, "PER_SM": 1, "TAIL": 8, "BATCHED": True}),
    ("qwen3.6-27b, a batch's rows, one consumer", 6, 256, "bf16",
     {"CONSUMERS": 1, "BLOCK_N": 64, "STAGES": 3, "PER_SM": 1, "BATCHED": True}),
)


def sass_hash(cubin: bytes) -> str:
    """A hash of the cubin's instructions as `cuobjdump -sass` prints them, addresses and
    encodings dropped, and their count."""
    import hashlib
    import re

    from check_kernels_compile import cuobjdump

    text = cuobjdump(cubin, "-sass") or ""
    address = re.compile(r"/\*[0-9a-f]{4,6}\*/")
    lines = [address.sub("", line).split(";")[0].strip() for line in text.splitlines() if address.search(line)]
    return f"{hashlib.sha256(chr(10).join(lines).encode()).hexdigest()[:16]} ({len(lines)} instructions)"


def main() -> int:
    import torch

    from check_kernels_compile import SHARED_LIMITS, compile_gluon, resource_usage
    from ddtree.kernels.prefix_attention_sm90 import _prefix_kernel, registers, shared_layouts

    failed = 0
    for name, group, head_dim, dtype_name, t in TILINGS:
        dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float16
        q_smem, kv_smem = shared_layouts(head_dim, dtype, 64, t["BLOCK_N"])
        descriptor = f"tensordesc<{dtype_name}[{t['BLOCK_N']}, {head_dim}],{kv_smem!r}>"
        signature = {"q_ptr": f"*{dtype_name}", "k_desc": descriptor, "v_desc": descriptor, "o_ptr": f"*{dtype_name}",
                     "lse_ptr": "*fp32", "prefix_ptr": "*i64", "first_ptr": "*i64", "mask_ptr": "*u8",
                     "part_o_ptr": "*fp32", "part_ml_ptr": "*fp32", "count_ptr": "*i32", "n_tokens": "i32",
                     "batch": "i32", "stride_qt": "i32", "stride_qh": "i32", "keys_per_split": "i32", "lead": "i32",
                     "block_cols": "i32", "mask_stride": "i32", "qk_scale": "fp32", "full_rows": "i32"}
        tail = t.get("TAIL", 0)
        maxnreg, consumer_regs, tail_regs = registers(t["CONSUMERS"], t["PER_SM"], tail > 0)
        constexprs = {"GROUP": group, "D": head_dim, "CONSUMERS": t["CONSUMERS"], "SKIP_IDLE": True, "TAIL": tail,
                      "BLOCK_N": t["BLOCK_N"], "STAGES": t["STAGES"], "Q_SMEM": q_smem,
                      "CONSUMER_REGS": consumer_regs, "TAIL_REGS": tail_regs, "BATCHED": t.get("BATCHED", False),
                      "num_warps": 4}
        signature |= {key: "constexpr" for key in constexprs}
        aligned = ("q_ptr", "o_ptr", "lse_ptr", "stride_qt", "stride_qh")
        attrs = {(_prefix_kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
        compiled = compile_gluon(_prefix_kernel, signature, constexprs, attrs, {"num_warps": 4, "maxnreg": maxnreg},
                                 name)
        if compiled is None:
            failed += 1
            continue
        usage = resource_usage(compiled.asm["cubin"])
        shared = compiled.metadata.shared
        fits = "fits" if shared * t["PER_SM"] <= SHARED_LIMITS[90] else "OVER"
        print(f"ok     {name} {t}: shared {shared} bytes ({fits} at {t['PER_SM']} an SM), maxnreg {maxnreg} "
              f"(consumers {consumer_regs}, loader 24{f', tail {tail_regs}' if tail else ''}), "
              f"local {usage.get('local')}, stack (spills) {usage.get('stack')}"
              + (f", sass {sass_hash(compiled.asm['cubin'])}" if "--sass-hash" in sys.argv else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
