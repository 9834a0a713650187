"""The tree budget of every row of a batch, chosen each round for the batch's tokens per second.

The best budget falls as the batch grows: a tree's extra verify tokens are nearly free next to one
row's weights pass and dear next to eight rows' (on the 2-core CPU with the demo pair at T = 0,
16 beats `ar` 1.4x alone, `ar` beats 16 1.4x for 8 requests at once). A per-request choice cannot
see that, since each request's speed depends on its neighbours' trees. So each round `choose`
gives every row whose budget is ours the candidate that maximises the batch's

    sum over rows of E[acceptance length | row's budget, row's temperature] / seconds of the round,

the round's seconds from `RoundCostTable` (measured on the device: rows x verify tokens x
context) and each expectation from the acceptance observed per budget and temperature bucket.

Acceptance does not depend on the load, so it is learned from whatever rows ran a budget; an
untried budget starts at its most optimistic length (every drafted token accepted, worth
`prior_rounds` observations), so a budget is tried once its best case beats the current choice
and dropped once measured below it; the choice is deterministic given what was observed.
Every budget gives the target's own tokens, so a trial costs time, never correctness.

The search: first every free row on one shared candidate (the best of the candidates), then each
free row in turn moves to the candidate that raises the batch's rate most, until a pass moves
none (at most one pass per row). Rows of different temperatures can end on different budgets
(a greedy row keeps a tree while a T = 1 row decodes with `ar`). With K candidates and R rows a
choice costs at most R^2 K table look-ups; a row of the same bucket and pick as the row before it,
which stayed, is not weighed again (the batch has not changed, so it would stay too). On the
2-core CPU, 16 rows of one bucket, three candidates: 34 -> 19 us a choice with that and the
table's look-ups sorted once (benchmarks/budget_choice_cost.py); it runs every round, on the
engine thread.

Used from the engine thread only (`ddtree.batching.BatchedRequests.step`), so unlocked.
"""
from __future__ import annotations

from dataclasses import dataclass

from ddtree.budget_selector import CANDIDATES
from ddtree.round_costs import RoundCostTable
from ddtree.tree_shape import TreeShape

PRIOR_ROUNDS = 1.0  # weight of the optimistic prior, in observed rounds
WINDOW = 512  # observations per (bucket, budget) beyond which older ones fade


@dataclass(frozen=True)
class BatchRow:
    """What the choice needs of one row: its temperature bucket, its committed tokens, and its
    own budget (a request that named one) or None (ours to choose)."""

    temperature_bucket: str
    context: int
    budget: TreeShape | None = None


class AcceptanceStats:
    """Mean acceptance length (tokens committed per round, bonus counted) per (temperature bucket,
    budget): the rounds observed, plus `prior_rounds` rounds at the budget's best case."""

    def __init__(self, block_size: int, prior_rounds: float = PRIOR_ROUNDS, window: int = WINDOW):
        self.block_size = block_size
        self.prior_rounds = prior_rounds
        self.window = window
        self._sums: dict[tuple[str, TreeShape], list[float]] = {}  # [sum of lengths, rounds]

    def best_case(self, budget: TreeShape) -> float:
        """Every drafted token accepted: the deepest path the shape can hold, plus the bonus."""
        depth = {"ar": 0, "chain": self.block_size - 1}.get(budget.kind, min(budget.budget, self.block_size - 1))
        return float(depth + 1)

    def expected(self, temperature_bucket: str, budget: TreeShape) -> float:
        if not budget.drafts:
            return 1.0
        total, rounds = self._sums.get((temperature_bucket, budget), (0.0, 0.0))
        return (total + self.prior_rounds * self.best_case(budget)) / (rounds + self.prior_rounds)

    def observe(self, temperature_bucket: str, budget: TreeShape, acceptance_length: int) -> None:
        if not budget.drafts:
            return
        sums = self._sums.setdefault((temperature_bucket, budget), [0.0, 0.0])
        sums[0] += acceptance_length
        sums[1] += 1
        if sums[1] > self.window:  # older rounds fade: the mean follows a change of traffic
            sums[0] *= self.window / sums[1]
            sums[1] = float(self.window)

    def buckets(self) -> list[str]:
        """The temperature buckets observed so far."""
        return sorted({bucket for bucket, _ in self._sums})


