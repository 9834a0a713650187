"""What turning a request's tokens into text costs the host per step, by output length: the
whole-output decode each step against the incremental one (`ddtree.output.OutputBuilder`).

    python -m benchmarks.output_text OUTPUT.json [--tokens 128,1024,4096,16384] [--step 4]

With the demo pair's tokenizer, an output of `--tokens` tokens (text from this repository's
README, encoded) is fed `--step` tokens a step, as rounds commit them; per mode: the mean and the
last step's microseconds of `OutputBuilder.add` plus `text_delta`, and the request's total.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ddtree.config import SamplingParams
from ddtree.models.tokenizer import load_tokenizer
from ddtree.output import OutputBuilder

ROOT = Path(__file__).resolve().parents[1]


def run(tokenizer, ids: list[int], step: int, incremental: bool) -> dict:
    out = OutputBuilder(SamplingParams(max_tokens=len(ids) + 1, ignore_eos=True), [], tokenizer.decode_for_output,
                        incremental)
    times = []
    for at in range(0, len(ids), step):
        start = time.perf_counter()
        out.add(ids[at:at + step])
        out.text_delta()
        times.append(time.perf_counter() - start)
    assert out.text == tokenizer.decode_for_output(ids)
    return {"mean_step_us": sum(times) / len(times) * 1e6, "last_step_us": times[-1] * 1e6,
            "request_ms": sum(times) * 1e3}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("output")
    p.add_argument("--tokens", default="128,1024,4096,16384")
    p.add_argument("--step", type=int, default=4)
    args = p.parse_args()
    tokenizer = load_tokenizer(ROOT / "models" / "demo-target")
    text = (ROOT / "README.md").read_text()
    ids = tokenizer.encode(text)
    while len(ids) < max(int(n) for n in args.tokens.split(",")):
        ids = ids + ids
    rows = []
    for n in (int(n) for n in args.tokens.split(",")):
        row = {"tokens": n, "whole": run(tokenizer, ids[:n], args.step, False),
               "incremental": run(tokenizer, ids[:n], args.step, True)}
        rows.append(row)
        print(f"{n:6d} tokens: whole {row['whole']['mean_step_us']:8.1f} us a step (last "
              f"{row['whole']['last_step_us']:8.1f}), incremental {row['incremental']['mean_step_us']:6.1f} "
              f"(last {row['incremental']['last_step_us']:6.1f})", flush=True)
    result = {"benchmark": "output_text", "command": " ".join(["python -m benchmarks.output_text", *sys.argv[1:]]),
              "step": args.step, "rows": rows}
    Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
