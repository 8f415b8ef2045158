"""Bounds on what a request may make the server do, checked before any costly work.

::

    bytes --BodyLimit (serve.max_body_bytes; 413)--> parse_json_body --> pydantic models
          (Content-Length first, then the bytes actually received)
    parse_json_body: JSON nesting <= MAX_JSON_DEPTH, integers <= MAX_INT_DIGITS digits,
                     no NaN/Infinity, no lone UTF-16 surrogates in any string (400 naming the
                     field), never a RecursionError or ValueError escaping as a 500
    admission_precheck: the queue has room (429) and the prompt's characters can fit the
                     context (400 context_length_exceeded), before tokenization or templating

Every refusal is a :class:`~moe_service.engine.engine.RequestError` (an OpenAI error object),
so the handler answers it like any other bad request and never logs a traceback for it.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from moe_service.api.envelopes import error_body, is_anthropic_path
from moe_service.engine.engine import RequestError

MAX_JSON_DEPTH = 64
"""Most nested arrays/objects in a request body. The API's deepest legitimate structure
(a tool's JSON schema inside ``tools``) stays well under it; 10,000 levels would make
the parser recurse 10,000 times."""

MAX_INT_DIGITS = 40
"""Most digits of an integer in a request body (a u64 seed has 20). Python refuses to convert
more than 4300 digits (``sys.int_info.str_digits_check_threshold``) with a ValueError, and
converting a 4,000-digit number costs time for nothing."""

MAX_NUMBER_CHARS = 400
"""Most characters of a floating-point literal (a double needs at most ~25)."""

MAX_STOP_CHARS = 512
"""Longest stop string, in characters: the stop matcher holds back up to this many characters
of every stream and scans them at each token."""


def _bad_number(text: str) -> RequestError:
    return RequestError(f"invalid JSON body: a number of {len(text)} characters ({text[:20]}...) is too long "
                        f"(integers up to {MAX_INT_DIGITS} digits are accepted)", code="invalid_json")


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _bad_number(text)
    return int(text)


def _parse_float(text: str) -> float:
    if len(text) > MAX_NUMBER_CHARS:
        raise _bad_number(text)
    return float(text)


def _parse_constant(name: str) -> float:
    raise RequestError(f"invalid JSON body: {name} is not a JSON number", code="invalid_json")


def _path(parts: list[str | int]) -> str | None:
    return ".".join(str(p) for p in parts) or None


def _has_lone_surrogate(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def check_json_value(value: Any) -> None:
    """Walk a parsed JSON value (iteratively: no recursion) and refuse nesting deeper than
    :data:`MAX_JSON_DEPTH` and strings (values or keys) holding a lone UTF-16 surrogate
    (``"\\ud800"``: valid JSON, but no valid UTF-8 text; a tokenizer or the response encoder
    would raise on it). Raises RequestError (400) naming the field."""
    stack: list[tuple[Any, list[str | int]]] = [(value, [])]
    while stack:
        v, where = stack.pop()
        if isinstance(v, str):
            if _has_lone_surrogate(v):
                raise RequestError(f"{_path(where) or 'body'}: the text holds a lone UTF-16 surrogate "
                                   "(\\ud800-\\udfff without its pair), which is not valid Unicode",
                                   param=_path(where), code="invalid_value")
            continue
        if not isinstance(v, dict | list):
            continue
        if len(where) >= MAX_JSON_DEPTH:
            raise RequestError(f"invalid JSON body: nested deeper than {MAX_JSON_DEPTH} levels at "
                               f"{_path(where[:8])}...", code="invalid_json")
        if isinstance(v, dict):
            for k, item in v.items():
                if _has_lone_surrogate(k):
                    raise RequestError(f"{_path(where) or 'body'}: a key holds a lone UTF-16 surrogate",
                                       param=_path(where), code="invalid_value")
                stack.append((item, where + [k]))
        else:
            stack.extend((item, where + [i]) for i, item in enumerate(v))


def parse_json_body(raw: bytes) -> Any:
    """The request body as JSON, within the bounds of the module docstring.

    Raises RequestError (400, code ``invalid_json`` or ``invalid_value``) for anything else:
    invalid JSON or UTF-8, nesting deeper than MAX_JSON_DEPTH, numbers too long, NaN or
    Infinity, lone surrogates.
    """
    try:
        value = json.loads(raw, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"We could not parse the JSON body of your request: {e}", code="invalid_json") from None
    except RequestError:  # from the number hooks
        raise
    except RecursionError:  # json's C scanner recurses once per level (10,000 levels: this)
        raise RequestError(f"invalid JSON body: nested deeper than {MAX_JSON_DEPTH} levels",
                           code="invalid_json") from None
    except ValueError as e:  # e.g. a number Python refuses to convert
        raise RequestError(f"invalid JSON body: {e}", code="invalid_json") from None
    check_json_value(value)
    return value


def check_stop_strings(stop: str | list[str] | None) -> None:
    """Refuse stop strings longer than :data:`MAX_STOP_CHARS` (400 naming ``stop``)."""
    stops = [stop] if isinstance(stop, str) else list(stop or ())
    for i, s in enumerate(stops):
        if len(s) > MAX_STOP_CHARS:
            param = "stop" if isinstance(stop, str) else f"stop.{i}"
            raise RequestError(f"{param}: a stop string may hold at most {MAX_STOP_CHARS} characters "
                               f"(got {len(s)})", param=param, code="invalid_value")


def prompt_chars(prompt: Any) -> int:
    """Characters of a completion prompt or of chat messages' text content (token-id prompts
    count one per id)."""
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list):
        return sum(prompt_chars(p) if isinstance(p, str | list | dict) else 1 for p in prompt)
    if isinstance(prompt, dict):
        return sum(len(v) if isinstance(v, str) else prompt_chars(v) for v in prompt.values()
                   if isinstance(v, str | list | dict))
    return 0


def chat_chars(messages: Any) -> int:
    """Characters of chat messages' text: string contents and the ``text`` of content parts."""
    n = 0
    for m in messages or ():
        content = getattr(m, "content", None) if not isinstance(m, dict) else m.get("content")
        if isinstance(content, str):
            n += len(content)
        elif isinstance(content, list):
            n += sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return n


