"""The FastAPI app: OpenAI-compatible completions and chat, /health, /v1/models, /version, /metrics,
and vLLM's /tokenize and /detokenize.

    app = create_app(llm, served_model_name="qwen3-8b")     # serve a loaded LLM
    app = create_app(None, served_model_name="qwen3-8b")    # /health answers 503 until
    app.state.worker.attach(llm)                            # the model is attached

Every bad request is answered 400 with `{"error": {"message", "type", "param", "code"}}`, an unknown
model 404, a missing or wrong API key 401, a full queue 429; nothing a client sends reaches the engine
before it has been validated in full and checked against the server's limits (`ServerLimits`). A
server fault is a 500 whose body holds a request id and no internal detail; the log has the rest.

Request bodies are parsed here, not by FastAPI: within limits and a slice at a time
(ddtree.server.json_body), so that no body holds the event loop; the prompts of small bodies are
tokenized on the loop, larger ones in worker threads, a few at a time.
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

import ddtree
from ddtree.config import DDTreeError, parse_tree_budget, shown
from ddtree.server.ignored_fields import IgnoredFieldLog, unknown_fields
from ddtree.server.json_body import JsonBodyError, JsonLimits, parse_json_body
from ddtree.server.limits import ServerLimits
from ddtree.server.metrics import ServerMetrics
from ddtree.server.middleware import ApiKeyMiddleware, BodyLimitMiddleware, RequestIdMiddleware, internal_error_body
from ddtree.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ErrorResponse,
    SamplingFields,
    error_body,
    validation_error_body,
)
from ddtree.server.responses import Reply, sse
from ddtree.server.tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize
from ddtree.server.worker import LOADING, READY, EngineFailure, EngineUnavailable, EngineWorker, Job, QueueFull

DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there
PREPARE_THREADS = 2  # requests tokenized at once: tokenizing releases the GIL, but each takes a core
# Bodies up to this size are templated and tokenized on the event loop itself: the two hops to a
# worker thread and back cost about 0.1 ms before the job is sent (the client's first token 1.29 ->
# 1.15 ms on the 2-core CPU, zero-cost engine in its own process: benchmarks/README.md). Larger ones
# go to the worker threads, so that no long prompt holds the loop.
INLINE_PREPARE_BYTES = 16384
RETRY_AFTER_LOADING_S = 5
RETRY_AFTER_QUEUE_FULL_S = 1
COMPLETION_MAX_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
MESSAGES_PER_TURN = 256  # chat messages validated between two turns of the event loop
_MESSAGE_LIST = TypeAdapter(list[ChatMessage])
ERROR_RESPONSES = {400: {"model": ErrorResponse, "description": "invalid request"},
                   401: {"model": ErrorResponse, "description": "missing or wrong API key"},
                   404: {"model": ErrorResponse, "description": "unknown model"},
                   429: {"model": ErrorResponse, "description": "the engine's queue is full"},
                   500: {"model": ErrorResponse, "description": "server fault (the body holds its request id)"},
                   503: {"model": ErrorResponse, "description": "model loading, engine failed or shutting down"}}


class ModelNotFound(Exception):
    pass


class RequestRejected(Exception):
    """A request refused before it reached the engine, with its status and error body."""

    def __init__(self, status: int, body: dict, headers: dict | None = None):
        super().__init__(body["error"]["message"])
        self.status, self.body, self.headers = status, body, headers


def _json_error(status: int, body: dict, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(body, status_code=status, headers=headers)


def create_app(llm=None, *, served_model_name: str | None = None, api_key: str | None = None,
               limits: ServerLimits | None = None, tree_budget_mode: str = "fixed",
               on_engine_death: Callable[[BaseException], None] | None = None, engine=None) -> FastAPI:
    """An app serving `llm`; with llm=None it answers 503 until `app.state.worker.attach(llm)`.
    engine: instead of an engine thread in this process, an `EngineClient` (the engine in a process
    of its own, ddtree.server.engine_client), which answers 503 until its engine is ready."""
    if llm is None and not served_model_name:
        raise ValueError("served_model_name is required when the model is attached later")
    if api_key is not None and not api_key:
        raise ValueError("api_key must not be empty: pass None to serve without one")
    limits = limits or ServerLimits()
    limits.check()
    model_name = served_model_name or llm.target_name
    worker = engine  # an engine process keeps its own metrics
    if worker is None:
        worker = EngineWorker(ServerMetrics(model_name), on_engine_death, max_queued=limits.max_queued_requests,
                              max_cached_budgets=limits.max_cached_budgets, max_tree_budget=limits.max_tree_budget)
    if llm is not None:
        worker.attach(llm, tree_budget_mode)

    async def lifespan(app: FastAPI):
        yield
        await run_in_threadpool(worker.stop, limits.shutdown_timeout)

    app = FastAPI(title="ddtree", version=ddtree.__version__, lifespan=lifespan,
                  description="OpenAI-compatible DDTree speculative decoding server")
    app.state.worker = worker
    app.state.metrics = getattr(worker, "metrics", None)
    app.state.model_name = model_name
    app.state.limits = limits
    app.add_middleware(BodyLimitMiddleware, max_bytes=limits.max_request_bytes)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(RequestIdMiddleware)  # added last: the outermost, so every answer carries an id
    _add_error_handlers(app)
    _add_info_routes(app, worker, model_name, limits)
    _add_generation_routes(app, worker, model_name, limits)
    _document_openapi(app, {"CompletionRequest": CompletionRequest, "ChatCompletionRequest": ChatCompletionRequest,
                            "TokenizeRequest": TokenizeRequest, "DetokenizeRequest": DetokenizeRequest})
    return app


def _request_body(model: type[BaseModel]) -> dict:
    """The OpenAPI requestBody of a route that parses its body itself."""
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _document_openapi(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """The request bodies' schemas (FastAPI does not see them: the routes parse their own bodies),
    and no 422 (this server answers 400)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for name, model in bodies.items():
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[name] = body
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
        return app.openapi_schema

    app.openapi = openapi


