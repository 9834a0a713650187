"""Every kernel configuration cuBLASLt accepts for a projection, not only its heuristic's list.

Why: `blaslt.LtProjection.candidates` asks cuBLASLt's heuristic, which offered 8 kernels at each of
Qwen3-8B's projections on an H100; at a 256 tree's 257 rows the best of them still ran the down
projection at 1.6x its floor (benchmarks/README.md, "What the tree's last row costs cuBLAS"). The
library holds more: each algorithm id takes tiles, pipeline stages, split-K counts and reductions,
CTA swizzles, custom options and thread-block clusters, which `cublasLtMatmulAlgoCheck` accepts or
refuses for a given call. `search` walks those and returns the accepted ones as `Candidate`s,
which `LtProjection` runs like the heuristic's.

What it walks (cublasLt.h's values): around each of the heuristic's candidates (`bases`), its
algorithm as it came with the tile, custom option, CTA swizzle, split-K count and reduction, and
cluster shape changed (a heuristic's algorithm carries settings that `cublasLtMatmulAlgoInit` does
not restore: on an H100 at 257 rows, configurations built from the ids alone ran at half the
heuristic's speed, and its neighbours took the down projection from 52.5 to 45.5 us,
`benchmarks/results/blaslt_search_h100_qwen3_8b.json`); without bases, every id of
`cublasLtMatmulAlgoGetIds` with its capabilities' tiles, stages and settings. Cluster shapes
`CLUSTERS`, since no capability lists them. Each walk stops at its share of the time and of the
accepted count. Host calls only (no kernel runs here); `screen` then times what was accepted.
"""
from __future__ import annotations

import ctypes
import itertools
import time

import torch

from ddtree.kernels.blaslt import (_ALGO_CONFIG, _COMPUTE_32F, _DTYPES, _R_32F, WORKSPACE_BYTES, Candidate,
                                   LtProjection, _Algo, _describe, _handle, _HeuristicResult, _lib)

# cublasLtMatmulAlgoCapAttributes_t
_CAP_SPLITK_SUPPORT, _CAP_REDUCTION_SCHEME_MASK, _CAP_CTA_SWIZZLING_SUPPORT = 0, 1, 2
_CAP_TILE_IDS, _CAP_CUSTOM_OPTION_MAX, _CAP_STAGES_IDS = 6, 7, 13
SPLITS = (1, 2, 3, 4, 6, 8)
REDUCTIONS = (1, 2, 4)  # in place, in the compute type, in the output type
CLUSTERS = (0, 2, 3, 4, 5)  # left as it is (the library's choice, or the heuristic's), 1x1x1, 2x1x1, 4x1x1, 1x2x1


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """The search's entry points' signatures (set once a library)."""
    if getattr(lib, "_ddtree_search_declared", False):
        return lib
    p, i, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    algo = ctypes.POINTER(_Algo)
    sigs = {
        "cublasLtMatmulAlgoGetIds": [p, i, i, i, i, i, i, i, ctypes.POINTER(i), ctypes.POINTER(i)],
        "cublasLtMatmulAlgoInit": [p, i, i, i, i, i, i, i, algo],
        "cublasLtMatmulAlgoCapGetAttribute": [algo, i, p, sz, ctypes.POINTER(sz)],
        "cublasLtMatmulAlgoConfigSetAttribute": [algo, i, p, sz],
        "cublasLtMatmulAlgoCheck": [p, p, p, p, p, p, algo, ctypes.POINTER(_HeuristicResult)],
    }
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    lib._ddtree_search_declared = True
    return lib


def _cap_int(lib, algo: _Algo, attr: int) -> int:
    value, written = ctypes.c_int32(), ctypes.c_size_t()
    if lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, ctypes.byref(value), 4, ctypes.byref(written)):
        return 0
    return value.value


def _cap_list(lib, algo: _Algo, attr: int) -> list[int]:
    """A capability that is an array of uint32 (tiles, stages); [0] (undefined) where it is empty."""
    written = ctypes.c_size_t()
    if lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, None, 0, ctypes.byref(written)):
        return [0]
    count = written.value // 4
    if count == 0:
        return [0]
    values = (ctypes.c_uint32 * count)()
    if lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, values, count * 4, ctypes.byref(written)):
        return [0]
    return list(values)


