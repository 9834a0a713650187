"""`ddtree` command line: generate | serve | bench | tune | train-target | train-drafter.

Each subcommand lives with its concern (`ddtree.generate_cli`, `ddtree.server.main`, `ddtree.bench.cli`,
`ddtree.train.cli`) and shares its flags and error handling through `ddtree.cli_args`; this file only
wires them up.
"""
from __future__ import annotations

import argparse
import sys

from ddtree.cli_args import run
from ddtree.flags import OneLineErrorParser


def build_parser() -> argparse.ArgumentParser:
    from ddtree.version import package_version

    parser = OneLineErrorParser(prog="ddtree", description="DDTree speculative decoding")
    parser.add_argument("--version", action="version", version=f"ddtree {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    # Each registers its subcommands; none imports its heavy dependencies until it runs.
    from ddtree import generate_cli
    from ddtree.bench import cli as bench_cli
    from ddtree.server import main as server_main
    from ddtree.train import cli as train_cli

    for module in (generate_cli, server_main, bench_cli, train_cli):
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
