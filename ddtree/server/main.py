"""`ddtree serve`: an OpenAI-compatible endpoint for a target + DFlash drafter pair.

The port is bound first (a port in use is one line and exit code 2), then the HTTP server starts
and the pair loads in a background thread, so /health answers 503 ("loading") until the engine is
ready. SIGTERM (what `systemctl stop` sends) stops accepting connections and lets the requests in
flight and in the queue finish; what is left then ends with an error (a final error chunk for a
stream) and the process exits 0, all within --shutdown-timeout seconds. An engine failure turns /health
503 for --failure-exit-delay seconds, then exits 1 so that the service manager restarts the server.
Every flag can also come from a `DDTREE_<FLAG>` environment variable (e.g. DDTREE_TARGET,
DDTREE_API_KEY), which is how the systemd unit passes them.
"""
from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import threading
import time
from pathlib import Path

from ddtree.cli_args import add_model_args
from ddtree.config import PREFILL_CHUNK, DDTreeError, parse_tree_budget
from ddtree.server.limits import ServerLimits
from ddtree.flags import PORT, int_at_least
from ddtree.model_pair import check_budget_has_drafter, check_pair_configs
from ddtree.tree_shape import TreeShape

log = logging.getLogger("ddtree.server")

# ServerLimits' fields, each a flag: (type, help). Defaults and checks are ServerLimits'.
LIMIT_FLAGS = {
    "max_tree_budget": (int, "largest tree budget a request may name; larger ones are answered 400 (the "
                             "server's own default is always allowed)"),
    "max_cached_budgets": (int, "tree budgets besides the default whose buffers and graphs stay allocated; "
                                "the least recently used beyond it are freed"),
    "max_num_seqs": (int, "requests decoded together, in one batch per round; more wait in the queue "
                          "(default: 8 on a CPU; 1 on CUDA, where batching is opt-in, and for hybrid targets)"),
    "default_max_tokens": (int, "max_tokens of a chat request that names none (fewer when the context has less "
                                "room; completions default to 16, as in OpenAI)"),
    "max_output_tokens": (int, "most max_tokens a request may ask for; more is answered 400 (default: the "
                               "context's room)"),
    "max_stop": (int, "most stop strings, and stop token ids, per request (more: 400)"),
    "max_stop_chars": (int, "longest stop string, in characters (longer: 400)"),
    "max_request_bytes": (int, "larger request bodies are answered 400"),
    "max_json_depth": (int, "deepest nesting of objects and arrays in a request body (deeper: 400)"),
    "max_json_keys": (int, "most keys in one object of a request body (more: 400)"),
    "max_json_values": (int, "most JSON values in a request body (more: 400; default 2 x max-model-len + 4096)"),
    "max_queued_requests": (int, "requests waiting for the engine; more are answered 429 with Retry-After"),
    "max_connections": (int, "open connections; more are answered 503 (uvicorn's limit_concurrency)"),
    "max_header_bytes": (int, "largest request line + headers; larger: 400 and the connection closed"),
    "read_timeout": (float, "seconds for a request's head and body to arrive, from its first byte; a "
                            "connection still receiving one then is closed"),
    "keep_alive_timeout": (float, "seconds an idle kept-alive connection stays open"),
    "shutdown_timeout": (float, "seconds from SIGTERM to the process's exit: requests in flight and queued "
                                "finish until about a second before, then end with an error"),
    "engine_stall_timeout": (float, "/health answers 503 once the engine has had work but made no progress "
                                    "for this many seconds"),
    "failure_exit_delay": (float, "seconds /health answers 503 after an engine failure before the server "
                                  "exits with code 1"),
    "engine_stall_exit": (float, "seconds without engine progress, with work waiting, after which the server "
                                 "ends its requests with an error and exits with code 1 so that a service "
                                 "manager restarts it; 0: never"),
}
ENV_FLAGS = ("target", "draft", "device", "dtype", "max_model_len", "rope_scaling", "host", "port", "tree_budget",
             "served_model_name", "api_key", "log_level", "warmup", "engine_process", "prefill_chunk",
             "gpu_memory_utilization", "kv_cache_tokens", *LIMIT_FLAGS)
