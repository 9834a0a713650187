"""Benchmark arithmetic: per-request measurements -> one row per (tree budget, concurrency), the
comparisons with `ar`, and the recommendation. No I/O here.

Latency statistics follow `vllm bench serve`: TTFT per request; TPOT = (E2E - TTFT) / (output
tokens - 1) per request with more than one token; ITL = every gap between two streamed chunks,
all requests pooled; mean / median / std (population) / p99 in milliseconds, 0 when there is no
sample. Tokens/s of a request = its output tokens / its E2E latency; the recommendation ranks
budgets by the median of that.
"""
from __future__ import annotations

import math
from dataclasses import astuple, dataclass, field
from typing import Iterable

from ddtree.tree_shape import AR, CHAIN, TreeShape

PERCENTILES = (99,)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestOutput:
    """What one request measured. Times are seconds from the moment the request was sent."""

    index: int  # the prompt's position in the benchmark's prompt list
    success: bool = False
    error: str = ""
    text: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    e2el_s: float = 0.0
    decode_rounds: int | None = None  # engine rounds, when the engine or the response told us
    accepted_tokens: int | None = None  # sum of the rounds' acceptance lengths (bonus token counted)
    budget_rounds: dict[str, int] | None = None  # decode rounds per tree budget, when the response said

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.e2el_s if self.e2el_s > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float | None:
        """The tokens after the first over the time from the first to the last: what a tree budget
        changes (the prefill before the first token is the same whatever the budget); None with
        fewer than two tokens."""
        span = self.e2el_s - self.ttft_s
        return (self.output_tokens - 1) / span if self.output_tokens > 1 and span > 0 else None


@dataclass
class ServerCounters:
    """Deltas of a server's /metrics over one budget's run: vLLM's spec-decode counters, and the
    sums and counts of its time-to-first-token and end-to-end latency histograms: the server's own
    view of a request, from its admission (ddtree: the request read, checked and tokenized) to its
    first and its last token leaving the engine, beside the client's view, which adds the HTTP
    path both ways."""

    drafts: float = 0.0
    accepted_tokens: float = 0.0
    ttft_sum_s: float = 0.0
    ttft_count: float = 0.0
    e2el_sum_s: float = 0.0
    e2el_count: float = 0.0

    def __sub__(self, before: "ServerCounters") -> "ServerCounters":
        return ServerCounters(*(a - b for a, b in zip(astuple(self), astuple(before))))

    def server_latency_ms(self) -> dict:
        """server_mean_ttft_ms and server_mean_e2el_ms (None where the server keeps no histogram)."""
        return {"server_mean_ttft_ms": self.ttft_sum_s / self.ttft_count * 1e3 if self.ttft_count else None,
                "server_mean_e2el_ms": self.e2el_sum_s / self.e2el_count * 1e3 if self.e2el_count else None}


# -- statistics ---------------------------------------------------------------------------------


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's default)."""
    data = sorted(values)
    if not data:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    rank = (len(data) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (rank - low)


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def median(values: list[float]) -> float:
    return percentile(values, 50) if values else 0.0


def std(values: list[float]) -> float:
    """Population standard deviation (numpy's default, ddof=0)."""
    if not values:
        return 0.0
    m = mean(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / len(values))


def latency_stats(name: str, seconds: list[float]) -> dict[str, float]:
    """{mean,median,std,p99}_{name}_ms as `vllm bench serve` names them."""
    ms = [s * 1000.0 for s in seconds]
    stats = {f"mean_{name}_ms": mean(ms), f"median_{name}_ms": median(ms), f"std_{name}_ms": std(ms)}
    for p in PERCENTILES:
        stats[f"p{p}_{name}_ms"] = percentile(ms, p) if ms else 0.0
    return stats


# -- one row ------------------------------------------------------------------------------------


def summarize(
    outputs: list[RequestOutput],
    duration_s: float,
    tree_budget: TreeShape,
    concurrency: int,
    counters: ServerCounters | None = None,
) -> dict:
    """One result row for a budget at a concurrency. Acceptance comes from the requests' own
    statistics when every request has them, else from the /metrics counter deltas, else (for `ar`
    only) from its definition: one token per target forward after the prefill."""
    done = [o for o in outputs if o.success]
    failed = [o for o in outputs if not o.success]
    total_in = sum(o.prompt_tokens for o in done)
    total_out = sum(o.output_tokens for o in done)
    tps = [o.tokens_per_second for o in done]
    row: dict = {
        "tree_budget": tree_budget,
        "concurrency": concurrency,
        "completed": len(done),
        "failed": len(failed),
        "errors": sorted({o.error for o in failed})[:5],
        "duration": duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) / duration_s if duration_s > 0 else 0.0,
        "output_throughput": total_out / duration_s if duration_s > 0 else 0.0,
        "total_token_throughput": (total_in + total_out) / duration_s if duration_s > 0 else 0.0,
        "mean_tokens_per_second": mean(tps),
        "median_tokens_per_second": median(tps),
    }
    row.update(latency_stats("ttft", [o.ttft_s for o in done]))
    tpot = [(o.e2el_s - o.ttft_s) / (o.output_tokens - 1) for o in done if o.output_tokens > 1]
    row.update(latency_stats("tpot", tpot))
    row.update(latency_stats("itl", [gap for o in done for gap in o.itl_s]))
    row.update(latency_stats("e2el", [o.e2el_s for o in done]))
    row.update(acceptance(done, tree_budget, counters))
    if counters is not None:
        row.update(counters.server_latency_ms())
    row["budget_rounds"] = budget_rounds(done)
    return row


