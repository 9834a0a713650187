"""The batch-level budget choice (ddtree.batch_budget) and its round-cost table
(ddtree.round_costs), on synthetic costs and acceptance: no model, no timing."""
from __future__ import annotations

import pytest

from ddtree.batch_budget import AcceptanceStats, BatchBudget, BatchRow
from ddtree.budget_selector import CANDIDATES
from ddtree.round_costs import RoundCost, RoundCostTable, row_counts, timed_contexts
from ddtree.tree_shape import AR, CHAIN, TreeShape

_, SMALL, BIG = CANDIDATES  # ar and the two default trees (15 and 63 nodes past the root)
BLOCK = 16


def table(seconds, rows=(1, 2, 4, 8), budgets=(AR, SMALL, BIG), contexts=(64,)) -> RoundCostTable:
    """A table whose round at (context, rows, budget) takes seconds(context, rows, nodes)."""
    return RoundCostTable([RoundCost(c, r, b.label, b.nodes(BLOCK), seconds(c, r, b.nodes(BLOCK)))
                           for c in contexts for r in rows for b in budgets])


def weights_bound(c, rows, nodes):
    """A big model on a fast device: a round is its weights pass; verify tokens are nearly free."""
    return 0.020 + 0.00001 * rows * nodes


def compute_bound(c, rows, nodes):
    """A small device: every verified token costs as much as a tenth of the weights pass."""
    return 0.002 + 0.0002 * rows * nodes


def chooser(seconds, acceptance: dict[TreeShape, float], bucket="greedy", contexts=(64,)) -> BatchBudget:
    """A chooser that has already seen many rounds at each budget, with these mean lengths."""
    budget = BatchBudget(table(seconds, contexts=contexts), BLOCK)
    for shape, mean in acceptance.items():
        for _ in range(400):
            budget.observe(bucket, shape, mean)
    return budget


SEEN = {SMALL: 4, BIG: 6}  # mean acceptance lengths at T = 0


def test_a_few_rows_on_cheap_tokens_get_the_big_tree():
    chosen = chooser(weights_bound, SEEN).choose([BatchRow("greedy", 100)] * 2)
    assert chosen == [BIG, BIG]


def test_tokens_that_cost_get_ar_for_a_full_batch_and_a_tree_alone():
    budget = chooser(compute_bound, SEEN)
    assert budget.choose([BatchRow("greedy", 100)] * 8) == [AR] * 8
    # Alone, a tree's tokens are cheap beside the round's fixed cost: the small tree pays, the big one
    # does not.
    assert budget.choose([BatchRow("greedy", 100)]) == [SMALL]


def test_rows_that_named_a_budget_keep_it_and_weigh_in_the_cost():
    budget = chooser(weights_bound, SEEN)
    rows = [BatchRow("greedy", 100, CHAIN), BatchRow("greedy", 100), BatchRow("greedy", 100, AR)]
    chosen = budget.choose(rows)
    assert chosen[0] == CHAIN and chosen[2] == AR and chosen[1] == BIG
    assert budget.choose([BatchRow("greedy", 100, SMALL)] * 3) == [SMALL] * 3


def test_rows_of_other_temperatures_get_their_own_budgets():
    budget = chooser(lambda c, r, n: 0.004 + 0.00002 * r * n, SEEN)
    for _ in range(400):  # at T = 1 the drafter's guesses rarely match
        budget.observe("t>0.8", SMALL, 1.1)
        budget.observe("t>0.8", BIG, 1.2)
    chosen = budget.choose([BatchRow("greedy", 50), BatchRow("t>0.8", 50), BatchRow("greedy", 50)])
    assert chosen[0] == chosen[2] != AR and chosen[1] == AR


def picks_over_rounds(seconds, rows: int, rounds: int = 12) -> list[TreeShape]:
    """The shared budget of `rows` greedy rows, round after round, as each round's acceptance
    (the small tree: 4 tokens, the big one: 6) is observed."""
    budget = BatchBudget(table(seconds), BLOCK)
    batch = [BatchRow("greedy", 100)] * rows
    picks = []
    for _ in range(rounds):
        chosen = budget.choose(batch)
        assert len(set(chosen)) == 1  # same temperature, same lengths: one budget for all
        picks.append(chosen[0])
        for shape in chosen:
            budget.observe("greedy", shape, {AR: 1, SMALL: 4, BIG: 6}[shape])
    assert budget.choose(batch) == budget.choose(batch)  # deterministic
    return picks


def test_untried_budgets_are_tried_while_their_best_case_wins_and_dropped_once_measured():
    # Every tree starts at its best case (each drafted token accepted): the small tree is tried
    # first, found to lose to ar under this load and never chosen again; the big one loses even at
    # its best, so it is never tried.
    picks = picks_over_rounds(compute_bound, rows=8)
    assert picks[0] == SMALL and BIG not in picks and picks[-8:] == [AR] * 8
    # With cheap tokens both trees are tried, and the measured better one stays.
    picks = picks_over_rounds(weights_bound, rows=2, rounds=16)
    assert picks[0] == SMALL and BIG in picks and picks[-6:] == [BIG] * 6


