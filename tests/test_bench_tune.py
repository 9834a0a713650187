"""`ddtree tune` and `resolve_auto_budget` (behind `ddtree serve --tree-budget auto`)."""
from __future__ import annotations

import json
import shutil
import time

import pytest

from ddtree.bench.report import RequestOutput
from ddtree.bench.runner import OfflineBackend
from ddtree.bench.tune import (
    CALIBRATION_WARMUP_TOKENS,
    CALIBRATION_BUDGETS,
    TUNE_FILE,
    calibrate,
    pick_for_concurrency,
    _calibration_prompts,
    read_tune_file,
    resolve_auto_budget,
    resolve_context_budgets,
    write_tune_file,
)
from ddtree.cli import main
from ddtree.config import DDTreeError
from ddtree.flags import token_counts
from ddtree.llm import LLM
from ddtree.tree_shape import AR, CHAIN, TreeShape


@pytest.fixture(scope="module")
def drafter_copy(demo_pair, tmp_path_factory):
    """A private copy of the drafter, so the tune file lands beside it and nowhere shared."""
    copy = tmp_path_factory.mktemp("tune") / "drafter"
    shutil.copytree(demo_pair[1], copy, ignore=shutil.ignore_patterns(TUNE_FILE))
    return copy


@pytest.fixture(scope="module")
def llm(demo_pair, drafter_copy):
    return LLM(demo_pair[0], drafter_copy, device="cpu")


@pytest.fixture(scope="module")
def tuned(demo_pair, drafter_copy):
    """Run `ddtree tune` once with its default output (beside the drafter)."""
    code = main(["tune", "--target", str(demo_pair[0]), "--draft", str(drafter_copy), "--device", "cpu",
                 "--tree-budgets", "ar,chain,8", "--num-prompts", "3", "--max-tokens", "8", "--concurrency", "1,2",
                 "--sampled-seconds", "2", "--contexts", "1024", "--context-seconds", "6", "--no-progress"])
    assert code == 0
    return drafter_copy / TUNE_FILE


def test_tune_writes_recommendations_beside_the_drafter(tuned):
    record = read_tune_file(tuned)
    assert [p["concurrency"] for p in record["recommendations"]] == [1, 2]
    for pick in record["recommendations"]:
        measured = record["median_tokens_per_second"][str(pick["concurrency"])]
        assert set(measured) == {"ar", "chain", "8"}
        assert measured[str(pick["tree_budget"])] == max(measured.values())
    assert record["device"].startswith("cpu") and record["dtype"] == "float32"
    assert len(record["target_fingerprint"]) == 16 and record["target_fingerprint"] != record["draft_fingerprint"]


def test_tune_measures_every_temperature_bucket(tuned):
    """Greedy from the sweep, each sampled bucket from a calibration at its temperature; each bucket's
    pick is its fastest budget."""
    by_temperature = read_tune_file(tuned)["by_temperature"]
    assert list(by_temperature) == ["greedy", "t<=0.4", "t<=0.8", "t>0.8"]
    assert [e["temperature"] for e in by_temperature.values()] == [0.0, 0.3, 0.6, 1.0]
    assert by_temperature["greedy"]["source"] == "sweep" and by_temperature["t>0.8"]["source"] == "calibration"
    for entry in by_temperature.values():
        measured = entry["median_tokens_per_second"]
        assert measured[str(entry["tree_budget"])] == max(measured.values())
        assert set(entry["mean_acceptance_length"]) <= set(measured) and entry["mean_acceptance_length"]["ar"] == 1.0


def test_tune_measures_a_context_length(tuned):
    """--contexts 1024: a greedy calibration after 1024-token prompts, filed under its context
    bucket, its pick the fastest budget it measured."""
    entry = read_tune_file(tuned)["by_context"]["ctx<=2k"]
    assert entry["context_tokens"] == 1024 and entry["source"] == "calibration"
    measured = entry["median_tokens_per_second"]
    assert measured[str(entry["tree_budget"])] == max(measured.values())


