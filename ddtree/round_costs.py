"""Seconds per batched round on this device: the cost side of the batch's budget choice
(ddtree.batch_budget).

A `BatchEngine` round costs more with more rows, more verified tokens and a longer context, in
proportions only a measurement on the device knows (on the 2-core CPU with the demo pair, a round
of 8 rows at budget 64 costs over 10x one of 8 `ar` rows; 1 row at 64, 5x one `ar` row). The table
holds the median time of a few rounds at a grid: contexts x rows x tree budgets, every row of a
measured round at the same budget. It prices any round by interpolation:

- in verify tokens per row (root included), piecewise-linear between the measured budgets' node
  counts; a round that mixes budgets is priced at its mean, which counts the drafter pass of the
  drafting rows in proportion to their tokens (an approximation: a drafter pass is per row);
- then in rows, linear between the measured row counts;
- then in context (mean committed tokens per row), linear between the measured contexts.

Beyond the largest measured value of each, the last segment's slope carries on (never falling);
below the smallest, the smallest's value holds. Each (context, rows) line is made non-decreasing
in tokens (a running maximum), so that timing noise never makes a larger tree look cheaper.

`measure_round_costs` times rounds of dummy prompts on the engine itself (a few seconds on the CPU
at one context); `ddtree tune` stores a table in its tune file (`to_json` / `from_json`).
"""
from __future__ import annotations

import bisect
import contextlib
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from ddtree.config import SamplingParams
from ddtree.tree_shape import TreeShape

ROUNDS_PER_POINT = 3  # timed rounds per grid point, after one untimed round
STARTUP_CONTEXT = 64  # the context measured when no other is asked for
# From this context on, the rows of a (context, row count) point are prefilled once and every budget
# is timed on them in turn (a prefill of 32k tokens takes over a second on an H200, and the budgets
# would each have prefilled them afresh); each budget then runs at most (rounds + 1) x block_size
# tokens further on than the one before it (64 at the defaults: the third of three 3% past 4096).
SHARED_PREFILL_CONTEXT = 4096


@dataclass(frozen=True)
class RoundCost:
    """One measured grid point: `rows` rows of `context` committed tokens, each verifying
    `tokens_per_row` tokens (the `budget`'s nodes), took `seconds` per round (median)."""

    context: int
    rows: int
    budget: str
    tokens_per_row: int
    seconds: float


class RoundCostTable:
    def __init__(self, points: list[RoundCost]):
        if not points:
            raise ValueError("a round-cost table needs at least one measured point")
        self.points = list(points)
        grid: dict[int, dict[int, dict[int, float]]] = {}
        for p in points:
            grid.setdefault(p.context, {}).setdefault(p.rows, {})[p.tokens_per_row] = p.seconds
        # context -> rows -> [(tokens per row, seconds)], seconds non-decreasing in tokens
        self._grid = {c: {r: _running_max(sorted(line.items())) for r, line in by_rows.items()}
                      for c, by_rows in grid.items()}
        # Sorted once for `seconds`, which runs a few times a round: (contexts, per context (rows, lines)).
        self._contexts = sorted(self._grid)
        self._rows = [sorted(self._grid[c]) for c in self._contexts]
        self._lines = [[self._grid[c][r] for r in rows] for c, rows in zip(self._contexts, self._rows)]

    @property
    def max_rows(self) -> int:
        return max(p.rows for p in self.points)

    def seconds(self, rows: int, verify_tokens: int, context: float) -> float:
        """Expected seconds of one round of `rows` rows verifying `verify_tokens` tokens in all."""
        per_row = verify_tokens / rows

        def at_context(i: int) -> float:
            lines = self._lines[i]
            return _interpolate_at(self._rows[i], lambda j: _interpolate(lines[j], per_row), rows)
        return _interpolate_at(self._contexts, at_context, context)

    def summary(self) -> str:
        """The measured points in one line, ms per round: "context 64: 1 rows ar 0.27 16 0.45 | ..."."""
        parts = []
        for context in sorted({p.context for p in self.points}):
            for rows in sorted({p.rows for p in self.points if p.context == context}):
                line = sorted((p.tokens_per_row, p.budget, p.seconds) for p in self.points
                              if p.context == context and p.rows == rows)
                parts.append(f"context {context}, {rows} rows: " + " ".join(f"{b} {s * 1000:.2f}" for _, b, s in line))
        return "ms per round at " + " | ".join(parts)

    def to_json(self) -> list[dict]:
        return [vars(p).copy() for p in self.points]

    @classmethod
    def from_json(cls, data: object) -> RoundCostTable:
        """A table from `to_json`'s list; ValueError names what is wrong with it."""
        if not isinstance(data, list):
            raise ValueError("round costs must be a list of measured points")
        try:
            points = [RoundCost(int(d["context"]), int(d["rows"]), str(d["budget"]), int(d["tokens_per_row"]),
                                float(d["seconds"])) for d in data]
        except (TypeError, KeyError, ValueError) as exc:
            raise ValueError(f"a round-cost point is malformed: {exc}") from None
        if any(p.rows < 1 or p.tokens_per_row < 1 or p.context < 0 or not p.seconds > 0 for p in points):
            raise ValueError("a round-cost point has a count below 1 or a time that is not positive")
        return cls(points)


def _running_max(line: list[tuple[int, float]]) -> list[tuple[int, float]]:
    out, top = [], 0.0
    for x, y in line:
        top = max(top, y)
        out.append((x, top))
    return out


