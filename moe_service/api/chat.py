"""Chat requests with tools, reasoning and response_format: prompt + constraint in, message out.

::

    body (validated by moe_service.server) --check_tools / check_tool_choice / response_format-->
    plan_chat (worker thread): the model's ChatFormat -> messages/tools for its template ->
      prompt ids + text -> the constraint (tool_choice required/named: the family's call
      grammar; response_format: the JSON schema) -> ChatPlan
    engine events --ChatPlan.parser()--> Delta (content / reasoning / tool_call)
      --> MessageBuilder (one JSON answer) | StreamBuilder (chat.completion.chunk deltas)

Errors are RequestError 400 naming the field: ``tools.1.function.name``,
``tool_choice``, ``response_format.json_schema.schema`` (with llguidance's message for a
schema it cannot compile), ``chat_template_kwargs``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from moe_service.api import tools as tl
from moe_service.api.grammar import GrammarError, compile_constraint, json_schema_grammar
from moe_service.engine.engine import RequestError

_NAME = re.compile(r"^[a-zA-Z0-9_.-]{1,64}$")


def check_tools(tools: Sequence[Any] | None) -> list[dict[str, Any]]:
    """The request's ``tools`` as a list of OpenAI function tools; raises RequestError naming
    the first bad field."""
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, t in enumerate(tools or []):
        p = f"tools.{i}"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise RequestError(f"{p}.type: only function tools are supported", param=f"{p}.type",
                               code="unsupported_parameter")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise RequestError(f"{p}.function: an object with a name is required", param=f"{p}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise RequestError(f"{p}.function.name: must be 1-64 characters of a-z, A-Z, 0-9, '_', '.', '-' "
                               f"(got {json.dumps(name)[:80]})", param=f"{p}.function.name")
        if name in seen:
            raise RequestError(f"{p}.function.name: {name!r} is declared twice", param=f"{p}.function.name")
        seen.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise RequestError(f"{p}.function.parameters: must be a JSON schema object", param=f"{p}.function.parameters")
        out.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    return out


def check_tool_choice(choice: Any, tools: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """(mode, the tools a call may use): mode ``none`` | ``auto`` | ``required`` | ``named``
    (exactly one call of that one tool). Raises RequestError (param ``tool_choice``)."""
    if choice is None:
        return ("auto" if tools else "none"), tools
    if choice in ("none", "auto", "required"):
        if choice == "required" and not tools:
            raise RequestError("tool_choice 'required' needs at least one tool in 'tools'", param="tool_choice")
        return choice, tools
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        match = [t for t in tools if t["function"]["name"] == name]
        if not match:
            raise RequestError(f"tool_choice names function {name!r}, which is not in 'tools' "
                               f"({', '.join(t['function']['name'] for t in tools) or 'none given'})",
                               param="tool_choice.function.name")
        return "named", match
    raise RequestError(f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'function': "
                       f"{{'name': ...}}}} (got {json.dumps(choice)[:80]})", param="tool_choice")


def check_response_format(fmt: Mapping[str, Any] | None) -> tuple[dict[str, Any] | None, str]:
    """(the JSON schema a response must follow (``json_object``: any object) or None for
    text, the request field to name in errors)."""
    if not fmt:
        return None, "response_format"
    kind = fmt.get("type")
    if kind == "text":
        return None, "response_format"
    if kind == "json_object":
        return {"type": "object"}, "response_format"
    if kind == "json_schema":
        js = fmt.get("json_schema")
        if not isinstance(js, dict):
            raise RequestError("response_format.json_schema: an object with 'name' and 'schema' is required",
                               param="response_format.json_schema")
        schema = js.get("schema", {})
        if not isinstance(schema, dict):
            raise RequestError("response_format.json_schema.schema: must be a JSON schema object",
                               param="response_format.json_schema.schema")
        return schema, "response_format.json_schema.schema"
    raise RequestError(f"response_format.type must be 'text', 'json_object' or 'json_schema' (got {kind!r})",
                       param="response_format.type")


@dataclass
class ChatPlan:
    """What one chat request runs: prompt, optional constraint, and how to read the output."""

    prompt_ids: list[int]
    prompt_text: str
    fmt: tl.ChatFormat
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_mode: str = "none"
    reasoning: bool = True
    in_reasoning: bool = False
    constraint: Any = None
    tokenizer: Any = None
    single_call: bool = False  # parallel_tool_calls false: calls after the first are dropped

    def parser(self) -> tl.OutputParser:
        return tl.OutputParser(self.fmt, tools=self.tools if self.tool_mode != "none" else None,
                               reasoning=self.reasoning, in_reasoning=self.in_reasoning, tokenizer=self.tokenizer,
                               max_calls=1 if (self.single_call or self.tool_mode == "named") else None)


def plan_chat(engine, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]], tool_choice: Any,
              parallel_tool_calls: bool | None, schema: dict[str, Any] | None,
              template_kwargs: Mapping[str, Any] | None, reasoning_effort: str | None = None,
              schema_param: str = "response_format.json_schema.schema") -> ChatPlan:
    """Render the prompt and build the constraint (a worker thread: templates and grammar
    compilation take milliseconds). Raises RequestError naming the field at fault."""
    tok = engine.tokenizer
    mode, allowed = check_tool_choice(tool_choice, tools)
    fmt = tl.chat_format(tok) if hasattr(tok, "token_to_id") else tl.ChatFormat()
    if mode != "none" and fmt.family == "harmony" and fmt.harmony_error:
        raise RequestError(f"tool calling on this gpt-oss model needs openai-harmony's vocabulary: "
                           f"{fmt.harmony_error}", param="tools", code="unsupported_parameter")
    tvars: dict[str, Any] = dict(template_kwargs or {})
    if reasoning_effort is not None:
        tvars.setdefault("reasoning_effort", reasoning_effort)
    msgs, extra = tl.prepare_messages(fmt, messages, tools if mode != "none" else None)
    for k in ("messages", "add_generation_prompt"):
        if k in tvars:
            raise RequestError(f"chat_template_kwargs.{k}: set by the server", param=f"chat_template_kwargs.{k}")
    tvars.update(extra)
    prompt_ids, text = engine.render_chat(msgs, tvars)
    thinking = tvars.get("enable_thinking", tvars.get("thinking", True)) is not False
    in_reasoning = tl.prompt_opens_reasoning(fmt, text)
    plan = ChatPlan(prompt_ids, text, fmt, tools=tools, tool_mode=mode, reasoning=True, in_reasoning=in_reasoning,
                    tokenizer=tok, single_call=parallel_tool_calls is False)
    grammar = None
    param = None
    if mode in ("required", "named"):
        parallel = mode == "required" and parallel_tool_calls is not False
        for t in allowed:
            try:
                compile_constraint(tok, json_schema_grammar(tl._schema_of(t)))
            except GrammarError as e:
                idx = next(j for j, u in enumerate(tools) if u is t)
                raise RequestError(f"tools.{idx}.function.parameters: the schema cannot be enforced: {e}",
                                   param=f"tools.{idx}.function.parameters", code="invalid_json_schema") from None
        grammar = tl.tool_grammar(fmt, tok, allowed, parallel=parallel, reasoning_open=in_reasoning,
                                  reasoning_allowed=thinking or in_reasoning)
        param = "tools"
    elif schema is not None:
        try:
            grammar = tl.json_grammar(fmt, schema, reasoning_open=in_reasoning, reasoning_allowed=thinking or in_reasoning)
        except (GrammarError, ValueError) as e:
            raise RequestError(f"{schema_param}: the schema cannot be enforced: {e}",
                               param=schema_param, code="invalid_json_schema") from None
        param = schema_param
    if grammar is not None:
        try:
            plan.constraint = compile_constraint(tok, grammar)
        except GrammarError as e:
            raise RequestError(f"{param}: the schema cannot be enforced: {e}", param=param,
                               code="invalid_json_schema") from None
    return plan


class MessageBuilder:
    """Collects parser deltas into one assistant message (non-streamed answers)."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[tl.ToolCall] = []
        self.cut = False  # a call cut by the output limit was dropped (tools.OutputParser.finish)

    def add(self, deltas: Sequence[tl.Delta]) -> None:
        """Add parsed pieces; whitespace-only content around tool calls (kept or cut) is dropped."""
        for d in deltas:
            if d.kind == "content":
                self.content.append(d.text)
            elif d.kind == "reasoning":
                self.reasoning.append(d.text)
            elif d.kind == "tool_call_cut":
                self.cut = True
            elif d.call is not None:
                self.calls.append(d.call)

    def message(self) -> dict[str, Any]:
        content = "".join(self.content)
        if (self.calls or self.cut) and not content.strip():
            content = ""
        msg: dict[str, Any] = {"role": "assistant", "content": content if (content or not self.calls) else None}
        reasoning = "".join(self.reasoning)
        if reasoning:
            msg["reasoning_content"] = reasoning
        if self.calls:
            msg["tool_calls"] = [c.to_openai() for c in self.calls]
        return msg

    def finish_reason(self, engine_reason: str | None) -> str | None:
        return "tool_calls" if self.calls and engine_reason == "stop" else engine_reason