def admission_precheck(service, chars: int, *, param: str) -> None:
    """Cheap checks before tokenization and templating (which run on the shared thread pool
    and cost time in the prompt's size): the queue has a place (else QueueFull, 429) and
    ``chars`` characters of prompt can fit the context (else 400 context_length_exceeded
    naming ``param``). The character bound is ``engine.max_prompt_chars``: no prompt longer
    than that can tokenize to fewer than n_ctx tokens."""
    batch = service.batch
    check = getattr(batch, "check_capacity", None)
    if check is not None:
        check()
    limit = getattr(service.engine, "max_prompt_chars", None)
    if limit is not None and chars > limit:
        raise RequestError(f"{param}: the prompt has {chars} characters, more than the {limit} that can fit "
                           f"this model's context of {service.engine.n_ctx} tokens. Please shorten it.",
                           param=param, code="context_length_exceeded")


class BodyTooLarge(RequestError):
    """The request body exceeds ``serve.max_body_bytes``: 413."""

    def __init__(self, limit: int, got: int | None = None):
        what = f"{got} bytes" if got is not None else "more bytes"
        super().__init__(f"the request body has {what}; this server accepts at most {limit} bytes "
                         "(serve.max_body_bytes)", status=413, code="request_too_large")


class BodyLimit:
    """ASGI middleware over a request's body: bodies larger than ``service.max_body_bytes``
    (None or 0: no limit) get 413 before they are read, from their Content-Length when given,
    else as soon as the bytes received pass the limit (chunked bodies); a body whose next piece
    takes longer than ``service.body_timeout_s`` (None: no limit) gets 408. A handler reading
    the body then gets the RequestError (answered like any other request error). Once the body
    is complete, receive() is left alone (it then waits for the client to go away)."""

    def __init__(self, app, service):
        self.app = app
        self.service = service

    async def __call__(self, scope, receive, send):
        limit = getattr(self.service, "max_body_bytes", None)
        timeout_s = getattr(self.service, "body_timeout_s", None)
        if scope["type"] != "http" or not (limit or timeout_s):
            return await self.app(scope, receive, send)
        length = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
        if length is not None and limit:
            try:
                n = int(length)
            except ValueError:
                n = -1
            if n < 0:
                return await _send_error(send, RequestError(f"invalid Content-Length {length[:40]!r}"),
                                         scope.get("path", ""))
            if n > limit:
                return await _send_error(send, BodyTooLarge(limit, n), scope.get("path", ""))
        seen = 0
        body_done = False

        async def limited_receive():
            nonlocal seen, body_done
            if body_done or not timeout_s:
                message = await receive()
            else:
                try:
                    message = await asyncio.wait_for(receive(), timeout_s)
                except TimeoutError:
                    raise RequestError(f"the request body stalled: no data for {timeout_s:g} s "
                                       "(serve.body_timeout_s)", status=408, code="request_timeout") from None
            if message["type"] == "http.request":
                body_done = not message.get("more_body", False)
                seen += len(message.get("body", b""))
                if limit and seen > limit:
                    raise BodyTooLarge(limit)
            return message

        return await self.app(scope, limited_receive, send)


async def _send_error(send, err: RequestError, path: str = "") -> None:
    if is_anthropic_path(path):  # Anthropic's clients read their own envelope
        body = json.dumps(error_body(err.status, err.message)).encode()
    else:
        body = json.dumps(err.to_dict()).encode()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


__all__ = ["BodyLimit", "BodyTooLarge", "chat_chars", "MAX_JSON_DEPTH", "MAX_INT_DIGITS", "MAX_STOP_CHARS", "parse_json_body", "check_json_value",
           "check_stop_strings", "prompt_chars", "admission_precheck"]
