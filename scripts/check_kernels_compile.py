"""Compile every Triton kernel the CPU tests launch for an NVIDIA GPU, without one.

Triton's interpreter (how the tests run the kernels on a CPU) lets through some code its compiler
refuses, e.g. one name given tiles of two shapes in two branches of an `if`. This finds those
before a GPU does:

    python scripts/check_kernels_compile.py [--arch 90] [pytest arguments]

1. runs the tests (default: the kernel tests, when no test path is given) in the interpreter,
   recording each launch: the kernel, its arguments' types, which of them a GPU launch would
   specialise as 16-byte aligned (a tensor whose address, an integer whose value, is a multiple of
   16, as Triton's launcher does), its constexprs and num_warps / num_stages / maxnreg;
2. compiles each distinct launch, in a process without the interpreter, with `triton.compile`
   for the target (sm_90, the H100's and H200's, by default), down to a cubin, with those
   alignments: they are what lets the compiler pipeline a loop's loads through shared memory, so
   the shared memory it reports is what a GPU launch would ask for. A launch asking for more than
   the target's per-block limit (227 KiB on sm_90) is listed as OVER: a GPU would refuse it. Not a
   failure here, since the interpreter's tests may force a tiling in float32 that GPU launches only
   take with 2-byte inputs.

`--record-only` records the launches without running them (their outputs are garbage): for
`scripts/model_shape_launches.py`, the verify's launches at real model shapes, too large for the
interpreter to run in reasonable time.

Each launch's line also gives its registers a thread, its local bytes and its stack bytes (where
ptxas's spills land), from the cubin (`cuobjdump -res-usage`, shipped with Triton): with num_warps
they bound how many programs share an SM; and the seconds its compile took on this machine
(Triton's cache off, so every launch is compiled), what a GPU machine's first use of that launch
spends before it runs. Compiling is not running: the numbers are the GPU's to find. Exit status 1
if a launch does not compile.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD_ENV = "DDTREE_RECORD_LAUNCHES"
RECORD_ONLY_ENV = "DDTREE_RECORD_ONLY"
KERNEL_TESTS = ["tests/test_tree_attention.py", "tests/test_batched_attention.py", "tests/test_gdn_kernels.py",
                "tests/test_gdn_tree_inputs.py", "tests/test_kv_write.py", "tests/test_tree_kernels.py",
                "tests/test_qk_rope_write.py"]
POINTER_TYPES = {"float32": "*fp32", "bfloat16": "*bf16", "float16": "*fp16", "float64": "*fp64", "int64": "*i64",
                 "int32": "*i32", "int16": "*i16", "int8": "*i8", "uint8": "*u8", "bool": "*i1"}
OPTIONS = ("num_warps", "num_stages", "maxnreg")
# Shared memory one block may use, by compute capability (CUDA's opt-in maximum per block).
SHARED_LIMITS = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448, 120: 101376}


# -- 1. recording, as a pytest plugin (`-p check_kernels_compile` with this folder on the path) --------

def _arg_type(value) -> str:
    """The compiler's signature type of a launch argument."""
    import torch

    if isinstance(value, torch.Tensor):
        return POINTER_TYPES[str(value.dtype).removeprefix("torch.")]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no signature type for {type(value).__name__}")


def _record(launches: list, fn, args: tuple, kwargs: dict) -> None:
    import inspect

    params = inspect.signature(fn).parameters
    bound = dict(zip(params, args)) | {k: v for k, v in kwargs.items() if k in params}
    signature, constexprs, aligned = {}, {}, []
    for name, param in params.items():
        if "constexpr" in str(param.annotation):
            constexprs[name] = bound.get(name, param.default)
        else:
            signature[name] = _arg_type(bound[name])
            if _aligned(bound[name]):
                aligned.append(name)
    launches.append({"module": fn.__module__, "kernel": fn.__name__, "signature": signature, "constexprs": constexprs,
                     "aligned": aligned, "options": {k: kwargs[k] for k in OPTIONS if k in kwargs}})


def _aligned(value) -> bool:
    """Whether a GPU launch would specialise this argument as divisible by 16 (Triton's launcher:
    a tensor's address, an integer's value)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.data_ptr() % 16 == 0
    return isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0


if os.environ.get(RECORD_ENV):
    from triton.runtime import interpreter

    _LAUNCHES: list = []
    _run = interpreter.InterpretedFunction.run

    def _recording_run(self, *args, grid, warmup, **kwargs):
        _record(_LAUNCHES, self.fn, args, kwargs)
        if os.environ.get(RECORD_ONLY_ENV):
            return None
        return _run(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = _recording_run

    def pytest_sessionfinish(session, exitstatus):
        unique = {json.dumps(launch, sort_keys=True) for launch in _LAUNCHES}
        Path(os.environ[RECORD_ENV]).write_text(json.dumps([json.loads(u) for u in sorted(unique)]))


# -- 2. compiling ------------------------------------------------------------------------------------------

def cuobjdump(cubin: bytes, flag: str) -> str | None:
    """Triton's cuobjdump `flag` (e.g. -res-usage, -sass) over a compiled kernel's cubin -> its
    output (None where that tool is missing)."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), flag, f.name], capture_output=True, text=True).stdout


