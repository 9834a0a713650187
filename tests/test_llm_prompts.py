"""`LLM.generate` takes one prompt or a list of them, as vLLM's does: a string, token ids or a
prompt dict is one prompt (one result); a list of those is several (a list of results)."""
from __future__ import annotations

import pytest

from ddtree import LLM, SamplingParams
from ddtree.config import DDTreeError
from ddtree.llm import GenerationResult, is_prompt_list

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(demo_pair):
    return LLM(*demo_pair, device="cpu")


def test_what_counts_as_a_list_of_prompts():
    assert is_prompt_list(["a", "b"]) and is_prompt_list([[1, 2], [3]]) and is_prompt_list([{"prompt": "a"}])
    assert is_prompt_list(["a"]) and is_prompt_list(("a", [1]))
    assert not is_prompt_list("a") and not is_prompt_list([1, 2, 3]) and not is_prompt_list([])
    assert not is_prompt_list({"prompt": "a"}) and not is_prompt_list([1, "a"])


def test_a_list_of_prompts_gives_a_list_of_results_in_order(llm):
    texts = ["def fib(n):", "import os\n"]
    ids = llm.encode(texts[1])
    results = llm.generate([texts[0], ids, {"prompt_token_ids": ids}, {"prompt": texts[0]}], PARAMS, "chain")
    assert isinstance(results, list) and len(results) == 4
    assert all(isinstance(r, GenerationResult) for r in results)
    one = llm.generate(texts[0], PARAMS, "chain")
    assert isinstance(one, GenerationResult)
    assert results[0].token_ids == results[3].token_ids == one.token_ids
    assert results[1].prompt_token_ids == ids and results[1].token_ids == results[2].token_ids


def test_token_ids_stay_one_prompt(llm):
    result = llm.generate([5, 6, 7], PARAMS, "ar")
    assert isinstance(result, GenerationResult) and result.prompt_token_ids == [5, 6, 7]
    with pytest.raises(DDTreeError, match="prompt token ids must be integers"):
        llm.generate([1, "a"], PARAMS)  # one prompt with a bad id, not two prompts


def test_one_sampling_params_per_prompt(llm):
    short, longer = SamplingParams(max_tokens=2, ignore_eos=True), SamplingParams(max_tokens=5, ignore_eos=True)
    results = llm.generate(["a", "b"], [short, longer])
    assert [len(r.token_ids) for r in results] == [2, 5]


@pytest.mark.parametrize("prompts, params, message", [
    (["a", ""], PARAMS, "prompt 1: prompt must not be empty"),
    (["a", [1, -4]], PARAMS, "prompt 1: prompt token ids"),
    (["a", {"text": "b"}], PARAMS, "prompt 1: a prompt dict holds"),
    (["a", "b"], [PARAMS], "1 sampling params for 2 prompts"),
    ("a", [PARAMS], "needs a list of prompts"),
])
def test_a_bad_prompt_fails_before_any_runs(llm, monkeypatch, prompts, params, message):
    monkeypatch.setattr(llm, "_generate_one", lambda *a: pytest.fail("a prompt ran before all were checked"))
    with pytest.raises(DDTreeError, match=message):
        llm.generate(prompts, params)
