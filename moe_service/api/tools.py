"""Tool calls and reasoning per model family: prompt preparation, constraint grammars, parsers.

A model's :class:`ChatFormat` is detected once from its chat template and vocabulary:

==========  ==================================================================  ================
family      the model writes a call as                                          chosen when
==========  ==================================================================  ================
hermes      ``<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>``     default (Qwen,
            (Qwen2.5/3, Hermes, and every template without tool support)        Hermes, ChatML)
deepseek    ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>...<｜tool▁calls▁end｜>``  the vocabulary has
            in three dialects: ``v3`` (R1/V3: ``function<｜tool▁sep｜>N`` +      ``<｜tool▁calls▁begin｜>``
            a fenced json block), ``v31`` (V3.1: ``N<｜tool▁sep｜>{...}``) and   or the template
            ``dsml`` (V3.2/V4: ``<｜DSML｜function_calls>`` + ``invoke`` and      writes ``DSML``
            ``parameter`` elements)
harmony     gpt-oss: a ``commentary`` message to ``functions.N``, parsed by      the vocabulary has
            the ``openai-harmony`` package from token ids                       ``<|channel|>``
llama3      ``{"name": N, "parameters": {...}}`` (optionally after               the template knows
            ``<|python_tag|>``)                                                  ``<|python_tag|>``
==========  ==================================================================  ================

Reasoning: ``<think>...</think>`` (Qwen3, DeepSeek R1/V3.1+/V4) when the vocabulary or the
template has ``<think>``; a prompt that already opened ``<think>`` (R1, V3.1 thinking mode)
starts the parser inside the reasoning. gpt-oss: the ``analysis`` channel.

Prompting: tools go to the template as its jinja ``tools`` variable when the template renders
them (probed once by rendering a dummy tool); otherwise (e.g. the demo model's ChatML
template) the tool list is written into the system message in Hermes form, assistant tool
calls are written back as ``<tool_call>`` text and tool results as ``<tool_response>`` user
turns, as Qwen2.5's template does.

Parsing (:class:`OutputParser`): text streams as content until a call's opening marker; the
call is held until its closing marker (or the end), then parsed. A call that does not parse
(bad JSON, unknown function, arguments not an object) is returned as content, never an error.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from moe_service.log import get_logger

log = get_logger(__name__)

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
DSML = "｜DSML｜"
DSML_OPENS = (f"<{DSML}function_calls>", f"<{DSML}tool_calls>")
LLAMA_PYTHON_TAG = "<|python_tag|>"
_PROBE_TOOL = {"type": "function", "function": {"name": "moe_probe_fn", "description": "probe",
                                                 "parameters": {"type": "object", "properties": {
                                                     "moe_probe_arg": {"type": "string"}}}}}


def new_call_id() -> str:
    """An OpenAI-style tool call id (``call_`` + 24 hex digits)."""
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCall:
    """One parsed call: ``name`` and ``arguments`` (a JSON object as text), ``id`` as sent."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out = {"index": index, **out}
        return out


@dataclass
class Delta:
    """A piece of parsed output: ``kind`` ``content`` / ``reasoning`` (``text``), ``tool_call``
    (``call``) or ``tool_call_cut`` (no text, no call: a call the output limit cut off was
    dropped, so whitespace held before it is dropped too; consumers that only read content,
    reasoning and calls can ignore it)."""

    kind: str
    text: str = ""
    call: ToolCall | None = None


# ------------------------------------------------------------------------------------- format
@dataclass
class ChatFormat:
    """How one model writes tool calls and reasoning (see the module table)."""

    family: str = "hermes"
    dialect: str = ""  # deepseek: v3 | v31 | dsml
    native_tools: bool = False  # the template renders ``tools``
    native_tool_calls: bool = False  # the template renders assistant ``tool_calls``
    args_as_object: bool = True  # the template wants arguments as a dict (HF convention)
    reasoning: bool = False  # <think> reasoning
    harmony_error: str | None = None  # why openai-harmony cannot be used for this model

    @property
    def description(self) -> str:
        return self.family + (f"/{self.dialect}" if self.dialect else "")


