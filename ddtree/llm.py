"""The Python API shared by the CLI, the server, the benchmark and the tests.

    llm = LLM()                                    # the shipped demo pair
    out = llm.generate("def fib(n):", SamplingParams(max_tokens=64), tree_budget=63)
    for event in llm.stream(prompt_ids, params):   # tokens as each round accepts them
        print(event.text, end="")
"""
from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from ddtree.batch_budget import BatchBudget
from ddtree.batch_engine import longest_region
from ddtree.batch_memory import batch_cache_slots
from ddtree.budget_selector import CANDIDATES, measured_at_or_below
from ddtree.config import MAX_TREE_BUDGET, DDTreeError, SamplingParams, parse_tree_budget
from ddtree.engine import PREFILL_CHUNK, Engine, Step
from ddtree.logprobs import TokenLogprob
from ddtree.flags import parse_device
from ddtree.model_pair import (  # noqa: F401 (DEFAULT_DRAFT: the demo drafter, for callers)
    DEFAULT_DRAFT, DEFAULT_TARGET, context_limit, default_drafter, needs_drafter_error, no_drafter_warning)
from ddtree.models.configs import TargetConfig
from ddtree.models.loading import load_drafter, load_target, parse_dtype
from ddtree.models.tokenizer import Tokenizer, load_tokenizer
from ddtree.output import OutputBuilder
from ddtree.request_checks import Prompt, RequestChecks
from ddtree.round_costs import measure_round_costs
from ddtree.temperature_buckets import bucket_of
from ddtree.tree_shape import AR, DEFAULT_TREE_BUDGET, TreeShape
from ddtree.working_set import BudgetWorkingSet

ADAPTIVE = "adaptive"  # the budget label of a request whose budget its batch chooses each round

log = logging.getLogger("ddtree")


@dataclass
class GenerationStats:
    tree_budget: str  # its label, or "adaptive" for a request whose budget its batch chose each round
    decode_rounds: int = 0
    budget_rounds: dict[str, int] = field(default_factory=dict)  # decode rounds per tree budget label
    acceptance_lengths: list[int] = field(default_factory=list)
    mean_acceptance_length: float = 0.0
    tokens_per_second: float = 0.0  # generated tokens / wall time from request start to the last token
    time_to_first_token_s: float = 0.0

    def as_dict(self) -> dict:
        """`dataclasses.asdict(self)` without its deep copy of every list item (85 us for a 128-round
        request, paid by a stream's last chunk)."""
        return {**vars(self), "budget_rounds": dict(self.budget_rounds),
                "acceptance_lengths": list(self.acceptance_lengths)}


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None  # with params.logprobs: one per token id


    def to_dict(self) -> dict:
        data = asdict(self)
        if self.logprobs is None:  # only requests that asked for log-probs report them
            del data["logprobs"]
        return data


@dataclass
class StreamEvent:
    """One step's output: the new token ids and new text; `result` is set on the last event."""

    token_ids: list[int]
    text: str
    result: GenerationResult | None = None
    logprobs: list[TokenLogprob] | None = None  # with params.logprobs: one per token id

    @property
    def finished(self) -> bool:
        return self.result is not None

    def __reduce__(self):
        # Pickled as a constructor call, not a dataclass's state: the engine process sends every
        # round's events over a pipe (16 events on the CPU: 12.0 -> 8.7 us to pickle, 7.6 -> 4.7 to
        # unpickle; benchmarks/pipe_events.py, results/pipe_events_cpu*.json).
        return StreamEvent, (self.token_ids, self.text, self.result, self.logprobs)

    @staticmethod
    def merged(events: list["StreamEvent"]) -> "StreamEvent":
        """Consecutive events of one request as one: their tokens, text and log-probs in order, the
        last one's result (a stream that fell behind its engine sends what has gathered at once)."""
        if len(events) == 1:
            return events[0]
        logprobs = None if events[0].logprobs is None else [lp for e in events for lp in e.logprobs]
        return StreamEvent([t for e in events for t in e.token_ids], "".join(e.text for e in events),
                           events[-1].result, logprobs)


