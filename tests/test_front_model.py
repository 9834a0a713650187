"""The server front's view of the model (`FrontModel`, from the engine's `EngineInfo`): the same
prompt ids and request checks as the `LLM` it describes, without its models; a request that names
no tree budget is checked with none (the engine chooses it), one that names a drafting budget is
refused when the engine has no drafter."""
from __future__ import annotations

import dataclasses
import pickle

import pytest

from ddtree.config import DDTreeError, SamplingParams
from ddtree.llm import LLM
from ddtree.server.front_model import EngineInfo, FrontModel
from ddtree.tree_shape import TreeShape


@pytest.fixture(scope="module")
def llm(demo_pair):
    return LLM(*demo_pair, device="cpu", max_model_len=256, tree_budget=16)


def test_the_front_checks_requests_as_the_llm_does(llm):
    info = pickle.loads(pickle.dumps(EngineInfo.of(llm, "fixed")))  # it crosses the pipe
    front = FrontModel(info)
    assert (front.target_name, front.draft_name, front.block_size, front.max_model_len) == (
        llm.target_name, llm.draft_name, llm.block_size, llm.max_model_len)
    assert front.default_budget == llm.default_budget == TreeShape.best(16) and front.dtype == "float32"
    for prompt in ["def fib(n):", [5, 6, 7], {"prompt": "import os"}, {"prompt_token_ids": [9, 10]}]:
        assert front.prompt_ids(prompt) == llm.prompt_ids(prompt)
    messages = [{"role": "user", "content": "sort a list"}]
    assert front.apply_chat_template(messages) == llm.apply_chat_template(messages)
    assert front.max_prompt_chars == llm.max_prompt_chars
    params = SamplingParams(max_tokens=8)
    assert front.check_request([1, 2, 3], params) is None  # the engine chooses it when the request starts
    assert front.check_request([1, 2, 3], params, 64) == llm.check_request([1, 2, 3], params, 64)
    for bad in ([llm.vocab_size], "", {"text": "x"}):
        with pytest.raises(DDTreeError) as front_error:
            front.prompt_ids(bad)
        with pytest.raises(DDTreeError) as llm_error:
            llm.prompt_ids(bad)
        assert str(front_error.value) == str(llm_error.value)
    with pytest.raises(DDTreeError, match="exceeds the context limit"):
        front.check_request([1] * 250, SamplingParams(max_tokens=8), "ar")


def test_without_a_drafter_only_ar_is_accepted(llm):
    front = FrontModel(dataclasses.replace(EngineInfo.of(llm, "fixed"), has_drafter=False, default_budget="ar"))
    assert front.check_request([1, 2], SamplingParams(max_tokens=4), "ar").label == "ar"
    with pytest.raises(DDTreeError, match="no drafter"):
        front.check_request([1, 2], SamplingParams(max_tokens=4), 16)
    assert not front.adapts(None)
