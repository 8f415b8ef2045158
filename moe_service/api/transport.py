"""What every protocol endpoint shares with the others, below all of them (chat completions
and completions in moe_service.server, the Anthropic Messages API in api/anthropic.py, the
Responses API in api/responses.py): reading a JSON body within the request limits and
validating it, a pydantic error as a RequestError naming the field, the OpenAI error response, the channel that carries
a request's events from the engine thread to its event loop, merging events, the SSE line,
submitting a request to the batch loop, a refused request's log line and answer, waiting
for a non-streamed request's final event (cancelled when its client goes away), and finishing
a request (metrics and its log line).

The protocols import this module; none of them imports the server, and the server imports
them, so dependencies point one way (tests/test_structure.py).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from moe_service.engine.engine import Event, GenerationRequest, RequestError
from moe_service.log import get_logger
from moe_service.request_limits import parse_json_body

log = get_logger("moe_service.server")

BodyModel = TypeVar("BodyModel", bound=BaseModel)


def validation_error(e: ValidationError | RequestValidationError) -> RequestError:
    """The first pydantic error as a 400 naming the field (``messages.0.content``)."""
    errors = e.errors()
    if not errors:
        return RequestError("invalid request body")
    err = errors[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    # unions report the member tried (e.g. 'str'): keep the request's own path only
    path: list[str] = []
    for p in loc:
        if p in ("str", "int", "float", "list[int]", "list[str]", "list[list[int]]", "bool") or "[" in p:
            continue
        path.append(p)
    param = ".".join(path) or None
    kind = err.get("type", "")
    if kind == "extra_forbidden":
        return RequestError(f"Unrecognized request argument supplied: {param}", param=param, code="unknown_parameter")
    if kind == "missing":
        return RequestError(f"{param}: this field is required", param=param, code="missing_required_parameter")
    if kind == "json_invalid":
        return RequestError(f"invalid JSON body: {err.get('msg')}", code="invalid_json")
    return RequestError(f"{param}: {err.get('msg')} (got {json.dumps(err.get('input'), default=str)[:80]})"
                        if param else str(err.get("msg")), param=param, code="invalid_value")


def error_response(err: RequestError, headers: dict[str, str] | None = None) -> JSONResponse:
    if headers is None and getattr(err, "retry_after_s", None) is not None:  # 429 from any check
        headers = {"Retry-After": str(err.retry_after_s)}
    return JSONResponse(err.to_dict(), status_code=err.status, headers=headers)


class Mailbox:
    """Hands events from the engine thread to one event loop, one wake-up per burst: a decode
    step emits a token for every active sequence back to back, and the first post schedules
    one delivery that takes them all (a wake-up per event cost the engine thread ~12% of its
    time with 4 streams on 2 cores: each write to the loop's self-pipe woke the loop there)."""

    _by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox] = weakref.WeakKeyDictionary()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue, Event]] = []
        self._scheduled = False

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> Mailbox:
        try:
            box = cls._by_loop.get(loop)
            if box is None:
                box = cls._by_loop[loop] = cls(loop)
        except TypeError:  # a loop type without weak references: one mailbox per request then
            box = cls(loop)
        return box

    def post(self, queue: asyncio.Queue, ev: Event) -> None:  # engine thread
        """Queue ``ev`` for ``queue``; raises RuntimeError when the loop is closed (the
        requester is gone, so the engine cancels the sequence)."""
        if self.loop.is_closed():
            raise RuntimeError("the event loop is closed")
        with self._lock:
            self._items.append((queue, ev))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:
            with self._lock:
                self._scheduled = False
            raise

    def _deliver(self) -> None:  # the loop's thread
        with self._lock:
            items, self._items, self._scheduled = self._items, [], False
        for queue, ev in items:
            queue.put_nowait(ev)


class Events:
    """Receives a request's events from the engine thread; ``get`` keeps one pending read so a
    timeout loses nothing."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self._mailbox = Mailbox.of(self.loop)
        self._pending: asyncio.Task | None = None

    def emit(self, ev: Event) -> None:  # engine thread
        self._mailbox.post(self.queue, ev)

    async def get(self, timeout_s: float | None = None) -> Event | None:
        if self._pending is None:
            self._pending = asyncio.ensure_future(self.queue.get())
        done, _ = await asyncio.wait({self._pending}, timeout=timeout_s)
        if not done:
            return None
        task, self._pending = self._pending, None
        return task.result()

    def get_nowait(self) -> Event | None:
        if self._pending is not None:
            return None
        try:
            return self.queue.get_nowait()
        except asyncio.QueueEmpty:
            return None

    def close(self) -> None:
        if self._pending is not None:
            self._pending.cancel()

    def burst(self, first: Event) -> list[Event]:
        """``first`` and every event already queued behind it, up to the final one: what a
        stream sends in one write (a decode step emits one token per sequence at a time, and
        the loop may wake for several)."""
        batch = [first]
        while not batch[-1].final:
            more = self.get_nowait()
            if more is None:
                break
            batch.append(more)
        return batch


def merge_events(events: list[Event]) -> Event:
    last = events[-1]
    lps = [x for e in events for x in (e.logprobs or ())]
    return Event(text="".join(e.text for e in events), n_tokens=sum(e.n_tokens for e in events),
                 finish_reason=last.finish_reason, prompt_tokens=last.prompt_tokens,
                 completion_tokens=last.completion_tokens, error=last.error,
                 token_ids=[t for e in events for t in e.token_ids], logprobs=lps, cached_tokens=last.cached_tokens,
                 stop_sequence=last.stop_sequence)


def sse_data(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def read_json(request: Request) -> Any:
    """The body as JSON within moe_service.request_limits' bounds (RequestError 400 otherwise)."""
    return parse_json_body(await request.body())


