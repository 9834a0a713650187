"""Send the benchmark's requests and time them: to a live OpenAI-compatible endpoint
(`LiveBackend`, streaming over HTTP) or to the in-process engine (`OfflineBackend`, through
`ddtree.llm.LLM.stream`, the call the server makes).

`ddtree.bench.sweep.run_sweep` drives them through every (concurrency, tree budget) pair.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field

import aiohttp
import httpx

from ddtree.bench.datasets import BenchPrompt
from ddtree.bench.report import RequestOutput, ServerCounters
from ddtree.config import DDTreeError, SamplingParams
from ddtree.tree_shape import TreeShape, shape_json

DRAFTS_COUNTER = "vllm:spec_decode_num_drafts"
ACCEPTED_COUNTER = "vllm:spec_decode_num_accepted_tokens"
TTFT_HISTOGRAM = "vllm:time_to_first_token_seconds"
E2EL_HISTOGRAM = "vllm:e2e_request_latency_seconds"


@dataclass(frozen=True)
class ServerChoice:
    """The sweep's `server` budget: its requests name no tree_budget, so a live server decodes them
    at its own (its --tree-budget; without one, its measured or per-round choice). It answers what
    the sweep asks of a TreeShape."""

    label = "server"
    drafts = True  # it may: compared with ar like a tree
    builds_tree = False  # no node count to plot or to prune by
    budget = 0
    json_value = None  # nothing sent

    def __str__(self) -> str:
        return self.label


SERVER_CHOICE = ServerChoice()


def bench_json(value: object) -> object:
    """`json.dumps(..., default=bench_json)`: shapes as their JSON value, the server's choice as "server"."""
    return value.label if isinstance(value, ServerChoice) else shape_json(value)


@dataclass
class SweepSettings:
    tree_budgets: list[TreeShape]
    concurrencies: list[int] = field(default_factory=lambda: [1])
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    warmup: int = 1
    ignore_eos: bool = False

    def params(self, index: int) -> SamplingParams:
        """Request `index`'s sampling settings; at T > 0 each prompt gets its own fixed seed."""
        seed = self.seed + index if self.temperature > 0 else None
        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                              seed=seed, ignore_eos=self.ignore_eos)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# -- in-process engine ----------------------------------------------------------------------------


class OfflineBackend:
    """The in-process engine. It decodes one request at a time, so with concurrency > 1 requests
    wait their turn and that wait counts in their latency, as it does behind a server."""

    def __init__(self, llm):
        self.llm = llm
        self.lock = threading.Lock()
        self.prompts: dict[int, BenchPrompt] = {}
        self.prompt_ids: dict[int, list[int]] = {}
        # Set when the sweep is cancelled (Ctrl-C): the request in its thread stops after the step in
        # progress and the queued ones do not start, so the interrupted sweep ends at once.
        self.cancelled = threading.Event()

    def describe(self) -> dict:
        return {"mode": "offline", "target": str(self.llm.target_path), "draft": str(self.llm.draft_path),
                "dtype": str(self.llm.dtype).replace("torch.", ""), "max_model_len": self.llm.max_model_len}

    def encode(self, prompt: BenchPrompt) -> list[int]:
        if prompt.is_chat:
            return self.llm.apply_chat_template(list(prompt.messages))
        return self.llm.prompt_ids(prompt.prompt)

    def check(self, prompts: list[BenchPrompt], settings: SweepSettings) -> None:
        """Tokenize every prompt and validate every request before any is run."""
        for index, prompt in enumerate(prompts):
            try:
                ids = self.encode(prompt)
                for budget in settings.tree_budgets:
                    self.llm.check_request(ids, settings.params(index), budget)
            except DDTreeError as exc:
                raise DDTreeError(f"prompt {prompt.id!r}: {exc}", exc.param) from None
            self.prompts[index] = prompt
            self.prompt_ids[index] = ids

    def generate_one(self, index: int, budget: TreeShape, params: SamplingParams, sent_at: float,
                     deadline: float | None = None) -> RequestOutput:
        """Run one request (checked by `check`) from its text: its chat template and tokenizing count
        in its time, as they do for `LLM.generate(text)` and behind a server. Times count from
        `sent_at` (time.perf_counter()). Past `deadline` (a perf_counter time) the request stops
        after the step in progress and fails."""
        out = RequestOutput(index, prompt_tokens=len(self.prompt_ids[index]))
        with self.lock:
            last = None
            result = None
            if self.cancelled.is_set():
                out.error = "cancelled"
                return out
            prompt = self.prompts.get(index)  # none for prompts given as token ids (tune's calibrations)
            ids = self.encode(prompt) if prompt is not None else self.prompt_ids[index]
            stream = self.llm.stream(ids, params, budget)
            try:
                for event in stream:
                    now = time.perf_counter()
                    if event.token_ids:  # one engine step: the prefill's token, then each round's
                        if last is None:
                            out.ttft_s = now - sent_at
                        else:
                            out.itl_s.append(now - last)
                        last = now
                    result = event.result
                    if result is None and deadline is not None and now > deadline:
                        out.error = "stopped at the deadline"
                        return out
                    if result is None and self.cancelled.is_set():
                        out.error = "cancelled"
                        return out
            finally:
                stream.close()
        out.e2el_s = time.perf_counter() - sent_at
        out.text = result.text
        out.output_tokens = len(result.token_ids)
        out.decode_rounds = result.stats.decode_rounds
        out.accepted_tokens = sum(result.stats.acceptance_lengths)
        out.budget_rounds = dict(result.stats.budget_rounds)
        out.success = True
        return out

    async def send(self, prompt: BenchPrompt, index: int, budget: TreeShape, params: SamplingParams) -> RequestOutput:
        sent_at = time.perf_counter()
        try:
            return await asyncio.to_thread(self.generate_one, index, budget, params, sent_at)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def prepare(self, budget: TreeShape) -> None:
        """Capture every graph the budget can need, so that no capture falls inside the timing."""
        def capture():
            with self.lock:
                self.llm.warmup(budget)
        await asyncio.to_thread(capture)

    async def counters(self) -> ServerCounters | None:
        return None  # every request reports its own rounds

    async def aclose(self) -> None:
        pass


