"""Shared by the batched engine's CPU tests: its CUDA graph path run on the CPU."""
from __future__ import annotations


class RunAgain:
    """A CUDA graph's stand-in on the CPU: replaying it runs its function again."""

    def __init__(self, fn):
        self.fn = fn

    def replay(self):
        self.fn()


def replayed(engine, monkeypatch):
    """Make `engine` (a `BatchEngine`) take its graph path on the CPU: a capture runs the function
    once, as a capture's warm-up does (a real capture then records it without running it), and
    each replay runs it again."""
    def capture(fn):
        return RunAgain(fn), fn()

    monkeypatch.setattr(engine.rounds, "use_graphs", True)
    monkeypatch.setattr(engine.rounds, "capture", capture)
    return engine
