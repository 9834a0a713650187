"""The log-probs a request gets are the target's own, of the raw distribution at each emitted token's
position, at every tree budget: compared with transformers' target (float64 log-softmax) on the prompt
+ the generated tokens, greedy with an oracle drafter (rounds accepting many tokens, through branch
points) and sampled with temperature, top-k and top-p (which must not change them)."""
from __future__ import annotations

import pytest
import torch

from ddtree import SamplingParams
from test_greedy_parity import BUDGETS, Setup, install_oracle

TOLERANCE = 1e-4
K = 5


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return Setup(tmp_path_factory.mktemp("logprobs"), "qwen3", kv_heads=2)


@torch.no_grad()
def target_logprobs(setup: Setup, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V]: the target's float64 log-softmax at each generated token's position."""
    ids = torch.tensor([prompt + tokens])
    logits = setup.hf(ids).logits[0].double()
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) + len(tokens) - 1], dim=-1)


def check(setup: Setup, prompt: list[int], result, k: int, label: str) -> None:
    assert result.logprobs is not None and len(result.logprobs) == len(result.token_ids), label
    expected = target_logprobs(setup, prompt, result.token_ids)
    for j, (token, lp) in enumerate(zip(result.token_ids, result.logprobs)):
        assert lp.token_id == token
        assert abs(lp.logprob - float(expected[j, token])) < TOLERANCE, f"{label}: token {j}"
        assert len(lp.top) == k
        top = expected[j].topk(k)
        assert [t for t, _ in lp.top] == top.indices.tolist(), f"{label}: token {j}"
        assert all(abs(v - float(e)) < TOLERANCE for (_, v), e in zip(lp.top, top.values)), f"{label}: token {j}"


def test_greedy_logprobs_are_the_targets_at_every_budget(setup, monkeypatch):
    state: dict = {}
    install_oracle(monkeypatch, setup.vocab, state)
    params = SamplingParams(max_tokens=20, ignore_eos=True, logprobs=K)
    deep = 0
    for p, (prompt, expected) in enumerate(setup.cases(4, seed=21, max_new=28)):
        state["seq"] = prompt + expected
        for budget in BUDGETS:
            result = setup.llm.generate(prompt, params, budget)
            assert result.token_ids == expected[:20]
            check(setup, prompt, result, K, f"prompt {p}, budget {budget}")
            deep += max(result.stats.acceptance_lengths) > 3
    assert deep >= 8  # rounds emitting several tokens (and their log-probs) at once were checked


@pytest.mark.parametrize("budget", BUDGETS)
def test_sampled_logprobs_are_the_raw_targets(setup, budget):
    prompt = [3, 17, 42, 5]
    for seed, (temperature, top_k, top_p) in enumerate([(1.0, 0, 1.0), (0.7, 8, 0.9), (1.5, 0, 0.8)]):
        params = SamplingParams(max_tokens=12, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                                ignore_eos=True, logprobs=0)
        result = setup.llm.generate(prompt, params, budget)
        check(setup, prompt, result, 0, f"budget {budget}, seed {seed}")


def test_no_logprobs_unless_asked_and_streams_carry_theirs(setup):
    prompt = [7, 8, 9]
    assert setup.llm.generate(prompt, SamplingParams(max_tokens=6, ignore_eos=True), 16).logprobs is None
    params = SamplingParams(max_tokens=9, ignore_eos=True, logprobs=2, stop_token_ids=[])
    events = list(setup.llm.stream(prompt, params, 16))
    assert [len(e.logprobs) for e in events] == [len(e.token_ids) for e in events]
    assert [lp for e in events for lp in e.logprobs] == events[-1].result.logprobs


def test_logprobs_are_validated():
    from ddtree.config import DDTreeError

    for bad in (-1, 21, 1.5, True):
        with pytest.raises(DDTreeError):
            SamplingParams(logprobs=bad)
