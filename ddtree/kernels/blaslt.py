"""Projections through cuBLASLt with the kernel timed fastest on this GPU: y [M, N] = x [M, K] @
W [N, K]^T, or y += x @ W^T in place, for a verify's few rows.

Why: PyTorch's `F.linear` / `addmm_` take cuBLAS's first heuristic choice for every shape, and at a
verify's few rows the projections run 4-9 us above their weights' copy time (benchmarks/README.md,
"What is left at 64 over 32k"). cuBLASLt's heuristic offers a ranked list of kernels for a shape
(tiles, split-K); on an H100 at Qwen3-8B's shapes one of its others beat its first by up to 4 us
(`benchmarks/blaslt_algos.py`). `linear` times them the first time it meets a shape (outside a
CUDA graph's capture) and keeps the fastest where it beats PyTorch's own call; where nothing beat
it, PyTorch's call runs. On by default (DDTREE_BLAS_CHOICE=0 keeps PyTorch's call everywhere): in
whole rounds over 32k tokens on three H100 leases it took 0.02-0.33 ms off every budget's round
but one lease's 256 (benchmarks/README.md, "cuBLASLt's other kernels for the projections");
not yet timed on the H200. Its timings add about a minute to a batching server's first start on a
machine (whose round costs meet many row counts); later starts restore them from disk. Every
bias-free projection of the targets and the drafter comes through `linear`; inside a
`torch.compile`d function (the drafter's layers, a dense target's unfolded ones) it is the op
`ddtree::blaslt_linear`, which the compiled code calls as it runs. Where cuBLASLt cannot be loaded
every shape keeps PyTorch's call (one warning); where a shape's plan fails, that shape does.
With `DDTREE_BLAS_SEARCH=SECONDS` (opt-in) the configurations near the heuristic's
(`blaslt_search`) are timed too: on two H100 leases that took 0.06-0.11 ms off a 256 verify over
32k and added 46-83 s to a first start (benchmarks/README.md, "cuBLASLt's configurations near its
heuristic's").

Choices are kept on disk (`cache_path`: $DDTREE_CACHE_DIR, default ~/.cache/ddtree, file
blaslt_choices.json), keyed by the GPU's name, the cuBLASLt build and the shape: cuBLASLt's
algorithm description may be saved and restored for the same library version, so a later start
restores each shape's choice instead of timing it (a batching server's start-up meets a hundred
shapes, about a minute of timings on an H100), after one call checked against PyTorch's output; a
saved kernel that fails or disagrees is timed again. A cache that cannot be read or written is
logged once and the choices are timed as without it.

The call is the one PyTorch makes for `F.linear`: column-major D [N, M] = op(A) @ B with A = W
(K x N, ld K, transposed), B = x (K x M, ld K), bf16 / fp16 in, the output in that dtype or
float32, float32 accumulation and scale; `accumulate` sets beta = 1 with C = D = y. Host scalars,
so a CUDA graph captures a call (cuBLASLt reads alpha / beta when the call is made). One handle and
one workspace per device: the engines run their GPU work on one stream at a time (a graph's warm-up
stream and the main stream wait on each other), so no two calls use the workspace at once.
"""
from __future__ import annotations

import ctypes
import functools
import glob
import json
import logging
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ddtree.kernels.graph_timing import graph_call_us

log = logging.getLogger("ddtree.blaslt")
ENABLED = os.environ.get("DDTREE_BLAS_CHOICE", "1") != "0"
# Seconds a shape for the walk of every configuration near the heuristic's (`blaslt_search`); 0: off.
SEARCH_SECONDS = float(os.environ.get("DDTREE_BLAS_SEARCH", "0") or 0)
SEARCH_KEEP = 8  # the walk's fastest, by one eager timing, timed again beside the heuristic's
MAX_ROWS = 512  # a verify's rows; a prefill's chunks keep PyTorch's call

# cublasLt.h / library_types.h values.
_COMPUTE_32F = 68
_R_32F, _R_16F, _R_16BF = 0, 2, 14
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_OP_N, _OP_T = 0, 1
_PREF_MAX_WORKSPACE_BYTES = 1
_ALGO_CONFIG = {"id": 0, "tile": 1, "splitk": 2, "reduction": 3, "swizzle": 4, "custom": 5, "stages": 6, "inner": 7,
                "cluster": 8}
_CONFIG_UINT16 = {"inner", "cluster"}
_DTYPES = {torch.bfloat16: _R_16BF, torch.float16: _R_16F, torch.float32: _R_32F}
WORKSPACE_BYTES = 32 << 20


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", _Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


