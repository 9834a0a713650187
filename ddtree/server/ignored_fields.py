"""Request fields ddtree does not know: accepted and ignored, each name logged once.

OpenAI SDKs and frameworks send fields of their own (`user`, `metadata`, `store`, `service_tier`,
`parallel_tool_calls`, ...); refusing them breaks clients that would otherwise work. A warning names
each ignored field the first time it is seen, and only the first MAX_LOGGED_NAMES distinct names are
ever logged, so a client inventing new keys cannot flood the log.
"""
from __future__ import annotations

import logging
import threading
from typing import Iterable

from ddtree.config import shown

log = logging.getLogger("ddtree.server")

MAX_LOGGED_NAMES = 256


class IgnoredFieldLog:
    """Logs an ignored field's name the first time it is seen, up to MAX_LOGGED_NAMES names."""

    def __init__(self, max_names: int = MAX_LOGGED_NAMES):
        self.max_names = max_names
        self.seen: set[str] = set()
        self._lock = threading.Lock()

    def note(self, names: Iterable[str], endpoint: str, request_id: str) -> None:
        with self._lock:
            new = [name for name in names if name not in self.seen][: max(self.max_names - len(self.seen), 0)]
            self.seen.update(new)
            full = len(self.seen) >= self.max_names
        if new:
            listed = ", ".join(shown(name) for name in new)
            log.warning("request %s: %s ignored unknown field(s) %s%s", request_id, endpoint, listed,
                        " (no further unknown field names will be logged)" if full else "")


def unknown_fields(data: object, known: Iterable[str]) -> list[str]:
    """The top-level keys of a request body that are not fields of its request model."""
    if not isinstance(data, dict):
        return []
    known = set(known)
    return [key for key in data if key not in known]
