"""Slow and idle clients against a live server: connections that send nothing, half a request head or
half a body are closed after --read-timeout; idle kept-alive ones after --keep-alive-timeout; past
--max-connections new requests get 503. Last, SIGTERM while a stream runs, a request queues and a
client holds a half-sent body: the server exits within --shutdown-timeout, the stream ending with
an error chunk and the queued request with 503."""
from __future__ import annotations

import json
import signal
import socket
import threading
import time

import httpx
import pytest

from ddtree.server.shutdown import grace_period
from server_process import LiveServer, metric, metric_values

READ_TIMEOUT = 4.0
KEEP_ALIVE_TIMEOUT = 1.0
SHUTDOWN_TIMEOUT = 1.5
MAX_CONNECTIONS = 8
MAX_HEADER_BYTES = 2048
SLACK = 5.0  # a loaded two-core machine may run a timer this late
EXIT_SLACK = 0.25  # the test's own latency between signalling and seeing the exit on a loaded machine


@pytest.fixture(scope="module")
def server(demo_pair):
    live = LiveServer(*demo_pair, "--read-timeout", str(READ_TIMEOUT), "--keep-alive-timeout", str(KEEP_ALIVE_TIMEOUT),
                      "--shutdown-timeout", str(SHUTDOWN_TIMEOUT), "--max-connections", str(MAX_CONNECTIONS),
                      "--max-header-bytes", str(MAX_HEADER_BYTES),
                      # One request decodes at a time, so that the SIGTERM test has one waiting in the queue.
                      "--max-num-seqs", "1", api_key=None, max_model_len=512)
    with live:
        yield live


def connect(server: LiveServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.settimeout(READ_TIMEOUT + 30)
    return sock


def seconds_until_closed(sock: socket.socket) -> float:
    """Wait for the server to close the connection (recv returns b"" or the connection resets)."""
    start = time.monotonic()
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - start


HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


def test_idle_and_half_sent_connections_are_closed_after_the_read_timeout(server):
    idle = connect(server)
    half_head = connect(server)
    half_head.sendall(HEAD[:40])
    half_body = connect(server)
    half_body.sendall(HEAD + b'Content-Length: 100\r\n\r\n{"prompt"')
    trickle = connect(server)  # a byte of body every 0.5 s: slow, never done
    trickle.sendall(HEAD + b"Content-Length: 100\r\n\r\n")
    stop = threading.Event()

    def drip():
        while not stop.wait(0.5):
            try:
                trickle.sendall(b" ")
            except OSError:
                return

    dripper = threading.Thread(target=drip)
    dripper.start()
    waits = {}
    threads = [threading.Thread(target=lambda n=name, s=sock: waits.__setitem__(n, seconds_until_closed(s)))
               for name, sock in (("idle", idle), ("half head", half_head), ("half body", half_body),
                                  ("trickled body", trickle))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stop.set()
    dripper.join()
    print("closed after (s):", {name: round(wait, 2) for name, wait in waits.items()})
    assert all(READ_TIMEOUT - 0.5 <= wait <= READ_TIMEOUT + SLACK for wait in waits.values()), waits
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200


def test_a_head_over_the_limit_is_refused_and_its_connection_closed(server):
    """Whether it arrives at once or a header at a time, and however long its one header is, a head
    over --max-header-bytes is answered 400 and closed as soon as it passes the limit; one just under
    it, body and all in one send, is served."""
    whole = connect(server)
    whole.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * MAX_HEADER_BYTES + b"\r\n\r\n")
    trickled = connect(server)
    trickled.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
    for _ in range(MAX_HEADER_BYTES // 256 + 1):  # one header that never ends
        trickled.sendall(b"a" * 256)
        time.sleep(0.01)
    for sock in (whole, trickled):
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 400") and answer.endswith(b"Request head over 2048 bytes."), answer
    body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    head = HEAD + b"Content-Length: " + str(len(body)).encode() + b"\r\nX-Pad: "
    fits = connect(server)
    fits.sendall(head + b"a" * (MAX_HEADER_BYTES - len(head) - 8) + b"\r\n\r\n" + body)
    assert fits.recv(4096).startswith(b"HTTP/1.1 200")
    fits.close()


def test_idle_kept_alive_connection_is_closed(server):
    sock = connect(server)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    wait = seconds_until_closed(sock)
    assert wait <= KEEP_ALIVE_TIMEOUT + SLACK


def test_connections_over_the_limit_get_503(server):
    held = [connect(server) for _ in range(MAX_CONNECTIONS)]
    try:
        refused = httpx.get(server.url + "/health", timeout=30)
    finally:
        for sock in held:
            sock.close()
    assert refused.status_code == 503
    deadline = time.monotonic() + 10
    while httpx.get(server.url + "/health", timeout=30).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_sigterm_with_a_half_sent_body_exits_within_the_shutdown_timeout(server):
    lines: list[str] = []
    started = threading.Event()
    queued: dict = {}

    def stream():
        body = {"prompt": "def g(x):", "max_tokens": 480, "temperature": 0, "ignore_eos": True, "tree_budget": 128,
                "stream": True}
        with httpx.Client(base_url=server.url, timeout=60) as client, client.stream("POST", "/v1/completions",
                                                                                     json=body) as response:
            for line in response.iter_lines():
                if line:
                    lines.append(line)
                    started.set()

    def wait_in_queue():
        queued["response"] = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4},
                                        timeout=60)

    streaming = threading.Thread(target=stream)
    streaming.start()
    assert started.wait(60)
    waiting = threading.Thread(target=wait_in_queue)
    waiting.start()
    with httpx.Client(base_url=server.url, timeout=30) as client:
        while metric(metric_values(client.get("/metrics").text), "vllm:num_requests_waiting") < 1:
            time.sleep(0.02)
    half_body = connect(server)
    half_body.sendall(HEAD + b'Content-Length: 100\r\n\r\n{"prompt"')
    time.sleep(0.2)  # the request head has arrived
    signalled = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    code = server.proc.wait(SHUTDOWN_TIMEOUT + 60)
    exited = time.monotonic() - signalled
    streaming.join(30)
    waiting.join(30)
    print(f"exit code {code} {exited:.2f} s after SIGTERM (--shutdown-timeout {SHUTDOWN_TIMEOUT})")
    assert code == 0
    # It waited for the stream (the grace period), then ended it and exited by the timeout.
    assert grace_period(SHUTDOWN_TIMEOUT) - 0.2 <= exited <= SHUTDOWN_TIMEOUT + EXIT_SLACK
    assert seconds_until_closed(half_body) < 1
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][len("data: "):])["error"]
    assert error["code"] == "engine_unavailable" and "--shutdown-timeout" in error["message"]
    assert queued["response"].status_code == 503
