"""The Anthropic Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

Claude Code (``ANTHROPIC_BASE_URL``) and the ``anthropic`` SDKs speak it. One request model,
converted into the chat request the engine already serves; no second inference path::

    body --MessagesBody (pydantic; unknown fields accepted and ignored: context_management,
      output_config, metadata, container, ...)--> to_chat():
        system (string | text blocks)            -> a system message (without Claude Code's
                                                    per-request billing-header block)
        user text blocks                         -> user messages
        user tool_result blocks (string | text)  -> tool messages (tool_call_id = tool_use_id;
                                                    is_error: the text gets an "Error: " prefix)
        assistant text / thinking / tool_use     -> content, reasoning_content, tool_calls
        redacted_thinking                        -> dropped (we cannot read it)
        tools (input_schema)                     -> function tools
        tool_choice auto | any | tool | none     -> auto | required | named | none
          (disable_parallel_tool_use: parallel_tool_calls false)
        thinking enabled | disabled | adaptive   -> the template's reasoning switch
          (enable_thinking / thinking true | false | the model's default)
        output_config.effort                     -> the template's reasoning_effort
      --> moe_service.api.chat.plan_chat (chat template, per-family tool prompt, grammar for
          any / tool) --> Service.plan_output (max_tokens; serve.max_tokens_policy, "clamp" by
          default here) --> BatchLoop.submit (prefix cache, admission, 429)
    engine events --ChatPlan.parser()--> deltas --_Blocks--> content blocks text / thinking /
      tool_use (input as an object), or the named SSE events: message_start, ping,
      content_block_start, content_block_delta (text_delta, thinking_delta, input_json_delta,
      signature_delta), content_block_stop, message_delta, message_stop; error

``stop_reason``: ``end_turn`` (end of turn), ``tool_use`` (a call was made),
``max_tokens`` (max_tokens or the context reached: a call cut there is dropped, never
text), ``stop_sequence`` (with the ``stop_sequence`` that matched). ``usage``:
``input_tokens`` = prompt tokens not read from the prefix cache, ``cache_read_input_tokens`` =
those read from it (as Anthropic counts them), ``cache_creation_input_tokens`` = 0 (every
prompt enters the cache without being asked; cache_control is ignored), ``output_tokens``.
The answer's ``model`` is the name the client sent (an alias of the served model, see
serve.model_aliases).

Errors: every refusal on these paths is Anthropic's envelope ``{"type": "error", "error":
{"type", "message"}}`` (:func:`error_body`), the middleware's 401/413/415 and the 429 of a
full queue included; a 400 names the request field (``messages.1.content.0.type``). Images
and documents get a 400 naming the block; a ``tool_result`` whose ``tool_use_id`` is not a
``tool_use`` of the previous assistant message gets a 400 naming the field. Nothing of a
refused request reaches the engine.

Not served (refused by name): a final assistant message (prefill), image/document/search
blocks, server tool results. Accepted and not enforced: ``thinking.budget_tokens`` (the
reasoning runs within max_tokens), ``cache_control``, ``metadata``, ``service_tier``.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from moe_service.api.envelopes import ERROR_TYPES, error_body, error_type  # noqa: F401  (part of this API)
from moe_service.api.transport import (
    Events,
    await_final,
    finish_request,
    merge_events,
    refusal,
    submit,
    validate_body,
)
from moe_service.engine.engine import Event, RequestError
from moe_service.log import get_logger

log = get_logger(__name__)

MAX_STOP_SEQUENCES = 8
"""Most ``stop_sequences`` a request may give (each at most request_limits.MAX_STOP_CHARS)."""

PING_INTERVAL_S = 10.0
"""A streamed answer sends a ``ping`` event after this long without another event (a long
prefill), so proxies and clients see the connection alive."""

ENDPOINT_POLICY = "clamp"
"""serve.max_tokens_policy = auto on /v1/messages: Claude Code asks for max_tokens 32000 on
every request whatever the model's context; refusing would stop it on any model with less than
~45k context, so what fits is served and the answer ends with stop_reason max_tokens."""


def error_response(err: RequestError, request_id: str | None = None):
    """A JSONResponse with the envelope (and Retry-After for a 429, request-id when known).
    The envelope has no ``param``: a message that does not name the field at fault is
    prefixed with it (``max_tokens: ...``)."""
    from fastapi.responses import JSONResponse

    headers = {}
    if getattr(err, "retry_after_s", None) is not None:
        headers["Retry-After"] = str(err.retry_after_s)
    if request_id:
        headers["request-id"] = request_id
    message = err.message if not err.param or err.param in err.message else f"{err.param}: {err.message}"
    return JSONResponse(error_body(err.status, message), status_code=err.status, headers=headers or None)


# ---------------------------------------------------------------------------------------------
# Request


class _Body(BaseModel):
    """Unknown fields are accepted and ignored (clients send betas we do not know)."""

    model_config = ConfigDict(extra="allow")


class CountTokensBody(_Body):
    """POST /v1/messages/count_tokens: what shapes the prompt."""

    model: str
    messages: list[Any]
    system: str | list[Any] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None


class MessagesBody(CountTokensBody):
    """POST /v1/messages. ``temperature`` 0..1 as Anthropic's API takes it; ``top_p`` in (0, 1]."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    metadata: dict[str, Any] | None = None
    stream: bool | None = False