# -- live endpoint --------------------------------------------------------------------------------


def normalize_base_url(url: str) -> str:
    """'http://h:8000', 'http://h:8000/' and 'http://h:8000/v1' all -> 'http://h:8000'."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise DDTreeError(f"--base-url must start with http:// or https://, got {url!r}", "base_url")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _error_message(body: bytes) -> str:
    try:
        data = json.loads(body)
        if isinstance(data, dict):
            err = data.get("error", data.get("detail", data))
            if isinstance(err, dict) and "message" in err:
                return str(err["message"])
            return str(err)
    except (json.JSONDecodeError, UnicodeDecodeError):
        pass
    return body[:300].decode("utf-8", "replace")


def parse_counters(text: str) -> ServerCounters | None:
    """vLLM's spec-decode draft and accepted-token counters and its time-to-first-token and end-to-end
    histograms' sums and counts, each summed over its label sets; None without any of them."""
    from prometheus_client.parser import text_string_to_metric_families

    names = {DRAFTS_COUNTER: "drafts", DRAFTS_COUNTER + "_total": "drafts",
             ACCEPTED_COUNTER: "accepted_tokens", ACCEPTED_COUNTER + "_total": "accepted_tokens",
             TTFT_HISTOGRAM + "_sum": "ttft_sum_s", TTFT_HISTOGRAM + "_count": "ttft_count",
             E2EL_HISTOGRAM + "_sum": "e2el_sum_s", E2EL_HISTOGRAM + "_count": "e2el_count"}
    totals: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                field = names.get(sample.name)
                if field is not None:
                    totals[field] = totals.get(field, 0.0) + sample.value
    except ValueError:
        return None
    return ServerCounters(**totals) if totals else None


