"""SIGTERM's grace period: uvicorn's Server, calling back once the grace period after a shutdown began
has passed.

uvicorn waits for every connection to finish before it exits, or cancels the tasks left after its
`timeout_graceful_shutdown`, which cuts a stream off without a word. `ddtree serve` instead ends what is
left at the deadline itself (a final error chunk for each stream, 503 for the queued requests), and
keeps uvicorn's timeout only as a backstop a few seconds later.
"""
from __future__ import annotations

import asyncio
from typing import Callable

import uvicorn


class GracePeriodServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, grace_s: float, at_deadline: Callable[[], None]):
        super().__init__(config)
        self.grace_s = grace_s
        self.at_deadline = at_deadline

    async def shutdown(self, sockets=None) -> None:
        asyncio.get_running_loop().call_later(self.grace_s, self.at_deadline)
        await super().shutdown(sockets=sockets)