def resource_usage(cubin: bytes) -> dict[str, int]:
    """{"registers": R, "local": L, "stack": S} (a thread's registers, local-memory bytes and stack
    bytes: ptxas's spills land in the stack frame, STL / LDL on it, and not in LOCAL) of a compiled
    kernel, read from its cubin with Triton's cuobjdump ({} where that tool is missing)."""
    report = cuobjdump(cubin, "-res-usage")
    if report is None:
        return {}
    fields = dict(item.split(":", 1) for line in report.splitlines() if "REG:" in line for item in line.split())
    if "REG" not in fields:
        return {}
    return {"registers": int(fields["REG"]), "local": int(fields["LOCAL"]), "stack": int(fields.get("STACK", 0))}


def compile_gluon(kernel, signature: dict, constexprs: dict, attrs: dict, options: dict, name: str):
    """A Gluon kernel compiled for sm_90 -> the compiled kernel, or None after printing why not
    (`FAILED name: ...`)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    try:
        return triton.compile(GluonASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                              options=options)
    except Exception as error:
        print(f"FAILED {name}: {type(error).__name__}: {str(error).strip()[-3000:]}")
        return None


def programs_per_sm(registers: int, shared: int, num_warps: int, shared_limit: int) -> int:
    """How many programs (CTAs) of a launch an SM holds at once (sm_80+ limits: 64K registers,
    allocated per warp in units of 256; 64 warps; 32 CTAs; shared memory plus 1 KiB reserved a CTA)."""
    per_warp = -(-registers * 32 // 256) * 256
    by_registers = 65536 // (per_warp * num_warps) if registers else 32
    by_shared = shared_limit // (shared + 1024)
    return max(0, min(by_registers, by_shared, 64 // num_warps, 32))


def compile_launches(path: Path, arch: int) -> int:
    """Compile every recorded launch for sm_<arch> -> the number that failed."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    limit = SHARED_LIMITS.get(arch)
    failed = over = 0
    for launch in json.loads(path.read_text()):
        if not launch["module"].startswith("ddtree."):  # a test's own kernel, defined inside the test
            print(f"skip   {launch['module']}.{launch['kernel']} (a test's helper, not the package's)")
            continue
        kernel = getattr(importlib.import_module(launch["module"]), launch["kernel"])
        constexprs = launch["constexprs"]
        if "LOOP_WHILE" in constexprs:  # the interpreter's loops; a GPU launch takes `range` loops
            constexprs = constexprs | {"LOOP_WHILE": False}
        signature = launch["signature"] | {name: "constexpr" for name in constexprs}
        attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in launch["aligned"]}
        name = f"{launch['module']}.{launch['kernel']} {constexprs} {launch['options']}"
        try:
            start = time.perf_counter()
            compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                                      target=target, options=launch["options"])
            seconds = time.perf_counter() - start
        except Exception as error:  # report every launch that fails, not only the first
            failed += 1
            print(f"FAILED {name}\n  {type(error).__name__}: {str(error).strip()[-800:]}")
            continue
        shared = compiled.metadata.shared
        if limit is not None and shared > limit:
            over += 1
            print(f"OVER   {name}\n  shared memory: {shared} bytes, over sm_{arch}'s {limit} per block "
                  f"(inputs {sorted(set(t for t in launch['signature'].values() if t.startswith('*')))})")
        else:
            usage = resource_usage(compiled.asm["cubin"])
            detail = f" regs {usage['registers']} local {usage['local']} stack {usage['stack']}" if usage else ""
            if usage and limit is not None:
                fits = programs_per_sm(usage["registers"], shared, launch["options"].get("num_warps", 4), limit)
                detail += f" ({fits} an SM)"
            print(f"ok     {name} shared {shared}{detail} compiled in {seconds:.1f} s")
    if over:
        print(f"{over} launch(es) over sm_{arch}'s shared memory: a GPU would refuse them")
    return failed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="the GPU's compute capability, e.g. 90 (sm_90)")
    ap.add_argument("--record-only", action="store_true", help="record the launches without running them")
    args, pytest_args = ap.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "launches.json"
        env = dict(os.environ, TRITON_INTERPRET="1", **{RECORD_ENV: str(record)})
        if args.record_only:
            env[RECORD_ONLY_ENV] = "1"
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(Path(__file__).parent), env.get("PYTHONPATH", "")])
        paths = [arg for arg in pytest_args if arg.split("::")[0].endswith(".py") or (ROOT / arg).is_dir()]
        tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "check_kernels_compile", *pytest_args,
                                *([] if paths else KERNEL_TESTS)], cwd=ROOT, env=env)
        if not record.exists():
            sys.exit(f"the tests recorded no launches (pytest exit status {tests.returncode})")
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["TRITON_ALWAYS_COMPILE"] = "1"  # every launch compiled, so that its seconds are its compile's
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        compiled = subprocess.run([sys.executable, __file__, "--compile", str(record), "--arch", str(args.arch)],
                                  cwd=ROOT, env=env)
    sys.exit(1 if compiled.returncode or tests.returncode else 0)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--compile":
        arch = int(sys.argv[sys.argv.index("--arch") + 1]) if "--arch" in sys.argv else 90
        sys.exit(1 if compile_launches(Path(sys.argv[2]), arch) else 0)
    main()
