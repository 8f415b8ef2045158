"""Logging: structlog events with key=value fields, rendered for where stderr goes.

Targets (``[log] target``):

- ``console``: human-readable lines (the default on a TTY);
- ``json``: one JSON object per line on stderr (the default when piped);
- ``journald``: every event sent to journald's native socket with its fields as journal
  fields (``STAGE=fastload``, ``BYTES=...``, ``GBPS=...``), the level as ``PRIORITY`` and
  ``SYSLOG_IDENTIFIER=moe-service`` (the default when JOURNAL_STREAM says stderr is the journal).

Library code logs with ``log = get_logger(__name__)`` and ``log.info("event_name", key=value)``.
Standard-library loggers (uvicorn, numba warnings) are routed through the same renderer.
Exceptions travel as a field (``exception``), never as extra lines.
"""

from __future__ import annotations

import array
import errno
import json
import logging
import os
import re
import socket
import struct
import sys
from typing import Any

import structlog

IDENTIFIER = "moe-service"

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}

# syslog priorities (sd-daemon.h): 2 crit, 3 err, 4 warning, 6 info, 7 debug
_PRIORITY = {"critical": 2, "exception": 3, "error": 3, "warning": 4, "warn": 4, "info": 6, "debug": 7}

_FIELD_RE = re.compile(r"[^A-Z0-9_]")


def get_logger(name: str | None = None) -> Any:
    """A structlog logger; call ``.info("event", key=value, ...)`` on it."""
    return structlog.get_logger(name)


def stderr_is_journal() -> bool:
    """True when JOURNAL_STREAM (set by systemd, ``dev:inode``) matches our stderr."""
    value = os.environ.get("JOURNAL_STREAM", "")
    try:
        dev, ino = (int(x) for x in value.split(":"))
        st = os.fstat(sys.stderr.fileno())
    except (ValueError, OSError, AttributeError):
        return False
    return st.st_dev == dev and st.st_ino == ino


def choose_target(target: str) -> str:
    """Resolve ``auto`` to journald / console / json for this process."""
    if target != "auto":
        return target
    if stderr_is_journal():
        return "journald"
    try:
        if sys.stderr.isatty():
            return "console"
    except (AttributeError, ValueError):
        pass
    return "json"


# ---------------------------------------------------------------------------------------------
# journald native protocol (systemd.journal-fields(7), "Native Journal Protocol")


def journal_field_name(key: str) -> str:
    """A structlog key as a journal field name: upper case, [A-Z0-9_], not starting with `_`
    or a digit (those are reserved/invalid)."""
    name = _FIELD_RE.sub("_", key.upper()).lstrip("_")
    if not name or name[0].isdigit():
        name = "F_" + name
    return name[:64]


def encode_journal_fields(fields: dict[str, Any]) -> bytes:
    """Serialise fields in journald's native datagram format.

    Each field is ``NAME=value\\n``; a value containing a newline is written as ``NAME\\n``,
    its length as a little-endian u64, the bytes, then ``\\n``.
    """
    out = bytearray()
    for key, value in fields.items():
        data = value if isinstance(value, bytes) else str(value).encode("utf-8", "replace")
        name = key.encode("ascii")
        if b"\n" in data:
            out += name + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
        else:
            out += name + b"=" + data + b"\n"
    return bytes(out)


class JournalSender:
    """Sends field sets to journald's socket (AF_UNIX datagram).

    Messages too large for one datagram go through a sealed memfd passed with SCM_RIGHTS, as
    sd_journal_send does. When the socket is unreachable, falls back to one ``<N>``-prefixed
    line on stderr (journald's stream protocol reads the prefix as the priority).
    """

    def __init__(self, path: str):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)

    def send(self, fields: dict[str, Any]) -> None:
        payload = encode_journal_fields(fields)
        try:
            self.sock.sendto(payload, self.path)
        except OSError as e:
            if e.errno in (errno.EMSGSIZE, errno.ENOBUFS):
                try:
                    self._send_memfd(payload)
                    return
                except OSError:
                    pass
            prio = fields.get("PRIORITY", 6)
            sys.stderr.write(f"<{prio}>{fields.get('MESSAGE', '')}\n")

    def _send_memfd(self, payload: bytes) -> None:
        fd = os.memfd_create("journal-message", os.MFD_ALLOW_SEALING)
        try:
            os.write(fd, payload)
            import fcntl

            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL)
            rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
            self.sock.sendmsg([b""], rights, 0, self.path)
        finally:
            os.close(fd)