_FORMATS: dict[int, tuple[Any, ChatFormat]] = {}
_FORMAT_LOCK = threading.Lock()


def chat_format(tokenizer) -> ChatFormat:
    """The :class:`ChatFormat` of ``tokenizer``'s model (detected once per tokenizer object)."""
    with _FORMAT_LOCK:
        hit = _FORMATS.get(id(tokenizer))
        if hit is not None and hit[0] is tokenizer:
            return hit[1]
        fmt = detect_format(tokenizer)
        _FORMATS[id(tokenizer)] = (tokenizer, fmt)
        log.info("chat_format_detected", family=fmt.description, native_tools=fmt.native_tools,
                 native_tool_calls=fmt.native_tool_calls, reasoning=fmt.reasoning, harmony_error=fmt.harmony_error)
        return fmt


def detect_format(tokenizer) -> ChatFormat:
    template = getattr(tokenizer, "chat_template", None) or ""
    vocab = getattr(tokenizer, "token_to_id", {}) or {}
    fmt = ChatFormat()
    if "<|channel|>" in vocab or "<|channel|>" in template:
        fmt.family = "harmony"
    elif DS_CALLS_BEGIN in vocab or DS_CALLS_BEGIN in template or DSML in template:
        fmt.family = "deepseek"
        if DSML in template:
            fmt.dialect = "dsml"
        elif "```json" in template:
            fmt.dialect = "v3"
        else:
            fmt.dialect = "v31"
    elif LLAMA_PYTHON_TAG in template or ("<|eom_id|>" in vocab and "tools" in template):
        fmt.family = "llama3"
    fmt.reasoning = fmt.family != "harmony" and (THINK_OPEN in vocab or THINK_OPEN in template)
    if template:
        fmt.native_tools, fmt.native_tool_calls, fmt.args_as_object = _probe_template(tokenizer)
    if fmt.family == "harmony":
        try:
            harmony_encoding(tokenizer)
        except Exception as e:  # reported with every tools request to this model
            fmt.harmony_error = str(e)
    return fmt


def _probe_template(tokenizer) -> tuple[bool, bool, bool]:
    """(renders tools, renders assistant tool_calls, wants dict arguments), by rendering probes."""
    from moe_service.engine.tokenizer import ChatTemplateError

    user = {"role": "user", "content": "hi"}
    try:
        text = tokenizer.apply_chat_template([user], add_generation_prompt=True, tools=[_PROBE_TOOL])
        native_tools = "moe_probe_fn" in text
    except ChatTemplateError:
        native_tools = False
    for as_object in (True, False):
        args: Any = {"moe_probe_arg": "moe_probe_val"}
        call = {"id": "call_probe", "type": "function",
                "function": {"name": "moe_probe_fn", "arguments": args if as_object else json.dumps(args)}}
        msgs = [user, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_probe", "content": "moe_probe_result"}, user]
        try:
            text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True,
                                                 tools=[_PROBE_TOOL] if native_tools else None)
        except ChatTemplateError:
            continue
        if "moe_probe_fn" in text and "moe_probe_val" in text and "moe_probe_result" in text:
            escaped = '\\"moe_probe_arg\\"' in text  # a string argument was re-encoded by tojson
            if as_object or not escaped:
                return native_tools, True, as_object
    return native_tools, False, True


# ---------------------------------------------------------------------------------- harmony
_HARMONY: dict[int, Any] = {}


