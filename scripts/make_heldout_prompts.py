"""Write ddtree/data/stdlib_heldout.jsonl: function openings from held-out Python stdlib files.

A prompt is a public function's source from its `def` line through its docstring (a method's
prompt starts with its class header), the way HumanEval prompts end where the body begins. Files
are chosen by `ddtree.bench.datasets.is_heldout_stdlib_path`: the files that `ddtree train-target`
and `train-drafter` hold out by a hash of the relative path, so the demo pair never trained on
them. The output depends only on the stdlib of the Python that runs this.

    python scripts/make_heldout_prompts.py [--output ddtree/data/stdlib_heldout.jsonl]
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
import sysconfig
from pathlib import Path

from ddtree.bench.datasets import STDLIB_HELDOUT_FILE, is_heldout_stdlib_path

SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}  # as ddtree.train.corpus
MAX_CHARS = 1500
MIN_CHARS = 80
PER_FILE = 16
METHODS_PER_CLASS = 4

REPO = Path(__file__).resolve().parent.parent


def stdlib_files(root: Path) -> list[str]:
    """Relative paths ("a/b.py") of the stdlib's Python files, sorted, installed packages left out."""
    found = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in SKIP_DIRS for part in rel.parts[:-1]):
            continue
        found.append(rel.as_posix())
    return sorted(found)


def _docstring_end(node: ast.AST) -> int | None:
    """Last line of the function's docstring, or None when it has none."""
    first = node.body[0] if node.body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return first.end_lineno
    return None


def function_openings(source: str) -> list[tuple[str, str]]:
    """(name, opening text) for each public function or method with a docstring, in file order.

    A method's opening starts with its class's header line(s), so the prompt is valid-looking code.
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    out = []

    def add(name: str, node: ast.AST, header: str = "") -> None:
        end = _docstring_end(node)
        if end is None:
            return
        text = header + "\n".join(lines[node.lineno - 1 : end]) + "\n"
        if MIN_CHARS <= len(text) <= MAX_CHARS:
            out.append((name, text))

    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            add(node.name, node)
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_") and node.body:
            header = "\n".join(lines[node.lineno - 1 : node.body[0].lineno - 1]).rstrip() + "\n"
            if not header.rstrip().endswith(":"):
                continue  # a header with comments or odd layout: skip the class
            methods = [m for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))
                       and not m.name.startswith("_") and not m.decorator_list]
            for m in methods[:METHODS_PER_CLASS]:
                add(f"{node.name}.{m.name}", m, header)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=REPO / "ddtree" / "data" / STDLIB_HELDOUT_FILE)
    args = parser.parse_args()
    root = Path(sysconfig.get_paths()["stdlib"])
    records = []
    for rel in stdlib_files(root):
        if not is_heldout_stdlib_path(rel):
            continue
        source = (root / rel).read_text(encoding="utf-8", errors="replace")
        for name, text in function_openings(source)[:PER_FILE]:
            records.append({"id": f"{rel}:{name}", "prompt": text})
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with args.output.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    version = ".".join(map(str, sys.version_info[:3]))
    print(f"wrote {len(records)} prompts from the Python {version} stdlib to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