def validate_body(model: type[BodyModel], data: Any) -> BodyModel:
    """A request's JSON body (``data``) as ``model``: a 400 when it is not an object, or the
    first pydantic error as a 400 naming the field (``validation_error``)."""
    if not isinstance(data, dict):
        raise RequestError("the request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


def refusal(e: Exception, endpoint: str, request_id: str | None = None) -> RequestError:
    """The error to answer a request with that failed before reaching the engine, logged: a
    RequestError (the request's mistake, a limit) as ``request_invalid``; any other exception
    is a bug, logged as ``request_failed`` with its traceback and answered as a 500 while the
    server keeps serving. ``request_id``: logged when given."""
    ids = {} if request_id is None else {"request_id": request_id}
    if isinstance(e, RequestError):
        log.info("request_invalid", **ids, endpoint=endpoint, status=e.status, param=e.param, error=e.message)
        return e
    log.error("request_failed", **ids, endpoint=endpoint, error=f"{type(e).__name__}: {e}", exc_info=e)
    return RequestError(f"internal error: {type(e).__name__}", status=500, type="server_error")


def submit(service: Any, greq: GenerationRequest, events: Events, endpoint: str) -> RequestError | None:
    """Queue ``greq`` in ``service.batch``: None, or its refusal there (the 429 of a full
    queue, with its retry_after_s; shutting down), logged as ``request_rejected``, ``events``
    closed."""
    try:
        service.batch.submit(greq)
    except RequestError as e:
        events.close()
        log.info(
            "request_rejected", request_id=greq.request_id, endpoint=endpoint, status=e.status, reason=e.code
        )
        return e
    return None


def finish_request(service: Any, greq: GenerationRequest, ev: Event, endpoint: str, stream: bool) -> None:
    """Count a finished request in ``service.metrics`` (the server.Service's Prometheus
    metrics, or None) and log its ``request_done`` line (tokens, TTFT, duration)."""
    duration = time.monotonic() - greq.t_arrival_s
    ttft = None if greq.t_first_token_s is None else round(greq.t_first_token_s - greq.t_arrival_s, 4)
    if service.metrics is not None:
        service.metrics.count_tokens(ev.prompt_tokens, ev.completion_tokens)
        service.metrics.duration.labels(endpoint=endpoint).observe(duration)
    log.info("request_done", request_id=greq.request_id, endpoint=endpoint, stream=stream,
             finish_reason=ev.finish_reason, error=ev.error.message if ev.error else None,
             prompt_tokens=ev.prompt_tokens, completion_tokens=ev.completion_tokens, ttft_s=ttft,
             duration_s=round(duration, 4))


async def await_final(
    service: Any,
    request: Request,
    greq: GenerationRequest,
    events: Events,
    endpoint: str,
    on_event: Callable[[Event], object],
) -> Event | None:
    """The final event of a non-streamed request, each event (error events too) handed to
    ``on_event`` as it arrives; the request is then finished (``finish_request``, stream=False).

    None when the client went away meanwhile: ``request.is_disconnected()`` is asked at most once
    every ``service.status_poll_s`` seconds (tokens may flow faster than that), and that is logged
    as ``client_disconnected``. Whenever no final event arrived (the client went away, or
    ``on_event`` raised) the sequence is cancelled in ``service.batch`` and nothing is finished.
    """
    done = False
    ev = None
    next_check = time.monotonic() + service.status_poll_s
    try:
        while True:
            ev = await events.get(service.status_poll_s)
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + service.status_poll_s
                if await request.is_disconnected():
                    log.info("client_disconnected", request_id=greq.request_id, endpoint=endpoint)
                    return None
            if ev is None:
                continue
            on_event(ev)
            if ev.final:
                done = True
                break
    finally:
        events.close()
        if not done:
            service.batch.cancel(greq)
    finish_request(service, greq, ev, endpoint, stream=False)
    return ev
