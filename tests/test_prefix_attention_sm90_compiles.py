"""The Gluon prefix kernel compiles for sm_90 at every tiling it is benchmarked with, without a GPU
(in a process without Triton's interpreter, which the other tests switch on); its split plan."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.experimental.gluon")
ROOT = Path(__file__).resolve().parents[1]


def test_gluon_prefix_kernel_compiles_for_sm90():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "scripts/compile_prefix_attention_sm90.py"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("ok")]
    assert len(lines) == 6, done.stdout
    assert all("local 0" in line for line in lines), done.stdout  # no spills to local memory


def test_plan_splits_fills_whole_waves_with_few_splits():
    from ddtree.kernels.prefix_attention_sm90 import plan_splits

    assert plan_splits(24, 132, 32768) == 11  # 264 programs: two whole waves
    assert plan_splits(72, 132, 32768) == 9  # 648 in 5 waves, within 3% of 11's 792 in 6, with fewer partials
    assert plan_splits(120, 132, 32768) == 11  # 1320: ten whole waves
    assert plan_splits(24, 132, 2560) == 5  # at least 512 keys a split
    assert plan_splits(264, 132, 32768) == 1  # already whole waves