def test_acceptance_prior_and_window():
    stats = AcceptanceStats(BLOCK, prior_rounds=2, window=40)
    assert stats.best_case(AR) == 1 and stats.best_case(CHAIN) == 16
    assert stats.best_case(SMALL) == 16 and stats.best_case(TreeShape.best(3)) == 4
    assert stats.expected("greedy", BIG) == 16 and stats.expected("greedy", AR) == 1
    stats.observe("greedy", BIG, 4)
    assert stats.expected("greedy", BIG) == pytest.approx((2 * 16 + 4) / 3)
    for _ in range(100):
        stats.observe("greedy", BIG, 2)
    # Beyond the window older rounds fade (the 4 is all but gone); the prior keeps its weight.
    assert stats.expected("greedy", BIG) == pytest.approx((2 * 16 + 40 * 2) / 42, abs=0.02)
    assert stats.buckets() == ["greedy"]


def test_cost_table_interpolates_tokens_rows_and_context():
    costs = table(lambda c, r, n: 0.001 * r * n + 0.00001 * c, rows=(1, 4), contexts=(100, 300))
    assert costs.max_rows == 4
    assert costs.seconds(1, 17, 100) == pytest.approx(0.017 + 0.001)
    # A mixed round of 4 rows (two at 16, two at ar) is priced at its mean tokens per row, 9.
    assert costs.seconds(4, 2 * 17 + 2 * 1, 100) == pytest.approx(0.036 + 0.001)
    assert costs.seconds(2, 2 * 65, 100) == pytest.approx(0.130 + 0.001)  # rows 2: between 1 and 4
    assert costs.seconds(1, 1, 200) == pytest.approx(0.001 + 0.002)  # context: between 100 and 300
    assert costs.seconds(1, 1, 500) == pytest.approx(0.001 + 0.005)  # beyond: the last slope
    assert costs.seconds(1, 1, 10) == pytest.approx(0.001 + 0.001)  # below: the shortest's
    assert costs.seconds(8, 8 * 65, 100) == pytest.approx(0.520 + 0.001)  # more rows: the last slope


def test_cost_table_never_prices_a_bigger_tree_below_a_smaller_one():
    noisy = RoundCostTable([RoundCost(64, 1, "ar", 1, 0.010), RoundCost(64, 1, "16", 17, 0.050),
                            RoundCost(64, 1, "64", 65, 0.040)])
    assert noisy.seconds(1, 65, 64) == pytest.approx(0.050)
    assert noisy.seconds(1, 40, 64) == pytest.approx(0.050)


def test_cost_table_json_round_trip_and_refusals():
    costs = table(weights_bound)
    again = RoundCostTable.from_json(costs.to_json())
    assert again.seconds(3, 3 * 30, 64) == costs.seconds(3, 3 * 30, 64)
    for bad in ({"rows": 1}, [{"context": 1}], [{"context": 1, "rows": 0, "budget": "ar", "tokens_per_row": 1,
                                                  "seconds": 0.1}]):
        with pytest.raises(ValueError):
            RoundCostTable.from_json(bad)
    with pytest.raises(ValueError):
        RoundCostTable([])


def test_a_long_context_shrinks_the_tree_where_the_table_timed_it():
    """Each verified token reads the row's whole context: at 32k tokens a tree's tokens cost more
    than a weights pass, so the chooser that took the big tree at 100 tokens takes the small one."""
    def attention_grows(c, rows, nodes):
        return 0.020 + 0.00001 * rows * nodes + 2e-8 * rows * nodes * c

    budget = chooser(attention_grows, SEEN, contexts=(64, 1024, 8192, 32768))
    assert budget.choose([BatchRow("greedy", 100)] * 2) == [BIG, BIG]
    assert budget.choose([BatchRow("greedy", 32768)] * 2) == [SMALL, SMALL]
    # Timed at one short context (the start-up table), every context is priced as that one.
    assert chooser(attention_grows, SEEN).choose([BatchRow("greedy", 32768)] * 2) == [BIG, BIG]


def test_timed_contexts_are_cut_to_leave_room_for_two_rounds():
    assert timed_contexts((64, 1024, 8192, 32768), 40960, 16) == [64, 1024, 8192, 32768]
    assert timed_contexts((64, 1024, 8192, 32768), 1100, 16) == [64, 1024, 1100 - 33]
    assert timed_contexts((64, 1024), 512, 16) == [64, 512 - 33]
    with pytest.raises(ValueError, match="no room"):
        timed_contexts((64,), 33, 16)


def test_row_counts():
    assert row_counts(1) == [1] and row_counts(8) == [1, 2, 4, 8] and row_counts(6) == [1, 2, 4, 6]


