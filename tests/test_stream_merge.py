"""A stream that falls behind its engine catches up in one chunk: `Job.next_event` merges every
event waiting (`StreamEvent.merged`), keeps an engine error for after the events sent before it,
and a batched round's events reach their streams with one wake-up of the event loop (`emit_all`)."""
from __future__ import annotations

import asyncio

import pytest

from ddtree.config import SamplingParams
from ddtree.llm import GenerationResult, GenerationStats, StreamEvent
from ddtree.logprobs import TokenLogprob
from ddtree.server.worker import EngineFailure, Job, emit_all
from ddtree.tree_shape import AR


def _job(loop) -> Job:
    return Job([1, 2], SamplingParams(max_tokens=8), AR, loop)


def _result() -> GenerationResult:
    return GenerationResult("abcd", [5, 6, 7, 8], [1, 2], "length", GenerationStats("ar"))


def test_merged_keeps_order_text_logprobs_and_the_last_result():
    lp = [TokenLogprob(t, -0.5, [(t, -0.5)]) for t in range(4)]
    events = [StreamEvent([5], "a", None, lp[:1]), StreamEvent([6, 7], "bc", None, lp[1:3]),
              StreamEvent([8], "d", _result(), lp[3:])]
    merged = StreamEvent.merged(events)
    assert merged.token_ids == [5, 6, 7, 8] and merged.text == "abcd"
    assert merged.logprobs == lp and merged.result is events[-1].result
    assert StreamEvent.merged(events[:1]) is events[0]
    assert StreamEvent.merged([StreamEvent([1], "x"), StreamEvent([2], "y")]).logprobs is None


def test_events_cross_the_engine_pipe_whole():
    """The engine process pickles each round's events for the front: every field comes back."""
    import pickle
    from multiprocessing.reduction import ForkingPickler

    lp = [TokenLogprob(5, -0.5, [(5, -0.5), (9, -1.5)])]
    for event in (StreamEvent([5, 6], "ab"), StreamEvent([5], "a", _result(), lp)):
        back = pickle.loads(bytes(ForkingPickler.dumps(("items", [(3, event)]))))[1][0][1]
        assert back == event and type(back) is StreamEvent


def test_next_event_merges_what_waits_and_raises_an_error_after_it():
    async def run():
        job = _job(asyncio.get_running_loop())
        for i in range(3):
            job.events.put_nowait(StreamEvent([i], str(i)))
        job.events.put_nowait(EngineFailure("boom"))
        first = await job.next_event()
        assert first.token_ids == [0, 1, 2] and first.text == "012"
        with pytest.raises(EngineFailure):
            await job.next_event()

    asyncio.run(run())


def test_next_event_stops_at_the_final_event():
    """Nothing is merged past a result (nothing follows it in a real stream; kept out all the same)."""
    async def run():
        job = _job(asyncio.get_running_loop())
        job.events.put_nowait(StreamEvent([1], "a"))
        job.events.put_nowait(StreamEvent([2], "b", _result()))
        job.events.put_nowait(StreamEvent([3], "c"))
        last = await job.next_event()
        assert last.token_ids == [1, 2] and last.result is not None

    asyncio.run(run())


def test_emit_all_wakes_each_loop_once():
    class CountingLoop:
        def __init__(self):
            self.calls = 0

        def call_soon_threadsafe(self, fn, *args):
            self.calls += 1
            fn(*args)

    class ClosedLoop:
        def call_soon_threadsafe(self, fn, *args):
            raise RuntimeError("Event loop is closed")

    loop, closed = CountingLoop(), ClosedLoop()
    jobs = [_job(loop) for _ in range(5)]
    gone = _job(closed)
    emit_all([(job, StreamEvent([i], "t")) for i, job in enumerate(jobs)] + [(gone, StreamEvent([9], "x"))])
    assert loop.calls == 1
    assert [job.events.get_nowait().token_ids for job in jobs] == [[i] for i in range(5)]
    assert gone.cancelled.is_set() and not any(job.cancelled.is_set() for job in jobs)
