"""The front's side of the engine process (`ddtree.server.engine_process`): the calls the app and
`ddtree serve` make of an `EngineWorker` (submit, state, /health's facts, stop, abort_all,
abandon, stalled_for, waiting, render_metrics), answered over the pipe.

A thread reads the control pipe (the engine's state, /metrics' answers). Each round's items come
on the events pipe, which the event loop of the jobs (the app's) reads itself: they reach their
streams without a thread's hand-off to the loop in between (`_watch_events`). The front keeps its own view of
the jobs it has sent, so that it can bound the queue, tell a stalled engine from an idle one, and
end every job at once when the engine process dies (a crash, the kernel's OOM killer) or is
abandoned: a running job then gets EngineFailure (500), a queued one EngineUnavailable (503).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import threading
import time
from typing import Callable

from ddtree.models.tokenizer import load_tokenizer
from ddtree.server.engine_process import FrameReader, run_engine
from ddtree.server.front_model import FrontModel
from ddtree.server.worker import (
    DEAD,
    LOADING,
    READY,
    STOPPED,
    EngineFailure,
    EngineUnavailable,
    Job,
    QueueFull,
    emit_all,
    unavailable_reason,
)

log = logging.getLogger("ddtree.server")

METRICS_TIMEOUT_S = 10.0  # an engine process that does not answer /metrics in this long is unavailable


class EngineClient:
    """An engine in a child process. `start(load)` forks it (before any other thread of this process
    starts: a fork copies only the calling thread); it answers 503 until the engine is ready."""

    kind = "process"  # /health's "engine"

    def __init__(self, model_name: str, on_death: Callable[[BaseException], None] | None = None,
                 max_queued: int | None = None, max_cached_budgets: int | None = None,
                 max_tree_budget: int | None = None):
        self.model_name = model_name
        self.on_death = on_death
        self.max_queued = max_queued
        self.options = {"max_cached_budgets": max_cached_budgets, "max_tree_budget": max_tree_budget}
        self.state = LOADING
        self.error: str | None = None
        self.llm: FrontModel | None = None
        self.tree_budget_mode = "fixed"
        self.process = None
        self._conn = None
        self._events = None  # the read end of the events pipe (a Connection, read through its fd)
        self._events_loop: asyncio.AbstractEventLoop | None = None  # the loop reading it
        self._frames = FrameReader()
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._keys = itertools.count()
        self._jobs: dict[int, Job] = {}  # sent and not yet ended
        self._started: set[int] = set()  # of those, the ones the engine has sent something for
        self._progress_at = time.monotonic()  # the engine's last message (or the first job's submission)
        self._replies: dict[int, list] = {}  # reply id -> [threading.Event, answer]
        self._abandoned = False
        self._preload: threading.Thread | None = None
        self._preloaded: tuple | None = None  # (target path, its tokenizer)
        self._on_ready: Callable[[], None] | None = None
        self._on_load_failure: Callable[[BaseException], None] | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, load: Callable[[], tuple], *, fork: bool = True, inherited=(),
              on_ready: Callable[[], None] | None = None,
              on_load_failure: Callable[[BaseException], None] | None = None, target_path=None) -> None:
        """Start the engine process; load() -> (llm, tree budget mode) runs there.

        fork: the child inherits the loaded modules and whatever the launcher patched (tests,
        benchmarks), and `inherited` (the listening sockets) is closed there at once; it needs a
        process that has not touched CUDA (a GPU server spawns: load must then pickle).
        on_ready / on_load_failure(exc) are called by the pipe's reader thread. target_path: the
        target whose tokenizer this process loads meanwhile (a second or so with transformers)."""
        self._on_ready, self._on_load_failure = on_ready, on_load_failure
        context = multiprocessing.get_context("fork" if fork else "spawn")
        front_end, engine_end = context.Pipe()
        events_in, events_out = context.Pipe(duplex=False)
        # A forked child closes its copies of the front's ends of the pipes (else it would never see
        # the control pipe close when the front dies) and of the listening sockets; a spawned one has none.
        inherited = (*inherited, front_end, events_in) if fork else ()
        self.process = context.Process(target=run_engine, name="ddtree-engine",
                                       args=(engine_end, events_out, load, self.model_name, self.options, inherited,
                                             logging.getLogger().level))
        self.process.start()
        engine_end.close()
        events_out.close()
        self._conn = front_end
        self._events = events_in
        os.set_blocking(events_in.fileno(), False)  # read by an event loop: what has arrived, never more
        if target_path is not None:
            self._preload = threading.Thread(target=self._load_tokenizer, args=(target_path,), daemon=True)
            self._preload.start()
        # A thread reads the control pipe, not the event loop: it is written by the front too, and
        # uvloop's add_reader would make it non-blocking (a message written in part would then fail).
        threading.Thread(target=self._read, name="ddtree-engine-pipe", daemon=True).start()

    def _load_tokenizer(self, target_path) -> None:
        try:
            self._preloaded = (target_path, load_tokenizer(target_path))
        except Exception:  # FrontModel loads it again and reports the error then
            pass

    def stop(self, timeout: float | None = None) -> bool:
        """Let the engine finish its queued jobs, then end its process; False if it was still running
        after `timeout` (at once once it is abandoned)."""
        with self._lock:
            if self.state in (LOADING, READY):
                self.state = STOPPED
            if self._abandoned:
                return False
        if self.process is None or not self.process.is_alive():
            return True
        self._send(("stop", timeout))
        self.process.join(timeout)
        return not self.process.is_alive()

    def close(self, timeout: float = 5.0) -> None:
        """Close the pipe (the engine process exits when it sees it closed) and wait for the process;
        kill it if it is still there after `timeout`. For a front that exits without `stop`."""
        with self._lock:
            if self.state in (LOADING, READY):
                self.state = STOPPED
        if self._conn is not None:
            self._conn.close()
        if self._events_loop is not None and not self._events_loop.is_closed():
            try:
                self._events_loop.call_soon_threadsafe(self._unwatch_events)
            except RuntimeError:  # closed meanwhile
                pass
        if self.process is not None:
            self.process.join(timeout)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(timeout)

    def abort_all(self, reason: str) -> int:
        """Refuse new jobs and end every job with EngineUnavailable(reason) now; the engine drops them
        after the round in progress. Returns how many were ended."""
        with self._lock:
            if self.state == READY:
                self.state = STOPPED
            ended = list(self._jobs.values())
            self._jobs.clear()
            self._started.clear()
        emit_all([(job, EngineUnavailable(reason)) for job in ended])
        self._send(("abort_all", reason))
        return len(ended)

    def abandon(self, reason: str) -> int:
        """For a stuck engine (a hung GPU): end every job as `abort_all` does and kill its process."""
        with self._lock:
            self._abandoned = True
        ended = self.abort_all(reason)
        if self.process is not None and self.process.is_alive():
            self.process.kill()
        return ended

    @property
    def ready(self) -> bool:
        return self.state == READY

    def unavailable_reason(self) -> str:
        return unavailable_reason(self.state)

    # -- requests ----------------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        with self._lock:
            if self.state != READY:
                raise EngineUnavailable(self.unavailable_reason())
            waiting = len(self._jobs) - len(self._started)
            if self.max_queued is not None and waiting >= self.max_queued:
                raise QueueFull(f"{waiting} requests are already waiting for the engine, the most this server "
                                "queues (--max-queued-requests); retry shortly")
            if not self._jobs:
                self._progress_at = time.monotonic()  # an idle engine has not been stalling
            key = next(self._keys)
            self._jobs[key] = job
        self._watch_events(job.loop)
        job.on_cancel = lambda: self._cancel(key)
        if not self._send(("submit", key, job.prompt_ids, job.params, job.budget, job.adaptive, job.request_id,
                           job.arrival)):
            with self._lock:
                self._jobs.pop(key, None)
            raise EngineUnavailable(unavailable_reason(DEAD))

    def _cancel(self, key: int) -> None:
        if key in self._jobs:  # a finished job's cancel (its handler always calls it) sends nothing
            self._send(("cancel", key))

    @property
    def waiting(self) -> int:
        """Jobs the engine has not yet sent anything for (queued, or their prompt being prefilled)."""
        with self._lock:
            return len(self._jobs) - len(self._started)

    def stalled_for(self) -> float:
        """Seconds since the engine's last message while it has jobs; 0 when it has none."""
        if self.state != READY or not self._jobs:
            return 0.0
        return time.monotonic() - self._progress_at

    def render_metrics(self) -> tuple[bytes, str]:
        """The engine's Prometheus text (its worker keeps the metrics), asked over the pipe."""
        reply_id = next(self._keys)
        waiter = self._replies[reply_id] = [threading.Event(), None]
        try:
            if not self._send(("metrics", reply_id)) or not waiter[0].wait(METRICS_TIMEOUT_S) or waiter[1] is None:
                raise EngineUnavailable(f"the engine process did not answer for its metrics ({self.state})")
            return waiter[1]
        finally:
            self._replies.pop(reply_id, None)

    # -- the pipes ---------------------------------------------------------------------------

    def _watch_events(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Have `loop` (a submitted job's: the app's) read the events pipe, from the first job on,
        and again after a loop that read it has stopped (tests run one loop after another). Called
        on `loop`'s own thread (the app's handlers submit there), else asked of it."""
        if loop is None or loop is self._events_loop or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not loop:
            loop.call_soon_threadsafe(self._watch_events, loop)
            return
        previous = self._events_loop
        if previous is not None and previous.is_running():
            return  # the server's one loop reads it; a job of another loop gets its items from there
        if previous is not None and not previous.is_closed():
            previous.remove_reader(self._events.fileno())  # stopped: it reads nothing more
        self._events_loop = loop
        loop.add_reader(self._events.fileno(), self._read_events)

    def _unwatch_events(self) -> None:
        loop = self._events_loop
        if loop is not None and not loop.is_closed():
            loop.remove_reader(self._events.fileno())

    def _read_events(self) -> None:
        """On the event loop: the rounds' items that have arrived, to their jobs (`_deliver`)."""
        chunks = []
        try:
            while True:
                data = os.read(self._events.fileno(), 1 << 16)
                if not data:  # the engine process has ended; the control pipe's reader says why
                    self._unwatch_events()
                    break
                chunks.append(data)
                if len(data) < 1 << 16:
                    break
        except BlockingIOError:
            pass
        except OSError:  # closed here (`close`)
            self._unwatch_events()
        for message in self._frames.messages(b"".join(chunks)):
            if isinstance(message, tuple):  # ("dead", message): after the failing jobs' items
                self._dead(message[1])
            else:
                self._deliver(message)

    def _send(self, message: tuple) -> bool:
        """Send a message to the engine; False when its process is gone."""
        with self._send_lock:
            try:
                self._conn.send(message)
                return True
            except (BrokenPipeError, ConnectionResetError, EOFError, OSError, AttributeError):
                return False

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                self._lost()
                return
            self._handle(message)

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "metrics":
            waiter = self._replies.get(message[1])
            if waiter is not None:
                waiter[1] = message[2]
                waiter[0].set()
        elif kind == "ready":
            self._ready(message[1])
        elif kind == "load_failed":
            with self._lock:
                self.state = STOPPED
            if self._on_load_failure is not None:
                self._on_load_failure(message[1])
        # "stopped": the process ends next, which stop() waits for

    def _deliver(self, pairs: list[tuple[int, object]]) -> None:
        """A round's items to their jobs; a job's last item (its result or an exception) ends it."""
        out, failed = [], None
        with self._lock:
            self._progress_at = time.monotonic()
            for key, item in pairs:
                job = self._jobs.get(key)
                if job is None:
                    continue  # ended here already (abort_all)
                if isinstance(item, BaseException) or item.result is not None:
                    del self._jobs[key]
                    self._started.discard(key)
                    if isinstance(item, EngineFailure):
                        failed = item
                else:
                    self._started.add(key)
                out.append((job, item))
        if failed is not None:  # before the failure reaches its client
            self._mark_dead(f"{failed}; see the server log")
        emit_all(out)

    def _ready(self, info) -> None:
        if self._preload is not None:
            self._preload.join()
        try:
            model = FrontModel(info, self._preloaded)
        except BaseException as exc:  # the tokenizer did not load here
            log.exception("the server's front could not load the target's tokenizer")
            self.abandon("the server's front could not load the target's tokenizer")
            if self._on_load_failure is not None:
                self._on_load_failure(exc)
            return
        with self._lock:
            self.llm = model
            self.tree_budget_mode = info.tree_budget_mode
            if self.state == LOADING:
                self.state = READY
        log.info("the engine runs in process %d", self.process.pid)
        if self._on_ready is not None:
            self._on_ready()

    def _dead(self, message: str) -> None:
        """On the event loop: the engine failed (it has logged why, and its failing jobs' items
        have been delivered: they came before this on the events pipe). Ends the jobs left."""
        self._mark_dead(message)
        with self._lock:
            self.error = message
        self._end_jobs(EngineFailure(message), EngineUnavailable(unavailable_reason(DEAD)))

    def _mark_dead(self, message: str) -> None:
        """The state DEAD and `on_death`, once: at a job's EngineFailure (so that /health says so
        before its client hears) or at the engine's own notice, whichever comes first."""
        with self._lock:
            if self.state == DEAD:
                return
            self.state = DEAD
            self.error = message
        if self.on_death is not None:
            self.on_death(RuntimeError(message))

    def _lost(self) -> None:
        """The pipe closed: the engine process ended. Expected once stopped or abandoned; otherwise
        it died (a crash, the OOM killer), and so did its jobs."""
        for waiter in list(self._replies.values()):
            waiter[0].set()
        if self.process is not None:
            self.process.join(1)  # it is exiting: its exit code for the log
        code = self.process.exitcode if self.process is not None else None
        with self._lock:
            was = self.state
            if was in (LOADING, READY):
                self.state = DEAD
                self.error = "the engine process ended unexpectedly; see the server log"
        if was not in (LOADING, READY):
            return
        log.error("the engine process ended unexpectedly (exit code %s)", code)
        if was == LOADING:
            if self._on_load_failure is not None:
                self._on_load_failure(RuntimeError(f"the engine process ended while loading (exit code {code})"))
        elif self.on_death is not None:  # first, as in `_dead`
            self.on_death(RuntimeError(self.error))
        self._end_jobs(EngineFailure(self.error), EngineUnavailable(unavailable_reason(DEAD)))

    def _end_jobs(self, running: BaseException, queued: BaseException) -> None:
        with self._lock:
            pairs = [(job, running if key in self._started else queued) for key, job in self._jobs.items()]
            self._jobs.clear()
            self._started.clear()
        emit_all(pairs)