def _add_error_handlers(app: FastAPI) -> None:
    def request_id(request: Request) -> str:
        return request.scope.get("state", {}).get("request_id", "-")

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        return _json_error(400, validation_error_body(list(exc.errors())))

    @app.exception_handler(RequestRejected)
    async def on_rejected(request: Request, exc: RequestRejected):
        return _json_error(exc.status, exc.body, exc.headers)

    @app.exception_handler(DDTreeError)
    async def on_ddtree_error(request: Request, exc: DDTreeError):
        return _json_error(400, error_body(str(exc), param=exc.param, code="invalid_value"))

    @app.exception_handler(ModelNotFound)
    async def on_model_not_found(request: Request, exc: ModelNotFound):
        return _json_error(404, error_body(str(exc), param="model", code="model_not_found"))

    @app.exception_handler(QueueFull)
    async def on_queue_full(request: Request, exc: QueueFull):
        return _json_error(429, error_body(str(exc), type="server_error", code="queue_full"),
                           {"Retry-After": str(RETRY_AFTER_QUEUE_FULL_S)})

    @app.exception_handler(EngineUnavailable)
    async def on_unavailable(request: Request, exc: EngineUnavailable):
        worker: EngineWorker = request.app.state.worker
        headers = {"Retry-After": str(RETRY_AFTER_LOADING_S)} if worker.state == LOADING else None
        return _json_error(503, error_body(str(exc), type="server_error", code="engine_unavailable"), headers)

    @app.exception_handler(EngineFailure)
    async def on_engine_failure(request: Request, exc: EngineFailure):  # logged by the engine thread
        return _json_error(500, internal_error_body(request_id(request)))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_value")
        return _json_error(exc.status_code, error_body(f"{request.method} {shown(request.url.path)}: {exc.detail}",
                                                       type=kind, code=code))


def _add_info_routes(app: FastAPI, worker: EngineWorker, model_name: str, limits: ServerLimits) -> None:
    created = int(time.time())

    @app.get("/health")
    async def health():
        if worker.state != READY:
            if worker.state == LOADING:
                return JSONResponse({"status": "loading"}, status_code=503,
                                    headers={"Retry-After": str(RETRY_AFTER_LOADING_S)})
            status = {"dead": "error"}.get(worker.state, worker.state)
            return JSONResponse({"status": status, "error": worker.error or worker.unavailable_reason()},
                                status_code=503)
        stalled = worker.stalled_for()
        if stalled > limits.engine_stall_timeout:
            reason = (f"the engine has made no progress for {stalled:.0f} s with {worker.waiting} request(s) waiting "
                      f"(--engine-stall-timeout {limits.engine_stall_timeout:g})")
            return JSONResponse({"status": "stalled", "error": reason}, status_code=503)
        llm = worker.llm
        return {"status": "ok", "model": model_name, "target_model": llm.target_name,
                "draft_model": llm.draft_name, "block_size": llm.block_size,
                "max_draft_len": max(llm.block_size - 1, 0), "tree_budget": llm.default_budget.label,
                "tree_budget_mode": worker.tree_budget_mode, "max_model_len": llm.max_model_len,
                "max_num_seqs": getattr(llm, "max_num_seqs", 1),
                "device": str(llm.device), "dtype": str(llm.dtype).replace("torch.", ""), "engine": worker.kind}

    @app.get("/version")
    async def version():
        return {"version": ddtree.__version__}

    @app.get("/metrics")
    async def prometheus_metrics():
        data, content_type = await run_in_threadpool(worker.render_metrics)  # an engine process is asked
        return Response(data, media_type=content_type)

    @app.get("/v1/models", responses=ERROR_RESPONSES)
    async def models():
        llm = worker.llm
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "ddtree",
                "root": llm.target_name if llm is not None else None,
                "max_model_len": llm.max_model_len if llm is not None else None}
        return {"object": "list", "data": [card]}


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