def _text_of(blocks: Any, where: str, *, what: str) -> str:
    """The text of a string or of a list of ``text`` blocks; any other block is a 400 naming it."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise RequestError(f"{where}: must be a string or a list of content blocks", param=where)
    parts = []
    for j, b in enumerate(blocks):
        p = f"{where}.{j}"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            parts.append(b["text"])
            continue
        _refuse_block(kind, p, what=what)
    return "\n".join(parts) if what == "tool_result" else "".join(parts)


def _refuse_block(kind: Any, p: str, *, what: str) -> None:
    if kind in ("image", "document"):
        raise RequestError(
            f"{p}: {kind} blocks are not supported: this server's model reads text only",
            param=f"{p}.type",
            code="unsupported_content",
        )
    if not isinstance(kind, str):
        raise RequestError(f"{p}.type: a content block needs a 'type'", param=f"{p}.type")
    raise RequestError(
        f"{p}.type: block type {kind!r} is not supported in {what} (supported: {_SUPPORTED[what]})",
        param=f"{p}.type",
        code="unsupported_content",
    )


_SUPPORTED = {
    "system": "text",
    "user": "text, tool_result",
    "assistant": "text, thinking, redacted_thinking, tool_use",
    "tool_result": "text",
}


def _assistant(content: Any, where: str) -> tuple[dict[str, Any], list[str]]:
    """An assistant message (chat shape) and the ids of its tool_use blocks."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}, []
    if not isinstance(content, list):
        raise RequestError(f"{where}: must be a string or a list of content blocks", param=where)
    text: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, b in enumerate(content):
        p = f"{where}.{j}"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            text.append(b["text"])
        elif kind == "thinking":
            if isinstance(b.get("thinking"), str):
                reasoning.append(b["thinking"])
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            cid, name, args = b.get("id"), b.get("name"), b.get("input", {})
            if not isinstance(cid, str) or not cid:
                raise RequestError(f"{p}.id: a tool_use block needs its id", param=f"{p}.id")
            if not isinstance(name, str) or not name:
                raise RequestError(f"{p}.name: a tool_use block needs the tool's name", param=f"{p}.name")
            if not isinstance(args, dict):
                raise RequestError(f"{p}.input: must be an object", param=f"{p}.input")
            calls.append(
                {
                    "id": cid,
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
                }
            )
        else:
            _refuse_block(kind, p, what="assistant")
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if reasoning:
        msg["reasoning_content"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    return msg, [c["id"] for c in calls]


def _user(content: Any, where: str, open_calls: Sequence[str]) -> list[dict[str, Any]]:
    """A user message as chat messages: its tool_result blocks as ``tool`` messages (each
    answering a tool_use of the previous assistant message), then its text."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise RequestError(f"{where}: must be a string or a list of content blocks", param=where)
    results: list[dict[str, Any]] = []
    text: list[str] = []
    for j, b in enumerate(content):
        p = f"{where}.{j}"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            text.append(b["text"])
        elif kind == "tool_result":
            tid = b.get("tool_use_id")
            if not isinstance(tid, str) or tid not in open_calls:
                known = ", ".join(open_calls) or "none"
                raise RequestError(
                    f"{p}.tool_use_id: {json.dumps(tid)} does not answer a tool_use block of the "
                    f"previous assistant message (its tool_use ids: {known})",
                    param=f"{p}.tool_use_id",
                )
            body = _text_of(b.get("content", ""), f"{p}.content", what="tool_result")
            if b.get("is_error"):
                body = f"Error: {body}"
            results.append({"role": "tool", "tool_call_id": tid, "content": body})
        else:
            _refuse_block(kind, p, what="user")
    out = results
    if text or not results:
        out.append({"role": "user", "content": "".join(text)})
    return out


BILLING_HEADER = "x-anthropic-billing-header:"
"""Claude Code (2.1.29+) puts ``x-anthropic-billing-header: cc_version=...; cc_entrypoint=...;
cch=<hash>;`` as the first system block: telemetry for Anthropic's billing, no meaning to a
model, and its ``cch`` hash changes with every request. At the very start of the prompt it
would make every turn miss the prefix cache, so it is dropped (as sglang #21064 and
vllm-mlx #277 do; claude-code #68900)."""


def _without_billing_header(system: Any) -> Any:
    """``system`` without Claude Code's billing-header block (or line, in a string)."""
    if isinstance(system, str):
        if system.startswith(BILLING_HEADER):
            return system.split("\n", 1)[1] if "\n" in system else ""
        return system
    if isinstance(system, list):
        return [
            b
            for b in system
            if not (
                isinstance(b, dict)
                and b.get("type") == "text"
                and isinstance(b.get("text"), str)
                and b["text"].startswith(BILLING_HEADER)
            )
        ]
    return system


def to_chat_messages(body: CountTokensBody) -> list[dict[str, Any]]:
    """The request's system and messages as the chat messages moe_service.api.chat.plan_chat
    takes. Raises RequestError naming the field at fault."""
    out: list[dict[str, Any]] = []
    if body.system is not None:
        system = _text_of(_without_billing_header(body.system), "system", what="system")
        if system:
            out.append({"role": "system", "content": system})
    if not body.messages:
        raise RequestError("messages: at least one message is required", param="messages")
    open_calls: list[str] = []
    for i, m in enumerate(body.messages):
        p = f"messages.{i}"
        if not isinstance(m, dict):
            raise RequestError(f"{p}: must be an object with 'role' and 'content'", param=p)
        role = m.get("role")
        if "content" not in m:
            raise RequestError(f"{p}.content: this field is required", param=f"{p}.content")
        if role == "user":
            out.extend(_user(m["content"], f"{p}.content", open_calls))
            open_calls = []
        elif role == "assistant":
            if i == len(body.messages) - 1:
                raise RequestError(
                    f"{p}: a final assistant message (a prefill to continue) is not supported: "
                    "end with a user message",
                    param=p,
                    code="unsupported_parameter",
                )
            msg, open_calls = _assistant(m["content"], f"{p}.content")
            out.append(msg)
        else:
            raise RequestError(
                f"{p}.role: must be 'user' or 'assistant' (got {json.dumps(role)}); the system "
                "prompt goes in 'system'",
                param=f"{p}.role",
            )
    return out


def to_chat_tools(tools: list[Any] | None) -> tuple[list[dict[str, Any]], list[int]]:
    """Anthropic tools (``name``, ``description``, ``input_schema``) as function tools, and for
    each the index of the request's tool it came from; server tools (a ``type`` such as
    web_search_20250305 or bash_20250124) cannot run here and are skipped, logged. Raises
    RequestError naming the field (checked by chat.check_tools)."""
    from moe_service.api.chat import check_tools

    out = []
    index: list[int] = []
    for i, t in enumerate(tools or []):
        p = f"tools.{i}"
        if not isinstance(t, dict):
            raise RequestError(f"{p}: must be an object with 'name' and 'input_schema'", param=p)
        kind = t.get("type")
        if kind not in (None, "custom"):
            log.info(
                "anthropic_tool_skipped", tool=t.get("name"), type=kind, reason="server tools cannot run here"
            )
            continue
        schema = t.get("input_schema")
        if not isinstance(schema, dict):
            raise RequestError(
                f"{p}.input_schema: a JSON schema object is required", param=f"{p}.input_schema"
            )
        fn = {"name": t.get("name"), "description": t.get("description"), "parameters": schema}
        out.append({"type": "function", "function": fn})
        index.append(i)
    try:
        return check_tools(out), index
    except RequestError as e:
        raise _tool_field(e, index) from None


def _tool_field(e: RequestError, index: Sequence[int]) -> RequestError:
    """``e`` naming the request's own tool field (``tools.3.name``, ``tools.3.input_schema``)
    instead of the converted function tool's (``tools.2.function.parameters``)."""
    parts = (e.param or "").split(".", 2)
    if len(parts) < 3 or parts[0] != "tools" or not parts[1].isdigit() or int(parts[1]) >= len(index):
        return e
    field = {"function.name": "name", "function.parameters": "input_schema"}.get(parts[2], parts[2])
    param = f"tools.{index[int(parts[1])]}.{field}"
    return RequestError(e.message.replace(e.param or "", param), param=param, code=e.code)


def to_chat_tool_choice(
    choice: dict[str, Any] | None, tools: list[dict[str, Any]]
) -> tuple[Any, bool | None]:
    """(chat tool_choice, parallel_tool_calls) for Anthropic's ``tool_choice``."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind == "auto":
        return ("auto" if tools else None), parallel
    if kind == "none":
        return "none", None
    if kind == "any":
        if not tools:
            raise RequestError(
                "tool_choice: type 'any' needs at least one tool in 'tools'", param="tool_choice.type"
            )
        return "required", parallel
    if kind == "tool":
        name = choice.get("name")
        names = [t["function"]["name"] for t in tools]
        if name not in names:
            raise RequestError(
                f"tool_choice.name: {json.dumps(name)} is not one of the tools "
                f"({', '.join(names) or 'none given'})",
                param="tool_choice.name",
            )
        return {"type": "function", "function": {"name": name}}, parallel
    raise RequestError(
        f"tool_choice.type: must be 'auto', 'any', 'tool' or 'none' (got {json.dumps(kind)})",
        param="tool_choice.type",
    )


def template_switches(body: CountTokensBody) -> tuple[dict[str, Any], str | None]:
    """(chat template variables, reasoning_effort) from ``thinking`` and ``output_config``:
    ``enabled`` / ``disabled`` set the template's reasoning switch (``enable_thinking`` for
    Qwen3-style templates, ``thinking`` for DeepSeek V3.1-style ones); ``adaptive`` or none
    leaves the model's default; ``output_config.effort`` low/medium/high (max: high) becomes
    ``reasoning_effort`` (gpt-oss templates read it)."""
    tvars: dict[str, Any] = {}
    thinking = body.thinking or {}
    kind = thinking.get("type")
    if kind in ("enabled", "disabled"):
        tvars["enable_thinking"] = tvars["thinking"] = kind == "enabled"
    elif kind not in (None, "adaptive"):
        raise RequestError(
            f"thinking.type: must be 'enabled', 'disabled' or 'adaptive' (got {json.dumps(kind)})",
            param="thinking.type",
        )
    effort = (body.output_config or {}).get("effort")
    effort = {"max": "high"}.get(effort, effort) if effort in ("low", "medium", "high", "max") else None
    return tvars, effort


def _validate(model: type[BaseModel], data: Any) -> Any:
    """``validate_body``, the fields this API ignores logged (``anthropic_fields_ignored``)."""
    body = validate_body(model, data)
    if body.model_extra:
        log.info("anthropic_fields_ignored", fields=sorted(body.model_extra))
    return body


async def _plan(service, body: CountTokensBody):
    """Convert and render: (ChatPlan, chat messages). Raises RequestError."""
    from moe_service.api.chat import plan_chat

    messages = to_chat_messages(body)
    tools, index = to_chat_tools(body.tools)
    tool_choice, parallel = to_chat_tool_choice(body.tool_choice, tools)
    tvars, effort = template_switches(body)
    try:
        plan = await asyncio.to_thread(
            plan_chat,
            service.engine,
            messages,
            tools=tools,
            tool_choice=tool_choice,
            parallel_tool_calls=parallel,
            schema=None,
            template_kwargs=tvars,
            reasoning_effort=effort,
        )
    except RequestError as e:  # a schema the grammar engine cannot enforce: the request's field
        raise _tool_field(e, index) from None
    return plan, messages


# ---------------------------------------------------------------------------------------------
# Handlers


async def count_tokens(service, request) -> Any:
    """POST /v1/messages/count_tokens: ``{"input_tokens": N}``, the prompt's tokens as
    /v1/messages would render it (chat template, tools). Nothing runs on the engine."""
    from moe_service.request_limits import admission_precheck, chat_chars, parse_json_body

    try:
        service.check_serving()
        body = _validate(CountTokensBody, parse_json_body(await request.body()))
        service.check_model(body.model)
        messages = to_chat_messages(body)
        limit = getattr(service.engine, "max_prompt_chars", None)
        if limit is not None:  # the character bound only: counting takes no queue place
            admission_precheck(_NoQueue(service), chat_chars(messages), param="messages")
        plan, _ = await _plan(service, body)
    except Exception as e:  # the request's mistake, a limit, or a bug (a 500): the server keeps serving
        return error_response(refusal(e, "/v1/messages/count_tokens"))
    return {"input_tokens": len(plan.prompt_ids)}


class _NoQueue:
    """The service seen by admission_precheck without its queue (count_tokens queues nothing)."""

    def __init__(self, service):
        self.engine = service.engine
        self.batch = None


async def messages(service, request) -> Any:
    """POST /v1/messages: validate and convert, submit to the engine, answer as one message or
    as the named SSE events (module docstring). Every failure is Anthropic's envelope."""
    from fastapi.responses import JSONResponse, StreamingResponse

    from moe_service.engine.engine import GenerationRequest
    from moe_service.engine.sampler import SamplingParams
    from moe_service.request_limits import MAX_STOP_CHARS, admission_precheck, chat_chars, parse_json_body

    t_arrival = time.monotonic()
    endpoint = "/v1/messages"
    msg_id = "msg_" + secrets.token_hex(12)
    try:
        service.check_serving()
        body = _validate(MessagesBody, parse_json_body(await request.body()))
        service.check_model(body.model)
        stops = list(body.stop_sequences or ())
        if len(stops) > MAX_STOP_SEQUENCES:
            raise RequestError(
                f"stop_sequences: at most {MAX_STOP_SEQUENCES} are supported (got {len(stops)})",
                param="stop_sequences",
            )
        for i, s in enumerate(stops):
            if not s or len(s) > MAX_STOP_CHARS:
                raise RequestError(
                    f"stop_sequences.{i}: must hold 1 to {MAX_STOP_CHARS} characters",
                    param=f"stop_sequences.{i}",
                )
        messages_ = to_chat_messages(body)  # checked before the queue place and the template
        admission_precheck(service, chat_chars(messages_), param="messages")  # the system message included
        plan, _ = await _plan(service, body)
        max_tokens = service.plan_output(
            len(plan.prompt_ids),
            body.max_tokens,
            endpoint_policy=ENDPOINT_POLICY,
            param="max_tokens",
            prompt_param="messages",
        )
        sampling = SamplingParams.of_request(body.temperature, body.top_k, body.top_p, None)
        events = Events()
        greq = GenerationRequest(
            plan.prompt_ids,
            max_tokens,
            sampling,
            tuple(stops),
            events.emit,
            msg_id,
            t_arrival,
            constraint=plan.constraint,
        )
        if (rejected := submit(service, greq, events, endpoint)) is not None:
            return error_response(rejected, msg_id)
    except Exception as e:  # the request's mistake, a limit, or a bug (a 500): the server keeps serving
        return error_response(refusal(e, endpoint, msg_id), msg_id)

    head = {"id": msg_id, "type": "message", "role": "assistant", "model": body.model}
    if body.stream:
        return StreamingResponse(
            _stream(service, greq, events, plan, head, endpoint),
            media_type="text/event-stream",
            headers={
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
                "request-id": msg_id,
                "X-Request-Id": msg_id,
            },
        )
    answer = await _complete(service, request, greq, events, plan, head, endpoint)
    if isinstance(answer, RequestError):
        return error_response(answer, msg_id)
    if answer is None:
        from fastapi.responses import Response

        return Response(status_code=499)
    return JSONResponse(answer, headers={"request-id": msg_id, "X-Request-Id": msg_id})


def usage(ev) -> dict[str, int]:
    """Anthropic's usage from the final engine event: input_tokens excludes the prompt tokens
    read from the prefix cache, which cache_read_input_tokens counts."""
    return {
        "input_tokens": ev.prompt_tokens - ev.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": ev.cached_tokens,
        "output_tokens": ev.completion_tokens,
    }


def stop_reason(ev, made_calls: bool) -> str:
    """stop_reason from the engine's finish reason (module docstring)."""
    if ev.finish_reason == "length":
        return "max_tokens"
    if ev.stop_sequence is not None:
        return "stop_sequence"
    return "tool_use" if made_calls else "end_turn"


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


class _Blocks:
    """Parser deltas -> content blocks, as events (streaming) and as the finished list.

    Consecutive text (or reasoning) deltas extend one block; a kind change closes it. Text
    that is only whitespace is held until something else follows, and dropped when that is a
    tool call (the space a model writes before its call markup), as chat completions do.
    """

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self.open: str | None = None  # "text" | "thinking" while a block takes deltas
        self.n_calls = 0
        self._space = ""

    def add(self, deltas, *, final: bool = False) -> list[tuple[str, dict[str, Any]]]:
        """The SSE events (name, data) for ``deltas``; ``final``: the output ended."""
        out: list[tuple[str, dict[str, Any]]] = []
        for d in deltas:
            if d.kind == "content" and d.text:
                if not d.text.strip():
                    self._space += d.text
                    continue
                out += self._extend("text", self._space + d.text)
                self._space = ""
            elif d.kind == "reasoning" and d.text:
                out += self._extend("thinking", d.text)
            elif d.kind == "tool_call_cut":
                self._space = ""
            elif d.call is not None:
                self._space = ""
                out += self._close()
                try:
                    args = json.loads(d.call.arguments)
                except ValueError:
                    args = {}
                block = {
                    "type": "tool_use",
                    "id": _tool_use_id(d.call.id),
                    "name": d.call.name,
                    "input": args,
                }
                i = len(self.blocks)
                self.blocks.append(block)
                self.n_calls += 1
                out.append(
                    (
                        "content_block_start",
                        {"type": "content_block_start", "index": i, "content_block": {**block, "input": {}}},
                    )
                )
                out.append(
                    (
                        "content_block_delta",
                        {
                            "type": "content_block_delta",
                            "index": i,
                            "delta": {"type": "input_json_delta", "partial_json": d.call.arguments},
                        },
                    )
                )
                out.append(("content_block_stop", {"type": "content_block_stop", "index": i}))
        if final:
            if self._space and not self.n_calls:
                out += self._extend("text", self._space)
            self._space = ""
            out += self._close()
        return out

    def _extend(self, kind: str, text: str) -> list[tuple[str, dict[str, Any]]]:
        out: list[tuple[str, dict[str, Any]]] = []
        if self.open != kind:
            out += self._close()
            block = (
                {"type": "text", "text": ""}
                if kind == "text"
                else {"type": "thinking", "thinking": "", "signature": ""}
            )
            self.blocks.append(block)
            self.open = kind
            out.append(
                (
                    "content_block_start",
                    {
                        "type": "content_block_start",
                        "index": len(self.blocks) - 1,
                        "content_block": dict(block),
                    },
                )
            )
        block = self.blocks[-1]
        key, delta = ("text", "text_delta") if kind == "text" else ("thinking", "thinking_delta")
        block[key] += text
        out.append(
            (
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": len(self.blocks) - 1,
                    "delta": {"type": delta, key: text},
                },
            )
        )
        return out

    def _close(self) -> list[tuple[str, dict[str, Any]]]:
        if self.open is None:
            return []
        i = len(self.blocks) - 1
        out: list[tuple[str, dict[str, Any]]] = []
        if self.open == "thinking":  # we sign nothing: an empty signature, sent back as history, is ignored
            out.append(
                (
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": i,
                        "delta": {"type": "signature_delta", "signature": ""},
                    },
                )
            )
        self.open = None
        out.append(("content_block_stop", {"type": "content_block_stop", "index": i}))
        return out