class CublasLtMissing(RuntimeError):
    """No libcublasLt could be found beside PyTorch."""


def _library_path() -> str:
    """The libcublasLt this process's PyTorch loaded (after one matmul), else one beside it."""
    torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "libcublasLt.so" in line:
                return line.split()[-1]
    roots = [os.path.dirname(torch.__file__), os.path.join(os.path.dirname(torch.__file__), "..", "nvidia")]
    for root in roots:
        found = sorted(glob.glob(os.path.join(root, "**", "libcublasLt.so*"), recursive=True))
        if found:
            return found[0]
    raise CublasLtMissing("libcublasLt was not found beside PyTorch")


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL(_library_path())
    p, i, u64, i64, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
    sigs = {
        "cublasLtCreate": [ctypes.POINTER(p)],
        "cublasLtMatmulDescCreate": [ctypes.POINTER(p), i, i],
        "cublasLtMatmulDescSetAttribute": [p, i, p, sz],
        "cublasLtMatrixLayoutCreate": [ctypes.POINTER(p), i, u64, u64, i64],
        "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(p)],
        "cublasLtMatmulPreferenceSetAttribute": [p, i, p, sz],
        "cublasLtMatmulPreferenceDestroy": [p],
        "cublasLtMatmulAlgoGetHeuristic": [p, p, p, p, p, p, p, i, ctypes.POINTER(_HeuristicResult), ctypes.POINTER(i)],
        "cublasLtMatmul": [p, p, p, p, p, p, p, p, p, p, p, p, ctypes.POINTER(_Algo), p, sz, p],
        "cublasLtMatmulAlgoConfigGetAttribute": [ctypes.POINTER(_Algo), i, p, sz, ctypes.POINTER(sz)],
    }
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    lib.cublasLtGetVersion.argtypes, lib.cublasLtGetVersion.restype = [], sz
    return lib


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed with cublasStatus {status}")


@functools.cache
def _handle(device: int) -> tuple[int, torch.Tensor]:
    """(cuBLASLt handle, workspace) for a device."""
    handle = ctypes.c_void_p()
    _check(_lib().cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    return handle.value, torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=f"cuda:{device}")


@dataclass(frozen=True)
class Candidate:
    """One of cuBLASLt's kernels for a shape: its algorithm (opaque) and what it says of itself."""

    algo: _Algo
    workspace: int
    waves: float
    config: dict

    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.config.items())


def _describe(algo: _Algo) -> dict:
    """The algorithm's settings by name (those it has)."""
    out = {}
    for name, attr in _ALGO_CONFIG.items():
        value, written = (ctypes.c_uint16 if name in _CONFIG_UINT16 else ctypes.c_uint32)(), ctypes.c_size_t()
        if _lib().cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(value),
                                                      ctypes.sizeof(value), ctypes.byref(written)) == 0:
            out[name] = value.value
    return out


