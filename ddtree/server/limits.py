"""Every bound `ddtree serve` puts on what one client can make it do, with its default.

Each field is a `ddtree serve` flag of the same name (`max_tree_budget` is `--max-tree-budget`) and
a DDTREE_<FLAG> variable; docs/server.md lists them with what a client sees when it hits one.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerLimits:
    # -- what one request may ask for --------------------------------------------------------
    # Largest per-request tree budget (the server's own default is always allowed). Rounds grow
    # about quadratically with the budget on a CPU: 0.3 s at 512 and 21 s at 4096 on the demo pair.
    max_tree_budget: int = 512
    # Tree budgets besides the default whose buffers and graphs stay allocated (least recently used
    # beyond this are freed).
    max_cached_budgets: int = 4
    # Output tokens of a chat request that names no max_tokens (fewer when the context has less
    # room; completions keep OpenAI's default of 16). A request holds the engine until it ends:
    # the rest of the context was 2042 tokens and 554 s on the CPU with the demo pair.
    default_max_tokens: int = 1024
    max_output_tokens: int | None = None  # the most max_tokens a request may ask for (None: the context)
    max_stop: int = 16  # stop strings, and stop token ids, per request
    max_stop_chars: int = 256  # characters per stop string
    # Requests decoded together, each round one packed forward (ddtree.batching); more wait in the
    # queue. None: 8 on a CPU; 1 on CUDA and for hybrid targets, until their batched rounds have
    # passed their GPU tests and a concurrency-1 request is as fast as on the one-request engine.
    max_num_seqs: int | None = None
    # -- the request body ----------------------------------------------------------------------
    max_request_bytes: int = 8 * 1024 * 1024
    max_json_depth: int = 32  # nesting of objects and arrays
    max_json_keys: int = 64  # keys of one object; a request has about 30 fields
    max_json_values: int | None = None  # None: 2 x max_model_len + 4096 (a prompt of token ids fits)
    # -- queueing and connections ------------------------------------------------------------
    max_queued_requests: int = 128  # waiting for the engine; more are answered 429
    max_connections: int = 512  # open connections; more are answered 503 (uvicorn's limit_concurrency)
    max_header_bytes: int = 16384  # request line + headers (ddtree.server.connection)
    read_timeout: float = 30.0  # seconds for a request's head and body to arrive, from its first byte
    keep_alive_timeout: float = 5.0  # seconds an idle kept-alive connection stays open
    # -- failure and shutdown ------------------------------------------------------------------
    shutdown_timeout: float = 120.0  # SIGTERM drains this long, then ends what is left
    engine_stall_timeout: float = 120.0  # /health answers 503 after this long without engine progress
    engine_stall_exit: float = 600.0  # ... and the server exits 1 after this long (0: never)
    failure_exit_delay: float = 5.0  # after an engine failure, /health answers 503 this long, then exit 1

    def json_values(self, max_model_len: int) -> int:
        """The JSON values a body may hold: enough for a prompt of max_model_len token ids."""
        return self.max_json_values if self.max_json_values is not None else 2 * max_model_len + 4096

    def capped(self, max_tokens: int) -> int:
        """max_tokens within max_output_tokens."""
        return max_tokens if self.max_output_tokens is None else min(max_tokens, self.max_output_tokens)

    def default_output_tokens(self, room: int) -> int:
        """max_tokens of a chat request that names none, with `room` tokens left in the context."""
        return max(min(self.capped(self.default_max_tokens), room), 1)

    def check(self) -> None:
        """Raise ValueError naming the first limit that is out of range."""
        for name, value in vars(self).items():
            if value is None:
                continue
            minimum = 0 if name in ("max_cached_budgets", "max_queued_requests") else 1
            if isinstance(value, float):
                minimum = 0.0 if name in ("failure_exit_delay", "engine_stall_exit") else 0.001
            if value < minimum:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be >= {minimum}, got {value}")
