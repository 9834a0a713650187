"""Requests decoded together: a `BatchEngine` stepping every running request each round, with each
request's output (stop rules, text, statistics, log-probs) as `LLM.stream` gives it alone.

    batch = BatchedRequests(llm, max_rows=8)
    request, first = batch.add(prompt_ids, params, budget)   # prefill; `first` is its first event
    for request, event in batch.step():                      # one round of every running request
        ...                                                  # a finished request's event has .result

A prompt longer than one prefill chunk (the LLM's `prefill_chunk`) is prefilled one chunk per
`step`, after that step's round, so that the running requests wait for one chunk at a time rather
than the whole prompt: its `add` gives no first event (None), and the step that prefills its last
chunk gives it; meanwhile no other request joins (`free` is 0).

Each request holds a cache region sized by its prompt, its max_tokens and the largest tree it may
run (`BatchEngine.region_slots`); `fits` says whether one can join now (a free row and a free
region), and the caller holds a request that does not until one leaves.

A request that finishes (stop rule or max_tokens) leaves the batch in the `step` that finishes it;
`cancel` removes one between steps (a client that went away), or drops a prefill under way.

A request added with `adaptive=True` has its tree budget chosen before every round by the LLM's
`batch_budget` (ddtree.batch_budget), from the whole batch; the others keep theirs, and every
drafting row's acceptance teaches the choice.
"""
from __future__ import annotations

from dataclasses import dataclass

from ddtree.batch_budget import BatchRow
from ddtree.batch_engine import BatchEngine, Sequence
from ddtree.config import SamplingParams
from ddtree.llm import RequestProgress, StreamEvent
from ddtree.temperature_buckets import bucket_of
from ddtree.tree_shape import TreeShape


@dataclass(eq=False)
class BatchedRequest:
    sequence: Sequence
    progress: RequestProgress
    adaptive: bool  # its budget is chosen each round (sequence.budget: the current one)

    @property
    def temperature_bucket(self) -> str:
        return bucket_of(self.sequence.params.temperature).name


