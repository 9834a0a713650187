"""Prometheus metrics, named as vLLM names them so that `vllm bench serve` and existing dashboards
read DDTree's acceptance unchanged.

Per decode round with a tree (any budget but "ar"), with acceptance length `a` (bonus token counted):
num_drafts += 1, num_draft_tokens += tree nodes drafted, num_accepted_tokens += a - 1 and
num_accepted_tokens_per_pos{position=i} += 1 for every i < a - 1. Mean acceptance length is
therefore 1 + accepted / drafts, as vLLM defines it.

Batched decoding adds `ddtree:batch_rounds_total{tree_budget, batch_size}`: per round, one count
per row at that row's budget, labelled with the round's batch size bucket (1, 2, 3-4, 5-8, ...),
which shows the budgets an adaptive batch chose at each load.
"""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ddtree.tree_shape import TreeShape

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0)
ACCEPTANCE_BUCKETS = tuple(range(1, 17)) + (24, 32, 64)


def batch_size_bucket(rows: int) -> str:
    """"1", "2", "3-4", "5-8", "9-16", ...: the power-of-two bucket of a batch size."""
    if rows <= 2:
        return str(rows)
    upper = 1 << (rows - 1).bit_length()
    return f"{upper // 2 + 1}-{upper}"


class ServerMetrics:
    """One registry per app, so several apps in one process never share counters."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r, m = self.registry, ["model_name"]
        self.num_drafts = Counter("vllm:spec_decode_num_drafts", "Decode rounds that drafted a tree", m, registry=r)
        self.num_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Tree nodes drafted", m, registry=r)
        self.num_accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens",
                                           "Drafted tokens accepted by the target", m, registry=r)
        self.accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                        "Rounds whose accepted path reached this depth (0-based)",
                                        m + ["position"], registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of started requests", m, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens", m, registry=r)
        self.request_success = Counter("vllm:request_success", "Finished requests", m + ["finished_reason"],
                                       registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Arrival to first token", m,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("vllm:time_per_output_token_seconds",
                              "Per request: (last token - first token) / (output tokens - 1)", m,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to last token", m,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.running = Gauge("vllm:num_requests_running", "Requests decoding now", m, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests queued for the engine", m, registry=r)
        self.tree_budget = Gauge("ddtree:tree_budget",
                                 "Tree nodes drafted per round at the server's default budget (0 = ar)", m,
                                 registry=r)
        self.budgets_allocated = Gauge("ddtree:tree_budgets_allocated",
                                       "Tree budgets whose buffers (and graphs) are allocated now", m, registry=r)
        self.auto_tree_budget = Gauge("ddtree:auto_tree_budget",
                                      "1 for the tree budget --tree-budget auto chose for each temperature bucket",
                                      m + ["temperature_bucket", "tree_budget"], registry=r)
        self.budget_tokens_per_second = Gauge(
            "ddtree:budget_tokens_per_second",
            "Without --tree-budget: recent decode tokens/s of each candidate tree budget per temperature and "
            "context bucket, from which requests that name no budget get the fastest",
            m + ["temperature_bucket", "context_bucket", "tree_budget"], registry=r)
        # vLLM's name: the share of the (batched) KV cache that requests hold, 0-1.
        self.kv_cache_usage = Gauge("vllm:gpu_cache_usage_perc",
                                    "Share of the batched engine's KV cache slots held by requests' regions (0-1)", m,
                                    registry=r)
        self.gpu_memory = Gauge("ddtree:gpu_memory_bytes",
                                "GPU memory of the model's device when /metrics is read (cuda only), as the "
                                "caching allocator counts it: allocated or reserved",
                                m + ["kind"], registry=r)
        self.batch_rounds = Counter("ddtree:batch_rounds",
                                    "Batched decoding: rows decoded per round, by the row's tree budget and the "
                                    "round's batch size bucket", m + ["tree_budget", "batch_size"], registry=r)
        self.batch_acceptance = Gauge(
            "ddtree:batch_budget_acceptance",
            "Adaptive batch budgets: the acceptance length expected per round at each candidate budget and "
            "temperature bucket (observed, with an optimistic prior for untried budgets)",
            m + ["temperature_bucket", "tree_budget"], registry=r)
        self.acceptance_length = Histogram("ddtree:acceptance_length",
                                           "Acceptance length per drafted round (bonus token counted)", m,
                                           buckets=ACCEPTANCE_BUCKETS, registry=r)
        for metric in (self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, self.prompt_tokens,
                       self.generation_tokens, self.ttft, self.tpot, self.e2e, self.running, self.waiting,
                       self.tree_budget, self.budgets_allocated, self.acceptance_length):
            metric.labels(model_name)  # expose every series from the start, at zero
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(model_name, reason)

    def set_tree_budget(self, nodes: int) -> None:
        self.tree_budget.labels(self.model_name).set(nodes)

    def set_auto_budgets(self, picks: dict[str, TreeShape]) -> None:
        """--tree-budget auto's pick per temperature bucket, one series each."""
        for bucket, budget in picks.items():
            self.auto_tree_budget.labels(self.model_name, bucket, budget.label).set(1)

    def set_budgets_allocated(self, count: int) -> None:
        self.budgets_allocated.labels(self.model_name).set(count)

    def set_budget_estimates(self, estimates: dict[tuple[str, str], dict[str, float]]) -> None:
        for (temperature_bucket, context_bucket), rates in estimates.items():
            for budget, rate in rates.items():
                self.budget_tokens_per_second.labels(self.model_name, temperature_bucket, context_bucket, budget).set(rate)

    def set_gpu_memory(self, allocated: int, reserved: int) -> None:
        self.gpu_memory.labels(self.model_name, "allocated").set(allocated)
        self.gpu_memory.labels(self.model_name, "reserved").set(reserved)

    def set_kv_cache_usage(self, share: float) -> None:
        self.kv_cache_usage.labels(self.model_name).set(share)

    def set_queue(self, running: int, waiting: int) -> None:
        self.running.labels(self.model_name).set(running)
        self.waiting.labels(self.model_name).set(waiting)

    def record_rounds(self, acceptance_lengths: list[int], draft_tokens: int, ar_rounds: int = 0) -> None:
        """Spec-decode counters for one request's rounds: `ar_rounds` of them decoded with "ar" (a = 1,
        nothing drafted), the others drafted `draft_tokens` tree nodes in all."""
        drafted = list(acceptance_lengths)
        for _ in range(ar_rounds):  # an "ar" round's length is 1: drop as many 1s
            if 1 in drafted:
                drafted.remove(1)
        if draft_tokens == 0 or not drafted:
            return
        name = self.model_name
        self.num_drafts.labels(name).inc(len(drafted))
        self.num_draft_tokens.labels(name).inc(draft_tokens)
        self.num_accepted_tokens.labels(name).inc(sum(a - 1 for a in drafted))
        reached: dict[int, int] = {}
        histogram = self.acceptance_length.labels(name)  # one label look-up, not one per round
        for a in drafted:
            histogram.observe(a)
            for position in range(a - 1):
                reached[position] = reached.get(position, 0) + 1
        for position, count in reached.items():
            self.accepted_per_pos.labels(name, str(position)).inc(count)

    def record_batch_round(self, budgets: list[TreeShape]) -> None:
        """One batched round, whose rows decoded at these budgets."""
        size = batch_size_bucket(len(budgets))
        rows: dict[str, int] = {}
        for budget in budgets:  # one look-up per budget, not per row: this runs every round
            rows[budget.label] = rows.get(budget.label, 0) + 1
        for label, count in rows.items():
            self.batch_rounds.labels(self.model_name, label, size).inc(count)

    def set_batch_acceptance(self, expected: dict[tuple[str, str], float]) -> None:
        for (temperature_bucket, budget), value in expected.items():
            self.batch_acceptance.labels(self.model_name, temperature_bucket, budget).set(value)

    def record_request(self, *, prompt_tokens: int, output_tokens: int, finish_reason: str,
                       ttft_s: float | None, e2e_s: float, first_to_last_s: float | None) -> None:
        name = self.model_name
        self.prompt_tokens.labels(name).inc(prompt_tokens)
        self.generation_tokens.labels(name).inc(output_tokens)
        self.request_success.labels(name, finish_reason).inc()
        if ttft_s is not None:
            self.ttft.labels(name).observe(ttft_s)
        if first_to_last_s is not None and output_tokens > 1:
            self.tpot.labels(name).observe(first_to_last_s / (output_tokens - 1))
        if finish_reason != "abort":
            self.e2e.labels(name).observe(e2e_s)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
