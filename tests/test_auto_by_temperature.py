"""--tree-budget auto by temperature: the tune file's buckets, old files, and the server's per-request pick."""
from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from ddtree.bench.runner import OfflineBackend, RequestOutput
from ddtree.bench.tune import TUNE_FILE, bucket_picks, calibrate, identity, read_tune_file, resolve_auto_budgets
from ddtree.llm import LLM
from ddtree.server.app import create_app
from ddtree.temperature_buckets import BUCKET_NAMES, bucket_of
from ddtree.tree_shape import AR, CHAIN, TreeShape
from server_process import metric, metric_values


EIGHT = TreeShape.best(8)


@pytest.fixture(scope="module")
def llm(demo_pair):
    return LLM(*demo_pair, device="cpu", max_model_len=96)


def tune_file(llm, directory, by_temperature=None):
    """A made-up tune file for `llm`: greedy pick 8, and `by_temperature` when given."""
    record = {"format": "ddtree-tune/1", **identity(llm),
              "recommendations": [{"concurrency": 1, "tree_budget": 8, "median_tokens_per_second": 50.0,
                                   "margin_over_chain": 1.1, "margin_over_ar": 1.2}]}
    if by_temperature is not None:
        record["by_temperature"] = by_temperature
    path = directory / TUNE_FILE
    path.write_text(json.dumps(record))
    return path


def test_bucket_of_names_each_range():
    assert [bucket_of(t).name for t in (0.0, 1e-6, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0)] == [
        "greedy", "greedy", "t<=0.4", "t<=0.4", "t<=0.8", "t<=0.8", "t>0.8", "t>0.8"]


def test_auto_reads_the_picks_per_bucket(llm, tmp_path):
    tune_file(llm, tmp_path, {"t<=0.8": {"tree_budget": "chain"}, "t>0.8": {"tree_budget": "ar"}})
    picks = resolve_auto_budgets(llm, tmp_path, log=lambda line: None, time_limit_s=0)
    assert picks == {"greedy": EIGHT, "t<=0.4": EIGHT, "t<=0.8": CHAIN, "t>0.8": AR}


def test_a_file_without_buckets_gives_its_greedy_pick_everywhere(llm, tmp_path):
    lines: list[str] = []
    path = tune_file(llm, tmp_path)
    assert resolve_auto_budgets(llm, tmp_path, log=lines.append, time_limit_s=0) == dict.fromkeys(BUCKET_NAMES, EIGHT)
    assert any("greedy traffic only" in line for line in lines)
    assert bucket_picks(read_tune_file(path)) == dict.fromkeys(BUCKET_NAMES, EIGHT)


def test_a_sampled_tune_keeps_its_calibrated_greedy_pick(llm, tmp_path):
    """`ddtree tune --temperature 0.6`: the sweep's pick serves t<=0.8, a calibration's serves greedy."""
    path = tune_file(llm, tmp_path, {"greedy": {"tree_budget": 64, "source": "calibration"},
                                     "t<=0.8": {"tree_budget": 8, "source": "sweep"}})
    assert bucket_picks(read_tune_file(path)) == {"greedy": TreeShape.best(64), "t<=0.4": EIGHT, "t<=0.8": EIGHT,
                                                  "t>0.8": EIGHT}


def test_calibration_samples_at_the_bucket_temperature(llm, monkeypatch):
    """Made-up speeds and acceptance: the calibration passes its temperature on and records acceptance."""
    seen: set[float] = set()

    def fake_generate(self, index, budget, params, sent_at, deadline=None):
        seen.add(params.temperature)
        speed = {AR: 100.0, CHAIN: 60.0}.get(budget, 30.0)
        return RequestOutput(index, success=True, output_tokens=params.max_tokens, decode_rounds=4,
                             accepted_tokens=6, e2el_s=params.max_tokens / speed)

    monkeypatch.setattr(OfflineBackend, "generate_one", fake_generate)
    budget, summary = calibrate(llm, time_limit_s=0.2, budgets=[AR, CHAIN, TreeShape.best(16)], temperature=1.0)
    assert seen == {1.0} and budget == AR
    assert summary["mean_acceptance_length"]["chain"] == pytest.approx(1.5)
    assert summary["mean_acceptance_length"]["ar"] == 1.0


