"""The engine in a process of its own (`ddtree serve`'s default): `EngineClient` forks it and talks
over a pipe. Every job's tokens equal the same request decoded in this process; a cancel reaches
the engine; the queue is bounded by the front; a budget a request does not name is chosen by the
engine; an engine process that dies ends every job at once (a running job 500, a queued one 503),
and `ddtree serve` then answers /health 503 and exits 1."""
from __future__ import annotations

import asyncio
import functools
import os
import random
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from ddtree.config import SamplingParams
from ddtree.llm import LLM
from ddtree.server.engine_client import EngineClient
from ddtree.server.engine_process import FrameReader, write_frame
from ddtree.server.worker import DEAD, READY, EngineFailure, EngineUnavailable, Job, QueueFull
from ddtree.tree_shape import AR, TreeShape
from server_process import LiveServer, metric, metric_values


def load_demo(target: Path, draft: Path, max_num_seqs: int) -> tuple:
    """The engine's LLM (module level: a spawned engine process unpickles it by name)."""
    return LLM(target, draft, device="cpu", max_num_seqs=max_num_seqs, tree_budget=16, max_model_len=512), "fixed"


def started(client: EngineClient, timeout: float = 120) -> EngineClient:
    deadline = time.monotonic() + timeout
    while client.state != READY:
        assert client.state != DEAD and time.monotonic() < deadline, f"the engine did not start ({client.state})"
        time.sleep(0.05)
    return client


@pytest.fixture
def engine(demo_pair):
    clients = []

    def make(max_num_seqs: int = 4, max_queued: int | None = None, deaths: list | None = None, fork: bool = True):
        client = EngineClient("demo", on_death=(deaths.append if deaths is not None else None), max_queued=max_queued)
        client.start(functools.partial(load_demo, *demo_pair, max_num_seqs), fork=fork, target_path=demo_pair[0])
        clients.append(client)
        return started(client)

    yield make
    for client in clients:
        if client.process is not None and client.process.is_alive():
            client.process.kill()
            client.process.join(10)


def job(client: EngineClient, loop, prompt: str, max_tokens: int, budget=TreeShape.best(16), **params) -> Job:
    ids = client.llm.prompt_ids(prompt)
    return Job(ids, SamplingParams(max_tokens=max_tokens, **params), budget, loop)


async def drain(job: Job) -> tuple[list[int], object]:
    """Every token of a job's events, and its result (or the exception that ended it)."""
    tokens = []
    while True:
        try:
            event = await asyncio.wait_for(job.next_event(), 60)
        except (EngineFailure, EngineUnavailable) as exc:
            return tokens, exc
        tokens += event.token_ids
        if event.result is not None:
            return tokens, event.result


def test_jobs_through_the_engine_process_equal_in_process_decoding(engine, demo_pair):
    client = engine(max_num_seqs=4)
    prompts = [("def fib(n):", 40, {}), ("import numpy", 25, {"temperature": 0.8, "seed": 3}),
               ("class Stack:", 33, {"ignore_eos": True})]

    async def run():
        loop = asyncio.get_running_loop()
        jobs = [job(client, loop, p, n, **kw) for p, n, kw in prompts]
        for j in jobs:
            client.submit(j)
        return await asyncio.gather(*(drain(j) for j in jobs))

    results = asyncio.run(run())
    llm = LLM(*demo_pair, device="cpu", max_model_len=512)
    for (prompt, n, kw), (tokens, result) in zip(prompts, results):
        solo = llm.generate(prompt, SamplingParams(max_tokens=n, **kw), 16)
        assert tokens == result.token_ids == solo.token_ids
        assert result.text == solo.text
    assert client.waiting == 0 and client.stalled_for() == 0.0


def test_a_spawned_engine_process_decodes_as_in_process(engine, demo_pair):
    """Spawned (a GPU server's way: its front may have asked CUDA whether it is there)."""
    client = engine(max_num_seqs=1, fork=False)

    async def run():
        one = job(client, asyncio.get_running_loop(), "def fib(n):", 24)
        client.submit(one)
        return await drain(one)

    tokens, result = asyncio.run(run())
    solo = LLM(*demo_pair, device="cpu", max_model_len=512).generate("def fib(n):", SamplingParams(max_tokens=24), 16)
    assert tokens == result.token_ids == solo.token_ids