class LtProjection:
    """y [m, n] = x [m, k] @ W [n, k]^T (accumulate: y += ...) on one device: x and W in `dtype`
    (bf16 / fp16), y in `out_dtype` (that dtype, or float32)."""

    def __init__(self, m: int, n: int, k: int, dtype: torch.dtype, accumulate: bool = False, device: int = 0,
                 out_dtype: torch.dtype | None = None):
        out_dtype = out_dtype or dtype
        if dtype not in (torch.bfloat16, torch.float16) or out_dtype not in (dtype, torch.float32):
            raise ValueError(f"cuBLASLt projections take bf16 or fp16 in and that or float32 out, not {dtype} -> {out_dtype}")
        self.m, self.n, self.k, self.dtype, self.out_dtype, self.accumulate = m, n, k, dtype, out_dtype, accumulate
        self.device = device
        lib, t = _lib(), _DTYPES[dtype]
        self.desc = ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F, _R_32F), "MatmulDescCreate")
        for attr, op in ((_DESC_TRANSA, _OP_T), (_DESC_TRANSB, _OP_N)):
            value = ctypes.c_int32(op)
            _check(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(value), 4), "MatmulDescSetAttribute")
        self.a, self.b, self.c = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self.a), t, k, n, k), "MatrixLayoutCreate")
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self.b), t, k, m, k), "MatrixLayoutCreate")
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self.c), _DTYPES[out_dtype], n, m, n), "MatrixLayoutCreate")
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(1.0 if accumulate else 0.0)

    def candidates(self, count: int = 32) -> list[Candidate]:
        """cuBLASLt's heuristic's kernels for this shape, its first choice first."""
        lib = _lib()
        pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "MatmulPreferenceCreate")
        limit = ctypes.c_uint64(WORKSPACE_BYTES)
        _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(limit), 8),
               "MatmulPreferenceSetAttribute")
        results, returned = (_HeuristicResult * count)(), ctypes.c_int()
        handle, _ = _handle(self.device)
        try:
            _check(lib.cublasLtMatmulAlgoGetHeuristic(handle, self.desc, self.a, self.b, self.c, self.c, pref, count,
                                                      results, ctypes.byref(returned)), "MatmulAlgoGetHeuristic")
        finally:
            lib.cublasLtMatmulPreferenceDestroy(pref)
        return [Candidate(r.algo, r.workspace_size, r.waves_count, _describe(r.algo))
                for r in results[:returned.value] if r.state == 0]

    def __call__(self, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, candidate: Candidate) -> torch.Tensor:
        """Writes (or with `accumulate` adds) x @ w.T into y [m, n] on the current stream; returns y."""
        assert x.shape == (self.m, self.k) and w.shape == (self.n, self.k) and y.shape == (self.m, self.n)
        assert x.is_contiguous() and w.is_contiguous() and y.is_contiguous() and y.dtype == self.out_dtype
        if torch.cuda.current_device() != y.device.index:  # cuBLASLt launches on the current device
            with torch.cuda.device(y.device):
                return self(x, w, y, candidate)
        handle, workspace = _handle(self.device)
        stream = ctypes.c_void_p(torch.cuda.current_stream(y.device).cuda_stream)
        _check(_lib().cublasLtMatmul(handle, self.desc, ctypes.byref(self.alpha), w.data_ptr(), self.a, x.data_ptr(),
                                     self.b, ctypes.byref(self.beta), y.data_ptr(), self.c, y.data_ptr(), self.c,
                                     ctypes.byref(candidate.algo), workspace.data_ptr(), WORKSPACE_BYTES, stream),
               "cublasLtMatmul")
        return y


@dataclass
class _Choice:
    plan: LtProjection
    candidate: Candidate
    torch_us: float
    us: float


_TIMING = {"calls": 16, "warm": 2, "repeats": 3}  # fewer than the benchmarks: this runs in an engine's warm-up

# (m, n, k, dtype, out dtype, accumulate, device) -> the kernel chosen, or None for PyTorch's call.
_CHOSEN: dict[tuple, _Choice | None] = {}


def chosen() -> list[dict]:
    """What `linear` chose so far, shape by shape (for logs and benchmarks)."""
    rows = []
    for (m, n, k, dtype, out_dtype, accumulate, _), choice in _CHOSEN.items():
        row = {"m": m, "n": n, "k": k, "dtype": str(dtype).removeprefix("torch."), "accumulate": accumulate,
               "float32_out": out_dtype == torch.float32, "lt": choice is not None}
        if choice is not None:
            row |= {"torch_us": round(choice.torch_us, 2), "us": round(choice.us, 2), "kernel": choice.candidate.label()}
        rows.append(row)
    return rows


def _torch_linear(x, w, out, accumulate, out_dtype):
    if accumulate:
        return out.addmm_(x, w.t())
    if out_dtype == torch.float32 and x.dtype != torch.float32:
        return torch.mm(x, w.t(), out_dtype=torch.float32)
    return F.linear(x, w)


def _l2_bytes(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).L2_cache_size


CACHE_FORMAT = "ddtree-blaslt/1"


def cache_path() -> Path:
    """The file of saved choices: $DDTREE_CACHE_DIR/blaslt_choices.json, by default under ~/.cache/ddtree."""
    return Path(os.environ.get("DDTREE_CACHE_DIR") or Path.home() / ".cache" / "ddtree") / "blaslt_choices.json"


def _build(device: int) -> str:
    """The GPU and cuBLASLt build a saved choice holds for."""
    return f"{torch.cuda.get_device_name(device)}|cublasLt {_lib().cublasLtGetVersion()}"


def cache_key(key: tuple, build: str) -> str:
    """A `_CHOSEN` key as the cache file's: 'GPU|cublasLt V|m x n x k|in->out|= or +='."""
    m, n, k, dtype, out_dtype, accumulate, _ = key
    name = lambda t: str(t).removeprefix("torch.")  # noqa: E731
    return f"{build}|{m}x{n}x{k}|{name(dtype)}->{name(out_dtype)}|{'+=' if accumulate else '='}"


