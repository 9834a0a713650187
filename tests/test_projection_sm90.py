"""The Gluon projection kernel (`kernels.projection_sm90`) against a float32 product on an sm_90 GPU:
tiles whole in one run and shared among runs, K and N ragged, M from 1 to 128 (with and without the
8-column second product), y written and y added to, and replayed in a CUDA graph (the arrival counts
left at zero). On the CPU: the host-side plan, and the kernel compiled for sm_90 at Qwen3-8B's
projections (`scripts/compile_projection_sm90.py`) with no spills."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon")
sm90 = pytest.importorskip("ddtree.kernels.projection_sm90")

ROOT = Path(__file__).resolve().parents[1]
ON_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
needs_sm90 = pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 GPU")


def operands(m: int, n: int, k: int, dtype=torch.bfloat16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to("cuda", dtype)
    w = (torch.randn(n, k, generator=gen) * 0.05).to("cuda", dtype)
    return x, w


def test_compiles_for_sm90_without_a_gpu():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "scripts/compile_projection_sm90.py"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    sys.path.insert(0, str(ROOT / "scripts"))
    from compile_projection_sm90 import CASES

    lines = [line for line in done.stdout.splitlines() if line.startswith("ok")]
    assert len(lines) == len(CASES), done.stdout
    assert all(line.endswith("local 0, stack (spills) 0") and "(fits)" in line for line in lines), done.stdout


def test_token_tiles():
    assert sm90.token_tiles(65) == (64, 8)
    assert sm90.token_tiles(17) == (16, 8)
    assert sm90.token_tiles(16) == (16, 0)
    assert sm90.token_tiles(1) == (8, 0)
    assert sm90.token_tiles(9) == (16, 0)
    assert sm90.token_tiles(100) == (128, 0)
    assert sm90.token_tiles(128) == (128, 0)


def test_tiling_gives_every_program_a_run():
    t = sm90.tiling(65, 4096, 12288, 132, {"BM": 128, "BK": 64})
    assert (t["MP"], t["TAIL"], t["STEPS_K"], t["TOTAL"], t["PROGRAMS"]) == (64, 8, 192, 6144, 132)
    assert sm90.tiling(1, 256, 128, 132, {"BM": 128, "BK": 64})["PROGRAMS"] == 4  # 2 tiles x 2 steps: fewer programs than SMs


@needs_sm90
@pytest.mark.parametrize("m,n,k,programs", [
    (65, 4096, 12288, 0),  # the down projection's shape: several runs a tile
    (65, 24576, 4096, 0),  # gate + up: runs of 1-3 tiles
    (17, 6144, 4096, 0), (1, 4096, 4096, 0), (16, 1024, 512, 0), (128, 2048, 1024, 0),
    (33, 1000, 1000, 7),  # N and K past whole tiles and steps, a few long runs
    (72, 384, 4096, 40),  # a tile shared by many runs
])
@pytest.mark.parametrize("accumulate", [False, True])
def test_equals_a_float32_product(m, n, k, programs, accumulate):
    x, w = operands(m, n, k, seed=m + n)
    config = {"PROGRAMS": programs} if programs else None
    base = torch.randn(m, n, device="cuda").to(torch.bfloat16)
    out = base.clone()
    got = sm90.projection(x, w, out, accumulate=accumulate, config=config)
    expected = x.float() @ w.float().T + (base.float() if accumulate else 0)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got.float(), expected, atol=3e-2, rtol=2e-2)
    _, count = sm90._WORKSPACE[x.device]
    assert int(count.abs().sum()) == 0  # the arrival counts are left at zero


@needs_sm90
def test_fp16_a_strided_input_and_a_new_output():
    x, w = operands(20, 512, 256, torch.float16, seed=3)
    wide = torch.zeros(20, 384, dtype=torch.float16, device="cuda")
    wide[:, :256] = x
    got = sm90.projection(wide[:, :256], w)
    assert got.dtype == torch.float16 and got.shape == (20, 512)
    torch.testing.assert_close(got.float(), x.float() @ w.float().T, atol=1e-2, rtol=1e-2)


@needs_sm90
def test_a_graph_replays_it():
    x, w = operands(65, 4096, 12288, seed=5)
    out = torch.zeros(65, 4096, dtype=torch.bfloat16, device="cuda")
    sm90.projection(x, w, out, accumulate=True)  # the workspace made before the capture
    out.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sm90.projection(x, w, out, accumulate=True)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), 3 * (x.float() @ w.float().T), atol=8e-2, rtol=2e-2)


@needs_sm90
def test_what_it_takes():
    x, w = operands(4, 64, 64)
    with pytest.raises(ValueError):
        sm90.projection(x.float(), w.float())
    with pytest.raises(ValueError):
        sm90.projection(torch.zeros(129, 64, dtype=torch.bfloat16, device="cuda"), w)
    with pytest.raises(ValueError):
        sm90.projection(x, w, accumulate=True)  # nothing to add to
