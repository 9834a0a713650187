"""What every `ddtree` command line shares: the model flags, and `run`, which parses and runs a
subcommand and turns a `DDTreeError` into one line on stderr and exit code 2.

The commands (`ddtree.generate_cli`, `ddtree.server.main`, `ddtree.bench.cli`, `ddtree.train.cli`)
import this module; `ddtree.cli` only wires them up.
"""
from __future__ import annotations

import argparse
import shlex
import sys

from ddtree.config import DDTreeError
from ddtree.flags import DEVICE, MODEL_DIRECTORY, ROPE_SCALING, int_at_least


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """--target / --draft / --device / --dtype / --max-model-len / --rope-scaling, shared by every
    model-loading command."""
    parser.add_argument("--target", default=None, type=MODEL_DIRECTORY,
                        help="target model directory (Hugging Face format; default: the demo target)")
    parser.add_argument("--draft", default=None, type=MODEL_DIRECTORY,
                        help="DFlash drafter directory (z-lab format; default: the demo drafter with the demo "
                             "target, none with any other target, which then decodes with tree budget ar)")
    parser.add_argument("--device", default=None, type=DEVICE,
                        help="cpu, cuda or cuda:N (default: cuda when available)")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="weights and activations (default: bfloat16 on cuda, float32 on cpu)")
    parser.add_argument("--max-model-len", type=int_at_least(2), default=None,
                        help="context limit in tokens (default: the target's)")
    parser.add_argument("--rope-scaling", type=ROPE_SCALING, default=None, metavar="JSON",
                        help="the target's rope scaling, over its config.json's, e.g. '{\"rope_type\": \"yarn\", "
                             "\"factor\": 4.0, \"original_max_position_embeddings\": 32768}' (Qwen3 to 131072 "
                             "tokens); the context limit grows with it")


def run(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    """Parse and run a subcommand; a DDTreeError, on the command line or later, becomes one line on
    stderr and exit code 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(argv)
        args.command_line = "ddtree " + shlex.join(argv)  # the exact command, for reports and model cards
        return args.func(args)
    except DDTreeError as exc:
        print(f"ddtree: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