_SAVED: dict[str, dict | None] | None = None  # the file's entries, read once a process
_CACHE_FAILED: set[str] = set()  # what failed with the cache ("read", "write", ...), each logged once


def _cache_failed(what: str, exc: Exception) -> None:
    if what not in _CACHE_FAILED:
        log.warning("cuBLASLt choices: could not %s %s (%s); %s", what, cache_path(), exc,
                    "it is written anew" if what == "read" else "they are timed at each start")
    _CACHE_FAILED.add(what)


def _saved() -> dict[str, dict | None]:
    """Saved choices by `cache_key`: {"algo": [8 ints], "workspace", "us", "torch_us"}, or None
    where PyTorch's call was kept ({"torch": True} where that was chosen with the configurations'
    walk, and "searched": True in either); empty where the file is missing, unreadable or of
    another format."""
    global _SAVED
    if _SAVED is None:
        _SAVED = {}
        path = cache_path()
        if path.exists():
            try:
                record = json.loads(path.read_text())
                if record.get("format") == CACHE_FORMAT and isinstance(record.get("choices"), dict):
                    _SAVED = record["choices"]
            except (OSError, ValueError, AttributeError) as exc:
                _cache_failed("read", exc)
    return _SAVED


def _save(name: str, choice: _Choice | None) -> None:
    """Records a shape's choice in the file (re-read first, so that processes sharing it keep each
    other's entries; written whole to a temporary file, then renamed over it)."""
    entry = None if choice is None else {"algo": list(choice.candidate.algo.data),
                                         "workspace": choice.candidate.workspace,
                                         "us": round(choice.us, 2), "torch_us": round(choice.torch_us, 2)}
    if SEARCH_SECONDS > 0:  # chosen with the walk: a start without it restores this too
        entry = (entry or {"torch": True}) | {"searched": True}
    _saved()[name] = entry
    if "write" in _CACHE_FAILED:
        return
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            on_disk = json.loads(path.read_text()).get("choices", {}) if path.exists() else {}
        except (ValueError, AttributeError):
            on_disk = {}
        record = {"format": CACHE_FORMAT, "choices": {**on_disk, **_saved()}}
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as tmp:
            json.dump(record, tmp, indent=0, sort_keys=True)
        os.replace(tmp.name, path)
    except OSError as exc:
        _cache_failed("write", exc)


def _agrees(plan, candidate: Candidate, x, w, want: torch.Tensor, out_dtype: torch.dtype) -> tuple[float, bool]:
    """(largest difference from PyTorch's output `want` over its largest value, whether the
    candidate agrees: below 1e-2 and finite), from one call into zeros of `out_dtype`."""
    got = plan(x, w, torch.zeros(want.shape, dtype=out_dtype, device=x.device), candidate).float()
    err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()
    return err, err < 1e-2 and bool(torch.isfinite(got).all())


def _restore(x, w, accumulate, out_dtype, entry: dict) -> _Choice | None:
    """A saved kernel for this shape, if it runs and agrees with PyTorch's output here; else None."""
    m, k = x.shape
    n = w.shape[0]
    algo = _Algo()
    try:
        algo.data[:] = entry["algo"]
        plan = LtProjection(m, n, k, x.dtype, accumulate, x.device.index or 0, out_dtype)
        candidate = Candidate(algo, int(entry["workspace"]), 0.0, _describe(algo))
        want = _torch_linear(x, w, None, False, out_dtype).float()
        if not _agrees(plan, candidate, x, w, want, out_dtype)[1]:
            return None
    except (RuntimeError, KeyError, TypeError, ValueError):
        return None
    return _Choice(plan, candidate, float(entry.get("torch_us", 0.0)), float(entry.get("us", 0.0)))


def _choice_for(key: tuple, x, w, out, accumulate, out_dtype) -> _Choice | None:
    """A shape's choice: the saved one where the file has it for this GPU and cuBLASLt build (and
    its kernel still agrees), else `_choose`'s, then saved."""
    try:
        name = cache_key(key, _build(key[-1]))
    except (OSError, AttributeError, RuntimeError) as exc:  # no cuBLASLt to name: time as without a cache
        _cache_failed("name the build for", exc)
        return _choose(x, w, out, accumulate, out_dtype)
    saved = _saved()
    if name in saved and (SEARCH_SECONDS <= 0 or (saved[name] or {}).get("searched")):
        entry = saved[name]
        if entry is None or entry.get("torch"):
            return None
        restored = _restore(x, w, accumulate, out_dtype, entry)
        if restored is not None:
            return restored
        log.info("projection %s: the saved kernel no longer agrees or runs; timing again", name)
    return _choose(x, w, out, accumulate, out_dtype, save_as=name)