def harmony_encoding(tokenizer):
    """openai-harmony's gpt-oss encoding, its o200k vocabulary written from the model's own
    tokens (ids 0..199997 as ``base64(bytes) rank`` lines; the package checks the file's
    SHA-256, so only the genuine vocabulary loads). Raises RuntimeError naming the cause."""
    if id(tokenizer) in _HARMONY:
        return _HARMONY[id(tokenizer)]
    import base64

    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    from moe_service.paths import cache_dir

    n_base = 199998
    if tokenizer.n_vocab < n_base:
        raise RuntimeError(f"the vocabulary has {tokenizer.n_vocab} tokens, fewer than o200k's {n_base}")
    d = cache_dir() / "harmony"
    d.mkdir(parents=True, exist_ok=True)
    path = d / "o200k_base.tiktoken"
    if not path.exists():
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        with open(tmp, "w") as f:
            for i in range(n_base):
                f.write(base64.b64encode(tokenizer.token_to_piece(i, special=True)).decode() + f" {i}\n")
        os.replace(tmp, path)
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(d)
    try:
        enc = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    except Exception as e:
        raise RuntimeError(f"openai-harmony could not load the o200k vocabulary written from the model ({path}): "
                           f"{e}") from None
    _HARMONY[id(tokenizer)] = enc
    return enc


# --------------------------------------------------------------------------------- prompting
HERMES_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>"
)


def _call_text(fmt: ChatFormat, name: str, args: str) -> str:
    """A call in the family's own text form (for templates that cannot render tool_calls)."""
    try:
        args_obj = json.loads(args)
    except (TypeError, ValueError):
        args_obj = args
    if fmt.family == "llama3":
        return json.dumps({"name": name, "parameters": args_obj}, ensure_ascii=False)
    if fmt.family == "deepseek":
        body = json.dumps(args_obj, ensure_ascii=False)
        if fmt.dialect == "v3":
            return f"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}{name}\n```json\n{body}\n```{DS_CALL_END}{DS_CALLS_END}"
        return f"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}{name}{DS_SEP}{body}{DS_CALL_END}{DS_CALLS_END}"
    return f"{HERMES_OPEN}\n{json.dumps({'name': name, 'arguments': args_obj}, ensure_ascii=False)}\n{HERMES_CLOSE}"


