"""The FastAPI app: OpenAI-compatible completions and chat, /health, /v1/models, /version, /metrics.

    app = create_app(llm, served_model_name="qwen3-8b")     # serve a loaded LLM
    app = create_app(None, served_model_name="qwen3-8b")    # /health answers 503 until
    app.state.worker.attach(llm)                            # the model is attached

Every bad request is answered 400 with `{"error": {"message", "type", "param", "code"}}` (FastAPI's
own 422 included), an unknown model 404, a missing or wrong API key 401; nothing a client sends
reaches the engine before it has been validated in full.
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

import ddtree
from ddtree.config import DDTreeError
from ddtree.server.metrics import ServerMetrics
from ddtree.server.middleware import ApiKeyMiddleware, BodyLimitMiddleware
from ddtree.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    SamplingFields,
    error_body,
    validation_error_body,
)
from ddtree.server.responses import Reply, sse
from ddtree.server.worker import READY, EngineUnavailable, EngineWorker, Job

DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there
ERROR_RESPONSES = {400: {"model": ErrorResponse, "description": "invalid request"},
                   401: {"model": ErrorResponse, "description": "missing or wrong API key"},
                   404: {"model": ErrorResponse, "description": "unknown model"},
                   503: {"model": ErrorResponse, "description": "model loading or engine failed"}}


class ModelNotFound(Exception):
    pass


def _json_error(status: int, body: dict) -> JSONResponse:
    return JSONResponse(body, status_code=status)


def create_app(llm=None, *, served_model_name: str | None = None, api_key: str | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, tree_budget_mode: str = "fixed",
               on_engine_death: Callable[[BaseException], None] | None = None) -> FastAPI:
    """An app serving `llm`; with llm=None it answers 503 until `app.state.worker.attach(llm)`."""
    if llm is None and not served_model_name:
        raise ValueError("served_model_name is required when the model is attached later")
    model_name = served_model_name or llm.target_name
    metrics = ServerMetrics(model_name)
    worker = EngineWorker(metrics, on_engine_death)
    if llm is not None:
        worker.attach(llm, tree_budget_mode)

    async def lifespan(app: FastAPI):
        yield
        await run_in_threadpool(worker.stop)

    app = FastAPI(title="ddtree", version=ddtree.__version__, lifespan=lifespan,
                  description="OpenAI-compatible DDTree speculative decoding server")
    app.state.worker = worker
    app.state.metrics = metrics
    app.state.model_name = model_name
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    _add_error_handlers(app)
    _add_info_routes(app, worker, metrics, model_name)
    _add_generation_routes(app, worker, model_name)
    _document_400_not_422(app)
    return app


def _document_400_not_422(app: FastAPI) -> None:
    """FastAPI documents a 422 for every body; this server answers those with 400."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
        return app.openapi_schema

    app.openapi = openapi


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        return _json_error(400, validation_error_body(list(exc.errors())))

    @app.exception_handler(DDTreeError)
    async def on_ddtree_error(request: Request, exc: DDTreeError):
        return _json_error(400, error_body(str(exc), param=exc.param, code="invalid_value"))

    @app.exception_handler(ModelNotFound)
    async def on_model_not_found(request: Request, exc: ModelNotFound):
        return _json_error(404, error_body(str(exc), param="model", code="model_not_found"))

    @app.exception_handler(EngineUnavailable)
    async def on_unavailable(request: Request, exc: EngineUnavailable):
        return _json_error(503, error_body(str(exc), type="server_error", code="engine_unavailable"))

    @app.exception_handler(Exception)
    async def on_internal_error(request: Request, exc: Exception):
        return _json_error(500, error_body(f"internal error: {type(exc).__name__}: {exc}", type="server_error"))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return _json_error(exc.status_code, error_body(f"{request.method} {request.url.path}: {exc.detail}",
                                                       type=kind, code=code))


def _add_info_routes(app: FastAPI, worker: EngineWorker, metrics: ServerMetrics, model_name: str) -> None:
    created = int(time.time())

    @app.get("/health")
    async def health():
        if worker.state != READY:
            status = {"loading": "loading", "dead": "error"}.get(worker.state, worker.state)
            body = {"status": status}
            if worker.error:
                body["error"] = worker.error
            return JSONResponse(body, status_code=503)
        llm = worker.llm
        return {"status": "ok", "model": model_name, "target_model": llm.target_name,
                "draft_model": llm.draft_name, "block_size": llm.block_size,
                "max_draft_len": max(llm.block_size - 1, 0), "tree_budget": str(llm.default_budget),
                "tree_budget_mode": worker.tree_budget_mode, "max_model_len": llm.max_model_len,
                "device": str(llm.device)}

    @app.get("/version")
    async def version():
        return {"version": ddtree.__version__}

    @app.get("/metrics")
    async def prometheus_metrics():
        data, content_type = metrics.render()
        return Response(data, media_type=content_type)

    @app.get("/v1/models", responses=ERROR_RESPONSES)
    async def models():
        llm = worker.llm
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "ddtree",
                "root": llm.target_name if llm is not None else None,
                "max_model_len": llm.max_model_len if llm is not None else None}
        return {"object": "list", "data": [card]}


def _add_generation_routes(app: FastAPI, worker: EngineWorker, model_name: str) -> None:
    def check_model(body: SamplingFields) -> None:
        if body.model is not None and body.model != model_name:
            raise ModelNotFound(f"model {body.model!r} does not exist; this server serves {model_name!r}")

    def submit(prompt_ids: list[int], params, budget) -> Job:
        job = Job(prompt_ids, params, budget, asyncio.get_running_loop())
        worker.submit(job)
        return job

    @app.post("/v1/completions", responses=ERROR_RESPONSES)
    async def completions(body: CompletionRequest, request: Request):
        check_model(body)
        llm = _ready_llm(worker)

        def prepare():
            prompt_ids = _nonempty(llm.prompt_ids(body.single_prompt()))
            params = body.sampling_params(default_max_tokens=16)
            return prompt_ids, params, llm.check_request(prompt_ids, params, body.tree_budget)

        prompt_ids, params, budget = await run_in_threadpool(prepare)
        job = submit(prompt_ids, params, budget)
        reply = Reply("cmpl", "text_completion", model_name, body, prompt_ids)
        if body.stream:
            return sse(reply.completion_chunks(job))
        result = await _collect(job, request)
        return reply.completion(result) if result is not None else Response(status_code=499)

    @app.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body)
        llm = _ready_llm(worker)

        def prepare():
            prompt_ids = _nonempty(llm.apply_chat_template(body.template_messages()))
            room = max(llm.max_model_len - len(prompt_ids), 1)
            params = body.sampling_params(default_max_tokens=room)
            return prompt_ids, params, llm.check_request(prompt_ids, params, body.tree_budget)

        prompt_ids, params, budget = await run_in_threadpool(prepare)
        job = submit(prompt_ids, params, budget)
        reply = Reply("chatcmpl", "chat.completion", model_name, body, prompt_ids)
        if body.stream:
            return sse(reply.chat_chunks(job))
        result = await _collect(job, request)
        return reply.chat(result) if result is not None else Response(status_code=499)


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
