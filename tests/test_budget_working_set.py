"""The engine's bounded working set of tree budgets: budgets beyond the default and the most
recently used few are released (buffers, plans, graphs) and prepared again when used, with the same
output; the walk is compiled for a bounded number of tree sizes; a prompt that cannot fit is refused
before it is tokenized."""
from __future__ import annotations

import pytest
import torch

from ddtree.bounded_compile import CompiledForFirstSizes
from ddtree.config import DDTreeError, SamplingParams
from ddtree.llm import LLM
from ddtree.tree_shape import TreeShape

PROMPT = "def fib(n):"
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(demo_pair):
    return LLM(*demo_pair, device="cpu", max_model_len=96, max_cached_budgets=2)


def held(llm) -> set:
    """The budgets allocated now, as written in JSON: "ar", "chain" or integers."""
    e = llm.engine
    assert {k[0] for k in e.front_graphs} <= set(e.buffers) and set(e.back_graphs) <= set(e.buffers)
    assert set(e.tree_plans) <= set(e.buffers)
    return {b.json_value for b in e.buffers}


def test_working_set_keeps_the_default_and_the_most_recent(llm):
    reference = llm.generate(PROMPT, GREEDY, "ar").token_ids
    outputs = {}
    for budget in (63, 3, 5, 7, 9):
        outputs[budget] = llm.generate(PROMPT, GREEDY, budget).token_ids
        assert outputs[budget] == reference  # greedy DDTree is the target's own output at every budget
    assert held(llm) == {63, 7, 9}  # the default (pinned) and the two most recently used
    again = llm.generate(PROMPT, GREEDY, 3).token_ids  # prepared again after its release
    assert again == outputs[3] and held(llm) == {63, 9, 3}
    llm.generate(PROMPT, GREEDY, 9)  # using a held budget makes it the most recent
    llm.generate(PROMPT, GREEDY, "chain")
    assert held(llm) == {63, 9, "chain"}


def test_release_frees_every_per_budget_structure(llm):
    llm.generate(PROMPT, GREEDY, 11)
    assert TreeShape.best(11) in llm.engine.buffers
    llm.engine.release(TreeShape.best(11))
    assert 11 not in held(llm)
    llm.engine.release(TreeShape.best(11))  # releasing what is not held is a no-op


def test_unbounded_working_set_keeps_everything(demo_pair):
    unbounded = LLM(*demo_pair, device="cpu", max_model_len=64)
    for budget in (2, 4, 6):
        unbounded.generate(PROMPT, SamplingParams(max_tokens=3, temperature=0), budget)
    assert {2, 4, 6} <= held(unbounded)


def test_compiled_for_first_sizes_never_passes_the_recompile_limit():
    """dynamo with fullgraph=True fails past its recompile limit; the bound keeps further sizes eager."""

    def double_sum(x):
        return (x * 2).sum()

    def eager_backend(fn):
        return torch.compile(fn, dynamic=False, fullgraph=True, backend="eager")

    with torch._dynamo.config.patch(recompile_limit=3):
        torch._dynamo.reset()
        unbounded = eager_backend(double_sum)
        with pytest.raises(Exception, match="fullgraph|recompile"):
            for n in range(1, 8):
                unbounded(torch.ones(n))
        torch._dynamo.reset()
        bounded = CompiledForFirstSizes(double_sum, 2, lambda x: x.shape[0], compile=eager_backend)
        assert [float(bounded(torch.ones(n))) for n in range(1, 12)] == [2.0 * n for n in range(1, 12)]
        assert bounded.sizes == {1, 2}
        torch._dynamo.reset()


def test_prompt_that_cannot_fit_is_refused_before_tokenizing(llm, monkeypatch):
    limit = llm.max_prompt_chars
    assert limit == 2 * llm.max_model_len * llm.tokenizer.max_token_chars
    calls = []
    monkeypatch.setattr(llm.tokenizer, "encode", lambda text: calls.append(text) or [1])
    with pytest.raises(DDTreeError, match="characters") as info:
        llm.prompt_ids("x" * (limit + 1))
    assert info.value.param == "prompt" and not calls
    with pytest.raises(DDTreeError, match="characters") as info:
        llm.apply_chat_template([{"role": "user", "content": "y" * (limit + 1)}])
    assert info.value.param == "messages" and not calls
    assert llm.prompt_ids("x" * 10) == [1] and calls  # under the bound it is tokenized as usual
