"""Bad requests: each answered 400/401/404/405 with the OpenAI error body, none reaching the engine,
and the server answering a good request right after."""
from __future__ import annotations

import json

import httpx
import pytest

from server_process import LiveServer, metric, metric_values

MAX_MODEL_LEN = 96
MAX_REQUEST_BYTES = 65536
GOOD_REQUESTS: list[dict] = []  # every 200 answer this module received, for the metrics check

C, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]

# (case id, path, JSON body or raw bytes, extra headers, status, param, code)
BAD = [
    ("malformed-json", C, b'{"prompt": "x",', {}, 400, None, "invalid_json"),
    ("body-not-object", C, b"[1, 2]", {}, 400, None, None),
    ("empty-body", C, b"", {}, 400, None, None),
    ("not-json-content-type", C, b"prompt=x", {"content-type": "text/plain"}, 400, None, None),
    ("max-tokens-string", C, {"prompt": "x", "max_tokens": "5"}, {}, 400, "max_tokens", None),
    ("max-tokens-fraction", C, {"prompt": "x", "max_tokens": 5.5}, {}, 400, "max_tokens", None),
    ("max-tokens-negative", C, {"prompt": "x", "max_tokens": -1}, {}, 400, "max_tokens", None),
    ("max-tokens-huge", C, {"prompt": "x", "max_tokens": 10**12}, {}, 400, "max_tokens", None),
    ("prompt-over-context", C, {"prompt": list(range(2, 2 + MAX_MODEL_LEN)), "max_tokens": 1}, {}, 400, "prompt", None),
    ("chat-over-context", CHAT, {"messages": [{"role": "user", "content": "def f(): pass\n" * 200}]}, {}, 400,
     "prompt", None),
    ("prompt-empty", C, {"prompt": ""}, {}, 400, "prompt", None),
    ("prompt-token-out-of-range", C, {"prompt": [10**9]}, {}, 400, "prompt", None),
    ("prompt-batch", C, {"prompt": ["a", "b"]}, {}, 400, "prompt", None),
    ("prompt-missing", C, {"max_tokens": 3}, {}, 400, "prompt", "missing_required_parameter"),
    ("tree-budget-word", C, {"prompt": "x", "tree_budget": "wide"}, {}, 400, "tree_budget", None),
    ("tree-budget-zero", C, {"prompt": "x", "tree_budget": 0}, {}, 400, "tree_budget", None),
    ("tree-budget-huge", C, {"prompt": "x", "tree_budget": 10**6}, {}, 400, "tree_budget", None),
    ("tree-budget-bool", C, {"prompt": "x", "tree_budget": True}, {}, 400, "tree_budget", None),
    ("unknown-model", C, {"prompt": "x", "model": "gpt-4o"}, {}, 404, "model", "model_not_found"),
    ("stream-options-without-stream", C, {"prompt": "x", "stream_options": {"include_usage": True}}, {}, 400,
     "stream_options", None),
    ("stream-not-bool", C, {"prompt": "x", "stream": "yes"}, {}, 400, "stream", None),
    ("temperature-negative", C, {"prompt": "x", "temperature": -0.5}, {}, 400, "temperature", None),
    ("temperature-nan", C, b'{"prompt": "x", "temperature": NaN}', {}, 400, "temperature", None),
    ("top-p-zero", C, {"prompt": "x", "top_p": 0}, {}, 400, "top_p", None),
    ("top-p-above-one", C, {"prompt": "x", "top_p": 1.5}, {}, 400, "top_p", None),
    ("top-k-negative", C, {"prompt": "x", "top_k": -2}, {}, 400, "top_k", None),
    ("seed-negative", C, {"prompt": "x", "seed": -1}, {}, 400, "seed", None),
    ("seed-too-big", C, {"prompt": "x", "seed": 2**70}, {}, 400, "seed", None),
    ("stop-not-strings", C, {"prompt": "x", "stop": [1]}, {}, 400, "stop", None),
    ("stop-token-ids-negative", C, {"prompt": "x", "stop_token_ids": [-1]}, {}, 400, "stop_token_ids", None),
    ("n-two", C, {"prompt": "x", "n": 2}, {}, 400, "n", None),
    ("unknown-field-wrong-known-one", C, {"prompt": "x", "tools": [], "top_p": "1"}, {}, 400, "top_p", None),
    ("presence-penalty", C, {"prompt": "x", "presence_penalty": 0.5}, {}, 400, "presence_penalty", None),
    ("logprobs-over-20", C, {"prompt": "x", "logprobs": 21}, {}, 400, "logprobs", None),
    ("top-logprobs-without-logprobs", CHAT, {"messages": USER, "top_logprobs": 2}, {}, 400, "top_logprobs", None),
    ("chat-empty-messages", CHAT, {"messages": []}, {}, 400, "messages", None),
    ("chat-unknown-role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, {}, 400, "messages.0.role", None),
    ("chat-null-content", CHAT, {"messages": [{"role": "user", "content": None}]}, {}, 400, "messages.0.content",
     None),
    ("chat-missing-content", CHAT, {"messages": [{"role": "user"}]}, {}, 400, "messages.0.content", None),
    ("chat-messages-not-list", CHAT, {"messages": "hi"}, {}, 400, "messages", None),
    ("oversize-body", C, {"prompt": "x" * (MAX_REQUEST_BYTES + 10)}, {}, 400, None, "request_too_large"),
    ("missing-api-key", C, {"prompt": "x"}, {"authorization": ""}, 401, None, "invalid_api_key"),
    ("wrong-api-key", CHAT, {"messages": USER}, {"authorization": "Bearer sk-nope"}, 401, None, "invalid_api_key"),
    ("unknown-route", "/v1/edits", {"prompt": "x"}, {}, 404, None, "not_found"),
]


@pytest.fixture(scope="module")
def server(demo_pair):
    with LiveServer(*demo_pair, "--max-request-bytes", str(MAX_REQUEST_BYTES), max_model_len=MAX_MODEL_LEN) as live:
        yield live


@pytest.fixture(scope="module")
def http(server):
    with server.client() as client:
        yield client


def good_request(http: httpx.Client) -> None:
    r = http.post(C, json={"prompt": "def f(x):", "max_tokens": 3, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    GOOD_REQUESTS.append(r.json())


def test_enough_distinct_bad_inputs():
    assert len({case[0] for case in BAD}) == len(BAD) >= 15


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_then_good_request(http, case):
    _, path, body, headers, status, param, code = case
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json", **headers})
    else:
        r = http.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json", **headers})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    good_request(http)


def test_streaming_request_with_bad_input_is_rejected_before_streaming(http):
    r = http.post(C, json={"prompt": "x", "stream": True, "max_tokens": 10**6})
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["param"] == "max_tokens"
    good_request(http)


def test_wrong_method(http):
    r = http.get(C)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    good_request(http)


def test_rejected_requests_never_reached_the_engine(http):
    values = metric_values(http.get("/metrics").text)
    assert metric(values, "vllm:request_success_total") == len(GOOD_REQUESTS)
    assert metric(values, "vllm:generation_tokens_total") == 3 * len(GOOD_REQUESTS)
    assert http.get("/health").json()["status"] == "ok"
