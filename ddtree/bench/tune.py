"""Choose the tree budget by measurement on this machine.

`ddtree tune` runs an offline sweep and writes the winner per concurrency level to a small JSON
file, by default `<draft_dir>/ddtree_tune.json`. `resolve_auto_budget` (behind
`ddtree serve --tree-budget auto`) reads that file when it was made on this device for this
target/drafter pair, and otherwise runs a calibration of at most `time_limit_s` seconds;
`resolve_context_budgets` likewise takes the file's picks per context bucket, or measures them
(`calibrate_context_caps`) when asked to.

With `--max-num-seqs N` the file also holds the batched engine's round costs for 1..N rows at
`ROUND_COST_CONTEXTS` (ddtree.round_costs), which `resolve_round_costs` (behind the adaptive batch
budget of `ddtree serve` without --tree-budget) reads instead of timing them at start-up
(`startup_round_cost_contexts`).
"""
from __future__ import annotations

import datetime as dt
import json
import random
import time
from pathlib import Path
from typing import Callable

from ddtree.bench.datasets import stdlib_prompts
from ddtree.bench.machine import device_name, git_revision, model_fingerprint
from ddtree.bench.report import median, recommend, recommendation_line
from ddtree.bench.runner import OfflineBackend, SweepSettings
from ddtree.budget_selector import CONTEXT_BUCKETS, context_bucket
from ddtree.config import DDTreeError, SamplingParams, parse_tree_budget
from ddtree.round_costs import STARTUP_CONTEXT, RoundCostTable, measure_round_costs, timed_contexts
from ddtree.temperature_buckets import BUCKET_NAMES, BUCKETS, GREEDY, SAMPLED_BUCKETS
from ddtree.tree_shape import AR, CHAIN, SWEEP_BEST, TreeShape, shape_json

TUNE_FILE = "ddtree_tune.json"
TUNE_FORMAT = "ddtree-tune/1"
CALIBRATION_BUDGETS = [AR, CHAIN, *map(TreeShape.best, SWEEP_BEST)]
CALIBRATION_MAX_TOKENS = 64
CALIBRATION_WARMUP_TOKENS = 8
ELIMINATE_BELOW = 0.5  # a budget this far below the leader's median tokens/s cannot be noise
CALIBRATION_PROMPT_TOKENS = 32  # length of the synthetic prompts used when the target has no tokenizer
CALIBRATION_LONG_PROMPTS = 4  # distinct prompts of a context length calibration (each costs a long prefill)
# Committed tokens per row at which tune times batched rounds (each cut to the context limit; a
# context whose rows the KV cache cannot hold is left out). The batch's budget choice prices a round
# at the batch's mean context, between these by linear interpolation and past the longest along the
# last segment's slope: timed at 64 and 1024 alone, a 32k-token batch was priced from a difference
# its attention barely shows at 1024 tokens, 30x extrapolated.
ROUND_COST_CONTEXTS = (64, 1024, 8192, 32768)
# `serve --tree-budget auto` without a tune file's contexts: seconds of greedy measurement after the
# prompts of each long context (`calibrate_context_caps`), on top of each budget's warm-up request.
STARTUP_CONTEXT_SECONDS = 10.0
# The long context start-up times batched rounds at on a GPU besides STARTUP_CONTEXT, without a
# tune file's round costs (`startup_round_cost_contexts`): its rows' prefills, shared by the
# budgets, are 1 + 2 + 4 + ... + max_num_seqs rows of it (15 at 8 rows: 122880 tokens).
STARTUP_LONG_CONTEXT = 8192


def tune_file_path(draft_dir: str | Path) -> Path:
    return Path(draft_dir) / TUNE_FILE


def identity(llm) -> dict:
    """What a tune result is only valid for: the device, the dtype and the exact model pair."""
    return {
        "device": device_name(llm.device),
        "dtype": str(llm.dtype).replace("torch.", ""),
        "target_fingerprint": model_fingerprint(llm.target_path),
        "draft_fingerprint": model_fingerprint(llm.draft_path),
    }