def prepare_messages(fmt: ChatFormat, messages: Sequence[Mapping[str, Any]],
                     tools: list[dict[str, Any]] | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Messages (OpenAI shapes: assistant ``tool_calls``, ``tool`` role) and the template's extra
    variables, in the form this model's template takes. Returns (messages, {"tools": ...})."""
    out: list[dict[str, Any]] = []
    extra: dict[str, Any] = {}
    fallback_tools = bool(tools) and not fmt.native_tools
    if tools and fmt.native_tools:
        extra["tools"] = tools
    pending_results: list[str] = []

    def flush_results() -> None:
        if pending_results:
            out.append({"role": "user", "content": "\n".join(
                f"<tool_response>\n{r}\n</tool_response>" for r in pending_results)})
            pending_results.clear()

    for m in messages:
        m = dict(m)
        role = m.get("role")
        if role == "tool" and not fmt.native_tool_calls:
            pending_results.append(m.get("content") or "")
            continue
        flush_results()
        calls = m.get("tool_calls")
        if role == "assistant" and calls:
            if fmt.native_tool_calls:
                fixed = []
                for c in calls:
                    fn = dict(c["function"])
                    if fmt.args_as_object:
                        try:
                            fn["arguments"] = json.loads(fn["arguments"])
                        except (TypeError, ValueError):
                            pass  # rendered as the string the client sent
                    fixed.append({**c, "function": fn})
                m["tool_calls"] = fixed
            else:
                text = "\n".join(_call_text(fmt, c["function"]["name"], c["function"]["arguments"]) for c in calls)
                m.pop("tool_calls")
                m["content"] = ((m.get("content") or "") + ("\n" if m.get("content") else "") + text)
        if m.get("content") is None:
            m["content"] = ""
        out.append(m)
    flush_results()
    if fallback_tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        note = HERMES_SYSTEM.format(tools=listing)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{note}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": note})
    return out, extra


def prompt_opens_reasoning(fmt: ChatFormat, prompt_text: str) -> bool:
    """True when the rendered prompt ends inside an open ``<think>`` (R1, V3.1 thinking)."""
    if not fmt.reasoning:
        return False
    i = prompt_text.rfind(THINK_OPEN)
    return i >= 0 and prompt_text.rfind(THINK_CLOSE) < i and not prompt_text[i + len(THINK_OPEN):].strip()


# ------------------------------------------------------------------------ constraint grammars
def _lit(text: str, specials: Mapping[str, int]) -> str:
    """Lark for literal ``text``: control-token texts inside it as special tokens ``<...>``."""
    parts: list[str] = []
    pos = 0
    names = sorted((t for t in specials if t and t in text), key=len, reverse=True)
    while pos < len(text):
        hit = min(((text.find(n, pos), -len(n), n) for n in names if text.find(n, pos) >= 0), default=None)
        if hit is None:
            parts.append(json.dumps(text[pos:]))
            break
        at, _, name = hit
        if at > pos:
            parts.append(json.dumps(text[pos:at]))
        parts.append(name if name.startswith("<") and name.endswith(">") else json.dumps(name))
        pos = at + len(name)
    return " ".join(parts) if parts else '""'


def control_texts(tokenizer) -> dict[str, int]:
    """Texts of the tokenizer's control tokens (what the grammar must write as ``<...>``)."""
    from moe_service.engine.tokenizer import ATTR_CONTROL

    attrs = getattr(tokenizer, "attrs", None)
    if attrs is None:
        return {}
    return {tokenizer.tokens[i]: i for i, a in enumerate(attrs) if a & ATTR_CONTROL}


def _schema_of(tool: Mapping[str, Any]) -> dict[str, Any]:
    params = tool.get("function", {}).get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object"}


def _dsml_params(schema: Mapping[str, Any], lit) -> str:
    from moe_service.api.grammar import lark_json

    props = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    if not props:
        return '""'
    items = []
    for k, sub in props.items():
        sub = sub if isinstance(sub, dict) else {}
        if sub.get("type") == "string":
            value = lit(f'<{DSML}parameter name="{k}" string="true">') + " /[^<]*/ " + lit(f"</{DSML}parameter>\n")
        else:
            value = lit(f'<{DSML}parameter name="{k}" string="false">') + " " + lark_json(sub) + " " + \
                lit(f"</{DSML}parameter>\n")
        items.append(f"({value})" + ("" if k in required else "?"))
    return " ".join(items)


def tool_grammar(fmt: ChatFormat, tokenizer, tools: list[dict[str, Any]], *, parallel: bool,
                 reasoning_open: bool, reasoning_allowed: bool) -> str:
    """llguidance grammar text that admits only calls to ``tools`` in the family's form
    (``tool_choice`` ``required``: any of them; a named choice: a one-tool list), one call or,
    with ``parallel``, one or more; an optional reasoning block first when the model thinks."""
    from moe_service.api.grammar import lark_grammar, lark_json

    specials = control_texts(tokenizer)

    def lit(s: str) -> str:
        return _lit(s, specials)

    rules: list[str] = []
    alts = []
    for i, t in enumerate(tools):
        name = t["function"]["name"]
        schema = _schema_of(t)
        if fmt.family == "deepseek" and fmt.dialect == "v3":
            body = (lit(f"{DS_CALL_BEGIN}function{DS_SEP}{name}\n```json\n") + " " + lark_json(schema) + " "
                    + lit(f"\n```{DS_CALL_END}"))
        elif fmt.family == "deepseek" and fmt.dialect == "v31":
            body = lit(f"{DS_CALL_BEGIN}{name}{DS_SEP}") + " " + lark_json(schema) + " " + lit(DS_CALL_END)
        elif fmt.family == "deepseek":
            body = (lit(f'<{DSML}invoke name="{name}">\n') + " " + _dsml_params(schema, lit) + " "
                    + lit(f"</{DSML}invoke>\n"))
        elif fmt.family == "llama3":
            body = lark_json({"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                              "required": ["name", "parameters"], "additionalProperties": False})
        elif fmt.family == "harmony":
            body = (lit(f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>") + " "
                    + lark_json(schema))
        else:
            body = lit(f"{HERMES_OPEN}\n") + " " + lark_json(
                {"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
                 "required": ["name", "arguments"], "additionalProperties": False}) + " " + lit(f"\n{HERMES_CLOSE}")
        rules.append(f"call_{i}: {body}")
        alts.append(f"call_{i}")
    rules.append("call: " + " | ".join(alts))
    if fmt.family == "deepseek" and fmt.dialect == "dsml":
        calls = lit(DSML_OPENS[0] + "\n") + (" call+ " if parallel else " call ") + lit(f"</{DSML}function_calls>")
    elif fmt.family == "deepseek":
        calls = lit(DS_CALLS_BEGIN) + (" call+ " if parallel else " call ") + lit(DS_CALLS_END)
    elif fmt.family == "llama3" or fmt.family == "harmony":
        calls = "call"  # one call per turn (the model ends its turn with <|eom_id|> / <|call|>)
    else:
        calls = 'call ("\\n" call)*' if parallel else "call"
    rules.append(f"calls: {calls}")
    rules.insert(0, "start: " + _reasoning_prefix(fmt, reasoning_open, reasoning_allowed, rules) + "calls")
    return lark_grammar("\n".join(rules))


def _reasoning_prefix(fmt: ChatFormat, reasoning_open: bool, reasoning_allowed: bool, rules: list[str]) -> str:
    if fmt.family == "harmony":
        if reasoning_allowed:
            rules.append('analysis[stop="<|end|>"]: "<|channel|>analysis<|message|>" /(.|\\n)*/')
            rules.append('after_analysis: "<|start|>assistant"')
            return "(analysis after_analysis)? "
        return ""
    if not fmt.reasoning or not reasoning_allowed:
        return ""
    if reasoning_open:
        rules.append('think_rest[stop="</think>"]: /(.|\\n)*/')
        return 'think_rest /[ \\n]*/ '
    rules.append('think[stop="</think>"]: "<think>" /(.|\\n)*/')
    return '(think /[ \\n]*/)? '


def json_grammar(fmt: ChatFormat, schema: dict[str, Any], *, reasoning_open: bool, reasoning_allowed: bool) -> str:
    """llguidance grammar for a response_format JSON schema, after an optional reasoning block."""
    from moe_service.api.grammar import json_schema_grammar, lark_grammar, lark_json

    rules: list[str] = []
    prefix = _reasoning_prefix(fmt, reasoning_open, reasoning_allowed, rules)
    if not prefix:
        return json_schema_grammar(schema)
    if fmt.family == "harmony":
        prefix += '"<|channel|>final<|message|>" '
    return lark_grammar("\n".join([f"start: {prefix}{lark_json(schema)}", *rules]))


# ------------------------------------------------------------------------------------ parsing
def _parse_json_object(text: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(text)
    except (TypeError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def parse_hermes(block: str, names: set[str]) -> list[ToolCall] | None:
    """``<tool_call>{json}</tool_call>`` (one block; markers included or not)."""
    inner = block.strip()
    inner = inner.removeprefix(HERMES_OPEN).removesuffix(HERMES_CLOSE).strip()
    obj = _parse_json_object(inner)
    if obj is None or not isinstance(obj.get("name"), str) or obj["name"] not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = _parse_json_object(args)
    if not isinstance(args, dict):
        return None
    return [ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))]


_DS_V3_CALL = re.compile(re.escape(DS_CALL_BEGIN) + r"\s*(?:function)?\s*" + re.escape(DS_SEP)
                         + r"\s*([^\n`]+?)\s*\n```(?:json)?\s*\n(.*?)\n?```\s*" + re.escape(DS_CALL_END), re.S)
_DS_V31_CALL = re.compile(re.escape(DS_CALL_BEGIN) + r"\s*([^<\n]+?)\s*" + re.escape(DS_SEP) + r"(.*?)"
                          + re.escape(DS_CALL_END), re.S)
_DSML_INVOKE = re.compile(r"<｜DSML｜invoke\s+name=\"([^\"]+)\"\s*>(.*?)</｜DSML｜invoke>", re.S)
_DSML_PARAM = re.compile(r"<｜DSML｜parameter\s+name=\"([^\"]+)\"\s+string=\"(true|false)\"\s*>(.*?)</｜DSML｜parameter>",
                         re.S)


def parse_deepseek(block: str, names: set[str]) -> list[ToolCall] | None:
    """A DeepSeek tool-calls block in any of the three dialects; None when anything is off."""
    calls: list[ToolCall] = []
    if DSML in block:
        invokes = _DSML_INVOKE.findall(block)
        if not invokes:
            return None
        for name, body in invokes:
            if name not in names:
                return None
            args: dict[str, Any] = {}
            for key, is_string, value in _DSML_PARAM.findall(body):
                if is_string == "true":
                    args[key] = value
                else:
                    try:
                        args[key] = json.loads(value)
                    except ValueError:
                        return None
            calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
        return calls
    found = _DS_V3_CALL.findall(block) or _DS_V31_CALL.findall(block)
    if not found:
        return None
    for name, body in found:
        name = name.strip()
        args = _parse_json_object(body.strip())
        if name not in names or args is None:
            return None
        calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
    return calls


def parse_llama3(text: str, names: set[str]) -> list[ToolCall] | None:
    """``{"name": N, "parameters": {...}}`` (``arguments`` accepted too), one or several
    separated by ``;`` or newlines, optionally after ``<|python_tag|>``."""
    body = text.strip().removeprefix(LLAMA_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return None
    dec = json.JSONDecoder()
    calls = []
    pos = 0
    while pos < len(body):
        try:
            obj, end = dec.raw_decode(body, pos)
        except ValueError:
            return None
        if not isinstance(obj, dict) or obj.get("name") not in names:
            return None
        args = obj.get("parameters", obj.get("arguments", {}))
        if isinstance(args, str):
            args = _parse_json_object(args)
        if not isinstance(args, dict):
            return None
        calls.append(ToolCall(obj["name"], json.dumps(args, ensure_ascii=False)))
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return calls or None


class OutputParser:
    """Splits a completion into content, reasoning and tool calls, incrementally.

    ``feed(text, token_ids)`` with each engine event's text and tokens returns the
    :class:`Delta` list that is final now; ``finish(reason)`` flushes the rest. ``tools``: the
    request's tool list (None: no tool parsing); ``reasoning``: parse ``<think>``;
    ``in_reasoning``: the prompt already opened the reasoning block; ``max_calls``: calls past
    this many are dropped (``parallel_tool_calls: false``; logged).
    """

    def __init__(self, fmt: ChatFormat, *, tools: list[dict[str, Any]] | None, reasoning: bool,
                 in_reasoning: bool = False, tokenizer=None, max_calls: int | None = None):
        self.fmt = fmt
        self.names = {t["function"]["name"] for t in tools or []}
        self.parse_tools = bool(tools)
        self.reasoning = reasoning and fmt.reasoning
        self.state = "reasoning" if (self.reasoning and in_reasoning) else "start"
        self.buf = ""
        self.calls: list[ToolCall] = []
        self.max_calls = max_calls
        self._harmony = None
        if fmt.family == "harmony" and fmt.harmony_error is None and tokenizer is not None:
            from openai_harmony import Role, StreamableParser

            self._harmony = StreamableParser(harmony_encoding(tokenizer), Role.ASSISTANT)
            self._h_msgs = 0

    # markers that open a tool call block in this family
    def _opens(self) -> tuple[str, ...]:
        if not self.parse_tools:
            return ()
        if self.fmt.family == "deepseek":
            return (DS_CALLS_BEGIN, DS_CALL_BEGIN, *DSML_OPENS)
        if self.fmt.family == "llama3":
            return (LLAMA_PYTHON_TAG,)
        return (HERMES_OPEN,)

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> list[Delta]:
        if self._harmony is not None:
            return self._feed_harmony(token_ids)
        self.buf += text
        return self._drain(final=False)

    def finish(self, reason: str | None = None) -> list[Delta]:
        """The rest of the output once generation ended; ``reason``: the engine's finish
        reason. ``"length"`` (the output limit or the context cut the text): a tool call
        still open is returned as a call when what was written parses (only its closing
        marker is missing), else dropped with a ``tool_call_cut`` delta, and a tail that
        could be the start of a marker (``\\n<tool``, ``</thi``) is dropped: the template's
        markup never reaches the text (a required call cut at max_tokens 64 on the demo model
        used to end the content with ``\\n<tool``). Other reasons keep such text as content
        (the model chose to write it)."""
        cut = reason == "length"
        if self._harmony is not None:
            try:
                self._harmony.process_eos()
            except Exception as e:  # a truncated message: what was parsed stays
                log.info("harmony_parse_incomplete", error=str(e))
            return self._harmony_messages(final=True, cut=cut)
        return self._drain(final=True, cut=cut)

    # -- text families ------------------------------------------------------------------------
    def _drain(self, *, final: bool, cut: bool = False) -> list[Delta]:
        """Deltas final now; ``final``: the output ended (flush); ``cut``: it ended at the
        output limit (see :meth:`finish`)."""
        out: list[Delta] = []
        while True:
            before = (self.state, len(self.buf))
            if self.state == "start":
                stripped = self.buf.lstrip()
                if not stripped and not final:
                    return out
                if self.reasoning and stripped.startswith(THINK_OPEN):
                    self.buf = stripped[len(THINK_OPEN):]
                    self.state = "reasoning"
                elif self.reasoning and THINK_OPEN.startswith(stripped) and not final:
                    return out
                elif (self.parse_tools and self.fmt.family == "llama3" and stripped.startswith("{")):
                    self.state = "json_call"  # Llama 3 writes a bare JSON call: hold it all
                else:
                    self.state = "content"
            elif self.state == "reasoning":
                i = self.buf.find(THINK_CLOSE)
                if i >= 0:
                    if i:
                        out.append(Delta("reasoning", self.buf[:i]))
                    self.buf = self.buf[i + len(THINK_CLOSE):].lstrip("\n")
                    self.state = "content_start"
                else:
                    keep = _held_prefix(self.buf, (THINK_CLOSE,)) if (not final or cut) else 0
                    emit = self.buf[: len(self.buf) - keep]
                    if emit:
                        out.append(Delta("reasoning", emit))
                    self.buf = "" if final else self.buf[len(self.buf) - keep:]  # cut: the partial marker goes
                    return out
            elif self.state == "content_start":
                stripped = self.buf.lstrip()
                if not stripped and not final:
                    return out
                if self.parse_tools and self.fmt.family == "llama3" and stripped.startswith("{"):
                    self.buf = stripped
                    self.state = "json_call"
                else:
                    self.buf = stripped
                    self.state = "content"
            elif self.state == "content":
                opens = self._opens()
                at, marker = _find_first(self.buf, opens)
                if at >= 0:
                    if at:
                        out.append(Delta("content", self.buf[:at]))
                    self.buf = self.buf[at:]
                    self.state = "call"
                else:
                    keep = _held_prefix(self.buf, opens) if (not final or cut) else 0
                    emit = self.buf[: len(self.buf) - keep]
                    if emit:
                        out.append(Delta("content", emit))
                    if final and keep:  # cut: a call's opening marker had begun
                        log.info("tool_call_cut", family=self.fmt.description, text=self.buf[-keep:])
                        out.append(Delta("tool_call_cut"))
                    self.buf = "" if final else self.buf[len(self.buf) - keep:]
                    return out
            elif self.state == "call":
                end = self._call_end(self.buf)
                if end < 0 and not final:
                    return out
                block = self.buf if end < 0 else self.buf[:end]
                self.buf = "" if end < 0 else self.buf[end:]
                calls = self._parse_block(block)
                if calls is None and end < 0 and cut and self.fmt.family == "hermes":
                    # cut inside the closing marker: the call itself may be whole
                    calls = self._parse_block(block[: len(block) - _held_prefix(block, (HERMES_CLOSE,))])
                if calls is None and end < 0 and cut:  # the output limit cut the call: nothing of it is text
                    log.info("tool_call_cut", family=self.fmt.description, text=block[:200])
                    out.append(Delta("tool_call_cut"))
                elif calls is None:
                    log.info("tool_call_unparsable", family=self.fmt.description, text=block[:200])
                    out.append(Delta("content", block))
                else:
                    for c in calls:
                        out.extend(self._call(c))
                self.state = "content"
            elif self.state == "json_call":
                if not final:
                    return out
                calls = parse_llama3(self.buf, self.names)
                if calls is None:
                    out.append(Delta("content", self.buf))
                else:
                    for c in calls:
                        out.extend(self._call(c))
                self.buf = ""
                return out
            if (self.state, len(self.buf)) == before and final:
                if self.buf:
                    out.append(Delta("content", self.buf))
                    self.buf = ""
                return out

    def _call(self, c: ToolCall) -> list[Delta]:
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            log.info("tool_call_dropped", name=c.name, reason="parallel_tool_calls is false")
            return []
        self.calls.append(c)
        return [Delta("tool_call", call=c)]

    def _call_end(self, buf: str) -> int:
        """Index just past the end of the call block at the start of ``buf``; -1 while open."""
        fam = self.fmt.family
        if fam == "deepseek":
            for close in (DS_CALLS_END, f"</{DSML}function_calls>", f"</{DSML}tool_calls>"):
                i = buf.find(close)
                if i >= 0:
                    return i + len(close)
            return -1
        if fam == "llama3":
            return -1  # <|python_tag|> runs to the end of the turn
        i = buf.find(HERMES_CLOSE)
        return -1 if i < 0 else i + len(HERMES_CLOSE)

    def _parse_block(self, block: str) -> list[ToolCall] | None:
        fam = self.fmt.family
        if fam == "deepseek":
            return parse_deepseek(block, self.names)
        if fam == "llama3":
            return parse_llama3(block, self.names)
        return parse_hermes(block, self.names)

    # -- harmony --------------------------------------------------------------------------
    def _feed_harmony(self, token_ids: Sequence[int]) -> list[Delta]:
        out: list[Delta] = []
        p = self._harmony
        for t in token_ids:
            try:
                p.process(int(t))
            except Exception as e:  # a malformed header: keep the raw text as content
                log.info("harmony_parse_failed", error=str(e))
                self._harmony = None
                return out
            delta = p.last_content_delta
            if delta and not (p.current_recipient or "").startswith("functions."):
                kind = "reasoning" if p.current_channel == "analysis" else "content"
                out.append(Delta(kind, delta))
        out.extend(self._harmony_messages(final=False))
        return out

    def _harmony_messages(self, *, final: bool, cut: bool = False) -> list[Delta]:
        out: list[Delta] = []
        if self._harmony is None:
            return out
        msgs = self._harmony.messages
        for m in msgs[self._h_msgs:]:
            recipient = getattr(m, "recipient", None) or ""
            if not recipient.startswith("functions."):
                continue
            name = recipient[len("functions."):]
            text = "".join(getattr(c, "text", "") for c in m.content)
            args = _parse_json_object(text)
            if name in self.names and args is not None and self.parse_tools:
                out.extend(self._call(ToolCall(name, json.dumps(args, ensure_ascii=False))))
            else:
                out.append(Delta("content", text))
        self._h_msgs = len(msgs)
        if final and self._harmony.current_content and (self._harmony.current_recipient or "").startswith("functions."):
            if cut:  # a call's arguments cut by the output limit: not text
                out.append(Delta("tool_call_cut"))
            else:
                out.append(Delta("content", self._harmony.current_content))
        return out


def _find_first(buf: str, markers: Sequence[str]) -> tuple[int, str]:
    best, which = -1, ""
    for m in markers:
        i = buf.find(m)
        if i >= 0 and (best < 0 or i < best):
            best, which = i, m
    return best, which


def _held_prefix(buf: str, markers: Sequence[str]) -> int:
    """Length of the longest tail of ``buf`` that is a proper prefix of a marker."""
    hold = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(buf)), hold, -1):
            if buf.endswith(m[:n]):
                hold = n
                break
    return hold