def test_frames_cut_anywhere_read_as_the_messages_written(tmp_path):
    """The events pipe's frames, read in whatever pieces the pipe gives (one frame over a pipe's
    64 KiB buffer), are the messages written, in order."""
    messages = [[(0, "x" * 100_000)], [(1, None), (2, [1, 2, 3])], [], [(3, ValueError("gone"))]]
    path = tmp_path / "frames"
    with path.open("wb") as f:
        for message in messages:
            write_frame(f.fileno(), message)
    data = path.read_bytes()
    rng = random.Random(0)
    for _ in range(20):
        reader, read, start = FrameReader(), [], 0
        while start < len(data):
            end = min(len(data), start + rng.choice([1, 3, 7, 4096, 70_000]))
            read += reader.messages(data[start:end])
            start = end
        assert read[:3] == messages[:3] and len(read) == 4 and not reader.buffer
        (key, exc), = read[3]  # an exception does not compare equal to its copy
        assert key == 3 and isinstance(exc, ValueError) and str(exc) == "gone"


def test_round_events_are_read_on_the_event_loop_of_their_jobs(engine, monkeypatch):
    """The events pipe is read by the jobs' event loop itself (no thread's hand-off to it), and by
    the next loop once that one has closed."""
    client = engine(max_num_seqs=1)
    threads = []
    deliver = client._deliver
    monkeypatch.setattr(client, "_deliver", lambda pairs: (threads.append(threading.current_thread()), deliver(pairs)))

    async def run(prompt):
        one = job(client, asyncio.get_running_loop(), prompt, 12, ignore_eos=True)
        client.submit(one)
        return await drain(one)

    for prompt in ("def fib(n):", "import os"):
        threads.clear()
        tokens, result = asyncio.run(run(prompt))
        assert len(tokens) == 12 == len(result.token_ids)
        assert threads and set(threads) == {threading.main_thread()}


def test_cancel_reaches_the_engine_and_the_budget_is_chosen_there(engine):
    client = engine(max_num_seqs=1)

    async def run():
        loop = asyncio.get_running_loop()
        long = job(client, loop, "def f(x):", 400, ignore_eos=True)
        client.submit(long)
        await long.next_event()
        long.cancel()
        # The engine's default (16, from load) is chosen there: the front checked it with none.
        ids, params = client.llm.prompt_ids("x = "), SamplingParams(max_tokens=6, ignore_eos=True)
        unnamed = Job(ids, params, client.llm.check_request(ids, params), loop)
        assert unnamed.budget is None
        client.submit(unnamed)
        return await drain(unnamed)

    tokens, result = asyncio.run(run())
    assert len(tokens) == 6 and result.stats.tree_budget == "16"
    values = metric_values(client.render_metrics()[0].decode())
    assert metric(values, "vllm:request_success_total", finished_reason="abort") == 1
    assert metric(values, "vllm:request_success_total", finished_reason="length") == 1


def test_the_front_bounds_the_queue(engine):
    client = engine(max_num_seqs=1, max_queued=1)

    async def run():
        loop = asyncio.get_running_loop()
        running = job(client, loop, "def f(x):", 300, ignore_eos=True)
        client.submit(running)
        await running.next_event()
        client.submit(job(client, loop, "x", 4))
        assert client.waiting == 1
        with pytest.raises(QueueFull):
            client.submit(job(client, loop, "y", 4))
        running.cancel()

    asyncio.run(run())


def test_a_killed_engine_process_ends_running_and_queued_jobs(engine):
    deaths = []
    client = engine(max_num_seqs=1, deaths=deaths)

    async def run():
        loop = asyncio.get_running_loop()
        running = job(client, loop, "def f(x):", 400, ignore_eos=True)
        queued = job(client, loop, "x", 4)
        client.submit(running)
        await running.next_event()
        client.submit(queued)
        os.kill(client.process.pid, signal.SIGKILL)
        return await drain(running), await drain(queued)

    (_, running_end), (queued_tokens, queued_end) = asyncio.run(run())
    assert isinstance(running_end, EngineFailure) and isinstance(queued_end, EngineUnavailable)
    assert queued_tokens == []
    assert client.state == DEAD and len(deaths) == 1
    with pytest.raises(EngineUnavailable):
        client.submit(Job([1, 2], SamplingParams(max_tokens=2), AR, None))


