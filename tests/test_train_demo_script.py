"""scripts/train_demo.sh end to end at smoke size on CPU (tiny corpus): both models, the acceptance
report and the two model cards, filled in from the run; and the CLI wiring of the train commands."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from train_helpers import write_corpus

REPO = Path(__file__).resolve().parent.parent


def test_demo_script_smoke_run(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    env = {**os.environ, "DDTREE_DEMO_SMOKE": "1", "CORPUS": str(corpus), "HELD_OUT": "0.2",
           "ROOT": str(tmp_path / "run"), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["bash", str(REPO / "scripts" / "train_demo.sh")], env=env, capture_output=True, text=True,
                          timeout=900)
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


def test_train_commands_are_registered_in_the_ddtree_cli():
    from ddtree.cli import build_parser

    args = build_parser().parse_args(["train-target", "--out", "x"])
    assert args.vocab_size == 8192 and args.func.__name__ == "cmd_train_target"
    args = build_parser().parse_args(["train-drafter", "--target", "t", "--out", "d"])
    assert args.block_size == 16 and args.layers == 2 and args.func.__name__ == "cmd_train_drafter"
