"""OpenAI response bodies and server-sent-event streams built from a job's StreamEvents."""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from ddtree.config import DDTreeError
from ddtree.server.logprobs_format import LogprobsFormatter
from ddtree.server.middleware import internal_error_body
from ddtree.server.protocol import SamplingFields, error_body
from ddtree.server.worker import EngineFailure, EngineUnavailable, Job

log = logging.getLogger("ddtree.server")


DONE = object()  # in a batch of chunks: the stream's end, "data: [DONE]", sent in the same write


class EventStream(StreamingResponse):
    """A StreamingResponse whose body iterator yields (text, last): the last text goes out with the
    end of the body (`more_body` False), so that the stream's last chunk, "data: [DONE]" and the
    chunked encoding's terminator leave in one socket write. A client that stops reading at
    "data: [DONE]" (many do) then finds the response complete and keeps the connection for its next
    request; with the terminator in a write of its own it often does not, and reconnects."""

    async def __call__(self, scope, receive, send) -> None:
        """Stream in this task, while a second one waits for the client to disconnect and then
        cancels it (the body iterator's `finally` cancels the job). Starlette runs the two in a
        task group of its own when the server speaks ASGI 2.3 (uvicorn does), which costs a stream
        about 80 us more (two CPU cores)."""
        stream = asyncio.current_task()
        streaming, gone = True, False

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            if streaming:  # else the response is complete: uvicorn then answers "disconnect" at once
                gone = True
                stream.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not gone:
                raise
            if hasattr(stream, "uncancel"):  # Python 3.11+: this cancellation is handled
                stream.uncancel()
        finally:
            streaming = False
            watcher.cancel()
        if self.background is not None:
            await self.background()

    async def stream_response(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        more = True
        async for text, last in self.body_iterator:
            if more:  # nothing follows the end of the body; the iterator is still run to its end
                await send({"type": "http.response.body", "body": text.encode(), "more_body": not last})
                more = not last
        if more:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


def sse(batches: AsyncIterator[list]) -> StreamingResponse:
    """A server-sent-event stream of `batches`: each a list of chunks (dicts) sent in one write, so
    that a round's last chunk, the usage chunk and the end of the stream leave together (each write
    costs the loop a pass through the middleware and a socket send); a batch ending in DONE ends
    the stream, and the response with it (`EventStream`), which otherwise ends with
    "data: [DONE]" on its own."""
    async def encode():
        needs_done = True
        async for batch in batches:
            lines = []
            for chunk in batch:
                if chunk is DONE:
                    lines.append("data: [DONE]\n\n")
                    needs_done = False
                else:
                    lines.append(f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n")
            yield "".join(lines), not needs_done
        if needs_done:
            yield "data: [DONE]\n\n", True

    return EventStream(encode(), media_type="text/event-stream",
                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class Reply:
    """Builds the OpenAI response bodies and stream chunks of one request."""

    def __init__(self, prefix: str, obj: str, model: str, body: SamplingFields, prompt_ids: list[int],
                 request_id: str | None = None, token_text: Callable[[int], str] = lambda t: f"token_id:{t}"):
        """token_text: a token id's text, for log-probs."""
        self.request_id = request_id or uuid.uuid4().hex
        self.id = f"{prefix}-{self.request_id}"
        self.object = obj
        self.created = int(time.time())
        self.model = model
        self.body = body
        self.prompt_ids = prompt_ids
        self.logprobs = LogprobsFormatter(token_text) if body.requested_logprobs() is not None else None

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _usage(self, result) -> dict:
        n_out = len(result.token_ids)
        return {"prompt_tokens": len(self.prompt_ids), "completion_tokens": n_out,
                "total_tokens": len(self.prompt_ids) + n_out}

    def _ids(self, choice: dict, token_ids: list[int], first: bool) -> dict:
        if self.body.return_token_ids:
            choice["token_ids"] = list(token_ids)
            if first:
                choice["prompt_token_ids"] = list(self.prompt_ids)
        return choice

    def _logprobs(self, logprobs, chat: bool) -> dict | None:
        if self.logprobs is None or logprobs is None:
            return None
        return self.logprobs.chat(logprobs) if chat else self.logprobs.completion(logprobs)

    # -- whole responses ---------------------------------------------------------------------

    def completion(self, result) -> dict:
        choice = {"index": 0, "text": result.text, "logprobs": self._logprobs(result.logprobs, chat=False),
                  "finish_reason": result.finish_reason}
        return {**self._head("text_completion"), "choices": [self._ids(choice, result.token_ids, True)],
                "usage": self._usage(result), "ddtree": result.stats.as_dict()}

    def chat(self, result) -> dict:
        choice = {"index": 0, "message": {"role": "assistant", "content": result.text},
                  "logprobs": self._logprobs(result.logprobs, chat=True), "finish_reason": result.finish_reason}
        return {**self._head("chat.completion"), "choices": [self._ids(choice, result.token_ids, True)],
                "usage": self._usage(result), "ddtree": result.stats.as_dict()}

    # -- streams -----------------------------------------------------------------------------

    async def _events(self, job: Job):
        """The job's events, with an error turned into a final error chunk; cancels on exit."""
        try:
            while True:
                try:
                    event = await job.next_event()
                except DDTreeError as exc:
                    yield error_body(str(exc), param=exc.param, code="invalid_value")
                    return
                except EngineUnavailable as exc:
                    yield error_body(str(exc), type="server_error", code="engine_unavailable")
                    return
                except EngineFailure:  # logged by the engine thread
                    yield internal_error_body(self.request_id)
                    return
                except Exception:  # cancellation passes through
                    log.exception("request %s failed mid-stream", self.request_id)
                    yield internal_error_body(self.request_id)
                    return
                yield event
                if event.result is not None:
                    return
        finally:
            job.cancel()

    def _batch(self, chunk: dict, result) -> list:
        """An event's chunk, and after the last event (a result) its stats, the usage chunk and
        the stream's end: one write (`sse`)."""
        if result is None:
            return [chunk]
        chunk["ddtree"] = result.stats.as_dict()
        out = [chunk]
        if self.body.include_usage:
            out.append({**self._head(chunk["object"]), "choices": [], "usage": self._usage(result)})
        return [*out, DONE]

    async def completion_chunks(self, job: Job):
        """Batches of stream chunks (`sse`): one per event."""
        first = True
        async for event in self._events(job):
            if isinstance(event, dict):  # an error: the stream's last chunk
                yield [event, DONE]
                return
            finish = event.result.finish_reason if event.result is not None else None
            choice = self._ids({"index": 0, "text": event.text, "logprobs": self._logprobs(event.logprobs, chat=False),
                                "finish_reason": finish},
                               event.token_ids, first)
            first = False
            yield self._batch({**self._head("text_completion"), "choices": [choice]}, event.result)

    async def chat_chunks(self, job: Job):
        """Batches of stream chunks (`sse`): the role first, on its own (sent while the prompt is
        prefilled), then one per event."""
        head = self._head("chat.completion.chunk")
        yield [{**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": None}]}]
        first = True
        async for event in self._events(job):
            if isinstance(event, dict):  # an error: the stream's last chunk
                yield [event, DONE]
                return
            finish = event.result.finish_reason if event.result is not None else None
            delta = {"content": event.text} if event.text or finish is None else {}
            choice = self._ids({"index": 0, "delta": delta, "logprobs": self._logprobs(event.logprobs, chat=True),
                                "finish_reason": finish},
                               event.token_ids, first)
            first = False
            yield self._batch({**head, "choices": [choice]}, event.result)
