"""A live `ddtree serve` against the hostile requests of tests/hostile_cases.py (over 600, both generation
endpoints): not one 5xx, not one dropped connection, every refusal a well-formed OpenAI error with a
known code, and greedy outputs identical before and after. While 8 MB bodies of unknown keys arrive,
/health keeps answering within 100 ms."""
from __future__ import annotations

import collections
import json
import statistics
import threading
import time

import httpx
import pytest

from hostile_cases import C, CHAT, KNOWN_CODES, all_cases, unknown_keys_body
from server_process import LiveServer

CASES = all_cases()
STATUSES: collections.Counter = collections.Counter()  # of the hostile requests answered so far
MAX_MODEL_LEN = 128
HEALTH_LIMIT_S = 0.1
# Greedy requests whose outputs must not change across the suite: both endpoints, several budgets, streamed.
GREEDY = [(C, {"prompt": "def fib(n):", "max_tokens": 12, "tree_budget": budget}) for budget in ("ar", "chain", 7, 64)] + [
    (CHAT, {"messages": [{"role": "user", "content": "Write fib."}], "max_tokens": 12}),
    (C, {"prompt": "import os\n", "max_tokens": 12, "stream": True})]


@pytest.fixture(scope="module")
def server(demo_pair):
    with LiveServer(*demo_pair, max_model_len=MAX_MODEL_LEN) as live:
        yield live


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:  # each request sends its own key
        yield client


def greedy_ids(http: httpx.Client, server: LiveServer, path: str, body: dict) -> list[int]:
    body = {**body, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    response = http.post(path, json=body, headers=server.headers)
    assert response.status_code == 200, response.text
    if body.get("stream"):
        chunks = [json.loads(line[6:]) for line in response.text.split("\n") if line.startswith("data: {")]
        return [t for chunk in chunks for t in chunk["choices"][0]["token_ids"]]
    return response.json()["choices"][0]["token_ids"]


@pytest.fixture(scope="module")
def greedy_before(http, server):
    return [greedy_ids(http, server, path, body) for path, body in GREEDY]


def test_the_suite_covers_both_endpoints():
    assert len({case.id for case in CASES}) == len(CASES) >= 600
    assert sum(case.path == C for case in CASES) >= 300 and sum(case.path == CHAT for case in CASES) >= 300


def send(http: httpx.Client, server: LiveServer, case) -> httpx.Response:
    headers = {"content-type": "application/json", **{k.lower(): v for k, v in server.headers.items()}}
    headers.update({k.lower(): v for k, v in case.headers.items()})
    headers = {k: v for k, v in headers.items() if v is not None}
    try:
        return http.post(case.path, content=case.content(), headers=headers)
    except httpx.TransportError as exc:
        pytest.fail(f"{case.id}: the connection was dropped ({type(exc).__name__}: {exc})")


def check(case, response: httpx.Response) -> None:
    status = response.status_code
    assert status < 500, f"{case.id}: {status} {response.text[:500]}"
    assert response.headers.get("x-request-id"), case.id
    if case.status is not None:
        assert status == case.status, f"{case.id}: {status} {response.text[:500]}"
    if status >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, case.id
        assert isinstance(error["message"], str) and error["message"], case.id
        assert error["type"] == "invalid_request_error" and error["code"] in KNOWN_CODES, f"{case.id}: {error}"
        assert len(response.content) < 2000, f"{case.id}: the error echoes the input back"
        if case.code is not None:
            assert error["code"] == case.code, f"{case.id}: {error}"
        if case.param is not ...:
            assert error["param"] == case.param, f"{case.id}: {error}"
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.endswith("data: [DONE]\n\n") and '"error"' not in response.text, case.id
    else:
        assert response.json()["choices"][0]["finish_reason"] in ("stop", "length"), case.id


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_hostile_request(http, server, greedy_before, case):
    response = send(http, server, case)
    STATUSES[response.status_code] += 1
    check(case, response)


def test_health_answers_within_100_ms_while_8_mb_bodies_of_unknown_keys_arrive(server, greedy_before):
    """Four clients send 8.3 MB bodies of 600,000 unknown keys (each at least three, and until /health
    has been polled 40 times) while /health is polled. The machine running the tests is shared and
    small, so a try passes when 95% of the polls answer within 100 ms and their median within 50 ms;
    one try of three must pass. (Before the bounded parser, one such body held /health for seconds.)"""
    body = unknown_keys_body(C)
    assert 8_000_000 < len(body) <= 8 * 1024 * 1024  # parsed, not refused for its size
    headers = {"content-type": "application/json", **server.headers}
    tries = []
    for _ in range(3):
        latencies: list[float] = []
        statuses: list[int] = []
        flooding = threading.Event()

        def flood():
            with httpx.Client(base_url=server.url, timeout=120) as client:
                sent = 0
                while sent < 3 or len(latencies) < 40:
                    statuses.append(client.post(C, content=body, headers=headers).status_code)
                    sent += 1

        def poll():
            with httpx.Client(base_url=server.url, timeout=30) as client:
                while flooding.is_set():
                    start = time.perf_counter()
                    assert client.get("/health").status_code == 200
                    latencies.append(time.perf_counter() - start)
                    time.sleep(0.005)

        flooding.set()
        poller = threading.Thread(target=poll)
        poller.start()
        senders = [threading.Thread(target=flood) for _ in range(4)]
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join()
        flooding.clear()
        poller.join()
        assert len(statuses) >= 12 and set(statuses) == {400}
        latencies.sort()
        p95, median = latencies[int(0.95 * (len(latencies) - 1))], statistics.median(latencies)
        tries.append((round(median, 4), round(p95, 4), round(latencies[-1], 4), len(latencies), len(statuses)))
        print(f"/health during {len(statuses)} x 8.3 MB bodies from 4 clients: median {median * 1000:.1f} ms, "
              f"95th percentile {p95 * 1000:.1f} ms, max {latencies[-1] * 1000:.1f} ms over {len(latencies)} polls")
        if p95 < HEALTH_LIMIT_S and median < HEALTH_LIMIT_S / 2:
            return
    pytest.fail(f"/health was slow in every try (median, 95th percentile, max, polls, bodies): {tries}")


def test_greedy_outputs_identical_after_the_suite(http, server, greedy_before):
    print(f"{sum(STATUSES.values())} hostile requests answered, by status: {dict(sorted(STATUSES.items()))}")
    assert [greedy_ids(http, server, path, body) for path, body in GREEDY] == greedy_before
    assert http.get("/health").json()["status"] == "ok"