def test_server_auto_serves_each_temperature_with_its_bucket_pick(demo_pair, llm):
    llm.auto_budgets = {"greedy": EIGHT, "t<=0.4": EIGHT, "t<=0.8": CHAIN, "t>0.8": AR}
    try:
        with TestClient(create_app(llm, tree_budget_mode="auto")) as client:
            used = {}
            for temperature in (0, 0.6, 1.0):
                body = {"prompt": "def f(x):", "max_tokens": 4, "temperature": temperature, "seed": 1,
                        "ignore_eos": True}
                reply = client.post("/v1/completions", json=body)
                assert reply.status_code == 200, reply.text
                used[temperature] = reply.json()["ddtree"]["tree_budget"]
            named = client.post("/v1/completions", json={**body, "tree_budget": "chain"}).json()
            values = metric_values(client.get("/metrics").text)
    finally:
        llm.auto_budgets = None
    assert used == {0: "8", 0.6: "chain", 1.0: "ar"}
    assert named["ddtree"]["tree_budget"] == "chain"  # a request's own tree_budget still wins
    assert metric(values, "ddtree:auto_tree_budget", temperature_bucket="t>0.8", tree_budget="ar") == 1
    assert metric(values, "ddtree:auto_tree_budget", temperature_bucket="greedy", tree_budget="8") == 1


def test_the_sampled_buckets_race_what_greedy_measured_inside_the_bound(llm, tmp_path, monkeypatch):
    """Without a tune file, `--tree-budget auto` gives the sampled buckets the budgets the greedy
    calibration measured (not those it ran out of time for) with their warm-ups inside the time
    bound; a greedy calibration that measured one budget leaves the sampled buckets unmeasured."""
    from ddtree.bench import tune

    calls = []

    def fake_calibrate(llm, time_limit_s, log=print, budgets=None, temperature=0.0, prompt_tokens=None,
                       untimed_warmups=False):
        calls.append((temperature, budgets, untimed_warmups, time_limit_s))
        speeds = {"ar": 10.0, "chain": 30.0, "15": 20.0} if temperature == 0 else {"ar": 10.0, "chain": 25.0}
        pick = CHAIN if temperature == 0 else max((b for b in budgets), key=lambda b: speeds.get(str(b), 0))
        return pick, {"seconds": 1.0, "median_tokens_per_second": speeds, "skipped": {"31": "out of time"},
                      "mean_acceptance_length": {},
                      "recommendation": {"concurrency": 1, "tree_budget": pick,
                                         "median_tokens_per_second": speeds[str(pick)],
                                         "margin_over_chain": 1.0, "margin_over_ar": 3.0}}

    monkeypatch.setattr(tune, "calibrate", fake_calibrate)
    picks = resolve_auto_budgets(llm, tmp_path, log=lambda line: None, time_limit_s=60)
    assert picks == dict.fromkeys(BUCKET_NAMES, CHAIN)
    greedy, *sampled = calls
    assert greedy[0] == 0 and greedy[1] is None and greedy[3] == 30
    assert len(sampled) == len(BUCKET_NAMES) - 1
    assert all(budgets == [AR, CHAIN, TreeShape.best(15)] and not untimed and seconds == 10
               for _, budgets, untimed, seconds in sampled)
    calls.clear()
    monkeypatch.setattr(tune, "calibrate", lambda llm, time_limit_s, log=print, **kw: calls.append(kw) or (
        AR, {"seconds": 1.0, "median_tokens_per_second": {"ar": 10.0}, "skipped": {},
             "recommendation": {"concurrency": 1, "tree_budget": AR, "median_tokens_per_second": 10.0,
                                "margin_over_chain": 1.0,
                                "margin_over_ar": 1.0}}))
    picks = resolve_auto_budgets(llm, tmp_path, log=lambda line: None, time_limit_s=60)
    assert picks == dict.fromkeys(BUCKET_NAMES, AR)
    assert len(calls) == 1


def test_a_first_start_whose_compiles_fill_the_bound_still_serves_speculation(llm, tmp_path, monkeypatch):
    """Without a tune file, on a machine's first start: `ar`'s first requests compile for longer than
    the whole bound. Every calibration (greedy and each sampled bucket) still measures `ar` and the
    chain, past its deadline, and the chain, twice as fast, is served everywhere (a fresh GPU had
    measured `ar` alone and served it)."""
    import time

    from ddtree.bench.tune import CALIBRATION_WARMUP_TOKENS

    compiled: set = set()

    def fake_generate(self, index, budget, params, sent_at, deadline=None):
        if budget == AR and params.max_tokens == CALIBRATION_WARMUP_TOKENS and params.temperature == 0:
            time.sleep(0.3)  # the first compiles, past the 0.1 s greedy share of the bound
        compiled.add(budget)
        speed = {AR: 100.0, CHAIN: 200.0}.get(budget, 150.0)
        return RequestOutput(index, success=True, output_tokens=params.max_tokens, ttft_s=0.001,
                             e2el_s=0.001 + params.max_tokens / speed)

    monkeypatch.setattr(OfflineBackend, "generate_one", fake_generate)
    lines: list[str] = []
    picks = resolve_auto_budgets(llm, tmp_path, log=lines.append, time_limit_s=0.2)
    assert picks == dict.fromkeys(BUCKET_NAMES, CHAIN)
    assert compiled == {AR, CHAIN}  # no tree: every one was out of time
    assert any("calibration took" in line and "not measured: 15" in line for line in lines)
