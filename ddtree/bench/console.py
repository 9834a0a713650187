"""What a sweep prints to stdout while it runs and when it ends.

The title and the header first, then each row the moment its run ends (compared with `ar` when
`ar` ran before it at that concurrency), then the warnings and the recommendation. A row printed
before its `ar` run has no comparison yet, so then the table is printed once more at the end.
An interrupted sweep says what it left out.
"""
from __future__ import annotations

from rich.console import Console
from rich.markup import escape

from ddtree.bench.report import compare_with_ar
from ddtree.bench.sweep import Sweep
from ddtree.bench.table import RowPrinter, budgets_line, print_report


def make_console() -> Console:
    return Console(highlight=False)


class SweepConsole:
    def __init__(self, console: Console, title: str, full: bool, greedy: bool, prompt_names: list[str]):
        self.console, self.title, self.full = console, title, full
        self.greedy, self.prompt_names = greedy, prompt_names
        self.printer = RowPrinter(console, title, full)
        self.printed_before_ar = False

    def on_row(self, sweep: Sweep) -> None:
        compare_with_ar(sweep.rows, sweep.texts, self.greedy, self.prompt_names)
        row = sweep.rows[-1]
        if row["tree_budget"].drafts and row.get("speedup_vs_ar") is None:
            self.printed_before_ar = True
        self.printer.row(row)
        chosen = budgets_line(row)
        if chosen is not None:
            self.note(chosen, "dim")

    def note(self, text: str, style: str = "bold") -> None:
        self.console.print(f"[{style}]{escape(text)}[/{style}]", soft_wrap=True)

    def finish(self, report: dict, sweep: Sweep) -> None:
        rows = report["results"]
        if not rows:
            self.note("no run finished: nothing was measured", "bold red")
        elif self.printed_before_ar and any(r.get("speedup_vs_ar") is not None for r in rows):
            self.note("the table again, each row now compared with ar:")
            print_report({**report, "warnings": [], "recommendations": []}, self.console, self.title, self.full)
        print_report(report, self.console, self.title, self.full, table=False)
        for skip in sweep.skipped:
            self.note(f"skipped tree budget {skip['tree_budget']} at concurrency {skip['concurrency']}: "
                      f"{skip['reason']}", "dim")
        if sweep.interrupted:
            self.note(f"interrupted: {len(rows)} of {sweep.planned_runs} runs measured (the run in progress, "
                      f"if any, is left out); the recommendation is among those measured", "bold yellow")
