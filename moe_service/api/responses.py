"""The OpenAI Responses API: ``POST /v1/responses`` (plus ``GET``/``DELETE /v1/responses/{id}``
for stored responses), served through the chat completions path.

::

    body --JSON--> ResponsesBody (unknown fields accepted: Codex sends prompt_cache_key,
      client_metadata, include, ...) --previous_response_id--> the stored conversation
      (moe_service.api.response_store) + this request's ``input`` items
      --to_chat--> chat messages + function tools (custom tools as one-string functions)
      --moe_service.api.chat.plan_chat--> prompt ids + constraint (the same template, tool
      parsers, llguidance grammars and reasoning switch as /v1/chat/completions)
      --> BatchLoop.submit (the same admission, prefix cache and engine)
    engine events --ChatPlan.parser()--> Delta --OutputBuilder--> output items and the typed
      stream events (``response.created`` ... ``response.completed``), or one JSON response

Request items (``input``) and what the chat template gets for them:

========================  =====================================================================
``message``               role ``user`` / ``assistant`` / ``system`` / ``developer`` (as system);
                          content a string or ``input_text`` / ``output_text`` / ``refusal``
                          parts. Leading system and developer messages (and ``instructions``)
                          become one system message, since templates want one, first.
``function_call``         an assistant ``tool_calls`` entry (``call_id``, ``name``, ``arguments``:
                          a JSON object as text, else 400 naming ``input.N.arguments``)
``function_call_output``  a ``tool`` message answering ``call_id`` (400 when no call before it
                          has that id)
``custom_tool_call``      an assistant call of the custom tool, its ``input`` as the one argument
``custom_tool_call_output``  like ``function_call_output``
``reasoning``             the ``reasoning_content`` of the next assistant turn (templates that
                          keep it); text from ``content`` (``reasoning_text``), else from our own
                          ``encrypted_content`` (see below); OpenAI's real encrypted reasoning
                          cannot be read and is dropped
hosted tool items         (``web_search_call``, ``file_search_call``, ... and ``compaction``):
                          skipped and logged: this server never produced them
anything else             400 naming ``input.N.type``
========================  =====================================================================

Tools: ``function`` tools as the chat API's; ``custom`` tools (free-form text input) are shown
to the model as a function with one string argument ``input`` whose description carries the
tool's grammar, and their calls come back as ``custom_tool_call`` items. A custom tool's grammar
is enforced when ``tool_choice`` names it: the model's output after its reasoning is then the
tool's input, constrained by the Lark grammar (embedded as an llguidance sub-grammar) or the
regex; with ``tool_choice: required`` a regex grammar is enforced as the argument's JSON
``pattern``; under ``auto`` (as for function tools) nothing is enforced. Other tool types
(``web_search``, ``file_search``, ``namespace``, MCP, ...) cannot run here: they are skipped and
logged, as llama.cpp's server does since b10488, because Codex always sends some.

Output: ``reasoning`` items (``content`` holds ``reasoning_text``; with ``include:
["reasoning.encrypted_content"]`` also ``encrypted_content``, which here is the reasoning text
base64-encoded with a ``moe1:`` prefix, not encrypted: a stateless client such as Codex
(``store: false``) sends it back and the model sees its reasoning again), ``message`` items
(``output_text``), ``function_call`` and ``custom_tool_call`` items. ``usage`` counts
``input_tokens_details.cached_tokens`` from the prefix cache and
``output_tokens_details.reasoning_tokens`` (tokens sampled while the parser was in the reasoning).

Output limit (moe_service.server.Service.plan_output): ``max_output_tokens`` when given; one
that does not fit beside the prompt is served up to the context under serve.max_tokens_policy
``auto`` or ``clamp`` (this endpoint's default, as llama.cpp serves it) and refused with
``context_length_exceeded`` under ``refuse``. Without it: the rest of the context, not
``serve.max_tokens_default``: agents such as Codex send no limit, and a 256-token cut would
end every answer. A response cut by the limit (or the context) has ``status: incomplete`` and
``incomplete_details.reason: max_output_tokens``; a tool call it cut off is dropped, never
written as text (tools.OutputParser.finish).

Errors are OpenAI error objects naming the field (``input.3.call_id``, ``tools.0.name``,
``previous_response_id``, ``text.format.schema``); nothing reaches the engine then. A request
with no input at all (Codex and other clients probe with one) gets an empty completed response
without running the model.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from moe_service.api import tools as tl
from moe_service.api.transport import (
    Events,
    await_final,
    error_response,
    finish_request,
    read_json,
    refusal,
    submit,
    validate_body,
)
from moe_service.engine.engine import Event, GenerationRequest, RequestError
from moe_service.log import get_logger

log = get_logger(__name__)

ENDPOINT = "/v1/responses"
# serve.max_tokens_policy "auto" on this endpoint: clamp, as llama.cpp serves a limit that does
# not fit (agents ask for fixed large outputs whatever the context); refuse is OpenAI's rule
ENDPOINT_POLICY = "clamp"
ENCRYPTED_PREFIX = "moe1:"  # our reasoning round-trip marker in ``encrypted_content`` (not encryption)

# Item types of OpenAI's hosted tools and server-side features: this server never produces
# them, a client may replay them from a conversation held elsewhere; skipped with a log line.
SKIPPED_ITEM_TYPES = frozenset(
    {
        "web_search_call",
        "file_search_call",
        "computer_call",
        "computer_call_output",
        "code_interpreter_call",
        "image_generation_call",
        "local_shell_call",
        "local_shell_call_output",
        "mcp_call",
        "mcp_list_tools",
        "mcp_approval_request",
        "mcp_approval_response",
        "shell_call",
        "shell_call_output",
        "apply_patch_call",
        "apply_patch_call_output",
        "tool_search_call",
        "tool_search_output",
        "compaction",
        "compaction_summary",
    }
)
KNOWN_ITEM_TYPES = (
    "message",
    "function_call",
    "function_call_output",
    "custom_tool_call",
    "custom_tool_call_output",
    "reasoning",
)
# Tool types that need OpenAI's hosted services or a feature this server does not have.
SKIPPED_TOOL_TYPES = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "web_search_2025_08_26",
        "file_search",
        "computer_use_preview",
        "computer_use",
        "code_interpreter",
        "image_generation",
        "mcp",
        "local_shell",
        "shell",
        "apply_patch",
        "namespace",
        "tool_search",
        "programmatic_tool_calling",
    }
)
_NAME = re.compile(r"^[a-zA-Z0-9_.-]{1,64}$")
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = {
    "input_text": "text",
    "output_text": "text",
    "text": "text",
    "refusal": "refusal",
    "summary_text": "text",
    "reasoning_text": "text",
}
_MEDIA_PARTS = ("input_image", "input_file", "input_audio")


# ---------------------------------------------------------------------------------------------
# Request body


class ResponsesBody(BaseModel):
    """POST /v1/responses. Fields this server does not know are accepted and ignored (the
    Responses API grows often and agents send fields such as ``prompt_cache_key``,
    ``client_metadata``, ``include``, ``safety_identifier``); the known ones are checked."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[Any] | None = None
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    include: list[str] | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    truncation: str | None = None
    seed: int | None = None  # extension (as on chat completions): seeds the sampler
    top_k: int | None = Field(None, ge=0)  # extension (llama.cpp, vLLM)
    generate: bool | None = None  # Codex's prewarm flag: false asks for no generation


