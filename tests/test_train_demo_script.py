"""scripts/train_demo.sh end to end at smoke size on CPU (tiny corpus): both models, the acceptance
report and the two model cards, filled in from the run; and the CLI wiring of the train commands."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from train_helpers import write_corpus

REPO = Path(__file__).resolve().parent.parent


def checkout_with_readme_venv(root: Path, venv_python: str | None) -> tuple[Path, dict]:
    """A checkout as the README leaves it: the script, the package, and `./.venv/bin/python` (from
    `bash scripts/install.sh`; here a wrapper around this test's python). The system `python3` on
    PATH has none of ddtree's dependencies, so the script must not fall back to it."""
    (root / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "train_demo.sh", root / "scripts")
    (root / "ddtree").symlink_to(REPO / "ddtree")
    if venv_python is not None:
        (root / ".venv" / "bin").mkdir(parents=True)
        wrapper = root / ".venv" / "bin" / "python"
        wrapper.write_text(f'#!/bin/sh\nexec {shlex.quote(venv_python)} "$@"\n')
        wrapper.chmod(0o755)
    stub = root / "system-bin" / "python3"
    stub.parent.mkdir()
    stub.write_text("#!/bin/sh\necho 'ModuleNotFoundError: No module named torch' >&2\nexit 1\n")
    stub.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = f"{stub.parent}:{env['PATH']}"
    return root, env


def test_demo_script_smoke_run_in_the_readme_venv(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    checkout, env = checkout_with_readme_venv(tmp_path / "checkout", sys.executable)
    env.update({"DDTREE_DEMO_SMOKE": "1", "CORPUS": str(corpus), "HELD_OUT": "0.2", "ROOT": str(tmp_path / "run"),
                "OMP_NUM_THREADS": "1"})
    done = subprocess.run(["bash", str(checkout / "scripts" / "train_demo.sh")], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "run"
    report = json.loads((run / "demo-acceptance.json").read_text())
    assert report["lossless"] and set(report["results"]) == {"ar", "chain", "64"}
    assert report["results"]["ar"]["mean_acceptance_length"] == 1.0
    assert report["results"]["chain"]["rounds"] > 0 and len(report["samples"]) == 2
    target_card = (run / "demo-target" / "README.md").read_text()
    drafter_card = (run / "demo-drafter" / "README.md").read_text()
    target_summary = json.loads((run / "demo-target" / "training.json").read_text())
    for card in (target_card, drafter_card):
        assert "DDTREE_DEMO_SMOKE='1' scripts/train_demo.sh" in card
        assert f"{report['results']['chain']['mean_acceptance_length']:.2f}" in card
        assert report["samples"][0]["completion"] in card and "n/a" not in card
    assert target_summary["command"] in target_card and f"{target_summary['held_out_loss']:.4f}" in target_card
    assert "ddtree train-drafter --target" in drafter_card


def test_demo_script_without_an_installed_python_says_so_in_one_line(tmp_path):
    checkout, env = checkout_with_readme_venv(tmp_path / "checkout", None)
    done = subprocess.run(["bash", str(checkout / "scripts" / "train_demo.sh")], env={**env, "DDTREE_DEMO_SMOKE": "1"},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.splitlines()) == 1 and "bash scripts/install.sh" in done.stderr


def test_train_commands_are_registered_in_the_ddtree_cli():
    from ddtree.cli import build_parser

    args = build_parser().parse_args(["train-target", "--out", "x"])
    assert args.vocab_size == 8192 and args.func.__name__ == "cmd_train_target"
    args = build_parser().parse_args(["train-drafter", "--target", "t", "--out", "d"])
    assert args.block_size == 16 and args.layers == 2 and args.func.__name__ == "cmd_train_drafter"
