"""Logging: journald native fields read back from a socket bound by the test; JSON lines."""

from __future__ import annotations

import json
import logging
import os
import struct
import subprocess
import sys
import tempfile
import time

import pytest

from bench.datagram import DatagramSink
from moe_service.log import configure_logging, encode_journal_fields, get_logger
from tests.conftest import REPO


def parse_journal(data: bytes) -> dict[str, bytes]:
    """Decode journald's native format (the inverse of encode_journal_fields)."""
    out, i = {}, 0
    while i < len(data):
        nl = data.index(b"\n", i)
        line = data[i:nl]
        if b"=" in line:
            k, v = line.split(b"=", 1)
            out[k.decode()] = v
            i = nl + 1
        else:
            (n,) = struct.unpack("<Q", data[nl + 1 : nl + 9])
            out[line.decode()] = data[nl + 9 : nl + 9 + n]
            assert data[nl + 9 + n : nl + 10 + n] == b"\n"
            i = nl + 10 + n
    return out


@pytest.fixture
def journal():
    d = tempfile.mkdtemp(prefix="journal-")
    path = os.path.join(d, "socket")
    sink = DatagramSink(path)
    yield path, sink
    sink.close()
    os.unlink(path)
    os.rmdir(d)
    configure_logging("info", "json")


def test_journald_fields_and_priority(journal):
    path, sink = journal
    configure_logging("debug", "journald", path)
    get_logger("t").info("fastload_progress", stage="fastload", bytes=123, gbps=3.2)
    get_logger("t").warning("numa_balancing_on", node=1)
    assert sink.wait_for("numa_balancing_on")
    first, second = (parse_journal(m) for _, m in sink.messages)
    assert first["PRIORITY"] == b"6" and second["PRIORITY"] == b"4"
    assert first["SYSLOG_IDENTIFIER"] == b"moe-service"
    assert first["STAGE"] == b"fastload" and first["BYTES"] == b"123" and first["GBPS"] == b"3.2"
    assert first["EVENT"] == b"fastload_progress"
    assert first["MESSAGE"].startswith(b"fastload_progress ")
    assert second["NODE"] == b"1"


def test_journald_exception_is_one_field_with_newlines(journal):
    path, sink = journal
    configure_logging("info", "journald", path)
    try:
        raise ValueError("boom")
    except ValueError:
        get_logger("t").exception("stage_failed", stage="warmup")
    assert sink.wait_for("stage_failed")
    (fields,) = (parse_journal(m) for _, m in sink.messages)
    assert fields["PRIORITY"] == b"3"
    assert b"Traceback" in fields["EXCEPTION"] and b"ValueError: boom" in fields["EXCEPTION"]


def test_stdlib_records_reach_the_journal(journal):
    path, sink = journal
    configure_logging("info", "journald", path)
    logging.getLogger("uvicorn.error").info("Uvicorn running on %s", "http://127.0.0.1:8000")
    assert sink.wait_for("Uvicorn running")
    (fields,) = (parse_journal(m) for _, m in sink.messages)
    assert fields["PRIORITY"] == b"6" and fields["LOGGER"] == b"uvicorn.error"


def test_large_message_goes_through_memfd(journal):
    path, sink = journal
    configure_logging("info", "journald", path)
    get_logger("t").info("big_event", blob="x" * 400_000)
    # Too big for one datagram: it goes as an empty datagram carrying a memfd (journald reads
    # the fd). The sink sees the empty datagram: not dropped, not written to stderr instead.
    deadline = time.monotonic() + 3
    while not sink.messages and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [m for _, m in sink.messages] == [b""]


def test_encode_binary_safe_values():
    data = encode_journal_fields({"A": "x", "B": "line1\nline2"})
    assert parse_journal(data) == {"A": b"x", "B": b"line1\nline2"}


def test_json_lines_one_event_per_line():
    code = (
        "from moe_service.log import configure_logging, get_logger\n"
        "configure_logging('info', 'json')\n"
        "log = get_logger('x')\n"
        "log.info('stage_done', stage='fastload', seconds=1.5)\n"
        "try:\n    1/0\nexcept ZeroDivisionError:\n    log.exception('boom', stage='x')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 2, r.stderr
    a, b = (json.loads(x) for x in lines)
    assert a["event"] == "stage_done" and a["stage"] == "fastload" and a["level"] == "info"
    assert b["level"] == "error" and "ZeroDivisionError" in b["exception"]


def test_auto_target_picks_journald_when_stderr_is_the_journal(tmp_path):
    code = "from moe_service.log import choose_target; print(choose_target('auto'))"
    err = tmp_path / "stderr"
    with err.open("w") as f:
        st = os.fstat(f.fileno())
        env = dict(os.environ, JOURNAL_STREAM=f"{st.st_dev}:{st.st_ino}")
        r = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=f, text=True, env=env, cwd=REPO)
    assert r.stdout.strip() == "journald"
    env = dict(os.environ, JOURNAL_STREAM="1:2")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO)
    assert r.stdout.strip() == "json"
