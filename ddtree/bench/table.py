"""The benchmark's results as a rich table, with parity failures and the recommendation in red/green."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from ddtree.bench.report import recommendation_line


def _num(value: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def _parity(row: dict) -> str:
    if row.get("parity_ok") is None:
        return "-"
    text = f"{row['parity_vs_ar'] * 100:.1f}%"
    return text if row["parity_ok"] else f"[bold red]{text} MISMATCH[/bold red]"


def results_table(rows: list[dict], title: str = "ddtree bench") -> Table:
    table = Table(title=title, header_style="bold")
    for name in ("budget", "conc", "done/failed", "req/s", "out tok/s", "median tok/s", "vs ar", "accept len",
                 "rounds/req", "TTFT med ms", "TPOT med ms", "ITL med ms", "E2E med ms", "E2E p99 ms", "parity vs ar"):
        table.add_column(name, justify="left" if name == "budget" else "right", no_wrap=True)
    for row in rows:
        failed = f"[bold red]{row['failed']}[/bold red]" if row["failed"] else "0"
        table.add_row(
            str(row["tree_budget"]), str(row["concurrency"]), f"{row['completed']}/{failed}",
            _num(row["request_throughput"], "{:.2f}"), _num(row["output_throughput"]),
            _num(row["median_tokens_per_second"]), _num(row.get("speedup_vs_ar"), "{:.2f}x"),
            _num(row["mean_acceptance_length"], "{:.2f}"), _num(row["decode_rounds"]),
            _num(row["median_ttft_ms"]), _num(row["median_tpot_ms"], "{:.2f}"), _num(row["median_itl_ms"], "{:.2f}"),
            _num(row["median_e2el_ms"]), _num(row["p99_e2el_ms"]), _parity(row),
        )
    return table


def print_report(report: dict, console: Console | None = None, title: str = "ddtree bench") -> None:
    """The table, then each warning in bold red, then the recommendation line(s)."""
    console = console or Console()
    console.print(results_table(report["results"], title))
    for warning in report["warnings"]:
        console.print(f"[bold red]WARNING: {warning}[/bold red]", soft_wrap=True)
    for pick in report["recommendations"]:
        console.print(f"[bold green]{recommendation_line(pick)}[/bold green]", soft_wrap=True)
