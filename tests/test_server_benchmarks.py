"""benchmarks/server_first_token.py at a tiny scale on the CPU: its marks still sit on the request's
path (a refactor that moves them fails here), every stage is reached by every request, in order,
and before the client's first token."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from server_process import free_port, quiet_env

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("engine_process", [False, True])
def test_server_first_token_reaches_every_stage_in_order(tmp_path, engine_process):
    """Every request passes every stage, in order, before the client sees its first token; the
    benchmark's small body is tokenized on the loop (no prepare_* stages), and with the engine in
    its own process the marks made there join their requests'."""
    from benchmarks.server_first_token import PROCESS_STAGES, STAGES

    out = tmp_path / "first_token.json"
    cmd = [sys.executable, "-m", "benchmarks.server_first_token", str(out), "--requests", "4", "--warmup", "1",
           "--port", str(free_port()), *(["--engine-process"] if engine_process else [])]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=quiet_env())
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["requests_with_every_stage"] == 4
    expected = [s for s in (PROCESS_STAGES if engine_process else STAGES) if not s.startswith("prepare_")]
    assert list(result["stages_ms"]) == expected
    times = list(result["stages_ms"].values())
    assert times == sorted(times) and 0 < times[0]
    assert times[-1] < result["client_ttft_ms"]
    ends = result["end_stages_ms"]
    assert list(ends) == (["emit_last", "pipe_back_last", "last_sent"] if engine_process else ["emit_last", "last_sent"])
    assert times[-1] < ends["last_sent"] < result["client_e2e_ms"] and ends["emit_last"] < ends["last_sent"]


def test_server_first_token_with_the_real_engine(tmp_path):
    """--real: the demo pair's own engine in its process, every stage marked there too, and the same
    prompt's first token and end in process beside the client's."""
    out = tmp_path / "first_token_real.json"
    cmd = [sys.executable, "-m", "benchmarks.server_first_token", str(out), "--real", "--engine-process", "--requests",
           "3", "--warmup", "1", "--max-tokens", "6", "--tree-budget", "16", "--port", str(free_port())]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=quiet_env())
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["real"] and result["requests_with_every_stage"] == 3 and result["client_tokens"] == 6
    stages = result["stages_ms"]
    assert stages["engine_start"] < stages["emit"] < stages["first_content"] < result["client_ttft_ms"]
    assert 0 < result["in_process_ttft_ms"] < result["in_process_e2e_ms"]
    assert result["end_stages_ms"]["last_sent"] < result["client_e2e_ms"]


def test_server_overhead_batched_replay_streams_every_request_whole(tmp_path):
    """The batched server on a replaying batch: every request of several streamed at once gets all
    its tokens, a row's rounds giving `--accept` tokens each, and both rates are measured."""
    out = tmp_path / "overhead.json"
    cmd = [sys.executable, "-m", "benchmarks.server_overhead", str(out), "--engine-us", "100", "--max-num-seqs", "4",
           "--concurrency", "4", "--accept", "3", "--requests", "8", "--warmup", "1", "--max-tokens", "16",
           "--port", str(free_port())]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=quiet_env())
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["concurrency"] == 4 and result["tokens_per_request"] == 16
    assert result["aggregate_tokens_per_s"] > 0 and result["in_process_tokens_per_s"] > 0
    assert result["http_over_in_process"] == result["aggregate_tokens_per_s"] / result["in_process_tokens_per_s"]


def test_http_against_in_process_reports_each_mode_and_budget(tmp_path):
    """benchmarks/http_against_in_process.py at a tiny scale: the in-process bench, then a server
    per mode benched over HTTP, every request complete both ways, and the ratio of the two."""
    out = tmp_path / "http.json"
    cmd = [sys.executable, "-m", "benchmarks.http_against_in_process", str(out), "--tree-budgets", "ar,16",
           "--num-prompts", "2", "--max-tokens", "6", "--modes", "process,thread", "--device", "cpu",
           "--max-model-len", "1024", "--port", str(free_port())]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=quiet_env())
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert set(result["modes"]) == {"process", "thread"} and result["serve_max_num_seqs"] is None
    for mode in result["modes"].values():
        assert set(mode["budgets"]) == {"ar", "16"}
        for row in mode["budgets"].values():
            assert row["completed"] == {"http": 2, "in_process": 2}
            assert row["http_over_in_process"] > 0
    assert (tmp_path / "http_offline.json").exists() and (tmp_path / "http_process.json").exists()


