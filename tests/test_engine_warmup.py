"""Graph warm-up: the KV buckets captured up front cover every length a sequence can reach, and
`LLM.warmup` validates its budget before touching the engine. (Capture itself runs on a GPU:
tests/test_gpu_graphs.py.)"""
from __future__ import annotations

import asyncio

import pytest
import torch

from ddtree import LLM
from ddtree.bench.runner import OfflineBackend
from ddtree.config import DDTreeError, SamplingParams, parse_tree_budget
from ddtree.tree_shape import AR, CHAIN, TreeShape
from tiny_models import make_drafter, make_target

MAX_LEN = 200


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    root = tmp_path_factory.mktemp("warmup")
    make_target(root / "t", "qwen3")
    make_drafter(root / "d", root / "t", block_size=8)
    return LLM(root / "t", root / "d", device="cpu", dtype="float32", max_model_len=MAX_LEN, kv_bucket=32)


@pytest.mark.parametrize("budget", ["ar", "chain", 1, 7, 64, 300])
def test_front_buckets_cover_every_length(llm, budget):
    engine, budget = llm.engine, parse_tree_budget(budget)
    lens = engine.front_kv_lens(budget)
    assert lens == sorted(set(lens)) and all(x % engine.kv_bucket == 0 for x in lens)
    assert set(lens) == {engine._front_kv_len(budget, n) for n in range(MAX_LEN)}
    size = max(budget.nodes(engine.block_size), engine.block_size)
    assert lens[0] >= size and lens[-1] >= MAX_LEN - 1 + size  # the scratch slots always fit


@pytest.mark.parametrize("budget", ["ar", "chain", 7, 64])
def test_min_prefix_bounds_every_committed_length_a_front_runs_at(llm, budget):
    """A front at kv_len runs wherever the host's bound n_bound (its n plus an unread round's keep
    at most) maps to kv_len, at any n in [n_bound - keep, n_bound]; `_min_prefix` is at most every
    such n (tree attention may hand keys below it to cuDNN) and equals the least of them."""
    engine, budget = llm.engine, parse_tree_budget(budget)
    llm.warmup(budget)
    keep = engine.buffers[budget].keep
    least: dict[int, int] = {}
    for n_bound in range(MAX_LEN):
        kv_len = engine._front_kv_len(budget, n_bound)
        least[kv_len] = min(least.get(kv_len, n_bound), max(0, n_bound - keep))
    for kv_len, n in least.items():
        assert engine._min_prefix(budget, kv_len) == n


@pytest.mark.parametrize("budget", ["chain", 7])
def test_the_drafters_attention_gets_the_fronts_bound_on_the_context(llm, budget, monkeypatch):
    """The drafter's context is the committed sequence, so its block attends with the target's
    `_min_prefix` (which lets a long context take the prefix kernel on a GPU), a bound of every
    context length it runs at."""
    engine, budget = llm.engine, parse_tree_budget(budget)
    drafter = engine.drafter
    seen: list[tuple[int, int, int]] = []  # (context length, kv_len, the full layers' min_prefix)
    real = type(drafter).block_metas

    def recording(self, context_len, block, kv_len, *rest, **kw):
        metas = real(self, context_len, block, kv_len, *rest, **kw)
        seen.append((int(context_len), kv_len, metas["full"].min_prefix))
        return metas

    monkeypatch.setattr(type(drafter), "block_metas", recording)
    llm.generate([3 + i % 90 for i in range(120)], SamplingParams(max_tokens=30, ignore_eos=True), budget)
    assert seen and all(0 < least <= n for n, _, least in seen)
    assert all(least == engine._min_prefix(budget, kv_len) for _, kv_len, least in seen)


def test_warmup_prepares_the_budget(llm):
    llm.warmup(16)
    assert TreeShape.best(16) in llm.engine.buffers
    llm.warmup()  # the default budget
    assert llm.default_budget in llm.engine.buffers


@pytest.mark.parametrize("bad", [0, -3, "wide", 10**6, 2.5])
def test_warmup_refuses_a_bad_budget_and_changes_nothing(llm, bad):
    before = set(llm.engine.buffers)
    with pytest.raises(DDTreeError):
        llm.warmup(bad)
    assert set(llm.engine.buffers) == before


def test_warmup_without_a_drafter_allows_only_ar(tmp_path):
    make_target(tmp_path / "t", "qwen3")
    plain = LLM(tmp_path / "t", device="cpu", dtype="float32", use_draft=False, max_model_len=64)
    with pytest.raises(DDTreeError, match="no drafter"):
        plain.warmup(16)
    plain.warmup("ar")
    assert AR in plain.engine.buffers


def test_offline_benchmark_warms_each_budget_up():
    class Recorder:
        def __init__(self):
            self.calls = []

        def warmup(self, budget):
            self.calls.append(budget)

    llm = Recorder()
    backend = OfflineBackend(llm)
    asyncio.run(backend.prepare(TreeShape.best(32)))
    asyncio.run(backend.prepare(CHAIN))
    assert llm.calls == [TreeShape.best(32), CHAIN]


@pytest.mark.parametrize("budget", ["ar", "chain", 7])
def test_round_phases_run_alone_in_round_order(llm, budget):
    """The phases benchmarks/round_latency.py times one by one, at a sequence's current state."""
    budget, engine = parse_tree_budget(budget), llm.engine
    steps = engine.generate([3, 1, 4, 1, 5], SamplingParams(max_tokens=50, ignore_eos=True), budget)
    next(steps), next(steps)  # the prefill and one round
    with torch.inference_mode():
        phases = engine.round_phases(budget)
        assert list(phases) == (["draft", "build"] if budget.drafts else []) + ["verify", "walk_commit"]
        n = int(engine.n)
        for name in list(phases)[:-1]:
            out = phases[name]()
        assert out.shape[0] == budget.nodes(engine.block_size) and int(engine.n) == n  # the verify's logits
        phases["walk_commit"]()
        assert int(engine.n) > n
    steps.close()
