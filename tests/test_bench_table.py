"""The bench / tune table: the default columns fit 100 characters, whatever the numbers; the full
table has every latency column; rows print one at a time, a parity failure flagged in each."""
from __future__ import annotations

import io

from rich.console import Console

from ddtree.bench.report import RequestOutput, finish, summarize
from ddtree.bench.table import COMPACT_WIDTH, RowPrinter, print_report, table_lines
from ddtree.config import parse_tree_budget


def _row(budget, concurrency: int, seconds: float, failed: int = 0) -> dict:
    done = [RequestOutput(i, success=True, prompt_tokens=900, output_tokens=1024, ttft_s=seconds / 50,
                          itl_s=[seconds / 300] * 200, e2el_s=seconds, decode_rounds=200, accepted_tokens=1023)
            for i in range(1000)]
    return summarize(done + [RequestOutput(1000 + i, error="HTTP 500") for i in range(failed)], seconds * 1000,
                     parse_tree_budget(budget), concurrency)


def _report() -> dict:
    """Wide numbers on purpose: 4-digit budgets and concurrency, 1000 requests, a parity failure."""
    rows = [_row("ar", 1024, 300.0), _row("chain", 1024, 0.004), _row(4096, 1024, 999.0, failed=12)]
    texts = [{0: "a", 1: "b"}, {0: "a", 1: "b"}, {0: "a", 1: "x"}]
    return finish(rows, texts, greedy=True)


def test_the_default_table_fits_its_width_and_the_full_one_has_every_column():
    report = _report()
    compact = table_lines(report["results"])
    assert max(len(line) for line in compact) <= COMPACT_WIDTH
    assert compact[0].split()[:3] == ["budget", "conc", "ok/fail"]
    assert compact[3].split()[:3] == ["4096", "1024", "1000/12"] and compact[3].endswith("50.0% MISMATCH")
    full = table_lines(report["results"], full=True)
    assert "out tok/s" in compact[0]  # aggregate tokens/s: what concurrency levels compare by
    for header in ("req/s", "rounds/req", "ITL med ms", "E2E med ms"):
        assert header in full[0] and header not in compact[0]
    assert max(len(line) for line in full) > COMPACT_WIDTH


def test_rows_print_one_by_one_with_no_cut_cells_in_a_narrow_terminal():
    out = io.StringIO()
    console = Console(file=out, width=80, force_terminal=False)
    printer = RowPrinter(console, "ddtree bench: demo-target on cpu")
    report = _report()
    printer.row(report["results"][0])
    assert out.getvalue().splitlines() == ["ddtree bench: demo-target on cpu", *table_lines(report["results"])[:2]]
    printer.row(report["results"][2])
    assert out.getvalue().splitlines()[-1] == table_lines(report["results"])[3]
    assert "…" not in out.getvalue() and "..." not in out.getvalue()


def test_report_prints_warnings_and_the_recommendation_after_the_table():
    out = io.StringIO()
    print_report(_report(), Console(file=out, width=100), "t")
    lines = out.getvalue().splitlines()
    assert lines[0] == "t" and len(lines) == 5 + 2 + 1
    assert lines[5].startswith("WARNING: PARITY FAILURE") and lines[7].startswith("recommended tree budget")