def test_auto_context_budgets_cap_the_temperature_pick(llm, tuned, drafter_copy):
    lines: list[str] = []
    assert resolve_context_budgets(llm, drafter_copy, log=lines.append) == {
        "ctx<=2k": read_tune_file(tuned)["by_context"]["ctx<=2k"]["tree_budget"]}
    assert any("by context" in line for line in lines)
    saved = llm.auto_budgets, llm.auto_context_budgets
    try:
        llm.auto_budgets = {"greedy": TreeShape.best(64), "t>0.8": AR}
        llm.auto_context_budgets = {"ctx<=8k": TreeShape.best(16), "ctx>32k": TreeShape.best(256)}
        assert llm.budget_for(0.0, 100) == TreeShape.best(64)  # no pick for ctx<=2k
        assert llm.budget_for(0.0, 5000) == TreeShape.best(16)  # the context's smaller tree
        assert llm.budget_for(1.0, 5000) == AR  # the temperature's smaller tree
        assert llm.budget_for(0.0, 50000) == TreeShape.best(64)  # a larger cap changes nothing
    finally:
        llm.auto_budgets, llm.auto_context_budgets = saved


def test_auto_measures_context_caps_without_a_tune_file(llm, tmp_path, monkeypatch):
    """No tune file: `serve --tree-budget auto` measures greedy decoding after long prompts itself,
    among the budgets up to the greedy pick, and files the winner under the context's bucket;
    nothing to measure when the greedy pick is `ar` or no long context fits."""
    from ddtree.bench import tune

    monkeypatch.setattr(tune, "tune_contexts", lambda llm, max_tokens: [1024])
    saved = llm.auto_budgets
    try:
        llm.auto_budgets = {"greedy": TreeShape.best(15), "t>0.8": AR}
        lines: list[str] = []
        picks = resolve_context_budgets(llm, tmp_path, log=lines.append, seconds_per_context=2)
        assert list(picks) == ["ctx<=2k"] and picks["ctx<=2k"] in (AR, CHAIN, TreeShape.best(15))
        assert any("after prompts of 1024 tokens at ar, chain, 15," in line for line in lines)
        assert any("context 1024 tokens (ctx<=2k)" in line for line in lines)
        assert resolve_context_budgets(llm, tmp_path, log=lines.append) == {}  # not asked to measure
        llm.auto_budgets = {"greedy": AR}
        assert resolve_context_budgets(llm, tmp_path, log=lines.append, seconds_per_context=2) == {}
        llm.auto_budgets = {"greedy": TreeShape.best(8)}  # a pick no calibration budget is: measured too
        picks = resolve_context_budgets(llm, tmp_path, log=lines.append, seconds_per_context=1)
        assert any("after prompts of 1024 tokens at ar, 8," in line for line in lines)
        assert picks["ctx<=2k"] in (AR, TreeShape.best(8))
        llm.auto_budgets = {"greedy": TreeShape.best(15)}
        monkeypatch.setattr(tune, "tune_contexts", lambda llm, max_tokens: [])
        assert resolve_context_budgets(llm, tmp_path, log=lines.append, seconds_per_context=2) == {}
    finally:
        llm.auto_budgets = saved


def test_calibration_prompts_of_a_context_length(llm):
    prompts = _calibration_prompts(llm, 8, 1500)
    assert len(prompts) == 4 and all(len(p) == 1500 for p in prompts) and len({tuple(p) for p in prompts}) == 4
    assert all(len(p) == llm.max_model_len - 8 for p in _calibration_prompts(llm, 8, 10**6))  # capped by the room


def test_token_counts_flag():
    assert token_counts("8192, 32768") == [8192, 32768]
    for bad in ("", "0", "8k", "-5"):
        with pytest.raises(DDTreeError):
            token_counts(bad)


