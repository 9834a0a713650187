"""The sweep's order and bookkeeping on a fake backend: warm-up requests first (they price the
ETA), a row handed over as each run ends, trees pruned in quick mode, and the quick preset."""
from __future__ import annotations

import asyncio

import pytest

from ddtree.bench.cli import QUICK, settings_from
from ddtree.bench.datasets import BenchPrompt
from ddtree.bench.progress import SweepProgress
from ddtree.bench.report import RequestOutput
from ddtree.bench.runner import SweepSettings
from ddtree.bench.sweep import Sweep, run_sweep
from ddtree.cli import build_parser
from ddtree.config import parse_tree_budget

TOKENS = 10


class FakeBackend:
    """Answers at a fixed tokens/s per budget ("ar", "chain" or an integer, as in JSON) and records
    every request as (budget, timed)."""

    def __init__(self, speeds: dict):
        self.speeds, self.calls, self.timed = speeds, [], False

    def check(self, prompts, settings) -> None:
        pass

    async def counters(self):
        return None

    async def send(self, prompt, index, budget, params) -> RequestOutput:
        self.calls.append((budget.json_value, self.timed))
        seconds = TOKENS / self.speeds[budget.json_value]
        await asyncio.sleep(seconds / 100)  # the warm-ups' wall time is what prices the ETA
        return RequestOutput(index, success=True, text="same", output_tokens=TOKENS, ttft_s=seconds / 2,
                             e2el_s=seconds, decode_rounds=1, accepted_tokens=TOKENS)


PROMPTS = [BenchPrompt(f"p{i}", prompt="x") for i in range(3)]


def sweep(backend, budgets, prune_below=None, warmup=1):
    settings = SweepSettings(tree_budgets=[parse_tree_budget(b) for b in budgets], max_tokens=TOKENS, warmup=warmup)
    seen = []

    def on_row(s: Sweep) -> None:
        seen.append([r["tree_budget"].json_value for r in s.rows])
        backend.timed = True  # every call after the first row is a timed one

    backend.timed = False
    result = asyncio.run(run_sweep(backend, PROMPTS, settings, progress=False, on_row=on_row,
                                   prune_below=prune_below))
    return result, seen


def test_warm_ups_first_then_each_row_as_its_run_ends():
    backend = FakeBackend({"ar": 10.0, "chain": 20.0, 16: 30.0})
    result, seen = sweep(backend, ["ar", "chain", 16])
    assert [b for b, _ in backend.calls[:3]] == ["ar", "chain", 16], "one warm-up request per budget, first"
    assert seen == [["ar"], ["ar", "chain"], ["ar", "chain", 16]]
    assert set(result.warmup_seconds) == {"ar", "chain", "16"} and result.planned_runs == 3
    assert result.predicted_seconds == pytest.approx(3 * sum(TOKENS / v for v in (10.0, 20.0, 30.0)) / 100, rel=0.5)
    assert not result.interrupted and result.skipped == []


def test_quick_mode_stops_growing_trees_once_one_falls_below_half_the_best():
    backend = FakeBackend({"ar": 10.0, "chain": 20.0, 16: 30.0, 32: 14.0, 64: 40.0, 128: 50.0})
    result, _ = sweep(backend, ["ar", "chain", 16, 32, 64, 128], prune_below=0.5)
    assert [r["tree_budget"].json_value for r in result.rows] == ["ar", "chain", 16, 32]
    assert [(s["tree_budget"].json_value, s["concurrency"]) for s in result.skipped] == [(64, 1), (128, 1)]
    assert "tree 32 already ran below 50% of the best" in result.skipped[0]["reason"]
    full, _ = sweep(FakeBackend(backend.speeds), ["ar", "chain", 16, 32, 64, 128])
    assert len(full.rows) == 6, "without quick mode every budget asked for runs"


def test_eta_prices_each_request_at_its_budgets_warm_up_time():
    runs = [(1, "ar"), (1, 16), (1, 1024)]
    progress = SweepProgress(runs, 10, {"ar": 1.0, 16: 0.5, 1024: 6.0}, enabled=False)
    assert progress.predicted_seconds == pytest.approx(10 * 7.5)
    assert progress.weight == {"ar": 1.0, 16: 0.5, 1024: 6.0}
    progress.request_done("ar")
    progress.drop_run(1024)
    assert progress.bar.total == pytest.approx(10 * 1.5) and progress.requests_left == 19
    unpriced = SweepProgress(runs, 10, {"ar": 1.0, 16: None, 1024: 6.0}, enabled=False)
    assert unpriced.predicted_seconds is None and unpriced.bar.total == 30, "without warm-ups, requests count alike"


def test_quick_preset_fills_only_the_flags_left_unset():
    def tune_settings(*flags: str):
        args = build_parser().parse_args(["tune", *flags])
        return args, settings_from(args)

    args, settings = tune_settings("--quick", "--max-tokens", "8")
    assert (args.num_prompts, settings.max_tokens) == (QUICK["num_prompts"], 8)
    assert [b.json_value for b in settings.tree_budgets] == ["ar", "chain", 15, 31, 63, 127]
    args, settings = tune_settings()
    assert (args.num_prompts, settings.max_tokens, len(settings.tree_budgets)) == (16, 128, 9)