def event_to_journal_fields(event_dict: dict[str, Any]) -> dict[str, Any]:
    """A structlog event dict as journal fields: MESSAGE (the event plus key=value pairs, for
    humans), PRIORITY, SYSLOG_IDENTIFIER, one field per key, EXCEPTION with the traceback."""
    ed = dict(event_dict)
    level = str(ed.pop("level", "info")).lower()
    event = str(ed.pop("event", ""))
    ed.pop("timestamp", None)
    fields: dict[str, Any] = {}
    pairs = " ".join(f"{k}={_short(v)}" for k, v in ed.items() if k not in ("exception", "logger"))
    fields["MESSAGE"] = f"{event} {pairs}".strip()
    fields["PRIORITY"] = _PRIORITY.get(level, 6)
    fields["SYSLOG_IDENTIFIER"] = IDENTIFIER
    fields["EVENT"] = event
    for key, value in ed.items():
        name = journal_field_name(key)
        if name in ("MESSAGE", "PRIORITY", "SYSLOG_IDENTIFIER", "EVENT"):
            name = "F_" + name
        fields[name] = value if isinstance(value, str | bytes | int | float) else json.dumps(value, default=str)
    return fields


def _short(v: Any) -> str:
    s = v if isinstance(v, str) else json.dumps(v, default=str)
    return s if " " not in s else json.dumps(s)


class JournaldHandler(logging.Handler):
    """A logging handler that sends each record to journald with its fields."""

    def __init__(self, path: str):
        super().__init__()
        self.sender = JournalSender(path)
        self.pre_chain = _shared_processors()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if isinstance(record.msg, dict):  # from structlog (wrap_for_formatter)
                ed = dict(record.msg)
            else:  # a foreign stdlib record (uvicorn, numba, ...)
                ed = {"event": record.getMessage(), "logger": record.name}
                ed.setdefault("level", record.levelname.lower())
                for proc in self.pre_chain:
                    ed = proc(None, record.levelname.lower(), ed)
            ed.setdefault("level", record.levelname.lower())
            if record.exc_info and "exception" not in ed:
                ed["exception"] = logging.Formatter().formatException(record.exc_info)
            self.sender.send(event_to_journal_fields(ed))
        except Exception:  # logging must never take the service down
            self.handleError(record)


def _shared_processors() -> list:
    return [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]


def configure_logging(level: str = "info", target: str = "auto", journal_socket: str = "/run/systemd/journal/socket") -> str:
    """Configure structlog and the stdlib root logger. Returns the resolved target.

    ``level``: debug/info/warning/error; ``target``: auto/console/json/journald (see module doc).
    Safe to call again (tests, config reload): handlers are replaced, not added.
    """
    resolved = choose_target(target)
    shared = _shared_processors()
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    if resolved == "journald":
        handler: logging.Handler = JournaldHandler(journal_socket)
    else:
        if resolved == "console":
            renderer = structlog.dev.ConsoleRenderer(colors=_colors_ok())
        else:
            renderer = structlog.processors.JSONRenderer(default=str)
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(
            structlog.stdlib.ProcessorFormatter(
                foreign_pre_chain=[*shared, structlog.processors.format_exc_info],
                processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
            )
        )
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(_LEVELS[level])
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.handlers.clear()
        lg.propagate = True
    logging.getLogger("numba").setLevel(max(logging.WARNING, _LEVELS[level]))
    return resolved


def _colors_ok() -> bool:
    try:
        return sys.stderr.isatty() and os.environ.get("NO_COLOR") is None
    except (AttributeError, ValueError):
        return False
