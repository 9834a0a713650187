"""`ddtree generate`: one prompt, streamed to the terminal or printed as one JSON object."""
from __future__ import annotations

import argparse
import json
import sys

from ddtree.cli_args import add_model_args
from ddtree.config import DDTreeError
from ddtree.flags import TOP_K
from ddtree.tree_shape import DEFAULT_BEST


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 decodes greedily (default); above 0 samples, exactly as the target alone would")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1: off)")
    parser.add_argument("--top-k", type=TOP_K, default=0,
                        help="sample among the k likeliest tokens (default 0: off; -1 also means off)")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed, for a reproducible sample at T > 0")
    parser.add_argument("--stop", action="append", default=None, metavar="TEXT",
                        help="end the text just before this string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-text token")


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise DDTreeError(f"--prompt-token-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise DDTreeError("--prompt-token-ids is empty")
    return ids


def cmd_generate(args: argparse.Namespace) -> int:
    from ddtree.config import SamplingParams, parse_tree_budget
    from ddtree.model_pair import check_budget_has_drafter, check_pair_configs, default_drafter, no_drafter_warning

    budget = parse_tree_budget(args.tree_budget) if args.tree_budget is not None else None
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop or [], ignore_eos=args.ignore_eos)
    prompt = _token_ids(args.prompt_token_ids) if args.prompt_token_ids is not None else args.prompt
    check_budget_has_drafter(budget, args.target, args.draft)
    check_pair_configs(args.target, args.draft, args.max_model_len, args.rope_scaling)
    draft = args.draft or default_drafter(args.target)
    if draft is None and budget is None:
        print(f"ddtree: warning: {no_drafter_warning(args.target)}", file=sys.stderr)

    from ddtree.llm import LLM

    use_draft = args.draft is not None or (draft is not None and (budget is None or budget.drafts))
    llm = LLM(args.target, draft, device=args.device, dtype=args.dtype, tree_budget=budget,
              max_model_len=args.max_model_len, use_draft=use_draft, rope_scaling=args.rope_scaling)
    budget = llm.default_budget
    if args.json:
        result = llm.generate(prompt, params, budget)
        print(json.dumps(result.to_dict()))
        return 0
    result = None
    for event in llm.stream(prompt, params, budget):
        print(event.text, end="", flush=True)
        result = event.result
    s = result.stats
    print(f"\n[{len(result.token_ids)} tokens, finish={result.finish_reason}, budget={s.tree_budget}, "
          f"rounds={s.decode_rounds}, mean acceptance={s.mean_acceptance_length:.2f}, "
          f"{s.tokens_per_second:.1f} tok/s, ttft={s.time_to_first_token_s * 1000:.0f} ms]", file=sys.stderr)
    return 0


def register(subparsers) -> None:
    gen = subparsers.add_parser("generate", help="generate from one prompt")
    add_model_args(gen)
    src = gen.add_mutually_exclusive_group()
    src.add_argument("--prompt", default="def fib(n):", help="the prompt text (default 'def fib(n):')")
    src.add_argument("--prompt-token-ids", default=None, help="comma-separated token ids, e.g. 1,2,3")
    add_sampling_args(gen)
    gen.add_argument("--tree-budget", default=None,
                     help=f"ar, chain or an integer >= 1 (default {DEFAULT_BEST}; ar for a target given without --draft)")
    gen.add_argument("--json", action="store_true", help="print one JSON object with text, token ids and stats")
    gen.set_defaults(func=cmd_generate)
