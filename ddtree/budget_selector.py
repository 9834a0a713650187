"""The server's default tree budget when no tune file says otherwise: measured while serving.

Which budget is fastest depends on the machine, the temperature and the context length (on an H200 with the demo
pair budget 64 is about twice as fast as plain decoding at T = 0 and 0.87x at T = 1; on a 2-core
CPU it is 0.7x at T = 0 and 0.3x at T = 1), so no fixed default is right everywhere. `OnlineBudgetSelector` keeps, per
temperature bucket, the decode tokens/s each candidate budget delivered to recent requests and
gives a request that names no budget the candidate with the best figure. Each candidate is first
tried `min_samples` times in turn; after that a slower candidate is tried again once
`revisit_every` x s^2 of that bucket's requests have passed since it last ran, s being how many
times slower it measured (s^2 capped at 64), so a change in load or prompts is noticed. A revisit
costs (s - 1) requests' time every `revisit_every` s^2 requests: under 1/(4 x revisit_every) of
the bucket's time per candidate, whatever s is. Every budget gives the same tokens (the tree is
lossless), so trying one costs time, never correctness.

Thread-safe: requests are admitted from worker threads while the engine thread records results.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from ddtree.tree_shape import AR, DEFAULT_BEST, SMALL_BEST, TreeShape

CANDIDATES: tuple[TreeShape, ...] = (AR, TreeShape.best(SMALL_BEST), TreeShape.best(DEFAULT_BEST))
CONTEXT_BUCKETS: tuple[tuple[str, int], ...] = (("ctx<=2k", 2048), ("ctx<=8k", 8192), ("ctx<=32k", 32768))
LONGEST_CONTEXT_BUCKET = "ctx>32k"


def context_bucket(tokens: int) -> str:
    """The context bucket of a request whose prompt has `tokens` tokens."""
    return next((name for name, upper in CONTEXT_BUCKETS if tokens <= upper), LONGEST_CONTEXT_BUCKET)


def measured_at_or_below(picks: dict, tokens: int):
    """picks[bucket] for the context bucket of `tokens`, or where that bucket was not measured,
    that of the longest measured bucket below it (None if none): a tree that did not pay at a
    shorter context pays less at a longer one, its attention growing with the context."""
    order = [name for name, _ in CONTEXT_BUCKETS] + [LONGEST_CONTEXT_BUCKET]
    for name in reversed(order[:order.index(context_bucket(tokens)) + 1]):
        if name in picks:
            return picks[name]
    return None


@dataclass
class _Candidate:
    budget: TreeShape
    samples: deque  # (tokens, seconds) of its recent requests
    chosen: int = 0  # requests this selector gave it
    last_used: int = -1  # the bucket's request count when it was last chosen or measured

    def tokens_per_second(self) -> float | None:
        seconds = sum(s for _, s in self.samples)
        return sum(t for t, _ in self.samples) / seconds if seconds > 0 else None


@dataclass
class _Bucket:
    candidates: list[_Candidate]
    requests: int = 0


class OnlineBudgetSelector:
    """Per (temperature bucket, context bucket), the candidate budget with the best recent decode
    tokens/s."""

    def __init__(self, candidates: tuple[TreeShape, ...] = CANDIDATES, min_samples: int = 2,
                 revisit_every: int = 16, window: int = 8, min_tokens: int = 8):
        if not candidates:
            raise ValueError("at least one candidate budget is needed")
        self.candidates = tuple(candidates)
        self.min_samples = min_samples
        self.revisit_every = revisit_every
        self.window = window
        self.min_tokens = min_tokens  # shorter requests say little about a budget's speed
        self._lock = threading.Lock()
        self._buckets: dict[tuple[str, str], _Bucket] = {}

    def _bucket(self, temperature_bucket: str, context_tokens: int) -> _Bucket:
        key = (temperature_bucket, context_bucket(context_tokens))
        if key not in self._buckets:
            self._buckets[key] = _Bucket([_Candidate(b, deque(maxlen=self.window)) for b in self.candidates])
        return self._buckets[key]

    def choose(self, temperature_bucket: str, context_tokens: int = 0) -> TreeShape:
        """The budget for the next request that names none, of that temperature bucket and prompt length."""
        with self._lock:
            bucket = self._bucket(temperature_bucket, context_tokens)
            bucket.requests += 1
            count, candidates = bucket.requests, bucket.candidates
            # Short or aborted requests are not measured: a candidate is retried a bounded number of times.
            untried = [c for c in candidates if len(c.samples) < self.min_samples and c.chosen < 2 * self.min_samples]
            best = _fastest(candidates)
            overdue = [(count - c.last_used) / self._revisit_period(c, best) for c in candidates]
            if untried:
                pick = min(untried, key=lambda c: c.chosen)
            elif max(overdue) >= 1.0:
                pick = candidates[overdue.index(max(overdue))]
            else:
                pick = best
            pick.chosen += 1
            pick.last_used = count
            return pick.budget

    def _revisit_period(self, candidate: _Candidate, best: _Candidate) -> float:
        """Requests of the bucket between tries of `candidate`: revisit_every x (best rate / its rate)^2."""
        if candidate is best:
            return float("inf")
        rate, top = candidate.tokens_per_second(), best.tokens_per_second()
        slowdown_squared = 64.0 if not rate or not top else min((top / rate) ** 2, 64.0)
        return self.revisit_every * max(slowdown_squared, 1.0)

    def observe(self, temperature_bucket: str, budget: TreeShape, tokens: int, seconds: float,
                context_tokens: int = 0) -> None:
        """A finished request decoded `tokens` tokens after its first in `seconds`."""
        if tokens < self.min_tokens or seconds <= 0:
            return
        with self._lock:
            bucket = self._bucket(temperature_bucket, context_tokens)
            for candidate in bucket.candidates:
                if candidate.budget == budget:
                    candidate.samples.append((tokens, seconds))
                    candidate.last_used = max(candidate.last_used, bucket.requests)

    def estimates(self) -> dict[tuple[str, str], dict[str, float]]:
        """{(temperature bucket, context bucket): {budget label: recent decode tokens/s}} for the
        candidates measured so far."""
        with self._lock:
            return {key: {c.budget.label: rate for c in bucket.candidates
                          if (rate := c.tokens_per_second()) is not None}
                    for key, bucket in self._buckets.items()}

    def picks(self) -> dict[tuple[str, str], str]:
        """{(temperature bucket, context bucket): the label of the budget a request would get now,
        revisits aside}."""
        with self._lock:
            return {key: _fastest(bucket.candidates).budget.label for key, bucket in self._buckets.items()}


def _fastest(candidates: list[_Candidate]) -> _Candidate:
    """The best measured rate; unmeasured candidates lose to any measured one (the first wins ties)."""
    return max(candidates, key=lambda c: rate if (rate := c.tokens_per_second()) is not None else -1.0)