def _untimed(x, w, exc: Exception) -> None:
    """PyTorch's call for a shape cuBLASLt could not be timed for; where the library itself could not
    be loaded, for every shape from now on (one warning, not one a shape)."""
    global ENABLED
    if isinstance(exc, (OSError, CublasLtMissing)):
        ENABLED = False
        log.warning("cuBLASLt could not be loaded (%s): every projection keeps PyTorch's call", exc)
        return None
    log.warning("projection [%d, %d] x [%d, %d]^T: cuBLASLt's kernels could not be timed (%s); PyTorch's call kept",
                *x.shape, w.shape[0], w.shape[1], exc)


def _no_room(x, w) -> None:
    log.info("no memory to time cuBLASLt's kernels for [%d, %d] x [%d, %d]^T; PyTorch's call kept", *x.shape,
             w.shape[0], w.shape[1])


def _choose(x, w, out, accumulate, out_dtype, save_as: str | None = None) -> _Choice | None:
    """The fastest candidate of `time_candidates` that agrees with PyTorch's output and beats its
    time by 3% and 0.3 us, else None (PyTorch's call), as also where the GPU has no room to time or
    cuBLASLt cannot be loaded or planned for the shape. save_as: the cache's name for the shape,
    under which a timed outcome is saved (one that could not be timed is not: a later start may)."""
    try:
        choice = _choose_timed(x, w, out, accumulate, out_dtype)
    except torch.OutOfMemoryError:
        return _no_room(x, w)
    except (OSError, AttributeError, RuntimeError) as exc:  # no cuBLASLt, or no plan for this shape
        return _untimed(x, w, exc)
    if save_as is not None:
        _save(save_as, choice)
    return choice


def _choose_timed(x, w, out, accumulate, out_dtype) -> _Choice | None:
    """`_choose`, raising torch.OutOfMemoryError where the GPU has no room to time."""
    m, k = x.shape
    n = w.shape[0]
    plan, torch_us, timed = time_candidates(x, w, out, accumulate, out_dtype, search_seconds=SEARCH_SECONDS)
    best = min((t for t in timed if t.us is not None), key=lambda t: t.us, default=None)
    if best is None or best.us > min(0.97 * torch_us, torch_us - 0.3):
        log.info("projection [%d, %d] x [%d, %d]^T%s: PyTorch's call (%.1f us) kept", m, k, n, k,
                 " (+=)" if accumulate else "", torch_us)
        return None
    log.info("projection [%d, %d] x [%d, %d]^T%s: cuBLASLt's %s, %.1f us against PyTorch's %.1f", m, k, n, k,
             " (+=)" if accumulate else "", best.candidate.label(), best.us, torch_us)
    return _Choice(plan, best.candidate, torch_us, best.us)


@dataclass
class Timed:
    """A candidate, its output's largest difference from PyTorch's over PyTorch's largest value,
    and its time (None where it disagreed, by 1e-2 or more, or gave a non-finite value)."""

    candidate: Candidate
    rel_err: float
    us: float | None


def time_candidates(x, w, out, accumulate: bool, out_dtype: torch.dtype, copies: int | None = None,
                    timing: dict | None = None, search_seconds: float = 0.0) -> tuple[LtProjection, float, list[Timed]]:
    """(the plan, PyTorch's call's us, each of cuBLASLt's candidates checked and timed) for
    x @ w.T (accumulate: added into out), on copies of x, w and out: `copies` weights (default:
    enough to keep each call's weights out of L2), `timing` as `graph_call_us` takes it (default
    `_TIMING`). With `search_seconds`, the heuristic's candidates are followed by the `SEARCH_KEEP`
    fastest of `blaslt_search.search`'s walk near them (one eager timing each). Synchronises the device."""
    m, k = x.shape
    n = w.shape[0]
    timing = timing or _TIMING
    copies = copies or min(8, max(1, math.ceil(2 * _l2_bytes(x.device) / w.nbytes)))
    weights = [w] + [w.clone() for _ in range(copies - 1)]
    x = x.clone()
    scratch = out.clone() if accumulate else torch.empty(m, n, dtype=out_dtype, device=x.device)
    torch_us = graph_call_us(lambda i: _torch_linear(x, weights[i % copies], scratch, accumulate, out_dtype),
                             **timing)
    want = _torch_linear(x, w, torch.zeros_like(scratch), False, out_dtype).float()
    plan = LtProjection(m, n, k, x.dtype, accumulate, x.device.index or 0, out_dtype)
    candidates = plan.candidates()
    if search_seconds > 0:
        candidates += _searched(plan, candidates, x, weights, scratch, search_seconds)
    timed = []
    for cand in candidates:
        err, agrees = _agrees(plan, cand, x, w, want, out_dtype)
        us = graph_call_us(lambda i: plan(x, weights[i % copies], scratch, cand), **timing) if agrees else None
        timed.append(Timed(cand, err, us))
    return plan, torch_us, timed


