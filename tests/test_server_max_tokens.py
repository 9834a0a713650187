"""The operator's output-token settings: --default-max-tokens for chat requests naming none, and
--max-output-tokens refusing larger requests with 400."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from ddtree.llm import LLM
from ddtree.server.app import create_app
from ddtree.server.limits import ServerLimits

CHAT = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "ignore_eos": True}
MAX_MODEL_LEN = 96


@pytest.fixture(scope="module")
def llm(demo_pair):
    return LLM(*demo_pair, device="cpu", max_model_len=MAX_MODEL_LEN, tree_budget="chain")


def completion_tokens(client, path, body) -> int:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["completion_tokens"]


def test_chat_without_max_tokens_gets_the_default(llm):
    with TestClient(create_app(llm, served_model_name="m", limits=ServerLimits(default_max_tokens=5))) as client:
        assert completion_tokens(client, "/v1/chat/completions", CHAT) == 5
        assert completion_tokens(client, "/v1/chat/completions", {**CHAT, "max_tokens": 7}) == 7
        assert completion_tokens(client, "/v1/completions", {"prompt": "x", "ignore_eos": True}) == 16


def test_the_default_never_passes_the_context(llm):
    with TestClient(create_app(llm, served_model_name="m")) as client:  # default 1024 > the context of 96
        prompt = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1, "return_token_ids": True})
        room = MAX_MODEL_LEN - len(prompt.json()["choices"][0]["prompt_token_ids"])
        assert completion_tokens(client, "/v1/chat/completions", CHAT) == room


def test_max_output_tokens_refuses_larger_requests_and_caps_defaults(llm):
    limits = ServerLimits(max_output_tokens=6)
    with TestClient(create_app(llm, served_model_name="m", limits=limits)) as client:
        for path, body, param in [("/v1/completions", {"prompt": "x", "max_tokens": 7}, "max_tokens"),
                                  ("/v1/chat/completions", {**CHAT, "max_tokens": 7}, "max_tokens"),
                                  ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 9}, "max_completion_tokens")]:
            r = client.post(path, json=body)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == param and "--max-output-tokens" in r.json()["error"]["message"]
        assert completion_tokens(client, "/v1/completions", {"prompt": "x", "max_tokens": 6, "ignore_eos": True}) == 6
        assert completion_tokens(client, "/v1/chat/completions", CHAT) == 6
        assert completion_tokens(client, "/v1/completions", {"prompt": "x", "ignore_eos": True}) == 6


def test_limits_are_checked():
    for bad in (ServerLimits(default_max_tokens=0), ServerLimits(max_output_tokens=0)):
        with pytest.raises(ValueError):
            bad.check()