async def read_request(request: Request, model: type[SamplingFields], limits: JsonLimits,
                       ignored: IgnoredFieldLog | None = None) -> SamplingFields:
    """The request body as `model`, parsed within `limits`; raises RequestRejected (400). Unknown
    top-level fields are dropped, and their names noted in `ignored`."""
    content_type = request.headers.get("content-type")
    if content_type is not None and not _is_json(content_type):
        raise RequestRejected(400, error_body(f"request body must be JSON (Content-Type: application/json), got "
                                              f"Content-Type {shown(content_type)}", code="invalid_value"))
    try:
        data = await parse_json_body(await request.body(), limits)
    except JsonBodyError as exc:
        raise RequestRejected(400, error_body(str(exc), param=exc.param, code=exc.code)) from None
    unknown = unknown_fields(data, model.model_fields)
    if unknown and ignored is not None:
        ignored.note(unknown, request.url.path, request.scope.get("state", {}).get("request_id", "-"))
    if "messages" in model.model_fields and isinstance(data, dict) and isinstance(data.get("messages"), list):
        data = {**data, "messages": await _validated_messages(data["messages"])}
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise RequestRejected(400, validation_error_body(exc.errors(include_url=False))) from None


async def _validated_messages(messages: list) -> list:
    """The messages as ChatMessage, validated a slice at a time: pydantic holds the loop for the whole
    of what it is given (0.1 s for 20,000 messages). The request's own validation then takes them as
    they are."""
    if len(messages) <= MESSAGES_PER_TURN:
        return messages
    checked: list[ChatMessage] = []
    for start in range(0, len(messages), MESSAGES_PER_TURN):
        try:
            checked += _MESSAGE_LIST.validate_python(messages[start : start + MESSAGES_PER_TURN])
        except ValidationError as exc:
            errors = [{**e, "loc": ("messages", start + e["loc"][0], *e["loc"][1:])} for e in exc.errors(include_url=False)]
            raise RequestRejected(400, validation_error_body(errors)) from None
        await asyncio.sleep(0)
    return checked