class LiveBackend:
    """A running server: ddtree's (which takes `tree_budget` per request and reports its `ddtree`
    statistics) or any OpenAI-compatible one (acceptance then comes from its /metrics counters)."""

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None, timeout_s: float = 600.0):
        self.base_url = normalize_base_url(base_url)
        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(base_url=self.base_url, headers=headers,
                                        timeout=httpx.Timeout(timeout_s, connect=10.0),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        # The streams go through aiohttp, whose line reader costs about a third of httpx's per chunk
        # (40 against 140 us on the 2-core CPU): with httpx, 16 streams of a fast server were bound by
        # this client's own loop at about 25k tokens/s. Made in `open`, inside the event loop.
        self._headers, self._timeout_s = headers, timeout_s
        self.streams: aiohttp.ClientSession | None = None
        self.server_info: dict = {}
        self.usage_missing = False

    async def open(self) -> None:
        """Reach the server, pick the model (the first of /v1/models unless given) and read /version."""
        self.streams = aiohttp.ClientSession(
            base_url=self.base_url, headers=self._headers, connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=self._timeout_s, sock_connect=10.0),
            read_bufsize=1 << 22)  # a stream's longest line: the last chunk's statistics, log-probs
        try:
            resp = await self.client.get("/v1/models")
        except httpx.HTTPError as exc:
            raise DDTreeError(f"cannot reach {self.base_url}: {exc}", "base_url") from None
        if resp.status_code != 200:
            raise DDTreeError(f"{self.base_url}/v1/models answered {resp.status_code}: {_error_message(resp.content)}",
                              "base_url")
        models = [m.get("id") for m in resp.json().get("data", []) if isinstance(m, dict)]
        if self.model is None:
            if not models:
                raise DDTreeError(f"{self.base_url}/v1/models lists no model: pass --model", "model")
            self.model = models[0]
        for path in ("/version", "/health"):
            try:
                r = await self.client.get(path)
                if r.status_code == 200 and r.headers.get("content-type", "").startswith("application/json"):
                    self.server_info[path.strip("/")] = r.json()
            except (httpx.HTTPError, json.JSONDecodeError):
                pass

    def describe(self) -> dict:
        return {"mode": "live", "base_url": self.base_url, "model": self.model, **self.server_info}

    def check(self, prompts: list[BenchPrompt], settings: SweepSettings) -> None:
        for index in range(len(prompts)):
            settings.params(index)  # validates the sampling settings; the server checks the rest

    def _body(self, prompt: BenchPrompt, budget: TreeShape, params: SamplingParams) -> dict:
        body = {"model": self.model, "max_tokens": params.max_tokens, "temperature": params.temperature,
                "stream": True, "stream_options": {"include_usage": True}}
        if budget.json_value is not None:
            body["tree_budget"] = budget.json_value
        if params.top_p != 1.0:
            body["top_p"] = params.top_p
        if params.seed is not None:
            body["seed"] = params.seed
        if params.ignore_eos:
            body["ignore_eos"] = True
        if prompt.is_chat:
            body["messages"] = list(prompt.messages)
        else:
            body["prompt"] = prompt.prompt
        return body

    async def send(self, prompt: BenchPrompt, index: int, budget: TreeShape, params: SamplingParams) -> RequestOutput:
        out = RequestOutput(index)
        url = "/v1/chat/completions" if prompt.is_chat else "/v1/completions"
        pieces: list[str] = []
        chunks = 0
        usage = None
        sent_at = time.perf_counter()
        last = None
        try:
            async with self.streams.post(url, json=self._body(prompt, budget, params)) as resp:
                if resp.status != 200:
                    out.error = f"HTTP {resp.status}: {_error_message(await resp.read())}"
                    return out
                done = False
                async for line in resp.content:  # one line at a time
                    if done or not line.startswith(b"data:"):
                        continue  # after [DONE], to the body's end: the connection is kept for the next request
                    data = line[len(b"data:"):].strip()
                    if data == b"[DONE]":
                        done = True
                        continue
                    chunk = json.loads(data)
                    if "error" in chunk:
                        out.error = _error_message(data)
                        return out
                    text = self._chunk_text(chunk, prompt.is_chat)
                    if text:
                        now = time.perf_counter()
                        if last is None:
                            out.ttft_s = now - sent_at
                        else:
                            out.itl_s.append(now - last)
                        last = now
                        pieces.append(text)
                        chunks += 1
                    usage = chunk.get("usage") or usage
                    if isinstance(chunk.get("ddtree"), dict):
                        self._take_stats(out, chunk["ddtree"])
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:  # ValueError: bad JSON, a line too long
            out.error = f"{type(exc).__name__}: {exc}"
            return out
        out.e2el_s = time.perf_counter() - sent_at
        if last is None:
            out.ttft_s = out.e2el_s
        out.text = "".join(pieces)
        if usage:
            out.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            out.output_tokens = int(usage.get("completion_tokens") or 0)
        else:
            self.usage_missing = True
            out.output_tokens = chunks
        out.success = True
        return out

    @staticmethod
    def _chunk_text(chunk: dict, chat: bool) -> str:
        choices = chunk.get("choices") or []
        if not choices:
            return ""
        if chat:
            return (choices[0].get("delta") or {}).get("content") or ""
        return choices[0].get("text") or ""

    @staticmethod
    def _take_stats(out: RequestOutput, stats: dict) -> None:
        rounds = stats.get("decode_rounds")
        if not isinstance(rounds, int):
            return
        out.decode_rounds = rounds
        by_budget = stats.get("budget_rounds")
        if isinstance(by_budget, dict):
            out.budget_rounds = {str(b): int(n) for b, n in by_budget.items() if isinstance(n, int)}
        lengths = stats.get("acceptance_lengths")
        if isinstance(lengths, list):
            out.accepted_tokens = int(sum(lengths))
        elif isinstance(stats.get("mean_acceptance_length"), (int, float)):
            out.accepted_tokens = round(stats["mean_acceptance_length"] * rounds)

    async def counters(self) -> ServerCounters | None:
        try:
            resp = await self.client.get("/metrics")
        except httpx.HTTPError:
            return None
        return parse_counters(resp.text) if resp.status_code == 200 else None

    async def aclose(self) -> None:
        await self.client.aclose()
        if self.streams is not None:
            await self.streams.close()
