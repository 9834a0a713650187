"""Where a streamed request's time to first token goes inside `ddtree serve`, stage by stage.

    python -m benchmarks.server_first_token OUTPUT.json [--requests 60] [--warmup 10] [--engine-us 0]
        [--engine-process] [--real [--target DIR --draft DIR --device cuda --dtype bfloat16 --tree-budget 64
        --max-model-len N]]

The server is `benchmarks.server_overhead`'s (the demo pair on the CPU, its engine replaying one
recorded generation, each step `--engine-us` of busy Python; the engine a thread of the server's
process, `serve --no-engine-process`, or with `--engine-process` a process of its own, serve's
default), with marks added around the request's
path: the server process times each request from the moment it reaches the app, and a client
process times it from sending to the first content chunk. The stages, each a median over the
requests after the warm-up, in ms from the request reaching the app:

    prepare_call      body read and validated, the prompt handed to a worker thread
    prepare_start     that thread starts (the hop to it)
    prepare_end       chat template, tokenizing and the request's checks done
    prepare_back      the handler has the result again (the hop back)
                      (none of the four when the body is small enough to be tokenized on the
                      loop, `app.INLINE_PREPARE_BYTES`)
    submit            the job queued for the engine thread
    engine_start      the engine thread has taken it (its wake-up)
    emit              the first event leaves the engine thread
    loop_put          the event loop has put it in the job's queue
    handler_event     the handler has it
    first_content     the first chunk with content is sent

With `--engine-process` the job crosses the pipe: `submit` is the front's send, then (marked in
the engine process, whose clock is the same system-wide monotonic one)

    engine_submit     the engine process's main thread has read it and queued it for its worker
    engine_start      the worker thread has taken it
    emit              the first event leaves the worker (to the pipe)

and `pipe_back` the front's pipe reader has the event, before `loop_put`.

`client_ttft_ms` beside them is the client's view: the rest is the client's own time, the socket
and uvicorn's parsing of the request before the app sees it.

With `--real` the engine is the real pair (`ddtree serve --warmup` of `--target`/`--draft`, the
demo pair by default, on `--device`), not a replay, so `emit - engine_start` is the engine's own
time to its first token inside the server; `in_process_ttft_ms` beside it is the same prompt's
first token from the same `LLM` called directly (`LLM.stream`, a fresh load in the client's
process after the server has stopped). The end of every request is marked too (`end_stages_ms`,
the same medians, with any engine): `emit_last` (the last event leaves the engine),
`pipe_back_last`, `last_sent` (the stream's last chunk is handed to uvicorn), against the client's
`client_e2e_ms` (and, with `--real`, the in-process `in_process_e2e_ms`).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

STAGES = ("prepare_call", "prepare_start", "prepare_end", "prepare_back", "submit", "engine_start", "emit",
          "loop_put", "handler_event", "first_content")
END_STAGES = ("emit_last", "last_sent")
END_PROCESS_STAGES = ("emit_last", "pipe_back_last", "last_sent")
PROCESS_STAGES = ("prepare_call", "prepare_start", "prepare_end", "prepare_back", "submit", "engine_submit",
                  "engine_start", "emit", "pipe_back", "loop_put", "handler_event", "first_content")


class Marks:
    """The running request's stage times (one request at a time), a JSON line per request.
    `engine_side`: this process is the engine's (spawned), whose every mark is a line of its own."""

    def __init__(self, path: Path, engine_thread: bool = True, engine_side: bool = False):
        self.engine_thread = engine_thread
        self.file = path.open("a")
        self.times: dict[str, float] = {}
        self.lock = threading.Lock()
        self.pid = -1 if engine_side else os.getpid()

    def mark(self, stage: str) -> None:
        now = time.perf_counter()
        if os.getpid() != self.pid:  # the engine process (forked or spawned): every mark, with its clock time
            self.file.write(json.dumps({"engine_stage": stage, "t": now}) + "\n")
            self.file.flush()
            return
        with self.lock:
            self.times.setdefault(stage, now)
            self.times[stage + "_last"] = now

    def start(self) -> dict[str, float]:
        """A new request: its marks from now on (the last one's may still be finishing)."""
        with self.lock:
            self.times = {"arrive": time.perf_counter()}
            return self.times

    def flush(self, times: dict[str, float]) -> None:
        with self.lock:
            t0 = times["arrive"]
            self.file.write(json.dumps({**{k: (v - t0) * 1e3 for k, v in times.items()}, "arrive_at": t0}) + "\n")
            self.file.flush()