def _refuse_unsupported(body: ResponsesBody) -> None:
    if body.background:
        raise RequestError(
            "background=true is not supported by this server: responses run while the request is open",
            param="background",
            code="unsupported_parameter",
        )
    if body.conversation is not None:
        raise RequestError(
            "conversation is not supported by this server (no Conversations API): use "
            "previous_response_id or send the items in input",
            param="conversation",
            code="unsupported_parameter",
        )
    if body.prompt is not None:
        raise RequestError(
            "prompt (stored prompt templates) is not supported by this server: send instructions and input",
            param="prompt",
            code="unsupported_parameter",
        )
    if body.truncation not in (None, "disabled", "auto"):
        raise RequestError(
            f"truncation must be 'auto' or 'disabled' (got {body.truncation!r})", param="truncation"
        )


# ---------------------------------------------------------------------------------------------
# Responses items -> chat messages


@dataclass
class ChatRequest:
    """What to_chat makes of a request: the chat messages and tools the chat path takes."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    custom: dict[str, dict[str, Any]]  # custom tool name -> its format ({"type": "text"} or a grammar)
    tool_choice: Any
    forced_custom: str | None = None  # tool_choice names a custom tool that has a grammar
    schema: dict[str, Any] | None = None  # text.format json_schema / json_object
    effort: str | None = None


def _where(prefix: str, i: int) -> str:
    return f"{prefix}.{i}"


def _parts_text(content: Any, where: str, *, allow_media: bool = False) -> str:
    """A message's content (a string or a list of parts) as text; 400 naming the part at fault."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}: must be a string or a list of content parts", param=where)
    out = []
    for j, part in enumerate(content):
        p = f"{where}.{j}"
        if isinstance(part, str):
            out.append(part)
            continue
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS:
            text = part.get(_TEXT_PARTS[kind])
            if not isinstance(text, str):
                raise RequestError(
                    f"{p}.{_TEXT_PARTS[kind]}: a string is required", param=f"{p}.{_TEXT_PARTS[kind]}"
                )
            out.append(text)
        elif kind in _MEDIA_PARTS and not allow_media:
            raise RequestError(
                f"{p}.type: {kind} parts are not supported: this server serves text models",
                param=f"{p}.type",
                code="unsupported_parameter",
            )
        elif kind in _MEDIA_PARTS:
            continue
        else:
            raise RequestError(
                f"{p}.type: unknown content part type {kind!r} (supported: input_text, output_text, refusal)",
                param=f"{p}.type",
                code="invalid_value",
            )
    return "".join(out)


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """The text of a ``reasoning`` item: its ``content`` (reasoning_text parts), else our own
    ``encrypted_content``; OpenAI's encrypted reasoning (or a summary alone) gives ''."""
    content = item.get("content")
    if content:
        return _parts_text(content, f"{where}.content")
    enc = item.get("encrypted_content")
    if isinstance(enc, str) and enc.startswith(ENCRYPTED_PREFIX):
        try:
            return base64.b64decode(enc[len(ENCRYPTED_PREFIX) :], validate=True).decode("utf-8")
        except (ValueError, UnicodeDecodeError):
            raise RequestError(
                f"{where}.encrypted_content: not reasoning this server wrote (bad base64 after "
                f"{ENCRYPTED_PREFIX!r})",
                param=f"{where}.encrypted_content",
            ) from None
    return ""


def encode_reasoning(text: str) -> str:
    """``encrypted_content`` for a reasoning item: the text base64-encoded (see the module doc)."""
    return ENCRYPTED_PREFIX + base64.b64encode(text.encode("utf-8")).decode("ascii")


def _call_id(item: dict[str, Any], where: str) -> str:
    cid = item.get("call_id")
    if not isinstance(cid, str) or not cid:
        raise RequestError(
            f"{where}.call_id: a non-empty string is required",
            param=f"{where}.call_id",
            code="missing_required_parameter",
        )
    return cid


