"""`ddtree serve` as a child process on a free loopback port, for the server tests."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

API_KEY = "sk-ddtree-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def quiet_env() -> dict:
    """The environment for a child ddtree process: no DDTREE_* settings leak in, and one torch
    thread, since the server, the test and the client share a small CPU."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDTREE_")}
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


class LiveServer:
    """Starts the server, waits for /health 200; `stop()` sends SIGTERM and returns the exit code."""

    def __init__(self, target: Path, draft: Path, *extra: str, api_key: str | None = API_KEY,
                 max_model_len: int = 160, name: str = "ddtree-test", launcher: tuple[str, ...] = ("-m", "ddtree.cli"),
                 device: str = "cpu"):
        """launcher: what runs `ddtree` (python's arguments before "serve"), e.g. ("-c", code) to run
        code that patches the server before calling ddtree.cli.main(sys.argv[1:])."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = name
        self.api_key = api_key
        cmd = [sys.executable, *launcher, "serve", "--target", str(target), "--draft", str(draft),
               "--port", str(self.port), "--max-model-len", str(max_model_len), "--device", device,
               "--served-model-name", name, "--log-level", "warning", *extra]
        if api_key:
            cmd += ["--api-key", api_key]
        env = quiet_env()
        self.log = tempfile.NamedTemporaryFile("w+", prefix="ddtree-serve-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, timeout: float = 120) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=timeout)

    def rss_bytes(self) -> int:
        """The server's resident memory now (Linux)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS in /proc/<pid>/status")

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()

    def wait_ready(self, timeout: float = 180) -> "LiveServer":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ddtree serve exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"ddtree serve did not become ready in {timeout} s:\n{self.output()}")

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "LiveServer":
        return self.wait_ready()

    def __exit__(self, *exc) -> None:
        self.stop()
        self.log.close()
        os.unlink(self.log.name)


def metric_values(text: str) -> dict[tuple, float]:
    """Prometheus text -> {(sample name, sorted label items): value}, via prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return values


def metric(values: dict, name: str, **labels) -> float:
    """The sum of the samples called `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in values.items() if n == name and want <= set(ls))
