"""/tokenize and /detokenize: vLLM's shapes, the ids the generation endpoints prefill, a round trip,
and the generation endpoints' key, limits and error bodies."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from ddtree.llm import LLM
from ddtree.server.app import create_app
from ddtree.server.limits import ServerLimits

KEY = {"Authorization": "Bearer k"}
TEXT = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # ünïcode ✓"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write fib."}]


@pytest.fixture(scope="module")
def llm(demo_pair):
    return LLM(*demo_pair, device="cpu", max_model_len=96, tree_budget="chain")


@pytest.fixture(scope="module")
def client(llm):
    with TestClient(create_app(llm, served_model_name="m", api_key="k",
                               limits=ServerLimits(max_json_values=1000))) as client:
        yield client


def post(client, path, body, headers=KEY):
    return client.post(path, json=body, headers=headers)


def test_tokenize_round_trip(client, llm):
    out = post(client, "/tokenize", {"prompt": TEXT, "model": "m"})
    assert out.status_code == 200, out.text
    body = out.json()
    assert body["tokens"] == llm.encode(TEXT) and body["count"] == len(body["tokens"]) > 5
    assert body["max_model_len"] == 96
    back = post(client, "/detokenize", {"tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": TEXT}


def test_tokenize_gives_the_ids_the_endpoints_prefill(client):
    completion = post(client, "/v1/completions", {"prompt": TEXT[:20], "max_tokens": 1, "return_token_ids": True})
    assert post(client, "/tokenize", {"prompt": TEXT[:20]}).json()["tokens"] == \
        completion.json()["choices"][0]["prompt_token_ids"]
    chat = post(client, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1, "return_token_ids": True})
    tokenized = post(client, "/tokenize", {"messages": MESSAGES}).json()["tokens"]
    assert tokenized == chat.json()["choices"][0]["prompt_token_ids"]


def test_add_generation_prompt_reaches_the_template(client, llm, monkeypatch):
    monkeypatch.setattr(llm.tokenizer.hf, "chat_template", None)  # ddtree's default template honours it
    with_turn = post(client, "/tokenize", {"messages": MESSAGES}).json()["tokens"]
    no_turn = post(client, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()["tokens"]
    assert len(no_turn) < len(with_turn) and with_turn[: len(no_turn)] == no_turn
    assert post(client, "/detokenize", {"tokens": with_turn}).json()["prompt"].endswith("<|assistant|>\n")


@pytest.mark.parametrize("path, body, status, param", [
    ("/detokenize", {"tokens": [5, 10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": ["5"]}, 400, "tokens.0"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"tokens": list(range(2000))}, 400, None),  # over --max-json-values
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": MESSAGES}, 400, "messages"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
    ("/tokenize", {"prompt": "x" * 10**6}, 400, "prompt"),
])
def test_bad_requests_get_openai_errors(client, path, body, status, param):
    out = post(client, path, body)
    assert out.status_code == status, out.text
    error = out.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param


def test_the_api_key_and_unknown_fields(client):
    for path, body in [("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [5]})]:
        assert post(client, path, body, headers={}).status_code == 401
        assert post(client, path, {**body, "extra": 1}).status_code == 200