def _output_text(output: Any, where: str) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return _parts_text(output, where)
    if output is None:
        raise RequestError(
            f"{where}: the call's output is required", param=where, code="missing_required_parameter"
        )
    return json.dumps(output, ensure_ascii=False)


class _Conversation:
    """Builds chat messages from Responses items (see the module table)."""

    def __init__(self, custom_names: set[str]) -> None:
        self.messages: list[dict[str, Any]] = []
        self.call_ids: set[str] = set()
        self.custom_names = custom_names
        self._reasoning: str | None = None  # from a reasoning item, for the next assistant turn
        self.skipped: list[str] = []

    def _assistant(self) -> dict[str, Any]:
        """The assistant message a call joins: the last message when it is an assistant turn
        not yet answered by a tool result, else a new one."""
        last = self.messages[-1] if self.messages else None
        if last is None or last["role"] != "assistant":
            last = {"role": "assistant", "content": ""}
            self.messages.append(last)
        self._take_reasoning(last)
        return last

    def _take_reasoning(self, msg: dict[str, Any]) -> None:
        if self._reasoning:
            msg["reasoning_content"] = (msg.get("reasoning_content") or "") + self._reasoning
        self._reasoning = None

    def _add_call(self, call_id: str, name: str, arguments: str) -> None:
        msg = self._assistant()
        msg.setdefault("tool_calls", []).append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        )
        self.call_ids.add(call_id)

    def add(self, item: Any, where: str) -> None:
        if isinstance(item, str):  # a bare string item: a user message
            self.messages.append({"role": "user", "content": item})
            return
        if not isinstance(item, dict):
            raise RequestError(f"{where}: an input item must be an object", param=where)
        kind = item.get("type")
        if kind is None and "role" in item:
            kind = "message"  # EasyInputMessage: {role, content} without a type
        if kind == "message":
            role = _ROLES.get(item.get("role"))
            if role is None:
                raise RequestError(
                    f"{where}.role: role {item.get('role')!r} is not supported (supported: "
                    f"{', '.join(_ROLES)})",
                    param=f"{where}.role",
                    code="invalid_value",
                )
            msg: dict[str, Any] = {
                "role": role,
                "content": _parts_text(item.get("content"), f"{where}.content"),
            }
            if role == "assistant":
                self._take_reasoning(msg)
                last = self.messages[-1] if self.messages else None
                if last is not None and last["role"] == "assistant" and not last.get("tool_calls"):
                    last["content"] += msg["content"]  # consecutive assistant pieces: one turn
                    if msg.get("reasoning_content"):
                        last["reasoning_content"] = (last.get("reasoning_content") or "") + msg[
                            "reasoning_content"
                        ]
                    return
            else:
                self._reasoning = None  # reasoning belongs to the assistant turn right after it
            self.messages.append(msg)
        elif kind == "function_call":
            name = item.get("name")
            if not isinstance(name, str) or not name:
                raise RequestError(
                    f"{where}.name: the function's name is required",
                    param=f"{where}.name",
                    code="missing_required_parameter",
                )
            args = item.get("arguments", "{}")
            if not isinstance(args, str):
                raise RequestError(
                    f"{where}.arguments: must be a string holding a JSON object", param=f"{where}.arguments"
                )
            try:
                parsed = json.loads(args) if args.strip() else {}
            except ValueError as e:
                raise RequestError(
                    f"{where}.arguments: not valid JSON ({e}): a function call's arguments are a JSON "
                    "object as text",
                    param=f"{where}.arguments",
                    code="invalid_value",
                ) from None
            if not isinstance(parsed, dict):
                raise RequestError(
                    f"{where}.arguments: must be a JSON object (got {type(parsed).__name__})",
                    param=f"{where}.arguments",
                    code="invalid_value",
                )
            self._add_call(_call_id(item, where), name, args if args.strip() else "{}")
        elif kind == "custom_tool_call":
            name = item.get("name")
            text = item.get("input")
            if not isinstance(name, str) or not name:
                raise RequestError(
                    f"{where}.name: the tool's name is required",
                    param=f"{where}.name",
                    code="missing_required_parameter",
                )
            if not isinstance(text, str):
                raise RequestError(f"{where}.input: a string is required", param=f"{where}.input")
            self._add_call(_call_id(item, where), name, json.dumps({"input": text}, ensure_ascii=False))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            cid = _call_id(item, where)
            if cid not in self.call_ids:
                raise RequestError(
                    f"{where}.call_id: no function_call or custom_tool_call with call_id {cid!r} comes "
                    "before this output",
                    param=f"{where}.call_id",
                    code="invalid_value",
                )
            self.messages.append(
                {
                    "role": "tool",
                    "tool_call_id": cid,
                    "content": _output_text(item.get("output"), f"{where}.output"),
                }
            )
        elif kind == "reasoning":
            text = _reasoning_text(item, where)
            if text:
                self._reasoning = (self._reasoning or "") + text
        elif kind == "item_reference":
            raise RequestError(
                f"{where}.type: item_reference is not supported by this server: send the item itself "
                "or use previous_response_id",
                param=f"{where}.type",
                code="unsupported_parameter",
            )
        elif kind in SKIPPED_ITEM_TYPES:
            self.skipped.append(kind)
        else:
            raise RequestError(
                f"{where}.type: unknown input item type {kind!r} (supported: {', '.join(KNOWN_ITEM_TYPES)})",
                param=f"{where}.type",
                code="invalid_value",
            )

    def finish(self, instructions: str | None) -> list[dict[str, Any]]:
        """The messages, leading system/developer messages and ``instructions`` merged into
        one system message (first)."""
        lead: list[str] = [instructions] if instructions else []
        rest = self.messages
        while rest and rest[0]["role"] == "system":
            lead.append(rest[0]["content"])
            rest = rest[1:]
        out = ([{"role": "system", "content": "\n\n".join(t for t in lead if t)}] if lead else []) + rest
        return out


