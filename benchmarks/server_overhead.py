"""What the HTTP server costs a request, against the engine's own time, with the engine's time fixed.

    python -m benchmarks.server_overhead OUTPUT.json [--engine-us 180] [--requests 32]
        [--max-tokens 128] [--max-num-seqs 1] [--concurrency 1 --accept 1 --row-us 0] [--engine-thread]

The GPU's engine is host-bound on small models: its Python thread holds the interpreter lock for
most of a round (launching graphs, reading the summary), and when it runs as a thread of the
server's process (`serve --no-engine-process`, here `--engine-thread`) the server's event loop
shares that lock; by default it runs in a process of its own (ddtree.server.engine_process). This benchmark reproduces that on any machine: a `ddtree serve` process whose engine replays
one recorded generation (the demo pair's tokens and text, so that the detokenizer and every chunk
are real), each step holding the lock for `--engine-us` microseconds of busy Python (180 us is
the demo pair's `ar` step on the H200, 5216 tokens/s in process) and then yielding it once (as
the round's host sync does), instead of running the models; `--host-fraction` below 1 sleeps the
rest of the step with the lock free (a GPU still working while the host waits).
A client process streams `--requests` chat requests one after another (concurrency 1) and times
each one's first content chunk and its end. In process, the same replayed stream takes exactly
tokens x engine-us; the ratio of the two is what the HTTP path leaves of in-process tokens/s.

The server process's CPU seconds per request are read from /proc (Linux) around the timed
requests: beyond the engine's own busy time, they are the cost of the HTTP path itself (with the
engine in its own process, the server's are the front's alone, and the engine process's and the
client's own are reported beside them: on a machine with fewer cores than busy processes they
compete for the CPU).

With `--max-num-seqs` above 1 the server's batched worker runs instead, on a replaying batch
(`ReplayingBatch`, in place of `ddtree.batching.BatchedRequests`): every round spins `--engine-us`
plus `--row-us` per row, and gives each row the next `--accept` tokens of the recording through
its own real `RequestProgress` (stop rules, text, statistics), so that every round's events, the
worker, the event loop and the HTTP path are real and only the models are not. `--concurrency`
clients then stream `--requests` requests at once, and the same replaying batch driven in process
with that many requests at a time (no server) gives the in-process tokens/s they are held to.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}]


def replaying_stream(llm, engine_us: float, max_tokens: int, host_fraction: float = 1.0):
    """A stand-in for `llm.stream`: one real generation of `max_tokens` tokens at `ar`, recorded
    once, replayed for every request (cut to its max_tokens), each step after `engine_us` of
    busy Python that holds the interpreter lock, as a host-bound GPU engine's round does, then
    (1 - host_fraction) of it asleep with the lock free, as in the round's host sync."""
    from ddtree.config import SamplingParams

    recorded = list(llm.stream(llm.apply_chat_template(PROMPT), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                               "ar"))
    busy, idle = engine_us * host_fraction / 1e6, engine_us * (1 - host_fraction) / 1e6

    def stream(prompt, params=None, tree_budget=None):
        limit = params.max_tokens if params is not None and params.max_tokens else max_tokens
        sent = 0
        for event in recorded:
            spin(busy, idle)  # the lock held, as in the engine's host loop; then free, as at its sync
            sent += len(event.token_ids)
            yield event
            if event.result is not None or sent >= limit:
                return

    return stream


def spin(busy_s: float, idle_s: float) -> None:
    """`busy_s` of busy Python with the interpreter lock held, then `idle_s` asleep with it free."""
    end = time.perf_counter() + busy_s
    while time.perf_counter() < end:
        pass
    time.sleep(idle_s)


def recorded_tokens(llm, max_tokens: int) -> list[int]:
    """The demo pair's greedy answer to PROMPT, `max_tokens` tokens."""
    from ddtree.config import SamplingParams

    prompt = llm.apply_chat_template(PROMPT)
    return llm.generate(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), "ar").token_ids


