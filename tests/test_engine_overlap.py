"""Rounds launched ahead of the host (Engine overlap) change nothing but timing.

With overlap the engine queues round r + 1 before reading round r's summary; the committed length
and the root advance on the device. These tests hold overlap to the plain loop (every summary read
before the next launch): the same tokens and acceptance lengths, greedy and sampled; a request
stopped early leaves a launched round behind that does not change the next request; and a request
that ends by length launches no round past its last.
"""
from __future__ import annotations

import pytest

from ddtree import LLM, SamplingParams, parse_tree_budget
from tiny_models import make_drafter, make_target

BUDGETS = ["ar", "chain", 3, 16]
PROMPTS = [[1], [2, 0, 1, 0], [3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 2]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A small vocabulary, so that the random drafter is sometimes right and rounds accept 1-4 nodes."""
    root = tmp_path_factory.mktemp("overlap")
    make_target(root / "t", "qwen3", vocab=4, hidden=32, layers=2, heads=2, kv_heads=1, head_dim=16,
                intermediate=64, peak=2.0, eos=None)
    make_drafter(root / "d", root / "t", layers=1, block_size=4, mask_token_id=3)
    kw = dict(device="cpu", dtype="float32", max_model_len=96)
    return LLM(root / "t", root / "d", overlap=True, **kw), LLM(root / "t", root / "d", overlap=False, **kw)


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_overlap_gives_the_same_tokens(pair, budget, temperature):
    ahead, plain = pair
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams(max_tokens=40, temperature=temperature, seed=100 + i, ignore_eos=True)
        a, b = ahead.generate(prompt, params, budget), plain.generate(prompt, params, budget)
        assert a.token_ids == b.token_ids
        assert a.stats.acceptance_lengths == b.stats.acceptance_lengths
    if budget != "ar":
        assert max(a.stats.acceptance_lengths) > 1  # rounds did accept drafted nodes


@pytest.mark.parametrize("budget", BUDGETS)
def test_a_stopped_request_leaves_the_next_one_unchanged(pair, budget):
    ahead, plain = pair
    long = SamplingParams(max_tokens=40, ignore_eos=True)
    full = plain.generate(PROMPTS[1], long, budget).token_ids
    # A token first produced by a round (not the prefill), well before max_tokens.
    at = next(i for i in range(2, 20) if full[i] not in full[:i])
    stop = SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=[full[at]])
    ahead.engine.prepare(parse_tree_budget(budget))
    bufs = ahead.engine.buffers[parse_tree_budget(budget)]
    before = bufs.rounds
    stopped = ahead.generate(PROMPTS[1], stop, budget)
    assert stopped.finish_reason == "stop" and stopped.token_ids == full[: at + 1]
    # The stop came mid-request: the round after the last one read had already been launched.
    assert bufs.rounds - before == stopped.stats.decode_rounds + 1
    for prompt in PROMPTS:
        assert ahead.generate(prompt, long, budget).token_ids == plain.generate(prompt, long, budget).token_ids


@pytest.mark.parametrize("budget", BUDGETS)
def test_ending_by_length_launches_no_extra_round(pair, budget):
    ahead, _ = pair
    ahead.engine.prepare(parse_tree_budget(budget))
    bufs = ahead.engine.buffers[parse_tree_budget(budget)]
    for max_tokens in (2, 7, 40):
        before = bufs.rounds
        result = ahead.generate(PROMPTS[2], SamplingParams(max_tokens=max_tokens, ignore_eos=True), budget)
        assert result.finish_reason == "length" and len(result.token_ids) == max_tokens
        assert bufs.rounds - before == result.stats.decode_rounds