def _custom_description(tool: dict[str, Any], fmt: dict[str, Any]) -> str:
    desc = tool.get("description") or ""
    note = "This tool takes free-form text: put the whole text in the `input` argument."
    if fmt.get("type") == "grammar":
        note += f" The text must follow this {fmt.get('syntax')} grammar:\n{fmt.get('definition')}"
    return f"{desc}\n\n{note}".strip()


def check_tools(
    tools: Sequence[Any] | None,
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]], list[str]]:
    """(chat function tools, custom tool name -> format, the skipped tool types). Raises
    RequestError naming ``tools.N.<field>``."""
    out: list[dict[str, Any]] = []
    custom: dict[str, dict[str, Any]] = {}
    skipped: list[str] = []
    seen: set[str] = set()
    for i, t in enumerate(tools or []):
        p = f"tools.{i}"
        if not isinstance(t, dict):
            raise RequestError(f"{p}: a tool must be an object", param=p)
        kind = t.get("type")
        if kind in SKIPPED_TOOL_TYPES:
            skipped.append(str(kind))
            continue
        if kind not in ("function", "custom"):
            raise RequestError(
                f"{p}.type: unknown tool type {kind!r} (function and custom tools run here; "
                f"{', '.join(sorted(SKIPPED_TOOL_TYPES))} are skipped)",
                param=f"{p}.type",
                code="invalid_value",
            )
        name = t.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise RequestError(
                f"{p}.name: must be 1-64 characters of a-z, A-Z, 0-9, '_', '.', '-' "
                f"(got {json.dumps(name)[:80]})",
                param=f"{p}.name",
            )
        if name in seen:
            raise RequestError(f"{p}.name: {name!r} is declared twice", param=f"{p}.name")
        seen.add(name)
        desc = t.get("description")
        if desc is not None and not isinstance(desc, str):
            raise RequestError(f"{p}.description: must be a string", param=f"{p}.description")
        if kind == "function":
            params = t.get("parameters")
            if params is not None and not isinstance(params, dict):
                raise RequestError(f"{p}.parameters: must be a JSON schema object", param=f"{p}.parameters")
            fn: dict[str, Any] = {"name": name}
            if desc:
                fn["description"] = desc
            fn["parameters"] = params if params else {"type": "object", "properties": {}}
            out.append({"type": "function", "function": fn})
            continue
        fmt = t.get("format") or {"type": "text"}
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "grammar"):
            raise RequestError(f"{p}.format.type: must be 'text' or 'grammar'", param=f"{p}.format.type")
        arg: dict[str, Any] = {"type": "string"}
        if fmt["type"] == "grammar":
            if fmt.get("syntax") not in ("lark", "regex"):
                raise RequestError(
                    f"{p}.format.syntax: must be 'lark' or 'regex' (got {fmt.get('syntax')!r})",
                    param=f"{p}.format.syntax",
                )
            if not isinstance(fmt.get("definition"), str) or not fmt["definition"].strip():
                raise RequestError(
                    f"{p}.format.definition: the grammar text is required",
                    param=f"{p}.format.definition",
                    code="missing_required_parameter",
                )
            if fmt["syntax"] == "regex":
                arg["pattern"] = fmt["definition"]
        custom[name] = {**fmt, "index": i}
        out.append(
            {
                "type": "function",
                "function": {
                    "name": name,
                    "description": _custom_description(t, fmt),
                    "parameters": {
                        "type": "object",
                        "properties": {"input": arg},
                        "required": ["input"],
                        "additionalProperties": False,
                    },
                },
            }
        )
    return out, custom, skipped


def _tool_choice(
    choice: Any, tools: list[dict[str, Any]], custom: dict[str, Any]
) -> tuple[Any, list[dict[str, Any]]]:
    """(chat tool_choice, the tools offered): Responses' tool_choice in the chat API's terms."""
    names = [t["function"]["name"] for t in tools]
    if choice is None or choice in ("none", "auto", "required"):
        return choice, tools
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind in ("function", "custom"):
            name = choice.get("name")
            if name not in names or (kind == "custom") != (name in custom):
                raise RequestError(
                    f"tool_choice.name: {name!r} is not among the request's {kind} tools "
                    f"({', '.join(n for n in names if (n in custom) == (kind == 'custom')) or 'none'})",
                    param="tool_choice.name",
                )
            return {"type": "function", "function": {"name": name}}, tools
        if kind == "allowed_tools":
            mode = choice.get("mode", "auto")
            if mode not in ("auto", "required"):
                raise RequestError(
                    f"tool_choice.mode must be 'auto' or 'required' (got {mode!r})", param="tool_choice.mode"
                )
            allowed = choice.get("tools")
            if not isinstance(allowed, list):
                raise RequestError(
                    "tool_choice.tools: a list of tools is required", param="tool_choice.tools"
                )
            keep = {a.get("name") for a in allowed if isinstance(a, dict)}
            return mode, [t for t in tools if t["function"]["name"] in keep]
        if kind in SKIPPED_TOOL_TYPES or (isinstance(kind, str) and kind.startswith("web_search")):
            raise RequestError(
                f"tool_choice.type: the {kind} tool cannot run on this server",
                param="tool_choice.type",
                code="unsupported_parameter",
            )
    raise RequestError(
        f"tool_choice must be 'none', 'auto', 'required', {{'type': 'function'|'custom', 'name': ...}} "
        f"or {{'type': 'allowed_tools', ...}} (got {json.dumps(choice)[:80]})",
        param="tool_choice",
    )