class ReplayedRequest:
    """`BatchedRequest`'s part the worker reads: `sequence.budget`, `progress`; and the replay's place."""

    def __init__(self, budget, progress):
        from types import SimpleNamespace

        self.sequence = SimpleNamespace(budget=budget)
        self.progress = progress
        self.at = 1  # the next recorded token (the prefill gave the first)


class ReplayingBatch:
    """A stand-in for `ddtree.batching.BatchedRequests` (module docstring): `add`, `step`, `cancel`,
    `begin`, `started`, `free`, `fits`, `running`. Each round costs `engine_us` + `row_us` per row, `host_fraction` of it busy."""

    def __init__(self, llm, tokens: list[int], accept: int, engine_us: float, row_us: float,
                 host_fraction: float, max_rows: int):
        self.llm, self.tokens, self.accept, self.max_rows = llm, tokens, accept, max_rows
        self.engine_us, self.row_us, self.host_fraction = engine_us, row_us, host_fraction
        self.running: list[ReplayedRequest] = []
        self.begun: list[ReplayedRequest] = []

    @property
    def free(self) -> int:
        return self.max_rows - len(self.running) - len(self.begun)

    def fits(self, prompt_len, params, budget, adaptive: bool = False) -> bool:
        return self.free > 0

    def add(self, prompt_ids, params, budget, adaptive: bool = False):
        self.begin(prompt_ids, params, budget, adaptive)
        return self.started()[0]

    def begin(self, prompt_ids, params, budget, adaptive: bool = False):
        request = ReplayedRequest(budget, self.llm.progress(prompt_ids, params, budget, adaptive))
        self.begun.append(request)
        return request

    def started(self):
        from ddtree.engine import Step

        out = []
        for request in self.begun:
            event = request.progress.add(Step([self.tokens[0]], 0))
            if event is None:
                event = request.progress.final_event()
            else:
                self.running.append(request)
            out.append((request, event))
        self.begun = []
        return out

    def step(self):
        from ddtree.engine import Step

        seconds = (self.engine_us + self.row_us * len(self.running)) / 1e6
        spin(seconds * self.host_fraction, seconds * (1 - self.host_fraction))
        events = []
        for request in list(self.running):
            chunk = self.tokens[request.at:request.at + self.accept]
            request.at += len(chunk)
            event = request.progress.add(Step(chunk, len(chunk), budget=request.sequence.budget))
            if event is None or request.at >= len(self.tokens):
                self.running.remove(request)
                event = request.progress.final_event()
            events.append((request, event))
        return events

    def cancel(self, request) -> None:
        if request in self.running:
            self.running.remove(request)


def in_process_tokens_per_s(batch: ReplayingBatch, llm, requests: int, concurrency: int, max_tokens: int) -> float:
    """The replaying batch driven with `concurrency` requests at a time, no server -> output tokens/s."""
    from ddtree.config import SamplingParams
    from ddtree.tree_shape import AR

    prompt_ids = llm.apply_chat_template(PROMPT)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    started = tokens = 0
    start = time.perf_counter()
    while started < requests or batch.running:
        while started < requests and len(batch.running) < concurrency:
            _, event = batch.add(prompt_ids, params, AR)
            tokens += len(event.token_ids)
            started += 1
        for _, event in batch.step():
            tokens += len(event.token_ids)
    return tokens / (time.perf_counter() - start)


def serve(port: int, engine_us: float, max_tokens: int, max_num_seqs: int, host_fraction: float,
          accept: int = 1, row_us: float = 0.0, engine_thread: bool = False) -> int:
    """Run `ddtree serve` on the demo pair (CPU) with the replaying engine (or, batched, batch): in
    its own process (serve's default: the process forks after this patch, so it replays too) or,
    with engine_thread, as a thread of the server's process."""
    from ddtree.cli import build_parser
    from ddtree.server import main as server_main

    load = server_main._load

    def load_replaying(*args, **kwargs):
        llm = load(*args, **kwargs)
        llm.stream = replaying_stream(llm, engine_us, max_tokens, host_fraction)
        if max_num_seqs > 1:
            batch = ReplayingBatch(llm, recorded_tokens(llm, max_tokens), accept, engine_us, row_us, host_fraction,
                                   max_num_seqs)
            llm.batched = lambda max_nodes=None: batch
        return llm

    server_main._load = load_replaying
    args = build_parser().parse_args(["serve", "--port", str(port), "--device", "cpu", "--tree-budget", "ar",
                                      "--max-num-seqs", str(max_num_seqs), "--log-level", "warning",
                                      "--no-engine-process" if engine_thread else "--engine-process"])
    return server_main.cmd_serve(args)