def _add_generation_routes(app: FastAPI, worker: EngineWorker, model_name: str, limits: ServerLimits) -> None:
    prepare_slots: list[anyio.CapacityLimiter] = []  # made on the event loop, at the first request
    ignored_fields = IgnoredFieldLog()

    async def read_body(request: Request, model: type[BaseModel]):
        """The validated body (of the served model) and the LLM."""
        llm = _ready_llm(worker)
        json_limits = JsonLimits(limits.max_json_depth, limits.max_json_keys, limits.json_values(llm.max_model_len))
        body = await read_request(request, model, json_limits, ignored_fields)
        if body.model is not None and body.model != model_name:
            raise ModelNotFound(f"model {shown(body.model)} does not exist; this server serves {model_name!r}")
        return body, llm

    async def admit(request: Request, model: type[SamplingFields]):
        """The validated body and the LLM, once everything that needs no tokenizer has been checked."""
        body, llm = await read_body(request, model)
        body.check_stop_limits(limits.max_stop, limits.max_stop_chars)
        _check_output_cap(body, limits.max_output_tokens)
        if body.tree_budget is not None:
            budget = parse_tree_budget(body.tree_budget)
            if budget.budget > limits.max_tree_budget and budget != llm.default_budget:
                raise DDTreeError(f"tree_budget {budget} is over this server's limit of {limits.max_tree_budget} "
                                  "(--max-tree-budget)", "tree_budget")
        return body, llm

    async def prepared(request: Request, prepare: Callable[[], tuple]) -> tuple:
        """prepare() (templating and tokenizing): on the loop for a small body, else in a worker thread
        (a few requests at a time)."""
        if len(await request.body()) <= INLINE_PREPARE_BYTES:  # the body is read already: no wait
            return prepare()
        if not prepare_slots:
            prepare_slots.append(anyio.CapacityLimiter(PREPARE_THREADS))
        return await anyio.to_thread.run_sync(prepare, limiter=prepare_slots[0])

    def submit(request: Request, prompt_ids: list[int], params, budget, adaptive: bool) -> Job:
        job = Job(prompt_ids, params, budget, asyncio.get_running_loop(),
                  request_id=request.scope["state"].get("request_id", "-"), adaptive=adaptive)
        worker.submit(job)
        return job

    _add_tokenize_routes(app, read_body, prepared)

    @app.post("/v1/completions", responses=ERROR_RESPONSES, openapi_extra=_request_body(CompletionRequest))
    async def completions(request: Request):
        body, llm = await admit(request, CompletionRequest)

        def prepare():
            prompt_ids = _nonempty(llm.prompt_ids(body.single_prompt()))
            params = body.sampling_params(default_max_tokens=limits.capped(COMPLETION_MAX_TOKENS))
            return prompt_ids, params, llm.check_request(prompt_ids, params, body.tree_budget)

        prompt_ids, params, budget = await prepared(request, prepare)
        job = submit(request, prompt_ids, params, budget, llm.adapts(body.tree_budget))
        reply = Reply("cmpl", "text_completion", model_name, body, prompt_ids, job.request_id, _token_text(llm))
        if body.stream:
            return sse(reply.completion_chunks(job))
        result = await _collect(job, request)
        return reply.completion(result) if result is not None else Response(status_code=499)

    @app.post("/v1/chat/completions", responses=ERROR_RESPONSES, openapi_extra=_request_body(ChatCompletionRequest))
    async def chat_completions(request: Request):
        body, llm = await admit(request, ChatCompletionRequest)

        def prepare():
            prompt_ids = _nonempty(llm.apply_chat_template(body.template_messages()))
            params = body.sampling_params(default_max_tokens=limits.default_output_tokens(llm.max_model_len - len(prompt_ids)))
            return prompt_ids, params, llm.check_request(prompt_ids, params, body.tree_budget)

        prompt_ids, params, budget = await prepared(request, prepare)
        job = submit(request, prompt_ids, params, budget, llm.adapts(body.tree_budget))
        reply = Reply("chatcmpl", "chat.completion", model_name, body, prompt_ids, job.request_id, _token_text(llm))
        if body.stream:
            return sse(reply.chat_chunks(job))
        result = await _collect(job, request)
        return reply.chat(result) if result is not None else Response(status_code=499)


def _add_tokenize_routes(app: FastAPI, read_body, prepared) -> None:
    @app.post("/tokenize", responses=ERROR_RESPONSES, openapi_extra=_request_body(TokenizeRequest))
    async def tokenize_route(request: Request):
        body, llm = await read_body(request, TokenizeRequest)
        return (await prepared(request, lambda: (tokenize(llm, body),)))[0]

    @app.post("/detokenize", responses=ERROR_RESPONSES, openapi_extra=_request_body(DetokenizeRequest))
    async def detokenize_route(request: Request):
        body, llm = await read_body(request, DetokenizeRequest)
        return (await prepared(request, lambda: (detokenize(llm, body),)))[0]


def _check_output_cap(body: SamplingFields, cap: int | None) -> None:
    """Refuse a max_tokens over the operator's --max-output-tokens."""
    requested = body.requested_max_tokens()
    if cap is not None and requested is not None and requested > cap:
        param = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) is not None else "max_tokens"
        raise DDTreeError(f"{param} {requested} is over this server's limit of {cap} output tokens "
                          "(--max-output-tokens)", param)


def _token_text(llm) -> Callable[[int], str]:
    """A token id's text, for log-probs ("token_id:<id>" without a tokenizer, as vLLM writes it)."""
    if llm.tokenizer is None:
        return lambda token: f"token_id:{token}"
    return lambda token: llm.tokenizer.decode([token])


def _ready_llm(worker: EngineWorker):
    if worker.state != READY:
        raise EngineUnavailable(worker.unavailable_reason())
    return worker.llm


def _nonempty(prompt_ids: list[int]) -> list[int]:
    if not prompt_ids:
        raise DDTreeError("the prompt encodes to no tokens", "prompt")
    return prompt_ids


async def _collect(job: Job, request: Request):
    """Wait for the job's result, cancelling it if the client disconnects; None when it did."""
    try:
        while True:
            try:
                item = await asyncio.wait_for(job.next_event(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cancel()
                    return None
                continue
            if item.result is not None:
                return item.result
    finally:
        job.cancel()  # a no-op for a finished job; stops it if this handler was cancelled
