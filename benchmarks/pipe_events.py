"""What a batched round's events cost to cross the engine process's pipe: `ForkingPickler` (as
`multiprocessing.Connection.send` pickles) on the engine's side, `pickle.loads` on the front's, per
round of `--rows` events of `--tokens` tokens each, on this CPU.

    python -m benchmarks.pipe_events [OUTPUT.json] [--rows 16] [--tokens 5] [--calls 5000]

Both sides run on a thread that also serves the round (the engine's, the front's pipe reader), so
their microseconds add to every round at that many streams.
"""
from __future__ import annotations

import argparse
import json
import pickle
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

from ddtree.bench.machine import git_revision
from ddtree.bench.timing import host_us_per_call
from ddtree.llm import StreamEvent


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("output", nargs="?")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--tokens", type=int, default=5)
    p.add_argument("--calls", type=int, default=5000)
    args = p.parse_args()
    # The engine process's "items" message: (the front's key, the event) per row.
    message = ("items", [(key, StreamEvent(list(range(100, 100 + args.tokens)), " return fib(n - 1)"))
                         for key in range(args.rows)])
    data = bytes(ForkingPickler.dumps(message))
    assert pickle.loads(data) == message
    result = {
        "benchmark": "pipe_events",
        "command": "python -m benchmarks.pipe_events " + " ".join(
            f"--{k} {v}" for k, v in vars(args).items() if k != "output"),
        "git_revision": git_revision(),
        "rows": args.rows, "tokens": args.tokens, "bytes": len(data),
        "pickle_us": host_us_per_call(lambda: ForkingPickler.dumps(message), args.calls),
        "unpickle_us": host_us_per_call(lambda: pickle.loads(data), args.calls),
    }
    print(json.dumps(result, indent=1))
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
