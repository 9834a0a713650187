"""The server's limits in-process: the queue bound (429 + Retry-After), /health on a stalled engine,
the shutdown deadline ending running and queued requests, the tree-budget and stop-list limits,
request ids and generic 500s, and the flags and environment variables of every limit."""
from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
from fastapi.testclient import TestClient

from ddtree.llm import LLM
from ddtree.server.app import create_app
from ddtree.server.limits import ServerLimits
from ddtree.server.protocol import validation_error_body
from ddtree.tree_shape import TreeShape

GOOD = {"prompt": "def f(x):", "max_tokens": 3, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def llm(demo_pair):
    return LLM(*demo_pair, device="cpu", max_model_len=96)


class GatedLLM:
    """A real LLM whose requests wait at `gate` before their first step: one at a time (its
    streams wait) or batched (a request joining the batch waits)."""

    def __init__(self, llm: LLM, batched: bool):
        self.llm = llm
        self.max_num_seqs = llm.max_num_seqs if batched else 1
        self.gate = threading.Event()
        self.started = threading.Event()

    def __getattr__(self, name):
        return getattr(self.llm, name)

    def _wait(self):
        self.started.set()
        self.gate.wait(60)

    def stream(self, prompt, params, tree_budget=None):
        self._wait()
        yield from self.llm.stream(prompt, params, tree_budget)

    def batched(self, max_nodes=None):
        return GatedBatch(self.llm.batched(max_nodes), self._wait)


class GatedBatch:
    def __init__(self, batch, wait):
        self.batch, self.wait = batch, wait

    def __getattr__(self, name):
        return getattr(self.batch, name)

    def add(self, *args):
        self.wait()
        return self.batch.add(*args)

    def begin(self, *args):  # how the server's worker joins a request
        self.wait()
        return self.batch.begin(*args)


MODES = pytest.mark.parametrize("batched", [False, True], ids=["one_at_a_time", "batched"])


async def _asgi_client(app):
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=60)


@MODES
def test_full_queue_is_429_with_retry_after(llm, batched):
    gated = GatedLLM(llm, batched)
    app = create_app(gated, served_model_name="m", limits=ServerLimits(max_queued_requests=2))

    async def run():
        async with await _asgi_client(app) as client:
            first = asyncio.create_task(client.post("/v1/completions", json=GOOD))  # runs, held at the gate
            await asyncio.to_thread(gated.started.wait, 30)
            queued = [asyncio.create_task(client.post("/v1/completions", json=GOOD)) for _ in range(2)]
            while app.state.worker.waiting < 2:
                await asyncio.sleep(0.01)
            refused = await client.post("/v1/completions", json=GOOD)
            gated.gate.set()
            return refused, await first, [await q for q in queued]

    refused, first, queued = asyncio.run(run())
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "queue_full" and "--max-queued-requests" in refused.text
    assert first.status_code == 200 and all(q.status_code == 200 for q in queued)
    app.state.worker.stop(30)


@MODES
def test_health_is_503_while_the_engine_makes_no_progress_with_work(llm, batched):
    gated = GatedLLM(llm, batched)
    app = create_app(gated, served_model_name="m", limits=ServerLimits(engine_stall_timeout=0.3))

    async def run():
        async with await _asgi_client(app) as client:
            idle = await client.get("/health")
            await asyncio.sleep(0.5)
            still_idle = await client.get("/health")  # no work: not stalled however long it waits
            request = asyncio.create_task(client.post("/v1/completions", json=GOOD))
            await asyncio.to_thread(gated.started.wait, 30)
            await asyncio.sleep(0.6)
            stalled = await client.get("/health")
            gated.gate.set()
            done = await request
            return idle, still_idle, stalled, done, await client.get("/health")

    idle, still_idle, stalled, done, after = asyncio.run(run())
    assert idle.status_code == still_idle.status_code == 200
    assert stalled.status_code == 503 and stalled.json()["status"] == "stalled"
    assert "no progress" in stalled.json()["error"] and "--engine-stall-timeout" in stalled.json()["error"]
    assert done.status_code == 200 and after.status_code == 200  # progress again: healthy again
    app.state.worker.stop(30)


@MODES
def test_shutdown_deadline_ends_running_and_queued_requests(llm, batched):
    gated = GatedLLM(llm, batched)
    app = create_app(gated, served_model_name="m")
    worker = app.state.worker

    async def run():
        async with await _asgi_client(app) as client:
            streaming = asyncio.create_task(client.post("/v1/completions", json={**GOOD, "stream": True,
                                                                                 "max_tokens": 60}))
            await asyncio.to_thread(gated.started.wait, 30)
            queued = asyncio.create_task(client.post("/v1/completions", json=GOOD))
            while worker.waiting < 1:
                await asyncio.sleep(0.01)
            ended = worker.abort_all("the server is shutting down (test)")
            gated.gate.set()
            late = await client.post("/v1/completions", json=GOOD)
            return ended, await streaming, await queued, late

    ended, streamed, queued, late = asyncio.run(run())
    assert ended == 2
    lines = [line for line in streamed.text.split("\n") if line]
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][len("data: "):])
    assert last["error"]["code"] == "engine_unavailable" and "shutting down" in last["error"]["message"]
    assert queued.status_code == 503 and queued.json()["error"]["code"] == "engine_unavailable"
    assert late.status_code == 503
    assert worker.stop(30)


