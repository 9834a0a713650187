"""The server in-process: loading and engine-failure states, the API key, cancellation within one
round, the request models and the metric arithmetic."""
from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time

import pytest
from fastapi.testclient import TestClient

from ddtree.config import DDTreeError, SamplingParams
from ddtree.llm import LLM
from ddtree.server.app import create_app
from ddtree.server.metrics import ServerMetrics, batch_size_bucket
from ddtree.server.protocol import ChatCompletionRequest, CompletionRequest, validation_error_body
from ddtree.server.worker import EngineWorker, Job
from ddtree.tree_shape import AR, CHAIN, TreeShape
from server_process import metric, metric_values

GOOD = {"prompt": "def f(x):", "max_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def llm(demo_pair):
    return LLM(*demo_pair, device="cpu", max_model_len=96)


def test_health_is_503_while_loading_then_200(llm):
    app = create_app(None, served_model_name="late")
    with TestClient(app) as client:
        assert client.get("/health").status_code == 503
        assert client.get("/health").json() == {"status": "loading"}
        busy = client.post("/v1/completions", json=GOOD)
        assert busy.status_code == 503 and busy.json()["error"]["code"] == "engine_unavailable"
        assert client.get("/v1/models").json()["data"][0]["id"] == "late"
        app.state.worker.attach(llm)
        health = client.get("/health").json()
        assert health["status"] == "ok" and health["tree_budget"] == str(llm.default_budget)
        assert health["max_model_len"] == 96 and health["tree_budget_mode"] == "fixed"
        assert health["max_num_seqs"] == llm.max_num_seqs == 8  # a CPU's default: batched
        out = client.post("/v1/completions", json={**GOOD, "model": "late"})
        assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 4


def broken_llm(demo_pair, batched: bool) -> LLM:
    """An LLM whose rounds fail after the prefill, decoding one request at a time or batched."""
    broken = LLM(*demo_pair, device="cpu", max_model_len=96, max_num_seqs=8 if batched else 1)

    def failing_walk(tree, choices):
        raise RuntimeError("device lost")

    if batched:
        broken.batched().engine.walk_fn = failing_walk
    else:
        broken.engine.walk_fn = failing_walk
    return broken


MODES = pytest.mark.parametrize("batched", [False, True], ids=["one_at_a_time", "batched"])


@MODES
def test_engine_failure_is_a_500_then_503_and_reported(demo_pair, batched):
    broken = broken_llm(demo_pair, batched)
    deaths = []
    app = create_app(broken, on_engine_death=deaths.append)
    with TestClient(app, raise_server_exceptions=False) as client:
        first = client.post("/v1/completions", json=GOOD)
        assert first.status_code == 500 and first.json()["error"]["type"] == "server_error"
        # The client gets the request id to quote, never the internal message (the log has it).
        request_id = first.headers["x-request-id"]
        assert request_id in first.json()["error"]["message"] and "device lost" not in first.text
        assert first.json()["error"]["code"] == "internal_error"
        # The engine thread reports the death after the failures it emits (`EngineWorker._fail`),
        # so the response may arrive first.
        deadline = time.monotonic() + 10
        while not deaths and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(deaths) == 1 and "device lost" in str(deaths[0])
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "error"
        assert request_id in health.json()["error"] and "device lost" not in health.text
        again = client.post("/v1/completions", json={**GOOD, "stream": True})
        assert again.status_code == 503 and again.json()["error"]["code"] == "engine_unavailable"


@MODES
def test_engine_failure_mid_stream_ends_with_an_error_chunk(demo_pair, batched):
    broken = broken_llm(demo_pair, batched)  # the prefill's token streams, the first round fails
    app = create_app(broken, on_engine_death=lambda exc: None)
    with TestClient(app) as client:
        response = client.post("/v1/completions", json={**GOOD, "stream": True})
        assert response.status_code == 200
        lines = [line for line in response.text.split("\n") if line]
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
        assert len(chunks) == 2 and chunks[0]["choices"][0]["finish_reason"] is None  # the prefill's token
        assert chunks[-1]["error"]["type"] == "server_error" and "device lost" not in response.text
        assert response.headers["x-request-id"] in chunks[-1]["error"]["message"]
        assert client.get("/health").status_code == 503


class RecordedWrites:
    """The app, with every response body write it makes recorded (one string each)."""

    def __init__(self, app):
        self.app, self.writes, self.body_messages = app, [], []

    async def __call__(self, scope, receive, send):
        async def recording(message):
            if message["type"] == "http.response.body":
                self.body_messages.append(message)
                if message.get("body"):
                    self.writes.append(message["body"].decode())
            await send(message)
        await self.app(scope, receive, recording)


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0,
                              "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}),
    ("/v1/completions", {**GOOD, "stream": True}),
], ids=["chat_with_usage", "completion"])
def test_a_stream_ends_in_one_write(llm, path, body):
    """The last event's chunk, the usage chunk and "data: [DONE]" leave in one write, which also ends
    the body (so the chunked encoding's terminator goes with it); every other write holds one chunk
    (the role, then one per engine step)."""
    app = RecordedWrites(create_app(llm))
    with TestClient(app) as client:
        response = client.post(path, json=body)
    assert response.status_code == 200
    writes = app.writes
    assert "".join(writes) == response.text
    last = [line for line in writes[-1].split("\n") if line]
    assert last[-1] == "data: [DONE]"
    assert app.body_messages[-1]["body"].decode() == writes[-1] and not app.body_messages[-1]["more_body"]
    assert all(message["more_body"] for message in app.body_messages[:-1])
    final = [json.loads(line[len("data: "):]) for line in last[:-1]]
    assert final[0]["choices"][0]["finish_reason"] == "length"
    if "stream_options" in body:
        assert len(final) == 2 and final[1]["choices"] == [] and final[1]["usage"]["completion_tokens"] == 5
    else:
        assert len(final) == 1
    for write in writes[:-1]:
        lines = [line for line in write.split("\n") if line]
        assert len(lines) == 1 and json.loads(lines[0][len("data: "):])["choices"][0]["finish_reason"] is None


