"""The sweep's progress bar, on stderr, with an ETA that prices each request still to run at its
own budget's predicted time.

A plain requests-per-second ETA is off by about 2x on a sweep whose budgets run at different
speeds (on a CPU a budget-1024 request takes many times an `ar` one): it prices the slow budgets
still ahead at the pace of the fast ones behind. Here each request counts as the seconds its
budget's warm-up requests took (`estimates`), so the bar advances in predicted seconds, and the
average rate since the start (tqdm's smoothing 0, not its moving average, which swings with every
prompt's length) scales the prediction by what the timed requests have really taken so far: a
warm-up request, the first at its budget, runs slower than the average request.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator

from tqdm import tqdm

from ddtree.tree_shape import TreeShape

BAR_FORMAT = "{desc}{percentage:3.0f}%|{bar}| [{elapsed}<{remaining}]"  # tqdm adds ": " to desc


def format_seconds(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class SweepProgress:
    """Counts finished requests; `estimates[budget]` is that budget's predicted seconds per request
    (None for all when there were no warm-up requests: then every request weighs the same)."""

    def __init__(self, runs: list[tuple[int, TreeShape]], num_prompts: int,
                 estimates: dict[TreeShape, float | None], enabled: bool = True):
        known = all(estimates.get(b) for _, b in runs)
        self.weight = {b: (estimates[b] if known else 1.0) for _, b in runs}
        self.timed = known
        self.num_prompts, self.runs = num_prompts, len(runs)
        self.requests_left = num_prompts * len(runs)
        self.done = 0
        total = sum(num_prompts * self.weight[b] for _, b in runs)
        self.predicted_seconds = total if known else None
        self.run = ""
        self.bar = tqdm(total=total, disable=not enabled, dynamic_ncols=True, bar_format=BAR_FORMAT,
                        file=sys.stderr, smoothing=0)

    def _describe(self) -> None:
        self.bar.set_description(f"{self.run}{self.done}/{self.done + self.requests_left} req", refresh=False)

    def start_run(self, index: int, budget: TreeShape, concurrency: int) -> None:
        self.run = f"budget {budget} x{concurrency} ({index + 1}/{self.runs}) "
        self._describe()

    def request_done(self, budget: TreeShape) -> None:
        self.done += 1
        self.requests_left -= 1
        self._describe()
        self.bar.update(self.weight[budget])

    def drop_run(self, budget: TreeShape, unfinished: int | None = None) -> None:
        """A run that will not happen (skipped), or the unfinished part of one cut short."""
        count = self.num_prompts if unfinished is None else unfinished
        self.requests_left -= count
        self.bar.total -= count * self.weight[budget]
        self._describe()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Clear the bar while something else is printed (the table's rows go to stdout)."""
        with tqdm.external_write_mode(file=sys.stdout):
            yield

    def close(self) -> None:
        self.bar.close()