def _set(lib, algo: _Algo, attr: int, value: int, width: int = 4) -> bool:
    v = ctypes.c_uint16(value) if width == 2 else ctypes.c_uint32(value)
    return lib.cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(algo), attr, ctypes.byref(v), width) == 0


def algo_ids(plan: LtProjection, lib=None) -> list[int]:
    """cuBLASLt's algorithm ids for the plan's types."""
    lib = _declare(lib or _lib())
    handle, _ = _handle(plan.device)
    t, out = _DTYPES[plan.dtype], _DTYPES[plan.out_dtype]
    ids, returned = (ctypes.c_int * 256)(), ctypes.c_int()
    status = lib.cublasLtMatmulAlgoGetIds(handle, _COMPUTE_32F, _R_32F, t, t, out, out, 256, ids,
                                          ctypes.byref(returned))
    if status:
        raise RuntimeError(f"MatmulAlgoGetIds failed with cublasStatus {status}")
    return list(ids[:returned.value])


def _accepted(lib, handle, plan: LtProjection, base: _Algo, settings) -> Candidate | None:
    """base with `settings` ((attribute, value, byte width), ...) as a candidate, if cuBLASLt accepts
    it for the plan's call within `WORKSPACE_BYTES`; else None."""
    algo = _Algo()
    ctypes.memmove(ctypes.byref(algo), ctypes.byref(base), ctypes.sizeof(_Algo))
    if not all(_set(lib, algo, attr, value, width) for attr, value, width in settings):
        return None
    result = _HeuristicResult()
    if lib.cublasLtMatmulAlgoCheck(handle, plan.desc, plan.a, plan.b, plan.c, plan.c, ctypes.byref(algo),
                                   ctypes.byref(result)):
        return None
    if result.state != 0 or result.workspace_size > WORKSPACE_BYTES:
        return None
    return Candidate(algo, result.workspace_size, result.waves_count, _describe(algo))