def test_api_key_guards_v1_only(llm):
    app = create_app(llm, served_model_name="guarded", api_key="sk-right")
    with TestClient(app) as client:
        assert client.get("/v1/models").status_code == 401
        assert client.get("/v1/models", headers={"Authorization": "Bearer sk-wrong"}).status_code == 401
        assert client.get("/v1/models", headers={"Authorization": "sk-right"}).status_code == 401
        assert client.get("/v1/models", headers={"Authorization": "Bearer sk-right"}).status_code == 200
        for open_path in ("/health", "/metrics", "/version"):
            assert client.get(open_path).status_code == 200


class CountingLLM:
    """A real LLM whose stream cancels the job right after step `cancel_at` and counts the steps the
    worker asks for, to show that nothing runs after the round in progress."""

    max_num_seqs = 1  # one request at a time: the worker reads `stream`

    def __init__(self, llm: LLM, cancel_at: int):
        self.llm, self.cancel_at = llm, cancel_at
        self.job: Job | None = None
        self.steps = 0
        self.closed = False

    def __getattr__(self, name):
        return getattr(self.llm, name)

    def stream(self, prompt, params, tree_budget=None):
        try:
            for event in self.llm.stream(prompt, params, tree_budget):
                self.steps += 1
                if self.steps == self.cancel_at:
                    self.job.cancel()  # the client hangs up while this round runs
                yield event
        finally:
            self.closed = True


def run_cancelled_job(llm, wrapped, watcher) -> tuple[list, ServerMetrics]:
    """One 60-token job through a worker serving `wrapped`; `watcher.job` is set to it, so that the
    watcher can cancel it. -> the job's events and the worker's metrics, once the worker stopped."""
    metrics = ServerMetrics("m")
    worker = EngineWorker(metrics)
    worker.attach(wrapped)

    async def run():
        params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
        job = Job(llm.prompt_ids("def f(x):"), params, AR, asyncio.get_running_loop())
        watcher.job = job
        worker.submit(job)
        await asyncio.to_thread(worker.stop, 60)  # the thread ends once the job has stopped
        await asyncio.sleep(0)  # deliver the events it scheduled on this loop
        events = []
        while not job.events.empty():
            events.append(job.events.get_nowait())
        return events

    return asyncio.run(run()), metrics


