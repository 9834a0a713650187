"""Property-based fuzzing of the live server from its own OpenAPI schema (schemathesis): valid and
invalid requests to every operation, none answered with a 5xx, the server healthy afterwards."""
from __future__ import annotations

import collections

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

from server_process import LiveServer

CASES = 240


@pytest.fixture(scope="module")
def server(demo_pair):
    # A short context keeps every valid generated request cheap on a CPU.
    with LiveServer(*demo_pair, max_model_len=48) as live:
        yield live


def test_openapi_schema_fuzzing_never_gets_a_server_error(server):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    statuses: collections.Counter = collections.Counter()
    session = requests.Session()

    def fuzz(case):
        headers = server.headers if sum(statuses.values()) % 8 else {}  # every 8th call without the key
        response = case.call(base_url=server.url, session=session, headers=headers, timeout=120)
        statuses[response.status_code] += 1
        assert response.status_code < 500, f"{case.method} {case.path} -> {response.status_code}: {response.text}"
        if response.status_code >= 400 and case.path.startswith("/v1"):
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}

    for mode, examples in ((GenerationMode.POSITIVE, CASES * 2 // 3), (GenerationMode.NEGATIVE, CASES // 3)):
        run = settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                       phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))(
            given(case=schema.as_strategy(mode))(fuzz))
        run()
    assert sum(statuses.values()) >= 200, statuses
    assert statuses[200] > 0 and statuses[400] > 0 and statuses[401] > 0, statuses
    assert requests.get(server.url + "/health", timeout=10).json()["status"] == "ok"