TRUE_WORDS, FALSE_WORDS = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve an OpenAI-compatible endpoint",
                              description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health, "
                                          "/metrics and /version. Each flag may also be set by the "
                                          "environment variable DDTREE_<FLAG> (e.g. DDTREE_API_KEY).")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=PORT, default=8000, help="port (default 8000)")
    p.add_argument("--tree-budget", default=None,
                   help="budget of requests that name none: ar, chain, an integer >= 1, or auto (a tune "
                        "file's pick per temperature, or measured at start-up); default: the fastest of ar, 15 "
                        "and 63 per temperature, measured on the requests served")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: the target directory's name)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* (prefer DDTREE_API_KEY)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--warmup", action="store_true",
                   help="on CUDA, capture every graph of the server's tree budgets (its default and those it "
                        "chooses among: all prefill lengths and KV buckets; with --max-num-seqs above 1, the "
                        "batched rounds' every row bucket and KV bucket) before serving: no capture pauses on "
                        "first requests, for start-up time and GPU memory (a logits buffer per KV bucket); "
                        "DDTREE_WARMUP=1 sets it")
    p.add_argument("--prefill-chunk", type=int_at_least(1), default=PREFILL_CHUNK,
                   help="most tokens of a long prompt one forward prefills (its activation memory grows with "
                        f"it); with --max-num-seqs above 1, a prompt joins a running batch a chunk a round, so "
                        f"the requests decoding wait for one chunk at a time (default {PREFILL_CHUNK})")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="on CUDA, the share of the device's memory the server may hold in all: with --max-num-seqs "
                        "above 1, the KV cache the requests share takes what the weights, the engines' buffers "
                        "and a margin for activations leave of it, and each request holds a region sized by its "
                        "prompt, max_tokens and tree, so short requests leave room for more (default 0.9)")
    p.add_argument("--kv-cache-tokens", type=int_at_least(1), default=None,
                   help="the batched KV cache's size in tokens (slots), instead of --gpu-memory-utilization's; any "
                        "device; at least one request at --max-model-len must fit")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine in a process of its own, so that the HTTP server's Python and the "
                        "engine's never wait for each other's interpreter lock (default); --no-engine-process "
                        "runs it as a thread of the server's process; DDTREE_ENGINE_PROCESS=0 sets that")
    defaults = ServerLimits()
    for name, (kind, text) in LIMIT_FLAGS.items():
        default = getattr(defaults, name)
        shown = "" if default is None else f" (default {default:g})" if kind is float else f" (default {default})"
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=default, help=text + shown)
    env = {flag: os.environ[f"DDTREE_{flag.upper()}"] for flag in ENV_FLAGS if os.environ.get(f"DDTREE_{flag.upper()}")}
    p.set_defaults(func=cmd_serve, **env)


def flag_enabled(value: bool | str, name: str) -> bool:
    """A boolean flag from the command line (bool) or the environment (one of TRUE_WORDS / FALSE_WORDS)."""
    if isinstance(value, bool):
        return value
    word = value.strip().lower()
    if word not in TRUE_WORDS + FALSE_WORDS:
        raise DDTreeError(f"DDTREE_{name.upper()} must be one of {', '.join(TRUE_WORDS + FALSE_WORDS[:-1])}, got {value!r}")
    return word in TRUE_WORDS


def _load(args: argparse.Namespace, budget, warmup: bool = False, max_tree_budget: int | None = None):
    """Load the pair, settle its default tree budget (measuring it for 'auto'; with no --tree-budget,
    choosing it while serving) and, with `warmup`, capture the graphs of the budgets it serves."""
    from ddtree.llm import LLM

    fixed = budget not in (None, "auto")
    llm = LLM(args.target, args.draft, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
              rope_scaling=getattr(args, "rope_scaling", None),
              use_draft=not fixed or budget.drafts or args.draft is not None, max_num_seqs=getattr(args, "max_num_seqs", None),
              prefill_chunk=getattr(args, "prefill_chunk", PREFILL_CHUNK),
              gpu_memory_utilization=getattr(args, "gpu_memory_utilization", 0.9),
              kv_cache_tokens=getattr(args, "kv_cache_tokens", None),
              **({"tree_budget": budget} if fixed else {}))
    if budget == "auto":
        from ddtree.bench.tune import STARTUP_CONTEXT_SECONDS, resolve_auto_budgets, resolve_context_budgets
        from ddtree.temperature_buckets import GREEDY

        log.info("tree budget 'auto': measuring budgets for this machine")
        start = time.perf_counter()
        llm.auto_budgets = resolve_auto_budgets(llm, llm.draft_path, log=log.info)
        llm.auto_context_budgets = resolve_context_budgets(llm, llm.draft_path, log=log.info,
                                                           seconds_per_context=STARTUP_CONTEXT_SECONDS)
        llm.default_budget = llm.auto_budgets[GREEDY.name]
        log.info("tree budget 'auto' chose %s (greedy), per temperature bucket: %s; in %.1f s", llm.default_budget,
                 ", ".join(f"{name}: {budget}" for name, budget in llm.auto_budgets.items()),
                 time.perf_counter() - start)
    if budget is None and llm.drafter is not None:
        from ddtree.budget_selector import CANDIDATES, OnlineBudgetSelector

        candidates = tuple(b for b in CANDIDATES
                           if not b.builds_tree or max_tree_budget is None or b.budget <= max_tree_budget)
        if len(candidates) > 1 and llm.max_num_seqs > 1:
            _adapt_batch_budget(llm, candidates, max_tree_budget)
        if len(candidates) > 1 and llm.batch_budget is None:
            llm.budget_selector = OnlineBudgetSelector(candidates)
            log.info("tree budget: requests that name none get the fastest of %s for their temperature, as "
                     "measured while serving (--tree-budget N or auto fixes it)", ", ".join(map(str, candidates)))
    if warmup:
        _warm_up(llm, max_tree_budget)
    return llm