def test_cancelled_job_stops_within_one_round(llm):
    counting = CountingLLM(llm, cancel_at=3)
    events, metrics = run_cancelled_job(llm, counting, counting)
    assert counting.steps == 3 and counting.closed
    assert len(events) == 3 and all(e.result is None for e in events)
    values = metric_values(metrics.render()[0].decode())
    assert metric(values, "vllm:request_success_total", finished_reason="abort") == 1
    assert metric(values, "vllm:generation_tokens_total") == sum(len(e.token_ids) for e in events) == 3


class CountingBatch:
    """A real batch (`LLM.batched`) that cancels its one job right after round `cancel_at` and
    counts the rounds the worker asks for."""

    def __init__(self, batch, cancel_at: int):
        self.batch, self.cancel_at = batch, cancel_at
        self.job: Job | None = None
        self.rounds = 0

    def __getattr__(self, name):
        return getattr(self.batch, name)

    def step(self):
        events = self.batch.step()
        self.rounds += 1
        if self.rounds == self.cancel_at:
            self.job.cancel()  # the client hangs up while this round runs
        return events


class BatchedCountingLLM:
    def __init__(self, llm: LLM, cancel_at: int):
        self.llm = llm
        self.batch = CountingBatch(llm.batched(), cancel_at)

    def __getattr__(self, name):
        return getattr(self.llm, name)

    def batched(self, max_nodes=None):
        return self.batch


@pytest.mark.parametrize("max_num_seqs", [1, 4])
def test_a_finished_job_is_counted_by_the_time_its_client_can_ask(demo_pair, max_num_seqs):
    """A job's last event goes out before its metrics are recorded (its client waits for no
    bookkeeping), yet /metrics read by a client that has its answer already counts it."""
    llm = LLM(*demo_pair, device="cpu", max_model_len=96, max_num_seqs=max_num_seqs)
    worker = EngineWorker(ServerMetrics("m"))
    worker.attach(llm)
    texts, readers = [], []

    def read_metrics():
        texts.append(worker.render_metrics()[0].decode())

    def sink(pairs):  # the client's side: once it has the answer, it asks for /metrics
        for _, item in pairs:
            if item.result is not None:
                readers.append(threading.Thread(target=read_metrics))
                readers[-1].start()
                readers[-1].join(0.2)  # time enough to read them, were the recording not waited for

    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    worker.submit(Job(llm.prompt_ids("def f(x):"), params, AR, None, sink=sink))
    assert worker.stop(60)
    readers[0].join(10)
    values = metric_values(texts[0])
    assert metric(values, "vllm:request_success_total", finished_reason="length") == 1
    assert metric(values, "vllm:generation_tokens_total") == 5


def test_cancelled_batched_job_leaves_before_the_next_round(llm):
    counting = BatchedCountingLLM(llm, cancel_at=2)
    assert llm.max_num_seqs > 1
    events, metrics = run_cancelled_job(llm, counting, counting.batch)
    # The prefill's event, then the two rounds' events; the job left the batch before a third.
    assert counting.batch.rounds == 2 and not counting.batch.running and counting.batch.free == llm.max_num_seqs
    assert len(events) == 3 and all(e.result is None for e in events)
    values = metric_values(metrics.render()[0].decode())
    assert metric(values, "vllm:request_success_total", finished_reason="abort") == 1


def test_request_defaults_follow_openai():
    completion = CompletionRequest.model_validate({"prompt": [[5, 6]]})
    params = completion.sampling_params(default_max_tokens=16)
    assert completion.single_prompt() == [5, 6]
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (16, 1.0, 1.0, 0)
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "top_k": -1,
                                                 "max_tokens": 9, "max_completion_tokens": 5, "stop": "END"})
    params = chat.sampling_params(default_max_tokens=100)
    assert (params.max_tokens, params.top_k, params.stop) == (5, 0, ["END"])
    neutral = {"prompt": "x", "presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1,
               "logit_bias": {}, "echo": False, "logprobs": 0, "best_of": 1, "user": "u", "max_tokens": 3.0}
    assert CompletionRequest.model_validate(neutral).sampling_params(16).max_tokens == 3