def _interpolate(line: list[tuple[float, float]], x: float) -> float:
    """y at x on the piecewise-linear line through `line` (sorted by x): the first y below the
    first point, the last segment's slope (never falling) beyond the last."""
    if len(line) == 1 or x <= line[0][0]:
        return line[0][1]
    for (x0, y0), (x1, y1) in zip(line, line[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = line[-2], line[-1]
    return y1 + max(y1 - y0, 0.0) * (x - x1) / (x1 - x0)


def _interpolate_at(xs: list[float], y: Callable[[int], float], x: float) -> float:
    """`_interpolate` over the points (xs[i], y(i)), computing y only at the points it uses (at
    most two): the same value, for a table whose every point is itself an interpolation."""
    if len(xs) == 1 or x <= xs[0]:
        return y(0)
    i = bisect.bisect_left(xs, x)
    if i == len(xs):  # beyond the last point: the last segment's slope, never falling
        i = len(xs) - 1
    return _interpolate([(xs[i - 1], y(i - 1)), (xs[i], y(i))], x)


def row_counts(max_rows: int) -> list[int]:
    """The measured row counts: powers of two below max_rows, and max_rows."""
    counts, r = [], 1
    while r < max_rows:
        counts.append(r)
        r *= 2
    return counts + [max_rows]


def timed_contexts(contexts, max_model_len: int, block_size: int) -> list[int]:
    """The contexts `measure_round_costs` times for `contexts`: each cut to leave room for two rounds
    of `block_size` tokens under the context limit, sorted, without repeats."""
    block = max(block_size, 1)  # the most tokens one round commits
    longest = max_model_len - 2 * block - 1
    if longest < 1:
        raise ValueError(f"a context limit of {max_model_len} tokens leaves no room to time rounds")
    return sorted({min(c, longest) for c in contexts})


def measure_round_costs(engine, budgets: list[TreeShape], rows: list[int] | None = None,
                        contexts: list[int] = (STARTUP_CONTEXT,), rounds: int = ROUNDS_PER_POINT,
                        log: Callable[[str], None] | None = None,
                        shared_from: int = SHARED_PREFILL_CONTEXT) -> RoundCostTable:
    """Time up to `rounds` rounds (after an untimed one) of `engine` (a `BatchEngine` with no
    sequences) at every context x row count x budget, on dummy greedy prompts -> the table of
    medians. rows: default every `row_counts` up to the engine's rows. A context is cut to leave
    room for two rounds; the rounds stop early where the context limit leaves no room for another.
    From `shared_from` tokens of context on, a point's rows are prefilled once for all the budgets,
    timed in turn on them (where the KV cache holds rows with room for all their rounds; else each
    budget's rows are prefilled afresh)."""
    if engine.sequences:
        raise RuntimeError("round costs are measured on an engine with no sequences")
    rows = rows or row_counts(engine.free_rows)
    cut = timed_contexts(contexts, engine.max_model_len, engine.block_size)
    points = []
    new_tokens = (rounds + 2) * max(engine.block_size, 1)  # room for every timed round in each dummy row's region

    def fits(count: int, context: int, group: list[TreeShape]) -> bool:
        nodes = max(b.nodes(engine.block_size) for b in group)
        return count * engine.region_slots(context, new_tokens * len(group), nodes) <= engine.regions.largest_free

    for context in cut:
        for count in rows:
            shared = context >= shared_from and len(budgets) > 1 and fits(count, context, budgets)
            for group in [list(budgets)] if shared else [[b] for b in budgets]:
                if not fits(count, context, group):
                    if log is not None:
                        log(f"round cost: context {context}, {count} rows at {group[0]}: not timed, the KV cache "
                            "holds fewer such rows")
                    continue
                max_nodes = max(b.nodes(engine.block_size) for b in group)
                with dummy_rows(engine, count, group[0], context, new_tokens * len(group), max_nodes) as seqs:
                    for budget in group:
                        for seq in seqs:
                            engine.set_budget(seq, budget)
                        points.append(RoundCost(context, count, budget.label, budget.nodes(engine.block_size),
                                                _median_round(engine, seqs, budget, rounds)))
                        if log is not None:
                            log(f"round cost: context {context}, {count} rows at {budget}: "
                                f"{points[-1].seconds * 1000:.1f} ms")
    return RoundCostTable(points)


def _median_round(engine, seqs: list, budget: TreeShape, rounds: int) -> float:
    """Seconds of the median of up to `rounds` rounds of `seqs` at `budget`, after an untimed one
    (fewer where the rows' regions leave no room for another)."""
    nodes = budget.nodes(engine.block_size)
    times = []
    while len(times) <= rounds and all(s.n + engine.span(nodes) <= s.slots for s in seqs):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


@contextlib.contextmanager
def dummy_rows(engine, count: int, budget: TreeShape, context: int, new_tokens: int | None = None,
               max_nodes: int | None = None) -> Iterator[list]:
    """`count` greedy sequences of `context` dummy tokens at `budget` in `engine` (a `BatchEngine`),
    each with a region for new_tokens more (default: to the context limit) and trees of up to
    max_nodes nodes (default: the budget's), removed on exit -> their `Sequence`s. Each feeds the
    drafter, as a row whose budget the batch chooses does."""
    params = SamplingParams(max_tokens=engine.max_model_len, ignore_eos=True)
    vocab = engine.target.config.vocab_size
    nodes = budget.nodes(engine.block_size) if max_nodes is None else max_nodes
    seqs = []
    try:
        for i in range(count):
            seqs.append(engine.add(_dummy_prompt(context, i, vocab), params, budget, engine.drafter is not None,
                                   max_new=new_tokens, max_nodes=nodes)[0])
        yield seqs
    finally:
        for seq in seqs:
            engine.remove(seq)


def _dummy_prompt(length: int, row: int, vocab: int) -> list[int]:
    """Distinct token ids per row, past the special ids at the start of a vocabulary."""
    low = min(16, vocab // 2)
    return [low + (row * 7919 + j * 104729) % (vocab - low) for j in range(length)]