def engine_process_of(server_pid: int) -> int | None:
    """The server's engine process (its one child, Linux), or None when the engine is a thread."""
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    return int(children[0]) if children else None


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stream_one(client, url: str, max_tokens: int, model: str = "demo-target") -> dict:
    """One streamed chat request -> its time to first content, end-to-end time and token count."""
    start = time.perf_counter()
    first, tokens = None, 0
    body = {"model": model, "messages": PROMPT, "max_tokens": max_tokens, "stream": True, "temperature": 0.0,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif first is None and any(c["delta"].get("content") for c in chunk["choices"]):
                first = time.perf_counter() - start
    return {"ttft_s": first, "e2e_s": time.perf_counter() - start, "tokens": tokens}


def wait_until_up(client, url: str, child: subprocess.Popen, timeout_s: float = 300) -> None:
    """Poll the server process `child` at url's /health with the httpx client until it answers 200."""
    import httpx

    deadline = time.time() + timeout_s
    while True:
        try:
            if client.get(url + "/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.time() > deadline or child.poll() is not None:
            raise RuntimeError("the server did not come up")
        time.sleep(0.5)


def measure(args) -> dict:
    import httpx

    port = args.port
    child = subprocess.Popen([sys.executable, "-m", "benchmarks.server_overhead", "--serve", str(port),
                              "--engine-us", str(args.engine_us), "--max-tokens", str(args.max_tokens),
                              "--max-num-seqs", str(args.max_num_seqs), "--host-fraction", str(args.host_fraction),
                              "--accept", str(args.accept), "--row-us", str(args.row_us),
                              *(["--engine-thread"] if args.engine_thread else [])])
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(timeout=120) as client:
            wait_until_up(client, url, child)
            for _ in range(args.warmup):
                stream_one(client, url, args.max_tokens)
            engine_pid = engine_process_of(child.pid)
            engine_before = cpu_seconds(engine_pid) if engine_pid else 0.0
            client_before = time.process_time()
            cpu_before, wall_before = cpu_seconds(child.pid), time.perf_counter()
            if args.concurrency == 1:
                runs = [stream_one(client, url, args.max_tokens) for _ in range(args.requests)]
            else:
                runs = streams_at_once(url, args.max_tokens, args.requests, args.concurrency)
            wall = time.perf_counter() - wall_before
            server_cpu = cpu_seconds(child.pid) - cpu_before
            client_cpu = time.process_time() - client_before
            engine_cpu = cpu_seconds(engine_pid) - engine_before if engine_pid else None
    finally:
        child.terminate()
        child.wait(30)
    tokens = statistics.median(r["tokens"] for r in runs)
    in_process_s = tokens * args.engine_us / 1e6  # one event per token at `ar`
    e2e = statistics.median(r["e2e_s"] for r in runs)
    aggregate = sum(r["tokens"] for r in runs) / wall
    cpu = {"client_cpu_ms_per_request": client_cpu / args.requests * 1000, "wall_s": wall,
           "engine_process_cpu_ms_per_request": None if engine_cpu is None else engine_cpu / args.requests * 1000}
    if args.max_num_seqs > 1:
        return {**batched_result(args, runs, aggregate, server_cpu), **cpu}
    return {
        "benchmark": "server_overhead", "command": " ".join(["python -m benchmarks.server_overhead", *sys.argv[1:]]),
        "engine_us": args.engine_us, "host_fraction": args.host_fraction, "max_tokens": args.max_tokens,
        "requests": args.requests, "engine_process": not args.engine_thread,
        "max_num_seqs": args.max_num_seqs, "tokens_per_request": tokens,
        "median_ttft_ms": statistics.median(r["ttft_s"] for r in runs) * 1000,
        "median_e2e_ms": e2e * 1000, "in_process_ms": in_process_s * 1000,
        "http_over_in_process": in_process_s / e2e,
        "aggregate_tokens_per_s": aggregate,
        "server_cpu_ms_per_request": server_cpu / args.requests * 1000,
        "server_cpu_ms_per_request_beyond_engine": (server_cpu / args.requests - in_process_s) * 1000, **cpu,
    }


def streams_at_once(url: str, max_tokens: int, requests: int, concurrency: int) -> list[dict]:
    """`requests` streamed requests, `concurrency` at a time (a client thread each)."""
    import threading

    import httpx

    left, runs, lock = list(range(requests)), [], threading.Lock()

    def client_loop():
        with httpx.Client(timeout=120) as client:
            while True:
                with lock:
                    if not left:
                        return
                    left.pop()
                run = stream_one(client, url, max_tokens)
                with lock:
                    runs.append(run)

    threads = [threading.Thread(target=client_loop) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return runs


def batched_result(args, runs: list[dict], aggregate: float, server_cpu: float) -> dict:
    """The batched server's aggregate tokens/s beside the replaying batch's in process."""
    from ddtree.llm import LLM

    llm = LLM(device="cpu", max_num_seqs=args.max_num_seqs)
    batch = ReplayingBatch(llm, recorded_tokens(llm, args.max_tokens), args.accept, args.engine_us, args.row_us,
                           args.host_fraction, args.max_num_seqs)
    in_process_tokens_per_s(batch, llm, args.concurrency, args.concurrency, args.max_tokens)  # warm-up
    in_process = in_process_tokens_per_s(batch, llm, args.requests, args.concurrency, args.max_tokens)
    return {
        "benchmark": "server_overhead", "command": " ".join(["python -m benchmarks.server_overhead", *sys.argv[1:]]),
        "engine_us": args.engine_us, "row_us": args.row_us, "accept": args.accept,
        "engine_process": not args.engine_thread,
        "host_fraction": args.host_fraction, "max_tokens": args.max_tokens, "requests": args.requests,
        "max_num_seqs": args.max_num_seqs, "concurrency": args.concurrency,
        "tokens_per_request": statistics.median(r["tokens"] for r in runs),
        "median_ttft_ms": statistics.median(r["ttft_s"] for r in runs) * 1000,
        "median_e2e_ms": statistics.median(r["e2e_s"] for r in runs) * 1000,
        "aggregate_tokens_per_s": aggregate, "in_process_tokens_per_s": in_process,
        "http_over_in_process": aggregate / in_process,
        "server_cpu_ms_per_request": server_cpu / args.requests * 1000,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("output", nargs="?")
    p.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the server process, on this port
    p.add_argument("--port", type=int, default=8137)
    p.add_argument("--engine-us", type=float, default=180.0, help="busy microseconds per engine step (default 180)")
    p.add_argument("--host-fraction", type=float, default=1.0,
                   help="of each step, the part that holds the interpreter lock; the rest sleeps with it free "
                        "(default 1: all of it, then the lock is yielded once)")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=1)
    p.add_argument("--concurrency", type=int, default=1, help="requests streamed at once (batched server)")
    p.add_argument("--accept", type=int, default=1, help="tokens a row commits per replayed round (batched)")
    p.add_argument("--row-us", type=float, default=0.0, help="busy microseconds per row per round (batched)")
    p.add_argument("--engine-thread", action="store_true",
                   help="the engine as a thread of the server's process (serve --no-engine-process), not its own")
    args = p.parse_args()
    if args.concurrency > 1 and args.max_num_seqs < args.concurrency:
        p.error("--concurrency above 1 needs --max-num-seqs at least as large")
    if args.serve is not None:
        return serve(args.serve, args.engine_us, args.max_tokens, args.max_num_seqs, args.host_fraction,
                     args.accept, args.row_us, args.engine_thread)
    result = measure(args)
    print(json.dumps(result, indent=1))
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