def test_validation_errors_name_the_field():
    body = validation_error_body([{"type": "greater_than_equal", "loc": ("body", "messages", 0, "role"),
                                   "msg": "bad role", "input": "wizard"}])
    assert body["error"]["param"] == "messages.0.role" and "wizard" in body["error"]["message"]
    union = validation_error_body([{"type": "string_type", "loc": ("body", "stop", "list[str]", 0),
                                    "msg": "Input should be a valid string", "input": 1}])
    assert union["error"]["param"] == "stop.0"
    assert validation_error_body([{"type": "extra_forbidden", "loc": ("body", "tools"), "msg": "x", "input": []}])[
        "error"]["code"] == "unsupported_parameter"


def test_round_counters():
    metrics = ServerMetrics("m")
    metrics.record_rounds([1, 3, 2], draft_tokens=12)
    metrics.record_rounds([1], draft_tokens=0, ar_rounds=1)  # "ar": no drafts
    # A request whose batch chose per round: two "ar" rounds (length 1) among three drafted ones.
    metrics.record_rounds([1, 4, 1, 1, 2], draft_tokens=3 * 16, ar_rounds=2)
    values = metric_values(metrics.render()[0].decode())
    assert metric(values, "vllm:spec_decode_num_drafts_total") == 3 + 3
    assert metric(values, "vllm:spec_decode_num_draft_tokens_total") == 12 + 48
    assert metric(values, "vllm:spec_decode_num_accepted_tokens_total") == 3 + 4
    assert metric(values, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0") == 2 + 2
    assert metric(values, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="1") == 1 + 1
    assert metric(values, "ddtree:acceptance_length_count") == 3 + 3


def test_batch_round_counters():
    metrics = ServerMetrics("m")
    metrics.record_batch_round([AR, AR, TreeShape.best(16)])
    metrics.record_batch_round([AR])
    metrics.set_batch_acceptance({("greedy", "16"): 4.5})
    values = metric_values(metrics.render()[0].decode())
    assert metric(values, "ddtree:batch_rounds_total", tree_budget="ar", batch_size="3-4") == 2
    assert metric(values, "ddtree:batch_rounds_total", tree_budget="16", batch_size="3-4") == 1
    assert metric(values, "ddtree:batch_rounds_total", tree_budget="ar", batch_size="1") == 1
    assert metric(values, "ddtree:batch_budget_acceptance", temperature_bucket="greedy", tree_budget="16") == 4.5
    assert [batch_size_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [
        "1", "2", "3-4", "3-4", "5-8", "5-8", "9-16", "9-16", "17-32"]


def test_auto_tree_budget_is_measured_and_reported(demo_pair, monkeypatch):
    import ddtree.bench.tune as tune
    from ddtree.server.main import _load

    calls = []

    def fake_resolve(llm, draft_dir, log):
        calls.append(draft_dir)
        log("measured")
        return {"greedy": TreeShape.best(7), "t<=0.4": TreeShape.best(7), "t<=0.8": CHAIN, "t>0.8": AR}

    monkeypatch.setattr(tune, "resolve_auto_budgets", fake_resolve)
    args = argparse.Namespace(target=str(demo_pair[0]), draft=str(demo_pair[1]), device="cpu", dtype=None,
                              max_model_len=96)
    loaded = _load(args, "auto")
    assert calls == [demo_pair[1]] and loaded.default_budget == TreeShape.best(7)
    app = create_app(loaded, tree_budget_mode="auto")
    with TestClient(app) as client:
        health = client.get("/health").json()
        assert health["tree_budget"] == "7" and health["tree_budget_mode"] == "auto"
        values = metric_values(client.get("/metrics").text)
        assert metric(values, "ddtree:tree_budget") == 7
        assert metric(values, "ddtree:auto_tree_budget", temperature_bucket="t>0.8", tree_budget="ar") == 1


def test_serve_flags_and_environment(monkeypatch):
    from ddtree.cli import build_parser

    monkeypatch.setenv("DDTREE_PORT", "9123")
    monkeypatch.setenv("DDTREE_TREE_BUDGET", "chain")
    monkeypatch.setenv("DDTREE_API_KEY", "sk-env")
    args = build_parser().parse_args(["serve", "--host", "0.0.0.0"])
    assert (args.port, args.tree_budget, args.api_key, args.host) == (9123, "chain", "sk-env", "0.0.0.0")
    args = build_parser().parse_args(["serve", "--port", "1", "--tree-budget", "auto"])
    assert (args.port, args.tree_budget) == (1, "auto")


def test_serve_warmup_flag_and_environment(monkeypatch):
    from ddtree.cli import build_parser
    from ddtree.server.main import flag_enabled

    assert build_parser().parse_args(["serve"]).warmup is False
    assert build_parser().parse_args(["serve", "--warmup"]).warmup is True
    monkeypatch.setenv("DDTREE_WARMUP", "1")
    assert flag_enabled(build_parser().parse_args(["serve"]).warmup, "warmup") is True
    assert flag_enabled("off", "warmup") is False and flag_enabled(" Yes ", "warmup") is True
    with pytest.raises(DDTreeError, match="DDTREE_WARMUP must be one of"):
        flag_enabled("maybe", "warmup")


def test_load_with_warmup_prepares_the_default_budget(demo_pair):
    """With one request at a time, --warmup runs `LLM.warmup` on the default budget before serving
    (on CUDA: captures every graph); without it nothing is prepared until a request arrives."""
    from ddtree.server.main import _load

    args = argparse.Namespace(target=str(demo_pair[0]), draft=str(demo_pair[1]), device="cpu", dtype=None,
                              max_model_len=96, max_num_seqs=1)
    cold = _load(args, CHAIN)
    assert cold.engine.buffers == {}
    warm = _load(args, CHAIN, warmup=True)
    assert list(warm.engine.buffers) == [CHAIN]


def test_load_with_warmup_and_max_num_seqs_captures_the_batched_rounds(demo_pair, monkeypatch):
    """With --max-num-seqs above 1 every request decodes in the batch, so --warmup captures the
    batched engine's rounds (`BatchEngine.capture_all`, on the batch the worker will step), not
    the one-request engine's."""
    from ddtree.batch_engine import BatchEngine
    from ddtree.server.main import _load
    from ddtree.server.worker import batch_max_nodes

    calls = []
    monkeypatch.setattr(BatchEngine, "capture_all", lambda engine, budgets: calls.append((engine, budgets)) or 0)
    args = argparse.Namespace(target=str(demo_pair[0]), draft=str(demo_pair[1]), device="cpu", dtype=None,
                              max_model_len=96, max_num_seqs=2)
    warm = _load(args, CHAIN, warmup=True, max_tree_budget=32)
    assert [budgets for _, budgets in calls] == [[CHAIN]]
    assert calls[0][0] is warm.batched(batch_max_nodes(warm, 32)).engine  # the worker's batch, not a new one
    assert warm.engine.buffers == {}


def test_small_bodies_are_tokenized_on_the_loop_and_large_ones_in_a_worker_thread(llm, monkeypatch):
    """A body up to INLINE_PREPARE_BYTES is templated and tokenized on the event loop (no hop to a
    worker thread and back before its first token); a larger one in a worker thread, so that a
    long prompt never holds the loop. Both get the same answer."""
    from ddtree.server import app as app_module

    on_loop = []  # per request: whether its prompt was encoded on the event loop's thread
    encode = llm.prompt_ids

    def recording(prompt):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:  # a worker thread runs no loop
            on_loop.append(False)
        return encode(prompt)
    monkeypatch.setattr(llm, "prompt_ids", recording)
    padding = " " * (app_module.INLINE_PREPARE_BYTES + 1)  # JSON whitespace: the same request, a larger body
    small = json.dumps(GOOD)
    large = small[:-1] + padding + "}"
    with TestClient(create_app(llm)) as client:
        answers = [client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
                   for body in (small, large)]
    assert [a.status_code for a in answers] == [200, 200]
    assert answers[0].json()["choices"][0]["text"] == answers[1].json()["choices"][0]["text"]
    assert on_loop == [True, False]
