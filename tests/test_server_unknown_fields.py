"""Unknown request fields are accepted and ignored, each name logged once; known fields stay strict."""
from __future__ import annotations

import logging

import pytest
from fastapi.testclient import TestClient

from ddtree.llm import LLM
from ddtree.server.app import create_app
from ddtree.server.ignored_fields import IgnoredFieldLog

GOOD = {"prompt": "def f(x):", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
# What OpenAI SDKs and frameworks send besides the fields ddtree implements.
CLIENT_FIELDS = {"metadata": {"a": "b"}, "store": False, "service_tier": "auto", "parallel_tool_calls": True,
                 "user": "u-1", "tools": None, "": 1, "stream_options_x": {"deep": [1, 2]}}


@pytest.fixture(scope="module")
def client(demo_pair):
    llm = LLM(*demo_pair, device="cpu", max_model_len=96)
    with TestClient(create_app(llm, served_model_name="m")) as client:
        yield client


@pytest.mark.parametrize("path, body", [("/v1/completions", GOOD), ("/v1/chat/completions", CHAT)])
def test_unknown_fields_are_ignored_with_a_warning(client, path, body, caplog):
    plain = client.post(path, json=body)
    with caplog.at_level(logging.WARNING, logger="ddtree.server"):
        extra = client.post(path, json={**body, **CLIENT_FIELDS, f"only_{len(path)}": 1,
                                        "stream_options": None})
    assert plain.status_code == extra.status_code == 200, extra.text
    choice, plain_choice = extra.json()["choices"][0], plain.json()["choices"][0]
    assert choice.get("text", choice.get("message")) == plain_choice.get("text", plain_choice.get("message"))
    warned = " ".join(r.getMessage() for r in caplog.records if "ignored unknown field" in r.getMessage())
    assert f"'only_{len(path)}'" in warned


def test_known_fields_stay_strict(client):
    for field, value in [("max_tokens", "3"), ("temperature", "0"), ("stream", 1), ("seed", -1)]:
        r = client.post("/v1/completions", json={**GOOD, "metadata": {}, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    nested = client.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": "x", "k": 1}]})
    assert nested.status_code == 400 and nested.json()["error"]["param"] == "messages.0.k"
    options = client.post("/v1/completions", json={**GOOD, "stream": True, "stream_options": {"include_usage": 1}})
    assert options.status_code == 400 and options.json()["error"]["param"] == "stream_options.include_usage"
    unsupported = client.post("/v1/completions", json={**GOOD, "presence_penalty": 0.5})
    assert unsupported.status_code == 400 and unsupported.json()["error"]["param"] == "presence_penalty"


def test_each_ignored_name_is_logged_once_and_the_names_are_bounded(caplog):
    ignored = IgnoredFieldLog(max_names=3)
    with caplog.at_level(logging.WARNING, logger="ddtree.server"):
        ignored.note(["a", "b"], "/v1/completions", "r1")
        ignored.note(["a", "b"], "/v1/completions", "r2")  # seen: nothing logged
        ignored.note(["c", "d", "e"], "/v1/completions", "r3")  # c fills the set; d, e are never logged
        ignored.note(["f"], "/v1/completions", "r4")
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and "'a', 'b'" in messages[0]
    assert "'c'" in messages[1] and "'d'" not in messages[1] and "no further" in messages[1]
    ignored.note(["k" * 10_000], "/v1/completions", "r5")
