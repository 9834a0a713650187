"""Ctrl-C during `ddtree bench` keeps what was measured: the rows already printed, the partial
results file (marked interrupted) and the recommendation among the measured budgets; exit 130."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

from server_process import quiet_env


def test_sigint_leaves_the_partial_json_and_the_table(demo_pair, tmp_path):
    out = tmp_path / "partial.json"
    target, draft = demo_pair
    # Long requests (--ignore-eos, 400 tokens), so that the signal lands inside the second budget's run.
    cmd = [sys.executable, "-m", "ddtree.cli", "bench", "--offline", "--target", str(target), "--draft", str(draft),
           "--device", "cpu", "--tree-budgets", "ar,chain,4", "--num-prompts", "2", "--max-tokens", "400",
           "--ignore-eos", "--warmup", "0", "--output", str(out), "--no-progress"]
    # SIGINT at its default in the child: a suite started as a background job (`cmd &` from a script)
    # inherits it ignored, and a Python started so never turns it into KeyboardInterrupt.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=quiet_env(),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    printed = []
    for line in proc.stdout:  # each row is flushed as its run ends
        printed.append(line)
        if line.startswith("ar "):
            break
    assert not out.exists(), "the results file is written at the end"
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=120)
    stopped_after = time.monotonic() - sent
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    result = json.loads(out.read_text())
    assert result["interrupted"] is True
    assert [r["tree_budget"] for r in result["results"]] == ["ar"], "the run in progress (chain) is left out"
    assert result["results"][0]["completed"] == 2 and result["recommendation"]["tree_budget"] == "ar"
    assert "recommended tree budget at concurrency 1: ar" in rest
    assert "interrupted: 1 of 3 runs measured" in rest
    assert stopped_after < 30, "the request in flight stops after its current round"
