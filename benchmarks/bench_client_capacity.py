"""What `ddtree bench`'s own client can take: tokens/s and CPU time per streamed chunk against a
stand-in OpenAI server with no engine, so that a bench of a fast server can be told apart from a
bench bound by its client.

    python -m benchmarks.bench_client_capacity OUTPUT.json [--concurrency 16] [--chunks 32]
        [--delay-ms 0.5] [--prompts 32,256] [--port 8147]

The stand-in (this module with --serve, in a process of its own) answers every completion with
`--chunks` chunks of 4 tokens, `--delay-ms` apart (0: as fast as it can), then usage and [DONE].
`ddtree bench --base-url` runs against it at `--concurrency` over each count of `--prompts` (the
held-out set repeated as needed); the bench process's CPU seconds (user + system, from
getrusage of the finished child) at two prompt counts give the client's marginal CPU time per
chunk, free of its start-up. A delay keeps the chunks arriving one at a time, as from a real
server's rounds; with none, a stream's chunks arrive together and are read in fewer socket reads.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

TOKENS_PER_CHUNK = 4


def stand_in_app(chunks: int, delay_s: float):
    import asyncio

    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    head = {"id": "x", "object": "text_completion", "created": 0, "model": "stand-in"}
    text = " tok" * TOKENS_PER_CHUNK

    async def completions(request):
        await request.json()

        async def stream():
            for i in range(chunks):
                await asyncio.sleep(delay_s)
                last = i == chunks - 1
                chunk = {**head, "choices": [{"index": 0, "text": text, "logprobs": None,
                                              "finish_reason": "length" if last else None}]}
                if last:
                    chunk["ddtree"] = {"acceptance_lengths": [TOKENS_PER_CHUNK] * chunks, "decode_rounds": chunks,
                                       "tree_budget": "64", "budget_rounds": {"64": chunks}}
                yield f"data: {json.dumps(chunk)}\n\n"
            usage = {"prompt_tokens": 10, "completion_tokens": TOKENS_PER_CHUNK * chunks,
                     "total_tokens": 10 + TOKENS_PER_CHUNK * chunks}
            yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(stream(), media_type="text/event-stream")

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "stand-in", "object": "model"}]})

    async def health(request):
        return JSONResponse({"status": "ok", "model": "stand-in"})

    async def metrics(request):
        return PlainTextResponse("")

    return Starlette(routes=[Route("/v1/models", models), Route("/health", health), Route("/metrics", metrics),
                             Route("/v1/completions", completions, methods=["POST"])])


def prompts_file(folder: Path, count: int) -> Path:
    """The held-out prompts repeated (ids suffixed) up to `count` lines."""
    from importlib import resources

    with resources.as_file(resources.files("ddtree") / "data" / "stdlib_heldout.jsonl") as path:
        records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    out = folder / f"prompts_{count}.jsonl"
    with out.open("w") as f:
        for i in range(count):
            record = records[i % len(records)]
            f.write(json.dumps({"id": f"{record['id']}#{i // len(records)}", "prompt": record["prompt"]}) + "\n")
    return out


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def bench_once(url: str, dataset: Path, prompts: int, concurrency: int, folder: Path) -> dict:
    """One `ddtree bench` process -> its tokens/s, chunks and CPU seconds."""
    output = folder / f"bench_{prompts}.json"
    cmd = [sys.executable, "-m", "ddtree.cli", "bench", "--base-url", url, "--dataset", str(dataset),
           "--tree-budgets", "server", "--concurrency", str(concurrency), "--num-prompts", str(prompts),
           "--max-tokens", "128", "--warmup", "1", "--no-progress", "--output", str(output)]
    before = children_cpu_s()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    cpu = children_cpu_s() - before
    if done.returncode != 0:
        raise RuntimeError(f"ddtree bench exited with {done.returncode}:\n{done.stderr[-2000:]}")
    row = json.loads(output.read_text())["results"][0]
    return {"prompts": prompts, "completed": row["completed"], "output_tokens_per_s": row["output_throughput"],
            "median_ttft_ms": row["median_ttft_ms"], "client_cpu_s": cpu}


def measure(args) -> dict:
    import httpx

    from benchmarks.server_overhead import wait_until_up

    counts = [int(c) for c in args.prompts.split(",")]
    url = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_client_capacity", "--serve", str(args.port),
                               "--chunks", str(args.chunks), "--delay-ms", str(args.delay_ms)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with httpx.Client(timeout=1.0) as client:
            wait_until_up(client, url, server, timeout_s=60)
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            dataset = prompts_file(folder, max(counts))
            runs = [bench_once(url, dataset, n, args.concurrency, folder) for n in counts]
    finally:
        server.terminate()
        server.wait(10)
    chunks_per_request = args.chunks + 1  # the content chunks and the usage chunk
    first, last = runs[0], runs[-1]
    marginal = (last["client_cpu_s"] - first["client_cpu_s"]) / ((last["prompts"] - first["prompts"]) * chunks_per_request)
    return {"benchmark": "bench_client_capacity",
            "command": " ".join(["python -m benchmarks.bench_client_capacity", *sys.argv[1:]]),
            "concurrency": args.concurrency, "chunks_per_request": args.chunks, "tokens_per_chunk": TOKENS_PER_CHUNK,
            "delay_ms": args.delay_ms, "runs": runs, "client_cpu_us_per_chunk": marginal * 1e6}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("output", nargs="?")
    p.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the stand-in server, on this port
    p.add_argument("--port", type=int, default=8147)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--chunks", type=int, default=32, help="content chunks of 4 tokens per request")
    p.add_argument("--delay-ms", type=float, default=0.5, help="the stand-in's pause before each chunk")
    p.add_argument("--prompts", default="32,256", help="prompt counts, the first and last give the marginal cost")
    args = p.parse_args()
    if args.serve is not None:
        import uvicorn

        uvicorn.run(stand_in_app(args.chunks, args.delay_ms / 1e3), host="127.0.0.1", port=args.serve,
                    log_level="warning")
        return 0
    result = measure(args)
    print(json.dumps(result, indent=1))
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