def search(plan: LtProjection, limit: int = 4000, seconds: float = 10.0,
           bases: list[Candidate] = ()) -> tuple[list[Candidate], dict]:
    """(the configurations cuBLASLt accepts for the plan's call within `WORKSPACE_BYTES`, at most
    `limit`; counts: ids, configurations checked and accepted, per walk and in all, walks cut short).

    First the neighbours of `bases` (the heuristic's candidates): each one's algorithm as it came,
    with its tile, custom option, swizzle and split-K changed, since a heuristic's algorithm carries
    settings that `cublasLtMatmulAlgoInit` does not restore. Without bases, every id from
    `cublasLtMatmulAlgoInit` instead, in two passes: its tiles and stages alone (one split, no swizzle, no
    custom option, the cluster left to the library), then every other setting over each accepted
    pair, split-K counts first, clusters, swizzles and custom options after. Each walk stops at its
    share of `seconds` or of `limit`, so that a cut leaves every walk its commoner settings walked."""
    lib = _declare(_lib())
    handle, _ = _handle(plan.device)
    t, out = _DTYPES[plan.dtype], _DTYPES[plan.out_dtype]
    found: dict[tuple, Candidate] = {}
    checked, began, cut = 0, time.monotonic(), 0
    by_id: dict[str, list[int]] = {}
    tile, stages, custom, swizzle, splitk, reduction = (_ALGO_CONFIG[k] for k in
                                                        ("tile", "stages", "custom", "swizzle", "splitk", "reduction"))

    def add(base, settings, label) -> None:
        nonlocal checked
        checked += 1
        cand = _accepted(lib, handle, plan, base, settings)
        row = by_id.setdefault(label, [0, 0])
        row[0] += 1
        key = None if cand is None else tuple(sorted(cand.config.items()))
        if cand is not None and key not in found:
            found[key] = cand
            row[1] += 1

    def caps(algo):
        splits = SPLITS if _cap_int(lib, algo, _CAP_SPLITK_SUPPORT) else (1,)
        mask = _cap_int(lib, algo, _CAP_REDUCTION_SCHEME_MASK)
        reductions = [r for r in REDUCTIONS if mask & r] or [0]
        swizzles = (0, 1) if _cap_int(lib, algo, _CAP_CTA_SWIZZLING_SUPPORT) else (0,)
        customs = range(_cap_int(lib, algo, _CAP_CUSTOM_OPTION_MAX) + 1)
        return splits, reductions, swizzles, customs

    def settings_of(tile_id, split, scheme, cluster, swizzle_id, custom_id, stage_id=None):
        settings = [(tile, tile_id, 4), (custom, custom_id, 4), (swizzle, swizzle_id, 4), (splitk, split, 4),
                    (reduction, scheme, 4)]
        if stage_id is not None:  # None: the base's stages kept
            settings.append((stages, stage_id, 4))
        if cluster:  # 0: the base's cluster kept (the library's own choice after an id's initialisation)
            settings.append((_ALGO_CONFIG["cluster"], cluster, 2))
        return settings

    def variants(splits, reductions, clusters, swizzles, customs):
        return [(split, scheme, cluster, swizzle_id, custom_id)
                for split, swizzle_id, cluster, custom_id in itertools.product(splits, swizzles, clusters, customs)
                for scheme in ((0,) if split == 1 else reductions)]

    ids = [] if bases else algo_ids(plan, lib)  # with bases, the ids' own walks found nothing faster (H100)
    walks = max(1, len(bases) + len(ids))

    def spent(n: int, before: int) -> bool:
        """Walk n has used its share of the time or of `limit`."""
        return len(found) - before >= limit / walks or time.monotonic() > began + seconds * (n + 1) / walks

    for n, base in enumerate(bases):  # the heuristic's neighbours: its stages kept, the cluster too where 0
        before = len(found)
        splits, reductions, swizzles, customs = caps(base.algo)
        tiles = sorted(set(_cap_list(lib, base.algo, _CAP_TILE_IDS)) | {base.config.get("tile", 0)})
        label = f"heuristic {n} (id {base.config.get('id')})"
        for (split, scheme, cluster, swizzle_id, custom_id), tile_id in itertools.product(
                variants(splits, reductions, CLUSTERS, swizzles, customs), tiles):
            if spent(n, before):
                cut += 1
                break
            add(base.algo, settings_of(tile_id, split, scheme, cluster, swizzle_id, custom_id), label)
    for n, algo_id in enumerate(ids, start=len(bases)):
        base = _Algo()
        if lib.cublasLtMatmulAlgoInit(handle, _COMPUTE_32F, _R_32F, t, t, out, out, algo_id, ctypes.byref(base)):
            continue
        splits, reductions, swizzles, customs = caps(base)
        label = f"id {algo_id}"
        before = len(found)
        for tile_id, stage_id in itertools.product(_cap_list(lib, base, _CAP_TILE_IDS),
                                                   _cap_list(lib, base, _CAP_STAGES_IDS)):
            add(base, ((tile, tile_id, 4), (stages, stage_id, 4)), label)
        pairs = [(c.config.get("tile", 0), c.config.get("stages", 0)) for c in list(found.values())[before:]]
        for (split, scheme, cluster, swizzle_id, custom_id), (tile_id, stage_id) in itertools.product(
                variants(splits, reductions, CLUSTERS, swizzles, customs)[1:], pairs):  # the first: the first pass's
            if spent(n, before):
                cut += 1
                break
            add(base, settings_of(tile_id, split, scheme, cluster, swizzle_id, custom_id, stage_id), label)
    counts = {"ids": len(ids), "bases": len(bases), "checked": checked, "accepted": len(found), "cut_walks": cut,
              "by_walk": {k: {"checked": v[0], "accepted": v[1]} for k, v in by_id.items()}}
    return list(found.values()), counts


def screen(plan: LtProjection, candidates: list[Candidate], x, weights, y, calls: int = 4,
           seconds: float | None = None) -> list[tuple[float, Candidate]]:
    """(us a call, candidate) for each candidate that runs, fastest first: `calls` eager calls over
    `weights` (copies of one weight, cycled so that L2 holds none) between two CUDA events, after
    one warm-up call; candidates in their order until `seconds` have passed (None: all). A first
    sort, for `graph_call_us` to time the fastest again."""
    timed, began = [], time.monotonic()
    for cand in candidates:
        if seconds is not None and time.monotonic() - began > seconds:
            break
        try:
            plan(x, weights[-1], y, cand)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(calls):
                plan(x, weights[i % len(weights)], y, cand)
            end.record()
            end.synchronize()
        except RuntimeError:  # a configuration the check accepted but the call refused
            continue
        timed.append((start.elapsed_time(end) * 1000 / calls, cand))
    return sorted(timed, key=lambda t: t[0])
