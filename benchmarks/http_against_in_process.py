"""What the HTTP server leaves of in-process tokens/s, measured in one run: `ddtree bench --offline`
and `ddtree bench --base-url` against a `ddtree serve` of the same pair, with the same prompts.

    python -m benchmarks.http_against_in_process OUTPUT.json [--tree-budgets ar,64] [--num-prompts 32]
        [--max-tokens 128] [--modes process,thread] [--warmup-server] [--target DIR --draft DIR]
        [--device cuda] [--dtype bfloat16] [--max-model-len N] [--port 8139] [--serve-max-num-seqs N]

The in-process bench runs first, then for each of `--modes` a server is started (`process`: the
engine in its own process, serve's default; `thread`: `--no-engine-process`), benched over HTTP
and stopped. Every bench runs at concurrency 1 with --ignore-eos, so each request produces
--max-tokens tokens both ways. OUTPUT holds, per mode and budget, output tokens/s over HTTP and in
process and their ratio (the goal is 0.95), with the median time to first token and per output
token of each; each bench's own JSON is written beside OUTPUT (`<stem>_offline.json`,
`<stem>_<mode>.json`).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx


def model_flags(args) -> list[str]:
    flags = []
    for name in ("target", "draft", "device", "dtype", "max_model_len"):
        value = getattr(args, name)
        if value is not None:
            flags += ["--" + name.replace("_", "-"), str(value)]
    return flags


def bench_flags(args, output: Path) -> list[str]:
    return ["--tree-budgets", args.tree_budgets, "--num-prompts", str(args.num_prompts), "--max-tokens",
            str(args.max_tokens), "--concurrency", "1", "--ignore-eos", "--no-progress", "--output", str(output)]


def run(cmd: list[str], timeout: float) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {done.returncode}:\n{done.stderr[-3000:]}")


def serve_and_bench(args, mode: str, output: Path) -> None:
    """A `ddtree serve` in `mode`, benched over HTTP into `output`, then stopped (SIGTERM)."""
    url = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-m", "ddtree.cli", "serve", "--port", str(args.port), "--log-level", "warning",
           *model_flags(args), *(["--warmup"] if args.warmup_server else []),
           *(["--max-num-seqs", str(args.serve_max_num_seqs)] if args.serve_max_num_seqs else []),
           "--engine-process" if mode == "process" else "--no-engine-process"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDTREE_")}
    server = subprocess.Popen(cmd, env=env)
    try:
        deadline = time.monotonic() + args.start_timeout
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ddtree serve ({mode}) did not come up")
            time.sleep(0.5)
        run([sys.executable, "-m", "ddtree.cli", "bench", "--base-url", url, *bench_flags(args, output)],
            args.bench_timeout)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(120)
        except subprocess.TimeoutExpired:
            server.kill()


def by_budget(path: Path) -> dict[str, dict]:
    return {str(row["tree_budget"]): row for row in json.loads(path.read_text())["results"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("output")
    p.add_argument("--tree-budgets", default="ar,64")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--modes", default="process,thread", help="process (serve's default), thread, or both")
    p.add_argument("--warmup-server", action="store_true", help="serve --warmup (capture every graph first)")
    p.add_argument("--serve-max-num-seqs", type=int, help="serve --max-num-seqs N: the batched worker, at one "
                   "stream still (the in-process bench decodes one request at a time either way)")
    p.add_argument("--target")
    p.add_argument("--draft")
    p.add_argument("--device")
    p.add_argument("--dtype")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--port", type=int, default=8139)
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument("--bench-timeout", type=float, default=1800.0)
    args = p.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in ("process", "thread") for m in modes):
        p.error(f"--modes takes process and/or thread, got {args.modes!r}")
    out = Path(args.output)
    offline = out.with_name(out.stem + "_offline.json")
    run([sys.executable, "-m", "ddtree.cli", "bench", "--offline", *model_flags(args), *bench_flags(args, offline)],
        args.bench_timeout)
    in_process = by_budget(offline)
    result = {"benchmark": "http_against_in_process",
              "command": " ".join(["python -m benchmarks.http_against_in_process", *sys.argv[1:]]),
              "offline": str(offline), "serve_max_num_seqs": args.serve_max_num_seqs, "modes": {}}
    for mode in modes:
        live = out.with_name(f"{out.stem}_{mode}.json")
        serve_and_bench(args, mode, live)
        rows = {}
        for budget, row in by_budget(live).items():
            local = in_process[budget]
            rows[budget] = {
                "http_output_tokens_per_s": row["output_throughput"],
                "in_process_output_tokens_per_s": local["output_throughput"],
                "http_over_in_process": row["output_throughput"] / local["output_throughput"],
                "median_ttft_ms": {"http": row["median_ttft_ms"], "in_process": local["median_ttft_ms"]},
                "median_tpot_ms": {"http": row["median_tpot_ms"], "in_process": local["median_tpot_ms"]},
                # Where the HTTP run's time goes: the client's means against the server's own (from its
                # admission of a request, read and tokenized, to the engine's first and last token).
                "mean_ttft_ms": {"http_client": row["mean_ttft_ms"], "http_server": row.get("server_mean_ttft_ms"),
                                 "in_process": local["mean_ttft_ms"]},
                "mean_e2el_ms": {"http_client": row["mean_e2el_ms"], "http_server": row.get("server_mean_e2el_ms"),
                                 "in_process": local["mean_e2el_ms"]},
                "completed": {"http": row["completed"], "in_process": local["completed"]},
            }
        result["modes"][mode] = {"bench": str(live), "budgets": rows}
    print(json.dumps(result, indent=1))
    out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