class BatchBudget:
    def __init__(self, costs: RoundCostTable, block_size: int, candidates: tuple[TreeShape, ...] = CANDIDATES,
                 prior_rounds: float = PRIOR_ROUNDS, window: int = WINDOW):
        if not candidates:
            raise ValueError("at least one candidate budget is needed")
        self.costs = costs
        self.block_size = block_size
        self.candidates = tuple(candidates)
        self.acceptance = AcceptanceStats(block_size, prior_rounds, window)

    def choose(self, rows: list[BatchRow]) -> list[TreeShape]:
        """Every row's budget for the next round: its own where it named one, else the choice."""
        chosen = [row.budget for row in rows]
        free = [i for i, row in enumerate(rows) if row.budget is None]
        if not free:
            return chosen
        context = sum(row.context for row in rows) / len(rows)
        nodes = [b.nodes(self.block_size) for b in self.candidates]
        # Rows of one temperature bucket expect the same: one look-up per bucket and candidate, not per
        # row (this runs every round: 16 rows took ~90 us a choice with a look-up per row on the CPU).
        by_bucket: dict[str, list[float]] = {}
        for i in free:
            bucket = rows[i].temperature_bucket
            if bucket not in by_bucket:
                by_bucket[bucket] = [self.acceptance.expected(bucket, b) for b in self.candidates]
        gain = {i: by_bucket[rows[i].temperature_bucket] for i in free}
        fixed_tokens = sum(row.budget.nodes(self.block_size) for row in rows if row.budget is not None)
        fixed_gain = sum(self.acceptance.expected(row.temperature_bucket, row.budget)
                         for row in rows if row.budget is not None)

        seconds: dict[int, float] = {}  # verify tokens -> round seconds: the search asks few distinct totals

        def rate(tokens: int, accepted: float) -> float:
            if tokens not in seconds:
                seconds[tokens] = self.costs.seconds(len(rows), tokens, context)
            return accepted / seconds[tokens]

        def shared(k: int) -> float:
            return rate(fixed_tokens + len(free) * nodes[k], fixed_gain + sum(gain[i][k] for i in free))

        pick = dict.fromkeys(free, max(range(len(self.candidates)), key=shared))  # max keeps the first of ties
        tokens = fixed_tokens + sum(nodes[k] for k in pick.values())
        accepted = fixed_gain + sum(gain[i][k] for i, k in pick.items())
        for _ in free:
            moved = False
            stayed = None  # (gains, pick) of the last row that found no better move since the batch last changed
            for i in free:
                old = pick[i]
                if stayed is not None and stayed[0] is gain[i] and stayed[1] == old:
                    continue  # same bucket, same pick, same batch: it would stay too
                now = rate(tokens, accepted)
                best, best_rate = old, now
                for k in range(len(self.candidates)):
                    if k == old:
                        continue
                    r = rate(tokens - nodes[old] + nodes[k], accepted - gain[i][old] + gain[i][k])
                    if r > best_rate * (1 + 1e-9):
                        best, best_rate = k, r
                if best != old:
                    tokens += nodes[best] - nodes[old]
                    accepted += gain[i][best] - gain[i][old]
                    pick[i], moved, stayed = best, True, None
                else:
                    stayed = (gain[i], old)
            if not moved:
                break
        for i, k in pick.items():
            chosen[i] = self.candidates[k]
        return chosen

    def observe(self, temperature_bucket: str, budget: TreeShape, acceptance_length: int) -> None:
        """A row at `budget` committed `acceptance_length` tokens in a round."""
        self.acceptance.observe(temperature_bucket, budget, acceptance_length)

    def estimates(self) -> dict[tuple[str, str], float]:
        """{(temperature bucket, budget label): expected acceptance length} for the drafting
        candidates of every bucket seen so far."""
        return {(bucket, b.label): self.acceptance.expected(bucket, b)
                for bucket in self.acceptance.buckets() for b in self.candidates if b.drafts}
