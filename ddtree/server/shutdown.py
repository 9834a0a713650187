"""SIGTERM's grace period: uvicorn's Server, calling back once the grace period after a shutdown began
has passed.

uvicorn waits for every connection to finish before it exits, or cancels the tasks left after its
`timeout_graceful_shutdown`, which cuts a stream off without a word. `ddtree serve` instead ends what is
left at the deadline itself (a final error chunk for each stream, 503 for the queued requests), and
keeps uvicorn's timeout only as a backstop a few seconds later.

`--shutdown-timeout` bounds the whole exit: requests get the timeout less `EXIT_ALLOWANCE_S` (at
least half of it), which leaves room for the round in progress, closing connections and leaving
the process (`exit_now`, which skips the interpreter's teardown of the loaded model: 0.5-1.3 s).
"""
from __future__ import annotations

import asyncio
import logging
import os
import sys
from typing import Callable

import uvicorn


EXIT_ALLOWANCE_S = 1.0


def grace_period(shutdown_timeout: float) -> float:
    """Seconds requests keep running after SIGTERM, so that the process is gone by the timeout."""
    return max(shutdown_timeout - EXIT_ALLOWANCE_S, shutdown_timeout / 2)


def exit_now(code: int) -> None:
    """Flush the logs and standard streams, then end the process without the interpreter's teardown
    (freeing a loaded model and its compiled kernels takes longer than the grace period allows)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class GracePeriodServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, grace_s: float, at_deadline: Callable[[], None]):
        super().__init__(config)
        self.grace_s = grace_s
        self.at_deadline = at_deadline

    async def shutdown(self, sockets=None) -> None:
        asyncio.get_running_loop().call_later(self.grace_s, self.at_deadline)
        await super().shutdown(sockets=sockets)
