"""benchmarks/batch_budgets.py and batch_budgets_adaptive.py at a tiny scale on the CPU: every
(budget, rows) cell is written, and a budget's acceptance is the same one request at a time and
batched (each request decodes the same tokens with the same trees, whoever shares its rounds);
every adaptive and fixed mode is written with the budgets its rounds ran; batch_round_latency.py
writes every cell, the choice, and with --profile each cell's busy time and operators."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from server_process import quiet_env

ROOT = Path(__file__).resolve().parent.parent


def test_batch_budgets_writes_every_cell(tmp_path):
    out = tmp_path / "cells.json"
    cmd = [sys.executable, "-m", "benchmarks.batch_budgets", str(out), "--budgets", "ar,16", "--rows", "1,3",
           "--temperatures", "0,1", "--max-tokens", "8"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=quiet_env())
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    cells = {(c["temperature"], c["tree_budget"], c["rows"]): c for c in result["cells"]}
    assert set(cells) == {(t, b, r) for t in (0.0, 1.0) for b in ("ar", "16") for r in (1, 3)}
    assert all(c["tokens_per_second"] > 0 for c in cells.values())
    for (t, b, r), cell in cells.items():
        assert cell["mean_acceptance_length"] == cells[(t, b, 1)]["mean_acceptance_length"]
    assert cells[(0.0, "ar", 3)]["mean_acceptance_length"] == 1.0 < cells[(0.0, "16", 3)]["mean_acceptance_length"]


def test_batch_budgets_adaptive_writes_every_mode_with_the_budgets_chosen(tmp_path):
    out = tmp_path / "adaptive.json"
    cmd = [sys.executable, "-m", "benchmarks.batch_budgets_adaptive", str(out), "--budgets", "ar,16",
           "--concurrency", "1,3", "--requests", "3", "--max-tokens", "8", "--repeats", "1"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=quiet_env())
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    rows = {(s["concurrency"], s["mode"]): s for s in result["summary"]}
    assert set(rows) == {(c, m) for c in (1, 3) for m in ("adaptive", "adaptive-warm", "ar", "16")}
    assert all(s["identical_outputs"] and s["median_tokens_per_second"] > 0 for s in rows.values())
    assert rows[(3, "ar")]["round_shares"] == {"ar": 1.0}
    assert set(rows[(3, "adaptive")]["round_shares"]) <= {"ar", "16"}
    assert sum(rows[(1, "adaptive")]["round_shares"].values()) == pytest.approx(1.0)
    measured = {(p["rows"], p["budget"]) for p in result["round_costs"]}
    assert measured == {(r, b) for r in (1, 2, 3) for b in ("ar", "16")}


def test_batch_round_latency_writes_every_cell_and_the_choice(tmp_path):
    out = tmp_path / "rounds.json"
    cmd = [sys.executable, "-m", "benchmarks.batch_round_latency", str(out), "--shape", "demo", "--rows", "1,2",
           "--budgets", "ar,16", "--context", "24", "--device", "cpu", "--profile"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=quiet_env())
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    cells = {(c["rows"], c["tree_budget"]): c for c in result["cells"]}
    assert set(cells) == {(r, b) for r in (1, 2) for b in ("ar", "16")}
    assert all(c["round_ms"] > 0 and c["floor_ms"] > 0 and c["context"] == 24 for c in cells.values())
    assert cells[(1, "16")]["tokens_per_row"] == 17 and cells[(2, "ar")]["tokens_per_row"] == 1
    for cell in cells.values():  # --profile: the busy time and operators of each cell's rounds
        profile = cell["profile"]
        assert 0 < profile["busy_ms"] and profile["launches"] > 0 and profile["kernels"]
        assert sum(k["us_per_round"] for k in profile["kernels"]) <= profile["busy_ms"] * 1000 + 1
    assert cells[(1, "16")]["profile"]["launches"] > cells[(1, "ar")]["profile"]["launches"]
    assert cells[(2, "16")]["floor_ms"] > cells[(1, "16")]["floor_ms"] > cells[(1, "ar")]["floor_ms"]
    assert set(result["chosen"]) == {"1", "2"} and set(result["chosen"].values()) <= {"ar", "16"}


def test_batch_round_latency_takes_a_checkpoint_pair(tmp_path):
    """--target / --draft: the rounds of that pair (here the demo pair's directories), recorded as such."""
    out = tmp_path / "rounds.json"
    models = ROOT / "models"
    cmd = [sys.executable, "-m", "benchmarks.batch_round_latency", str(out), "--target", str(models / "demo-target"),
           "--draft", str(models / "demo-drafter"), "--rows", "1", "--budgets", "16", "--context", "24",
           "--device", "cpu"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=quiet_env())
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["target"].endswith("demo-target") and result["shape"] is None and "--target" in result["command"]
    [cell] = result["cells"]
    assert cell["rows"] == 1 and cell["tree_budget"] == "16" and cell["round_ms"] > 0
