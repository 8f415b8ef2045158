"""The OpenAI-compatible HTTP API (FastAPI on uvicorn).

==========================  ======================================================================
POST /v1/completions        prompt (text or token ids) -> text; ``stream`` as server-sent events
POST /v1/chat/completions   messages -> chat template -> assistant message; ``stream`` likewise
POST /v1/messages           Anthropic's Messages API over the same chat path (moe_service.api.anthropic);
POST /v1/messages/count_tokens  its errors in Anthropic's envelope, its own SSE events
POST /v1/responses          the OpenAI Responses API over the same chat path (moe_service.api.responses);
                            GET / DELETE /v1/responses/{id} for stored responses
GET  /v1/models             the one served model (config ``model.name``, else the file name)
GET  /health                200 ``{"status": "ok"}`` while serving; 503 ``{"status": "loading",
                            "stage": ...}`` before, 503 ``{"status": "stopping"}`` after SIGTERM,
                            503 ``{"status": "unhealthy", "reason": ...}`` when work no longer
                            completes (Service.health_problem)
GET  /metrics               Prometheus text (moe_service.metrics)
==========================  ======================================================================

Request handling, per generation request::

    body --JSON--> pydantic model (extra fields refused) --unsupported values named--> model id
      --> prompt ids (chat template / tokenizer, in a worker thread) --> context policy
      --> BatchLoop.submit (429 + Retry-After when full) --> events from the engine thread
          (loop.call_soon_threadsafe into an asyncio.Queue)
      --> one JSON answer, or SSE chunks ``data: {...}`` ending with ``data: [DONE]``

Every error is an OpenAI error object ``{"error": {"message", "type", "param", "code"}}``:
400 ``invalid_request_error`` for invalid JSON, invalid or unknown fields (pydantic's errors
come out as 400 naming the field), unsupported values (n > 1, penalties, ...), an empty
prompt, an unknown model, a schema the grammar engine cannot compile or a prompt that does
not fit the context; 401 without a valid API key, 415 for a body that is not declared JSON
(moe_service.api.auth); 429 ``rate_limit_error`` when the queue is full; 503 while loading
and once the engine loop stopped (after SIGTERM, a request that arrives before the listener
closes is still served, with ``Connection: close``); 500 ``server_error`` when the engine
failed on the request's step. A client that goes away has its sequence cancelled.

Tool calls, reasoning_content, response_format and logprobs: moe_service.api (chat.py,
tools.py, grammar.py, logprobs.py).
"""

from __future__ import annotations

import asyncio
import fnmatch
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from moe_service.api import logprobs as lp_fmt
from moe_service.api.transport import (  # shared with the other protocols' endpoints
    Events,
    await_final,
    error_response,
    finish_request,
    merge_events,
    read_json,
    refusal,
    sse_data,
    submit,
    validate_body,
    validation_error,
)
from moe_service.engine.engine import Event, GenerationRequest, RequestError
from moe_service.log import get_logger
from moe_service.request_limits import (
    BodyLimit,
    admission_precheck,
    chat_chars,
    check_stop_strings,
    prompt_chars,
)

log = get_logger(__name__)

MAX_STOP_STRINGS = 4
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/v1/messages",
          "/v1/messages/count_tokens", "/v1/responses")


# ---------------------------------------------------------------------------------------------
# Request bodies


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: bool | None = False