def test_an_engine_failure_reaches_its_job_as_the_failure_with_the_state_already_dead(engine, monkeypatch):
    """A round that raises in the engine process: its job ends with EngineFailure (a 500 naming
    its request), never the 503 of a job that never ran, with the front's state DEAD by then, and
    a job submitted after it is refused. The events pipe is read late here: the death travels on it
    after the failing job's item, so no other path can end that job first."""
    def failing_back(self, *args):
        raise RuntimeError("device lost (injected by the test)")

    monkeypatch.setattr("ddtree.engine.Engine._back", failing_back)  # before the fork: the engine process has it
    deaths = []
    client = engine(max_num_seqs=1, deaths=deaths)
    read_events = client._read_events
    monkeypatch.setattr(client, "_read_events", lambda: (time.sleep(0.2), read_events()))
    seen = []

    async def run():
        loop = asyncio.get_running_loop()
        failing = job(client, loop, "def f(x):", 8)
        client.submit(failing)
        try:
            while (await asyncio.wait_for(failing.next_event(), 60)).result is None:
                pass  # the prompt's first token comes from the prefill; the first round fails
        except (EngineFailure, EngineUnavailable) as exc:
            seen.append((exc, client.state, len(deaths)))
        later = job(client, loop, "x", 4)
        try:
            client.submit(later)
        except EngineUnavailable as exc:
            return exc
        return (await drain(later))[1]

    later_end = asyncio.run(run())
    (failure, state, deaths_then), = seen
    assert isinstance(failure, EngineFailure), failure
    assert state == DEAD and deaths_then == 1
    assert isinstance(later_end, EngineUnavailable)
    assert len(deaths) == 1


def engine_pid(server_pid: int) -> int:
    """The server's one child process (Linux)."""
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


def test_serve_exits_1_when_its_engine_process_dies(demo_pair):
    delay = 2.0
    server = LiveServer(*demo_pair, "--failure-exit-delay", str(delay), "--tree-budget", "16",
                        api_key=None).wait_ready()
    try:
        assert httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4}).status_code == 200
        assert httpx.get(server.url + "/health").json()["engine"] == "process"
        os.kill(engine_pid(server.proc.pid), signal.SIGKILL)
        deadline = time.monotonic() + 30
        while (health := httpx.get(server.url + "/health", timeout=5)).status_code == 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert health.status_code == 503 and health.json()["status"] == "error"
        refused = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4})
        assert refused.status_code == 503
        assert server.proc.wait(60) == 1
        assert "engine process ended unexpectedly" in server.output()
    finally:
        server.kill()


def test_serve_without_an_engine_process(demo_pair):
    with LiveServer(*demo_pair, "--no-engine-process", "--tree-budget", "16", api_key=None) as server:
        answer = httpx.post(server.url + "/v1/completions", json={"prompt": "def f(x):", "max_tokens": 6}, timeout=60)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 6
        assert httpx.get(server.url + "/health").json()["engine"] == "thread"
        assert not Path(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children").read_text().split()


@pytest.mark.parametrize("device", [[], ["--device", "cpu"]], ids=["spawned", "forked"])
def test_a_model_that_fails_to_load_in_the_engine_process_is_one_line_and_exit_2(demo_pair, tmp_path, device):
    """Weights that only the engine process reads (the configs pass the front's checks): its
    error reaches the front, which prints it as one line and exits 2, its engine process gone."""
    import shutil
    import subprocess
    import sys

    from server_process import free_port, quiet_env

    target = tmp_path / "target"
    shutil.copytree(demo_pair[0], target)
    (target / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    cmd = [sys.executable, "-m", "ddtree.cli", "serve", "--target", str(target), "--draft", str(demo_pair[1]),
           "--port", str(free_port()), "--log-level", "error", *device]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=quiet_env())
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("ddtree: error:")]
    assert len(errors) == 1 and "corrupt weight file" in errors[0], out.stderr


def test_the_engine_process_exits_when_the_server_dies(demo_pair):
    """However the front ends (here SIGKILL, no goodbye), its engine process sees the pipe close."""
    server = LiveServer(*demo_pair, "--tree-budget", "16", api_key=None).wait_ready()
    try:
        engine = engine_pid(server.proc.pid)
        server.proc.kill()
        server.proc.wait(30)
        deadline = time.monotonic() + 30
        while Path(f"/proc/{engine}").exists() and "zombie" not in Path(f"/proc/{engine}/status").read_text():
            assert time.monotonic() < deadline, "the engine process outlived its server"
            time.sleep(0.1)
    finally:
        server.kill()


def test_metrics_and_health_answer_while_the_engine_process_loads(demo_pair):
    """The engine process reads its pipe while its model loads (in a thread): /metrics answers
    from the start, /health says "loading" until the engine is ready."""
    server = LiveServer(*demo_pair, api_key=None)  # no --tree-budget: start-up times round costs
    try:
        seen_loading = False
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                health = httpx.get(server.url + "/health", timeout=5)
            except httpx.TransportError:
                time.sleep(0.05)
                continue
            if health.status_code == 200:
                break
            assert health.json()["status"] == "loading"
            metrics = httpx.get(server.url + "/metrics", timeout=15)
            assert metrics.status_code == 200 and "vllm:num_requests_running" in metrics.text
            seen_loading = True
        assert seen_loading, "the engine was ready before /metrics could be asked while loading"
    finally:
        server.kill()