async def _complete(service, request, greq, events, plan, head: dict[str, Any], endpoint: str):
    """The whole message (a dict), a RequestError when the engine failed, or None when the
    client went away (its sequence cancelled)."""

    parser = plan.parser()
    blocks = _Blocks()

    def step(ev: Event) -> None:
        if ev.error is None:
            parsed = parser.feed(ev.text, ev.token_ids)
            if ev.final:
                parsed += parser.finish(ev.finish_reason)
            blocks.add(parsed, final=ev.final)

    ev = await await_final(service, request, greq, events, endpoint, step)
    if ev is None:
        return None
    if ev.error is not None:
        return ev.error
    content = blocks.blocks or [{"type": "text", "text": ""}]
    return {
        **head,
        "content": content,
        "stop_reason": stop_reason(ev, blocks.n_calls > 0),
        "stop_sequence": ev.stop_sequence,
        "usage": usage(ev),
    }


def _sse(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _stream(service, greq, events, plan, head: dict[str, Any], endpoint: str):
    """The named SSE events; cancels the sequence when the client goes away. ``message_start``
    counts the whole prompt as input_tokens; ``message_delta``'s usage has the final split
    between input_tokens and cache_read_input_tokens (known once the prefill ran)."""

    parser = plan.parser()
    blocks = _Blocks()
    done = False
    start_usage = {
        "input_tokens": len(greq.prompt_ids),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": 0,
    }
    try:
        yield _sse(
            "message_start",
            {
                "type": "message_start",
                "message": {
                    **head,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": start_usage,
                },
            },
        )
        yield _sse("ping", {"type": "ping"})
        while True:
            first = await events.get(PING_INTERVAL_S)
            if first is None:  # a long prefill: keep the connection visibly alive
                yield _sse("ping", {"type": "ping"})
                continue
            batch = events.burst(first)
            ev = merge_events(batch)
            if ev.error is not None:
                done = True
                finish_request(service, greq, ev, endpoint, stream=True)
                yield _sse("error", error_body(ev.error.status, ev.error.message))
                return
            parsed = parser.feed(ev.text, ev.token_ids)
            if ev.final:
                parsed += parser.finish(ev.finish_reason)
            for name, data in blocks.add(parsed, final=ev.final):
                yield _sse(name, data)
            if ev.final:
                done = True
                finish_request(service, greq, ev, endpoint, stream=True)
                yield _sse(
                    "message_delta",
                    {
                        "type": "message_delta",
                        "delta": {
                            "stop_reason": stop_reason(ev, blocks.n_calls > 0),
                            "stop_sequence": ev.stop_sequence,
                        },
                        "usage": usage(ev),
                    },
                )
                yield _sse("message_stop", {"type": "message_stop"})
                return
    finally:
        events.close()
        if not done:
            log.info("client_disconnected", request_id=greq.request_id, endpoint=endpoint)
            service.batch.cancel(greq)