def tune_record(llm, report: dict, settings: SweepSettings, dataset: str, num_prompts: int) -> dict:
    """The tune file's contents from a finished offline sweep (`report` from `report.finish`)."""
    tokens_per_second: dict[str, dict[str, float]] = {}
    for row in report["results"]:
        level = tokens_per_second.setdefault(str(row["concurrency"]), {})
        level[str(row["tree_budget"])] = row["median_tokens_per_second"]
    return {
        "format": TUNE_FORMAT,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        **identity(llm),
        "target": llm.target_name,
        "draft": llm.draft_name,
        "git_revision": git_revision(),
        "settings": {"dataset": dataset, "num_prompts": num_prompts, "max_tokens": settings.max_tokens,
                     "temperature": settings.temperature, "tree_budgets": settings.tree_budgets,
                     "concurrency": settings.concurrencies, "warmup": settings.warmup},
        "recommendations": report["recommendations"],
        "median_tokens_per_second": tokens_per_second,
        "parity_ok": report["parity_ok"],
    }


def write_tune_file(record: dict, path: str | Path) -> Path:
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(record, indent=2, default=shape_json) + "\n")
        tmp.replace(path)
    except OSError as exc:
        raise DDTreeError(f"cannot write the tune file {path}: {exc.strerror or exc} (pass --output)",
                          "output") from None
    return path