class BatchedRequests:
    def __init__(self, llm, max_rows: int, max_nodes: int | None = None, defer_long_prompts: bool = True,
                 cache_slots: int | None = None, overlap: bool | None = None):
        """llm: an `LLM` (its models, tokenizer and limits); max_rows: requests decoding at once;
        max_nodes: the largest tree a request may use (default: the largest tree budget's);
        defer_long_prompts: prefill a prompt of several chunks a chunk a step (else all at its add);
        cache_slots: the KV slots the requests' regions share (`BatchEngine`; default: the LLM's
        `batch_cache_slots`, from its kv_cache_tokens or the device's free memory); overlap
        (default: the LLM engine's `overlap`) queues each round before the last one's events are made."""
        self.llm = llm
        self.max_rows = max_rows
        overlap = llm.engine.overlap if overlap is None else overlap
        self.defer_long_prompts = defer_long_prompts
        if cache_slots is None:
            cache_slots = llm.batch_cache_slots(max_rows, max_nodes)
        self.engine = BatchEngine(llm.target, llm.drafter, llm.max_model_len, max_rows, max_nodes, cache_slots,
                                  prefill_chunk=llm.engine.prefill_chunk, use_graphs=llm.engine.use_graphs,
                                  kv_bucket=llm.engine.kv_bucket, fused_tree=llm.engine.fused_tree,
                                  padded_prefill=bool(llm.engine.prefill_lengths),
                                  compile_layers=False,  # the models run as the LLM set them
                                  # padded prompts go through the LLM's engine, its prefill graphs
                                  prefill_engine=llm.engine if llm.engine.prefill_lengths else None)
        self.running: list[BatchedRequest] = []
        self.pending: BatchedRequest | None = None  # its prompt prefilled a chunk a step
        self.overlap = overlap
        self._in_flight = None  # the next round, launched before the last one's events were made
        self.round_budgets: list[TreeShape] = []  # each row's budget in the round the last `step` read
        self._begun: list = []  # (request, its engine.FirstToken) begun and not yet `started`

    @property
    def free(self) -> int:
        """How many more requests can join now."""
        return self.engine.free_rows

    def max_nodes(self, budget: TreeShape, adaptive: bool) -> int:
        """The largest tree a request may run: its budget's, or an adaptive one's largest candidate's
        that the engine holds."""
        nodes = budget.nodes(self.engine.block_size)
        if adaptive:
            largest = max(shape.nodes(self.engine.block_size) for shape in self.llm.batch_budget.candidates)
            nodes = max(nodes, min(largest, self.engine.max_nodes))
        return nodes

    def fits(self, prompt_len: int, params: SamplingParams, budget: TreeShape, adaptive: bool = False) -> bool:
        """Whether such a request can join now: a free row, and a free cache region for its prompt,
        its max_tokens and its largest tree."""
        return self.engine.fits(prompt_len, params.max_tokens, self.max_nodes(budget, adaptive))

    @property
    def busy(self) -> bool:
        """Whether a request is decoding or being prefilled."""
        return bool(self.running) or self.pending is not None

    def add(self, prompt_ids: list[int], params: SamplingParams, budget: TreeShape,
            adaptive: bool = False) -> tuple[BatchedRequest, StreamEvent | None]:
        """Prefill a validated request (`LLM.check_request`) -> (its handle, its first event; None
        while a long prompt's prefill goes on, a chunk a `step`). A request finished by its first
        token is not kept: its event has the result. adaptive: its budget is chosen each round
        (`budget` is then only its start; needs the LLM's batch_budget)."""
        if self._begun:
            raise RuntimeError("read the first events of the requests begun (`started`) first")
        request = self.begin(prompt_ids, params, budget, adaptive)
        if request is self.pending:
            return request, None
        return self.started()[0]

    def begin(self, prompt_ids: list[int], params: SamplingParams, budget: TreeShape,
              adaptive: bool = False) -> BatchedRequest:
        """`add` without waiting for the first token: the prefill is queued on the device, and
        `started` reads the first events of every request begun since it last ran, in one host sync
        (so that requests arriving together are prefilled back to back). Call it before `step`."""
        if adaptive and self.llm.batch_budget is None:
            raise ValueError("an adaptive request needs the LLM's batch_budget")
        progress = self.llm.progress(prompt_ids, params, budget, adaptive)
        feeds_drafter = adaptive or budget.drafts  # an adaptive row may draft in any round
        sequence, first = self.engine.add(prompt_ids, params, budget, feeds_drafter, defer=self.defer_long_prompts,
                                          max_new=params.max_tokens, max_nodes=self.max_nodes(budget, adaptive),
                                          read=False)
        request = BatchedRequest(sequence, progress, adaptive)
        if first is None:
            self.pending = request
        else:
            self._begun.append((request, first))
        return request

    def started(self) -> list[tuple[BatchedRequest, StreamEvent]]:
        """The first events of the requests begun since the last call (`begin`), in order."""
        begun, self._begun = self._begun, []
        if not begun:
            return []
        steps = self.engine.first_steps([first for _, first in begun])
        return [(request, self._started(request, step)) for (request, _), step in zip(begun, steps)]

    def _started(self, request: BatchedRequest, step) -> StreamEvent:
        """Its first token's event; it runs from the next round, unless that token finished it."""
        event = request.progress.add(step)
        if event is None:
            self.engine.remove(request.sequence)
            return request.progress.final_event()
        self.running.append(request)
        return event

    def step(self) -> list[tuple[BatchedRequest, StreamEvent]]:
        """One round of every running request -> each one's event (with .result when it finished).
        With `overlap`, the round after it is queued on the device before this one's events are
        made (text, stop rules), so that the device works while the host does: a request that this
        round finishes has run one round more, which is dropped."""
        if self._begun:
            raise RuntimeError("read the first events of the requests begun (`started`) before a step")
        if self._in_flight is None:
            if not self.engine.sequences:  # none decoding: a long prompt's next chunk alone
                return self._events([])
            self._choose_budgets()
            if not self.engine.uniform:  # mixed budgets: the per-row round, waited for
                return self._events(self.engine.step())
            self._in_flight = self.engine.launch()
        current, self._in_flight = self._in_flight, None
        if self.overlap and self.engine.sequences:
            self._choose_budgets()  # for the next round (from the acceptance seen before this one)
            if self.engine.uniform:
                self._in_flight = self.engine.launch()
        return self._events(self.engine.collect(current))

    def _choose_budgets(self) -> None:
        """Every adaptive request's budget for the next round launched, from the batch (`batch_budget`)."""
        chooser = self.llm.batch_budget
        if chooser is not None and any(r.adaptive for r in self.running):
            rows = [BatchRow(r.temperature_bucket, r.sequence.n, None if r.adaptive else r.sequence.budget)
                    for r in self.running]
            for request, budget in zip(self.running, chooser.choose(rows)):
                self.engine.set_budget(request.sequence, budget)

    def _events(self, steps) -> list[tuple[BatchedRequest, StreamEvent]]:
        """A round's steps as events; the requests they finish leave; then a long prompt's next chunk."""
        chooser = self.llm.batch_budget
        by_sequence = {id(r.sequence): r for r in self.running}
        self.round_budgets = [step.budget for _, step in steps]  # of the round read (the next may differ)
        events = []
        for sequence, step in steps:
            request = by_sequence[id(sequence)]
            if chooser is not None:
                chooser.observe(request.temperature_bucket, step.budget, step.acceptance_length)
            event = request.progress.add(step)
            if event is None:
                self._leave(request)
                event = request.progress.final_event()
            events.append((request, event))
        if self.pending is not None:  # a long prompt's next chunk, after the round
            started = self.engine.advance_prefill()
            if started is not None:
                request, self.pending = self.pending, None
                events.append((request, self._started(request, started[1])))
        return events

    def cancel(self, request: BatchedRequest) -> None:
        """Remove a running request (its client went away), or drop its prefill under way; nothing
        more is decoded for it."""
        if request is self.pending:
            self.pending = None
            self.engine.remove(request.sequence)
        elif any(request is begun for begun, _ in self._begun):  # its first token not read yet
            self._begun = [(r, first) for r, first in self._begun if r is not request]
            self.engine.remove(request.sequence)
        elif request in self.running:
            self._leave(request)

    def _leave(self, request: BatchedRequest) -> None:
        self.running.remove(request)
        self.engine.remove(request.sequence)
        if not self.running and self._in_flight is not None:  # a round of requests all gone: nothing to read
            self.engine.collect(self._in_flight)
            self._in_flight = None
