"""`ddtree serve` as a process: SIGTERM drains the requests in flight and queued, then exits 0; a bad
model path is one line on stderr and exit code 2."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from server_process import LiveServer, free_port, metric, metric_values, quiet_env


def test_sigterm_drains_in_flight_and_queued_requests_then_exits_0(demo_pair):
    server = LiveServer(*demo_pair, max_model_len=320).wait_ready()
    try:
        http = server.client()
        streamed: dict = {"lines": [], "first": threading.Event()}
        queued: dict = {}

        def stream():
            body = {"prompt": "def g(x):", "max_tokens": 300, "temperature": 0, "ignore_eos": True,
                    "tree_budget": "ar", "stream": True}
            with server.client() as client, client.stream("POST", "/v1/completions", json=body) as response:
                for line in response.iter_lines():
                    if line:
                        streamed["lines"].append(line)
                        streamed["first"].set()

        def wait_in_queue():
            with server.client() as client:
                queued["response"] = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 5,
                                                                          "ignore_eos": True})

        streaming = threading.Thread(target=stream)
        streaming.start()
        assert streamed["first"].wait(60)
        waiting = threading.Thread(target=wait_in_queue)
        waiting.start()
        deadline = time.monotonic() + 30
        while metric(metric_values(http.get("/metrics").text), "vllm:num_requests_waiting") < 1:
            assert time.monotonic() < deadline, "the second request never queued"
            time.sleep(0.02)
        server.proc.send_signal(signal.SIGTERM)
        streaming.join(120)
        waiting.join(120)
        assert server.proc.wait(60) == 0, server.output()

        assert streamed["lines"][-1] == "data: [DONE]"
        chunks = [json.loads(line[len("data: "):]) for line in streamed["lines"][:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["ddtree"]["decode_rounds"] == 299
        assert queued["response"].status_code == 200
        assert queued["response"].json()["usage"]["completion_tokens"] == 5
        with pytest.raises(httpx.TransportError):
            httpx.get(server.url + "/health", timeout=5)
    finally:
        server.kill()


def test_bad_model_path_is_one_line_and_exit_2(tmp_path):
    cmd = [sys.executable, "-m", "ddtree.cli", "serve", "--target", str(tmp_path / "missing"),
           "--port", str(free_port()), "--device", "cpu", "--log-level", "error"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=quiet_env())
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("ddtree: error:")]
    assert len(errors) == 1 and "missing" in errors[0]


def test_bad_tree_budget_flag_fails_before_serving():
    cmd = [sys.executable, "-m", "ddtree.cli", "serve", "--tree-budget", "wide", "--port", str(free_port())]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=quiet_env())
    assert out.returncode == 2 and "tree budget" in out.stderr