def read_tune_file(path: str | Path) -> dict:
    """Load and check a tune file; DDTreeError names what is wrong with it."""
    path = Path(path)
    try:
        record = json.loads(path.read_text())
    except OSError as exc:
        raise DDTreeError(f"cannot read the tune file {path}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise DDTreeError(f"tune file {path} is not valid JSON") from None
    if not isinstance(record, dict) or record.get("format") != TUNE_FORMAT:
        raise DDTreeError(f"tune file {path} is not a {TUNE_FORMAT} file")
    picks = record.get("recommendations")
    if not isinstance(picks, list) or not picks:
        raise DDTreeError(f"tune file {path} holds no recommendation")
    for pick in picks:
        if not isinstance(pick, dict) or not isinstance(pick.get("concurrency"), int):
            raise DDTreeError(f"tune file {path}: a recommendation lacks its concurrency")
        pick["tree_budget"] = parse_tree_budget(pick.get("tree_budget"))
    by_temperature = record.get("by_temperature", {})  # absent from files made before the buckets
    if not isinstance(by_temperature, dict):
        raise DDTreeError(f"tune file {path}: by_temperature is not an object")
    for kind, entries in (("temperature", by_temperature), ("context", record.get("by_context", {}))):
        if not isinstance(entries, dict):
            raise DDTreeError(f"tune file {path}: by_{kind} is not an object")
        for name, entry in entries.items():
            if not isinstance(entry, dict) or "tree_budget" not in entry:
                raise DDTreeError(f"tune file {path}: {kind} bucket {name!r} lacks its tree_budget")
            entry["tree_budget"] = parse_tree_budget(entry["tree_budget"])
    return record


def mismatch(record: dict, llm) -> str | None:
    """Why a tune file does not apply to `llm` (None when it does)."""
    mine = identity(llm)
    for key, value in mine.items():
        if record.get(key) != value:
            return f"{key.replace('_', ' ')} differs (file: {record.get(key)!r}, here: {value!r})"
    return None


def pick_for_concurrency(record: dict, concurrency: int = 1) -> dict:
    """The recommendation measured at `concurrency`, else at the nearest level below it, else the lowest."""
    picks = sorted(record["recommendations"], key=lambda p: p["concurrency"])
    below = [p for p in picks if p["concurrency"] <= concurrency]
    return below[-1] if below else picks[0]


def bucket_picks(record: dict, concurrency: int = 1) -> dict[str, TreeShape]:
    """The budget per temperature bucket: the file's pick where it measured the bucket, else (files
    made before the buckets) its greedy pick at `concurrency`."""
    greedy = pick_for_concurrency(record, concurrency)["tree_budget"]
    measured = record.get("by_temperature", {})
    picks = {name: measured[name]["tree_budget"] if name in measured else greedy for name in BUCKET_NAMES}
    if measured.get(GREEDY.name, {}).get("source") != "calibration":
        picks[GREEDY.name] = greedy  # a greedy sweep at `concurrency` knows best about greedy traffic
    return picks


def sweep_bucket_entry(report: dict, temperature: float) -> dict | None:
    """The bucket entry of the tune sweep's own temperature, from its concurrency-1 rows."""
    rows = [r for r in report["results"] if r["concurrency"] == 1 and r["completed"]]
    picks = recommend(rows)
    if not picks:
        return None
    return {"temperature": temperature, "tree_budget": picks[0]["tree_budget"], "source": "sweep",
            "median_tokens_per_second": {str(r["tree_budget"]): r["median_tokens_per_second"] for r in rows},
            "mean_acceptance_length": {str(r["tree_budget"]): r.get("mean_acceptance_length") for r in rows}}


def measure_buckets(llm, seconds_per_bucket: float, budgets: list[TreeShape] | None = None,
                    skip: tuple[str, ...] = (), log: Callable[[str], None] = print,
                    untimed_warmups: bool = True) -> dict[str, dict]:
    """Calibrate each bucket (at its `measured_at` temperature) for `seconds_per_bucket`; buckets
    named in `skip` (the one the sweep measured) are left out. untimed_warmups: `calibrate`'s."""
    entries = {}
    for bucket in (b for b in BUCKETS if b.name not in skip):
        budget, summary = calibrate(llm, seconds_per_bucket, log, budgets, temperature=bucket.measured_at,
                                    untimed_warmups=untimed_warmups)
        if budget is None:
            continue
        entries[bucket.name] = {"temperature": bucket.measured_at, "tree_budget": budget, "source": "calibration",
                                "seconds": round(summary["seconds"], 1),
                                "median_tokens_per_second": summary["median_tokens_per_second"],
                                "mean_acceptance_length": summary["mean_acceptance_length"]}
        log(f"tree budget auto: bucket {bucket.name} (T = {bucket.measured_at:g}): {budget}; median tok/s "
            + ", ".join(f"{b}: {t:.1f}" for b, t in summary["median_tokens_per_second"].items()))
    return entries


def tune_contexts(llm, max_tokens: int) -> list[int]:
    """The context lengths `ddtree tune` measures by default: the upper bound of each context
    bucket past the first (the sweep's own prompts are short) that fits with `max_tokens`."""
    return [upper for _, upper in CONTEXT_BUCKETS[1:] if upper + max_tokens <= llm.max_model_len]


def measure_contexts(llm, seconds_per_context: float, contexts: list[int], budgets: list[TreeShape] | None = None,
                     log: Callable[[str], None] = print) -> dict[str, dict]:
    """Calibrate greedy decoding after prompts of each length in `contexts` for
    `seconds_per_context` -> entries by context bucket (`budget_selector.context_bucket`)."""
    entries = {}
    for tokens in contexts:
        budget, summary = calibrate(llm, seconds_per_context, log, budgets, prompt_tokens=tokens,
                                    untimed_warmups=True)
        if budget is None:
            log(f"tree budget auto: context {tokens}: nothing measured in {seconds_per_context:g} s")
            continue
        entries[context_bucket(tokens)] = {"context_tokens": summary["prompt_tokens"], "tree_budget": budget,
                                           "source": "calibration", "seconds": round(summary["seconds"], 1),
                                           "median_tokens_per_second": summary["median_tokens_per_second"],
                                           "mean_acceptance_length": summary["mean_acceptance_length"]}
        log(f"tree budget auto: context {summary['prompt_tokens']} tokens ({context_bucket(tokens)}): {budget}; "
            "median tok/s " + ", ".join(f"{b}: {t:.1f}" for b, t in summary["median_tokens_per_second"].items()))
    return entries


def context_picks(record: dict) -> dict[str, TreeShape]:
    """The budget per context bucket a tune file measured (empty for files without `by_context`)."""
    return {name: entry["tree_budget"] for name, entry in record.get("by_context", {}).items()}


# -- calibration ------------------------------------------------------------------------------------


def _calibration_prompts(llm, max_tokens: int, length: int | None = None) -> list[list[int]]:
    """Token ids of the stdlib prompts cut to fit the context; synthetic ids if there is no tokenizer.
    With `length` (capped by the room): CALIBRATION_LONG_PROMPTS prompts of exactly that many tokens,
    each the stdlib prompts one after another from a different first one."""
    room = llm.max_model_len - max_tokens
    if llm.tokenizer is None:
        rng = random.Random(0)
        size = min(length or CALIBRATION_PROMPT_TOKENS, room)
        return [[rng.randrange(llm.vocab_size) for _ in range(size)] for _ in range(16)]
    prompts = [ids for ids in (llm.encode(p.prompt) for p in stdlib_prompts() if p.prompt) if ids]
    if length is None:
        return [ids[:room] for ids in prompts]
    size = min(length, room)
    longer = []
    for first in range(min(CALIBRATION_LONG_PROMPTS, len(prompts))):
        ids: list[int] = []
        k = first
        while len(ids) < size:
            ids += prompts[k % len(prompts)]
            k += 1
        longer.append(ids[:size])
    return longer


def calibrate(llm, time_limit_s: float = 60.0, log: Callable[[str], None] = print,
              budgets: list[TreeShape] | None = None, temperature: float = 0.0,
              prompt_tokens: int | None = None, untimed_warmups: bool = False) -> tuple[TreeShape | None, dict]:
    """Measure budgets on this machine within `time_limit_s` seconds -> (the budget with the best
    median decode tokens/s, `RequestOutput.decode_tokens_per_second`, or None if nothing was
    measured; a summary). prompt_tokens: calibrate after
    prompts of that many tokens (a context length) instead of the stdlib prompts as they are.

    First an ascending pass: each budget (ar, chain, then trees from small to large) runs one short
    untimed request (graph capture, caches) and one timed one; the trees stop growing once one runs
    below half the best tokens/s so far, as larger trees only cost more per round. The first budget
    that drafts and the first that does not are measured even past the deadline (a machine's first
    start may spend the whole bound compiling), so that `ar` is never picked unopposed. Then the time left
    goes to more prompts for the budgets still in the race, the order rotating so that slow drifts hit
    all alike; after each turn a budget below half the leader's median (two samples or more) drops
    out. A request still running at the deadline stops after its round in progress and is not counted.
    With `untimed_warmups` (`ddtree tune`'s calibrations) each budget's warm-up request runs outside
    the time limit, which then counts measurement only: the first request after a long prompt may
    spend longer than the limit compiling its kernels. The server's start-up calibration keeps them
    inside its bound.
    """
    budgets = sorted(budgets or CALIBRATION_BUDGETS, key=lambda b: (b.builds_tree, b.budget))
    start = time.perf_counter()
    deadline = start + time_limit_s
    max_tokens = max(1, min(CALIBRATION_MAX_TOKENS, llm.max_model_len // 4))
    # a fixed seed at T > 0: every budget samples the same way, so the budgets differ only in speed
    seed = 0 if temperature > 0 else None
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
    warmup_params = SamplingParams(max_tokens=min(CALIBRATION_WARMUP_TOKENS, max_tokens), temperature=temperature,
                                   seed=seed)
    backend = OfflineBackend(llm)
    backend.prompt_ids = dict(enumerate(p for p in _calibration_prompts(llm, max_tokens, prompt_tokens) if p))
    n_prompts = len(backend.prompt_ids)
    samples: dict[TreeShape, list[float]] = {b: [] for b in budgets}
    accepted: dict[TreeShape, list[int]] = {b: [0, 0] for b in budgets}  # [accepted tokens, rounds]
    skipped: dict[str, str] = {}

    def timed(index: int, budget: TreeShape, until: float | None) -> bool:
        out = backend.generate_one(index % n_prompts, budget, params, time.perf_counter(), until)
        if out.success and out.decode_tokens_per_second is not None:
            # Decode tokens/s, as the server's own selector measures: after a long prompt the
            # prefill, the same for every budget, would otherwise be most of a request's time
            # (at 32k tokens 1.67 s of 1.7 at Qwen3-8B shape on an H200) and hide the budgets' rates.
            samples[budget].append(out.decode_tokens_per_second)
            accepted[budget][0] += out.accepted_tokens or 0
            accepted[budget][1] += out.decode_rounds or 0
        return out.success

    def first_of_its_kind(budget: TreeShape) -> bool:
        """No budget that drafts as it does (or does not) has a sample yet: one that drafts and one
        that does not are measured past the deadline, so that a first start whose compiles take the
        whole bound still compares speculation with plain decoding (on a fresh H100 its 30 s had
        measured `ar` alone and served it)."""
        return not any(samples[b] for b in budgets if b.drafts == budget.drafts)

    racing: list[TreeShape] = []
    for k, budget in enumerate(budgets):
        needed = first_of_its_kind(budget)
        if time.perf_counter() >= deadline and not needed:
            skipped[str(budget)] = "out of time"
            continue
        until = None if needed else deadline
        warm_start = time.perf_counter()
        warm = backend.generate_one(0, budget, warmup_params, warm_start, None if untimed_warmups else until)
        if untimed_warmups:
            deadline += time.perf_counter() - warm_start
        if not (warm.success and timed(0, budget, until)):
            if time.perf_counter() >= deadline:  # stopped at the deadline: a budget still needed may follow
                skipped[str(budget)] = "out of time"
                continue
            skipped.update({str(budget): "failed", **{str(b): f"not run: {budget} failed" for b in budgets[k + 1:]}})
            break
        racing.append(budget)
        best = max((median(samples[b]) for b in racing if samples[b]), default=0.0)
        if budget.builds_tree and samples[budget] and samples[budget][0] < ELIMINATE_BELOW * best:
            skipped.update({str(b): f"tree {budget} already ran below half the best" for b in budgets[k + 1:]})
            break
    turn = 1
    while racing and time.perf_counter() < deadline:
        shift = turn % len(racing)
        for budget in racing[shift:] + racing[:shift]:
            if time.perf_counter() >= deadline:
                break
            timed(turn, budget, deadline)
        racing = _survivors(racing, samples)
        turn += 1
    rows = [{"tree_budget": b, "concurrency": 1, "completed": len(s), "median_tokens_per_second": median(s)}
            for b, s in samples.items() if s]
    picks = recommend(rows)
    summary = {"seconds": time.perf_counter() - start, "max_tokens": max_tokens, "temperature": temperature,
               "prompt_tokens": max(map(len, backend.prompt_ids.values())),
               "median_tokens_per_second": {str(r["tree_budget"]): r["median_tokens_per_second"] for r in rows},
               "mean_acceptance_length": {str(b): (a / n if b.drafts else 1.0) for b, (a, n) in accepted.items()
                                          if samples[b] and (n or not b.drafts)},
               "samples": {str(r["tree_budget"]): r["completed"] for r in rows},
               "skipped": skipped,
               "recommendation": picks[0] if picks else None}
    return (picks[0]["tree_budget"] if picks else None), summary


def _survivors(racing: list[TreeShape], samples: dict[TreeShape, list[float]]) -> list[TreeShape]:
    """Budgets still worth measuring: those without two samples yet, or within half the leader's median."""
    measured = {b: median(samples[b]) for b in racing if len(samples[b]) >= 2}
    if not measured:
        return racing
    leader = max(measured.values())
    return [b for b in racing if b not in measured or measured[b] >= ELIMINATE_BELOW * leader]


def _by_reason(skipped: dict[str, str]) -> dict[str, list[str]]:
    grouped: dict[str, list[str]] = {}
    for budget, why in skipped.items():
        grouped.setdefault(why, []).append(budget)
    return grouped


def resolve_auto_budget(llm, draft_dir: str | Path | None, log: Callable[[str], None] = print,
                        time_limit_s: float = 60.0, concurrency: int = 1) -> TreeShape:
    """The greedy bucket's budget from `resolve_auto_budgets`."""
    return resolve_auto_budgets(llm, draft_dir, log, time_limit_s, concurrency)[GREEDY.name]


def resolve_auto_budgets(llm, draft_dir: str | Path | None, log: Callable[[str], None] = print,
                         time_limit_s: float = 60.0, concurrency: int = 1) -> dict[str, TreeShape]:
    """The tree budget per temperature bucket for `--tree-budget auto`: from
    `<draft_dir>/ddtree_tune.json` when it was measured on this device for this model pair, else from
    a calibration of at most `time_limit_s` (half for greedy, half shared by the sampled buckets;
    a request in progress at a deadline, its graph capture included, runs to the end of its round).
    The sampled buckets race the budgets the greedy calibration measured, whose graphs it captured:
    racing every budget, each bucket spent its share warming up the trees greedy traffic had no time
    for (on an H100 at Qwen3-8B shape a 511- or 1023-node tree's first capture took 23-29 s, and
    the start-up 149 s; benchmarks/results/startup_time_h100_qwen3_8b_agreeing.json)."""
    if llm.drafter is None:
        log("tree budget auto: no drafter loaded, using 'ar'")
        return dict.fromkeys(BUCKET_NAMES, AR)
    path = tune_file_path(draft_dir if draft_dir is not None else llm.draft_path)
    if path.is_file():
        record, reason = _matching_record(llm, path)
        if reason is None:
            pick = pick_for_concurrency(record, concurrency)
            picks = bucket_picks(record, concurrency)
            log(f"tree budget auto: {pick['tree_budget']} from {path} (tuned {record.get('created', '?')}); "
                + recommendation_line(pick))
            log("tree budget auto by temperature: " + _picks_line(picks)
                + ("" if record.get("by_temperature") else " (the file measured greedy traffic only)"))
            return picks
        log(f"tree budget auto: ignoring {path}: {reason}")
    else:
        log(f"tree budget auto: no tune file at {path} (run `ddtree tune` to make one)")
    log(f"tree budget auto: calibrating for at most {time_limit_s:g} s")
    budget, summary = calibrate(llm, time_limit_s / 2, log)
    measured = ", ".join(f"{b}: {tps:.1f}" for b, tps in summary["median_tokens_per_second"].items())
    log(f"tree budget auto: calibration took {summary['seconds']:.1f} s; median tok/s {measured or 'none'}"
        + "".join(f"; not measured: {', '.join(bs)} ({why})" for why, bs in _by_reason(summary["skipped"]).items()))
    if budget is None:
        log(f"tree budget auto: the calibration measured nothing in {time_limit_s / 2:g} s; "
            f"using the default budget {llm.default_budget}")
        budget = llm.default_budget
    else:
        log("tree budget auto: " + recommendation_line(summary["recommendation"]))
    raced = [b for b in CALIBRATION_BUDGETS if str(b) in summary["median_tokens_per_second"]]
    sampled = measure_buckets(llm, time_limit_s / 2 / len(SAMPLED_BUCKETS), raced, skip=(GREEDY.name,), log=log,
                              untimed_warmups=False) if len(raced) > 1 else {}
    picks = {GREEDY.name: budget, **{name: entry["tree_budget"] for name, entry in sampled.items()}}
    picks = {name: picks.get(name, budget) for name in BUCKET_NAMES}
    log("tree budget auto by temperature: " + _picks_line(picks))
    return picks


def tune_round_cost_contexts(llm) -> list[int]:
    """The contexts tune times batched rounds at: ROUND_COST_CONTEXTS, each cut to what the context
    limit leaves room for."""
    return timed_contexts(ROUND_COST_CONTEXTS, llm.max_model_len, llm.block_size)


def measure_tune_round_costs(llm, budgets: list[TreeShape], log: Callable[[str], None] = print) -> list[dict]:
    """The tune file's `round_costs`: batched rounds of 1..max_num_seqs rows timed at
    `tune_round_cost_contexts` (a context whose rows the KV cache cannot hold left out)."""
    return measure_round_costs(_batch_engine(llm, budgets), budgets, contexts=tune_round_cost_contexts(llm),
                               log=log).to_json()


def resolve_round_costs(llm, budgets: list[TreeShape], log: Callable[[str], None] = print) -> RoundCostTable:
    """The round costs of the adaptive batch budget: the tune file's (beside the drafter) when
    `ddtree tune --max-num-seqs` measured them on this device for this pair with at least
    max_num_seqs rows, else measured now at `startup_round_cost_contexts` (a few seconds on a CPU)."""
    path = tune_file_path(llm.draft_path)
    reason = f"no tune file at {path}"
    if path.is_file():
        record, reason = _matching_record(llm, path)
        if reason is None and "round_costs" not in record:
            reason = f"{path} holds no round costs (`ddtree tune --max-num-seqs N` measures them)"
        if reason is None:
            try:
                table = RoundCostTable.from_json(record["round_costs"])
            except ValueError as exc:
                reason = f"{path}: {exc}"
            else:
                if table.max_rows >= llm.max_num_seqs:
                    log(f"batch budget: round costs from {path} (tuned {record.get('created', '?')}): "
                        f"{table.summary()}")
                    return table
                reason = f"{path} measured round costs up to {table.max_rows} rows, not {llm.max_num_seqs}"
    start = time.perf_counter()
    contexts = startup_round_cost_contexts(llm)
    table = measure_round_costs(_batch_engine(llm, budgets), budgets, contexts=contexts)
    timed = sorted({point.context for point in table.points})
    untimed = "".join(f" (context {c}: not timed, the KV cache holds too few such rows)" for c in contexts
                      if c not in timed)
    log(f"batch budget: {reason}; measured round costs for 1..{llm.max_num_seqs} rows at "
        f"{', '.join(map(str, budgets))}, contexts {', '.join(map(str, timed))}{untimed}, in "
        f"{time.perf_counter() - start:.1f} s: {table.summary()}")
    return table


def startup_round_cost_contexts(llm) -> list[int]:
    """The contexts start-up times batched rounds at when no tune file holds them: STARTUP_CONTEXT,
    and on a GPU STARTUP_LONG_CONTEXT too (cut to the context limit), so that a longer batch is
    priced along the slope between the two, its attention's growth, rather than at a short
    context's cost. (The CPU's start-up keeps the one short context: its rounds are slow to time.)"""
    contexts = [STARTUP_CONTEXT] + ([STARTUP_LONG_CONTEXT] if llm.device.type == "cuda" else [])
    return timed_contexts(contexts, llm.max_model_len, llm.block_size)


def _batch_engine(llm, budgets: list[TreeShape]):
    """The LLM's batched engine, made to hold every budget's tree."""
    return llm.batched(max(b.nodes(llm.block_size) for b in budgets)).engine


def resolve_context_budgets(llm, draft_dir: str | Path | None, log: Callable[[str], None] = print,
                            seconds_per_context: float = 0.0) -> dict[str, TreeShape]:
    """The tree budget per context bucket for `--tree-budget auto` (`LLM.auto_context_budgets`): what
    `<draft_dir>/ddtree_tune.json` measured at long contexts when the file applies and holds any;
    else, with `seconds_per_context`, a greedy calibration after prompts of each context bucket's
    bound that fits (`tune_contexts`: 8192 and 32768 tokens where the context limit allows), among
    the budgets up to the greedy pick (`llm.auto_budgets`; a context pick only caps it), about
    `seconds_per_context` each plus each budget's warm-up request; else none."""
    path = tune_file_path(draft_dir if draft_dir is not None else llm.draft_path)
    if llm.drafter is None:
        return {}
    if path.is_file():
        record, reason = _matching_record(llm, path)
        picks = context_picks(record) if reason is None else {}
        if picks:
            log("tree budget auto by context (a cap on the temperature bucket's pick): " + _picks_line(picks))
            return picks
    return calibrate_context_caps(llm, seconds_per_context, log) if seconds_per_context > 0 else {}


def calibrate_context_caps(llm, seconds_per_context: float, log: Callable[[str], None] = print
                           ) -> dict[str, TreeShape]:
    """`resolve_context_budgets`' start-up measurement when no tune file says: each context bucket's
    fastest budget among the greedy pick and the calibration's smaller ones (none to measure where
    that pick is `ar`, or where no bucket's bound past 2048 tokens fits the context limit)."""
    greedy = (llm.auto_budgets or {}).get(GREEDY.name, llm.default_budget)
    budgets = [b for b in CALIBRATION_BUDGETS if b.nodes(llm.block_size) <= greedy.nodes(llm.block_size)]
    budgets += [] if greedy in budgets else [greedy]  # a tune file's pick may be no calibration budget
    contexts = tune_contexts(llm, CALIBRATION_MAX_TOKENS)
    if len(budgets) < 2 or not contexts:
        return {}
    log(f"tree budget auto: measuring greedy decoding after prompts of {', '.join(map(str, contexts))} tokens "
        f"at {', '.join(map(str, budgets))}, about {seconds_per_context:g} s each (a tune file's contexts "
        "replace this: `ddtree tune`)")
    start = time.perf_counter()
    picks = {name: entry["tree_budget"]
             for name, entry in measure_contexts(llm, seconds_per_context, contexts, budgets, log=log).items()}
    if picks:
        log(f"tree budget auto by context (a cap on the temperature bucket's pick), measured in "
            f"{time.perf_counter() - start:.1f} s: " + _picks_line(picks))
    return picks


def _matching_record(llm, path: Path) -> tuple[dict | None, str | None]:
    """(the tune file at `path`, None) when it applies to `llm`, else (None or the file, why not)."""
    try:
        record = read_tune_file(path)
    except DDTreeError as exc:
        return None, str(exc)
    return record, mismatch(record, llm)


def _picks_line(picks: dict[str, TreeShape]) -> str:
    return ", ".join(f"{name}: {budget}" for name, budget in picks.items())