class StreamBuilder:
    """Turns parser deltas into the ``delta`` objects of chat.completion.chunk events."""

    def __init__(self) -> None:
        self.n_calls = 0
        self._space = ""  # whitespace-only content held: dropped when a tool call follows

    def deltas(self, items: Sequence[tl.Delta], *, final: bool = False) -> list[dict[str, Any]]:
        """Delta objects for ``items``; ``final``: the last call, held whitespace is released
        when no tool call came."""
        out: list[dict[str, Any]] = []
        for d in items:
            if d.kind in ("content", "reasoning"):
                key = "content" if d.kind == "content" else "reasoning_content"
                if not d.text:
                    continue
                if key == "content":
                    if not d.text.strip():
                        self._space += d.text
                        continue
                    d = tl.Delta("content", self._space + d.text)
                    self._space = ""
                if out and set(out[-1]) == {key}:
                    out[-1][key] += d.text
                else:
                    out.append({key: d.text})
            elif d.kind == "tool_call_cut":
                self._space = ""  # the whitespace led to a call the output limit cut off
            elif d.call is not None:
                self._space = ""
                i = self.n_calls
                self.n_calls += 1
                out.append({"tool_calls": [{"index": i, "id": d.call.id, "type": "function",
                                            "function": {"name": d.call.name, "arguments": ""}}]})
                out.append({"tool_calls": [{"index": i, "function": {"arguments": d.call.arguments}}]})
        if final and self._space and not self.n_calls:
            out.append({"content": self._space})
            self._space = ""
        return out

    def finish_reason(self, engine_reason: str | None) -> str | None:
        return "tool_calls" if self.n_calls and engine_reason == "stop" else engine_reason
