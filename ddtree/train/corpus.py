"""The training corpus: `.py` files under one or more folders (default: the running Python's
standard library), split into train and held-out files by a hash of each file's relative path.

The split depends only on the path, so it is the same on every machine with the same standard
library, and the held-out files never reach the tokenizer, the target or the drafter.
"""
from __future__ import annotations

import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from ddtree.config import DDTreeError
from ddtree.heldout import DEFAULT_HELD_OUT_FRACTION, is_held_out  # noqa: F401  (the split; re-exported for callers)

MAX_FILE_BYTES = 1_000_000  # skip generated giants; none of the standard library's code is near this


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@dataclass
class Corpus:
    roots: list[Path]
    train_files: list[Path]
    held_out_files: list[Path]
    held_out_fraction: float

    def describe(self) -> str:
        stdlib = stdlib_root()
        names = ", ".join(f"the Python {sys.version_info.major}.{sys.version_info.minor} standard library ({r})"
                          if r == stdlib else str(r) for r in self.roots)
        return f"{len(self.train_files)} train + {len(self.held_out_files)} held-out .py files of {names}"


def load_corpus(roots: list[str | Path] | None = None, held_out_fraction: float = DEFAULT_HELD_OUT_FRACTION) -> Corpus:
    """Find the `.py` files (site-packages excluded) under `roots`, or under the standard library."""
    if not 0.0 < held_out_fraction < 1.0:
        raise DDTreeError(f"held-out fraction must be in (0, 1), got {held_out_fraction}", "held_out_fraction")
    dirs = [Path(r) for r in roots] if roots else [stdlib_root()]
    train, held_out = [], []
    for root in dirs:
        if not root.is_dir():
            raise DDTreeError(f"corpus folder {root} does not exist or is not a folder", "corpus")
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root)
            if "site-packages" in rel.parts or not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
                continue
            (held_out if is_held_out(rel.as_posix(), held_out_fraction) else train).append(path)
    if not train:
        raise DDTreeError(f"corpus {', '.join(map(str, dirs))} has no .py files to train on", "corpus")
    if not held_out:
        raise DDTreeError(
            f"corpus {', '.join(map(str, dirs))} has {len(train)} .py files but none falls in the held-out "
            f"fraction {held_out_fraction}: add files or raise --held-out-fraction", "corpus")
    return Corpus(dirs, train, held_out, held_out_fraction)


def read_texts(files: list[Path]) -> list[str]:
    """File contents as text; files that are not UTF-8 are skipped."""
    texts = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip():
            texts.append(text)
    return texts
