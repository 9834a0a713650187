"""The engine thread: one `LLM`, requests in arrival order, decoded one at a time or, with the LLM's
max_num_seqs above 1, up to that many together (`ddtree.batching`: jobs join between rounds).
`ddtree serve` runs it in a process of its own (ddtree.server.engine_process, its jobs' events
sent over a pipe by a `Job.sink`); `create_app(llm)` and `serve --no-engine-process` in the
server's process.

HTTP handlers run on the asyncio loop; they hand a validated `Job` to `EngineWorker.submit` and read
the job's events from an asyncio queue that the engine thread fills (a batched round's events with
one wake-up of the loop; a handler that fell behind takes every event waiting as one). A job whose client went away is
cancelled: the thread checks the flag after every engine step and closes the `LLM.stream` generator,
so a disconnected request costs at most the round in progress (a batched one leaves the batch before
the next round).

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

from ddtree.config import DDTreeError, SamplingParams, parse_tree_budget
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
    budget: TreeShape | None  # None: chosen by the engine when the job starts (`LLM.budget_for`)
    loop: asyncio.AbstractEventLoop | None  # where `events` are read; None when `sink` takes them
    request_id: str = "-"
    adaptive: bool = False  # its budget is chosen each round by the batch (`budget`: only its start)
    arrival: float = field(default_factory=time.perf_counter)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    # Instead of `events`: sink([(job, item), ...]) takes the engine's items (the engine process's
    # pipe to the server's front, ddtree.server.engine_process). One sink for many jobs.
    sink: Callable[[list[tuple["Job", object]]], None] | None = None
    on_cancel: Callable[[], None] | None = None  # called by `cancel` (the front tells the engine process)
    _raise_next: BaseException | None = None  # an exception found behind events already taken

    def cancel(self) -> None:
        self.cancelled.set()
        if self.on_cancel is not None:
            self.on_cancel()

    async def next_event(self):
        """The next StreamEvent: every event waiting, merged (`StreamEvent.merged`), so a stream
        that fell behind the engine catches up in one chunk; an exception sent by the engine thread
        is raised here, after the events sent before it."""
        if self._raise_next is not None:
            raise self._raise_next
        item = await self.events.get()
        if isinstance(item, BaseException):
            raise item
        events = [item]
        while not self.events.empty() and events[-1].result is None:
            more = self.events.get_nowait()
            if isinstance(more, BaseException):
                self._raise_next = more
                break
            events.append(more)
        return type(item).merged(events)  # a StreamEvent (its module is not imported here: torch)

    def emit(self, item: object) -> None:
        """Called from the engine thread; a closed loop means the client is gone."""
        emit_all([(self, item)])


def emit_all(items: list[tuple[Job, object]]) -> None:
    """Send each job its item from the engine thread, with one wake-up of each event loop (not one
    per job: a batched round's events reach their streams together), or one call of each sink; on
    a job's own loop (the engine process's events, read there), straight into its queue. A closed
    loop means the client is gone: its jobs are cancelled."""
    by_destination: dict[tuple, list[tuple[Job, object]]] = {}
    for job, item in items:
        key = ("sink", job.sink) if job.sink is not None else ("loop", job.loop)
        by_destination.setdefault(key, []).append((job, item))
    try:
        here = asyncio.get_running_loop()  # the engine process's events arrive on the loop itself
    except RuntimeError:
        here = None
    for (kind, destination), pairs in by_destination.items():
        if kind == "sink":
            destination(pairs)
        elif destination is here:
            _put_all(pairs)
        else:
            try:
                destination.call_soon_threadsafe(_put_all, pairs)
            except RuntimeError:
                for job, _ in pairs:
                    job.cancel()


def _put_all(pairs: list[tuple[Job, object]]) -> None:
    for job, item in pairs:
        job.events.put_nowait(item)


class EngineWorker:
    kind = "thread"  # /health's "engine": this worker runs in the server's process

    def __init__(self, metrics: ServerMetrics, on_death: Callable[[BaseException], None] | None = None,
                 max_queued: int | None = None, max_cached_budgets: int | None = None,
                 max_tree_budget: int | None = None):
        self.metrics = metrics
        self.on_death = on_death
        self.max_queued = max_queued
        self.max_cached_budgets = max_cached_budgets
        self.max_tree_budget = max_tree_budget  # the largest tree a batched request may use
        self.llm = None
        self.state = LOADING
        self.error: str | None = None
        self.tree_budget_mode = "fixed"
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._active: list[Job] = []  # the jobs decoding now
        self._held: Job | None = None  # the next job of a batch, taken from the queue, waiting for cache room
        self._progress_at = time.monotonic()  # the engine's last step (or the start of its current job)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._abandoned = False  # `abandon`: stop() no longer waits for the engine thread
        self._stop_seen = False  # the batched loop has taken the queue's stop marker
        self._recording = threading.Lock()  # held from a job's last event to its metrics recorded

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
            if self._held is not None:
                ended.append(self._held)
                self._held = None
            ended.extend(self._active)
        for job in ended:
            job.emit(EngineUnavailable(reason))
            job.cancel()
        self._update_queue_gauges()
        return len(ended)

    @property
    def ready(self) -> bool:
        return self.state == READY

    def render_metrics(self) -> tuple[bytes, str]:
        """/metrics: the Prometheus text and its content type."""
        if self.state == READY:
            self._update_memory_gauge()
        with self._recording:  # a finished job's last event may be out and its metrics not yet in
            return self.metrics.render()

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
            if self._jobs.empty() and not self._active:
                self._progress_at = time.monotonic()  # an idle engine has not been stalling
            self._jobs.put(job)
        self._update_queue_gauges()

    @property
    def waiting(self) -> int:
        return self._jobs.qsize() + (self._held is not None)

    def stalled_for(self) -> float:
        """Seconds since the engine's last step while it has work; 0 when it has none."""
        if self.state != READY or (not self._active and self._jobs.empty() and self._held is None):
            return 0.0
        return time.monotonic() - self._progress_at

    def unavailable_reason(self) -> str:
        return unavailable_reason(self.state)

    def _update_queue_gauges(self) -> None:
        self.metrics.set_queue(len(self._active), self.waiting)

    def _run(self) -> None:
        device = getattr(self.llm, "device", None)
        if getattr(device, "type", None) == "cuda" and device.index is not None:
            import torch

            torch.cuda.set_device(device)  # this thread's kernels and graphs go to the model's GPU
        if getattr(self.llm, "max_num_seqs", 1) > 1:
            self._run_batched(self.llm.batched(self._max_nodes()))
            return
        while True:
            job = self._jobs.get()
            if job is None:
                break
            if not self._admit(job):
                continue
            self._start(job)
            try:
                self._run_job(job)
            except DDTreeError as exc:  # checked before queueing; kept as a 400 just in case
                job.emit(exc)
            except BaseException as exc:  # the engine itself failed
                self._fail(exc, [job])
            finally:
                self._finish(job)

    def _admit(self, job: Job) -> bool:
        """Whether a job taken from the queue runs: not once the engine is dead (it is answered
        503), nor when its client left while it waited."""
        if self.state == DEAD:
            job.emit(EngineUnavailable(self.unavailable_reason()))
            return False
        if job.cancelled.is_set():
            self.metrics.record_request(prompt_tokens=0, output_tokens=0, finish_reason="abort", ttft_s=None,
                                        e2e_s=time.perf_counter() - job.arrival, first_to_last_s=None)
            return False
        if job.budget is None:  # chosen now, from what the budget choosers have seen so far
            job.budget = self.llm.budget_for(job.params.temperature, len(job.prompt_ids))
        return True

    def _start(self, job: Job) -> None:
        with self._lock:
            self._active.append(job)
            self._progress_at = time.monotonic()
        self._update_queue_gauges()

    def _finish(self, job: Job) -> None:
        with self._lock:
            if job in self._active:
                self._active.remove(job)
            self._progress_at = time.monotonic()
        self._update_queue_gauges()
        self._update_budget_gauge()

    def _fail(self, exc: BaseException, jobs: list[Job]) -> None:
        """The engine failed while these jobs were decoding: the state first (so that /health says
        so by the time their clients hear), then their failures, then the queued jobs' refusals and
        `on_death` (`_die`). An engine process tells the front of the death after the failures, on
        the same pipe, so that the front ends what is left only once they are in."""
        ids = ", ".join(job.request_id for job in jobs)
        log.exception("engine failed while decoding request %s", ids)
        self._mark_dead(ids)
        for job in jobs:
            job.emit(EngineFailure(f"the engine failed while decoding request {job.request_id}"))
        self._die(exc, ids)

    def _max_nodes(self) -> int:
        return batch_max_nodes(self.llm, self.max_tree_budget)

    def _run_job(self, job: Job) -> None:
        """Decode one job, emitting each StreamEvent; stop after the step in progress once cancelled."""
        run = JobRun(job)
        stream = self.llm.stream(job.prompt_ids, job.params, job.budget)
        try:
            for event in stream:
                self._progress_at = time.monotonic()
                if self._deliver(run, event):
                    return
                if job.cancelled.is_set():
                    break
        finally:
            stream.close()
        self._record_abort(run)

    def _run_batched(self, batch) -> None:
        """Up to `batch.max_rows` jobs decode together: queued jobs join between rounds (in arrival
        order) while rows are free and the cache has room for them (a job that does not fit yet is
        held, and the queue behind it waits, until running jobs leave), each round's events go to
        their jobs, a finished job leaves in the round that finishes it and a cancelled one before
        the next round."""
        runs: dict[int, tuple[object, JobRun]] = {}  # id(BatchedRequest) -> (it, its job's figures)
        stopping = False
        while True:
            while (not stopping or self._held is not None) and batch.free:
                job = self._next_job(block=not runs)  # wait for work only when nothing is decoding
                if job is None:  # none waiting, or the stop marker
                    stopping = self._stop_seen
                    break
                if not self._admit(job):
                    continue
                if not batch.fits(len(job.prompt_ids), job.params, job.budget, job.adaptive):
                    if runs:  # room comes back as running jobs leave
                        with self._lock:
                            self._held = job
                        break
                    # Nothing else holds the cache: it can never fit (`BatchEngine` keeps room for one
                    # sequence at the context limit, so a checked request always does).
                    job.emit(DDTreeError("the request does not fit the KV cache", "max_tokens"))
                    self._finish(job)
                    continue
                self._join(batch, job, runs)
            self._send_first_events(batch, runs)
            if not runs:
                if stopping and self._held is None:
                    return
                continue
            try:
                events = batch.step()
            except BaseException as exc:  # the engine failed: its batch is not used again
                self._fail_batch(exc, runs)
                continue
            self._progress_at = time.monotonic()
            self.metrics.record_batch_round(getattr(batch, "round_budgets", None)
                                            or [request.sequence.budget for request, _ in events])
            regions = getattr(getattr(batch, "engine", None), "regions", None)
            if regions is not None:
                self.metrics.set_kv_cache_usage(regions.used_slots / regions.total)
            self._deliver_all(events, runs)
            for key, (request, run) in list(runs.items()):
                if run.job.cancelled.is_set():
                    batch.cancel(request)
                    del runs[key]
                    self._record_abort(run, request.progress.stats.budget_rounds)
                    self._finish(run.job)

    def _next_job(self, block: bool) -> Job | None:
        """The held job, else the queue's next (waiting for one when `block`) -> None when there is
        none, or at the stop marker (`_stop_seen` then set)."""
        with self._lock:
            job, self._held = self._held, None
        if job is not None:
            return job
        try:
            job = self._jobs.get(block=block)
        except queue.Empty:
            return None
        if job is None:
            self._stop_seen = True
        return job

    def _join(self, batch, job: Job, runs: dict) -> None:
        """Queue `job`'s prefill into the batch; its first event is sent with those of the other
        jobs joining now (`_send_first_events`), so that their prefills run back to back."""
        self._start(job)
        try:
            request = batch.begin(job.prompt_ids, job.params, job.budget, job.adaptive)
        except DDTreeError as exc:  # checked before queueing; kept as a 400 just in case
            job.emit(exc)
            self._finish(job)
            return
        except BaseException as exc:
            self._fail(exc, [job])
            self._finish(job)
            return
        self._progress_at = time.monotonic()
        # A long prompt prefilled a chunk a round has no first event yet: it comes from `step`.
        runs[id(request)] = (request, JobRun(job))

    def _send_first_events(self, batch, runs: dict) -> None:
        """The first events of the jobs joined since the last round, read in one host sync."""
        try:
            started = batch.started()
        except BaseException as exc:  # the engine failed: its batch is not used again
            self._fail_batch(exc, runs)
            return
        self._deliver_all(started, runs)

    def _fail_batch(self, exc: BaseException, runs: dict) -> None:
        """The batch's engine failed: every job in it ends with the failure."""
        self._fail(exc, [run.job for _, run in runs.values()])
        for _, run in runs.values():
            self._finish(run.job)
        runs.clear()

    def _deliver_all(self, events: list, runs: dict) -> None:
        """Each (request, event) to its job, with one wake-up of each event loop for all of them;
        the jobs they finish leave `runs`."""
        outbox: list[tuple[Job, object]] = []
        finished: list[tuple[JobRun, object]] = []
        for request, event in events:
            run = runs[id(request)][1]
            run.saw(event)
            outbox.append((run.job, event))
            if event.result is not None:
                del runs[id(request)]
                finished.append((run, event))
        if finished:
            with self._recording:
                emit_all(outbox)
                for run, event in finished:
                    self._record_result(run, event)
        else:
            emit_all(outbox)
        for run, _ in finished:
            self._finish(run.job)

    def _deliver(self, run: "JobRun", event) -> bool:
        """Send an event to its job -> whether it was the last."""
        run.saw(event)
        if event.result is None:
            run.job.emit(event)
            return False
        with self._recording:
            run.job.emit(event)
            self._record_result(run, event)
        return True

    def _record_result(self, run: "JobRun", event) -> None:
        """A finished job's metrics, recorded after its last event has gone out: its client's answer
        does not wait for them (85 us of Prometheus updates on a 2-core CPU). The caller
        holds `_recording` from before the event is sent, and /metrics takes it too, so a client
        that has its answer and then reads /metrics always finds its request counted."""
        stats = event.result.stats
        self._record(run.job, stats.acceptance_lengths, stats.budget_rounds, len(event.result.token_ids),
                     event.result.finish_reason, run.first_token_at, run.last_token_at, run.last_event_at)

    def _record_abort(self, run: "JobRun", budget_rounds: dict[str, int] | None = None) -> None:
        """budget_rounds: the job's rounds per budget (default: all at its own budget)."""
        budget_rounds = budget_rounds or {run.job.budget.label: len(run.acceptance_lengths)}
        self._record(run.job, run.acceptance_lengths, budget_rounds, run.tokens, "abort", run.first_token_at,
                     run.last_token_at)

    def _record(self, job: Job, acceptance_lengths: list[int], budget_rounds: dict[str, int], output_tokens: int,
                finish_reason: str, first_token_at: float | None, last_token_at: float | None,
                ended_at: float | None = None) -> None:
        """budget_rounds: the job's decode rounds per budget label (several for an adaptive job).
        ended_at: when its last event went out (default: now)."""
        shapes = {parse_tree_budget(label): rounds for label, rounds in budget_rounds.items()}
        self.metrics.record_rounds(acceptance_lengths, sum(r * self.drafted_per_round(b) for b, r in shapes.items()),
                                   sum(r for b, r in shapes.items() if not b.drafts))
        ttft = None if first_token_at is None else first_token_at - job.arrival
        span = None if first_token_at is None or last_token_at is None else last_token_at - first_token_at
        self.metrics.record_request(prompt_tokens=len(job.prompt_ids), output_tokens=output_tokens,
                                    finish_reason=finish_reason, ttft_s=ttft,
                                    e2e_s=(ended_at or time.perf_counter()) - job.arrival, first_to_last_s=span)
        selector = getattr(self.llm, "budget_selector", None)
        if selector is not None and finish_reason != "abort" and span is not None:
            # The decode after the first token: the prefill and the queue are the same for every budget.
            selector.observe(bucket_of(job.params.temperature).name, job.budget, output_tokens - 1, span,
                             len(job.prompt_ids))
            self.metrics.set_budget_estimates(selector.estimates())
        chooser = getattr(self.llm, "batch_budget", None)
        if chooser is not None:
            self.metrics.set_batch_acceptance(chooser.estimates())

    def _update_budget_gauge(self) -> None:
        working_set = getattr(self.llm, "working_set", None)
        if working_set is not None:
            self.metrics.set_budgets_allocated(len(working_set.held))

    def _update_memory_gauge(self) -> None:
        """The caching allocator's view: what the working set and the KV cache hold (allocated) and
        what the process keeps from the driver (reserved). Read when /metrics is (not after every
        request: the allocator's statistics cost as much as a request's bookkeeping)."""
        device = getattr(self.llm, "device", None)
        if getattr(device, "type", None) == "cuda":
            import torch

            self.metrics.set_gpu_memory(torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device))

    def _mark_dead(self, request_id: str) -> None:
        with self._lock:
            self.state = DEAD
            # No internal message: /health is answered to anyone; the log has the traceback.
            self.error = f"the engine failed while decoding request {request_id}; see the server log"

    def _die(self, exc: BaseException, request_id: str) -> None:
        self._mark_dead(request_id)
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


