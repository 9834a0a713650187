"""Many clients at once against a live server: 32 concurrent streams all complete, each exactly equal
to the same request served alone; /metrics agrees with the responses' `ddtree` stats; a client that
disconnects mid-stream stops its generation."""
from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from server_process import API_KEY, LiveServer, metric, metric_values

CLIENTS = 32
BUDGETS = ["ar", "chain", 3, 16, 64]
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def server(demo_pair):
    with LiveServer(*demo_pair, max_model_len=MAX_MODEL_LEN) as live:
        yield live


def request_for(i: int, model: str) -> tuple[str, dict]:
    """Client i's request: completions or chat, its own prompt, length and tree budget."""
    extra = {"ignore_eos": True, "return_token_ids": True, "tree_budget": BUDGETS[i % len(BUDGETS)]}
    common = dict(model=model, max_tokens=6 + (i * 7) % 29, temperature=0, extra_body=extra)
    if i % 2:
        return "chat", {**common, "messages": [{"role": "user", "content": f"task {i}: sort a list"}]}
    return "completions", {**common, "prompt": f"def f{i}(x):\n    return"}


async def one_stream(client: openai.AsyncOpenAI, kind: str, kwargs: dict) -> dict:
    api = client.chat.completions if kind == "chat" else client.completions
    stream = await api.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    ids, text, chunk_ids, usage, stats, finish = [], "", set(), None, None, None
    async for chunk in stream:
        chunk_ids.add(chunk.id)
        if chunk.usage is not None:
            usage = chunk.usage
            continue
        choice = chunk.choices[0]
        ids += choice.model_extra.get("token_ids", [])
        text += (choice.delta.content or "") if kind == "chat" else choice.text
        if choice.finish_reason is not None:
            finish, stats = choice.finish_reason, chunk.model_extra["ddtree"]
    return {"ids": ids, "text": text, "chunk_ids": chunk_ids, "usage": usage, "stats": stats, "finish": finish}


def alone(client: openai.OpenAI, kind: str, kwargs: dict) -> dict:
    out = (client.chat.completions if kind == "chat" else client.completions).create(**kwargs)
    choice = out.choices[0]
    text = choice.message.content if kind == "chat" else choice.text
    return {"ids": choice.model_extra["token_ids"], "text": text, "usage": out.usage,
            "stats": out.model_extra["ddtree"], "finish": choice.finish_reason}


def test_concurrent_streams_complete_and_metrics_agree(server):
    requests = [request_for(i, server.model) for i in range(CLIENTS)]
    sync = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
    references = [alone(sync, kind, kwargs) for kind, kwargs in requests]
    before = metric_values(server.client().get("/metrics").text)

    async def run_all():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
        try:
            return await asyncio.gather(*(one_stream(client, kind, kwargs) for kind, kwargs in requests))
        finally:
            await client.close()

    results = asyncio.run(run_all())
    after = metric_values(server.client().get("/metrics").text)

    seen_ids = set()
    for (kind, kwargs), got, ref in zip(requests, results, references):
        assert got["ids"] == ref["ids"] and len(got["ids"]) == kwargs["max_tokens"]
        assert got["text"] == ref["text"]
        assert got["usage"].completion_tokens == len(got["ids"]) == ref["usage"].completion_tokens
        assert got["usage"].prompt_tokens == ref["usage"].prompt_tokens
        assert got["finish"] == "length"
        assert got["stats"]["acceptance_lengths"] == ref["stats"]["acceptance_lengths"]
        assert got["stats"]["tree_budget"] == str(kwargs["extra_body"]["tree_budget"])
        assert len(got["chunk_ids"]) == 1 and not (got["chunk_ids"] & seen_ids)
        seen_ids |= got["chunk_ids"]

    # /metrics, parsed by prometheus_client, agrees with the responses' ddtree stats
    block_size = server.client().get("/health").json()["block_size"]

    def delta(name, **labels):
        return metric(after, name, model_name=server.model, **labels) - metric(before, name, model_name=server.model,
                                                                               **labels)

    drafted = [(r["stats"], kw["extra_body"]["tree_budget"]) for (_, kw), r in zip(requests, results)
               if kw["extra_body"]["tree_budget"] != "ar"]
    rounds = [a for stats, _ in drafted for a in stats["acceptance_lengths"]]
    nodes = {"chain": block_size - 1}
    assert delta("vllm:spec_decode_num_drafts_total") == sum(s["decode_rounds"] for s, _ in drafted) == len(rounds)
    assert delta("vllm:spec_decode_num_draft_tokens_total") == sum(
        s["decode_rounds"] * nodes.get(b, b) for s, b in drafted)
    assert delta("vllm:spec_decode_num_accepted_tokens_total") == sum(a - 1 for a in rounds)
    for position in range(block_size):
        assert delta("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(position)) == sum(
            1 for a in rounds if a - 1 > position)
    assert delta("ddtree:acceptance_length_count") == len(rounds)
    assert delta("ddtree:acceptance_length_sum") == sum(rounds)
    assert delta("vllm:generation_tokens_total") == sum(r["usage"].completion_tokens for r in results)
    assert delta("vllm:prompt_tokens_total") == sum(r["usage"].prompt_tokens for r in results)
    assert delta("vllm:request_success_total", finished_reason="length") == CLIENTS
    assert delta("vllm:time_to_first_token_seconds_count") == CLIENTS
    assert delta("vllm:e2e_request_latency_seconds_count") == CLIENTS
    accepted, drafts = delta("vllm:spec_decode_num_accepted_tokens_total"), delta("vllm:spec_decode_num_drafts_total")
    mean = sum(s["mean_acceptance_length"] * s["decode_rounds"] for s, _ in drafted) / len(rounds)
    assert 1 + accepted / drafts == pytest.approx(mean)
    assert metric(after, "ddtree:tree_budget", model_name=server.model) == 63  # the default budget
    assert metric(after, "vllm:num_requests_running") == 0 and metric(after, "vllm:num_requests_waiting") == 0