def test_auto_uses_a_matching_tune_file(llm, tuned, drafter_copy):
    lines: list[str] = []
    budget = resolve_auto_budget(llm, drafter_copy, log=lines.append, time_limit_s=0)
    assert budget == read_tune_file(tuned)["recommendations"][0]["tree_budget"]
    assert any(str(tuned) in line for line in lines) and not any("calibrat" in line for line in lines)
    at_two = resolve_auto_budget(llm, drafter_copy, log=lines.append, time_limit_s=0, concurrency=5)
    assert at_two == read_tune_file(tuned)["recommendations"][1]["tree_budget"]


@pytest.mark.parametrize("change, reason", [
    (lambda r: r.update(device="NVIDIA H200"), "device differs"),
    (lambda r: r.update(draft_fingerprint="0" * 16), "draft fingerprint differs"),
    (lambda r: r.update(format="something else"), "is not a ddtree-tune/1 file"),
])
def test_auto_ignores_a_file_for_another_device_or_pair(llm, tuned, tmp_path, change, reason):
    record = json.loads(tuned.read_text())
    change(record)
    (tmp_path / TUNE_FILE).write_text(json.dumps(record))
    lines: list[str] = []
    budget = resolve_auto_budget(llm, tmp_path, log=lines.append, time_limit_s=0)
    assert any("ignoring" in line and reason in line for line in lines)
    # it calibrates instead; a zero time limit measures only `ar` and the chain, which are measured past it
    assert any("calibration took" in line and "not measured: 15, 31" in line for line in lines)
    assert budget in (AR, CHAIN)


def test_auto_calibrates_without_a_file(llm, tmp_path):
    lines: list[str] = []
    budget = resolve_auto_budget(llm, tmp_path, log=lines.append, time_limit_s=3)
    assert any("no tune file" in line for line in lines)
    assert any(line.startswith("tree budget auto: calibration took") for line in lines)
    if any("measured nothing" in line for line in lines):  # a heavily loaded machine
        assert budget == llm.default_budget
    else:
        assert budget in CALIBRATION_BUDGETS
        assert any(line.startswith(f"tree budget auto: recommended tree budget at concurrency 1: {budget} ")
                   for line in lines)


def test_calibration_grows_trees_until_they_fall_behind(llm, monkeypatch):
    """With made-up speeds: the ascending pass stops after the first tree below half the best, the
    race drops budgets below half the leader, and the winner is the fastest."""
    speed = {"ar": 100.0, "chain": 150.0, 15: 200.0, 31: 260.0, 63: 240.0, 127: 120.0}
    runs: list = []

    def fake_generate(self, index, budget, params, sent_at, deadline=None):
        runs.append(budget.json_value)
        return RequestOutput(index, success=True, output_tokens=params.max_tokens,
                             e2el_s=params.max_tokens / speed[budget.json_value])

    monkeypatch.setattr(OfflineBackend, "generate_one", fake_generate)
    budget, summary = calibrate(llm, time_limit_s=0.3)
    assert budget == TreeShape.best(31)
    assert summary["skipped"] == {str(b): "tree 127 already ran below half the best" for b in (255, 511, 1023)}
    assert set(summary["median_tokens_per_second"]) == {"ar", "chain", "15", "31", "63", "127"}
    assert summary["samples"]["127"] == 2 and summary["samples"]["ar"] == 2  # both dropped after two samples
    assert summary["samples"]["31"] > 2 and summary["samples"]["chain"] > 2
    assert not set(runs) & {255, 511, 1023}
    assert summary["recommendation"]["margin_over_ar"] == pytest.approx(2.6)


