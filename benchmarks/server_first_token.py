"""Where a streamed request's time to first token goes inside `ddtree serve`, stage by stage.

    python -m benchmarks.server_first_token OUTPUT.json [--requests 60] [--warmup 10] [--engine-us 0]

The server is `benchmarks.server_overhead`'s (the demo pair on the CPU, its engine replaying one
recorded generation, each step `--engine-us` of busy Python; the engine a thread of the server's
process, `serve --no-engine-process`), with marks added around the request's
path: the server process times each request from the moment it reaches the app, and a client
process times it from sending to the first content chunk. The stages, each a median over the
requests after the warm-up, in ms from the request reaching the app:

    prepare_call      body read and validated, the prompt handed to a worker thread
    prepare_start     that thread starts (the hop to it)
    prepare_end       chat template, tokenizing and the request's checks done
    prepare_back      the handler has the result again (the hop back)
    submit            the job queued for the engine thread
    engine_start      the engine thread has taken it (its wake-up)
    emit              the first event leaves the engine thread
    loop_put          the event loop has put it in the job's queue
    handler_event     the handler has it
    first_content     the first chunk with content is sent

`client_ttft_ms` beside them is the client's view: the rest is the client's own time, the socket
and uvicorn's parsing of the request before the app sees it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

STAGES = ("prepare_call", "prepare_start", "prepare_end", "prepare_back", "submit", "engine_start", "emit",
          "loop_put", "handler_event", "first_content")


class Marks:
    """The running request's stage times (one request at a time), a JSON line per request."""

    def __init__(self, path: Path):
        self.file = path.open("a")
        self.times: dict[str, float] = {}
        self.lock = threading.Lock()

    def mark(self, stage: str) -> None:
        with self.lock:
            self.times.setdefault(stage, time.perf_counter())

    def start(self) -> dict[str, float]:
        """A new request: its marks from now on (the last one's may still be finishing)."""
        with self.lock:
            self.times = {"arrive": time.perf_counter()}
            return self.times

    def flush(self, times: dict[str, float]) -> None:
        with self.lock:
            t0 = times["arrive"]
            self.file.write(json.dumps({k: (v - t0) * 1e3 for k, v in times.items()}) + "\n")
            self.file.flush()


def install_marks(marks: Marks) -> None:
    """Wrap the functions on a request's path so that each marks its stage."""
    import anyio.to_thread

    from ddtree.server import middleware, worker

    def before(owner, name: str, stage: str) -> None:
        fn = getattr(owner, name)

        def wrapped(*args, **kwargs):
            marks.mark(stage)
            return fn(*args, **kwargs)
        setattr(owner, name, wrapped)

    before(worker.EngineWorker, "submit", "submit")
    before(worker.EngineWorker, "_start", "engine_start")
    before(worker, "emit_all", "emit")
    before(worker, "_put_all", "loop_put")

    next_event = worker.Job.next_event

    async def marked_next_event(self):
        event = await next_event(self)
        marks.mark("handler_event")
        return event
    worker.Job.next_event = marked_next_event

    run_sync = anyio.to_thread.run_sync

    async def marked_run_sync(fn, *args, **kwargs):
        marks.mark("prepare_call")

        def inner(*inner_args):
            marks.mark("prepare_start")
            out = fn(*inner_args)
            marks.mark("prepare_end")
            return out
        out = await run_sync(inner, *args, **kwargs)
        marks.mark("prepare_back")
        return out
    anyio.to_thread.run_sync = marked_run_sync

    outer = middleware.RequestIdMiddleware.__call__

    async def marked_call(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/v1/chat/completions":
            return await outer(self, scope, receive, send)
        times = marks.start()

        async def marked_send(message):
            body = message.get("body", b"")
            if message["type"] == "http.response.body" and b'"content": "' in body and b'"content": ""' not in body:
                marks.mark("first_content")
            await send(message)
        await outer(self, scope, receive, marked_send)
        marks.flush(times)
    middleware.RequestIdMiddleware.__call__ = marked_call


def measure(args) -> dict:
    import httpx

    from benchmarks.server_overhead import stream_one, wait_until_up

    with tempfile.TemporaryDirectory() as tmp:
        marks_path = Path(tmp) / "marks.jsonl"
        child = subprocess.Popen([sys.executable, "-m", "benchmarks.server_first_token", "--serve", str(args.port),
                                  "--marks", str(marks_path), "--engine-us", str(args.engine_us),
                                  "--max-tokens", str(args.max_tokens)])
        url = f"http://127.0.0.1:{args.port}"
        try:
            with httpx.Client(timeout=120) as client:
                wait_until_up(client, url, child)
                runs = [stream_one(client, url, args.max_tokens) for _ in range(args.warmup + args.requests)]
        finally:
            child.terminate()
            child.wait(30)
        rows = [json.loads(line) for line in marks_path.read_text().splitlines()][args.warmup:]
    complete = [row for row in rows if all(stage in row for stage in STAGES)]
    return {
        "benchmark": "server_first_token",
        "command": " ".join(["python -m benchmarks.server_first_token", *sys.argv[1:]]),
        "engine_us": args.engine_us, "requests": args.requests, "requests_with_every_stage": len(complete),
        "requests_without": {stage: sum(stage not in row for row in rows) for stage in STAGES},
        "client_ttft_ms": statistics.median(r["ttft_s"] for r in runs[args.warmup:]) * 1e3,
        "stages_ms": {stage: statistics.median(row[stage] for row in complete) for stage in STAGES},
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("output", nargs="?")
    p.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the server process, on this port
    p.add_argument("--marks", help=argparse.SUPPRESS)  # where the server process writes its marks
    p.add_argument("--port", type=int, default=8138)
    p.add_argument("--engine-us", type=float, default=0.0, help="busy microseconds per engine step (default 0)")
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=8)
    args = p.parse_args()
    if args.serve is not None:
        from benchmarks.server_overhead import serve

        install_marks(Marks(Path(args.marks)))
        # The engine as a thread of the server's process: the marks of both sides share one clock and file.
        return serve(args.serve, args.engine_us, args.max_tokens, 1, 1.0, engine_thread=True)
    result = measure(args)
    print(json.dumps(result, indent=1))
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