def _searched(plan, heuristic: list[Candidate], x, weights, scratch, seconds: float) -> list[Candidate]:
    """The `SEARCH_KEEP` fastest configurations near the heuristic's that it did not offer itself
    (`seconds` for the walk, as many again at most for their first timing)."""
    from ddtree.kernels import blaslt_search  # it builds on this module's plans and candidates

    offered = {tuple(sorted(c.config.items())) for c in heuristic}
    found, counts = blaslt_search.search(plan, seconds=seconds, bases=heuristic)
    fresh = [c for c in found if tuple(sorted(c.config.items())) not in offered]
    screened = blaslt_search.screen(plan, fresh, x, weights, scratch, seconds=seconds)
    log.info("projection [%d, %d] x [%d, %d]^T: %d configurations near cuBLASLt's heuristic's, %d checked",
             plan.m, plan.k, plan.n, plan.k, counts["accepted"], counts["checked"])
    return [cand for _, cand in screened[:SEARCH_KEEP]]


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
           accumulate: bool = False, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [m, k] @ w [n, k]^T (+ bias) -> a new [m, n] in `out_dtype` (default x's), or with
    `accumulate` added into `out` [m, n] in place. Through the cuBLASLt kernel timed fastest for this
    shape on this GPU where one beat PyTorch's call (timed the first time the shape comes outside a
    graph's capture), else PyTorch's call (always with a bias); a shape first met during a capture
    keeps PyTorch's call for good, so that eager and graph runs of one shape run the same kernel."""
    if bias is not None:
        if accumulate or out_dtype not in (None, x.dtype):
            raise ValueError("a projection with a bias is neither accumulated nor widened here")
        return F.linear(x, w, bias)
    out_dtype = out_dtype or x.dtype
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):  # cuBLASLt's call has no backward
        return _torch_linear(x, w, out, accumulate, out_dtype)
    if torch.compiler.is_compiling():  # inside a compiled function: one opaque op, no graph break
        if ENABLED and not accumulate and x.is_cuda:
            return torch.ops.ddtree.blaslt_linear(x, w, out_dtype == torch.float32)
        return _torch_linear(x, w, out, accumulate, out_dtype)
    return _linear(x, w, out, accumulate, out_dtype)


def _linear(x, w, out, accumulate: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """`linear` without a bias, run eagerly (or as `blaslt_linear`'s body)."""
    if not (ENABLED and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype
            and x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.is_contiguous() and w.is_contiguous()
            and (not accumulate or (out.is_contiguous() and out.dtype == x.dtype))):
        return _torch_linear(x, w, out, accumulate, out_dtype)
    key = (x.shape[0], w.shape[0], x.shape[1], x.dtype, out_dtype, accumulate, x.device.index)
    if key not in _CHOSEN:
        capturing = torch.cuda.is_current_stream_capturing()
        _CHOSEN[key] = None if capturing else _choice_for(key, x, w, out, accumulate, out_dtype)
    choice = _CHOSEN[key]
    if choice is None:
        return _torch_linear(x, w, out, accumulate, out_dtype)
    y = out if accumulate else torch.empty(x.shape[0], w.shape[0], dtype=out_dtype, device=x.device)
    return choice.plan(x, w, y, choice.candidate)


@torch.library.custom_op("ddtree::blaslt_linear", mutates_args=())
def _linear_op(x: torch.Tensor, w: torch.Tensor, float32_out: bool) -> torch.Tensor:
    """`linear(x, w)` as one op for `torch.compile`d functions (the drafter's layers, a dense
    target's unfolded ones): traced as a call, run eagerly, where the kernel choice happens."""
    return _linear(x, w, None, False, torch.float32 if float32_out else x.dtype)


@_linear_op.register_fake
def _(x: torch.Tensor, w: torch.Tensor, float32_out: bool) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32 if float32_out else x.dtype)