def budget_rounds(done: list[RequestOutput]) -> dict[str, int] | None:
    """Decode rounds per tree budget over the requests (a server that chose budgets per round ran
    several), most first; None when no response said."""
    total: dict[str, int] = {}
    for o in done:
        for budget, rounds in (o.budget_rounds or {}).items():
            total[budget] = total.get(budget, 0) + rounds
    return dict(sorted(total.items(), key=lambda item: -item[1])) if total else None


def acceptance(done: list[RequestOutput], tree_budget: TreeShape, counters: ServerCounters | None) -> dict:
    """mean_acceptance_length, decode_rounds (mean per request) and where they came from."""
    empty = {"mean_acceptance_length": None, "decode_rounds": None, "acceptance_source": None}
    if not done:
        return empty
    if all(o.decode_rounds is not None and o.accepted_tokens is not None for o in done):
        rounds = sum(o.decode_rounds for o in done)
        accepted = sum(o.accepted_tokens for o in done)
        return {"mean_acceptance_length": accepted / rounds if rounds else None,
                "decode_rounds": rounds / len(done), "acceptance_source": "responses"}
    if counters is not None and counters.drafts > 0:
        return {"mean_acceptance_length": 1.0 + counters.accepted_tokens / counters.drafts,
                "decode_rounds": counters.drafts / len(done), "acceptance_source": "metrics"}
    if not tree_budget.drafts:
        return {"mean_acceptance_length": 1.0, "decode_rounds": mean([max(o.output_tokens - 1, 0) for o in done]),
                "acceptance_source": "definition"}
    return empty


# -- comparisons --------------------------------------------------------------------------------


def parity(texts: dict[int, str], reference: dict[int, str]) -> float | None:
    """Fraction of prompts answered in both runs whose texts are identical (None: none in common)."""
    common = texts.keys() & reference.keys()
    if not common:
        return None
    return sum(texts[i] == reference[i] for i in common) / len(common)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def mismatches(texts: dict[int, str], reference: dict[int, str]) -> list[int]:
    return sorted(i for i in texts.keys() & reference.keys() if texts[i] != reference[i])


def compare_with_ar(rows: list[dict], texts: list[dict[int, str]], greedy: bool,
                    prompt_names: list[str] | None = None) -> None:
    """Add speedup_vs_ar, throughput_speedup_vs_ar, parity_vs_ar, parity_ok and parity_mismatches
    (the prompts whose text differs, named by `prompt_names` or by index) to each row, in place.

    `texts[i]` holds row i's output text per prompt index (successful requests only). Parity is
    measured at temperature 0 only (`greedy`); a sampled run's texts legitimately differ.
    """
    ar_index = {row["concurrency"]: i for i, row in enumerate(rows) if row["tree_budget"] == AR}
    for i, row in enumerate(rows):
        j = ar_index.get(row["concurrency"])
        ar_row = rows[j] if j is not None else None
        row["speedup_vs_ar"] = ratio(row["median_tokens_per_second"], ar_row and ar_row["median_tokens_per_second"])
        row["throughput_speedup_vs_ar"] = ratio(row["output_throughput"], ar_row and ar_row["output_throughput"])
        row["parity_vs_ar"] = parity(texts[i], texts[j]) if greedy and j is not None else None
        row["parity_ok"] = None if row["parity_vs_ar"] is None else row["parity_vs_ar"] == 1.0
        differ = mismatches(texts[i], texts[j]) if row["parity_ok"] is False else []
        row["parity_mismatches"] = [prompt_names[k] if prompt_names else k for k in differ]