def test_tune_calibrations_leave_warm_ups_out_of_their_time(llm, monkeypatch):
    """Warm-up requests slower than the whole limit (the first request after a long prompt compiling
    its kernels, on a GPU): inside the limit only `ar` and the first budget that drafts are measured,
    past the deadline, so that plain decoding is never picked unopposed; outside it (`ddtree tune`)
    every budget is."""
    def fake_generate(self, index, budget, params, sent_at, deadline=None):
        if params.max_tokens == CALIBRATION_WARMUP_TOKENS:
            if deadline is not None and time.perf_counter() + 0.2 > deadline:
                time.sleep(max(0.0, deadline - time.perf_counter()))
                return RequestOutput(index, error="stopped at the deadline")
            time.sleep(0.2)
        return RequestOutput(index, success=True, output_tokens=params.max_tokens, ttft_s=0.001, e2el_s=0.01)

    monkeypatch.setattr(OfflineBackend, "generate_one", fake_generate)
    budgets = [AR, CHAIN, TreeShape.best(15)]
    budget, summary = calibrate(llm, time_limit_s=0.1, budgets=budgets)
    assert budget is not None and set(summary["median_tokens_per_second"]) == {"ar", "chain"}
    assert summary["skipped"] == {"15": "out of time"}
    budget, summary = calibrate(llm, time_limit_s=0.1, budgets=budgets, untimed_warmups=True)
    assert budget is not None and set(summary["median_tokens_per_second"]) == {"ar", "chain", "15"}
    assert summary["seconds"] >= 0.6  # the three warm-ups, beside the limit's 0.1 s


def test_a_first_start_out_of_time_still_races_a_drafting_budget_against_ar(llm, monkeypatch):
    """A machine's first start: `ar`'s first request compiles for longer than the whole limit. The
    chain is still measured after the deadline, and wins; the trees past it are out of time."""
    def fake_generate(self, index, budget, params, sent_at, deadline=None):
        if budget == AR and params.max_tokens == CALIBRATION_WARMUP_TOKENS:
            time.sleep(0.3)  # past the 0.1 s limit, but not stopped: ar is the first of its kind
        speed = {AR: 100.0, CHAIN: 900.0}.get(budget, 1000.0)
        return RequestOutput(index, success=True, output_tokens=params.max_tokens, ttft_s=0.001,
                             e2el_s=0.001 + params.max_tokens / speed)

    monkeypatch.setattr(OfflineBackend, "generate_one", fake_generate)
    budget, summary = calibrate(llm, time_limit_s=0.1, budgets=[AR, CHAIN, TreeShape.best(15), TreeShape.best(31)])
    assert budget == CHAIN
    assert set(summary["median_tokens_per_second"]) == {"ar", "chain"}
    assert summary["skipped"] == {"15": "out of time", "31": "out of time"}


def test_a_budget_that_fails_stops_the_larger_trees(llm, monkeypatch):
    def fake_generate(self, index, budget, params, sent_at, deadline=None):
        if budget == TreeShape.best(15):
            return RequestOutput(index, error="out of memory")
        return RequestOutput(index, success=True, output_tokens=params.max_tokens, ttft_s=0.001, e2el_s=0.01)

    monkeypatch.setattr(OfflineBackend, "generate_one", fake_generate)
    budgets = [AR, CHAIN, TreeShape.best(15), TreeShape.best(31)]
    budget, summary = calibrate(llm, time_limit_s=0.3, budgets=budgets)
    assert summary["skipped"] == {"15": "failed", "31": "not run: 15 failed"}
    assert set(summary["median_tokens_per_second"]) == {"ar", "chain"}


def test_without_a_drafter_auto_is_ar(demo_pair):
    plain = LLM(demo_pair[0], device="cpu", use_draft=False)
    assert resolve_auto_budget(plain, None, log=lambda line: None) == AR


def test_pick_for_concurrency_and_bad_files(tmp_path):
    record = {"recommendations": [{"concurrency": 1, "tree_budget": 64}, {"concurrency": 8, "tree_budget": 16}]}
    assert [pick_for_concurrency(record, c)["tree_budget"] for c in (1, 4, 8, 32)] == [64, 64, 16, 16]
    path = tmp_path / TUNE_FILE
    path.write_text("{not json")
    with pytest.raises(DDTreeError, match="not valid JSON"):
        read_tune_file(path)
    write_tune_file({"format": "ddtree-tune/1", "recommendations": [{"concurrency": 1, "tree_budget": "many"}]}, path)
    with pytest.raises(DDTreeError, match="tree budget must be"):
        read_tune_file(path)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(DDTreeError, match="cannot write the tune file"):
        write_tune_file({}, blocker / "sub" / TUNE_FILE)