def load_for_serving(args: argparse.Namespace, budget, warmup: bool = False,
                     max_tree_budget: int | None = None) -> tuple:
    """The LLM `serve` decodes with (`_load`) and its tree budget mode: "auto" (a tune file's picks),
    "adaptive" (chosen from what is measured while serving) or "fixed"."""
    llm = _load(args, budget, warmup, max_tree_budget)
    adaptive = llm.budget_selector is not None or llm.batch_budget is not None
    return llm, "auto" if budget == "auto" else "adaptive" if adaptive else "fixed"


def _warm_up(llm, max_tree_budget: int | None) -> None:
    """Capture, before serving, the graphs of the server's own budgets (its default and the ones
    it chooses among): with --max-num-seqs above 1, the batched engine's (every row bucket and KV
    length), else the one-request engine's."""
    start = time.perf_counter()
    chooser = llm.batch_budget or llm.budget_selector
    budgets = list(dict.fromkeys([llm.default_budget, *(chooser.candidates if chooser else ())]))
    if llm.max_num_seqs > 1:  # every request decodes in the batch
        from ddtree.server.worker import batch_max_nodes

        graphs = llm.batched(batch_max_nodes(llm, max_tree_budget)).engine.capture_all(budgets)
    else:
        for budget in budgets:
            llm.warmup(budget)
        e = llm.engine
        graphs = len(e.prefill_graphs) + len(e.front_graphs) + len(e.back_graphs)
    log.info("warm-up: tree budget %s ready in %.1f s, %d CUDA graphs captured", ", ".join(map(str, budgets)),
             time.perf_counter() - start, graphs)


def _adapt_batch_budget(llm, candidates: tuple[TreeShape, ...], max_tree_budget: int | None) -> None:
    """Requests that name no budget get theirs each round from the batch (ddtree.batch_budget),
    priced by the tune file's round costs or by costs measured now; with a context too short to
    time rounds in, nothing (the per-request selector then chooses)."""
    from ddtree.bench.tune import resolve_round_costs

    # The batched engine the worker will step (as large as its largest tree): costs are timed on it.
    largest = [llm.default_budget, *candidates, *([TreeShape.best(max_tree_budget)] if max_tree_budget else [])]
    llm.batched(max(b.nodes(llm.block_size) for b in largest))
    try:
        llm.adapt_batch_budget(candidates, resolve_round_costs(llm, list(candidates), log=log.info))
    except ValueError as exc:
        log.warning("tree budget: no batch-level choice (%s)", exc)
        return
    log.info("tree budget: requests that name none get, each round, whichever of %s gives the batch the most "
             "tokens/s, from its measured round costs and the acceptance seen so far (--tree-budget N or auto "
             "fixes it)", ", ".join(map(str, candidates)))


def limits_from(args: argparse.Namespace) -> ServerLimits:
    limits = ServerLimits(**{name: getattr(args, name) for name in LIMIT_FLAGS})
    try:
        limits.check()
    except ValueError as exc:
        raise DDTreeError(str(exc)) from None
    return limits


