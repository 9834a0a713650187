"""Shared pieces of the training tests: a small corpus of real Python on disk, CLI runs, logs."""
from __future__ import annotations

import inspect
import json
from pathlib import Path


from ddtree.train.cli import main as train_main

CORPUS_MODULES = ["json.decoder", "json.encoder", "json.scanner", "textwrap", "string", "shlex", "fractions",
                  "heapq", "bisect", "queue", "dataclasses", "functools", "pprint", "enum", "argparse",
                  "statistics", "csv", "calendar", "difflib", "fnmatch", "glob", "gettext", "graphlib",
                  "ipaddress", "numbers", "operator", "colorsys", "contextlib", "copy", "configparser"]


def write_corpus(folder: Path) -> Path:
    """30 real stdlib modules under fixed names (so the held-out split is the same everywhere)."""
    import importlib

    folder.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(CORPUS_MODULES):
        (folder / f"mod_{i:02d}.py").write_text(inspect.getsource(importlib.import_module(name)))
    return folder


def run(*args: str) -> int:
    return train_main([str(a) for a in args])


def losses(checkpoint_dir: Path) -> dict[int, float]:
    """step -> training loss from a run's log."""
    out = {}
    for line in (checkpoint_dir / "log.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            out[record["step"]] = record["loss"]
    return out


def evals(checkpoint_dir: Path) -> list[dict]:
    return [json.loads(l)["eval"] for l in (checkpoint_dir / "log.jsonl").read_text().splitlines() if '"eval"' in l]