class _GenerationBody(_Body):
    """Fields both endpoints share. ``top_k`` is an extension (llama.cpp, vLLM)."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool | None = False  # extension (vLLM, llama.cpp): generate max_tokens whatever comes
    # accepted only at their neutral value; anything else is named as unsupported
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        if isinstance(v, list):
            if len(v) > MAX_STOP_STRINGS:
                raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed (got {len(v)})")
            if any(not s for s in v):
                raise ValueError("stop strings must not be empty")
        return v


class CompletionBody(_GenerationBody):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None
    logprobs: int | None = Field(None, ge=0, le=lp_fmt.MAX_TOP_LOGPROBS)


class ChatMessage(_Body):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: Any = None
    tool_call_id: Any = None
    function_call: Any = None
    refusal: Any = None
    reasoning_content: str | None = None  # an assistant turn's reasoning (DeepSeek V3.2/V4 tool loops)


class ChatBody(_GenerationBody):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=lp_fmt.MAX_TOP_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extension (vLLM, llama.cpp): e.g. enable_thinking


# (field, neutral-value test, what the server supports) for values the engine cannot honour
_UNSUPPORTED_COMMON: list[tuple[str, Callable[[Any], bool], str]] = [
    ("n", lambda v: v in (None, 1), "only n=1 is supported"),
    ("presence_penalty", lambda v: not v, "penalties are not supported"),
    ("frequency_penalty", lambda v: not v, "penalties are not supported"),
    ("logit_bias", lambda v: not v, "logit_bias is not supported"),
]
_UNSUPPORTED_COMPLETION = _UNSUPPORTED_COMMON + [
    ("best_of", lambda v: v in (None, 1), "only best_of=1 is supported"),
    ("echo", lambda v: not v, "echo is not supported"),
    ("suffix", lambda v: not v, "suffix (insertion) is not supported"),
]
_UNSUPPORTED_CHAT = _UNSUPPORTED_COMMON + [
    ("functions", lambda v: not v, "the legacy 'functions' field is not supported: use 'tools'"),
    ("function_call", lambda v: v in (None, "none"), "the legacy 'function_call' field is not supported: "
     "use 'tool_choice'"),
    ("modalities", lambda v: not v or list(v) == ["text"], "only the text modality is supported"),
    ("audio", lambda v: v is None, "audio output is not supported"),
    ("prediction", lambda v: v is None, "predicted outputs are not supported"),
]
_CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def _unsupported(body: BaseModel, table) -> None:
    for name, neutral, why in table:
        value = getattr(body, name)
        if not neutral(value):
            raise RequestError(f"{name}={json.dumps(value, default=str)} is not supported by this server: {why}",
                               param=name, code="unsupported_parameter")


def _text_content(content, where: str) -> str:
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type")
            if kind != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"{where}.{j}: only text parts are supported (got type {kind!r})",
                                   param=f"{where}.{j}.type", code="unsupported_parameter")
            parts.append(part["text"])
        return "".join(parts)
    return content or ""


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` checked: [{id, type: function, function: {name,
    arguments (a string)}}]."""
    if not isinstance(calls, list):
        raise RequestError(f"{where}: must be a list of tool calls", param=where)
    out = []
    for k, c in enumerate(calls):
        p = f"{where}.{k}"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(f"{p}.function: an object with 'name' and 'arguments' is required",
                               param=f"{p}.function")
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        out.append({"id": str(c.get("id") or f"call_{k}"), "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def _chat_messages(body: ChatBody) -> list[dict[str, Any]]:
    """Messages as the chat template wants them: role + text content, assistant ``tool_calls``
    and ``tool`` results with their ``tool_call_id``. Raises RequestError naming the message
    field that cannot be served (images, legacy function calls)."""
    out = []
    for i, m in enumerate(body.messages):
        role = _CHAT_ROLES.get(m.role)
        if role is None:
            raise RequestError(f"messages.{i}.role: role {m.role!r} is not supported (supported: "
                               f"{', '.join(_CHAT_ROLES)})", param=f"messages.{i}.role", code="unsupported_parameter")
        if m.function_call:
            raise RequestError(f"messages.{i}.function_call: legacy function calls are not supported: use "
                               "tool_calls", param=f"messages.{i}.function_call", code="unsupported_parameter")
        msg: dict[str, Any] = {"role": role, "content": _text_content(m.content, f"messages.{i}.content")}
        if m.tool_calls:
            if role != "assistant":
                raise RequestError(f"messages.{i}.tool_calls: only assistant messages carry tool calls",
                                   param=f"messages.{i}.tool_calls")
            msg["tool_calls"] = _tool_calls(m.tool_calls, f"messages.{i}.tool_calls")
        if role == "tool":
            if not isinstance(m.tool_call_id, str) or not m.tool_call_id:
                raise RequestError(f"messages.{i}.tool_call_id: a tool message needs the id of the call it "
                                   "answers", param=f"messages.{i}.tool_call_id", code="missing_required_parameter")
            msg["tool_call_id"] = m.tool_call_id
        if m.name:
            msg["name"] = m.name
        if m.reasoning_content is not None and role == "assistant":  # templates that keep it (DeepSeek V4)
            msg["reasoning_content"] = m.reasoning_content
        out.append(msg)
    return out


# ---------------------------------------------------------------------------------------------
# The service the app serves


class Service:
    """What the HTTP layer serves, shared by every request.

    ``engine``: moe_service.engine.engine.Engine (prompts, context policy); ``batch``: the
    started BatchLoop; ``metrics``: moe_service.metrics.Metrics; ``model_name``: the id clients
    send; ``stage``: returns the pipeline stage shown by /health while loading. ``ready`` and
    ``stopping`` are flipped by the serve stage. ``keys`` (moe_service.api.auth.ApiKeys or
    None), ``metrics_auth``, ``allowed_hosts``, ``cors_origins``: serve.* of the same names.
    """

    def __init__(self, *, engine=None, batch=None, metrics=None, model_name: str,
                 stage: Callable[[], str] = lambda: "starting", status_poll_s: float = 0.25,
                 keys=None, metrics_auth: bool = False, allowed_hosts: tuple[str, ...] = (),
                 cors_origins: tuple[str, ...] = (), model_aliases: tuple[str, ...] = ()):
        self.engine = engine
        self.batch = batch
        self.metrics = metrics
        self.model_name = model_name
        self.stage = stage
        self.ready = False
        self.stopping = False
        self.status_poll_s = status_poll_s
        self.keys = keys
        self.metrics_auth = metrics_auth
        self.allowed_hosts = tuple(allowed_hosts)
        self.cors_origins = tuple(cors_origins)
        self.model_aliases = tuple(a for a in model_aliases if a)
        self.max_tokens_policy = "auto"  # serve.max_tokens_policy (plan_output)
        self.max_body_bytes: int | None = None  # serve.max_body_bytes (request_limits.BodyLimit)
        self.body_timeout_s: float | None = None  # serve.body_timeout_s (request_limits.BodyLimit)
        from moe_service.api.response_store import ResponseStore

        self.responses_store = ResponseStore()  # serve.responses_store_mib (previous_response_id)

    def health_problem(self) -> str | None:
        """Why the service cannot do work although it is up (the engine thread died, N steps in
        a row failed, the worker pool is dead, no step completes while requests wait), else
        None. From ``batch.health()`` (moe_service.engine.batch.BatchLoop.health)."""
        check = getattr(self.batch, "health", None)
        return check() if check is not None else None

    def check_serving(self) -> None:
        """Raise RequestError 503 ``loading`` before the engine serves, ``shutting_down`` after
        the serve stage closed it.

        ``stopping`` alone (SIGTERM received, /health already 503) refuses nothing: a request
        that reaches the instance before uvicorn closes its listener and idle connections (the
        next tick of its main loop, ~0.1 s) is served and drained with the others. Refusing it
        would fail a request a balancer sent before its checks saw the 503, and HAProxy's retry
        of a 503 may go back to this same instance (tests/systemd/test_fleet_lab.py, a restart
        by hand with no drain). Once the engine loop stops, BatchLoop.submit refuses.
        """
        if not self.ready or self.engine is None or self.batch is None:
            if self.stopping:
                raise RequestError("the server is shutting down", status=503, type="server_error",
                                   code="shutting_down")
            raise RequestError(f"the model is loading (stage: {self.stage()})", status=503, type="server_error",
                               code="loading")

    def plan_output(self, prompt_tokens: int, requested: int | None, *, endpoint_policy: str,
                    absent: str = "default", param: str = "max_tokens", prompt_param: str = "messages") -> int:
        """The output budget of a request of ``prompt_tokens`` that asked for ``requested``
        tokens (None: gave no limit), for every endpoint: serve.max_tokens_policy, where
        ``auto`` means the endpoint's own ``endpoint_policy`` (``refuse`` | ``clamp``), then
        moe_service.engine.engine.Engine.plan_max_tokens (``absent``: ``default`` =
        serve.max_tokens_default, ``context`` = the rest of the context). Raises RequestError
        400 ``context_length_exceeded`` naming ``param`` or ``prompt_param``."""
        policy = endpoint_policy if self.max_tokens_policy == "auto" else self.max_tokens_policy
        return self.engine.plan_max_tokens(prompt_tokens, requested, prompt_param=prompt_param, param=param,
                                           policy=policy, absent=absent)

    def serves_model(self, model: str) -> bool:
        """True when ``model`` names the served model: its id, or one of serve.model_aliases
        (exact names or fnmatch glob patterns, case-sensitive)."""
        return model == self.model_name or any(model == a or fnmatch.fnmatchcase(model, a)
                                               for a in self.model_aliases)

    def check_model(self, model: str | None) -> None:
        """Refuse (400 ``model_not_found``, naming the served model) a model name that is
        neither the served model nor one of serve.model_aliases; None is accepted."""
        if model is not None and not self.serves_model(model):
            aliases = f" (or a name matching serve.model_aliases: {', '.join(self.model_aliases)})" \
                if self.model_aliases else ""
            raise RequestError(f"The model {model!r} does not exist; this server serves {self.model_name!r}{aliases}",
                               param="model", code="model_not_found")


class _CloseWhenStopping:
    """After SIGTERM (``service.stopping``) every response says ``Connection: close``, so a
    balancer does not send its next request over a kept-alive connection that is about to be
    closed (it would see an empty response and have to retry)."""

    def __init__(self, app, service: Service):
        self.app = app
        self.service = service

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.service.stopping:
            return await self.app(scope, receive, send)

        async def send_closing(message):
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
                message = {**message, "headers": headers + [(b"connection", b"close")]}
            await send(message)

        return await self.app(scope, receive, send_closing)


class _MetricsMiddleware:
    """Counts every HTTP request by route (unknown paths as ``other``) and final status."""

    def __init__(self, app, service: Service):
        self.app = app
        self.service = service

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.service.metrics is None:
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in ROUTES or path.startswith(("/v1/models/", "/v1/responses/")) else "other"
        if endpoint.startswith("/v1/models/"):
            endpoint = "/v1/models/{id}"
        elif endpoint.startswith("/v1/responses/"):
            endpoint = "/v1/responses/{id}"
        status = {"code": 500}

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.service.metrics.count_request(endpoint, status["code"])


# ---------------------------------------------------------------------------------------------
# The app


def create_app(service: Service) -> FastAPI:
    """The FastAPI application over ``service`` (no lifespan: the serve stage runs the rest)."""
    app = FastAPI(title="moe-service", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    app.add_middleware(BodyLimit, service=service)  # inside the metrics middleware: 413s are counted
    from moe_service.api.auth import GuardMiddleware

    app.add_middleware(GuardMiddleware, keys=service.keys, metrics_auth=service.metrics_auth,
                       allowed_hosts=service.allowed_hosts)
    if service.cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(service.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type", "x-api-key", "anthropic-version",
                                          "anthropic-beta"], max_age=600)
    app.add_middleware(_MetricsMiddleware, service=service)
    app.add_middleware(_CloseWhenStopping, service=service)

    from moe_service.api import anthropic
    from moe_service.api.auth import is_anthropic_path

    def _answer(request: Request, err: RequestError):  # each protocol's own error envelope
        return anthropic.error_response(err) if is_anthropic_path(request.url.path) else error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, exc: RequestValidationError):
        return _answer(request, validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(request: Request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        msg = f"{request.method} {request.url.path}: {exc.detail}"
        return _answer(request, RequestError(msg, status=exc.status_code, type=kind, code=code))

    @app.get("/health")
    async def health():
        if service.stopping:
            return JSONResponse({"status": "stopping"}, status_code=503)
        if not service.ready:
            return JSONResponse({"status": "loading", "stage": service.stage()}, status_code=503)
        problem = service.health_problem()
        if problem is not None:  # liveness means work completes: up but unable is not ok
            return JSONResponse({"status": "unhealthy", "reason": problem}, status_code=503)
        batch = service.batch
        return {"status": "ok", "model": service.model_name,
                "active": batch.active if batch else 0, "queued": batch.waiting if batch else 0}

    @app.get("/metrics")
    async def metrics():
        if service.metrics is None:
            return Response("", media_type="text/plain")
        service.metrics.ready.set(1 if service.ready and not service.stopping else 0)
        body, content_type = service.metrics.render()
        return Response(body, media_type=content_type)

    def _model_card() -> dict[str, Any]:
        created = service.engine.created_s if service.engine is not None else int(time.time())
        card: dict[str, Any] = {"id": service.model_name, "object": "model", "created": created,
                                "owned_by": "moe-service"}
        if service.engine is not None:  # the served context (OpenRouter's field; Codex's catalog of
            card["context_length"] = service.engine.n_ctx  # an OpenAI-compatible provider reads it)
        return card

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if not service.serves_model(model_id):
            return error_response(RequestError(f"The model {model_id!r} does not exist", status=404,
                                               param="model", code="model_not_found"))
        return _model_card()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(service, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(service, request, chat=True)

    @app.post("/v1/messages")  # Anthropic's Messages API (moe_service.api.anthropic); ?beta=true too
    async def messages(request: Request):
        return await anthropic.messages(service, request)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        return await anthropic.count_tokens(service, request)

    @app.post("/v1/responses")
    async def responses(request: Request):
        from moe_service.api import responses as rs

        return await rs.create_response(service, request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        from moe_service.api import responses as rs

        return rs.get_stored(service, response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        from moe_service.api import responses as rs

        return rs.delete_stored(service, response_id)

    return app


async def _generate(service: Service, request: Request, *, chat: bool):
    """Validate, tokenize, submit, then answer (JSON or SSE). Every failure is an error object."""
    t_arrival = time.monotonic()
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    try:
        service.check_serving()
        data = await read_json(request)
        body = validate_body(ChatBody, data) if chat else validate_body(CompletionBody, data)
        _unsupported(body, _UNSUPPORTED_CHAT if chat else _UNSUPPORTED_COMPLETION)
        service.check_model(body.model)
        check_stop_strings(body.stop)
        # queue place and prompt size before the (costly, shared-thread-pool) tokenization
        admission_precheck(service, chat_chars(body.messages) if chat else prompt_chars(body.prompt),
                           param="messages" if chat else "prompt")
        engine = service.engine
        plan = None
        n_logprobs = None
        if chat:
            from moe_service.api.chat import check_response_format, check_tools, plan_chat

            messages = _chat_messages(body)
            tools = check_tools(body.tools)
            schema, schema_param = check_response_format(body.response_format)
            if body.logprobs:
                n_logprobs = body.top_logprobs or 0
            elif body.top_logprobs:
                raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
            plan = await asyncio.to_thread(
                plan_chat, engine, messages, tools=tools, tool_choice=body.tool_choice,
                parallel_tool_calls=body.parallel_tool_calls, schema=schema,
                template_kwargs=body.chat_template_kwargs, reasoning_effort=body.reasoning_effort,
                schema_param=schema_param)
            prompt_ids = plan.prompt_ids
            requested, param = ((body.max_completion_tokens, "max_completion_tokens")
                                if body.max_completion_tokens is not None else (body.max_tokens, "max_tokens"))
            max_tokens = service.plan_output(len(prompt_ids), requested, endpoint_policy="refuse", param=param)
        else:
            n_logprobs = body.logprobs
            prompt = body.prompt
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
                if len(prompt) != 1:
                    raise RequestError(f"prompt: one prompt per request is supported (got {len(prompt)})",
                                       param="prompt", code="unsupported_parameter")
                prompt = prompt[0]
            prompt_ids = await asyncio.to_thread(engine.encode_prompt, prompt)
            max_tokens = service.plan_output(len(prompt_ids), body.max_tokens, endpoint_policy="refuse",
                                             prompt_param="prompt")
        from moe_service.engine.sampler import SamplingParams

        sampling = SamplingParams.of_request(body.temperature, body.top_k, body.top_p, body.seed)
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        events = Events()
        greq = GenerationRequest(prompt_ids, max_tokens, sampling, stop, events.emit, request_id, t_arrival,
                                 ignore_eos=bool(body.ignore_eos),
                                 constraint=plan.constraint if plan is not None else None, logprobs=n_logprobs)
        if (rejected := submit(service, greq, events, endpoint)) is not None:
            return error_response(rejected)  # a 429 with its Retry-After
    except Exception as e:  # the request's mistake, a limit, or a bug (a 500): the server keeps serving
        return error_response(refusal(e, endpoint, request_id))

    created = int(time.time())
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _stream(service, request, greq, events, chat=chat, created=created, include_usage=include_usage,
                    endpoint=endpoint, plan=plan),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Request-Id": request_id},
        )
    return await _complete(service, request, greq, events, chat=chat, created=created, endpoint=endpoint, plan=plan)


def _usage(ev: Event) -> dict[str, int]:
    return {"prompt_tokens": ev.prompt_tokens, "completion_tokens": ev.completion_tokens,
            "total_tokens": ev.prompt_tokens + ev.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": ev.cached_tokens}}


async def _complete(service: Service, request: Request, greq: GenerationRequest, events: Events, *,
                    chat: bool, created: int, endpoint: str, plan=None):
    """Wait for the whole completion; cancel it when the client disconnects meanwhile."""
    parts: list[str] = []
    tokens: list[int] = []
    logprobs: list = []

    def step(ev: Event) -> None:
        parts.append(ev.text)
        tokens.extend(ev.token_ids)
        logprobs.extend(ev.logprobs or ())

    ev = await await_final(service, request, greq, events, endpoint, step)
    if ev is None:
        return Response(status_code=499)
    if ev.error is not None:
        return error_response(ev.error)
    text = "".join(parts)
    tokenizer = service.engine.tokenizer
    if chat:
        from moe_service.api.chat import MessageBuilder

        mb = MessageBuilder()
        parser = plan.parser()
        mb.add(parser.feed(text, tokens))
        mb.add(parser.finish(ev.finish_reason))
        choice = {"index": 0, "message": mb.message(),
                  "logprobs": lp_fmt.chat_logprobs(tokenizer, logprobs) if greq.logprobs is not None else None,
                  "finish_reason": mb.finish_reason(ev.finish_reason)}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text,
                  "logprobs": lp_fmt.CompletionLogprobs(tokenizer).block(logprobs) if greq.logprobs is not None
                  else None, "finish_reason": ev.finish_reason}
        obj = "text_completion"
    return JSONResponse(
        {"id": greq.request_id, "object": obj, "created": created, "model": service.model_name,
         "choices": [choice], "usage": _usage(ev)},
        headers={"X-Request-Id": greq.request_id},
    )


async def _stream(service: Service, request: Request, greq: GenerationRequest, events: Events, *, chat: bool,
                  created: int, include_usage: bool, endpoint: str, plan=None):
    """SSE chunks as the OpenAI API sends them; cancels the sequence if the client goes away.

    Chat: the text goes through the plan's parser, so a chunk's delta holds ``content``,
    ``reasoning_content`` or ``tool_calls`` (a call's id and name first, then its arguments);
    logprobs ride on the first chunk of the engine events they came with.
    """
    obj = "chat.completion.chunk" if chat else "text_completion"
    head = {"id": greq.request_id, "object": obj, "created": created, "model": service.model_name}
    tokenizer = service.engine.tokenizer
    want_lp = greq.logprobs is not None
    parser = plan.parser() if chat else None
    if chat:
        from moe_service.api.chat import StreamBuilder

        builder = StreamBuilder()
    else:
        clp = lp_fmt.CompletionLogprobs(tokenizer)

    def out(choice: dict[str, Any]) -> str:
        o = {**head, "choices": [choice]}
        if include_usage:
            o["usage"] = None
        return sse_data(o)

    def chat_chunks(ev: Event) -> list[str]:
        parsed = parser.feed(ev.text, ev.token_ids)
        if ev.final:
            parsed += parser.finish(ev.finish_reason)
        deltas = builder.deltas(parsed, final=ev.final)
        lps = lp_fmt.chat_logprobs(tokenizer, ev.logprobs or []) if want_lp and ev.logprobs else None
        if lps is not None and not deltas:
            deltas = [{}]
        chunks = []
        for i, d in enumerate(deltas):
            chunks.append(out({"index": 0, "delta": d, "logprobs": lps if i == 0 else None, "finish_reason": None}))
        if ev.final:
            chunks.append(out({"index": 0, "delta": {}, "logprobs": None,
                               "finish_reason": builder.finish_reason(ev.finish_reason)}))
        return chunks

    done = False
    try:
        if chat:
            yield out({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                       "finish_reason": None})
        while True:
            first = await events.get(None)
            batch = events.burst(first)
            ev = merge_events(batch)
            if ev.error is not None:
                done = True
                finish_request(service, greq, ev, endpoint, stream=True)
                yield sse_data(ev.error.to_dict())
                yield "data: [DONE]\n\n"
                return
            if chat:
                for c in chat_chunks(ev):
                    yield c
            elif ev.text or ev.final or (want_lp and ev.logprobs):
                yield out({"index": 0, "text": ev.text or "",
                           "logprobs": clp.block(ev.logprobs or []) if want_lp else None,
                           "finish_reason": ev.finish_reason})
            if ev.final:
                done = True
                finish_request(service, greq, ev, endpoint, stream=True)
                if include_usage:
                    yield sse_data({**head, "choices": [], "usage": _usage(ev)})
                yield "data: [DONE]\n\n"
                return
    finally:
        events.close()
        if not done:
            log.info("client_disconnected", request_id=greq.request_id, endpoint=endpoint,
                     completion_tokens=None)
            service.batch.cancel(greq)


__all__ = ["Service", "create_app", "error_response", "ChatBody", "CompletionBody"]