def _text_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if not fmt:
        return None
    if not isinstance(fmt, dict):
        raise RequestError("text.format: must be an object", param="text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise RequestError(
                "text.format.schema: a JSON schema object is required", param="text.format.schema"
            )
        return schema
    raise RequestError(
        f"text.format.type must be 'text', 'json_object' or 'json_schema' (got {kind!r})",
        param="text.format.type",
    )


def input_items(value: str | list[Any] | None) -> list[Any]:
    """``input`` as a list of items (a string is one user message)."""
    if value is None or value == "":
        return []
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return list(value)


def to_chat(body: ResponsesBody, history: list[Any], items: list[Any]) -> ChatRequest:
    """The chat request for ``history`` (a stored conversation) + ``items`` (this request's
    input). Raises RequestError naming the field at fault."""
    tools, custom, skipped_tools = check_tools(body.tools)
    if skipped_tools:
        log.info("responses_tools_skipped", types=sorted(set(skipped_tools)), count=len(skipped_tools))
    conv = _Conversation(set(custom))
    for i, item in enumerate(history):
        conv.add(item, _where("previous_response_id", i))
    for i, item in enumerate(items):
        conv.add(item, _where("input", i))
    if conv.skipped:
        log.info("responses_items_skipped", types=sorted(set(conv.skipped)), count=len(conv.skipped))
    choice, offered = _tool_choice(body.tool_choice, tools, custom)
    forced = None
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        if custom.get(name, {}).get("type") == "grammar":
            forced = name
    effort = (body.reasoning or {}).get("effort")
    if effort is not None and not isinstance(effort, str):
        raise RequestError("reasoning.effort: must be a string", param="reasoning.effort")
    return ChatRequest(
        conv.finish(body.instructions),
        offered,
        custom,
        choice,
        forced_custom=forced,
        schema=_text_format(body.text),
        effort=effort,
    )


# ---------------------------------------------------------------------------------------------
# Planning: the chat plan, and the custom-grammar constraint


def custom_grammar(
    fmt: tl.ChatFormat, syntax: str, definition: str, *, reasoning_open: bool, reasoning_allowed: bool
) -> str:
    """llguidance grammar (TopLevelGrammar JSON) for an output that is one custom tool's input:
    an optional reasoning block (the family's, as for JSON answers), then the text the tool's
    Lark grammar or regex admits. The tool's grammar is a separate llguidance grammar named
    ``custom`` referenced as ``@custom``, so its rule names cannot clash with ours."""
    rules: list[str] = []
    prefix = tl._reasoning_prefix(fmt, reasoning_open, reasoning_allowed, rules)
    if fmt.family == "harmony":
        prefix += '"<|channel|>final<|message|>" '
    if syntax == "regex":
        inner = "start: /" + re.sub(r"(?<!\\)((?:\\\\)*)/", r"\1\\/", definition) + "/"
    else:
        inner = definition
    main = "\n".join([f"start: {prefix}@custom", *rules])
    return json.dumps({"grammars": [{"lark_grammar": main}, {"name": "custom", "lark_grammar": inner}]})


def plan(engine, req: ChatRequest, body: ResponsesBody):
    """The ChatPlan (moe_service.api.chat) for ``req``; a worker thread runs it. A forced
    custom tool with a grammar gets the custom-grammar constraint and no tool parsing (the
    whole answer is the call's input)."""
    from moe_service.api.chat import plan_chat
    from moe_service.api.grammar import GrammarError, compile_constraint

    tvars: dict[str, Any] = {}
    if req.effort == "none":
        tvars["enable_thinking"] = False  # Responses' "no reasoning": the template's switch
    forced = req.forced_custom
    try:
        p = plan_chat(
            engine,
            req.messages,
            tools=req.tools,
            tool_choice="auto" if forced else req.tool_choice,
            parallel_tool_calls=body.parallel_tool_calls,
            schema=req.schema,
            template_kwargs=tvars,
            reasoning_effort=req.effort if req.effort not in (None, "none") else None,
            schema_param="text.format.schema",
        )
    except RequestError as e:
        raise _rename_param(e) from None
    if forced:
        fmt = req.custom[forced]
        where = f"tools.{fmt['index']}.format.definition"
        thinking = tvars.get("enable_thinking", True) is not False
        try:
            grammar = custom_grammar(
                p.fmt,
                fmt["syntax"],
                fmt["definition"],
                reasoning_open=p.in_reasoning,
                reasoning_allowed=thinking or p.in_reasoning,
            )
            p.constraint = compile_constraint(engine.tokenizer, grammar)
        except GrammarError as e:
            raise RequestError(
                f"{where}: the grammar cannot be enforced: {e}", param=where, code="invalid_grammar"
            ) from None
        p.tool_mode = "none"
    return p


def _rename_param(e: RequestError) -> RequestError:
    """Chat-path errors in Responses terms: ``messages`` -> ``input``, ``tools.N.function.X`` ->
    ``tools.N.X``."""
    param = e.param
    if param is not None:
        if param == "messages" or param.startswith("messages."):
            param = "input"
        param = re.sub(r"^tools\.(\d+)\.function\.", r"tools.\1.", param)
        if param != e.param:
            e.message = e.message.replace(e.param, param, 1) if e.param in e.message else e.message
            e.args = (e.message,)
            e.param = param
    return e