def install_marks(marks: Marks) -> None:
    """Wrap the functions on a request's path so that each marks its stage."""
    import anyio.to_thread

    from ddtree.server import engine_client, middleware, worker

    def before(owner, name: str, stage: str) -> None:
        fn = getattr(owner, name)

        def wrapped(*args, **kwargs):
            marks.mark(stage)
            return fn(*args, **kwargs)
        wrapped.__wrapped_mark__ = True
        setattr(owner, name, wrapped)

    before(worker.EngineWorker, "submit", "submit" if marks.engine_thread else "engine_submit")
    before(engine_client.EngineClient, "submit", "submit")
    before(engine_client.EngineClient, "_deliver", "pipe_back")
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
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                marks.mark("last_sent")
            await send(message)
        await outer(self, scope, receive, marked_send)
        marks.flush(times)
    middleware.RequestIdMiddleware.__call__ = marked_call


MARKS_ENV = "SERVER_FIRST_TOKEN_MARKS"


def marked_load(*args, **kwargs):
    """`ddtree.server.main.load_for_serving` in the engine process, with the marks installed there
    first (a forked engine has them already; marking twice would only repeat each line)."""
    from ddtree.server import main as server_main, worker

    if not hasattr(worker.EngineWorker.submit, "__wrapped_mark__"):
        install_marks(Marks(Path(os.environ[MARKS_ENV]), engine_thread=False, engine_side=True))
    return (_ORIGINAL_LOAD[0] if _ORIGINAL_LOAD else server_main.load_for_serving)(*args, **kwargs)


_ORIGINAL_LOAD: list = []  # the server process's load_for_serving, before `marked_load` replaced it


def measure(args) -> dict:
    import httpx

    from benchmarks.server_overhead import stream_one, wait_until_up

    with tempfile.TemporaryDirectory() as tmp:
        marks_path = Path(tmp) / "marks.jsonl"
        child = subprocess.Popen([sys.executable, "-m", "benchmarks.server_first_token", "--serve", str(args.port),
                                  "--marks", str(marks_path), "--engine-us", str(args.engine_us),
                                  "--max-tokens", str(args.max_tokens),
                                  *(["--engine-process"] if args.engine_process else []), *real_flags(args)])
        url = f"http://127.0.0.1:{args.port}"
        try:
            with httpx.Client(timeout=120) as client:
                wait_until_up(client, url, child)
                model = client.get(url + "/v1/models").json()["data"][0]["id"]
                runs = [stream_one(client, url, args.max_tokens, model) for _ in range(args.warmup + args.requests)]
        finally:
            child.terminate()
            child.wait(30)
        lines = [json.loads(line) for line in marks_path.read_text().splitlines()]
    rows = with_engine_marks([r for r in lines if "engine_stage" not in r],
                             [r for r in lines if "engine_stage" in r])[args.warmup:]
    stages = PROCESS_STAGES if args.engine_process else STAGES
    # A small body is tokenized on the loop (no worker thread): its rows have no prepare_* marks.
    stages = [s for s in stages if not s.startswith("prepare_") or any(s in row for row in rows)]
    end_stages = END_PROCESS_STAGES if args.engine_process else END_STAGES
    complete = [row for row in rows if all(stage in row for stage in (*stages, *end_stages))]
    timed = runs[args.warmup:]
    result = {
        "benchmark": "server_first_token",
        "command": " ".join(["python -m benchmarks.server_first_token", *sys.argv[1:]]),
        "engine_process": args.engine_process, "real": args.real,
        "engine_us": None if args.real else args.engine_us, "requests": args.requests,
        "requests_with_every_stage": len(complete),
        "requests_without": {stage: sum(stage not in row for row in rows) for stage in (*stages, *end_stages)},
        "client_ttft_ms": statistics.median(r["ttft_s"] for r in timed) * 1e3,
        "client_e2e_ms": statistics.median(r["e2e_s"] for r in timed) * 1e3,
        "client_tokens": statistics.median(r["tokens"] for r in timed),
        "stages_ms": {stage: statistics.median(row[stage] for row in complete) for stage in stages},
        "end_stages_ms": {stage: statistics.median(row[stage] for row in complete) for stage in end_stages},
    }
    if args.real:
        result.update(in_process(args))
    return result