def cmd_serve(args: argparse.Namespace) -> int:
    # Every flag is checked before the heavy imports and before the port opens: a mistake is one line.
    budget = parse_tree_budget(args.tree_budget, allow_auto=True) if args.tree_budget is not None else None
    limits = limits_from(args)
    if isinstance(budget, TreeShape) and budget.budget > limits.max_tree_budget:
        raise DDTreeError(f"--tree-budget {budget} is over --max-tree-budget {limits.max_tree_budget}")
    if args.api_key is not None and not args.api_key.strip():
        raise DDTreeError("--api-key must not be empty; leave it out to serve without a key")
    warmup = flag_enabled(args.warmup, "warmup")
    engine_process = flag_enabled(args.engine_process, "engine_process")
    check_budget_has_drafter(budget, args.target, args.draft)
    check_pair_configs(args.target, args.draft, args.max_model_len, args.rope_scaling)

    import uvicorn

    from ddtree.llm import DEFAULT_TARGET
    from ddtree.server.app import create_app
    from ddtree.server.connection import TimedHttpProtocol
    from ddtree.server.listen import bind_listeners
    from ddtree.server.shutdown import GracePeriodServer, exit_now, grace_period

    sockets = bind_listeners(args.host, args.port)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    name = args.served_model_name or Path(args.target or DEFAULT_TARGET).name
    outcome: dict[str, object] = {"exit": 0}

    def on_engine_death(exc: BaseException) -> None:
        log.error("engine failed; /health answers 503 for %g s, then the server exits with code 1",
                  limits.failure_exit_delay)
        outcome["exit"] = 1
        threading.Timer(limits.failure_exit_delay, lambda: setattr(server, "should_exit", True)).start()

    engine = None
    if engine_process:
        from ddtree.server.engine_client import EngineClient

        engine = EngineClient(name, on_engine_death, max_queued=limits.max_queued_requests,
                              max_cached_budgets=limits.max_cached_budgets, max_tree_budget=limits.max_tree_budget)
    app = create_app(None, served_model_name=name, api_key=args.api_key, limits=limits,
                     on_engine_death=on_engine_death, engine=engine)
    worker = app.state.worker

    def end_what_is_left() -> None:
        ended = worker.abort_all(f"the server is shutting down and its {limits.shutdown_timeout:g} s limit "
                                 "(--shutdown-timeout) is up")
        if ended:
            log.warning("shutdown timeout: ended %d request(s) still running or queued", ended)

    config = uvicorn.Config(app, log_level=args.log_level,
                            http=TimedHttpProtocol.with_limits(limits.read_timeout, grace_period(limits.shutdown_timeout),
                                                               limits.max_header_bytes),
                            limit_concurrency=limits.max_connections,
                            timeout_keep_alive=limits.keep_alive_timeout,
                            # A backstop: end_what_is_left has ended every request by then.
                            timeout_graceful_shutdown=limits.shutdown_timeout + 5)
    server = GracePeriodServer(config, grace_period(limits.shutdown_timeout), end_what_is_left)

    def watch_for_a_stall() -> None:
        """A hung engine (a GPU that stopped answering) never fails by itself: end the process."""
        while not server.should_exit:
            stalled = worker.stalled_for()
            if stalled > limits.engine_stall_exit:
                reason = (f"the engine made no progress for {stalled:.0f} s with work waiting "
                          f"(--engine-stall-exit {limits.engine_stall_exit:g}); the server is restarting")
                log.error("%s: ending its requests and exiting with code 1", reason)
                outcome["exit"] = 1
                worker.abandon(reason)
                server.should_exit = True
                return
            time.sleep(min(1.0, limits.engine_stall_exit / 4))

    def serving() -> None:
        log.info("serving %r on http://%s:%d", name, args.host, args.port)
        if limits.engine_stall_exit > 0:
            threading.Thread(target=watch_for_a_stall, name="ddtree-stall-watch", daemon=True).start()

    def load_failed(exc: BaseException) -> None:  # reported after the HTTP server has stopped
        outcome["error"] = exc
        server.should_exit = True

    def load() -> None:
        try:
            worker.attach(*load_for_serving(args, budget, warmup, limits.max_tree_budget))
            serving()
        except BaseException as exc:
            load_failed(exc)

    if engine is not None:
        # Started first, while this process has one thread. Forked on a CPU (the child inherits what
        # a launcher patched); spawned where CUDA may run, since this process may have asked CUDA
        # whether it is there (a forked child could not use it then).
        engine.start(functools.partial(load_for_serving, args, budget, warmup, limits.max_tree_budget),
                     fork=args.device == "cpu", inherited=sockets, on_ready=serving,
                     on_load_failure=load_failed, target_path=Path(args.target or DEFAULT_TARGET))
    # uvicorn drains on SIGTERM and then re-raises the signal to the handler found before it started;
    # a no-op handler there makes a drained shutdown exit 0 instead of dying by the signal.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    if engine is None:
        threading.Thread(target=load, name="ddtree-load", daemon=True).start()
    server.run(sockets=sockets)
    error = outcome.get("error")
    if error is not None and engine is not None:
        engine.close()  # this process exits normally now, and would wait for its child
    if isinstance(error, DDTreeError):
        raise error
    if error is not None:
        log.error("loading the model failed: %s: %s", type(error).__name__, error)
        return 1
    exit_now(int(outcome["exit"]))  # within --shutdown-timeout: no teardown of the loaded model
    return int(outcome["exit"])  # not reached
