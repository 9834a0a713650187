"""The benchmark's results as a plain fixed-width table, one line per row, so that each budget's row
can be printed the moment it is measured.

The default columns fit 112 characters (aggregate tokens/s, `out tok/s`, beside each request's
median, so that concurrency levels compare); `full=True` gives every latency column (about 170
characters). Every number of every row is in the JSON results either way. Parity failures are in
red, the recommendation in green (rich markup; plain text when the output is not a terminal).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from rich.console import Console
from rich.markup import escape

from ddtree.bench.report import recommendation_line

GAP = "  "  # between columns
COMPACT_WIDTH = 112


def _num(value: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def _parity(row: dict) -> str:
    if row.get("parity_ok") is None:
        return "-"
    text = f"{row['parity_vs_ar'] * 100:.1f}%"
    return text if row["parity_ok"] else f"{text} MISMATCH"


def _done(row: dict) -> str:
    return f"{row['completed']}/{row['failed']}"


@dataclass(frozen=True)
class Column:
    header: str
    width: int
    cell: Callable[[dict], str]
    left: bool = False
    alarm: Callable[[dict], bool] = lambda row: False  # printed in bold red when true

    def render(self, text: str) -> str:
        return text.ljust(self.width) if self.left else text.rjust(self.width)


BUDGET = Column("budget", 6, lambda r: str(r["tree_budget"]), left=True)
CONCURRENCY = Column("conc", 4, lambda r: str(r["concurrency"]))
DONE = Column("ok/fail", 7, _done, alarm=lambda r: r["failed"] > 0)
OUTPUT_TPS = Column("out tok/s", 9, lambda r: _num(r["output_throughput"]))  # all requests' tokens / wall
MEDIAN_TPS = Column("tok/s med", 9, lambda r: _num(r["median_tokens_per_second"]))
VS_AR = Column("vs ar", 6, lambda r: _num(r.get("speedup_vs_ar"), "{:.2f}x"))
ACCEPT = Column("accept", 6, lambda r: _num(r["mean_acceptance_length"], "{:.2f}"))
TTFT = Column("TTFT ms", 8, lambda r: _num(r["median_ttft_ms"]))
TPOT = Column("TPOT ms", 8, lambda r: _num(r["median_tpot_ms"], "{:.2f}"))
E2E_P99 = Column("E2E p99 ms", 10, lambda r: _num(r["p99_e2el_ms"]))
PARITY = Column("parity vs ar", 14, _parity, alarm=lambda r: r.get("parity_ok") is False)

COMPACT_COLUMNS = (BUDGET, CONCURRENCY, DONE, OUTPUT_TPS, MEDIAN_TPS, VS_AR, ACCEPT, TTFT, TPOT, E2E_P99, PARITY)
FULL_COLUMNS = (
    BUDGET, CONCURRENCY, DONE,
    Column("req/s", 7, lambda r: _num(r["request_throughput"], "{:.2f}")),
    OUTPUT_TPS, MEDIAN_TPS, VS_AR, ACCEPT,
    Column("rounds/req", 10, lambda r: _num(r["decode_rounds"])),
    Column("TTFT med ms", 11, lambda r: _num(r["median_ttft_ms"])),
    # a live server's own mean, from admission to its first token leaving the engine (its /metrics)
    Column("srv TTFT ms", 11, lambda r: _num(r.get("server_mean_ttft_ms"))),
    Column("TPOT med ms", 11, lambda r: _num(r["median_tpot_ms"], "{:.2f}")),
    Column("ITL med ms", 10, lambda r: _num(r["median_itl_ms"], "{:.2f}")),
    Column("E2E med ms", 10, lambda r: _num(r["median_e2el_ms"])),
    E2E_P99, PARITY,
)


def budgets_line(row: dict) -> str | None:
    """'server at concurrency 8: rounds at ar 93%, 16 7%' for a row whose rounds ran budgets other
    than its own (the server chose them); None otherwise."""
    rounds = row.get("budget_rounds") or {}
    if not rounds or set(rounds) == {str(row["tree_budget"])}:
        return None
    total = sum(rounds.values())
    shares = ", ".join(f"{budget} {count / total:.0%}" for budget, count in rounds.items())
    return f"{row['tree_budget']} at concurrency {row['concurrency']}: rounds at {shares}"


def columns_for(full: bool) -> tuple[Column, ...]:
    return FULL_COLUMNS if full else COMPACT_COLUMNS


def header_line(columns: tuple[Column, ...]) -> str:
    return GAP.join(c.render(c.header) for c in columns).rstrip()


def row_line(row: dict, columns: tuple[Column, ...], markup: bool = False) -> str:
    """One row; a cell wider than its column pushes the rest right rather than being cut."""
    cells = []
    for column in columns:
        text = column.render(column.cell(row))
        cells.append(f"[bold red]{escape(text)}[/bold red]" if markup and column.alarm(row) else
                     (escape(text) if markup else text))
    return GAP.join(cells).rstrip()


def table_lines(rows: list[dict], full: bool = False) -> list[str]:
    """The table as plain text: the header, then one line per row."""
    columns = columns_for(full)
    return [header_line(columns)] + [row_line(r, columns) for r in rows]


class RowPrinter:
    """Prints a title and the header, then each row as it is measured. `title` may be a function,
    called when the first line is printed."""

    def __init__(self, console: Console, title: str | Callable[[], str], full: bool = False):
        self.console, self.title, self.columns = console, title, columns_for(full)
        self.started = False

    def title_text(self) -> str:
        return self.title() if callable(self.title) else self.title

    def _print(self, text: str, markup: bool = True) -> None:
        self.console.print(text, soft_wrap=True, highlight=False, markup=markup)
        self.console.file.flush()  # a row is news: show it now even when stdout is a pipe or a file

    def start(self) -> None:
        if not self.started:
            self._print(f"[bold]{escape(self.title_text())}[/bold]")
            self._print(f"[bold]{escape(header_line(self.columns))}[/bold]")
            self.started = True

    def row(self, row: dict) -> None:
        self.start()
        self._print(row_line(row, self.columns, markup=True))


def print_report(report: dict, console: Console | None = None, title: str | Callable[[], str] = "ddtree bench",
                 full: bool = False, table: bool = True) -> None:
    """The table (unless its rows were already printed one by one), then each warning in bold red,
    then the recommendation line(s)."""
    console = console or Console()
    if table:
        printer = RowPrinter(console, title, full)
        printer.start()
        for row in report["results"]:
            printer.row(row)
    for warning in report["warnings"]:
        console.print(f"[bold red]WARNING: {escape(warning)}[/bold red]", soft_wrap=True, highlight=False)
    for pick in report["recommendations"]:
        console.print(f"[bold green]{escape(recommendation_line(pick))}[/bold green]", soft_wrap=True,
                      highlight=False)
