"""Requests decoded together: a `BatchEngine` stepping every running request each round, with each
request's output (stop rules, text, statistics, log-probs) as `LLM.stream` gives it alone.

    batch = BatchedRequests(llm, max_rows=8)
    request, first = batch.add(prompt_ids, params, budget)   # prefill; `first` is its first event
    for request, event in batch.step():                      # one round of every running request
        ...                                                  # a finished request's event has .result

A request that finishes (stop rule or max_tokens) leaves the batch in the `step` that finishes it;
`cancel` removes one between steps (a client that went away).
"""
from __future__ import annotations

from dataclasses import dataclass

from ddtree.batch_engine import BatchEngine, Sequence
from ddtree.config import SamplingParams
from ddtree.llm import RequestProgress, StreamEvent
from ddtree.tree_shape import TreeShape


@dataclass(eq=False)
class BatchedRequest:
    sequence: Sequence
    progress: RequestProgress
    budget: TreeShape


class BatchedRequests:
    def __init__(self, llm, max_rows: int, max_nodes: int | None = None):
        """llm: an `LLM` (its models, tokenizer and limits); max_rows: requests decoding at once;
        max_nodes: the largest tree a request may use (default: the largest tree budget's)."""
        self.llm = llm
        self.max_rows = max_rows
        self.engine = BatchEngine(llm.target, llm.drafter, llm.max_model_len, max_rows, max_nodes,
                                  prefill_chunk=llm.engine.prefill_chunk)
        self.running: list[BatchedRequest] = []

    @property
    def free(self) -> int:
        """How many more requests can join now."""
        return self.engine.free_rows

    def add(self, prompt_ids: list[int], params: SamplingParams, budget: TreeShape) -> tuple[BatchedRequest, StreamEvent]:
        """Prefill a validated request (`LLM.check_request`) -> (its handle, its first event). A
        request finished by its first token is not kept: its event has the result."""
        progress = self.llm.progress(prompt_ids, params, budget)
        sequence, step = self.engine.add(prompt_ids, params, budget)
        request = BatchedRequest(sequence, progress, budget)
        event = progress.add(step)
        if event is None:
            self.engine.remove(sequence)
            return request, progress.final_event()
        self.running.append(request)
        return request, event

    def step(self) -> list[tuple[BatchedRequest, StreamEvent]]:
        """One round of every running request -> each one's event (with .result when it finished)."""
        by_sequence = {id(r.sequence): r for r in self.running}
        events = []
        for sequence, step in self.engine.step():
            request = by_sequence[id(sequence)]
            event = request.progress.add(step)
            if event is None:
                self._leave(request)
                event = request.progress.final_event()
            events.append((request, event))
        return events

    def cancel(self, request: BatchedRequest) -> None:
        """Remove a running request (its client went away); nothing more is decoded for it."""
        if request in self.running:
            self._leave(request)

    def _leave(self, request: BatchedRequest) -> None:
        self.running.remove(request)
        self.engine.remove(request.sequence)