def unavailable_reason(state: str) -> str:
    """Why an engine in `state` (not READY) takes no request, as a 503 says it."""
    if state == LOADING:
        return "the model is still loading; retry when /health answers 200"
    if state == DEAD:
        return "the engine has failed; the server is restarting"
    return "the server is shutting down"


def batch_max_nodes(llm, max_tree_budget: int | None) -> int:
    """The largest tree a batched request may use: the largest budget a request may name
    (max_tree_budget), and the server's own budgets."""
    b = llm.block_size
    budgets = [llm.default_budget, *(getattr(llm, "auto_budgets", None) or {}).values()]
    for chooser in (getattr(llm, "budget_selector", None), getattr(llm, "batch_budget", None)):
        if chooser is not None:
            budgets += list(chooser.candidates)
    if max_tree_budget is not None:
        budgets.append(TreeShape.best(max_tree_budget))
    return max(budget.nodes(b) for budget in budgets)


class JobRun:
    """A job's figures as its events arrive: when its first and last tokens went out, how many
    tokens, and each round's (for a cancelled job's metrics)."""

    def __init__(self, job: Job):
        self.job = job
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.last_event_at: float | None = None
        self.tokens = 0
        self.acceptance_lengths: list[int] = []

    def saw(self, event) -> None:
        now = self.last_event_at = time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = now
        elif event.result is None:
            self.acceptance_lengths.append(len(event.token_ids))  # a round commits `a` tokens
        if event.token_ids:
            self.last_token_at = now
        self.tokens += len(event.token_ids)
