"""The engine thread: one `LLM`, one request at a time, requests in arrival order.

HTTP handlers run on the asyncio loop; they hand a validated `Job` to `EngineWorker.submit` and read
the job's events from an asyncio queue that the engine thread fills. A job whose client went away is
cancelled: the thread checks the flag after every engine step and closes the `LLM.stream` generator,
so a disconnected request costs at most the round in progress.

Any unexpected exception from the engine marks it dead: the job gets `EngineFailure` (its client a
500 without internal details, the log the traceback), every queued job "engine unavailable",
/health answers 503 and `on_death` (the CLI: answer 503 for a few seconds, then exit 1 so that the
service manager restarts it) is called.

The queue is bounded (`max_queued`: more is `QueueFull`, a 429), and the worker notes the time of
the engine's last step, so /health can tell a stuck engine from a busy one (`stalled_for`). At the
end of a shutdown's grace period, `abort_all` ends the running job and the queued ones with
"engine unavailable" (their streams end with an error chunk).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ddtree.config import DDTreeError, SamplingParams
from ddtree.server.metrics import ServerMetrics
from ddtree.temperature_buckets import bucket_of
from ddtree.tree_shape import TreeShape

log = logging.getLogger("ddtree.server")

LOADING, READY, DEAD, STOPPED = "loading", "ready", "dead", "stopped"


class EngineUnavailable(Exception):
    """The engine is loading, dead or stopped: the request is answered 503."""


class QueueFull(Exception):
    """max_queued requests are already waiting: the request is answered 429."""


class EngineFailure(Exception):
    """The engine failed while decoding this job (the details are in the log): answered 500."""


@dataclass
class Job:
    """One validated request. `events` receives StreamEvents, then nothing more; or one exception."""

    prompt_ids: list[int]
    params: SamplingParams
    budget: TreeShape
    loop: asyncio.AbstractEventLoop
    request_id: str = "-"
    arrival: float = field(default_factory=time.perf_counter)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()

    async def next_event(self):
        """The next StreamEvent; an exception sent by the engine thread is raised here."""
        item = await self.events.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def emit(self, item: object) -> None:
        """Called from the engine thread; a closed loop means the client is gone."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:
            self.cancel()