def test_interrupted_tune_writes_what_it_measured(demo_pair, tmp_path, monkeypatch, capsys):
    """Ctrl-C in the middle of `ddtree tune`: the budgets measured so far make the tune file (marked
    interrupted), the rows stay printed, and the exit code is 130."""
    import ddtree.bench.sweep as sweep_module

    real_run_one = sweep_module.run_one
    calls = []

    async def interrupt_on_the_second_run(*args, **kwargs):
        calls.append(args[2])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return await real_run_one(*args, **kwargs)

    monkeypatch.setattr(sweep_module, "run_one", interrupt_on_the_second_run)
    out = tmp_path / "tune.json"
    code = main(["tune", "--target", str(demo_pair[0]), "--draft", str(demo_pair[1]), "--device", "cpu",
                 "--tree-budgets", "ar,chain,8", "--num-prompts", "2", "--max-tokens", "6", "--output", str(out),
                 "--no-progress"])
    printed = capsys.readouterr().out
    assert code == 130 and calls == [AR, CHAIN]
    record = read_tune_file(out)
    assert record["interrupted"] is True and record["median_tokens_per_second"]["1"].keys() == {"ar"}
    assert record["recommendations"][0]["tree_budget"] == AR
    assert "interrupted: 1 of 3 runs measured" in printed and "tune file written" in printed


def test_startup_round_costs_time_a_long_context_on_a_gpu_only(llm):
    """Without a tune file a GPU times batched rounds at 64 and 8192 tokens (so longer batches are
    priced along the slope between them), cut to the context limit; the CPU at 64 only."""
    from types import SimpleNamespace

    import torch

    from ddtree.bench.tune import startup_round_cost_contexts

    def contexts(device: str, limit: int) -> list[int]:
        return startup_round_cost_contexts(SimpleNamespace(device=torch.device(device), max_model_len=limit,
                                                           block_size=16))

    assert contexts("cuda", 40960) == [64, 8192]
    assert contexts("cuda", 4096) == [64, 4096 - 33]  # room for two rounds of 16
    assert contexts("cpu", 40960) == [64] == startup_round_cost_contexts(llm)


def test_tune_with_max_num_seqs_stores_the_round_costs_a_batching_server_reads(demo_pair, tmp_path):
    from ddtree.bench.tune import resolve_round_costs
    from ddtree.round_costs import RoundCostTable

    drafter = tmp_path / "drafter"
    shutil.copytree(demo_pair[1], drafter, ignore=shutil.ignore_patterns(TUNE_FILE))
    code = main(["tune", "--target", str(demo_pair[0]), "--draft", str(drafter), "--device", "cpu",
                 "--tree-budgets", "ar,8", "--num-prompts", "2", "--max-tokens", "8", "--sampled-seconds", "1",
                 "--max-num-seqs", "2", "--max-model-len", "1100", "--no-progress"])
    assert code == 0
    table = RoundCostTable.from_json(read_tune_file(drafter / TUNE_FILE)["round_costs"])
    # Contexts 64, 1024, 8192 and 32768, the last two cut to what 1100 tokens leave room for (two
    # rounds of 16).
    assert {(p.context, p.rows, p.budget) for p in table.points} == {
        (c, r, b) for c in (64, 1024, 1100 - 33) for r in (1, 2) for b in ("ar", "15", "63")}
    budgets = [AR, TreeShape.best(15), TreeShape.best(63)]
    lines = []
    llm = LLM(demo_pair[0], drafter, device="cpu", max_model_len=1100, max_num_seqs=2)
    assert resolve_round_costs(llm, budgets, log=lines.append).to_json() == table.to_json()
    assert "round costs from" in lines[-1]
    llm.max_num_seqs = 3  # more rows than the file measured: timed now
    assert resolve_round_costs(llm, budgets, log=lines.append).max_rows == 3
    assert "measured round costs up to 2 rows, not 3" in lines[-1]