# ---------------------------------------------------------------------------------------------
# Output items and stream events


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class _Open:
    """The output item being written (message or reasoning) and its text so far."""

    kind: str  # "message" | "reasoning"
    index: int
    item: dict[str, Any]
    text: list[str] = field(default_factory=list)


class OutputBuilder:
    """Parser deltas -> Responses output items, and the typed stream events in OpenAI's order.

    Each method returns the events to send (dicts with ``type`` and ``sequence_number``);
    ``items`` holds the finished output items. Whitespace-only text before a tool call is
    dropped (templates put newlines between text and the call markup), as chat completions do.
    ``custom``: custom tool names (their calls become ``custom_tool_call`` items);
    ``raw_custom``: the whole answer is this custom tool's input (a forced, grammar-constrained
    call); ``encrypted_reasoning``: reasoning items carry ``encrypted_content`` (``include``).
    """

    def __init__(
        self, *, custom: Sequence[str] = (), raw_custom: str | None = None, encrypted_reasoning: bool = False
    ) -> None:
        self.seq = 0
        self.items: list[dict[str, Any]] = []
        self.custom = set(custom)
        self.raw_custom = raw_custom
        self.encrypted_reasoning = encrypted_reasoning
        self._open: _Open | None = None
        self._space = ""
        self._raw: list[str] = []
        self.n_calls = 0

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        ev = {"type": kind, **fields, "sequence_number": self.seq}
        self.seq += 1
        return ev

    # -- items --------------------------------------------------------------------------------
    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        o = self._open
        if o is None:
            return []
        self._open = None
        text = "".join(o.text)
        item_id = o.item["id"]
        extra: dict[str, Any] = {}
        if o.kind == "message":
            part = {"type": "output_text", "annotations": [], "logprobs": [], "text": text}
            done, extra = "response.output_text.done", {"logprobs": []}
        else:
            part = {"type": "reasoning_text", "text": text}
            done = "response.reasoning_text.done"
        evs = [self.event(done, item_id=item_id, output_index=o.index, content_index=0, text=text, **extra)]
        evs.append(
            self.event(
                "response.content_part.done",
                item_id=item_id,
                output_index=o.index,
                content_index=0,
                part=part,
            )
        )
        item = {**o.item, "status": status, "content": [part]}
        if o.kind == "reasoning" and self.encrypted_reasoning:
            item["encrypted_content"] = encode_reasoning(text)
        self.items.append(item)
        evs.append(self.event("response.output_item.done", output_index=o.index, item=item))
        return evs

    def _start(self, kind: str) -> tuple[_Open, list[dict[str, Any]]]:
        """Open an empty ``kind`` item ("message" or "reasoning") at the next output index: the
        open item, and its output_item.added and content_part.added events."""
        index = len(self.items)
        if kind == "message":
            item = {
                "id": _new_id("msg"),
                "type": "message",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            part: dict[str, Any] = {"type": "output_text", "annotations": [], "logprobs": [], "text": ""}
        else:
            item = {
                "id": _new_id("rs"),
                "type": "reasoning",
                "status": "in_progress",
                "summary": [],
                "content": [],
            }
            part = {"type": "reasoning_text", "text": ""}
        self._open = _Open(kind, index, item)
        return self._open, [
            self.event("response.output_item.added", output_index=index, item=dict(item)),
            self.event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=part,
            ),
        ]

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        evs: list[dict[str, Any]] = []
        o = self._open
        if o is None or o.kind != kind:
            evs += self._close()
            o, started = self._start(kind)
            evs += started
        o.text.append(text)
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        evs.append(
            self.event(name, item_id=o.item["id"], output_index=o.index, content_index=0, delta=text, **extra)
        )
        return evs

    def _call(
        self, name: str, call_id: str, arguments: str, *, custom_input: str | None = None
    ) -> list[dict[str, Any]]:
        evs = self._close()
        self._space = ""
        index = len(self.items)
        self.n_calls += 1
        # a custom tool's call carries its raw input, a function call its JSON arguments (and its
        # name again in the done event); otherwise the two items stream alike
        if custom_input is not None:
            prefix, kind, field, text, named = "ctc", "custom_tool_call", "input", custom_input, {}
        else:
            prefix, kind, field, text, named = "fc", "function_call", "arguments", arguments, {"name": name}
        stream = "response.custom_tool_call_input" if custom_input is not None else "response.function_call_arguments"
        item = {"id": _new_id(prefix), "type": kind, "status": "in_progress", "call_id": call_id, "name": name, field: ""}
        evs.append(self.event("response.output_item.added", output_index=index, item=item))
        evs.append(self.event(f"{stream}.delta", item_id=item["id"], output_index=index, delta=text))
        evs.append(self.event(f"{stream}.done", item_id=item["id"], output_index=index, **named, **{field: text}))
        done = {**item, "status": "completed", field: text}
        self.items.append(done)
        evs.append(self.event("response.output_item.done", output_index=index, item=done))
        return evs

    # -- deltas -------------------------------------------------------------------------------
    def feed(self, deltas: Sequence[tl.Delta]) -> list[dict[str, Any]]:
        evs: list[dict[str, Any]] = []
        for d in deltas:
            if d.kind == "reasoning":
                if d.text:
                    evs += self._text("reasoning", d.text)
            elif d.kind == "content":
                if not d.text:
                    continue
                if self.raw_custom is not None:
                    self._raw.append(d.text)
                    continue
                if not d.text.strip() and (self._open is None or self._open.kind != "message"):
                    self._space += d.text  # held: dropped if a call follows
                    continue
                text, self._space = self._space + d.text, ""
                evs += self._text("message", text)
            elif d.kind == "tool_call_cut":
                self._space = ""  # the whitespace led to a call the output limit cut off
            elif d.call is not None:
                if d.call.name in self.custom:
                    try:
                        args = json.loads(d.call.arguments)
                    except ValueError:
                        args = None
                    value = args.get("input") if isinstance(args, dict) else None
                    if not isinstance(value, str):  # the model wrote other arguments: pass them on as text
                        value = d.call.arguments
                    evs += self._call(d.call.name, d.call.id, d.call.arguments, custom_input=value)
                else:
                    evs += self._call(d.call.name, d.call.id, d.call.arguments)
        return evs

    def finish(self, *, incomplete: bool) -> list[dict[str, Any]]:
        """Close the open item (``incomplete``: cut by the output limit)."""
        evs: list[dict[str, Any]] = []
        if self.raw_custom is not None:
            evs += self._close()
            evs += self._call(self.raw_custom, tl.new_call_id(), "", custom_input="".join(self._raw))
            if incomplete:
                self.items[-1]["status"] = "incomplete"
            return evs
        if self._space and not self.n_calls:
            evs += self._text("message", self._space)
        self._space = ""
        if self._open is None and not self.items:  # an empty answer: one empty message, as OpenAI sends
            evs += self._start("message")[1]
        evs += self._close("incomplete" if incomplete else "completed")
        return evs


