"""Benchmark and tune tree budgets: `ddtree bench` (live endpoint or in-process engine), `ddtree tune`
and the `--tree-budget auto` resolver (`ddtree.bench.tune.resolve_auto_budget`)."""