def pair_flags(args) -> list[str]:
    """--target / --draft / --dtype / --max-model-len as given (the same for this script and serve)."""
    flags = []
    for name in ("target", "draft", "dtype", "max_model_len"):
        if getattr(args, name) is not None:
            flags += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return flags


def real_flags(args) -> list[str]:
    """The server process's flags for --real (none without it)."""
    if not args.real:
        return []
    return ["--real", "--tree-budget", args.tree_budget, "--device", args.device, *pair_flags(args)]


def in_process(args) -> dict:
    """The same prompt and settings through `LLM.stream` in this process (after the server stopped):
    median time to its first token and to its end over the same number of requests."""
    from benchmarks.server_overhead import PROMPT
    from ddtree.config import SamplingParams, parse_tree_budget
    from ddtree.server.main import _load

    budget = parse_tree_budget(args.tree_budget)
    llm = _load(real_serve_args(args), budget, warmup=True)
    ids = llm.apply_chat_template(PROMPT)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
    ttft, e2e = [], []
    for index in range(args.warmup + args.requests):
        start = time.perf_counter()
        first = None
        for event in llm.stream(ids, params, budget):
            if first is None and event.token_ids:
                first = time.perf_counter() - start
        if index >= args.warmup:
            ttft.append(first * 1e3)
            e2e.append((time.perf_counter() - start) * 1e3)
    return {"in_process_ttft_ms": statistics.median(ttft), "in_process_e2e_ms": statistics.median(e2e)}


def real_serve_args(args, port: int = 8000, engine_process: bool = False):
    """`ddtree serve`'s parsed arguments for the real pair (the demo pair when no --target)."""
    from ddtree.cli import build_parser

    argv = ["serve", "--port", str(port), "--device", args.device, "--tree-budget", args.tree_budget, "--warmup",
            "--log-level", "warning", "--engine-process" if engine_process else "--no-engine-process", *pair_flags(args)]
    return build_parser().parse_args(argv)


def with_engine_marks(rows: list[dict], engine_marks: list[dict]) -> list[dict]:
    """Each request's row with the engine process's first mark of each stage between its arrival
    and the next request's (one request at a time), and its last as `<stage>_last`, in ms from its
    arrival."""
    starts = [row["arrive_at"] for row in rows] + [float("inf")]
    for row, start, end in zip(rows, starts, starts[1:]):
        for mark in engine_marks:
            if start <= mark["t"] < end:
                row.setdefault(mark["engine_stage"], (mark["t"] - start) * 1e3)
                row[mark["engine_stage"] + "_last"] = (mark["t"] - start) * 1e3
    return rows


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
    p.add_argument("--engine-process", action="store_true", help="the engine in a process of its own (serve's default)")
    p.add_argument("--real", action="store_true", help="the real pair's engine (serve --warmup), not a replay")
    p.add_argument("--target", help="with --real: the target (default: the demo pair)")
    p.add_argument("--draft", help="with --real: the drafter")
    p.add_argument("--device", default="cpu", help="with --real: the device (default cpu)")
    p.add_argument("--dtype", help="with --real: the dtype")
    p.add_argument("--tree-budget", default="ar", help="with --real: the server's budget (default ar)")
    p.add_argument("--max-model-len", type=int, help="with --real: the context limit")
    args = p.parse_args()
    if args.serve is not None and args.real:
        from ddtree.server import main as server_main

        install_marks(Marks(Path(args.marks), engine_thread=not args.engine_process))
        # On CUDA the engine process is spawned: it marks its stages once its load (this module's
        # `marked_load`, pickled by name) has installed the marks there.
        os.environ[MARKS_ENV] = args.marks
        _ORIGINAL_LOAD.append(server_main.load_for_serving)
        server_main.load_for_serving = marked_load
        return server_main.cmd_serve(real_serve_args(args, args.serve, args.engine_process))
    if args.serve is not None:
        from benchmarks.server_overhead import serve

        install_marks(Marks(Path(args.marks), engine_thread=not args.engine_process))
        # A thread of the server's process, or a process forked from it with the marks installed:
        # either way every mark is on the system's monotonic clock, in one file.
        return serve(args.serve, args.engine_us, args.max_tokens, 1, 1.0, engine_thread=not args.engine_process)
    result = measure(args)
    print(json.dumps(result, indent=1))
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
