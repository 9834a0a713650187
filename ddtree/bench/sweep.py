"""The sweep: every (concurrency, tree budget) pair in turn, each summarized into a row the moment
its run ends, so that rows can be printed as they come and an interrupted sweep keeps them.

1. Warm-up: each budget's `warmup` untimed requests (graph capture, caches), before any timed
   request. Their times predict each budget's run, which is what the progress bar's ETA counts.
2. For each concurrency level, each budget in the order given: every prompt with at most
   `concurrency` requests in flight -> one row, appended to the `Sweep` and handed to `on_row`.

With `prune_below` (the quick mode), a tree budget whose median tokens/s falls below that
fraction of the best so far at its concurrency level ends the trees: the larger tree budgets
after it are skipped, as a larger tree only costs more per round. A Ctrl-C (the sweep's task
cancelled) leaves the rows measured so far in the `Sweep`; the run in progress is dropped.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable

from ddtree.bench.datasets import BenchPrompt
from ddtree.bench.progress import SweepProgress
from ddtree.bench.report import RequestOutput, ServerCounters, mean, summarize
from ddtree.bench.runner import SweepSettings
from ddtree.tree_shape import TreeShape


@dataclass
class Sweep:
    rows: list[dict] = field(default_factory=list)
    texts: list[dict[int, str]] = field(default_factory=list)  # per row: prompt index -> output text
    skipped: list[dict] = field(default_factory=list)  # {"tree_budget", "concurrency", "reason"}
    warmup_seconds: dict[str, float] = field(default_factory=dict)  # per budget: mean warm-up request time
    planned_runs: int = 0
    predicted_seconds: float | None = None  # the timed part, as the warm-up requests predict it
    timed_seconds: float | None = None  # the timed part as it went (up to the interruption, if any)
    interrupted: bool = False


def _delta(before: ServerCounters | None, after: ServerCounters | None) -> ServerCounters | None:
    if before is None or after is None:
        return None
    return after - before


async def warm_up(backend, prompts: list[BenchPrompt], settings: SweepSettings, sweep: Sweep,
                  progress: bool) -> dict[TreeShape, float | None]:
    """Each budget's warm-up requests -> its mean request time in seconds (None without warm-up)."""
    from tqdm import tqdm

    estimates: dict[TreeShape, float | None] = {}
    with tqdm(total=len(settings.tree_budgets), desc="warm-up", unit="budget", disable=not progress,
              dynamic_ncols=True, leave=False) as bar:
        for budget in settings.tree_budgets:
            if hasattr(backend, "prepare"):
                await backend.prepare(budget)
            times = []
            for w in range(settings.warmup):
                index = w % len(prompts)
                start = time.perf_counter()
                await backend.send(prompts[index], index, budget, settings.params(index))
                times.append(time.perf_counter() - start)
            estimates[budget] = mean(times) if times else None
            if times:
                sweep.warmup_seconds[str(budget)] = estimates[budget]
            bar.update(1)
    return estimates


async def run_one(backend, prompts: list[BenchPrompt], budget: TreeShape, concurrency: int,
                  settings: SweepSettings, on_request: Callable[[], None] | None = None) -> tuple[dict, dict[int, str]]:
    """Every prompt at `budget` with at most `concurrency` in flight -> (row, texts)."""
    if hasattr(backend, "prepare"):
        await backend.prepare(budget)  # already done by the warm-up; a no-op then
    gate = asyncio.Semaphore(concurrency)

    async def one(index: int, prompt: BenchPrompt) -> RequestOutput:
        async with gate:
            out = await backend.send(prompt, index, budget, settings.params(index))
        if on_request is not None:
            on_request()
        return out

    before = await backend.counters()
    start = time.perf_counter()
    outputs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    duration = time.perf_counter() - start
    after = await backend.counters()
    row = summarize(list(outputs), duration, budget, concurrency, _delta(before, after))
    return row, {o.index: o.text for o in outputs if o.success}


def _too_slow(row: dict, rows: list[dict], fraction: float) -> bool:
    level = [r["median_tokens_per_second"] for r in rows if r["concurrency"] == row["concurrency"] and r["completed"]]
    return row["tree_budget"].builds_tree and row["median_tokens_per_second"] < fraction * max(level)


async def run_sweep(backend, prompts: list[BenchPrompt], settings: SweepSettings, progress: bool = True,
                    sweep: Sweep | None = None, on_row: Callable[[Sweep], None] | None = None,
                    prune_below: float | None = None) -> Sweep:
    """Run the sweep into `sweep` (a new one if None) and return it; `on_row(sweep)` after each row."""
    sweep = sweep if sweep is not None else Sweep()
    backend.check(prompts, settings)
    runs = [(c, b) for c in settings.concurrencies for b in settings.tree_budgets]
    sweep.planned_runs = len(runs)
    estimates = await warm_up(backend, prompts, settings, sweep, progress)
    bar = SweepProgress(runs, len(prompts), estimates, progress)
    sweep.predicted_seconds = bar.predicted_seconds
    started = time.perf_counter()
    ended_trees: dict[int, TreeShape] = {}  # concurrency -> the tree budget that ran too slowly
    try:
        for k, (concurrency, budget) in enumerate(runs):
            stop = ended_trees.get(concurrency)
            if stop is not None and budget.builds_tree and budget.budget > stop.budget:
                sweep.skipped.append({"tree_budget": budget, "concurrency": concurrency,
                                      "reason": f"tree {stop} already ran below {prune_below:.0%} of the best"})
                bar.drop_run(budget)
                continue
            bar.start_run(k, budget, concurrency)
            finished = 0

            def on_request() -> None:
                nonlocal finished
                finished += 1
                bar.request_done(budget)

            try:
                row, texts = await run_one(backend, prompts, budget, concurrency, settings, on_request)
            except asyncio.CancelledError:
                bar.drop_run(budget, len(prompts) - finished)
                raise
            sweep.rows.append(row)
            sweep.texts.append(texts)
            if prune_below is not None and _too_slow(row, sweep.rows, prune_below):
                ended_trees[concurrency] = budget
            if on_row is not None:
                with bar.paused():
                    on_row(sweep)
    finally:
        sweep.timed_seconds = time.perf_counter() - started
        bar.close()
    return sweep
