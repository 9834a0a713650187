"""End-to-end decoding speed of the demo pair on a GPU, graphs on, with output parity.

    python benchmarks/e2e.py [--budgets ar,chain,16,...] [--num-prompts 16] [--max-tokens 128]
        [--no-eager-parity] [--no-overlap] [--output FILE.json]

For each budget: output tokens/s over held-out stdlib prompts (greedy, the same prompts for
every budget, after capturing all of the budget's graphs and one warm-up prompt), mean acceptance
length, time to first token and time per round, speedup over ar and over chain, and parity: the
fraction of prompts whose tokens equal (a) the ar output and (b) the same budget on the eager
path (no CUDA graphs; in bf16 the eager path uses the same fused kernels, KV buckets and padded
prefill lengths, so that only graph replay differs; --no-eager-parity skips (b), about half the
run). Writes JSON to benchmarks/results/ after every budget, so a run cut short keeps the
budgets it finished.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from ddtree.bench.machine import git_revision, results_path
from ddtree.bench.datasets import load_prompts
from ddtree.config import SamplingParams, parse_tree_budget
from ddtree.llm import LLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--target", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--budgets", default="ar,chain,16,32,64,128,256,512,1024")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--no-eager-parity", action="store_true", help="skip the eager path's run of every prompt")
    ap.add_argument("--no-overlap", action="store_true",
                    help="read each round's summary before launching the next (Engine overlap=False)")
    ap.add_argument("--output", default=None)
    args = ap.parse_args()

    graphs = LLM(args.target, args.draft, device="cuda", dtype=args.dtype, use_graphs=True, overlap=not args.no_overlap)
    same = dict(compile_layers=True, kv_bucket=graphs.engine.kv_bucket, padded_prefill=True) if args.dtype != "float32" else {}
    eager = None if args.no_eager_parity else \
        LLM(args.target, args.draft, device="cuda", dtype=args.dtype, use_graphs=False, **same)
    prompts = [graphs.prompt_ids(p.prompt if p.prompt is not None else graphs.apply_chat_template(p.messages))
               for p in load_prompts("stdlib", args.num_prompts + 1)]
    warm, prompts = prompts[0], prompts[1:]
    params = SamplingParams(max_tokens=args.max_tokens)
    rows, outputs = [], {}
    for label in args.budgets.split(","):
        budget = parse_tree_budget(label)
        graphs.warmup(budget)  # captures every graph of this budget, outside the timing
        graphs.generate(warm, params, budget)
        tokens, seconds, accept, eager_same, first_token_s, prompt_tokens = 0, 0.0, [], 0, 0.0, 0
        outs = []
        for prompt in prompts:
            torch.cuda.synchronize()
            t = time.perf_counter()
            r = graphs.generate(prompt, params, budget)
            torch.cuda.synchronize()  # a round launched ahead past the last token counts too
            seconds += time.perf_counter() - t
            tokens += len(r.token_ids)
            accept.extend(r.stats.acceptance_lengths)
            first_token_s += r.stats.time_to_first_token_s
            prompt_tokens += len(prompt)
            outs.append(r.token_ids)
            if eager is not None:
                eager_same += eager.generate(prompt, params, budget).token_ids == r.token_ids
        outputs[label] = outs
        rows.append({"tree_budget": label, "output_tokens": tokens, "seconds": seconds,
                     "tokens_per_second": tokens / seconds,
                     "mean_acceptance_length": statistics.fmean(accept) if accept else 0.0,
                     # where the time goes: the prefill (to the first token) and each decoding round
                     "mean_prompt_tokens": prompt_tokens / len(prompts),
                     "mean_time_to_first_token_ms": first_token_s * 1000 / len(prompts),
                     "ms_per_round": (seconds - first_token_s) * 1000 / max(len(accept), 1),
                     "parity_vs_eager": eager_same / len(prompts) if eager is not None else None})
        print(f"{label:>6}  {tokens / seconds:8.1f} tok/s  accept {rows[-1]['mean_acceptance_length']:5.2f}  "
              f"ttft {rows[-1]['mean_time_to_first_token_ms']:.2f} ms  round {rows[-1]['ms_per_round']:.3f} ms  "
              f"parity eager {rows[-1]['parity_vs_eager']}", flush=True)
        best, out = write_result(args, graphs, rows, outputs, len(prompts))
    for r in rows:
        print(f"{r['tree_budget']:>6}  {r['tokens_per_second']:8.1f} tok/s  x{r['speedup_vs_ar'] or 0:5.2f} vs ar  "
              f"x{r['speedup_vs_chain'] or 0:5.2f} vs chain  accept {r['mean_acceptance_length']:5.2f}  "
              f"parity ar {r.get('parity_vs_ar', 0):.2f} eager {r['parity_vs_eager']}", flush=True)
    if best:
        margins = ", ".join(f"x{best[key]:.2f} vs {name}" for key, name in (("speedup_vs_chain", "chain"), ("speedup_vs_ar", "ar"))
                            if best[key] is not None)  # None: that baseline was not in --budgets
        print(f"best budget {best['tree_budget']}: {margins}; wrote {out}")


def write_result(args, graphs: LLM, rows: list[dict], outputs: dict, prompts: int):
    """Speedups and parity with ar for the budgets done so far, then the JSON -> (best tree row, path)."""
    base = {r["tree_budget"]: r["tokens_per_second"] for r in rows}
    for r in rows:
        r["speedup_vs_ar"] = r["tokens_per_second"] / base["ar"] if "ar" in base else None
        r["speedup_vs_chain"] = r["tokens_per_second"] / base["chain"] if "chain" in base else None
        if "ar" in outputs:
            r["parity_vs_ar"] = sum(a == b for a, b in zip(outputs[r["tree_budget"]], outputs["ar"])) / prompts
    trees = [r for r in rows if parse_tree_budget(r["tree_budget"]).builds_tree]
    best = max(trees, key=lambda r: r["tokens_per_second"]) if trees else None
    result = {
        "benchmark": "e2e",
        "command": "python benchmarks/e2e.py " + " ".join(
            f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}")
            for k, v in vars(args).items() if v is not None and v is not False),
        "machine": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version()},
        "git_revision": git_revision(),
        "models": {"target": str(graphs.target_path), "draft": str(graphs.draft_path)},
        "dtype": args.dtype, "num_prompts": prompts, "max_tokens": args.max_tokens, "overlap": not args.no_overlap,
        "graph_capture_seconds": graphs.engine.capture_seconds,
        "rows": rows,
        "best_tree_budget": best and best["tree_budget"],
    }
    out = results_path(args.output, "e2e")
    out.write_text(json.dumps(result, indent=2))
    return best, out


if __name__ == "__main__":
    with torch.inference_mode():
        main()
