"""API keys and browser-facing hardening of the HTTP API (ASGI middleware).

Order of the checks, outermost first::

    CORS (starlette CORSMiddleware; only when serve.cors_origins is set: off by default, so a
          browser page of another origin can neither read answers nor send a JSON preflight)
    Host allow-list (serve.allowed_hosts; DNS rebinding: a page of evil.example resolving to
          127.0.0.1 still sends Host: evil.example) -> 400 invalid_host
    API key (serve.api_keys / serve.api_key_file), as 'Authorization: Bearer <key>' or
          'x-api-key: <key>' (Anthropic's clients), either admits -> 401 invalid_api_key;
          /health always open, /metrics open unless serve.metrics_auth
    Content-Type on POST: application/json (or */*+json) -> else 415 unsupported_media_type
          (an HTML form or a no-cors fetch can only send text/plain, form or multipart bodies
          without a preflight: such a POST never reaches the engine)

On /v1/messages the refusals use Anthropic's error envelope (``{"type": "error", "error":
{"type", "message"}}``), elsewhere OpenAI's.

Keys are compared in constant time: every configured key's SHA-256 is compared with
``hmac.compare_digest`` against the presented key's, all of them, whatever matches, so
neither the position of a match nor a key's length shows in the timing. The key file holds
one key per line (blank lines and ``#`` comments ignored) and is read again on SIGHUP
(:meth:`ApiKeys.reload`); a file that cannot be read at reload keeps the previous keys.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import threading
from collections.abc import Iterable
from pathlib import Path

from moe_service.api.envelopes import error_body, is_anthropic_path
from moe_service.log import get_logger

log = get_logger(__name__)

OPEN_PATHS = frozenset({"/health"})


class ApiKeyFileError(ValueError):
    """The key file cannot be read (the message names it)."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def read_key_file(path: str | Path) -> list[str]:
    """Keys in ``path``: one per line, blank lines and ``#`` comments skipped."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ApiKeyFileError(f"serve.api_key_file: cannot read {p}: {e}") from None
    keys = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keys.append(line)
    return keys


class ApiKeys:
    """The accepted keys: ``keys`` (serve.api_keys) plus those of ``key_file``.

    ``enabled`` is True as soon as either is configured (a configured but empty file accepts
    no key at all rather than opening the server). Thread-safe: :meth:`reload` may run from
    a signal handler while requests are checked.
    """

    def __init__(self, keys: Iterable[str] = (), key_file: str | Path | None = None):
        self.static = [k for k in keys if k]
        self.key_file = Path(key_file) if key_file else None
        self.enabled = bool(self.static) or self.key_file is not None
        self._lock = threading.Lock()
        self._digests: tuple[bytes, ...] = ()
        self.n_file_keys = 0
        self.reload(strict=True)

    def reload(self, *, strict: bool = False) -> bool:
        """Read the key file again; returns False (and keeps the old keys) when it cannot be
        read, or raises ApiKeyFileError when ``strict`` (at start)."""
        file_keys: list[str] = []
        if self.key_file is not None:
            try:
                file_keys = read_key_file(self.key_file)
            except ApiKeyFileError as e:
                if strict:
                    raise
                log.error("api_keys_reload_failed", error=str(e))
                return False
        with self._lock:
            self._digests = tuple(_digest(k) for k in [*self.static, *file_keys])
            self.n_file_keys = len(file_keys)
        if self.enabled and not self._digests:
            log.warning("api_keys_empty", key_file=str(self.key_file), detail="no key is accepted")
        log.info("api_keys_loaded", keys=len(self._digests), from_file=len(file_keys),
                 key_file=str(self.key_file) if self.key_file else None)
        return True

    @property
    def count(self) -> int:
        return len(self._digests)

    def check(self, presented: str | None) -> bool:
        """True when ``presented`` is one of the keys (constant time in the key set)."""
        if presented is None:
            return False
        d = _digest(presented)
        with self._lock:
            digests = self._digests
        ok = False
        for k in digests:
            ok |= hmac.compare_digest(d, k)
        return ok


def is_loopback(host: str) -> bool:
    """True for a loopback bind address (127.0.0.0/8, ::1, localhost)."""
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def warn_if_open(host: str, keys: ApiKeys | None) -> bool:
    """Log a warning when binding ``host`` (not loopback) without API keys; returns True if so."""
    if (keys is None or not keys.enabled) and not is_loopback(host):
        log.warning("serve_without_api_keys", host=host,
                    detail="anyone who reaches this address can use the model: set serve.api_keys or "
                           "serve.api_key_file, or bind 127.0.0.1 behind a proxy")
        return True
    return False


def host_allowed(host_header: str, allowed: Iterable[str]) -> bool:
    """``host_header`` (``name[:port]``) against the allow-list: exact names, ``*.suffix``
    wildcards, or ``*`` for any."""
    host = host_header.strip().lower()
    if host.startswith("["):  # [v6]:port
        host = host[1:host.find("]")] if "]" in host else host
    elif host.count(":") == 1:
        host = host.rsplit(":", 1)[0]
    for a in allowed:
        a = a.strip().lower()
        if a == "*" or a == host or (a.startswith("*.") and host.endswith(a[1:])):
            return True
    return False


def _error(status: int, message: str, code: str, etype: str = "invalid_request_error",
           headers: list[tuple[bytes, bytes]] | None = None):
    body = json.dumps({"error": {"message": message, "type": etype, "param": None, "code": code}}).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *(headers or [])]
    return status, hdrs, body


class GuardMiddleware:
    """Host allow-list, API keys and the JSON Content-Type rule (see the module doc).

    ``keys``: ApiKeys or None (no keys: open); ``metrics_auth``: /metrics needs a key;
    ``allowed_hosts``: empty = any Host.
    """

    def __init__(self, app, *, keys: ApiKeys | None = None, metrics_auth: bool = False,
                 allowed_hosts: Iterable[str] = ()):
        self.app = app
        self.keys = keys
        self.metrics_auth = metrics_auth
        self.allowed_hosts = [h for h in allowed_hosts if h]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        refusal = None
        if self.allowed_hosts and path not in OPEN_PATHS and not host_allowed(headers.get("host", ""),
                                                                               self.allowed_hosts):
            refusal = _error(400, f"Host {headers.get('host', '')!r} is not in serve.allowed_hosts", "invalid_host")
        elif self._needs_key(path) and not self._key_ok(headers):
            missing = not headers.get("authorization") and not headers.get("x-api-key")
            msg = ("You didn't provide an API key. Send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'."
                   if missing else "Incorrect API key provided.")
            refusal = _error(401, msg, "invalid_api_key", headers=[(b"www-authenticate", b"Bearer")])
        elif scope.get("method") in ("POST", "PUT", "PATCH") and not _is_json(headers.get("content-type", "")):
            ct = headers.get("content-type") or "none"
            refusal = _error(415, f"Content-Type {ct!r} is not accepted: send the JSON body with "
                                  "'Content-Type: application/json'", "unsupported_media_type")
        if refusal is None:
            return await self.app(scope, receive, send)
        status, hdrs, body = refusal
        reason = json.loads(body)["error"]["code"]
        if is_anthropic_path(path):  # Anthropic's clients read their own envelope (moe_service.api.anthropic)
            body = json.dumps(error_body(status, json.loads(body)["error"]["message"])).encode()
            hdrs = [(k, str(len(body)).encode() if k == b"content-length" else v) for k, v in hdrs]
        log.info("request_refused", path=path, status=status, reason=reason)
        await send({"type": "http.response.start", "status": status, "headers": hdrs})
        await send({"type": "http.response.body", "body": body})

    def _key_ok(self, headers: dict[str, str]) -> bool:
        """A valid key in ``Authorization: Bearer`` (OpenAI clients) or ``x-api-key``
        (Anthropic clients): either admits the request."""
        bearer = _bearer(headers.get("authorization"))
        return self.keys.check(bearer) or self.keys.check(headers.get("x-api-key") or None)

    def _needs_key(self, path: str) -> bool:
        if self.keys is None or not self.keys.enabled or path in OPEN_PATHS:
            return False
        if path == "/metrics":
            return self.metrics_auth
        return True


def _bearer(value: str | None) -> str | None:
    if not value:
        return None
    scheme, _, token = value.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _is_json(content_type: str) -> bool:
    mt = content_type.split(";", 1)[0].strip().lower()
    return mt == "application/json" or (mt.startswith("application/") and mt.endswith("+json"))
