"""The Gluon prefix kernel compiles for sm_90 at every tiling it is benchmarked with, without a GPU
(in a process without Triton's interpreter, which the other tests switch on)."""
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
