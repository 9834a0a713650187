"""Command-line flag values, checked while argparse parses them.

A bad value (or an unknown flag, or a missing one) becomes one `DDTreeError` line, which the CLI
prints as `ddtree: error: ...` with exit code 2, before any model, server or dataset is loaded.
Nothing here imports torch unless a flag asks for CUDA, which only torch can check.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable

from ddtree.config import DDTreeError

DEVICES = ("cpu", "cuda")


class OneLineErrorParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors raise DDTreeError instead of printing the usage block and
    exiting, so every mistake on the command line reads like every other ddtree error: one line.
    Subcommand parsers made with `add_subparsers().add_parser` inherit the class."""

    def error(self, message: str):
        raise DDTreeError(f"{message} (see '{self.prog} --help')")


def parse_device(name: object) -> str:
    """'cpu', 'cuda' or 'cuda:N' (N an existing GPU); anything else is a DDTreeError.

    torch.device accepts many names ddtree cannot run on (mps, xpu, meta, ...) and upper case
    fails deep inside torch, so the name is checked here first."""
    text = name.strip() if isinstance(name, str) else ""
    kind, _, index = text.partition(":")
    if kind not in DEVICES or (kind == "cpu" and index) or (index and not index.isdigit()):
        raise DDTreeError(f"device must be cpu, cuda or cuda:N, got {name!r}", "device")
    if kind == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise DDTreeError("device 'cuda' was asked for but no CUDA GPU is available", "device")
        if index and int(index) >= torch.cuda.device_count():
            raise DDTreeError(f"device {text!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s)", "device")
    return text


def _flag_type(check: Callable[[str], object], name: str) -> Callable[[str], object]:
    """An argparse `type=` from a checker that raises DDTreeError; argparse names the flag."""
    def convert(text: str) -> object:
        try:
            return check(text)
        except DDTreeError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = name
    return convert


def _integer(text: str, what: str) -> int:
    try:
        return int(text)
    except (TypeError, ValueError):
        raise DDTreeError(f"{what}, got {text!r}") from None


def _number(text: str, what: str) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise DDTreeError(f"{what}, got {text!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise DDTreeError(f"{what}, got {text!r}")
    return value


def int_at_least(low: int) -> Callable[[str], int]:
    """An integer flag >= `low`."""
    what = f"must be an integer >= {low}"

    def check(text: str) -> int:
        value = _integer(text, what)
        if value < low:
            raise DDTreeError(f"{what}, got {value}")
        return value

    return _flag_type(check, f"integer >= {low}")


def positive_number(text: str) -> float:
    what = "must be a number > 0"
    value = _number(text, what)
    if value <= 0:
        raise DDTreeError(f"{what}, got {text!r}")
    return value


def port_number(text: str) -> int:
    what = "port must be an integer in 1..65535"
    value = _integer(text, what)
    if not 1 <= value <= 65535:
        raise DDTreeError(f"{what}, got {value}")
    return value


def top_k_value(text: str) -> int:
    """top-k as the OpenAI-style APIs take it: 0 or -1 switch it off (stored as 0)."""
    what = "top-k must be an integer >= 1, or 0 or -1 to switch it off"
    value = _integer(text, what)
    if value < -1:
        raise DDTreeError(f"{what}, got {value}")
    return max(value, 0)


def token_counts(text: str) -> list[int]:
    """A comma-separated list of token counts, each >= 1 (`ddtree tune --contexts`)."""
    what = "expected comma-separated token counts (integers >= 1)"
    values = [_integer(part.strip(), what) for part in text.split(",") if part.strip()]
    if not values or min(values) < 1:
        raise DDTreeError(f"{what}, got {text!r}")
    return values


def rope_scaling_json(text: str) -> dict:
    """A JSON object of rope settings with a rope type (`--rope-scaling`, as vLLM's flag), e.g.
    '{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}'; what it
    holds is checked with the target's config (`configs.RopeConfig`)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DDTreeError(f"expected a JSON object of rope settings, got {text!r} ({exc.msg})") from None
    if not isinstance(value, dict) or not isinstance(value.get("rope_type", value.get("type")), str):
        raise DDTreeError(f"expected a JSON object with a \"rope_type\", got {text!r}")
    return value


def model_directory(text: str) -> Path:
    """A model folder that exists (what is inside is checked when it loads)."""
    path = Path(text).expanduser()
    if not path.is_dir():
        raise DDTreeError(f"{text}: not a directory" if path.exists() else f"{text}: no such directory")
    return path


DEVICE = _flag_type(parse_device, "device")
PORT = _flag_type(port_number, "port")
POSITIVE_NUMBER = _flag_type(positive_number, "positive number")
TOP_K = _flag_type(top_k_value, "top-k")
TOKEN_COUNTS = _flag_type(token_counts, "token counts")
MODEL_DIRECTORY = _flag_type(model_directory, "model directory")
ROPE_SCALING = _flag_type(rope_scaling_json, "rope scaling")
