"""`ddtree serve` as a process: SIGTERM drains the requests in flight and queued, then exits 0; an
engine failure turns /health 503 before the process exits 1; a bad model path, a port in use, a host
that does not resolve or a bad limit is one line on stderr and exit code 2."""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from server_process import LiveServer, free_port, metric, metric_values, quiet_env


# One at a time the second request waits in the queue; batched it joins the first's batch. Either
# way SIGTERM lets both finish. (Batched, a short second request could finish before it is seen
# running, so it asks for more tokens.)
DRAIN_MODES = pytest.mark.parametrize("max_num_seqs, seen, second_tokens", [
    (1, ("vllm:num_requests_waiting", 1), 5), (8, ("vllm:num_requests_running", 2), 40)], ids=["queued", "batched"])


@DRAIN_MODES
def test_sigterm_drains_in_flight_and_queued_requests_then_exits_0(demo_pair, max_num_seqs, seen, second_tokens):
    server = LiveServer(*demo_pair, "--max-num-seqs", str(max_num_seqs), max_model_len=320).wait_ready()
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
                queued["response"] = client.post("/v1/completions", json={"prompt": "x", "max_tokens": second_tokens,
                                                                          "ignore_eos": True, "tree_budget": "ar"})

        streaming = threading.Thread(target=stream)
        streaming.start()
        assert streamed["first"].wait(60)
        waiting = threading.Thread(target=wait_in_queue)
        waiting.start()
        deadline = time.monotonic() + 30
        while metric(metric_values(http.get("/metrics").text), seen[0]) < seen[1]:
            assert time.monotonic() < deadline, f"the second request never showed in {seen[0]}"
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
        assert queued["response"].json()["usage"]["completion_tokens"] == second_tokens
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


# Runs `ddtree serve` with an engine whose rounds fail, as a GPU fault would make them.
FAILING_ENGINE = """
import sys
import ddtree.batch_engine
import ddtree.engine

def failing_back(self, *args):
    raise RuntimeError("device lost (injected by the test)")

ddtree.engine.Engine._back = failing_back  # one request at a time
ddtree.batch_engine.BatchEngine.step = failing_back  # batched (the CPU's default): per-row rounds
ddtree.batch_engine.BatchEngine.launch = failing_back  # and fixed-shape ones
from ddtree.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_engine_failure_is_503_on_health_before_exit_1(demo_pair):
    delay = 3.0
    # A fixed budget: no round costs are timed at start-up, whose rounds would meet the failure.
    server = LiveServer(*demo_pair, "--failure-exit-delay", str(delay), "--log-level", "info", "--tree-budget", "16",
                        api_key=None, launcher=("-c", FAILING_ENGINE)).wait_ready()
    try:
        failed = httpx.post(server.url + "/v1/completions", json={"prompt": "def f(x):", "max_tokens": 8}, timeout=60)
        failed_at = time.monotonic()
        health = []
        while server.proc.poll() is None:
            try:
                response = httpx.get(server.url + "/health", timeout=5)
                health.append((response.status_code, response.json()))
            except httpx.TransportError:
                pass  # the port closes as the server exits
            time.sleep(0.1)
        exited_after = time.monotonic() - failed_at
        print(f"engine failure: /health answered {[status for status, _ in health].count(503)} times 503 "
              f"'{health[0][1]['status'] if health else None}', then exit {server.proc.returncode} "
              f"{exited_after:.1f} s after the failed request (--failure-exit-delay {delay:g})")
        assert server.proc.returncode == 1
        request_id = failed.headers["x-request-id"]
        assert failed.status_code == 500 and request_id in failed.json()["error"]["message"]
        assert "device lost" not in failed.text  # the client gets the id, the log gets the detail
        assert health and all(status == 503 and body["status"] == "error" for status, body in health)
        assert request_id in health[0][1]["error"] and "device lost" not in str(health)
        assert delay - 0.5 <= exited_after <= delay + 30
        log = server.output()
        assert "device lost (injected by the test)" in log and request_id in log
    finally:
        server.kill()


# Runs `ddtree serve` with an engine whose first decode round never returns, as a hung GPU would.
HUNG_ENGINE = """
import sys
import time
import ddtree.batch_engine
import ddtree.engine

def hung_back(self, *args):
    time.sleep(3600)

ddtree.engine.Engine._back = hung_back  # one request at a time
ddtree.batch_engine.BatchEngine.step = hung_back  # batched (the CPU's default): per-row rounds
ddtree.batch_engine.BatchEngine.launch = hung_back  # and fixed-shape ones
from ddtree.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_hung_engine_is_503_stalled_then_ends_its_requests_and_exits_1(demo_pair):
    stall_exit = 4.0
    server = LiveServer(*demo_pair, "--engine-stall-timeout", "1", "--engine-stall-exit", str(stall_exit),
                        "--log-level", "info", "--tree-budget", "16", api_key=None,  # as above
                        launcher=("-c", HUNG_ENGINE)).wait_ready()
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            sent_at = time.monotonic()
            with http.stream("POST", "/v1/completions",
                             json={"prompt": "def f(x):", "max_tokens": 8, "stream": True}) as stream:
                health = []
                while server.proc.poll() is None and time.monotonic() - sent_at < 3:
                    health.append(http.get("/health").status_code)
                    time.sleep(0.2)
                body = stream.read().decode()
        server.proc.wait(60)
        exited_after = time.monotonic() - sent_at
        print(f"hung engine: /health {health.count(503)} x 503, the stream ended with {body[-120:]!r}, "
              f"exit {server.proc.returncode} {exited_after:.1f} s after the request (--engine-stall-exit {stall_exit:g})")
        assert 503 in health
        assert "engine_unavailable" in body and "engine-stall-exit" in body and body.rstrip().endswith("[DONE]")
        assert server.proc.returncode == 1
        assert stall_exit <= exited_after <= stall_exit + 30
        assert "exiting with code 1" in server.output()
    finally:
        server.kill()


def run_serve(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "ddtree.cli", "serve", "--device", "cpu", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=quiet_env())


def test_port_in_use_is_one_line_and_exit_2():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        out = run_serve("--port", str(taken.getsockname()[1]))
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stderr.startswith("ddtree: error: cannot listen on 127.0.0.1:") and "in use" in out.stderr


@pytest.mark.parametrize("host", ["no-such-host.invalid", "999.1.1.1"])
def test_bad_host_is_one_line_and_exit_2(host):
    out = run_serve("--host", host, "--port", str(free_port()))
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stderr.startswith("ddtree: error: cannot listen on")


@pytest.mark.parametrize("args, fragment", [(["--api-key", ""], "--api-key"), (["--port", "70000"], "1..65535")])
def test_bad_serve_settings_are_one_line_and_exit_2(args, fragment):
    out = run_serve(*args)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert fragment in out.stderr
