"""The engine process: `ddtree serve`'s engine, in a process of its own.

The HTTP front (event loop, tokenizer, request checks) and the engine (the `EngineWorker` thread
that launches every round) used to share one interpreter lock, so the server's Python and the
engine's took turns and their costs added. Here the engine runs the same `EngineWorker` in a
forked child, and the two talk over two pipes. The control pipe (`multiprocessing.Pipe`) carries
messages of plain tuples:

    front -> engine   ("submit", key, prompt_ids, params, budget, adaptive, request_id, arrival)
                      ("cancel", key)  ("metrics", reply_id)  ("abort_all", reason)  ("stop", timeout)
    engine -> front   ("ready", EngineInfo)  ("load_failed", exception)
                      ("metrics", reply_id, (text, content type))  ("stopped", ok)

and a one-way events pipe carries each round's items, [(key, StreamEvent or exception), ...],
as frames (`write_frame`) that the front's event loop reads itself (`FrameReader`): a thread
reading them would add a wake-up of the loop to every round's events. The engine's failure,
("dead", message), is a frame there too, after the failing jobs' own items: on a pipe of its own
the front could hear it first and end those jobs with a 503 instead of their 500.

The child ignores SIGINT and SIGTERM (the front drains its requests, then sends "stop"), and
exits when the control pipe closes (the front is gone, however it ended). The front's side is
`ddtree.server.engine_client.EngineClient`.
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
import threading
from typing import Callable

from ddtree.config import DDTreeError
from ddtree.server.front_model import EngineInfo
from ddtree.server.metrics import ServerMetrics
from ddtree.server.worker import EngineUnavailable, EngineWorker, Job, QueueFull

log = logging.getLogger("ddtree.server")


FRAME_HEADER = 8  # bytes: a frame's payload length, little-endian, before the payload


def write_frame(fd: int, message: object) -> None:
    """`message` pickled, as one frame, to a blocking pipe (whole: a pipe may take a large write
    in parts)."""
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(len(payload).to_bytes(FRAME_HEADER, "little") + payload)
    while view:
        view = view[os.write(fd, view):]


class FrameReader:
    """The front's side of `write_frame`: the bytes read so far -> every whole message in them."""

    def __init__(self):
        self.buffer = bytearray()

    def messages(self, data: bytes) -> list:
        self.buffer += data
        out, start, end = [], 0, len(self.buffer)
        while end - start >= FRAME_HEADER:
            size = int.from_bytes(self.buffer[start:start + FRAME_HEADER], "little")
            if end - start - FRAME_HEADER < size:
                break
            start += FRAME_HEADER
            out.append(pickle.loads(self.buffer[start:start + size]))
            start += size
        del self.buffer[:start]
        return out


class PipeSender:
    """The engine's ends of the pipes: whole messages, one writer at a time on each (the engine
    thread writes each round's items to the events pipe; the loading thread and the main thread
    send the rest on the control pipe)."""

    def __init__(self, conn, events):
        self.conn = conn
        self.events_fd = events.fileno()
        self.lock = threading.Lock()
        self.events_lock = threading.Lock()
        self.keys: dict[int, int] = {}  # id(Job) -> the front's key, while the job runs

    def send(self, message: tuple) -> None:
        with self.lock:
            try:
                self.conn.send(message)
            except (BrokenPipeError, ConnectionResetError, EOFError):
                pass  # the front is gone; the main thread exits on the closed pipe

    def items(self, pairs: list[tuple[Job, object]]) -> None:
        """A `Job.sink`: a round's items for their jobs, one message; a job's last item forgets it."""
        out = []
        for job, item in pairs:
            key = self.keys.get(id(job))
            if key is None:
                continue
            if isinstance(item, BaseException) or item.result is not None:
                del self.keys[id(job)]
            out.append((key, item))
        if out:
            self._write_event(out)

    def dead(self, message: str) -> None:
        """The worker failed (`EngineWorker.on_death`, called after the failing jobs' items)."""
        self._write_event(("dead", message))

    def _write_event(self, frame) -> None:
        with self.events_lock:
            try:
                write_frame(self.events_fd, frame)
            except (BrokenPipeError, OSError):
                pass  # the front is gone; the main thread exits on the closed control pipe


def run_engine(conn, events, load: Callable[[], tuple], model_name: str, options: dict, inherited=(),
               log_level: int = logging.INFO) -> None:
    """The engine process's main. conn: the control pipe; events: the write end of the events pipe.
    load() -> (llm, tree budget mode) runs in a thread, so that the pipe is read (/metrics
    answered) while the model loads. options: EngineWorker's limits. inherited: objects to close
    that the fork copied (the front's listening sockets and its ends of the pipes)."""
    for thing in inherited:
        thing.close()
    # A spawned process starts with no logging set up (a forked one has the front's: this is a no-op).
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front decides when the engine stops
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sender = PipeSender(conn, events)
    worker = EngineWorker(ServerMetrics(model_name), lambda exc: sender.dead(worker.error),
                          max_queued=None, **options)  # the front bounds the queue
    threading.Thread(target=_load_and_attach, args=(load, worker, sender), name="ddtree-load", daemon=True).start()
    jobs: dict[int, Job] = {}
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break  # the front is gone: so is the engine
        kind = message[0]
        if kind == "submit":
            _submit(worker, sender, jobs, *message[1:])
        elif kind == "cancel":
            job = jobs.get(message[1])
            if job is not None:
                job.cancel()
        elif kind == "metrics":
            sender.send(("metrics", message[1], worker.render_metrics()))
        elif kind == "abort_all":
            worker.abort_all(message[1])
        elif kind == "stop":
            threading.Thread(target=_stop, args=(worker, sender, message[1]), name="ddtree-stop", daemon=True).start()
        for key in [key for key, job in jobs.items() if id(job) not in sender.keys]:
            del jobs[key]  # ended: its last item has gone to the front
    logging.shutdown()
    os._exit(0)  # no teardown of the model: the front may be exiting within its shutdown timeout


def _load_and_attach(load: Callable[[], tuple], worker: EngineWorker, sender: PipeSender) -> None:
    try:
        llm, mode = load()
        worker.attach(llm, mode)
    except BaseException as exc:  # reported by the front, as one line when it is a DDTreeError
        if not isinstance(exc, DDTreeError):
            log.exception("loading the model failed")
            exc = RuntimeError(f"{type(exc).__name__}: {exc}")  # picklable whatever it was
        sender.send(("load_failed", exc))
        logging.shutdown()
        os._exit(1)  # nothing to serve: the front reports the failure and exits
    sender.send(("ready", EngineInfo.of(llm, mode)))


def _submit(worker: EngineWorker, sender: PipeSender, jobs: dict[int, Job], key: int, prompt_ids: list[int], params,
            budget, adaptive: bool, request_id: str, arrival: float) -> None:
    job = Job(prompt_ids, params, budget, None, request_id=request_id, adaptive=adaptive, arrival=arrival,
              sink=sender.items)
    jobs[key] = job
    sender.keys[id(job)] = key
    try:
        worker.submit(job)
    except (EngineUnavailable, QueueFull) as exc:
        sender.items([(job, exc)])


def _stop(worker: EngineWorker, sender: PipeSender, timeout: float | None) -> None:
    """Finish the queued jobs, say so, and end the process (its main thread waits on the pipe)."""
    sender.send(("stopped", worker.stop(timeout)))
    logging.shutdown()
    os._exit(0)