def test_random_checkpoint_loads_and_decodes(tmp_path):
    """benchmarks/random_checkpoint.py at a tiny body: ddtree loads what it writes (the shape's
    head layout, the demo tokenizer) and decodes text from it without a drafter."""
    from benchmarks.random_checkpoint import write

    from ddtree.config import SamplingParams
    from ddtree.llm import LLM

    info = write(tmp_path / "t", "qwen3-8b", 8192, "cpu",
                 {"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512})
    assert info["parameters"] > 0
    llm = LLM(tmp_path / "t", device="cpu", max_model_len=128)
    assert (llm.target.config.num_attention_heads, llm.target.config.head_dim, llm.vocab_size) == (32, 128, 8192)
    assert llm.drafter is None
    result = llm.generate("def f(x):", SamplingParams(max_tokens=6, ignore_eos=True))
    assert len(result.token_ids) == 6 and isinstance(result.text, str)


def test_agreeing_random_pair_accepts_every_drafted_token(tmp_path):
    """benchmarks/random_checkpoint.py --agreeing-draft at a tiny body: the pair predicts one token
    everywhere, so each round of a chain or a tree accepts the whole block."""
    from benchmarks.random_checkpoint import AGREED_TOKEN, write, write_agreeing_draft

    from ddtree.config import SamplingParams
    from ddtree.llm import LLM

    write(tmp_path / "t", "qwen3-8b", 8192, "cpu", {"num_hidden_layers": 6, "hidden_size": 256,
                                                    "intermediate_size": 512}, agreeing=True)
    write_agreeing_draft(tmp_path / "d", tmp_path / "t", 2, "cpu")
    llm = LLM(tmp_path / "t", tmp_path / "d", device="cpu", max_model_len=256)
    block = llm.drafter.config.block_size
    for budget in ("chain", 16):
        result = llm.generate("def f(x):", SamplingParams(max_tokens=3 * block, ignore_eos=True), budget)
        assert result.token_ids == [AGREED_TOKEN] * (3 * block), budget
        lengths = result.stats.acceptance_lengths
        assert lengths[:2] == [block, block], (budget, lengths)
    assert llm.generate("def f(x):", SamplingParams(max_tokens=8, ignore_eos=True), "ar").token_ids == [AGREED_TOKEN] * 8


def test_bench_client_capacity_against_the_stand_in(tmp_path):
    """benchmarks/bench_client_capacity.py, small: `ddtree bench` completes every request against
    the stand-in server at both prompt counts, and the client's CPU per chunk comes out."""
    out = tmp_path / "capacity.json"
    subprocess.run([sys.executable, "-m", "benchmarks.bench_client_capacity", str(out), "--prompts", "4,12",
                    "--chunks", "3", "--concurrency", "2", "--port", str(free_port())], check=True, timeout=300,
                   capture_output=True, cwd=ROOT, env=quiet_env())
    result = json.loads(out.read_text())
    assert [(r["prompts"], r["completed"]) for r in result["runs"]] == [(4, 4), (12, 12)]
    assert all(r["output_tokens_per_s"] > 0 and r["client_cpu_s"] > 0 for r in result["runs"])
    assert result["client_cpu_us_per_chunk"] == pytest.approx(
        (result["runs"][1]["client_cpu_s"] - result["runs"][0]["client_cpu_s"]) / (8 * 4) * 1e6)


def test_budget_choice_cost_times_the_choice_it_makes(tmp_path):
    """benchmarks/budget_choice_cost.py, few calls: every row gets a budget of the table's, one
    bucket's rows all the same one, and each timing comes out positive."""
    out = tmp_path / "choice.json"
    subprocess.run([sys.executable, "-m", "benchmarks.budget_choice_cost", str(out), "--rows", "6", "--calls", "20"],
                   check=True, timeout=120, capture_output=True, cwd=ROOT, env=quiet_env())
    result = json.loads(out.read_text())
    assert len(result["chosen_one_bucket"]) == len(result["chosen_two_buckets"]) == 6
    assert len(set(result["chosen_one_bucket"])) == 1 and set(result["chosen_two_buckets"]) <= {"ar", "16", "64"}
    assert min(result[k] for k in ("choose_one_bucket_us", "choose_two_buckets_us", "table_seconds_us")) > 0


def test_pipe_events_times_a_round_that_round_trips(tmp_path):
    """benchmarks/pipe_events.py, few calls: the round's message comes back equal (checked inside)
    and both timings come out positive."""
    out = tmp_path / "pipe.json"
    subprocess.run([sys.executable, "-m", "benchmarks.pipe_events", str(out), "--rows", "3", "--calls", "20"],
                   check=True, timeout=120, capture_output=True, cwd=ROOT, env=quiet_env())
    result = json.loads(out.read_text())
    assert result["rows"] == 3 and result["bytes"] > 0
    assert result["pickle_us"] > 0 and result["unpickle_us"] > 0


def test_startup_time_times_the_servers_own_load_step(tmp_path):
    """benchmarks/startup_time.py on the demo pair: each mode runs serve's load step with serve's
    flags (the batch mode measures its round costs, which its log says), and a tune file beside
    the drafter is refused rather than timed."""
    import shutil

    out = tmp_path / "startup.json"
    draft = tmp_path / "drafter"
    shutil.copytree(ROOT / "models" / "demo-drafter", draft)
    cmd = [sys.executable, "-m", "benchmarks.startup_time", str(out), "--target", str(ROOT / "models" / "demo-target"),
           "--draft", str(draft), "--device", "cpu", "--dtype", "float32", "--max-model-len", "512",
           "--modes", "fixed,batch", "--max-num-seqs", "2"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=quiet_env())
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {row["mode"]: row for row in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["fixed", "batch"]
    assert rows["fixed"]["budget_mode"] == "fixed" and rows["fixed"]["default_budget"] == "16"
    assert rows["batch"]["budget_mode"] == "adaptive" and rows["batch"]["flags"] == ["--max-num-seqs", "2"]
    assert any("measured round costs for 1..2 rows" in line for line in rows["batch"]["log"])
    assert all(row["seconds"] > 0 for row in rows.values())

    (draft / "ddtree_tune.json").write_text("{}")
    refused = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=quiet_env())
    assert refused.returncode == 2 and "without a tune file" in refused.stderr