class RequestProgress:
    """One request's output as its engine steps arrive: stop rules and text (`OutputBuilder`),
    statistics and log-probs; the same for a request decoded alone or in a batch."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, budget: TreeShape, eos_token_ids: list[int],
                 decode, adaptive: bool = False, incremental: bool = True):
        self.prompt_ids = prompt_ids
        self.budget = budget
        self.out = OutputBuilder(params, eos_token_ids, decode, incremental)
        self.stats = GenerationStats(tree_budget=ADAPTIVE if adaptive else budget.label)
        self.start = time.perf_counter()
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.taken: list[int] = []
        self.taken_logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.out.finished

    def add(self, step: Step) -> StreamEvent | None:
        """Take a step's tokens up to the first stop -> the event to hand out, or None once the
        request has finished (its last tokens then go out with `final_event`)."""
        if step.acceptance_length:
            self.stats.decode_rounds += 1
            self.stats.acceptance_lengths.append(step.acceptance_length)
            label = (step.budget or self.budget).label
            self.stats.budget_rounds[label] = self.stats.budget_rounds.get(label, 0) + 1
        else:
            self.stats.time_to_first_token_s = time.perf_counter() - self.start
        self.taken = self.out.add(step.tokens)
        if self.logprobs is not None:
            self.taken_logprobs = step.logprobs[: len(self.taken)]
            self.logprobs += self.taken_logprobs
        if self.out.finished:
            return None
        return StreamEvent(self.taken, self.out.text_delta(), logprobs=self.taken_logprobs)

    def final_event(self) -> StreamEvent:
        """The last event: the last step's tokens and the request's result."""
        stats, out = self.stats, self.out
        elapsed = time.perf_counter() - self.start
        if stats.acceptance_lengths:
            stats.mean_acceptance_length = sum(stats.acceptance_lengths) / len(stats.acceptance_lengths)
        stats.tokens_per_second = len(out.token_ids) / elapsed if elapsed > 0 else 0.0
        result = GenerationResult(out.text, list(out.token_ids), self.prompt_ids, out.finish_reason, stats, self.logprobs)
        return StreamEvent(self.taken, out.text_delta(), result, self.taken_logprobs)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class LLM(RequestChecks):
    """A target + drafter pair loaded once. `stream` decodes one request; `generate` with several
    prompts decodes up to max_num_seqs of them together (`batched`). Not thread-safe."""

    def __init__(
        self,
        target: str | Path | None = None,
        draft: str | Path | None = None,
        *,
        device: str | None = None,
        dtype: str | None = None,
        tree_budget: TreeShape | str | int | None = None,
        max_model_len: int | None = None,
        use_draft: bool = True,
        use_graphs: bool | None = None,
        compile_layers: bool | None = None,
        fused_tree: bool | None = None,
        kv_bucket: int | None = None,
        padded_prefill: bool | None = None,
        overlap: bool = True,
        prefill_chunk: int = PREFILL_CHUNK,
        max_cached_budgets: int | None = None,
        max_num_seqs: int | None = None,
        gpu_memory_utilization: float | None = 0.9,
        kv_cache_tokens: int | None = None,
        rope_scaling: dict | None = None,
    ):
        """`draft=None` loads the demo drafter for the demo target and no drafter for any other target
        (it then decodes with `ar`, and a warning says so); `use_draft=False` never loads one.
        `tree_budget=None` is DEFAULT_TREE_BUDGET (63) with a drafter and `ar` without.
        prefill_chunk: the most tokens one forward of a long prompt's prefill runs (its activation
        memory grows with it; ddtree.engine.prefill_chunks), for the batched engine too.
        max_cached_budgets: how many tree budgets besides the default keep their buffers and
        graphs between requests (least recently used beyond it are freed; None keeps every one).
        max_num_seqs: requests decoded together (`generate` with several prompts, `ddtree serve`;
        ddtree.batching). None: 8 on a CPU; 1 on CUDA, where batching is opt-in (the README's
        limits); 1 for hybrid targets, which batch (each row with its own recurrent state) only
        when asked.
        gpu_memory_utilization: on CUDA, the share of the device's memory this process may hold in
        all; the batched engine's KV cache takes what the rest leaves (ddtree.batch_memory), so
        that short requests leave room for more of them. kv_cache_tokens: the batched engine's KV
        slots outright (any device; at least one sequence at the context limit).
        rope_scaling: the target's rope scaling over its config.json's (`--rope-scaling`), e.g.
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}; the
        context limit grows with it (`RopeConfig.context_limit`)."""
        self.target_path = Path(target) if target is not None else DEFAULT_TARGET
        self.draft_path = None
        if use_draft:
            self.draft_path = Path(draft) if draft is not None else default_drafter(self.target_path)
        self.device = torch.device(parse_device(device) if device is not None else default_device())
        dtype = dtype or ("bfloat16" if self.device.type == "cuda" else "float32")
        self.dtype = parse_dtype(dtype)
        if tree_budget is None:
            self.default_budget = DEFAULT_TREE_BUDGET if self.draft_path is not None else AR
        else:
            self.default_budget = parse_tree_budget(tree_budget)
            if self.default_budget.drafts and self.draft_path is None:
                raise needs_drafter_error(self.default_budget)
        # --tree-budget auto: the budget per temperature bucket (ddtree.temperature_buckets), else None
        self.auto_budgets: dict[str, TreeShape] | None = None
        # --tree-budget auto with a tune file that measured long contexts: the budget per context
        # bucket (ddtree.budget_selector.context_bucket), a cap on the temperature bucket's pick
        self.auto_context_budgets: dict[str, TreeShape] = {}
        # Without auto_budgets: picks the budget of requests that name none from their measured speed
        # (ddtree.budget_selector; `ddtree serve` without --tree-budget and one request at a time sets one).
        self.budget_selector = None
        # A ddtree.batch_budget.BatchBudget: requests that name no budget and decode in a batch get
        # theirs from it every round (`ddtree serve` without --tree-budget and with batching sets one;
        # `adapt_batch_budget`).
        self.batch_budget = None

        cfg = TargetConfig.from_dir(self.target_path, rope_scaling)
        limit = context_limit(cfg, max_model_len)
        if use_draft and self.draft_path is None:
            log.warning(no_drafter_warning(self.target_path))
        self.max_model_len = limit
        positions = limit + MAX_TREE_BUDGET + 1
        self.target = load_target(self.target_path, self.device, self.dtype, positions, rope_scaling)
        self.drafter = None
        if self.draft_path is not None:
            self.drafter = load_drafter(self.draft_path, cfg, self.device, self.dtype, positions)
        self.tokenizer: Tokenizer | None = load_tokenizer(self.target_path)
        self.eos_token_ids = list(cfg.eos_token_ids)
        self.vocab_size = cfg.vocab_size
        self.engine = Engine(self.target, self.drafter, limit, use_graphs=use_graphs, kv_bucket=kv_bucket,
                             compile_layers=compile_layers, fused_tree=fused_tree,
                             padded_prefill=padded_prefill, overlap=overlap, prefill_chunk=prefill_chunk)
        self.working_set = BudgetWorkingSet(self.engine, max_cached_budgets)
        if max_num_seqs is not None and max_num_seqs < 1:
            raise DDTreeError(f"max_num_seqs must be >= 1, got {max_num_seqs}", "max_num_seqs")
        # Hybrid targets batch only when asked: on a GPU their batched rounds have been checked in float32 at
        # `ar` and 16 only, and not timed.
        self.max_num_seqs = max_num_seqs or (1 if self.device.type == "cuda" or cfg.hybrid else 8)
        self.gpu_memory_utilization = gpu_memory_utilization
        self.kv_cache_tokens = kv_cache_tokens
        self._batch = None  # the BatchedRequests of `batched`, made on first use

    # -- facts the server and benchmark report -----------------------------------------------

    @property
    def block_size(self) -> int:
        return self.engine.block_size

    @property
    def target_name(self) -> str:
        return self.target_path.name

    @property
    def draft_name(self) -> str | None:
        return self.draft_path.name if self.draft_path is not None else None

    # -- tree budgets (prompts and request checks: RequestChecks) ---------------------------------

    def budget_for(self, temperature: float, context_tokens: int = 0) -> TreeShape:
        """The budget of a request that names none: with `auto_budgets` (--tree-budget auto) its
        temperature bucket's pick, or its context bucket's pick when that is the smaller tree (the
        temperature picks are measured on short prompts, the context picks greedily: each caps the
        tree where its measurement says a larger one does not pay; a context bucket not measured,
        such as the one past 32k that `ddtree tune` leaves by default, takes the cap of the longest
        measured bucket below it); else the budget selector's choice for its buckets; else the
        default."""
        if self.auto_budgets is None:
            if self.budget_selector is not None:
                return self.budget_selector.choose(bucket_of(temperature).name, context_tokens)
            return self.default_budget
        pick = self.auto_budgets.get(bucket_of(temperature).name, self.default_budget)
        cap = measured_at_or_below(self.auto_context_budgets, context_tokens)
        if cap is not None and cap.nodes(self.block_size) < pick.nodes(self.block_size):
            return cap
        return pick

    def adapts(self, tree_budget: object) -> bool:
        """Whether a request naming `tree_budget` has its budget chosen per round when it decodes
        in a batch: it names none and this LLM has a batch_budget."""
        return tree_budget is None and self.batch_budget is not None and self.max_num_seqs > 1

    def adapt_batch_budget(self, candidates: tuple[TreeShape, ...] | None = None, costs=None,
                           log=None) -> BatchBudget:
        """From now on, requests that name no budget and decode in a batch get theirs each round
        from the batch (ddtree.batch_budget) among `candidates` (default ar, 15, 63), priced by
        `costs` (a `RoundCostTable`; default: measured now on the batched engine, a few seconds on
        a CPU). -> the BatchBudget."""
        if self.drafter is None:
            raise DDTreeError("an adaptive tree budget needs a drafter", "tree_budget")
        candidates = tuple(candidates or CANDIDATES)
        batch = self.batched(max(b.nodes(self.block_size) for b in candidates))
        if costs is None:
            costs = measure_round_costs(batch.engine, list(candidates), log=log)
        self.batch_budget = BatchBudget(costs, self.block_size, candidates)
        return self.batch_budget

    def _budget(self, tree_budget: object, temperature: float = 0.0, context_tokens: int = 0) -> TreeShape:
        """The request's tree budget (None: the default for its temperature), refused when it needs a
        missing drafter."""
        budget = self.budget_for(temperature, context_tokens) if tree_budget is None else parse_tree_budget(tree_budget)
        if budget.drafts and self.drafter is None:
            raise DDTreeError("this engine has no drafter: only tree budget 'ar' is available", "tree_budget")
        return budget

    # -- generation ---------------------------------------------------------------------------

    def warmup(self, tree_budget: object = None) -> None:
        """Allocate a budget's buffers and, on CUDA, capture all of its graphs now (otherwise a
        graph is captured the first time a request reaches its KV-length bucket)."""
        budget = self._budget(tree_budget)
        self.working_set.use(budget, pinned=(self.default_budget,))
        self.engine.capture_all(budget)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, tree_budget: object = None) -> Iterator[StreamEvent]:
        """Yield a StreamEvent per engine step (the prefill's first token, then each round)."""
        params = params or SamplingParams()
        prompt_ids = self.prompt_ids(prompt)
        budget = self.check_request(prompt_ids, params, tree_budget)
        progress = self.progress(prompt_ids, params, budget)
        self.working_set.use(budget, pinned=(self.default_budget,))
        steps = self.engine.generate(prompt_ids, params, budget)
        try:
            for step in steps:
                event = progress.add(step)
                if event is None:
                    break
                yield event
        finally:
            steps.close()
        yield progress.final_event()

    def progress(self, prompt_ids: list[int], params: SamplingParams, budget: TreeShape,
                 adaptive: bool = False) -> "RequestProgress":
        """A request's output tracker (stop rules, text, statistics), started now."""
        tokenizer = self.tokenizer
        decode = tokenizer.decode_for_output if tokenizer is not None else None
        incremental = tokenizer is None or tokenizer.decodes_incrementally
        return RequestProgress(prompt_ids, params, budget, self.eos_token_ids, decode, adaptive, incremental)

    def generate(self, prompts: Prompt | list[Prompt], params: SamplingParams | list[SamplingParams] | None = None,
                 tree_budget: object = None) -> GenerationResult | list[GenerationResult]:
        """One prompt -> its GenerationResult; a list of prompts (as vLLM's `LLM.generate` takes) -> a
        list of results in the same order, with one SamplingParams for all or one per prompt.

        A list of integers is one prompt's token ids; a list of strings, of token-id lists or of
        prompt dicts is several prompts. Every prompt of a list is checked before any is run."""
        if not is_prompt_list(prompts):
            if isinstance(params, (list, tuple)):
                raise DDTreeError("a list of sampling params needs a list of prompts", "params")
            return self._generate_one(prompts, params, tree_budget)
        if isinstance(params, (list, tuple)):
            if len(params) != len(prompts):
                raise DDTreeError(f"{len(params)} sampling params for {len(prompts)} prompts", "params")
            per_prompt = list(params)
        else:
            per_prompt = [params] * len(prompts)
        per_prompt = [p or SamplingParams() for p in per_prompt]
        ids, budgets = [], []  # each prompt's budget chosen once, as it is checked
        for index, (prompt, p) in enumerate(zip(prompts, per_prompt)):
            try:
                ids.append(self.prompt_ids(prompt))
                budgets.append(self.check_request(ids[-1], p, tree_budget))
            except DDTreeError as exc:
                raise DDTreeError(f"prompt {index}: {exc}", exc.param) from None
        if self.max_num_seqs > 1 and len(ids) > 1:
            return self._generate_batched(ids, per_prompt, budgets, self.adapts(tree_budget))
        return [self._generate_one(i, p, b) for i, p, b in zip(ids, per_prompt, budgets)]

    def batched(self, max_nodes: int | None = None):
        """The `ddtree.batching.BatchedRequests` of this LLM: up to max_num_seqs requests decoded
        together, with trees of up to max_nodes nodes (default: the largest tree budget's). Made on
        first use and kept; made again only for larger trees. Its caches hold max_num_seqs
        sequences of max_model_len tokens and max_nodes tree slots each."""
        if self.max_num_seqs < 2:
            raise DDTreeError("batched decoding needs max_num_seqs >= 2", "max_num_seqs")
        if self._batch is None or (max_nodes is not None and self._batch.engine.max_nodes < max_nodes):
            from ddtree.batching import BatchedRequests  # it imports this module

            self._batch = BatchedRequests(self, self.max_num_seqs, max_nodes)
        return self._batch

    def batch_cache_slots(self, max_rows: int, max_nodes: int | None) -> int | None:
        """The KV slots of a batched engine of max_rows rows and trees of up to max_nodes nodes
        (ddtree.batch_memory.batch_cache_slots; None: the engine's default)."""
        max_nodes = max_nodes or MAX_TREE_BUDGET + 1
        served = max(shape.nodes(self.block_size) for shape in (self.default_budget, *CANDIDATES))
        drafter_cfg = self.drafter.config if self.drafter is not None else None
        return batch_cache_slots(self.target.config, drafter_cfg, str(self.dtype).removeprefix("torch."), max_rows,
                                 longest_region(self.max_model_len, max_nodes, self.block_size),
                                 min(served, max_nodes), self.device, self.gpu_memory_utilization,
                                 self.kv_cache_tokens)

    def _generate_batched(self, ids: list[list[int]], params: list[SamplingParams], budgets: list[TreeShape],
                          adaptive: bool) -> list[GenerationResult]:
        """Checked requests through `batched`, joining as rows free up; results in prompt order.
        adaptive: their budgets are chosen each round (`batch_budget`)."""
        if adaptive:
            budgets = budgets + list(self.batch_budget.candidates)  # every shape the rows may take
        batch = self.batched(max(budget.nodes(self.block_size) for budget in budgets))
        results: list[GenerationResult | None] = [None] * len(ids)
        index_of: dict[int, int] = {}
        waiting = list(range(len(ids)))
        while waiting or batch.busy:
            while waiting and batch.fits(len(ids[waiting[0]]), params[waiting[0]], budgets[waiting[0]], adaptive):
                i = waiting.pop(0)
                index_of[id(batch.begin(ids[i], params[i], budgets[i], adaptive))] = i
            for request, event in batch.started():  # those joining now, their first tokens read together
                if event.result is not None:
                    results[index_of.pop(id(request))] = event.result
            if not batch.busy:
                continue
            for request, event in batch.step():
                if event.result is not None:
                    results[index_of.pop(id(request))] = event.result
        return results

    def _generate_one(self, prompt: Prompt, params: SamplingParams | None, tree_budget: object) -> GenerationResult:
        for event in self.stream(prompt, params, tree_budget):
            if event.result is not None:
                return event.result
        raise RuntimeError("generation ended without a result")


def is_prompt_list(prompts: object) -> bool:
    """True for several prompts (a list of strings, token-id lists or prompt dicts); False for one
    prompt, token ids included: a list of integers is one prompt, as in vLLM."""
    return (isinstance(prompts, (list, tuple)) and len(prompts) > 0
            and all(isinstance(p, (str, list, tuple, dict)) for p in prompts))
