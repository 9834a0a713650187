"""How long `ddtree serve` takes to load and settle its tree budget when no tune file holds the
measurements, mode by mode, in one process.

    python -m benchmarks.startup_time OUTPUT.json --target DIR --draft DIR [--device cuda]
        [--dtype bfloat16] [--max-model-len 40960] [--modes fixed,auto,batch] [--max-num-seqs 8]

Each mode is the server's own load step (`ddtree.server.main.load_for_serving`, the flags parsed by
`ddtree serve`'s parser), run on a fresh pair with its log captured:

- `fixed`: `--tree-budget 16`, the load alone (the baseline the others add to);
- `auto`: `--tree-budget auto` with no tune file beside the drafter: the short calibration, then
  the context calibrations at 8192 and 32768 tokens where `--max-model-len` leaves room
  (`tune.calibrate_context_caps`);
- `batch`: `--max-num-seqs N` and no `--tree-budget`: the batch budget's start-up round costs
  (`tune.startup_round_cost_contexts`: a 64-token context, and on a GPU an 8192-token one).

OUTPUT holds each mode's seconds, what it chose and its log lines. A tune file beside the drafter
is refused (the point is the start-up without one).
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import platform
import sys
import time
from pathlib import Path

import torch

MODES = {
    "fixed": ["--tree-budget", "16"],
    "auto": ["--tree-budget", "auto"],
    "batch": [],  # --max-num-seqs added from the command line
}


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.name}: {record.getMessage()}")


def mode_flags(args: argparse.Namespace, mode: str) -> list[str]:
    """The flags that make this mode, beside the pair's own."""
    return MODES[mode] + (["--max-num-seqs", str(args.max_num_seqs)] if mode == "batch" else [])


def serve_args(args: argparse.Namespace, mode: str) -> argparse.Namespace:
    """The Namespace `ddtree serve` would parse for this mode."""
    from ddtree.cli import build_parser

    return build_parser().parse_args(["serve", "--target", str(args.target), "--draft", str(args.draft),
                                      "--device", args.device, "--dtype", args.dtype,
                                      "--max-model-len", str(args.max_model_len), *mode_flags(args, mode)])


def time_mode(args: argparse.Namespace, mode: str) -> dict:
    from ddtree.config import parse_tree_budget
    from ddtree.server.main import limits_from, load_for_serving

    served = serve_args(args, mode)
    budget = parse_tree_budget(served.tree_budget, allow_auto=True) if served.tree_budget is not None else None
    handler = _Lines()
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        start = time.perf_counter()
        llm, how = load_for_serving(served, budget, False, limits_from(served).max_tree_budget)
        seconds = time.perf_counter() - start
    finally:
        root.removeHandler(handler)
    row = {"mode": mode, "flags": mode_flags(args, mode), "seconds": round(seconds, 2), "budget_mode": how,
           "default_budget": str(llm.default_budget), "log": handler.lines}
    if getattr(llm, "auto_context_budgets", None):
        row["context_budgets"] = {name: str(b) for name, b in llm.auto_context_budgets.items()}
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    print(f"{mode:>6}: {seconds:7.1f} s ({how}, default {row['default_budget']})", flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("output", type=Path)
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--draft", type=Path, required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=40960)
    p.add_argument("--modes", default="fixed,auto,batch")
    p.add_argument("--max-num-seqs", type=int, default=8)
    args = p.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
    from ddtree.bench.machine import git_revision
    from ddtree.bench.tune import tune_file_path

    if tune_file_path(args.draft).exists():
        p.error(f"{tune_file_path(args.draft)} exists: this measures the start-up without a tune file")
    rows = [time_mode(args, mode) for mode in modes]
    record = {"benchmark": "startup_time", "command": "python -m benchmarks.startup_time " + " ".join(sys.argv[1:]),
              "git_revision": git_revision(), "target": str(args.target), "draft": str(args.draft),
              "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor(),
              "dtype": args.dtype, "max_model_len": args.max_model_len, "rows": rows}
    args.output.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