def test_cost_table_summary_lists_every_point_in_ms():
    table = RoundCostTable([RoundCost(64, 1, "ar", 1, 0.00027), RoundCost(64, 1, "16", 17, 0.00045),
                            RoundCost(64, 16, "16", 17, 0.00066), RoundCost(64, 16, "ar", 1, 0.00036)])
    assert table.summary() == ("ms per round at context 64, 1 rows: ar 0.27 16 0.45 | "
                               "context 64, 16 rows: ar 0.36 16 0.66")


def plain_greedy(chooser: BatchBudget, rows: list[BatchRow]) -> list[TreeShape]:
    """The choice's search written out with no shortcut: every free row weighs every move in
    every pass, and every price is the table's (the reference the shortcuts must match)."""
    cands, costs = chooser.candidates, chooser.costs
    nodes = [b.nodes(BLOCK) for b in cands]
    free = [i for i, row in enumerate(rows) if row.budget is None]
    context = sum(row.context for row in rows) / len(rows)
    gain = {i: [chooser.acceptance.expected(rows[i].temperature_bucket, b) for b in cands] for i in free}
    fixed_tokens = sum(row.budget.nodes(BLOCK) for row in rows if row.budget is not None)
    fixed_gain = sum(chooser.acceptance.expected(row.temperature_bucket, row.budget) for row in rows
                     if row.budget is not None)

    def rate(tokens, accepted):
        return accepted / costs.seconds(len(rows), tokens, context)
    shared = max(range(len(cands)), key=lambda k: rate(fixed_tokens + len(free) * nodes[k],
                                                       fixed_gain + sum(gain[i][k] for i in free)))
    pick = dict.fromkeys(free, shared)
    tokens = fixed_tokens + sum(nodes[k] for k in pick.values())
    accepted = fixed_gain + sum(gain[i][k] for i, k in pick.items())
    for _ in free:
        moved = False
        for i in free:
            old = pick[i]
            best, best_rate = old, rate(tokens, accepted)
            for k in range(len(cands)):
                r = rate(tokens - nodes[old] + nodes[k], accepted - gain[i][old] + gain[i][k])
                if k != old and r > best_rate * (1 + 1e-9):
                    best, best_rate = k, r
            if best != old:
                tokens += nodes[best] - nodes[old]
                accepted += gain[i][best] - gain[i][old]
                pick[i], moved = best, True
        if not moved:
            break
    return [row.budget if row.budget is not None else cands[pick[i]] for i, row in enumerate(rows)]


@pytest.mark.parametrize("seed", range(40))
def test_choice_equals_the_plain_search(seed):
    """Skipping a row whose bucket and pick match a row that just stayed, and the table's sorted
    look-ups, never change the choice: random tables (several contexts and row counts), buckets,
    named budgets and acceptance, against the search with no shortcut."""
    import random

    rng = random.Random(seed)
    base, per_token, per_row = rng.uniform(0.001, 0.02), rng.uniform(1e-6, 3e-4), rng.uniform(0, 1e-3)
    costs = table(lambda c, r, n: base + per_row * r + per_token * r * n * rng.uniform(0.8, 1.2) + 1e-6 * c,
                  rows=(1, 2, 4, 8, 16), budgets=(AR, SMALL, TreeShape.best(32), BIG), contexts=(64, 512, 2048))
    chooser = BatchBudget(costs, BLOCK, (AR, SMALL, TreeShape.best(32), BIG))
    buckets = ["greedy", "t0.7", "t1"][: rng.randint(1, 3)]
    for bucket in buckets:
        for shape in chooser.candidates[1:]:
            for _ in range(rng.randint(0, 30)):
                chooser.observe(bucket, shape, rng.randint(1, 9))
    rows = [BatchRow(rng.choice(buckets), rng.randint(10, 3000),
                     rng.choice([None, None, None, AR, SMALL, BIG])) for _ in range(rng.randint(1, 24))]
    assert chooser.choose(rows) == plain_greedy(chooser, rows)


@pytest.mark.parametrize("seed", range(10))
def test_cost_table_looks_up_only_the_points_it_interpolates_between(seed):
    """`seconds` computes the lines of the two row counts and contexts around the query only: the
    same prices as interpolating every line, in range, below it and beyond it."""
    import random

    from ddtree.round_costs import _interpolate, _running_max

    rng = random.Random(seed)
    costs = table(lambda c, r, n: rng.uniform(0.001, 0.05), rows=(1, 2, 4, 8, 32), contexts=(64, 1000, 8000))
    grid: dict = {}
    for p in costs.points:
        grid.setdefault(p.context, {}).setdefault(p.rows, {})[p.tokens_per_row] = p.seconds

    def every_line(rows, tokens, context):
        per_row = tokens / rows
        by_context = [(c, _interpolate([(r, _interpolate(_running_max(sorted(line.items())), per_row))
                                        for r, line in sorted(by_rows.items())], rows))
                      for c, by_rows in sorted(grid.items())]
        return _interpolate(by_context, context)
    for _ in range(200):
        rows = rng.randint(1, 40)
        query = (rows, rows * rng.randint(1, 80), rng.uniform(0, 12000))
        assert costs.seconds(*query) == pytest.approx(every_line(*query), rel=1e-12)