def test_tree_budget_and_stop_limits(llm):
    limits = ServerLimits(max_tree_budget=8, max_stop=2, max_stop_chars=5)
    with TestClient(create_app(llm, served_model_name="m", limits=limits)) as client:
        over = client.post("/v1/completions", json={**GOOD, "tree_budget": 9})
        assert over.status_code == 400 and over.json()["error"]["param"] == "tree_budget"
        assert "--max-tree-budget" in over.json()["error"]["message"] and " 8 " in over.json()["error"]["message"]
        assert client.post("/v1/completions", json={**GOOD, "tree_budget": 8}).status_code == 200
        # the server's own default budget (63) is always allowed, named or not
        assert llm.default_budget == TreeShape.best(63)
        assert client.post("/v1/completions", json={**GOOD, "tree_budget": 63}).status_code == 200
        assert client.post("/v1/completions", json={**GOOD, "tree_budget": "63"}).status_code == 200
        assert client.post("/v1/completions", json={**GOOD, "tree_budget": 64}).status_code == 400
        for body, param in (({"stop": ["a", "b", "c"]}, "stop"), ({"stop": "abcdef"}, "stop"),
                            ({"stop_token_ids": [1, 2, 3]}, "stop_token_ids")):
            refused = client.post("/v1/completions", json={**GOOD, **body})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
        assert client.post("/v1/completions", json={**GOOD, "stop": ["ab", "abcde"]}).status_code == 200


def test_request_ids_and_generic_server_errors(llm, monkeypatch):
    with TestClient(create_app(llm, served_model_name="m"), raise_server_exceptions=False) as client:
        ok = client.post("/v1/completions", json=GOOD)
        assert ok.status_code == 200 and ok.json()["id"] == "cmpl-" + ok.headers["x-request-id"]
        for response in (client.get("/health"), client.get("/nope"), client.post("/v1/completions", json={})):
            assert len(response.headers["x-request-id"]) == 32
        monkeypatch.setattr(llm, "prompt_ids", lambda prompt: (_ for _ in ()).throw(TypeError("secret detail")))
        broken = client.post("/v1/completions", json=GOOD)
    assert broken.status_code == 500 and "secret detail" not in broken.text and "TypeError" not in broken.text
    assert broken.headers["x-request-id"] in broken.json()["error"]["message"]
    assert broken.json()["error"]["code"] == "internal_error"


def test_empty_api_key_is_refused():
    with pytest.raises(ValueError, match="empty"):
        create_app(None, served_model_name="m", api_key="")


def test_unknown_keys_are_named_whatever_they_are_called():
    for key in ("", "str", "list[int]", "__proto__"):
        body = validation_error_body([{"type": "extra_forbidden", "loc": (key,), "msg": "x", "input": 1}])["error"]
        assert body["param"] == key and body["code"] == "unsupported_parameter"
    nested = validation_error_body([{"type": "extra_forbidden", "loc": ("messages", 0, ""), "msg": "x", "input": 1}])
    assert nested["error"]["param"] == "messages.0."


def test_every_limit_is_a_flag_and_an_environment_variable(monkeypatch):
    from ddtree.cli import build_parser
    from ddtree.config import DDTreeError
    from ddtree.server.main import LIMIT_FLAGS, limits_from

    assert set(LIMIT_FLAGS) == set(vars(ServerLimits()))
    args = build_parser().parse_args(["serve"])
    assert limits_from(args) == ServerLimits()
    monkeypatch.setenv("DDTREE_MAX_TREE_BUDGET", "256")
    monkeypatch.setenv("DDTREE_READ_TIMEOUT", "2.5")
    args = build_parser().parse_args(["serve", "--max-queued-requests", "3"])
    assert limits_from(args) == ServerLimits(max_tree_budget=256, read_timeout=2.5, max_queued_requests=3)
    with pytest.raises(DDTreeError, match="--max-json-depth"):
        limits_from(build_parser().parse_args(["serve", "--max-json-depth", "0"]))


@pytest.mark.parametrize("argv, fragment", [(["--tree-budget", "600"], "--max-tree-budget 512"),
                                            (["--api-key", " "], "--api-key"),
                                            (["--read-timeout", "0"], "--read-timeout"),
                                            (["--host", "a" * 300], "cannot listen")])
def test_bad_serve_settings_fail_before_anything_starts(argv, fragment):
    from ddtree.cli import build_parser
    from ddtree.config import DDTreeError
    from ddtree.server.main import cmd_serve

    with pytest.raises(DDTreeError, match=fragment):
        cmd_serve(build_parser().parse_args(["serve", "--device", "cpu", *argv]))


def test_long_chats_are_validated_a_slice_at_a_time(llm):
    """Errors in a long `messages` list name the message, as they would validated whole."""
    limits = ServerLimits(max_json_values=100_000)
    messages = [{"role": "user", "content": "x"}] * 1000
    with TestClient(create_app(llm, served_model_name="m", limits=limits)) as client:
        bad = [*messages[:700], {"role": "wizard", "content": "x"}, *messages[701:]]
        refused = client.post("/v1/chat/completions", json={"messages": bad, "max_tokens": 1})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages.700.role"
        extra = [*messages[:300], {"role": "user", "content": "x", "k": 1}]
        refused = client.post("/v1/chat/completions", json={"messages": extra, "max_tokens": 1})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages.300.k"
        # 1000 messages of "x" do not fit in 96 tokens: refused, but only after validating them all
        over = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
        assert over.status_code == 400 and over.json()["error"]["param"] == "prompt"
    from ddtree.server.app import _validated_messages
    from ddtree.server.protocol import ChatCompletionRequest

    varied = [{"role": ("user", "assistant", "system")[i % 3], "content": f"m{i}"} for i in range(600)]
    sliced = asyncio.run(_validated_messages(varied))
    assert ChatCompletionRequest.model_validate({"messages": sliced}) == ChatCompletionRequest.model_validate(
        {"messages": varied})