def test_client_disconnect_stops_generation(server):
    http = server.client()
    before = metric_values(http.get("/metrics").text)
    body = {"prompt": "def g(x):", "max_tokens": MAX_MODEL_LEN - 16, "temperature": 0, "ignore_eos": True,
            "tree_budget": "ar", "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")  # generation has started; now hang up
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        after = metric_values(http.get("/metrics").text)
        if metric(after, "vllm:request_success_total", finished_reason="abort") > metric(
                before, "vllm:request_success_total", finished_reason="abort"):
            break
        time.sleep(0.05)
    else:
        pytest.fail("the disconnected request was never aborted")
    generated = metric(after, "vllm:generation_tokens_total") - metric(before, "vllm:generation_tokens_total")
    assert 1 <= generated < body["max_tokens"]
    assert metric(after, "vllm:request_success_total", finished_reason="length") == metric(
        before, "vllm:request_success_total", finished_reason="length")
    # and the server carries on
    ok = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_a_client_that_stops_reading_at_done_keeps_its_connection(server):
    """A stream's last chunk, "data: [DONE]" and the end of the body leave in one write, so that a
    client which stops reading at [DONE] (as `ddtree bench` did, as many do) finds the response
    complete and sends its next request on the same connection. aiohttp drops a connection whose
    response it left unfinished: with the body's end written apart, about half of these requests
    opened a new one."""
    import aiohttp

    async def run() -> int:
        opened = 0

        async def on_open(session, context, params):
            nonlocal opened
            opened += 1

        trace = aiohttp.TraceConfig()
        trace.on_connection_create_end.append(on_open)
        async with aiohttp.ClientSession(server.url, headers=server.headers, trace_configs=[trace]) as session:
            for i in range(12):
                body = {"prompt": f"def f{i}(x):", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                        "stream": True, "stream_options": {"include_usage": True}}
                async with session.post("/v1/completions", json=body) as response:
                    assert response.status == 200
                    async for line in response.content:
                        if line.strip() == b"data: [DONE]":
                            break
        return opened

    assert asyncio.run(run()) == 1


def test_requests_wait_for_cache_room_and_equal_their_solo_runs(demo_pair):
    """A KV cache of 800 slots: a request of 200 tokens holds a region of about 230, so three run at
    once and the others wait in the queue (not refused) for room; every stream equals the same
    request served alone, and /metrics reports the cache's share in use."""
    with LiveServer(*demo_pair, "--kv-cache-tokens", "800", "--max-tree-budget", "64",
                    max_model_len=MAX_MODEL_LEN) as live:
        kwargs = [dict(model=live.model, prompt=f"def h{i}(x):", max_tokens=200, temperature=0,
                       extra_body={"ignore_eos": True, "return_token_ids": True, "tree_budget": 16})
                  for i in range(6)]
        sync = openai.OpenAI(base_url=live.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
        references = [alone(sync, "completions", kw) for kw in kwargs]
        peak = []

        async def run_all():
            client = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)

            async def watch():  # the running count while the streams go
                async with httpx.AsyncClient(base_url=live.url) as http:
                    while True:
                        peak.append(metric(metric_values((await http.get("/metrics")).text),
                                           "vllm:num_requests_running"))
                        await asyncio.sleep(0.05)

            watcher = asyncio.create_task(watch())
            try:
                return await asyncio.gather(*(one_stream(client, "completions", kw) for kw in kwargs))
            finally:
                watcher.cancel()
                await client.close()

        results = asyncio.run(run_all())
        for got, ref in zip(results, references):
            assert got["ids"] == ref["ids"] and len(got["ids"]) == 200 and got["finish"] == "length"
        assert 1 <= max(peak) <= 3
        after = metric_values(live.client().get("/metrics").text)
        assert metric(after, "vllm:gpu_cache_usage_perc", model_name=live.model) == 0
        assert metric(after, "vllm:num_requests_waiting") == 0
