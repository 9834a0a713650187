"""`ddtree bench --offline`: a sweep on the in-process engine, its JSON, PNG, table and bad input."""
from __future__ import annotations

import json
import socket

import pytest

from ddtree.bench.table import COMPACT_WIDTH
from ddtree.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
VLLM_KEYS = ["request_throughput", "output_throughput", "total_token_throughput", "completed", "duration",
             "total_input_tokens", "total_output_tokens"] + [
    f"{stat}_{metric}_ms" for metric in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "std", "p99")]
OUR_KEYS = ["tree_budget", "concurrency", "speedup_vs_ar", "mean_acceptance_length", "decode_rounds", "parity_vs_ar",
            "parity_ok", "median_tokens_per_second"]


def _model_flags(pair):
    target, draft = pair
    return ["--target", str(target), "--draft", str(draft), "--device", "cpu"]


def test_offline_sweep_writes_json_png_and_table(demo_pair, tmp_path, capsys):
    out, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    code = main(["bench", "--offline", *_model_flags(demo_pair), "--tree-budgets", "ar,chain,4,16",
                 "--num-prompts", "8", "--max-tokens", "16", "--output", str(out), "--plot", str(plot),
                 "--no-progress"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "tok/s med" in printed and "recommended tree budget at concurrency 1:" in printed
    table = [line for line in printed.splitlines() if not line.startswith(("recommended", "results", "plot"))]
    assert len(table) == 2 + 4 and max(len(line) for line in table) <= COMPACT_WIDTH
    result = json.loads(out.read_text())
    assert result["interrupted"] is False and result["skipped"] == []
    assert set(result["warmup_seconds"]) == {"ar", "chain", "4", "16"} and result["predicted_seconds"] > 0
    assert plot.read_bytes().startswith(PNG_MAGIC)
    assert socket.gethostname() not in out.read_text()
    assert result["command"].startswith("ddtree bench") and "--offline" in result["command"]
    assert {"device", "torch", "python"} <= result["machine"].keys()
    assert "git_revision" in result
    rows = result["results"]
    assert [r["tree_budget"] for r in rows] == ["ar", "chain", 4, 16]
    for row in rows:
        assert set(VLLM_KEYS + OUR_KEYS) <= row.keys()
        assert row["completed"] == 8 and row["failed"] == 0
        assert row["total_output_tokens"] > 0 and row["median_tokens_per_second"] > 0
        assert row["acceptance_source"] == "responses" and row["mean_acceptance_length"] >= 1.0
        assert row["parity_vs_ar"] == 1.0 and row["parity_ok"] is True
    assert rows[0]["speedup_vs_ar"] == 1.0 and rows[0]["mean_acceptance_length"] == 1.0
    # every round after the prefill commits its acceptance length, so rounds x length covers the output
    for row in rows:
        assert row["decode_rounds"] * row["mean_acceptance_length"] >= row["total_output_tokens"] / 8 - 1 - 1e-9
    assert result["parity_ok"] is True and result["warnings"] == []
    best = max(rows, key=lambda r: r["median_tokens_per_second"])
    assert result["recommendation"]["tree_budget"] == best["tree_budget"]
    assert result["recommendation"]["margin_over_ar"] == pytest.approx(
        best["median_tokens_per_second"] / rows[0]["median_tokens_per_second"])


def test_offline_concurrency_levels_and_chat_prompts(demo_pair, tmp_path):
    data = tmp_path / "mixed.jsonl"
    data.write_text(json.dumps({"prompt": "def add(a, b):\n    return"}) + "\n"
                    + json.dumps({"messages": [{"role": "user", "content": "Write a sort."}]}) + "\n"
                    + json.dumps({"prompt": "import os\n\ndef walk(path):"}) + "\n")
    out = tmp_path / "c.json"
    assert main(["bench", "--offline", *_model_flags(demo_pair), "--tree-budgets", "ar,8", "--dataset", str(data),
                 "--num-prompts", "3", "--max-tokens", "8", "--concurrency", "1,3", "--warmup", "0",
                 "--output", str(out), "--no-progress"]) == 0
    result = json.loads(out.read_text())
    assert [(r["tree_budget"], r["concurrency"]) for r in result["results"]] == [("ar", 1), (8, 1), ("ar", 3), (8, 3)]
    assert all(r["completed"] == 3 and r["parity_ok"] for r in result["results"])
    assert [p["concurrency"] for p in result["recommendations"]] == [1, 3]
    assert result["settings"]["concurrency"] == [1, 3]


@pytest.mark.parametrize("args, message", [
    (["--offline", "--tree-budgets", "ar,lots"], "tree budget must be"),
    (["--offline", "--concurrency", "0"], "--concurrency takes integers >= 1"),
    (["--offline", "--num-prompts", "0"], "--num-prompts must be"),
    (["--offline", "--warmup", "-1"], "--warmup must be >= 0"),
    (["--offline", "--temperature", "-1"], "temperature must be >= 0"),
    (["--offline", "--dataset", "nowhere.jsonl"], "neither a file nor one of the built-in sets"),
    (["--base-url", "http://127.0.0.1:9", "--target", "."], "--target only apply with --offline"),
    (["--base-url", "ftp://127.0.0.1:9"], "must start with http"),
    (["--offline", "--model", "m"], "--model only applies with --base-url"),
])
def test_bad_input_is_one_clear_error(args, message, tmp_path, capsys):
    out = tmp_path / "never.json"
    assert main(["bench", *args, "--output", str(out), "--no-progress"]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_missing_output_folder_and_unreachable_server(tmp_path, capsys):
    assert main(["bench", "--offline", "--output", str(tmp_path / "no" / "such.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once the socket closes
    assert main(["bench", "--base-url", f"http://127.0.0.1:{port}", "--no-progress"]) == 2
    assert "cannot reach" in capsys.readouterr().err


def test_requests_that_cannot_fit_fail_before_any_run(demo_pair, tmp_path, capsys):
    out = tmp_path / "never.json"
    assert main(["bench", "--offline", *_model_flags(demo_pair), "--max-tokens", "100000", "--num-prompts", "2",
                 "--tree-budgets", "ar", "--output", str(out), "--no-progress"]) == 2
    assert "exceeds the context limit" in capsys.readouterr().err
    assert not out.exists()