def _in_reasoning(parser: tl.OutputParser) -> bool:
    h = getattr(parser, "_harmony", None)
    if h is not None:
        return getattr(h, "current_channel", None) == "analysis"
    return parser.state == "reasoning"


# ---------------------------------------------------------------------------------------------
# The response object


@dataclass
class _Context:
    """What every response object of one request repeats."""

    id: str
    created_at: int
    model: str
    body: ResponsesBody

    def response(
        self,
        *,
        status: str,
        output: list[dict[str, Any]] | None = None,
        usage: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
        incomplete: str | None = None,
    ) -> dict[str, Any]:
        b = self.body
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "max_tool_calls": None,
            "model": self.model,
            "output": output or [],
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": b.previous_response_id,
            "reasoning": {
                "effort": (b.reasoning or {}).get("effort"),
                "summary": (b.reasoning or {}).get("summary"),
            },
            "service_tier": "default",
            "store": b.store is not False,
            "temperature": 1.0 if b.temperature is None else b.temperature,
            "text": {"format": (b.text or {}).get("format") or {"type": "text"}},
            "tool_choice": b.tool_choice if b.tool_choice is not None else "auto",
            "tools": list(b.tools or []),
            "top_p": 1.0 if b.top_p is None else b.top_p,
            "truncation": b.truncation or "disabled",
            "usage": usage,
            "user": b.user,
            "metadata": b.metadata or {},
        }


def usage_of(ev: Event | None, reasoning_tokens: int) -> dict[str, Any]:
    prompt = ev.prompt_tokens if ev else 0
    completion = ev.completion_tokens if ev else 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": ev.cached_tokens if ev else 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt + completion,
    }


def _sse(ev: dict[str, Any]) -> str:
    return f"event: {ev['type']}\ndata: {json.dumps(ev, ensure_ascii=False, separators=(',', ':'))}\n\n"


# ---------------------------------------------------------------------------------------------
# The handler


def _store_of(service):
    store = getattr(service, "responses_store", None)
    if store is None:
        from moe_service.api.response_store import ResponseStore

        store = service.responses_store = ResponseStore()
    return store


