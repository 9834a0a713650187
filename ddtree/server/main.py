"""`ddtree serve`: an OpenAI-compatible endpoint for a target + DFlash drafter pair.

The HTTP server starts at once and the pair loads in a background thread, so /health answers 503
("loading") until the engine is ready. SIGTERM (what `systemctl stop` sends) stops accepting
connections, lets the requests in flight and in the queue finish, then exits 0. An engine failure
exits 1 so that the service manager restarts the server. Every flag can also come from a
`DDTREE_<FLAG>` environment variable (e.g. DDTREE_TARGET, DDTREE_API_KEY), which is how the
systemd unit passes them.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from pathlib import Path

from ddtree.cli import add_model_args
from ddtree.config import AR, DDTreeError, parse_tree_budget
from ddtree.flags import PORT, int_at_least
from ddtree.model_pair import check_budget_has_drafter, check_pair_configs

log = logging.getLogger("ddtree.server")

DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024  # same as ddtree.server.app, without importing FastAPI here
ENV_FLAGS = ("target", "draft", "device", "dtype", "max_model_len", "host", "port", "tree_budget",
             "served_model_name", "api_key", "max_request_bytes", "log_level", "warmup")
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
                   help="default budget of requests that name none: ar, chain, an integer >= 1, or auto "
                        "(measure on this machine at start-up; default 64)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: the target directory's name)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* (prefer DDTREE_API_KEY)")
    p.add_argument("--max-request-bytes", type=int_at_least(1), default=DEFAULT_MAX_REQUEST_BYTES,
                   help=f"larger request bodies are answered 400 (default {DEFAULT_MAX_REQUEST_BYTES})")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--warmup", action="store_true",
                   help="on CUDA, capture every graph of the default tree budget (all prefill lengths and KV "
                        "buckets) before serving: no capture pauses on first requests, for start-up time and GPU "
                        "memory (a logits buffer per KV bucket); DDTREE_WARMUP=1 sets it")
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


def _load(args: argparse.Namespace, budget, warmup: bool = False):
    """Load the pair, settle its default tree budget (measuring it for 'auto') and, with `warmup`,
    capture that budget's graphs."""
    from ddtree.llm import LLM

    fixed = budget not in (None, "auto")
    llm = LLM(args.target, args.draft, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
              use_draft=budget != AR or args.draft is not None, **({"tree_budget": budget} if fixed else {}))
    if budget == "auto":
        from ddtree.bench.tune import resolve_auto_budget

        log.info("tree budget 'auto': measuring budgets for this machine")
        llm.default_budget = parse_tree_budget(resolve_auto_budget(llm, llm.draft_path, log=log.info))
        log.info("tree budget 'auto' chose %s", llm.default_budget)
    if warmup:
        start = time.perf_counter()
        llm.warmup()
        e = llm.engine
        graphs = len(e.prefill_graphs) + len(e.front_graphs) + len(e.back_graphs)
        log.info("warm-up: tree budget %s ready in %.1f s, %d CUDA graphs captured", llm.default_budget,
                 time.perf_counter() - start, graphs)
    return llm


def cmd_serve(args: argparse.Namespace) -> int:
    budget = parse_tree_budget(args.tree_budget, allow_auto=True) if args.tree_budget is not None else None
    check_budget_has_drafter(budget, args.target, args.draft)
    check_pair_configs(args.target, args.draft, args.max_model_len)  # before the port opens, not behind it

    import uvicorn

    from ddtree.llm import DEFAULT_TARGET
    from ddtree.server.app import create_app

    if args.max_request_bytes < 1:
        raise DDTreeError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    warmup = flag_enabled(args.warmup, "warmup")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    name = args.served_model_name or Path(args.target or DEFAULT_TARGET).name
    outcome: dict[str, object] = {"exit": 0}

    def on_engine_death(exc: BaseException) -> None:
        log.error("engine failed; shutting down with exit code 1")
        outcome["exit"] = 1
        server.should_exit = True

    app = create_app(None, served_model_name=name, api_key=args.api_key or None,
                     max_request_bytes=args.max_request_bytes, on_engine_death=on_engine_death)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=None))

    def load() -> None:
        try:
            llm = _load(args, budget, warmup)
            app.state.worker.attach(llm, "auto" if budget == "auto" else "fixed")
            log.info("serving %r on http://%s:%d", name, args.host, args.port)
        except BaseException as exc:  # reported after the HTTP server has stopped
            outcome["error"] = exc
            server.should_exit = True

    # uvicorn drains on SIGTERM and then re-raises the signal to the handler found before it started;
    # a no-op handler there makes a drained shutdown exit 0 instead of dying by the signal.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    threading.Thread(target=load, name="ddtree-load", daemon=True).start()
    server.run()
    error = outcome.get("error")
    if isinstance(error, DDTreeError):
        raise error
    if error is not None:
        log.error("loading the model failed: %s: %s", type(error).__name__, error)
        return 1
    return int(outcome["exit"])
