"""Acceptance of a target + drafter pair on held-out corpus prompts, measured by the engine at T = 0.

    python -m ddtree.train.evaluate --target models/demo-target --draft models/demo-drafter \
        --out benchmarks/results/demo-acceptance.json

Prompts start at a random line of a random held-out file (the same split as training). For every
tree budget the engine decodes each prompt greedily; the mean acceptance length is pooled over all
rounds (accepted tree nodes per round, bonus token counted, = 1 + accepted drafts / rounds). The
outputs of every budget are compared with plain autoregressive decoding (they must be identical).
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from ddtree.heldout import DEFAULT_HELD_OUT_FRACTION
from ddtree.config import DDTreeError, SamplingParams, parse_tree_budget
from ddtree.train.corpus import load_corpus, read_texts
from ddtree.tree_shape import AR, CHAIN, TreeShape

SAMPLE_PROMPTS = ["def fib(n):", "class Stack:\n    \"\"\"A last-in, first-out stack.\"\"\"\n\n    def __init__(self):"]


def held_out_prompts(llm, texts: list[str], count: int, prompt_tokens: int, seed: int) -> list[list[int]]:
    """`count` prompts of exactly `prompt_tokens` tokens, each starting at the start of a line."""
    rng = random.Random(seed)
    prompts, tries = [], 0
    while len(prompts) < count and tries < 100 * count:
        tries += 1
        lines = rng.choice(texts).splitlines(keepends=True)
        start = rng.randrange(len(lines))
        if not lines[start].strip():
            continue
        ids = llm.encode("".join(lines[start:start + 4 * prompt_tokens]))
        if len(ids) >= prompt_tokens:
            prompts.append(ids[:prompt_tokens])
    if len(prompts) < count:
        raise DDTreeError(f"the held-out files hold too few places for {count} prompts of {prompt_tokens} tokens")
    return prompts


def measure(llm, prompts: list[list[int]], budgets: list[TreeShape], max_tokens: int) -> dict:
    """Decode every prompt with every budget -> per-budget acceptance and speed, plus the outputs."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    results = {}
    for budget in budgets:
        lengths, speeds, outputs, start = [], [], [], time.perf_counter()
        for ids in prompts:
            r = llm.generate(ids, params, budget)
            lengths.extend(r.stats.acceptance_lengths)
            speeds.append(r.stats.tokens_per_second)
            outputs.append(r.token_ids)
        results[budget.label] = {
            "rounds": len(lengths),
            "mean_acceptance_length": sum(lengths) / max(len(lengths), 1),
            "median_tokens_per_second": statistics.median(speeds),
            "wall_seconds": round(time.perf_counter() - start, 2),
            "outputs": outputs,
        }
    return results


def git_revision() -> str:
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).parent)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else "unknown"


def machine(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name()} ({platform.machine()}, torch {torch.__version__})"
    return f"{platform.processor() or platform.machine()} CPU ({platform.machine()}, torch {torch.__version__})"


def evaluate(args: argparse.Namespace) -> dict:
    from ddtree.llm import LLM

    budgets = [parse_tree_budget(b) for b in args.budgets.split(",")]
    llm = LLM(args.target, args.draft, device=args.device)
    corpus = load_corpus(args.corpus, args.held_out_fraction)
    prompts = held_out_prompts(llm, read_texts(corpus.held_out_files), args.prompts, args.prompt_tokens, args.seed)
    results = measure(llm, prompts, [AR, *budgets], args.max_tokens)
    reference = results[AR.label]["outputs"]
    for r in results.values():
        r["identical_to_ar"] = sum(a == b for a, b in zip(r["outputs"], reference))
    lossless = all(r["identical_to_ar"] == len(prompts) for r in results.values())
    samples = []
    for text in SAMPLE_PROMPTS:
        r = llm.generate(text, SamplingParams(max_tokens=args.sample_tokens, temperature=0.0), budgets[-1])
        samples.append({"prompt": text, "completion": r.text, "tree_budget": budgets[-1].label,
                        "mean_acceptance_length": r.stats.mean_acceptance_length})
    for r in results.values():
        del r["outputs"]
    chain = results.get(CHAIN.label, {}).get("mean_acceptance_length")
    report = {
        "command": "python -m ddtree.train.evaluate " + shlex.join(sys.argv[1:] if args.argv is None else args.argv),
        "machine": machine(str(llm.device)),
        "git_revision": git_revision(),
        "target": str(args.target),
        "draft": str(args.draft),
        "corpus": corpus.describe(),
        "prompts": len(prompts),
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "temperature": 0.0,
        "lossless": lossless,
        "results": results,
        "tree_over_chain": {b.label: results[b.label]["mean_acceptance_length"] / chain
                            for b in budgets if b != CHAIN and chain},
        "samples": samples,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'budget':>8} {'rounds':>7} {'accept':>7} {'tok/s':>8}")
    for name, r in results.items():
        print(f"{name:>8} {r['rounds']:>7} {r['mean_acceptance_length']:>7.2f} {r['median_tokens_per_second']:>8.1f}")
    same = ", ".join(f"{k} {r['identical_to_ar']}/{len(prompts)}" for k, r in results.items())
    print(f"outputs identical to ar: {same}; wrote {out}")
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddtree.train.evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--out", required=True, help="JSON report path")
    p.add_argument("--corpus", action="append", default=None, metavar="DIR", help="default: the standard library")
    p.add_argument("--held-out-fraction", type=float, default=DEFAULT_HELD_OUT_FRACTION, help="must match training (default 0.02)")
    p.add_argument("--budgets", default="chain,64", help="tree budgets besides ar (default chain,64)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--sample-tokens", type=int, default=96)
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.argv = argv
    try:
        evaluate(args)
    except DDTreeError as exc:
        print(f"ddtree: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