class EngineWorker:
    def __init__(self, metrics: ServerMetrics, on_death: Callable[[BaseException], None] | None = None,
                 max_queued: int | None = None, max_cached_budgets: int | None = None):
        self.metrics = metrics
        self.on_death = on_death
        self.max_queued = max_queued
        self.max_cached_budgets = max_cached_budgets
        self.llm = None
        self.state = LOADING
        self.error: str | None = None
        self.tree_budget_mode = "fixed"
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._running = 0
        self._current: Job | None = None
        self._progress_at = time.monotonic()  # the engine's last step (or the start of its current job)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._abandoned = False  # `abandon`: stop() no longer waits for the engine thread

    # -- lifecycle ---------------------------------------------------------------------------

    def attach(self, llm, tree_budget_mode: str = "fixed") -> None:
        """Start serving `llm` (an `LLM` or an object with the same calls)."""
        with self._lock:
            if self.state != LOADING:
                raise RuntimeError(f"engine worker is {self.state}, cannot attach a model")
            self.llm = llm
            self.tree_budget_mode = tree_budget_mode
            working_set = getattr(llm, "working_set", None)
            if working_set is not None and self.max_cached_budgets is not None:
                working_set.capacity = self.max_cached_budgets
            self.metrics.set_tree_budget(self.drafted_per_round(llm.default_budget))
            if getattr(llm, "auto_budgets", None):
                self.metrics.set_auto_budgets(llm.auto_budgets)
            self._thread = threading.Thread(target=self._run, name="ddtree-engine", daemon=True)
            self._thread.start()
            self.state = READY
        log.info("engine ready: target %s, drafter %s, tree budget %s on %s", llm.target_name, llm.draft_name,
                 llm.default_budget, llm.device)

    def stop(self, timeout: float | None = None) -> bool:
        """Finish the queued jobs, then end the thread; False if it was still running after `timeout`
        (at once once the thread is abandoned)."""
        with self._lock:
            if self.state == READY:
                self.state = STOPPED
            thread = self._thread
            if self._abandoned:
                return False
        if thread is not None and thread.is_alive():
            self._jobs.put(None)
            thread.join(timeout)
            return not thread.is_alive()
        return True

    def abandon(self, reason: str) -> int:
        """For an engine thread that is stuck (a hung GPU): end every job as `abort_all` does, and let
        `stop` return without waiting for the thread, which the process's exit then ends."""
        with self._lock:
            self._abandoned = True
        return self.abort_all(reason)

    def abort_all(self, reason: str) -> int:
        """Refuse new jobs and end every job with EngineUnavailable(reason): the running one stops
        after the round in progress, queued ones never start. Returns how many were ended."""
        with self._lock:
            if self.state == READY:
                self.state = STOPPED
            ended = []
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    ended.append(job)
            self._jobs.put(None)  # and the thread ends once the running job has stopped
            if self._current is not None:
                ended.append(self._current)
        for job in ended:
            job.emit(EngineUnavailable(reason))
            job.cancel()
        self._update_queue_gauges()
        return len(ended)

    @property
    def ready(self) -> bool:
        return self.state == READY

    def drafted_per_round(self, budget: TreeShape) -> int:
        return budget.drafted_tokens(self.llm.block_size, getattr(self.llm, "vocab_size", 1 << 30))

    # -- requests ----------------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        with self._lock:
            if self.state != READY:
                raise EngineUnavailable(self.unavailable_reason())
            if self.max_queued is not None and self._jobs.qsize() >= self.max_queued:
                raise QueueFull(f"{self._jobs.qsize()} requests are already waiting for the engine, the most this "
                                "server queues (--max-queued-requests); retry shortly")
            if self._jobs.empty() and self._current is None:
                self._progress_at = time.monotonic()  # an idle engine has not been stalling
            self._jobs.put(job)
        self._update_queue_gauges()

    @property
    def waiting(self) -> int:
        return self._jobs.qsize()

    def stalled_for(self) -> float:
        """Seconds since the engine's last step while it has work; 0 when it has none."""
        if self.state != READY or (self._current is None and self._jobs.empty()):
            return 0.0
        return time.monotonic() - self._progress_at

    def unavailable_reason(self) -> str:
        if self.state == LOADING:
            return "the model is still loading; retry when /health answers 200"
        if self.state == DEAD:
            return "the engine has failed; the server is restarting"
        return "the server is shutting down"

    def _update_queue_gauges(self) -> None:
        self.metrics.set_queue(self._running, self._jobs.qsize())

    def _run(self) -> None:
        device = getattr(self.llm, "device", None)
        if getattr(device, "type", None) == "cuda" and device.index is not None:
            import torch

            torch.cuda.set_device(device)  # this thread's kernels and graphs go to the model's GPU
        while True:
            job = self._jobs.get()
            if job is None:
                break
            if self.state == DEAD:
                job.emit(EngineUnavailable(self.unavailable_reason()))
                continue
            if job.cancelled.is_set():
                self.metrics.record_request(prompt_tokens=0, output_tokens=0, finish_reason="abort",
                                            ttft_s=None, e2e_s=time.perf_counter() - job.arrival,
                                            first_to_last_s=None)
                continue
            with self._lock:
                self._current = job
                self._progress_at = time.monotonic()
            self._running = 1
            self._update_queue_gauges()
            try:
                self._run_job(job)
            except DDTreeError as exc:  # checked before queueing; kept as a 400 just in case
                job.emit(exc)
            except BaseException as exc:  # the engine itself failed
                log.exception("engine failed while decoding request %s", job.request_id)
                self._die(exc, job.request_id)  # first, so that /health already says so when the client hears
                job.emit(EngineFailure(f"the engine failed while decoding request {job.request_id}"))
            finally:
                with self._lock:
                    self._current = None
                    self._progress_at = time.monotonic()
                self._running = 0
                self._update_queue_gauges()
                self._update_budget_gauge()

    def _run_job(self, job: Job) -> None:
        """Decode one job, emitting each StreamEvent; stop after the step in progress once cancelled."""
        first_token_at = last_token_at = None
        tokens = 0
        acceptance_lengths: list[int] = []  # of the rounds seen, for a cancelled job's metrics
        stream = self.llm.stream(job.prompt_ids, job.params, job.budget)
        try:
            for event in stream:
                self._progress_at = time.monotonic()
                now = time.perf_counter()
                if first_token_at is None:
                    first_token_at = now
                elif event.result is None:
                    acceptance_lengths.append(len(event.token_ids))  # a round commits `a` tokens
                if event.token_ids:
                    last_token_at = now
                tokens += len(event.token_ids)
                if event.result is not None:  # metrics first, so a client that has its answer sees them
                    self._record(job, event.result.stats.acceptance_lengths, len(event.result.token_ids),
                                 event.result.finish_reason, first_token_at, last_token_at)
                    job.emit(event)
                    return
                job.emit(event)
                if job.cancelled.is_set():
                    break
        finally:
            stream.close()
        self._record(job, acceptance_lengths, tokens, "abort", first_token_at, last_token_at)

    def _record(self, job: Job, acceptance_lengths: list[int], output_tokens: int, finish_reason: str,
                first_token_at: float | None, last_token_at: float | None) -> None:
        self.metrics.record_rounds(acceptance_lengths, self.drafted_per_round(job.budget))
        ttft = None if first_token_at is None else first_token_at - job.arrival
        span = None if first_token_at is None or last_token_at is None else last_token_at - first_token_at
        self.metrics.record_request(prompt_tokens=len(job.prompt_ids), output_tokens=output_tokens,
                                    finish_reason=finish_reason, ttft_s=ttft,
                                    e2e_s=time.perf_counter() - job.arrival, first_to_last_s=span)
        selector = getattr(self.llm, "budget_selector", None)
        if selector is not None and finish_reason != "abort" and span is not None:
            # The decode after the first token: the prefill and the queue are the same for every budget.
            selector.observe(bucket_of(job.params.temperature).name, job.budget, output_tokens - 1, span,
                             len(job.prompt_ids))
            self.metrics.set_budget_estimates(selector.estimates())
        self._running = 0
        self._update_queue_gauges()

    def _update_budget_gauge(self) -> None:
        working_set = getattr(self.llm, "working_set", None)
        if working_set is not None:
            self.metrics.set_budgets_allocated(len(working_set.held))
        device = getattr(self.llm, "device", None)
        if getattr(device, "type", None) == "cuda":
            import torch

            # The caching allocator's view, after the request: what the working set and the KV cache
            # hold (allocated) and what the process keeps from the driver (reserved).
            self.metrics.set_gpu_memory(torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device))

    def _die(self, exc: BaseException, request_id: str) -> None:
        with self._lock:
            self.state = DEAD
            # No internal message: /health is answered to anyone; the log has the traceback.
            self.error = f"the engine failed while decoding request {request_id}; see the server log"
        stopping = False
        while True:  # fail whatever is still queued
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is None:
                stopping = True  # stop() raced with this death: keep its sentinel for the loop
            else:
                job.emit(EngineUnavailable(self.unavailable_reason()))
        if stopping:
            self._jobs.put(None)
        if self.on_death is not None:
            self.on_death(exc)