def _history(service, body: ResponsesBody) -> list[Any]:
    rid = body.previous_response_id
    if rid is None:
        return []
    entry = _store_of(service).get(rid)
    if entry is None:
        raise RequestError(
            f"previous_response_id: no stored response with id {rid!r} (it was never stored, was "
            "created with store=false, was evicted from the in-memory store "
            "(serve.responses_store_mib), or the server restarted)",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    return entry.items


@dataclass
class _Run:
    """One admitted request: what the answer needs."""

    ctx: _Context
    greq: GenerationRequest
    events: Any  # moe_service.server._Events
    parser: tl.OutputParser
    builder: OutputBuilder
    conversation: list[Any]  # the stored chain's items + this input (output items appended at the end)
    reasoning_tokens: int = 0

    def step(self, ev: Event) -> list[dict[str, Any]]:
        before = _in_reasoning(self.parser)
        deltas = self.parser.feed(ev.text, ev.token_ids)
        if ev.final:
            deltas += self.parser.finish(ev.finish_reason)
        if before or any(d.kind == "reasoning" for d in deltas):
            self.reasoning_tokens += ev.n_tokens
        return self.builder.feed(deltas)

    def final(self, ev: Event) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """(closing events, the final response object) for the last engine event."""
        incomplete = ev.finish_reason == "length"
        evs = self.builder.finish(incomplete=incomplete)
        resp = self.ctx.response(
            status="incomplete" if incomplete else "completed",
            output=self.builder.items,
            usage=usage_of(ev, self.reasoning_tokens),
            incomplete="max_output_tokens" if incomplete else None,
        )
        return evs, resp


def _keep(service, run: _Run, resp: dict[str, Any]) -> None:
    if run.ctx.body.store is False:
        return
    if not _store_of(service).put(run.ctx.id, run.conversation + run.builder.items, resp):
        log.info(
            "response_not_stored", response_id=run.ctx.id, reason="larger than serve.responses_store_mib"
        )


async def create_response(service, request: Request) -> Response:
    """POST /v1/responses: validate, convert, submit, then answer (JSON or typed SSE events)."""
    from moe_service.engine.sampler import SamplingParams
    from moe_service.request_limits import admission_precheck, chat_chars

    t_arrival = time.monotonic()
    rid = _new_id("resp")
    try:
        service.check_serving()
        body = validate_body(ResponsesBody, await read_json(request))
        _refuse_unsupported(body)
        service.check_model(body.model)
        ctx = _Context(rid, int(time.time()), service.model_name, body)
        history = _history(service, body)
        items = input_items(body.input)
        if not items or body.generate is False:  # a probe (empty input, Codex's prewarm): no generation
            log.info("responses_probe", request_id=rid, previous_response_id=body.previous_response_id)
            return _empty(ctx)
        req = to_chat(body, history, items)
        admission_precheck(service, chat_chars(req.messages), param="input")
        engine = service.engine
        p = await asyncio.to_thread(plan, engine, req, body)
        max_tokens = service.plan_output(
            len(p.prompt_ids),
            body.max_output_tokens,
            endpoint_policy=ENDPOINT_POLICY,
            absent="context",
            param="max_output_tokens",
            prompt_param="input",
        )
        sampling = SamplingParams.of_request(body.temperature, body.top_k, body.top_p, body.seed)
        events = Events()
        greq = GenerationRequest(
            p.prompt_ids, max_tokens, sampling, (), events.emit, rid, t_arrival, constraint=p.constraint
        )
        builder = OutputBuilder(
            custom=list(req.custom),
            raw_custom=req.forced_custom,
            encrypted_reasoning="reasoning.encrypted_content" in (body.include or ()),
        )
        run = _Run(ctx, greq, events, p.parser(), builder, history + items)
        if (rejected := submit(service, greq, events, ENDPOINT)) is not None:
            return error_response(rejected)
    except Exception as e:  # the request's mistake, a limit, or a bug (a 500): the server keeps serving
        return error_response(refusal(e, ENDPOINT, rid))
    if body.stream:
        return StreamingResponse(
            _stream(service, request, run),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Request-Id": rid},
        )
    return await _complete(service, request, run)


def _empty(ctx: _Context) -> Response:
    resp = ctx.response(status="completed", output=[], usage=usage_of(None, 0))
    if not ctx.body.stream:
        return JSONResponse(resp, headers={"X-Request-Id": ctx.id})
    b = OutputBuilder()
    evs = [
        b.event("response.created", response={**resp, "status": "in_progress", "usage": None}),
        b.event("response.in_progress", response={**resp, "status": "in_progress", "usage": None}),
        b.event("response.completed", response=resp),
    ]
    return Response(
        "".join(_sse(e) for e in evs), media_type="text/event-stream", headers={"X-Request-Id": ctx.id}
    )


async def _complete(service, request: Request, run: _Run) -> Response:
    """Wait for the whole response; cancel it when the client disconnects meanwhile."""

    def step(ev: Event) -> None:
        if ev.error is None:
            run.step(ev)

    ev = await await_final(service, request, run.greq, run.events, ENDPOINT, step)
    if ev is None:
        return Response(status_code=499)
    if ev.error is not None:
        return error_response(ev.error)
    _, resp = run.final(ev)
    _keep(service, run, resp)
    return JSONResponse(resp, headers={"X-Request-Id": run.greq.request_id})


async def _stream(service, request: Request, run: _Run):
    """The typed SSE events, in OpenAI's order; cancels the sequence if the client goes away."""

    greq, events, b = run.greq, run.events, run.builder
    done = False
    try:
        start = run.ctx.response(status="in_progress")
        yield _sse(b.event("response.created", response=start))
        yield _sse(b.event("response.in_progress", response=start))
        while True:
            batch = events.burst(await events.get(None))
            out: list[dict[str, Any]] = []
            for ev in batch:
                if ev.error is not None:
                    done = True
                    finish_request(service, greq, ev, ENDPOINT, stream=True)
                    err = {"code": ev.error.code or "server_error", "message": ev.error.message}
                    out += b._close("incomplete")
                    out.append(
                        b.event(
                            "response.failed",
                            response=run.ctx.response(
                                status="failed",
                                output=b.items,
                                error=err,
                                usage=usage_of(ev, run.reasoning_tokens),
                            ),
                        )
                    )
                    yield "".join(_sse(e) for e in out)
                    return
                out += run.step(ev)
                if ev.final:
                    done = True
                    finish_request(service, greq, ev, ENDPOINT, stream=True)
                    closing, resp = run.final(ev)
                    out += closing
                    _keep(service, run, resp)
                    kind = "response.completed" if resp["status"] == "completed" else "response.incomplete"
                    out.append(b.event(kind, response=resp))
                    yield "".join(_sse(e) for e in out)
                    return
            if out:
                yield "".join(_sse(e) for e in out)
    finally:
        events.close()
        if not done:
            log.info("client_disconnected", request_id=greq.request_id, endpoint=ENDPOINT)
            service.batch.cancel(greq)


def get_stored(service, response_id: str) -> Response:
    """GET /v1/responses/{id}: a stored response (404 when not stored)."""

    entry = _store_of(service).get(response_id)
    if entry is None:
        return error_response(
            RequestError(
                f"No response found with id {response_id!r}",
                status=404,
                param="response_id",
                code="not_found",
            )
        )
    return JSONResponse(entry.response)


def delete_stored(service, response_id: str) -> Response:
    """DELETE /v1/responses/{id}."""

    if not _store_of(service).delete(response_id):
        return error_response(
            RequestError(
                f"No response found with id {response_id!r}",
                status=404,
                param="response_id",
                code="not_found",
            )
        )
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})