def parity_failures(rows: list[dict]) -> list[dict]:
    return [row for row in rows if row.get("parity_ok") is False]


def recommend(rows: list[dict]) -> list[dict]:
    """Per concurrency level: the budget with the best median tokens/s and its margins (ratios) over
    `chain` and `ar` (None when that budget was not run). Ties go to the budget run first."""
    by_concurrency: dict[int, list[dict]] = {}
    for row in rows:
        if row["completed"] > 0:
            by_concurrency.setdefault(row["concurrency"], []).append(row)
    picks = []
    for concurrency in sorted(by_concurrency):
        group = by_concurrency[concurrency]
        best = max(group, key=lambda r: r["median_tokens_per_second"])  # max keeps the first of equals
        named = {r["tree_budget"]: r["median_tokens_per_second"] for r in group}
        picks.append({
            "concurrency": concurrency,
            "tree_budget": best["tree_budget"],
            "median_tokens_per_second": best["median_tokens_per_second"],
            "margin_over_chain": ratio(best["median_tokens_per_second"], named.get(CHAIN)),
            "margin_over_ar": ratio(best["median_tokens_per_second"], named.get(AR)),
        })
    return picks


def _margin_text(value: float | None, name: str) -> str:
    if value is None:
        return f"{name} not run"
    return f"{value:.2f}x {name} ({(value - 1) * 100:+.1f}%)"


def recommendation_line(pick: dict) -> str:
    """One line: 'recommended tree budget at concurrency 1: 64 (median 123.4 tok/s; 1.23x chain (+23.0%), ...)'."""
    return (f"recommended tree budget at concurrency {pick['concurrency']}: {pick['tree_budget']} "
            f"(median {pick['median_tokens_per_second']:.1f} tok/s; "
            f"{_margin_text(pick['margin_over_chain'], 'chain')}, {_margin_text(pick['margin_over_ar'], 'ar')})")


REDUCED_PRECISION = ("bfloat16", "float16")


def parity_warning(row: dict, dtype: str | None = None) -> str:
    """The warning for a row whose greedy texts differ from ar's. In bf16 / fp16 a tree verify rounds
    differently from one-token steps, so near-tied tokens can flip: worth saying, but not a failure
    until float32 shows it too."""
    differ = ", ".join(map(str, row.get("parity_mismatches", [])[:10]))
    matched = (f"tree budget {row['tree_budget']} at concurrency {row['concurrency']} matched ar's text on "
               f"{row['parity_vs_ar'] * 100:.1f}% of prompts at temperature 0 (differs on: {differ})")
    if dtype in REDUCED_PRECISION:
        return (f"parity in {dtype}: {matched}; expected in {dtype}, where a tree verify rounds differently from "
                "one token at a time and near-tied tokens can differ; rerun with --dtype float32 to check "
                "losslessness (below 100% there is a bug)")
    return (f"PARITY FAILURE: {matched}; lossless decoding gives 100% unless the target's top two logits tie to "
            "rounding error")


def failure_warning(row: dict) -> str:
    reasons = "; ".join(row["errors"]) or "unknown error"
    return (f"{row['failed']} of {row['completed'] + row['failed']} requests failed for tree budget "
            f"{row['tree_budget']} at concurrency {row['concurrency']}: {reasons}")


def finish(rows: list[dict], texts: list[dict[int, str]], greedy: bool, prompt_names: list[str] | None = None,
           dtype: str | None = None) -> dict:
    """Comparisons, recommendations and warnings for a finished sweep: the results file's body.
    dtype: the model's ("bfloat16", ...; None when unknown), which decides how a parity gap reads."""
    compare_with_ar(rows, texts, greedy, prompt_names)
    picks = recommend(rows)
    warnings = ([parity_warning(r, dtype) for r in parity_failures(rows)]
                + [failure_warning(r) for r in rows if r["failed"]])
    measured = [r["parity_ok"] for r in rows if r["parity_ok"] is not None]
    return {
        "results": rows,
        "recommendation": picks[0] if picks else None,
        "recommendations": picks,
        "parity_ok": all(measured) if measured else None,
        "warnings": warnings,
    }
